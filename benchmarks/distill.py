"""On-policy distillation from a stronger teacher beside continued SFT, OPSD and TRL's GKD, on the tiny default.

Teachers: the shipped default model (held out 0.450) after 150 and after 300 steps of `+algo=sft` at its
default learning rate (`--teacher-steps`), exported and kept under `--keep`. Student: the shipped default.
Every row trains `--steps` steps of 32 prompts, 2 ranks (`torchrun --standalone --nproc_per_node=2`):

- `distill-tN`: `+algo=distill algo.teacher_path=<teacher after N steps>` (defaults: lmbda 1, beta 0.5,
  temperature 1.1, top-p 0.95);
- `sft`: continued `+algo=sft` of the student on the gold solutions;
- `opsd`: `+algo=opsd`, the student's own weights as teacher, shown the reference;
- `gkd-tN`: TRL's `GKDTrainer` (`trl.experimental.gkd`) in one process, 32 prompts per step, lmbda 1, the
  same beta, teacher, prompt ids (our student prompts), sampling temperature and top-p, AdamW betas,
  warm-up and cosine-to-0.1x schedule and gradient clip. Its loss divides no logits by the temperature
  (GKD's own choice); ours divides both sides by it.

Phases: `sweep` runs every row at each learning rate of `--lrs` with seed 0 (and one more step of the 1-3-10
grid past an edge where a row's best rate lies, up to two); `seeds` runs every row at its best swept learning
rate (the highest final accuracy; ties to the lower rate) with `--seeds`. Held-out
accuracy: the trainer's greedy evals every `--eval-every` steps (n = `--eval-examples`), and at the end
per-question outcomes of every row's final model, scored the same way for all rows (transformers' greedy
`generate` on the student prompts, our verifier), for the paired comparison.

Every finished run writes `docs/results/distill/ROW-lrLR-sSEED.json` (`--results DIR` elsewhere) with its
command and commit; a restarted benchmark skips finished runs, so the runs accumulate across sessions.
`docs/results/distill.md` is rendered from every file there after each run; `--render` only rewrites it.

    nohup timeout 3600 python benchmarks/distill.py > /tmp/distill.log 2>&1 &       # sweep, then seeds
    python benchmarks/distill.py --steps 4 --eval-every 2 --eval-examples 8 --lrs 1e-4 --seeds 0 \
        --teacher-steps 4 --results /tmp/dres --keep /tmp/dkeep                       # a smoke run
    python benchmarks/distill.py --render
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULTS = os.path.join(ROOT, "docs", "results", "distill")
KEEP = os.path.join(ROOT, "outputs", "bench_distill")
BATCH = 32


def row_algo(row: str) -> tuple[str, int | None]:
    """'distill-t300' -> ('distill', 300); 'sft' -> ('sft', None)."""
    name, _, teacher = row.partition("-t")
    return name, int(teacher) if teacher else None


def common(args, seed: int, out: str, steps: int | None = None, eval_every: int | None = None) -> list[str]:
    steps = steps or args.steps
    return [f"seed={seed}", f"output_dir={out}", f"trainer.max_steps={steps}", f"trainer.batch_size={BATCH}",
            f"trainer.eval_every={eval_every or args.eval_every}", f"trainer.save_every={steps}",
            f"trainer.eval_examples={args.eval_examples}", "trainer.resume=never", "logging.wandb=false",
            "logging.progress=false"]


def train(argv: list[str], out: str, ranks: int) -> tuple[float, list[dict]]:
    """One `train.py` run into `out` (started over when unfinished); wall seconds and its metric lines."""
    done = os.path.join(out, "wall_s")
    if not os.path.exists(done):
        shutil.rmtree(out, ignore_errors=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // ranks)), WANDB_MODE="disabled")
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                  if ranks > 1 else [sys.executable])
        started = time.perf_counter()
        proc = subprocess.run([*launch, os.path.join(ROOT, "train.py"), *argv], env=env, capture_output=True,
                              text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"train.py {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(done, "w") as fh:  # written last: the run finished
            fh.write(str(time.perf_counter() - started))
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return float(open(done).read()), lines


def outcomes(model_dir: str, n: int, max_new_tokens: int) -> list[bool]:
    """Per held-out question (the first n of the test split): is the greedy answer of `model_dir` right?
    transformers' `generate` on our student prompt ids, our verifier -- the same scorer for every row."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from algorithms.rollouts import encode_prompt

    task, _ = _task()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = list(task.test_examples())[:n]
    right = []
    with torch.no_grad():
        for start in range(0, len(examples), 32):
            chunk = examples[start:start + 32]
            ids = [encode_prompt(tok, task.prompt(ex)) for ex in chunk]
            width = max(map(len, ids))
            pad = tok.pad_token_id
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
            attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            out = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id)
            for ex, row in zip(chunk, out[:, width:]):
                right.append(bool(task.verify(ex, tok.decode(row, skip_special_tokens=True)).correct))
    return right


