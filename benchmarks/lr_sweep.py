"""Every training algorithm at every learning rate, as a new user runs it: which rate is each one's best?

Each run is README command 1's launch with every key at its default but the learning rate, the step count
and the eval cadence: `torchrun --standalone --nproc_per_node=2 train.py +algo=ALGO [data=multipath]
trainer.lr=LR trainer.max_steps=300 trainer.eval_every=50` on the shipped default model of the setting
(`arith`, the embedded default task; `multipath`: 3 gains / losses in any valid order). `distill` learns
from a teacher made the same way for each setting: 300 steps of `+algo=sft` at its defaults, 2 ranks.

Phases: `sweep` runs every (setting, algorithm) at each rate of `--lrs` with seed 0, in the order given
(the likely best first, so a partial sweep already spans every algorithm); `seeds` runs each (setting,
algorithm)'s two best swept rates (highest final held-out accuracy; ties to the lower rate) with `--seeds`.
Held-out accuracy is the trainer's own greedy eval (n = `trainer.eval_examples`, 200 by default), every 50
steps; its per-question outcomes (the eval record's `outcomes`) give the paired differences.

Every finished run writes `docs/results/lr_sweep/SETTING-ALGO-lrLR-sSEED.json` (`--results DIR` elsewhere)
with its overrides, command, date and commit; a restarted benchmark skips a run whose file holds the same
overrides, so the runs (hours on 2 cores) accumulate across sessions. `docs/results/lr_sweep.md` and
`docs/results/lr_sweep_curves.png` are rendered from every file there after each run (each run keeps its
own commit); `--render` only rewrites them.

    nohup timeout 10000 python benchmarks/lr_sweep.py > /tmp/lr_sweep.log 2>&1 &    # sweep, then seeds
    python benchmarks/lr_sweep.py --settings arith --algos sft,opsd --lrs 3e-4,1e-3   # some of it
    python benchmarks/lr_sweep.py --render
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.distill import paired, train  # noqa: E402  (one train.py launch; the paired bootstrap)

RESULTS = os.path.join(ROOT, "docs", "results", "lr_sweep")
KEEP = os.path.join(ROOT, "outputs", "bench_lr_sweep")
SETTINGS = {"arith": [], "multipath": ["data=multipath"]}
ALGOS = "sft,opsd,mass,tesd,grpo,distill"
LRS = "3e-4,1e-3,1e-4,3e-3,3e-5,1e-5"  # the order they run in: the likely best first
LAUNCH = "torchrun --standalone --nproc_per_node=2 train.py"


def overrides(args, setting: str, algo: str, lr: float | None, seed: int, out: str, teacher: str | None = None,
              steps: int | None = None) -> list[str]:
    """A user's run: the algorithm's defaults but the rate (None: its default), steps and eval cadence."""
    steps = steps or args.steps
    return [f"+algo={algo}", *SETTINGS[setting], *([f"trainer.lr={lr:g}"] if lr is not None else []),
            f"trainer.max_steps={steps}", f"trainer.eval_every={args.eval_every}", f"seed={seed}",
            *([f"algo.teacher_path={teacher}"] if teacher else []), f"output_dir={out}",
            f"trainer.save_every={steps}", "trainer.resume=never", "logging.wandb=false", "logging.progress=false",
            *args.extra]


def default_overrides(setting: str, algo: str, seed: int, out: str, teacher: str | None = None) -> list[str]:
    """README command 1's run: every key at its default (rate, steps, eval cadence) but the seed."""
    return [f"+algo={algo}", *SETTINGS[setting], f"seed={seed}", *([f"algo.teacher_path={teacher}"] if teacher else []),
            f"output_dir={out}", "trainer.resume=never", "logging.wandb=false", "logging.progress=false"]


def portable(argv: list[str]) -> list[str]:
    """The overrides that define the run (no output or teacher directory of this machine)."""
    return [("algo.teacher_path=<teacher>" if a.startswith("algo.teacher_path=") else a)
            for a in argv if not a.startswith("output_dir=")]


def teacher(args, setting: str) -> dict:
    """The setting's distillation teacher: `--teacher-steps` steps of `+algo=sft` at its defaults, 2 ranks."""
    out = os.path.join(args.keep, f"{setting}-teacher-{args.teacher_steps}")
    argv = overrides(args, setting, "sft", None, 0, out, steps=args.teacher_steps)
    _, lines = train(argv, out, 2)
    evals = [x for x in lines if x["split"] == "eval"]
    return {"path": os.path.join(out, "final"), "accuracy": evals[-1]["accuracy"],
            "command": f"{LAUNCH} {' '.join(portable(argv))}"}


