"""Does A beat B? A paired comparison of two sets of finished runs, question by question.

Each side is a list of result files that store their held-out per-question outcomes (`outcomes`: one
"0"/"1" per question, the same questions in the same order on both sides) and their `seed`, as
benchmarks/lr_sweep.py's files do. The runs pair by seed: only seeds both sides ran count. Per question
the outcome is averaged over those seeds on each side; the difference A - B is the mean over questions,
and its 95% interval a bootstrap over questions (benchmarks/distill.py::paired, 10,000 draws, fixed seed).

    python benchmarks/compare.py --name opsd-truncate \\
        --a 'docs/results/lr_levers/truncate/arith-opsd-lr0.0003-s*.json' \\
        --b 'docs/results/lr_sweep/arith-opsd-lr0.0003-s*.json'

Writes docs/results/compare/NAME.json (`--results DIR` elsewhere: written aside, then renamed) with both
sides' files and each run's commit, the seeds, the means, the difference and its interval; prints it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.distill import paired  # noqa: E402

RESULTS = os.path.join(ROOT, "docs", "results", "compare")


def side(pattern: str) -> dict[int, dict]:
    """seed -> run of the result files `pattern` names (a glob); one run per seed."""
    runs: dict[int, dict] = {}
    for path in sorted(glob.glob(pattern)):
        with open(path) as fh:
            run = json.load(fh)
        if "outcomes" not in run or "seed" not in run:
            raise SystemExit(f"{path}: no per-question outcomes or seed to pair on")
        if run["seed"] in runs:
            raise SystemExit(f"{path}: a second run of seed {run['seed']} ({runs[run['seed']]['path']})")
        runs[run["seed"]] = dict(run, path=os.path.relpath(path, ROOT))
    if not runs:
        raise SystemExit(f"no result files match {pattern}")
    return runs


def compare(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """The paired difference of two sides (seed -> run), over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise SystemExit(f"no seed on both sides (A: {sorted(a)}, B: {sorted(b)})")
    bits = lambda runs: [[int(c) for c in runs[s]["outcomes"]] for s in seeds]  # noqa: E731
    sizes = {len(x) for x in bits(a) + bits(b)}
    if len(sizes) != 1:
        raise SystemExit(f"the runs score different numbers of questions: {sorted(sizes)}")
    diff, lo, hi = paired(bits(a), bits(b))
    mean = lambda runs: statistics.fmean(statistics.fmean(x) for x in bits(runs))  # noqa: E731
    files = lambda runs: [{"path": runs[s]["path"], "seed": s, "final": runs[s].get("final"),  # noqa: E731
                           "commit": (runs[s].get("meta") or {}).get("commit")} for s in seeds]
    return {"seeds": seeds, "questions": sizes.pop(), "a_mean": mean(a), "b_mean": mean(b), "difference": diff,
            "interval": [lo, hi], "a": files(a), "b": files(b)}


def main() -> None:
    from benchmarks.results_io import provenance, write_files

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True, help="the comparison's file name (NAME.json)")
    ap.add_argument("--a", required=True, help="glob of side A's result files")
    ap.add_argument("--b", required=True, help="glob of side B's result files")
    ap.add_argument("--results", default=RESULTS)
    args = ap.parse_args()
    result = compare(side(args.a), side(args.b))
    result.update(name=args.name, command="python benchmarks/compare.py " + " ".join(
        f"{k} '{v}'" if k in ("--a", "--b") else f"{k} {v}" for k, v in zip(sys.argv[1::2], sys.argv[2::2])),
        meta=provenance())
    write_files(args.results, {f"{args.name}.json": json.dumps(result, indent=1)})
    print(f"{args.name}: A {result['a_mean']:.3f} - B {result['b_mean']:.3f} = {result['difference']:+.3f} "
          f"[{result['interval'][0]:+.3f}, {result['interval'][1]:+.3f}] over seeds {result['seeds']}")


if __name__ == "__main__":
    main()
