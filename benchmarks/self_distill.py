"""SFT-continued vs OPSD vs MASS vs TESD (and GRPO) from the same warm-started tiny model, same budget.

Every run starts from the same embedded warm-started model (built with seed 0) and trains `--steps` steps
with each algorithm's own defaults (configs/algo/NAME.yaml; e.g. lr 1e-3 for SFT, 3e-5 for the
self-distillation algorithms);
the budget is steps x rollouts: OPSD and MASS sample `--batch` student rollouts per step, TESD
samples the same number split as batch/(1+G) questions x (1 student + G teacher rollouts), GRPO
batch/G prompts x G completions (`--group`), and
SFT-continued trains on `--batch` gold solutions per step. Each (setting, method, seed) is one
`python train.py` process (one thread; `--workers` run side by side). Held-out accuracy is greedy on
the setting's test split, before (step 0) and after training.

    python benchmarks/self_distill.py                          # 2 settings x 4 methods x 3 seeds
    python benchmarks/self_distill.py --methods opsd,mass --seeds 0 --steps 20
    python benchmarks/self_distill.py --methods grpo --settings arith --batch 64 --steps 100 \
        --extra trainer.eval_every=20               # GRPO: 8 prompts x G=8, held-out curve every 20 steps

Prints a table (accuracy mean +- std over seeds, tokens/s, wall time, diagnostics); last line JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {
    "arith": [],  # the embedded default: 2-digit operands, 2 chained operations
    "arith-hard": ["data.digits=3"],  # 3-digit operands: longer column working than the warm start saw
}
DIAGNOSTICS = ("rollout/reward", "mass/kept_fraction", "mass/view_disagreement", "mass/correction",
               "tesd/reliability", "tesd/teacher_correct", "tesd/independence", "opsd/divergence", "mass/divergence",
               "tesd/divergence", "grpo/steps_correct", "grpo/answer_correct", "grpo/frac_zero_std")


def overrides(method: str, setting: str, seed: int, args, out: str) -> list[str]:
    batch = args.batch
    extra = []
    if method == "tesd":
        g = args.teacher_rollouts
        if args.batch % (1 + g):
            raise SystemExit(f"--batch {args.batch} must be divisible by 1 + teacher_rollouts = {1 + g}")
        batch = args.batch // (1 + g)
        extra = [f"algo.teacher_rollouts={g}"]
    elif method == "grpo":  # batch rollouts = batch / G prompts x G completions
        g = args.group
        if args.batch % g:
            raise SystemExit(f"--batch {args.batch} must be divisible by --group {g}")
        batch = args.batch // g
        extra = [f"algo.num_generations={g}"]
    return [f"+algo={method}", f"model.path={args.model_path}", *SETTINGS[setting], f"seed={seed}", f"output_dir={out}",
            f"trainer.max_steps={args.steps}", f"trainer.batch_size={batch}",
            f"trainer.micro_batch_size={min(batch, args.micro)}", *([f"trainer.lr={args.lr}"] if args.lr else []),
            f"trainer.warmup_steps={max(1, args.steps // 10)}", f"trainer.eval_every={args.steps}",
            f"trainer.save_every={args.steps}", f"trainer.eval_examples={args.eval_examples}",
            "trainer.resume=never", "logging.wandb=false", "logging.progress=false", *extra, *args.extra]


def run_one(job) -> dict:
    method, setting, seed, args, base = job
    out = os.path.join(base, f"{setting}-{method}-{seed}")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    started = time.perf_counter()
    done = os.path.join(out, "wall_s")
    if os.path.exists(done):  # finished earlier into the same --keep directory: reuse it
        wall = float(open(done).read())
        proc = subprocess.CompletedProcess([], 0)
    else:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                               *overrides(method, setting, seed, args, out)], env=env, capture_output=True, text=True,
                              cwd=ROOT)
        wall = time.perf_counter() - started
        if proc.returncode == 0:
            with open(done, "w") as fh:
                fh.write(str(wall))
    if proc.returncode != 0:
        raise SystemExit(f"{setting}/{method}/seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    evals = [x for x in lines if x["split"] == "eval"]
    train = [x for x in lines if x["split"] == "train"]
    diag = {k: statistics.fmean(x[k] for x in train if k in x) for k in DIAGNOSTICS if any(k in x for x in train)}
    result = {"method": method, "setting": setting, "seed": seed, "before": evals[0]["accuracy"],
              "after": evals[-1]["accuracy"], "wall_s": wall, "curve": [(x["step"], x["accuracy"]) for x in evals],
              "tokens_per_s": statistics.fmean(x["tokens_per_s"] for x in train), **diag}
    if "teacher_accuracy" in evals[0]:
        result["teacher_before"], result["teacher_after"] = evals[0]["teacher_accuracy"], evals[-1]["teacher_accuracy"]
    print(f"  {setting:10s} {method:5s} seed {seed}: {result['before']:.3f} -> {result['after']:.3f}  "
          f"({wall:.0f}s)", flush=True)
    return result


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="sft,opsd,mass,tesd")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="rollouts (or SFT examples) per step")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="one lr for all (default: each algorithm's own)")
    ap.add_argument("--teacher-rollouts", type=int, default=3)
    ap.add_argument("--group", type=int, default=8, help="GRPO completions per prompt")
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--keep", default=None, help="directory for the runs (default: a temporary one)")
    args = ap.parse_args()
    methods, settings = args.methods.split(","), args.settings.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    base = args.keep or tempfile.mkdtemp(prefix="self_distill_")
    # One warm-started model for every run and seed (model.seed stays 0), built once.
    sys.path.insert(0, ROOT)
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.warm_start import ensure

    model_cfg = load_config(["+algo=sft", "model=tiny"], config_schemas()).model
    args.model_path = ensure(model_cfg, World())
    jobs = [(m, s, seed, args, base) for s in settings for seed in seeds for m in methods]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_one, jobs))
    print(f"\n{len(jobs)} runs in {time.perf_counter() - started:.0f}s ({args.workers} side by side); "
          f"{args.steps} steps x {args.batch} rollouts each; accuracy on {args.eval_examples} held-out questions\n")
    print(f"{'setting':11s} {'method':6s} {'before':>7s} {'after (mean +- std)':>20s} {'tokens/s':>9s} {'wall s':>7s}  diagnostics")
    table = []
    for s in settings:
        for m in methods:
            rs = [r for r in results if r["setting"] == s and r["method"] == m]
            after, std = mean_std([r["after"] for r in rs])
            row = {"setting": s, "method": m, "before": statistics.fmean(r["before"] for r in rs),
                   "after_mean": after, "after_std": std, "after_per_seed": [r["after"] for r in rs],
                   "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rs),
                   "wall_s": statistics.fmean(r["wall_s"] for r in rs)}
            for k in DIAGNOSTICS + ("teacher_before", "teacher_after"):
                if all(k in r for r in rs):
                    row[k] = statistics.fmean(r[k] for r in rs)
            curves = [dict(r["curve"]) for r in rs]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            row["curve"] = {step: statistics.fmean(c[step] for c in curves) for step in steps}
            table.append(row)
            diag = "  ".join(f"{k.split('/')[-1]}={row[k]:.3f}" for k in DIAGNOSTICS + ("teacher_before", "teacher_after")
                             if k in row)
            print(f"{s:11s} {m:6s} {row['before']:7.3f} {after:13.3f} +- {std:.3f} {row['tokens_per_s']:9.0f} "
                  f"{row['wall_s']:7.0f}  {diag}")
    for row in table:
        if len(row["curve"]) > 2:  # trainer.eval_every below --steps (via --extra): the held-out curve
            print(f"curve {row['setting']} {row['method']}: " +
                  "  ".join(f"{step}:{acc:.3f}" for step, acc in row["curve"].items()))
    print(json.dumps({"steps": args.steps, "rollouts_per_step": args.batch, "seeds": seeds, "table": table}))


if __name__ == "__main__":
    main()