def record_path(results: str, setting: str, algo: str, lr: float | None, seed: int) -> str:
    """The run's result file; `lr` None: the run at every default (the `defaults` phase)."""
    return os.path.join(results, f"{setting}-{algo}-{'default' if lr is None else f'lr{lr:g}'}-s{seed}.json")


def run(args, setting: str, algo: str, lr: float | None, seed: int, teachers: dict) -> dict:
    """One run (skipped when its result file holds the same overrides); its record. `lr` None: README
    command 1's run, every key at its default (rate and step count included)."""
    from benchmarks.results_io import provenance, write_files

    make = ((lambda o, t: overrides(args, setting, algo, lr, seed, o, t)) if lr is not None else
            (lambda o, t: default_overrides(setting, algo, seed, o, t)))
    name = f"{setting}-{algo}-lr{lr:g}-s{seed}-{args.steps}" if lr is not None else f"{setting}-{algo}-default-s{seed}"
    out = os.path.join(args.keep, name)
    path = record_path(args.results, setting, algo, lr, seed)
    label = f"{setting} {algo} lr {'default' if lr is None else f'{lr:g}'} seed {seed}"
    if os.path.exists(path):
        earlier = json.load(open(path))
        if earlier.get("overrides") == portable(make(out, "<teacher>" if algo == "distill" else None)):
            print(f"  {label}: done earlier ({path})", flush=True)
            return earlier
    t = None
    if algo == "distill":
        if setting not in teachers:
            teachers[setting] = teacher(args, setting)
        t = teachers[setting]
    argv = make(out, t["path"] if t else None)
    wall, lines = train(argv, out, 2)
    evals = [x for x in lines if x["split"] == "eval"]
    result = {"setting": setting, "algo": algo, "lr": lr, "seed": seed, "steps": evals[-1]["step"], "wall_s": wall,
              "before": evals[0]["accuracy"], "final": evals[-1]["accuracy"], "n": evals[-1]["n"],
              "outcomes": evals[-1]["outcomes"], "curve": [(x["step"], x["accuracy"]) for x in evals],
              "teacher_curve": [(x["step"], x["teacher_accuracy"]) for x in evals if "teacher_accuracy" in x],
              "teacher": ({"accuracy": t["accuracy"], "command": t["command"]} if t else None),
              "overrides": portable(argv), "command": f"{LAUNCH} {' '.join(portable(argv))}", "meta": provenance()}
    write_files(args.results, {os.path.basename(path): json.dumps(result, indent=1)})  # once complete
    print(f"  {label}: {result['before']:.3f} -> {result['final']:.3f} ({wall:.0f}s)", flush=True)
    render(args.results)
    return result


def best_lrs(results: list[dict], setting: str, algo: str, k: int = 2) -> list[float]:
    """The `k` swept (seed 0) rates of (setting, algo) with the highest final accuracy; ties to the lower rate."""
    swept = [r for r in results if r["setting"] == setting and r["algo"] == algo and r["seed"] == 0
             and r["lr"] is not None]
    return [r["lr"] for r in sorted(swept, key=lambda r: (-r["final"], r["lr"]))[:k]]


def load(results_dir: str) -> list[dict]:
    if not os.path.isdir(results_dir):
        return []
    return [json.load(open(os.path.join(results_dir, f))) for f in sorted(os.listdir(results_dir))
            if f.endswith(".json")]


def _bits(r: dict) -> list[int]:
    return [int(c) for c in r["outcomes"]]


