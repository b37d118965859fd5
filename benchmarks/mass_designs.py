"""MASS designs against OPSD at an equal step budget, as a user launches them: 2 ranks, each run
`torchrun --standalone --nproc_per_node=2 train.py +algo=NAME ...` from the shipped default model of
its data set, held-out greedy accuracy (n=200) before and after, and the policy's accuracy under the
teacher prompt.

    nohup python benchmarks/mass_designs.py --group seeds > /tmp/mass_designs.log 2>&1 &  # OPSD vs MASS, defaults,
                                                             # 3 seeds, multipath + arith
    python benchmarks/mass_designs.py --group designs        # MASS designs vs OPSD, 100 steps at lr 1e-4, seed 0
    python benchmarks/mass_designs.py --render               # only rewrite the table

Each finished run writes docs/results/mass_designs/NAME.json (its command, every eval, wall seconds)
and is skipped when the benchmark is started again (delete the file to remeasure it), so results
accumulate across sessions; docs/results/mass_designs.md is rendered from those files. One run at a
time: the two ranks use both cores.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.results_io import write_files  # noqa: E402
RESULTS = ROOT / "docs" / "results" / "mass_designs"
TABLE = ROOT / "docs" / "results" / "mass_designs.md"
DESIGN_BUDGET = ["trainer.max_steps=100", "trainer.eval_every=50", "trainer.lr=1e-4"]  # the design comparison

# name -> overrides; every other key at its default
EARLIER = ["algo.aggregate=geometric", "algo.full_view=false"]  # MASS's defaults before the posterior aggregate
# name -> overrides; every other key at its default
DESIGNS = {  # the rows of docs/mass.md "The earlier design study", then the aggregates compared at the defaults
    "opsd": ["+algo=opsd"],
    "mass-agreement-q0.8": ["+algo=mass", "algo.aggregate=mean", "algo.full_view=false", "algo.gate_margin=0",
                            "algo.gate_support=0", "algo.gate_agreement_quantile=0.8"],
    "mass-nogate-mean": ["+algo=mass", "algo.aggregate=mean", "algo.full_view=false", "algo.gate=false"],
    "mass-nogate-geometric": ["+algo=mass", *EARLIER, "algo.gate=false"],
    "mass-margin0.05-mean": ["+algo=mass", "algo.aggregate=mean", "algo.full_view=false", "algo.gate_margin=0.05"],
    "mass-margin0.05-mean-fullview": ["+algo=mass", "algo.aggregate=mean", "algo.gate_margin=0.05", "algo.full_view=true"],
    "mass-margin0.05-backed": ["+algo=mass", "algo.aggregate=backed", "algo.full_view=false", "algo.gate_margin=0.05"],
    "mass-margin0.05-geometric": ["+algo=mass", *EARLIER, "algo.gate_margin=0.05"],
    "mass-margin0.01-geometric": ["+algo=mass", *EARLIER, "algo.gate_margin=0.01"],
    "mass-gate": ["+algo=mass", *EARLIER],  # the earlier defaults: geometric, masked views only, the gate
    "mass-backed": ["+algo=mass", "algo.aggregate=backed", "algo.full_view=false"],
    "mass-confident": ["+algo=mass", "algo.aggregate=confident", "algo.full_view=false"],
    "mass-posterior": ["+algo=mass", "algo.aggregate=posterior", "algo.full_view=false"],
    "mass-posterior-tau0": ["+algo=mass", "algo.aggregate=posterior", "algo.full_view=false",
                            "algo.confidence_temperature=0"],
    "mass-posterior-full": ["+algo=mass", "algo.aggregate=posterior", "algo.full_view=true"],  # = the defaults
}
CANDIDATES = ("mass-backed", "mass-confident", "mass-posterior", "mass-posterior-tau0", "mass-posterior-full")  # aggregates tried against OPSD at the defaults (docs/mass.md)
GROUPS = {
    "designs": [(f"arith-{name}-s0-lr1e-4", [*o, "seed=0", *DESIGN_BUDGET]) for name, o in DESIGNS.items()],
    "seeds": [(f"{data}-{name}-s{seed}", [*DESIGNS[name], f"seed={seed}", *([f"data={data}"] if data != "arith" else [])])
              for data in ("multipath", "arith") for seed in (0, 1, 2) for name in ("opsd", "mass-gate")],
    **{f"{data}-{name}": [(f"{data}-{name}-s{seed}", [*DESIGNS[name], f"seed={seed}",
                                                      *([f"data={data}"] if data != "arith" else [])])
                          for seed in (0, 1, 2)]
       for data in ("multipath", "arith") for name in CANDIDATES},
}


def run_one(name: str, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"mass-{name}-") as tmp:
        cmd = ["torchrun", "--standalone", "--nproc_per_node=2", "train.py", *overrides]
        full = [*cmd, f"output_dir={tmp}/out", "trainer.resume=never", "logging.wandb=false", "logging.progress=false"]
        started = time.perf_counter()
        proc = subprocess.run(full, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, WANDB_MODE="disabled"))
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        rows = [json.loads(x) for x in open(f"{tmp}/out/metrics.jsonl")]
    evals = [{k: r[k] for k in ("step", "accuracy", "teacher_accuracy", "teacher_drift", "path_differs") if k in r}
             for r in rows if r["split"] == "eval"]
    train = [r for r in rows if r["split"] == "train"]
    means = {k: statistics.fmean(r[k] for r in train if k in r)
             for k in ("mass/kept_fraction", "mass/kept_correction_fraction", "mass/correction_tokens")
             if any(k in r for r in train)}
    return {"name": name, "command": " ".join(cmd), "evals": evals, "wall_s": round(seconds, 1), **means}


def render() -> None:
    runs = sorted((json.loads(p.read_text()) for p in RESULTS.glob("*.json")), key=lambda r: r["name"])
    lines = ["# MASS designs and OPSD at an equal budget (generated by benchmarks/mass_designs.py)", "",
             "2 ranks, defaults unless the command says otherwise; held-out accuracy (n=200), the policy under the teacher",
             "prompt in brackets; `kept` / `kept corr.`: mean share of tokens / of correction tokens the gate kept;",
             "`s`: wall seconds of the whole command, an upper bound where other jobs shared the 2 cores.",
             "", "| run | step 0 | step 100 | last step | kept | kept corr. | s | command |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ev = {e["step"]: e for e in r["evals"]}
        cell = lambda s: f"{ev[s]['accuracy']:.3f} ({ev[s].get('teacher_accuracy', float('nan')):.3f})" if s in ev else ""
        kept = r.get("mass/kept_fraction")
        corr = r.get("mass/kept_correction_fraction")
        last = r["evals"][-1]["step"]
        lines.append(f"| {r['name']} | {cell(0)} | {cell(100)} | {last}: {cell(last)} | {'' if kept is None else f'{kept:.3f}'} | "
                     f"{'' if corr is None else f'{corr:.3f}'} | {r['wall_s']:.0f} | `{r['command']}` |")
    summary = {}
    for r in runs:
        data, _, rest = r["name"].partition("-")
        design, _, budget = rest.partition("-s")
        budget = budget.partition("-")[2] or "defaults"
        first, last = r["evals"][0], r["evals"][-1]
        summary.setdefault((data, budget, design), []).append(
            (last["accuracy"] - first["accuracy"], last.get("teacher_accuracy", 0) - first.get("teacher_accuracy", 0)))
    lines += ["", "Gain over step 0 at the last step (student, and the policy under the teacher prompt), mean ± std over the",
              "seeds run:", "", "| data | budget | design | seeds | student gain | teacher-prompt change |", "|---|---|---|---|---|---|"]
    for (data, budget, design), gains in sorted(summary.items()):
        student, teacher = [g for g, _ in gains], [t for _, t in gains]
        sd = statistics.stdev(student) if len(student) > 1 else 0.0
        lines.append(f"| {data} | {budget} | {design} | {len(gains)} | {statistics.fmean(student):+.3f} ± {sd:.3f} | "
                     f"{statistics.fmean(teacher):+.3f} |")
    TABLE.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=sorted(GROUPS), action="append", default=[])
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for group in args.group:
        for name, overrides in GROUPS[group]:
            path = RESULTS / f"{name}.json"
            if path.exists():
                print(f"{name}: done earlier, skipped", flush=True)
                continue
            result = run_one(name, overrides)
            write_files(path.parent, {path.name: json.dumps(result, indent=1)})  # published only when complete
            ev = result["evals"]
            print(f"{name}: {ev[0]['accuracy']:.3f} -> {ev[-1]['accuracy']:.3f} ({result['wall_s']:.0f}s)", flush=True)
            render()
    render()


if __name__ == "__main__":
    sys.exit(main())
