"""Speculative decoding on a SEED-trained tiny-but-deep model, side by side in one run.

The target is the embedded warm-started tiny model made deep (`--layers`, default 12; its warm start
is built once and cached like the default one), fine-tuned with `+algo=seed` (`--seed-steps`; or
pass `--model DIR` of a SEED-trained export). Compared on the same held-out `arith` prompts:

  plain      our engine, one token per forward (the baseline);
  seed       self-speculative SEED drafting with the model's top layers (seed_drafter.json);
  external   a classic two-model setup: the default 4-layer warm-started tiny model drafts;
  hf-assist  HF `generate(assistant_model=...)` with the same small drafter (batch 1 only);

at batch 1 and 8, greedy and temperature 1: tokens/s, mean tokens per verify forward (accepted
drafts + 1), speedup over plain. Also: held-out greedy accuracy of the model before and after SEED
fine-tuning (it must not drop), from the training run's own evals. One thread; last line JSON.

    python benchmarks/speculative.py                     # build + SEED-train (cached runs reused)
    python benchmarks/speculative.py --model outputs/seed/final --prompts 16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def deep_overrides(args) -> list[str]:
    return ["model=tiny", f"model.num_layers={args.layers}", f"model.warm_start_steps={args.warm_steps}"]


def seed_model(args) -> tuple[str, dict]:
    """A SEED-trained export of the deep warm-started model (trained once into --workdir), and the
    held-out evals of that run (step 0 = the warm start, last = after SEED)."""
    out = os.path.join(args.workdir, f"seed-l{args.layers}-w{args.warm_steps}-s{args.seed_steps}")
    final = os.path.join(out, "final")
    if not os.path.exists(os.path.join(final, "seed_drafter.json")):
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "+algo=seed", *deep_overrides(args),
               f"trainer.max_steps={args.seed_steps}", f"trainer.eval_every={args.seed_steps}",
               f"trainer.save_every={args.seed_steps}", f"trainer.eval_examples={args.eval_examples}",
               "trainer.resume=never", "logging.wandb=false", "logging.progress=false", f"output_dir={out}",
               *args.extra]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.train_threads), WANDB_MODE="disabled")
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"SEED training failed:\n{proc.stderr[-3000:]}")
        print(f"SEED fine-tuning ({args.seed_steps} steps) in {time.perf_counter() - started:.0f}s", flush=True)
    evals = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"eval"' in x]
    return final, {"before": evals[0], "after": evals[-1]}


def timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a SEED-trained export (default: build and train one)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--warm-steps", type=int, default=150, help="SFT warm-start steps of the deep model")
    ap.add_argument("--seed-steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the decoding comparison")
    ap.add_argument("--train-threads", type=int, default=2, help="threads of the SEED training run")
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/posttrain/bench-speculative"))
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for the SEED training run")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from algorithms import config_schemas
    from inference import Engine, SamplingParams
    from inference.speculative import SpeculativeDecoder
    from models.loading import load_pretrained
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.setup import build_task_from
    from trainer.warm_start import cache_path, tiny_model

    deep_cfg = load_config(["+algo=sft", *deep_overrides(args)], config_schemas())
    tiny_model(deep_cfg.model, World(), 0)  # the deep warm start (built once, cached)
    small_cfg = load_config(["+algo=sft", "model=tiny"], config_schemas())
    tiny_model(small_cfg.model, World(), 0)  # the default 4-layer warm start: the external drafter
    if args.model:
        path, evals = args.model, {}
    else:
        path, evals = seed_model(args)
        b, a = evals["before"], evals["after"]
        print(f"held-out accuracy (n={a['n']}): deep warm start {b['accuracy']:.3f} -> after SEED {a['accuracy']:.3f}; "
              f"mean accepted length {b.get('seed/mean_accepted', float('nan')):.2f} -> "
              f"{a.get('seed/mean_accepted', float('nan')):.2f}", flush=True)
    model, tok = load_pretrained(path)
    small, _ = load_pretrained(cache_path(small_cfg.model, 0))
    for m in (model, small):
        m.eval()
    task = build_task_from(deep_cfg.data)
    held_out = list(task.test_examples())
    prompts = [tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in held_out[: args.prompts]]
    eos = tok.eos_token_id
    engine = Engine(model)
    seed_dec = SpeculativeDecoder.from_pretrained_dir(model, path)
    external = SpeculativeDecoder(model, mode="external", drafter=small)
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
                    outs, steps, emitted = [], 0, 0
                    for g in groups:
                        cs, st = dec.generate(g, params, generator=torch.Generator().manual_seed(0))
                        outs += cs
                        steps, emitted = steps + st.steps, emitted + st.emitted
                    return outs, emitted / max(steps, 1)
                return go

            t_plain, plain = timed(run_plain, args.repeats)
            n_tokens = sum(len(c.tokens) for c in plain)
            row = {"temperature": temperature, "batch": batch, "plain_tok_s": n_tokens / t_plain}
            for name, dec in (("seed", seed_dec), ("external", external)):
                t, (outs, accepted) = timed(run_spec(dec), args.repeats)
                n = sum(len(c.tokens) for c in outs)
                row[f"{name}_tok_s"] = n / t
                row[f"{name}_accept"] = accepted
                row[f"{name}_speedup"] = (n / t) / row["plain_tok_s"]
                if temperature == 0.0:
                    row[f"{name}_equal_to_plain"] = [c.tokens for c in outs] == [c.tokens for c in plain]
            if batch == 1:
                row.update(_hf_assisted(model, small, prompts, args, temperature, eos, row["plain_tok_s"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'T':>4} {'batch':>5} {'plain tok/s':>12} {'seed tok/s':>11} {'accept':>7} {'speedup':>8} "
          f"{'ext tok/s':>10} {'accept':>7} {'speedup':>8} {'hf-assist tok/s':>16}")
    for r in rows:
        print(f"{r['temperature']:4.1f} {r['batch']:5d} {r['plain_tok_s']:12.1f} {r['seed_tok_s']:11.1f} "
              f"{r['seed_accept']:7.2f} {r['seed_speedup']:7.2f}x {r['external_tok_s']:10.1f} {r['external_accept']:7.2f} "
              f"{r['external_speedup']:7.2f}x {r.get('hf_assist_tok_s', float('nan')):16.1f}")
    print(json.dumps({"model": path, "evals": evals, "rows": rows}))


def _hf_assisted(model, small, prompts, args, temperature, eos, plain_tok_s) -> dict:
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

    t_hf, n_hf = timed(lambda: run(None), 1)
    t_as, n_as = timed(lambda: run(small), 1)
    return {"hf_plain_tok_s": n_hf / t_hf, "hf_assist_tok_s": n_as / t_as,
            "hf_assist_speedup_vs_hf": (n_as / t_as) / (n_hf / t_hf)}


if __name__ == "__main__":
    main()