def render(results_dir: str) -> str:
    """docs/results/lr_sweep.md (and the curves PNG) from every result file in `results_dir`."""
    from benchmarks.results_io import write_files

    everything = load(results_dir)
    if not everything:
        return ""
    results = [r for r in everything if r["lr"] is not None]  # the sweep's; lr None: a run at the defaults
    defaults = [r for r in everything if r["lr"] is None]
    stem = os.path.basename(results_dir.rstrip("/"))
    parent = os.path.dirname(results_dir.rstrip("/"))
    lines = ["# Learning-rate sweep of every algorithm (generated by benchmarks/lr_sweep.py)", "",
             "Each run: `" + LAUNCH + " +algo=ALGO [data=multipath] trainer.lr=LR trainer.max_steps=300 "
             "trainer.eval_every=50` (every other key at its default), 2 ranks on 2 CPU cores; held-out greedy "
             "accuracy of the trainer's own eval. In brackets: the teacher prompt (question + reference) of the "
             "self-distillation algorithms at the end.", ""]
    extra = sorted({" ".join(r["overrides"][r["overrides"].index("logging.progress=false") + 1:]) for r in everything
                    if "logging.progress=false" in r["overrides"]} - {""})
    if extra:  # --extra: overrides beyond the rate, steps and seed, part of each run's identity
        lines += ["Every run here also sets " + "; ".join(f"`{x}`" for x in extra) + ".", ""]
    for setting in [s for s in SETTINGS if any(r["setting"] == s for r in results)]:
        mine = [r for r in results if r["setting"] == setting]
        algos = [a for a in ALGOS.split(",") if any(r["algo"] == a for r in mine)]
        lrs = sorted({r["lr"] for r in mine})
        n = mine[0]["n"]
        lines += [f"## {setting} (step 0: {mine[0]['before']:.3f}, n = {n})", "",
                  "Seed 0, final held-out accuracy at each rate:", "",
                  "| algorithm | " + " | ".join(f"lr {x:g}" for x in lrs) + " | best two |",
                  "|---|" + "---|" * (len(lrs) + 1)]
        for algo in algos:
            cells = []
            for lr in lrs:
                r = [x for x in mine if x["algo"] == algo and x["lr"] == lr and x["seed"] == 0]
                cell = f"{r[0]['final']:.3f}" if r else ""
                if r and r[0]["teacher_curve"]:
                    cell += f" ({r[0]['teacher_curve'][-1][1]:.3f})"
                cells.append(cell)
            lines.append(f"| {algo} | " + " | ".join(cells) + " | " +
                         ", ".join(f"{x:g}" for x in best_lrs(mine, setting, algo)) + " |")
        teachers = {r["teacher"]["accuracy"] for r in mine if r.get("teacher")}
        if teachers:
            lines += ["", "distill's teacher: `+algo=sft` at its defaults, held out " +
                      ", ".join(f"{x:.3f}" for x in sorted(teachers)) + "."]
        lines += ["", "At the two best rates, every seed run (mean ± sample std; the curve is the mean per eval step):",
                  "", "| algorithm | lr | seeds | final | per seed | curve | wall s / run | commits |",
                  "|---|---|---|---|---|---|---|---|"]
        best = {}
        for algo in algos:
            for rank, lr in enumerate(best_lrs(mine, setting, algo)):
                rs = sorted([x for x in mine if x["algo"] == algo and x["lr"] == lr], key=lambda x: x["seed"])
                finals = [x["final"] for x in rs]
                if rank == 0 or (len(rs) > 1 and statistics.fmean(finals) > statistics.fmean(
                        [x["final"] for x in best[algo]])):
                    best[algo] = rs  # the better of the two by its seed mean, where both have run
                curve: dict[int, list[float]] = {}
                for x in rs:
                    for s, a in x["curve"]:
                        curve.setdefault(s, []).append(a)
                sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
                lines.append(f"| {algo} | {lr:g} | {len(rs)} | {statistics.fmean(finals):.3f} ± {sd:.3f} | "
                             f"{', '.join(f'{f:.3f}' for f in finals)} | "
                             f"{', '.join(f'{s}: {statistics.fmean(v):.3f}' for s, v in sorted(curve.items()))} | "
                             f"{statistics.fmean(x['wall_s'] for x in rs):.0f} | "
                             f"{', '.join(sorted({str((x.get('meta') or {}).get('commit')) for x in rs}))} |")
        if "sft" in best:
            lines += ["", "Each algorithm at its best rate minus SFT at its best, paired over the seeds both ran "
                      "(95% bootstrap interval over questions):", "", "| A − sft | lr A / lr sft | seeds | difference "
                      "| interval |", "|---|---|---|---|---|"]
            for algo, rs in best.items():
                if algo == "sft":
                    continue
                seeds = sorted({x["seed"] for x in rs} & {x["seed"] for x in best["sft"]})
                pick = lambda group: [_bits(x) for x in group if x["seed"] in seeds]  # noqa: E731
                d, lo, hi = paired(pick(rs), pick(best["sft"]))
                lines.append(f"| {algo} | {rs[0]['lr']:g} / {best['sft'][0]['lr']:g} | {len(seeds)} | {d:+.3f} | "
                             f"[{lo:+.3f}, {hi:+.3f}] |")
        lines.append("")
    if defaults:
        lines += ["## At the defaults", "", "README command 1's run (`" + LAUNCH + " +algo=ALGO [data=multipath] "
                  "seed=S`): every key at its default, the learning rate and step count included.", "",
                  "| setting | algorithm | steps | seeds | final, mean [min, max] | per seed | curve (mean) | "
                  "teacher prompt at the end | commits |", "|---|---|---|---|---|---|---|---|---|"]
        for key in sorted({(r["setting"], r["algo"]) for r in defaults}):
            rs = sorted([r for r in defaults if (r["setting"], r["algo"]) == key], key=lambda r: r["seed"])
            finals = [r["final"] for r in rs]
            curve: dict[int, list[float]] = {}
            for r in rs:
                for s, a in r["curve"]:
                    curve.setdefault(s, []).append(a)
            teach = [r["teacher_curve"][-1][1] for r in rs if r["teacher_curve"]]
            lines.append(f"| {key[0]} | {key[1]} | {rs[0]['steps']} | {len(rs)} | {statistics.fmean(finals):.3f} "
                         f"[{min(finals):.3f}, {max(finals):.3f}] | {', '.join(f'{f:.3f}' for f in finals)} | "
                         f"{', '.join(f'{s}: {statistics.fmean(v):.3f}' for s, v in sorted(curve.items()))} | "
                         f"{f'{statistics.fmean(teach):.3f}' if teach else ''} | "
                         f"{', '.join(sorted({str((r.get('meta') or {}).get('commit')) for r in rs}))} |")
        lines.append("")
    if results and plot(results, os.path.join(parent, f"{stem}_curves.png")):
        lines += [f"![held-out accuracy per step, one panel per setting and algorithm]({stem}_curves.png)", ""]
    lines.append("Commands: every result file's `command`; its `meta` gives the date, machine and commit it ran at.")
    text = "\n".join(lines) + "\n"
    write_files(parent, {f"{stem}.md": text})
    return text