def _task():
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.setup import build_task_from
    from trainer.warm_start import ensure

    cfg = load_config(["+algo=sft"], config_schemas())
    path = ensure(cfg.model, World())
    return build_task_from(cfg.data, cfg.model), path


def teacher(args, steps: int) -> dict:
    """The SFT teacher after `steps` steps (2 ranks, its defaults), exported under --keep; its record."""
    out = os.path.join(args.keep, f"teacher-{steps}")
    argv = ["+algo=sft", *common(args, 0, out, steps, steps)]
    wall, lines = train(argv, out, 2)
    evals = [x for x in lines if x["split"] == "eval"]
    return {"path": os.path.join(out, "final"), "steps": steps, "before": evals[0]["accuracy"],
            "accuracy": evals[-1]["accuracy"], "wall_s": wall, "command": "torchrun --standalone --nproc_per_node=2 "
            f"train.py {' '.join(a for a in argv if not a.startswith('output_dir='))}"}


def record_path(args, row: str, lr: float, seed: int) -> str:
    return os.path.join(args.results, f"{row}-lr{lr:g}-s{seed}.json")


def run(args, row: str, lr: float, seed: int, teachers: dict) -> dict:
    """One row at one learning rate and seed (skipped when its result file is there)."""
    path = record_path(args, row, lr, seed)
    if os.path.exists(path):
        earlier = json.load(open(path))
        if earlier.get("steps") == args.steps and earlier.get("eval_examples") == args.eval_examples:
            print(f"  {row} lr {lr:g} seed {seed}: done earlier ({path})", flush=True)
            return earlier
    algo, teacher_steps = row_algo(row)
    t = teachers[teacher_steps] if teacher_steps else None
    out = os.path.join(args.keep, f"{row}-lr{lr:g}-s{seed}-{args.steps}")
    if algo == "gkd":
        result = gkd(args, t, lr, seed, out)
    else:
        argv = [f"+algo={algo}", *common(args, seed, out), f"trainer.lr={lr}",
                *([f"algo.teacher_path={t['path']}"] if t else [])]
        wall, lines = train(argv, out, 2)
        evals = [x for x in lines if x["split"] == "eval"]
        result = {"wall_s": wall, "curve": [(x["step"], x["accuracy"]) for x in evals],
                  "command": "torchrun --standalone --nproc_per_node=2 train.py " + " ".join(
                      a.replace(t["path"], f"<teacher-{teacher_steps}>") if t else a
                      for a in argv if not a.startswith("output_dir="))}
        if any("distill/teacher_accuracy" in x for x in evals):
            result["teacher_accuracy_extra"] = evals[0]["distill/teacher_accuracy"]
        result["outcomes"] = outcomes(os.path.join(out, "final"), args.eval_examples, args.max_new_tokens)
    from benchmarks.results_io import provenance, write_files

    result.update(row=row, algo=algo, lr=lr, seed=seed, steps=args.steps, eval_examples=args.eval_examples,
                  teacher=({"steps": teacher_steps, "accuracy": t["accuracy"], "command": t["command"]} if t else None),
                  final=sum(result["outcomes"]) / len(result["outcomes"]), meta=provenance())
    write_files(args.results, {os.path.basename(path): json.dumps(result, indent=1)})
    print(f"  {row} lr {lr:g} seed {seed}: {result['curve'][0][1]:.3f} -> {result['final']:.3f} "
          f"({result['wall_s']:.0f}s)", flush=True)
    render(args.results)
    return result


