"""Speculative decoding on a SEED-trained tiny-but-deep model, side by side in one run.

The target is deep (`--layers`, default 12) and competent: by default the embedded 4-layer warm
start deepened by identity blocks (`build_upscaled`: same function and accuracy, the cost of 12
layers per token); `--target warm` instead warm-starts a 12-layer tiny model from scratch (weak at
affordable CPU budgets: 0.04 held-out accuracy after 150 steps). It is then fine-tuned with
`+algo=seed` (`--seed-steps`, cached in `--workdir`), or pass `--model DIR` of a SEED-trained
export. Compared on the same held-out `arith` prompts:

  plain      our engine, one token per forward (the baseline);
  seed       self-speculative SEED drafting with the model's top layers, as exported
             (seed_drafter.json: confidence-based draft length by default);
  seed_k     the same drafter with a fixed draft length (`--fixed-k`, default 6);
  external   a classic two-model setup: a 4-layer tiny model warm-started like the default one but
             from another seed (`--drafter-seed`), so it is not the target's own source;
  hf-assist  HF `generate(assistant_model=...)` with the same small drafter (batch 1 only);

at batch 1 and 8, greedy and temperature 1: tokens/s, mean tokens per verify forward (accepted
drafts + 1), speedup over plain. The variants of one setting run round-robin `--repeats` times
and each keeps its fastest pass, so a slow spell of the machine hits them alike. Also: held-out
greedy accuracy of the model before and after SEED fine-tuning (it must not drop), from the
training run's own evals. One thread; last line JSON, also written to docs/results/speculative.json, with
the table in docs/results/speculative.md.

    python benchmarks/speculative.py                     # build + SEED-train (cached runs reused)
    python benchmarks/speculative.py --model outputs/seed/final --prompts 16
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def deep_overrides(args) -> list[str]:
    if args.target == "upscaled":
        return ["model=hf", f"model.path={upscaled_dir(args)}"]
    return ["model=tiny", f"model.num_layers={args.layers}", f"model.warm_start_steps={args.warm_steps}"]


def upscaled_dir(args) -> str:
    return os.path.join(args.workdir, f"upscaled-l{args.layers}")


def build_upscaled(source_dir: str, layers: int, out_dir: str) -> None:
    """Deepen a trained model without changing its function (depth up-scaling with identity
    blocks): source layer j becomes layer (j + 1) * r - 1 of the deep model (r = layers / source
    layers), and every other layer is a fresh block whose output projections (o_proj, down_proj)
    are zero, so it adds nothing to the residual stream until training moves it. The deep model
    costs `layers` full decoder layers per token and starts exactly as accurate as the source."""
    import torch

    from models.loading import load_pretrained

    source, tokenizer = load_pretrained(source_dir)
    n = source.config.num_hidden_layers
    if layers % n:
        raise SystemExit(f"--layers {layers} must be a multiple of the source model's {n} layers")
    ratio = layers // n
    config = copy.deepcopy(source.config)
    config.num_hidden_layers = layers
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    deep = type(source)(config)
    state = deep.state_dict()
    for key, value in source.state_dict().items():
        if key.startswith("model.layers."):
            j, rest = key[len("model.layers."):].split(".", 1)
            key = f"model.layers.{(int(j) + 1) * ratio - 1}.{rest}"
        state[key] = value.clone()
    for i in range(layers):
        if (i + 1) % ratio:
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.{name}.{kind}"
                    if key in state:
                        state[key] = torch.zeros_like(state[key])
    deep.load_state_dict(state)
    deep.eval()
    ids = torch.randint(2, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(deep(ids).logits, source.eval()(ids).logits, atol=1e-4, rtol=1e-4)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    deep.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)


def seed_model(args) -> tuple[str, dict]:
    """A SEED-trained export of the deep warm-started model (trained once into --workdir), and the
    held-out evals of that run (step 0 = the warm start, last = after SEED)."""
    name = (f"seed-up{args.layers}-s{args.seed_steps}" if args.target == "upscaled"
            else f"seed-l{args.layers}-w{args.warm_steps}-s{args.seed_steps}") + f"-lr{args.seed_lr:g}"
    if args.extra:  # a different training recipe is a different cached run
        name += "-" + hashlib.sha256(" ".join(args.extra).encode()).hexdigest()[:8]
    out = os.path.join(args.workdir, name)
    final = os.path.join(out, "final")
    if not os.path.exists(os.path.join(final, "seed_drafter.json")):
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "+algo=seed", *deep_overrides(args),
               f"trainer.max_steps={args.seed_steps}", f"trainer.eval_every={args.seed_steps}",
               f"trainer.save_every={args.seed_steps}", f"trainer.eval_examples={args.eval_examples}",
               f"trainer.lr={args.seed_lr}", "trainer.resume=never", "logging.wandb=false", "logging.progress=false",
               f"output_dir={out}", *args.extra]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.train_threads), WANDB_MODE="disabled")
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"SEED training failed:\n{proc.stderr[-3000:]}")
        print(f"SEED fine-tuning ({args.seed_steps} steps) in {time.perf_counter() - started:.0f}s", flush=True)
    evals = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"eval"' in x]
    return final, {"before": evals[0], "after": evals[-1]}


def timed_round_robin(fns: dict, repeats: int) -> dict:
    """{name: (fastest seconds, last output)}, running the variants in turn `repeats` times."""
    best = {name: (float("inf"), None) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - start
            best[name] = (min(best[name][0], seconds), out)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a SEED-trained export (default: build and train one)")
    ap.add_argument("--target", choices=("upscaled", "warm"), default="upscaled",
                    help="upscaled: the default 4-layer warm start deepened to --layers with identity blocks; "
                         "warm: a --layers-deep tiny model warm-started from scratch for --warm-steps")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--warm-steps", type=int, default=150, help="--target warm: SFT warm-start steps")
    ap.add_argument("--drafter-seed", type=int, default=1,
                    help="seed of the external drafter's warm start (the default 4-layer tiny model)")
    ap.add_argument("--seed-steps", type=int, default=300)
    ap.add_argument("--seed-lr", type=float, default=3e-4,
                    help="SEED's lr (its tiny-model value; model.path would otherwise give the pretrained 1e-5)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fixed-k", type=int, default=6, help="draft length of the fixed-length SEED variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the decoding comparison")
    ap.add_argument("--train-threads", type=int, default=2, help="threads of the SEED training run")
    ap.add_argument("--eval-examples", type=int, default=100)
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/posttrain/bench-speculative"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"),
                    help="where speculative.json and .md (the table) are written ('' for nowhere)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for the SEED training run")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from algorithms import config_schemas
    from inference import Engine, SamplingParams
    from inference.serving import ServeOptions, load_served
    from inference.speculative import SpecStats, SpeculativeDecoder
    from models.loading import load_pretrained
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.setup import build_task_from
    from trainer.warm_start import ensure

    small_cfg = load_config(["+algo=sft", "model=tiny"], config_schemas())
    target_path = ensure(small_cfg.model, World())  # the default 4-layer warm start (built once, cached)
    # The external drafter: the same recipe from another model seed, so it is not the target's own source.
    drafter_model = dataclasses.replace(small_cfg.model, seed=args.drafter_seed)
    drafter_path = ensure(drafter_model, World())
    if args.target == "upscaled" and not os.path.exists(upscaled_dir(args)):
        os.makedirs(args.workdir, exist_ok=True)
        build_upscaled(target_path, args.layers, upscaled_dir(args))
    deep_cfg = load_config(["+algo=sft", *deep_overrides(args)], config_schemas())
    if args.target == "warm":
        ensure(deep_cfg.model, World())  # the deep warm start (built once, cached)
    if args.model:
        path, evals = args.model, {}
    else:
        path, evals = seed_model(args)
        b, a = evals["before"], evals["after"]
        print(f"held-out accuracy (n={a['n']}): deep model {b['accuracy']:.3f} -> after SEED {a['accuracy']:.3f}; "
              f"mean accepted length {b.get('seed/mean_accepted', float('nan')):.2f} -> "
              f"{a.get('seed/mean_accepted', float('nan')):.2f}", flush=True)
    served = load_served(path, ServeOptions(speculative="seed"))  # the SEED export through the serving door
    model, tok = served.model, served.tokenizer
    small, _ = load_pretrained(drafter_path)
    small.eval()
    task = build_task_from(deep_cfg.data)
    held_out = list(task.test_examples())
    prompts = [tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in held_out[: args.prompts]]
    eos = tok.eos_token_id
    engine = Engine(model)
    decoders = {"seed": served.decoder,  # configured by the export's seed_drafter.json
                "seed_k": SpeculativeDecoder.from_pretrained_dir(model, path, adaptive=False, draft_len=args.fixed_k),
                "external": SpeculativeDecoder(model, mode="external", drafter=small)}
    seed_cfg = decoders["seed"]
    print(f"seed: decoder_layers {seed_cfg.decoder_layers}, draft_len {seed_cfg.draft_len}, "
          f"{'confidence ' + str(seed_cfg.confidence) if seed_cfg.adaptive else 'fixed'}; "
          f"seed_k: fixed draft_len {args.fixed_k}", flush=True)
    rows = []
    for temperature in (0.0, 1.0):
        for batch in (1, 8):
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature,
                                    stop_token_ids=(eos,))
            groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]

            def run_plain():
                return [c for g in groups for c in engine.generate(g, params, generator=torch.Generator().manual_seed(0))]

            def run_spec(dec):
                def go():
                    outs, total = [], SpecStats()
                    for g in groups:
                        cs = dec.generate(g, params, generator=torch.Generator().manual_seed(0))
                        st = dec.stats
                        outs += cs
                        total.add(st)
                    return outs, total
                return go

            results = timed_round_robin({"plain": run_plain, **{name: run_spec(dec) for name, dec in decoders.items()}},
                                        args.repeats)
            t_plain, plain = results.pop("plain")
            n_tokens = sum(len(c.tokens) for c in plain)
            row = {"temperature": temperature, "batch": batch, "plain_tok_s": n_tokens / t_plain}
            for name, (t, (outs, st)) in results.items():
                n = sum(len(c.tokens) for c in outs)
                row[f"{name}_tok_s"] = n / t
                row[f"{name}_accept"] = st.emitted / max(st.steps, 1)  # the prefill token included
                row[f"{name}_round_ms"] = st.mean_round_ms
                row[f"{name}_speedup"] = (n / t) / row["plain_tok_s"]
                if temperature == 0.0:
                    row[f"{name}_equal_to_plain"] = [c.tokens for c in outs] == [c.tokens for c in plain]
            if batch == 1:
                row.update(_hf_assisted(model, small, prompts, args, temperature, eos))
            rows.append(row)
            print(json.dumps(row), flush=True)
    variants = list(decoders)
    head = f"\n{'T':>4} {'batch':>5} {'plain tok/s':>12}"
    for name in variants:
        head += f" {name + ' tok/s':>15} {'accept':>7} {'speedup':>8}"
    print(head + f" {'hf-assist tok/s':>16} {'hf plain tok/s':>15}")
    for r in rows:
        line = f"{r['temperature']:4.1f} {r['batch']:5d} {r['plain_tok_s']:12.1f}"
        for name in variants:
            line += f" {r[name + '_tok_s']:15.1f} {r[name + '_accept']:7.2f} {r[name + '_speedup']:7.2f}x"
        print(line + f" {r.get('hf_assist_tok_s', float('nan')):16.1f} {r.get('hf_plain_tok_s', float('nan')):15.1f}")
    report = {"model": path, "evals": evals, "args": vars(args), "rows": rows}
    if args.out:
        write_results(report, args.out)
    print(json.dumps(report))


VARIANTS = ("seed", "seed_k", "external")


def render(report: dict) -> str:
    """docs/results/speculative.md from the run's JSON."""
    from benchmarks.results_io import provenance_lines

    a, ev = report["args"], report.get("evals") or {}
    lines = ["# Speculative decoding (generated by benchmarks/speculative.py)", "", *provenance_lines(report.get("meta")),
             f"Target: {a['layers']}-layer {a['target']} model, SEED-trained {a['seed_steps']} steps at lr "
             f"{a.get('seed_lr', '')}; {a['prompts']} held-out prompts, at most {a['max_new_tokens']} new tokens, "
             f"{a['threads']} thread(s), fastest of {a['repeats']} round-robin passes; seed_k drafts "
             f"{a['fixed_k']} always; external = a 4-layer model from another seed."]
    if ev:
        b, f = ev["before"], ev["after"]
        lines += ["", f"Held-out accuracy (n={f['n']}) {b['accuracy']:.3f} -> {f['accuracy']:.3f} after SEED; "
                      f"tokens per verify in the training eval {b.get('seed/mean_accepted', 0):.2f} -> "
                      f"{f.get('seed/mean_accepted', 0):.2f}."]
    head = "| T | batch | plain tok/s | " + " | ".join(f"{v} tok/s | {v} accept | {v} ms/round | {v} speedup"
                                                    for v in VARIANTS) + " | greedy equal |"
    lines += ["", head, "|" + "---|" * (4 + 4 * len(VARIANTS))]
    for r in report["rows"]:
        cells = [f"{r['temperature']:g}", str(r["batch"]), f"{r['plain_tok_s']:.1f}"]
        for v in VARIANTS:
            cells += [f"{r[v + '_tok_s']:.1f}", f"{r[v + '_accept']:.2f}", f"{r.get(v + '_round_ms', 0):.2f}",
                      f"{r[v + '_speedup']:.2f}x"]
        cells.append(str(all(r.get(v + "_equal_to_plain", True) for v in VARIANTS)) if r["temperature"] == 0 else "")
        lines.append("| " + " | ".join(cells) + " |")
    hf = [r for r in report["rows"] if "hf_assist_tok_s" in r]
    if hf:
        lines += ["", "HF `generate` at batch 1, the same prompts: " + "; ".join(
            f"T {r['temperature']:g}: plain {r['hf_plain_tok_s']:.1f} tok/s, with the external drafter as "
            f"assistant {r['hf_assist_tok_s']:.1f} ({r['hf_assist_speedup_vs_hf']:.2f}x)" for r in hf) + "."]
    return "\n".join(lines) + "\n"


def write_results(report: dict, out: str) -> None:
    """speculative.json and speculative.md under `out`, each written aside and renamed into place."""
    from benchmarks.results_io import write_report

    write_report(out, "speculative", report, render)


def _hf_assisted(model, small, prompts, args, temperature, eos) -> dict:
    """HF generate with and without assistant_model, batch 1 (what HF supports)."""
    import torch

    def run(assistant):
        n = 0
        for p in prompts:
            ids = torch.tensor([p])
            kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                      do_sample=temperature > 0)
            if temperature > 0:
                kw.update(temperature=temperature, top_k=0, top_p=1.0)
            if assistant is not None:
                kw["assistant_model"] = assistant
            torch.manual_seed(0)
            out = model.generate(ids, **kw)
            n += out.shape[1] - ids.shape[1]
        return n

    timings = timed_round_robin({"plain": lambda: run(None), "assist": lambda: run(small)}, 1)
    (t_hf, n_hf), (t_as, n_as) = timings["plain"], timings["assist"]
    return {"hf_plain_tok_s": n_hf / t_hf, "hf_assist_tok_s": n_as / t_as,
            "hf_assist_speedup_vs_hf": (n_as / t_as) / (n_hf / t_hf)}


if __name__ == "__main__":
    main()
