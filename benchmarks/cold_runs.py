"""How long every algorithm's first run takes: `+algo=NAME` on its defaults, cold.

For each algorithm, README command 1's launch (`torchrun --standalone --nproc_per_node=2 train.py
+algo=NAME`) with every key at its default, in a fresh output directory and an empty model cache
(`POSTTRAIN_CACHE` pointed at a new directory: whatever the run needs first -- the shipped default
model's install, or a build -- happens inside the timed run). Measured: wall-clock seconds of the whole
command, its exit code, the lines it printed about the default model (installed / built), and its
`held-out accuracy ...` summary.

    nohup python benchmarks/cold_runs.py > /tmp/cold_runs.log 2>&1 &     # all ten, one after another
    python benchmarks/cold_runs.py --algos sft,grpo                      # some
    python benchmarks/cold_runs.py --render                              # only rewrite the table

Each finished run writes docs/results/cold_runs/NAME.json and is skipped when the benchmark is started
again (delete the file to remeasure it), so the table accumulates across sessions; docs/cold_runs.md is
rendered from those files after every run. Run it alone on the machine: another job on the same cores
inflates every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.results_io import write_files  # noqa: E402
RESULTS = ROOT / "docs" / "results" / "cold_runs"
TABLE = ROOT / "docs" / "cold_runs.md"
ALGOS = ("sft", "grpo", "opsd", "mass", "tesd", "seed", "qad", "skipper", "attuner", "clm")
LIMIT_S = 600  # the target: a first run in at most 10 minutes on 2 CPU cores
TIMEOUT_S = 3600


def cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def run_one(algo: str, note: str = "") -> dict:
    with tempfile.TemporaryDirectory(prefix=f"cold-{algo}-") as tmp:
        env = dict(os.environ, POSTTRAIN_CACHE=os.path.join(tmp, "cache"), WANDB_MODE="disabled")
        cmd = ["torchrun", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), f"+algo={algo}",
               f"output_dir={os.path.join(tmp, 'out')}", "logging.progress=false"]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT_S)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            code, out = 124, (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        seconds = time.perf_counter() - started
    lines = out.splitlines()
    model = [line for line in lines if "shipped default model" in line or "building the warm-started" in line
             or line.startswith("warm start done")]
    summary = [line for line in lines if line.startswith("held-out accuracy")]
    return {"algo": algo, "seconds": round(seconds, 1), "exit_code": code, "default_model": model,
            "summary": summary[-1] if summary else None, "tail": lines[-5:] if code else [],
            "command": f"torchrun --standalone --nproc_per_node=2 train.py +algo={algo}", "note": note,
            "machine": {"cores": os.cpu_count(), "cpu_capability": cpu_capability(), "python": platform.python_version(),
                        "date": time.strftime("%Y-%m-%d")}}


def _short(line: str) -> str:
    """A default-model line without its cache path: what was installed or built, for which task."""
    import re

    if m := re.match(r"installed the shipped default model for (\w+) in \S+ \(.*accuracy ([0-9.]+)\)", line):
        return f"shipped {m.group(1)} installed (held-out {m.group(2)})"
    if m := re.match(r"building the warm-started tiny model for (\w+) in \S+, once: (.*)", line):
        return f"built {m.group(1)} on first use ({m.group(2)})"
    return line


def render() -> None:
    rows = []
    for algo in ALGOS:
        path = RESULTS / f"{algo}.json"
        if not path.exists():
            rows.append(f"| `{algo}` | not measured yet | | | |")
            continue
        r = json.loads(path.read_text())
        minutes = r["seconds"] / 60
        verdict = "yes" if r["exit_code"] == 0 and r["seconds"] <= LIMIT_S else "**no**"
        model = "; ".join(_short(line) for line in r["default_model"]) or "-"
        status = "done" if r["exit_code"] == 0 else f"exit code {r['exit_code']}"
        if r.get("note"):
            status += f"; {r['note']}"
        rows.append(f"| `{algo}` | {minutes:.1f} min ({status}) | {verdict} | {model} | {r['summary'] or '-'} |")
    machines = sorted({json.dumps(json.loads(p.read_text())["machine"], sort_keys=True) for p in RESULTS.glob("*.json")})
    text = ("# First runs, cold\n\n"
            "Every algorithm on its defaults, launched as README command 1 launches the main job\n"
            "(`torchrun --standalone --nproc_per_node=2 train.py +algo=NAME`), in a fresh output directory with an\n"
            "empty model cache, timed from start to exit: the default model's install (or build) is inside the\n"
            "figure. Target: 10 minutes on 2 CPU cores. Rendered by `python benchmarks/cold_runs.py` from\n"
            "`docs/results/cold_runs/NAME.json` (one file per measured run; a missing one is not measured yet).\n\n"
            "| algorithm | wall clock | within 10 min | default model | held-out accuracy (the run's own summary) |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            "Measured on: " + "; ".join(
                ", ".join(f"{k} {v}" for k, v in json.loads(m).items()) for m in machines) + ".\n")
    TABLE.write_text(text)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algos", default=",".join(ALGOS))
    parser.add_argument("--render", action="store_true", help="only rewrite docs/cold_runs.md")
    parser.add_argument("--note", default="", help="recorded with each run, e.g. what else used the cores "
                                                   "(such a figure is an upper bound)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.render:
        for algo in args.algos.split(","):
            if algo not in ALGOS:
                parser.error(f"unknown algorithm {algo}: one of {', '.join(ALGOS)}")
            path = RESULTS / f"{algo}.json"
            if path.exists():
                print(f"{algo}: measured already ({path}); delete it to remeasure", flush=True)
                continue
            print(f"{algo}: running cold ...", flush=True)
            result = run_one(algo, args.note)
            write_files(path.parent, {path.name: json.dumps(result, indent=1) + "\n"})  # a finished run only
            print(f"{algo}: {result['seconds']:.0f} s, exit code {result['exit_code']}: {result['summary']}", flush=True)
            render()
    render()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