def plot(results: list[dict], path: str) -> bool:
    """Seed-0 held-out curves, one line per rate (dashed: the teacher prompt), one panel per (setting,
    algorithm), into `path` (written aside, then renamed). False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    settings = [s for s in SETTINGS if any(r["setting"] == s for r in results)]
    algos = [a for a in ALGOS.split(",") if any(r["algo"] == a for r in results)]
    lrs = sorted({r["lr"] for r in results})
    fig, axes = plt.subplots(len(settings), len(algos), figsize=(3.4 * len(algos), 3.0 * len(settings)),
                             squeeze=False, sharey=True)
    for i, setting in enumerate(settings):
        for j, algo in enumerate(algos):
            ax = axes[i][j]
            for k, lr in enumerate(lrs):
                r = [x for x in results if (x["setting"], x["algo"], x["lr"], x["seed"]) == (setting, algo, lr, 0)]
                if not r:
                    continue
                ax.plot(*zip(*r[0]["curve"]), "-", color=f"C{k}", label=f"{lr:g}")
                if r[0]["teacher_curve"]:
                    ax.plot(*zip(*r[0]["teacher_curve"]), "--", color=f"C{k}", alpha=0.5)
            ax.set_title(f"{setting} {algo}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("held-out accuracy", fontsize=8)
            if ax.lines:
                ax.legend(fontsize=6, title="lr", title_fontsize=6)
    fig.tight_layout()
    tmp = f"{path}.{os.getpid()}.tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="arith,multipath")
    ap.add_argument("--algos", default=ALGOS)
    ap.add_argument("--lrs", default=LRS, help="the sweep's rates, in the order they run")
    ap.add_argument("--seeds", default="1,2", help="the seeds phase's seeds (seed 0 is the sweep's)")
    ap.add_argument("--phases", default="sweep,seeds", help="sweep, seeds, defaults (every key at its default, "
                    "with --default-seeds: README command 1's run)")
    ap.add_argument("--default-seeds", default="0,1,2")
    ap.add_argument("--seed-lrs", default="", help="the seeds phase runs these rates instead of each algorithm's "
                    "two best swept ones")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--teacher-steps", type=int, default=300, help="SFT steps of distill's teacher")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--keep", default=KEEP, help="runs and teachers (kept: a restart reuses a finished run)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run (e.g. a smoke run's "
                    "trainer.eval_examples=8); they are part of each run's identity")
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args()
    if args.render:
        print(render(args.results))
        return
    settings, algos = args.settings.split(","), args.algos.split(",")
    unknown = [s for s in settings if s not in SETTINGS] + [a for a in algos if a not in ALGOS.split(",")]
    if unknown:
        raise SystemExit(f"unknown setting or algorithm: {', '.join(unknown)} (settings: {', '.join(SETTINGS)}; "
                         f"algorithms: {ALGOS})")
    os.makedirs(args.keep, exist_ok=True)
    teachers: dict = {}
    if "sweep" in args.phases:
        for setting in settings:
            for lr in [float(x) for x in args.lrs.split(",")]:
                for algo in algos:
                    run(args, setting, algo, lr, 0, teachers)
    if "seeds" in args.phases:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for setting in settings:
                for algo in algos:
                    rates = ([float(x) for x in args.seed_lrs.split(",")] if args.seed_lrs else
                             best_lrs(load(args.results), setting, algo))
                    for lr in rates:
                        run(args, setting, algo, lr, seed, teachers)
    if "defaults" in args.phases:
        for seed in [int(s) for s in args.default_seeds.split(",")]:
            for setting in settings:
                for algo in algos:
                    run(args, setting, algo, None, seed, teachers)
    print(render(args.results))


if __name__ == "__main__":
    main()