def gkd(args, t: dict, lr: float, seed: int, out: str) -> dict:
    """TRL's GKDTrainer on the same work, in a child process (its memory and threads its own)."""
    os.makedirs(out, exist_ok=True)
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as fh:
        json.dump({"teacher": t["path"], "lr": lr, "seed": seed, "steps": args.steps, "eval_every": args.eval_every,
                   "eval_examples": args.eval_examples, "max_new_tokens": args.max_new_tokens, "out": out}, fh)
    started = time.perf_counter()
    log = os.path.join(out, "child.log")  # its progress (an eval line every --eval-every steps): tail -f it
    print(f"  {os.path.basename(out)}: TRL GKD running, progress in {log}", flush=True)
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--gkd-child", spec], stdout=fh,
                              stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if proc.returncode != 0:
        raise SystemExit(f"TRL GKD lr {lr} seed {seed} failed (exit {proc.returncode}):\n{open(log).read()[-3000:]}")
    result = json.load(open(os.path.join(out, "result.json")))
    result["wall_s"] = time.perf_counter() - started
    result["command"] = (f"python benchmarks/distill.py (TRL {result.pop('trl')} GKDTrainer, one process: lmbda 1, "
                         f"beta 0.5, temperature 1.1, top-p 0.95, lr {lr:g}, {args.steps} steps x {BATCH} prompts)")
    return result


def gkd_child(spec_path: str) -> None:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from algorithms import config_schemas
    from algorithms.rollouts import encode, encode_prompt
    from trainer.config import load_config

    spec = json.load(open(spec_path))
    torch.set_num_threads(2)
    random.seed(spec["seed"])
    torch.manual_seed(spec["seed"])
    task, path = _task()
    c = load_config(["+algo=distill", f"algo.teacher_path={spec['teacher']}"], config_schemas())
    tok = AutoTokenizer.from_pretrained(path)
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32)
    train = list(task.train_examples())
    data = Dataset.from_dict({"prompt_ids": [encode_prompt(tok, task.prompt(ex)) for ex in train],
                              "solution_ids": [encode(tok, ex.solution) + [tok.eos_token_id] for ex in train]})

    def collate(rows):  # our prompt ids (left-padded for generate) and the gold completion (unused at lmbda 1)
        pad = tok.pad_token_id
        width = max(len(r["prompt_ids"]) for r in rows)
        prompts = torch.tensor([[pad] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in rows])
        pmask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in rows])
        full = [r["prompt_ids"] + r["solution_ids"] for r in rows]
        w2 = max(map(len, full))
        ids = torch.tensor([x + [pad] * (w2 - len(x)) for x in full])
        attn = torch.tensor([[1] * len(x) + [0] * (w2 - len(x)) for x in full])
        labels = ids.clone()
        labels[attn == 0] = -100
        for i, r in enumerate(rows):
            labels[i, :len(r["prompt_ids"])] = -100
        return {"input_ids": ids, "attention_mask": attn, "labels": labels, "prompts": prompts,
                "prompt_attention_mask": pmask}

    curve: list = []

    def evaluate(step: int) -> None:
        student.eval()
        student.save_pretrained(os.path.join(spec["out"], "eval"))
        tok.save_pretrained(os.path.join(spec["out"], "eval"))
        right = outcomes(os.path.join(spec["out"], "eval"), spec["eval_examples"], spec["max_new_tokens"])
        student.train()
        curve.append((step, sum(right) / len(right)))
        print(f"trl gkd step {step}: held out {curve[-1][1]:.3f}", flush=True)
        return right

    class Evals(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % spec["eval_every"] == 0 and state.global_step < spec["steps"]:
                evaluate(state.global_step)

    t = c.trainer
    targs = GKDConfig(
        output_dir=os.path.join(spec["out"], "trl"), max_steps=spec["steps"], per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1, learning_rate=spec["lr"], adam_beta1=t.betas[0], adam_beta2=t.betas[1],
        weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio}, max_grad_norm=t.max_grad_norm,
        lmbda=1.0, beta=c.algo.beta, temperature=c.algo.temperature, max_new_tokens=spec["max_new_tokens"],
        seed=spec["seed"], report_to="none", logging_steps=10, save_strategy="no", use_cpu=True, bf16=False)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=targs, train_dataset=data, data_collator=collate,
                         processing_class=tok, callbacks=[Evals()])
    trainer.generation_config.top_p = c.algo.top_p  # ours samples with top-p; GKD's default is 1.0
    trainer.generation_kwargs["top_p"] = c.algo.top_p
    evaluate(0)
    trainer.train()
    right = evaluate(spec["steps"])
    with open(os.path.join(spec["out"], "result.json"), "w") as fh:
        json.dump({"curve": curve, "outcomes": right, "trl": trl.__version__}, fh)


def best_lr(results: list[dict], row: str) -> float | None:
    """The swept learning rate of `row` with the highest seed-0 final accuracy (ties: the lower rate)."""
    swept = [r for r in results if r["row"] == row and r["seed"] == 0]
    return min(swept, key=lambda r: (-r["final"], r["lr"]))["lr"] if swept else None


def edge_step(results: list[dict], row: str) -> float | None:
    """The next rate of the 1-3-10 grid past the swept edge where `row`'s best seed-0 rate lies (None inside)."""
    swept = sorted({r["lr"] for r in results if r["row"] == row and r["seed"] == 0})
    best = best_lr(results, row)
    if best is None or len(swept) < 2 or swept[0] < best < swept[-1]:
        return None
    up = best == swept[-1]
    digit = f"{best:.0e}"[0]
    factor = (3.0 if digit == "1" else 10 / 3) if up else (1 / 3 if digit == "3" else 0.3)
    return float(f"{best * factor:.0e}")


def load(results_dir: str) -> list[dict]:
    if not os.path.isdir(results_dir):
        return []
    return [json.load(open(os.path.join(results_dir, f))) for f in sorted(os.listdir(results_dir))
            if f.endswith(".json")]


def paired(a: list[list[bool]], b: list[list[bool]], draws: int = 10000) -> tuple[float, float, float]:
    """Mean difference a - b in accuracy (per question: the mean over seeds) with a 95% bootstrap interval
    over questions (paired: the same questions on both sides)."""
    qa = [statistics.fmean(x) for x in zip(*a)]
    qb = [statistics.fmean(x) for x in zip(*b)]
    diff = [x - y for x, y in zip(qa, qb)]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(diff, k=len(diff))) for _ in range(draws))
    return statistics.fmean(diff), means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def render(results_dir: str) -> str:
    from benchmarks.results_io import runs_by_commit, write_files

    results = load(results_dir)
    if not results:
        return ""
    rows = sorted({r["row"] for r in results}, key=lambda x: (row_algo(x)[0], row_algo(x)[1] or 0))
    lrs = sorted({r["lr"] for r in results})
    teachers = {r["teacher"]["steps"]: r["teacher"] for r in results if r.get("teacher")}
    steps = {r["steps"] for r in results}
    lines = ["# Distillation from a stronger teacher beside SFT, OPSD and TRL's GKD (generated by benchmarks/distill.py)",
             "", f"Tiny default student (held out {results[0]['curve'][0][1]:.3f} at step 0), {'/'.join(map(str, steps))} "
             f"steps x {BATCH} prompts, n = {results[0]['eval_examples']} held-out questions (final: each model's "
             "greedy answers scored by transformers' `generate` + our verifier). Teachers: " +
             "; ".join(f"`t{k}` = {k} steps of `+algo=sft` (held out {v['accuracy']:.3f})" for k, v in sorted(teachers.items())) +
             f". Wall time: one run on this machine's 2 cores (2 ranks; TRL one process of 2 threads).", "",
             "## Learning-rate sweep (seed 0, final held-out accuracy)", "",
             "| row | " + " | ".join(f"lr {x:g}" for x in lrs) + " | best |", "|---|" + "---|" * (len(lrs) + 1)]
    for row in rows:
        cells = []
        for lr in lrs:
            r = [x for x in results if x["row"] == row and x["lr"] == lr and x["seed"] == 0]
            cells.append(f"{r[0]['final']:.3f}" if r else "")
        best = best_lr(results, row)
        lines.append(f"| {row} | " + " | ".join(cells) + (f" | {best:g} |" if best is not None else " | |"))
    lines += ["", "## At each row's best learning rate (mean ± std over seeds)", "",
              "| row | lr | seeds | final | per seed | curve (step: mean accuracy) | wall s / run |",
              "|---|---|---|---|---|---|---|"]
    at_best = {}
    for row in rows:
        lr = best_lr(results, row)
        rs = sorted([x for x in results if x["row"] == row and x["lr"] == lr], key=lambda x: x["seed"])
        if not rs:
            continue
        at_best[row] = rs
        finals = [x["final"] for x in rs]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        curve = {}
        for x in rs:
            for s, a in x["curve"]:
                curve.setdefault(s, []).append(a)
        lines.append(f"| {row} | {lr:g} | {len(rs)} | {statistics.fmean(finals):.3f} ± {sd:.3f} | "
                     f"{', '.join(f'{f:.3f}' for f in finals)} | "
                     f"{', '.join(f'{s}: {statistics.fmean(v):.3f}' for s, v in sorted(curve.items()))} | "
                     f"{statistics.fmean(x['wall_s'] for x in rs):.0f} |")
    pairs = [(a, b) for a in at_best for b in at_best if row_algo(a)[0] == "distill" and row_algo(b)[0] != "distill"]
    pairs += [(a, b) for a in at_best for b in at_best if a.startswith("distill-t") and b == "gkd-" + a.split("-")[1]]
    if pairs:
        lines += ["", "## Paired differences (seeds both sides ran; 95% bootstrap interval over questions)", "",
                  "| A − B | seeds | difference | interval |", "|---|---|---|---|"]
        for a, b in dict.fromkeys(pairs):
            seeds = sorted({x["seed"] for x in at_best[a]} & {x["seed"] for x in at_best[b]})
            if not seeds:
                continue
            pick = lambda rs: [x["outcomes"] for x in sorted(rs, key=lambda x: x["seed"]) if x["seed"] in seeds]  # noqa: E731
            d, lo, hi = paired(pick(at_best[a]), pick(at_best[b]))
            lines.append(f"| {a} − {b} | {len(seeds)} | {d:+.3f} | [{lo:+.3f}, {hi:+.3f}] |")
    lines += ["", "Commands (each row's best rate, seed 0): " + "; ".join(
                  f"`{r['command']}`" for row in rows for r in results
                  if r["row"] == row and r["seed"] == 0 and r["lr"] == best_lr(results, row)), ""]
    lines += runs_by_commit(results, lambda r: f"{r['row']} lr {r['lr']:g} s{r['seed']}")
    text = "\n".join(lines) + "\n"
    write_files(os.path.dirname(results_dir.rstrip("/")), {os.path.basename(results_dir.rstrip("/")) + ".md": text})
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--teacher-steps", default="150,300")
    ap.add_argument("--rows", default="distill-t300,sft,opsd,gkd-t300,distill-t150")
    ap.add_argument("--lrs", default="3e-5,1e-4,3e-4,1e-3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--phases", default="sweep,seeds")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--keep", default=KEEP, help="teachers and runs (kept: a restart reuses them)")
    ap.add_argument("--render", action="store_true")
    ap.add_argument("--gkd-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gkd_child:
        gkd_child(args.gkd_child)
        return
    if args.render:
        print(render(args.results))
        return
    os.makedirs(args.keep, exist_ok=True)
    rows = args.rows.split(",")
    teachers = {}
    for n in sorted({row_algo(r)[1] for r in rows if row_algo(r)[1]}):
        teachers[n] = teacher(args, n)
        print(f"teacher t{n}: {teachers[n]['before']:.3f} -> {teachers[n]['accuracy']:.3f}", flush=True)
    lrs = [float(x) for x in args.lrs.split(",")]
    if "sweep" in args.phases:
        for row in rows:
            for lr in lrs:
                run(args, row, lr, 0, teachers)
            for _ in range(2):  # a best rate at the grid's edge is no best: one more step of the grid past it
                lr = edge_step(load(args.results), row)
                if lr is None:
                    break
                run(args, row, lr, 0, teachers)
    if "seeds" in args.phases:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for row in rows:
                lr = best_lr(load(args.results), row)
                if lr is not None:
                    run(args, row, lr, seed, teachers)
    print(render(args.results))


if __name__ == "__main__":
    main()
