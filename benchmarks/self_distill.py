"""SFT-continued vs OPSD vs MASS vs TESD (and GRPO) from the same warm-started tiny model, same budget.

Every run of a setting starts from the same embedded warm-started model (built with seed 0; the
multipath setting has its own, warm-started on data=multipath) and trains `--steps` steps
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
        --eval-every 20                             # GRPO: 8 prompts x G=8, held-out curve every 20 steps
    python benchmarks/self_distill.py --long --keep ~/runs/long   # 300 steps, eval every 25, 3 seeds,
                                                    # sft/opsd/mass/tesd on arith and multipath; curves + PNG
    python benchmarks/self_distill.py --long --settings multipath --methods mass-m67 \
        --variant mass-m67=mass:algo.mask_ratio=0.67  # a configured variant as a method row of its own

Prints a table (accuracy mean +- std over seeds, tokens/s, wall time, diagnostics), then with more
than two evals per run the held-out curves (student and teacher prompt, mean +- std per eval step)
and the path diagnostics; writes `self_distill.json` and, with matplotlib, `self_distill_curves.png`
into the runs directory; last line JSON. A run that finished into the same `--keep` directory with
the same overrides is reused.

With `--long` every finished (setting, method, seed) run also writes its result to
`docs/results/self_distill/SETTING-METHOD-sSEED.json` (`--results DIR` elsewhere), with the overrides
it ran with; a restarted benchmark skips every run whose file holds the same overrides, so the long
runs (hours on 2 cores) accumulate across sessions. `docs/results/self_distill.md` (and its PNG) is
rendered from all the files there after every run; `--render` only rewrites it.

    nohup python benchmarks/self_distill.py --long --workers 1 > /tmp/long.log 2>&1 &
    python benchmarks/self_distill.py --render
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # benchmarks.results_io, also when another benchmark imports this one
    sys.path.insert(0, ROOT)
SETTINGS = {
    "arith": [],  # the embedded default: 2-digit operands, 2 chained operations
    "arith-hard": ["data.digits=3"],  # 3-digit operands: longer column working than the warm start saw
    "multipath": ["data=multipath"],  # 3 gains / losses in any valid order: several valid solution paths
}
# --long: the long setting (flags given on the command line win).
LONG = {"steps": 300, "eval_every": 25, "seeds": "0,1,2", "methods": "sft,opsd,mass,tesd",
        "settings": "arith,multipath"}
PATH_DIAGNOSTICS = ("paths/differs", "paths/on_tokens", "paths/agree_full_on", "paths/agree_full_off",
                    "paths/agree_views_on", "paths/agree_views_off", "paths/kept_on", "paths/kept_off")
CURVE_KEYS = ("accuracy", "teacher_accuracy", "path_differs", "path_differs_correct", "teacher_path_differs")
DIAGNOSTICS = PATH_DIAGNOSTICS + ("rollout/reward", "mass/kept_fraction", "mass/view_disagreement", "mass/correction",
               "tesd/reliability", "tesd/teacher_correct", "tesd/independence", "opsd/divergence", "mass/divergence",
               "tesd/divergence", "grpo/steps_correct", "grpo/answer_correct", "grpo/frac_zero_std")


def parse_variants(specs: list[str]) -> dict[str, tuple[str, list[str]]]:
    """--variant LABEL=ALGO:KEY=VALUE,KEY=VALUE -> {LABEL: (ALGO, overrides)}: a method row of its own."""
    out = {}
    for spec in specs:
        label, sep, rest = spec.partition("=")
        algo, colon, keys = rest.partition(":")
        if not sep or not label or not algo:
            raise SystemExit(f"--variant {spec!r}: expected LABEL=ALGO:KEY=VALUE[,KEY=VALUE...]")
        out[label] = (algo, [k for k in keys.split(",") if k] if colon else [])
    return out


def overrides(method: str, setting: str, seed: int, args, out: str) -> list[str]:
    method, variant = args.variants.get(method, (method, []))
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
    model = ["model=tiny_init"] if args.random_init else [f"model.path={args.model_paths[setting]}"]
    eval_every = args.eval_every or args.steps
    return pin_lr([f"+algo={method}", *model, *SETTINGS[setting], f"seed={seed}", f"output_dir={out}",
            f"trainer.max_steps={args.steps}", f"trainer.batch_size={batch}",
            f"trainer.micro_batch_size={min(batch, args.micro)}", *([f"trainer.lr={args.lr}"] if args.lr else []),
            f"trainer.warmup_steps={max(1, args.steps // 10)}", f"trainer.eval_every={eval_every}",
            f"trainer.save_every={args.steps}", f"trainer.eval_examples={args.eval_examples}",
            "trainer.resume=never", "logging.wandb=false", "logging.progress=false", *extra, *args.extra, *variant])


def pin_lr(argv: list[str]) -> list[str]:
    """`argv` with the learning rate its run resolves to written out (`trainer.lr=...`) where no override sets
    one: the rate is part of a run's identity, so a result measured at another default rate is run again,
    never reused (these runs measured at lr 1e-5 once, when a model.path made every unset rate the pretrained
    default)."""
    if any(a.startswith("trainer.lr=") for a in argv):
        return argv
    from algorithms import config_schemas
    from trainer.config import load_config

    with CONFIG_LOCK:  # Hydra's global state: one config load at a time across the worker threads
        cfg = load_config([a for a in argv if not a.startswith("output_dir=")], config_schemas())
    return [*argv, f"trainer.lr={cfg.trainer.lr:g}"]


CONFIG_LOCK = threading.Lock()


RESULTS = os.path.join(ROOT, "docs", "results", "self_distill")


def portable(argv: list[str]) -> list[str]:
    """The overrides with the model's cache path reduced to its recipe directory (tiny-<hash>), so the
    same run has the same key on every machine."""
    return [f"model.path={os.path.basename(a.split('=', 1)[1].rstrip('/'))}" if a.startswith("model.path=") else a
            for a in argv if not a.startswith("output_dir=")]


def result_path(results: str, setting: str, method: str, seed: int) -> str:
    return os.path.join(results, f"{setting}-{method}-s{seed}.json")


def run_one(job) -> dict:
    method, setting, seed, args, base = job
    argv = overrides(method, setting, seed, args, "OUT")
    key = hashlib.sha256(json.dumps(argv).encode()).hexdigest()[:8]  # another setting of the flags: another run
    record = result_path(args.results, setting, method, seed) if args.results else None
    if record and os.path.exists(record):
        earlier = json.load(open(record))
        if earlier.get("overrides") == portable(argv):
            print(f"  {setting:10s} {method:5s} seed {seed}: done earlier ({record}), skipped", flush=True)
            return earlier
        print(f"  {setting:10s} {method:5s} seed {seed}: {record} ran with other overrides; running again", flush=True)
    out = os.path.join(base, f"{setting}-{method}-{seed}-{key}")
    argv = [a.replace("output_dir=OUT", f"output_dir={out}") for a in argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    started = time.perf_counter()
    done = os.path.join(out, "wall_s")
    if os.path.exists(done):  # finished earlier into the same --keep directory: reuse it
        wall = float(open(done).read())
        proc = subprocess.CompletedProcess([], 0)
    else:
        shutil.rmtree(out, ignore_errors=True)  # an unfinished run starts over (train.py appends to metrics.jsonl)
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], env=env, capture_output=True,
                              text=True, cwd=ROOT)
        wall = time.perf_counter() - started
        if proc.returncode == 0:
            with open(done, "w") as fh:  # written last: the run's record that it finished
                fh.write(str(wall))
    if proc.returncode != 0:
        raise SystemExit(f"{setting}/{method}/seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    evals = [x for x in lines if x["split"] == "eval"]
    train = [x for x in lines if x["split"] == "train"]
    diag = {k: statistics.fmean(x[k] for x in train if k in x) for k in DIAGNOSTICS if any(k in x for x in train)}
    result = {"method": method, "setting": setting, "seed": seed, "before": evals[0]["accuracy"],
              "after": evals[-1]["accuracy"], "wall_s": wall, "curve": [(x["step"], x["accuracy"]) for x in evals],
              "curves": {k: [(x["step"], x[k]) for x in evals if k in x] for k in CURVE_KEYS},
              "tokens_per_s": statistics.fmean(x["tokens_per_s"] for x in train), **diag}
    # the path diagnostics over the first and the last quarter of the run: does the split move?
    quarter = max(1, len(train) // 4)
    for k in PATH_DIAGNOSTICS:
        for part, rows in (("first", train[:quarter]), ("last", train[-quarter:])):
            values = [x[k] for x in rows if k in x]
            if values:
                result[f"{k}@{part}"] = statistics.fmean(values)
    if any("rollout/generated_tokens" in x for x in train):  # GRPO: completion tokens sampled, cumulative at each eval
        result["generated_tokens"] = sum(x.get("rollout/generated_tokens", 0.0) for x in train)
        result["generated_curve"] = [(e["step"], sum(x.get("rollout/generated_tokens", 0.0) for x in train
                                                     if x["step"] <= e["step"])) for e in evals]
    if "teacher_accuracy" in evals[0]:
        result["teacher_before"], result["teacher_after"] = evals[0]["teacher_accuracy"], evals[-1]["teacher_accuracy"]
    print(f"  {setting:10s} {method:5s} seed {seed}: {result['before']:.3f} -> {result['after']:.3f}  "
          f"({wall:.0f}s)", flush=True)
    if record:
        result["overrides"] = portable(argv)
        from benchmarks.results_io import provenance, write_files

        result["meta"] = provenance()  # this run's own date, command and commit, kept with it

        write_files(os.path.dirname(record), {os.path.basename(record): json.dumps(result, indent=1)})  # once complete
        with RENDER_LOCK:  # parallel workers finish together: one rewrite of the table at a time
            render(args.results, *getattr(args, "render_text", ()))
    return result


RENDER_LOCK = threading.Lock()


def summarise(results: list[dict], settings: list[str], methods: list[str]) -> list[dict]:
    """One row per (setting, method) over the seeds run: final accuracy, curves, diagnostics."""
    table = []
    for s in settings:
        for m in methods:
            rs = [r for r in results if r["setting"] == s and r["method"] == m]
            if not rs:
                continue
            after, std = mean_std([r["after"] for r in rs])
            row = {"setting": s, "method": m, "before": statistics.fmean(r["before"] for r in rs),
                   "after_mean": after, "after_std": std, "after_per_seed": [r["after"] for r in rs],
                   "seeds": [r["seed"] for r in rs], "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rs),
                   "wall_s": statistics.fmean(r["wall_s"] for r in rs)}
            if all("generated_tokens" in r for r in rs):
                row["generated_tokens"] = statistics.fmean(r["generated_tokens"] for r in rs)
            for k in DIAGNOSTICS + ("teacher_before", "teacher_after") + tuple(
                    f"{k}@{part}" for k in PATH_DIAGNOSTICS for part in ("first", "last")):
                if all(k in r for r in rs):
                    row[k] = statistics.fmean(r[k] for r in rs)
            curves = [dict((int(step), acc) for step, acc in r["curve"]) for r in rs]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            row["curve"] = {step: statistics.fmean(c[step] for c in curves) for step in steps}
            row["curves"] = {k: curve_stats(rs, k) for k in CURVE_KEYS if curve_stats(rs, k)}
            # how far each seed ended below its own best eval (the decline the long runs are about)
            row["drop_from_best"] = max(max(acc for _, acc in r["curve"]) - r["after"] for r in rs)
            table.append(row)
    return table


def render(results_dir: str, title: str = "Long self-distillation runs (generated by benchmarks/self_distill.py --long)",
           intro: tuple[str, ...] = ()) -> str:
    """RESULTS_DIR.md (and, with matplotlib, RESULTS_DIR_curves.png) beside `results_dir`, from every result
    file in it: docs/results/self_distill -> docs/results/self_distill.md."""
    runs = [json.load(open(os.path.join(results_dir, f))) for f in sorted(os.listdir(results_dir))
            if f.endswith(".json")] if os.path.isdir(results_dir) else []
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    methods = list(dict.fromkeys(r["method"] for r in runs))
    table = summarise(runs, settings, methods)
    tokens = any("generated_tokens" in row for row in table)
    lines = [f"# {title}", "", *intro,
             "Each run: `python train.py` with the overrides in its result file "
             f"(docs/results/{os.path.basename(results_dir.rstrip('/'))}/), from the",
             "setting's shipped default model; held-out greedy accuracy (n = `trainer.eval_examples`). `worst drop`: the",
             "largest amount any seed ended below its own best eval. A run whose overrides name no `trainer.lr` ran at",
             "1e-5 (a `model.path` then made every unset rate the pretrained default; runs now write their rate)."
             + (" `generated`: completion tokens sampled per run (mean over seeds), every dynamic-sampling round"
                " included." if tokens else ""), "",
             "| setting | method | seeds | step 0 | end (mean ± std) | per seed | worst drop | teacher prompt start → end | "
             + ("generated | " if tokens else "") + "wall s |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if tokens else "") + "---|"]
    for row in table:
        teacher = (f"{row['teacher_before']:.3f} → {row['teacher_after']:.3f}" if "teacher_after" in row else "")
        generated = (f"{row['generated_tokens'] / 1e6:.2f} M | " if "generated_tokens" in row else "| ") if tokens else ""
        lines.append(f"| {row['setting']} | {row['method']} | {len(row['seeds'])} | {row['before']:.3f} | "
                     f"{row['after_mean']:.3f} ± {row['after_std']:.3f} | "
                     f"{' / '.join(f'{a:.3f}' for a in row['after_per_seed'])} | {row['drop_from_best']:.3f} | "
                     f"{teacher} | {generated}{row['wall_s']:.0f} |")
    for row in table:
        student = row["curves"].get("accuracy", {})
        if len(student) > 2:
            teacher = row["curves"].get("teacher_accuracy", {})
            lines += ["", f"**{row['setting']} / {row['method']}**: held-out accuracy per eval step (mean ± std over "
                      f"{len(row['seeds'])} seeds; teacher prompt)", "",
                      "| step | student | teacher prompt |", "|---|---|---|"]
            for step, (mean, std) in student.items():
                t = f"{teacher[step][0]:.3f} ± {teacher[step][1]:.3f}" if step in teacher else ""
                lines.append(f"| {step} | {mean:.3f} ± {std:.3f} | {t} |")
    from benchmarks.results_io import runs_by_commit, write_files

    lines += ["", *runs_by_commit(runs, lambda r: f"{r['setting']}/{r['method']} s{r['seed']}")]
    text = "\n".join(lines) + "\n"
    stem = results_dir.rstrip("/")
    write_files(os.path.dirname(stem) or ".", {os.path.basename(stem) + ".md": text})
    if table and any(len(row["curves"].get("accuracy", {})) > 1 for row in table):
        plot(table, stem + "_curves.png")
    return text


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def curve_stats(rs: list[dict], key: str) -> dict[int, tuple[float, float]]:
    """Mean and std over seeds of a curve, at the eval steps every seed has."""
    curves = [dict(r["curves"].get(key, [])) for r in rs]
    if not all(curves):
        return {}
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return {step: mean_std([c[step] for c in curves]) for step in steps}


def plot(table: list[dict], path: str) -> bool:
    """Held-out accuracy curves (mean +- std band over seeds; teacher prompt dashed), one panel per
    setting, into `path`. False (and a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return False
    settings = list(dict.fromkeys(row["setting"] for row in table))
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for i, row in enumerate(r for r in table if r["setting"] == setting):
            color = f"C{i}"
            for key, style, label in (("accuracy", "-", row["method"]), ("teacher_accuracy", "--", None)):
                curve = row["curves"].get(key, {})
                if not curve:
                    continue
                steps = sorted(curve)
                mean = [curve[s][0] for s in steps]
                std = [curve[s][1] for s in steps]
                ax.plot(steps, mean, style, color=color, label=label, alpha=1.0 if style == "-" else 0.6)
                if style == "-":
                    ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                                    color=color, alpha=0.15)
        ax.set_title(f"{setting}: held-out accuracy (dashed: teacher prompt)")
        ax.set_xlabel("step")
        ax.set_ylabel("greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = f"{path}.{os.getpid()}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true",
                    help=f"the long setting: {', '.join(f'{k}={v}' for k, v in LONG.items())} (explicit flags win)")
    ap.add_argument("--methods", default=None, help="default sft,opsd,mass,tesd")
    ap.add_argument("--settings", default=None, help=f"default arith,arith-hard; known: {', '.join(SETTINGS)}")
    ap.add_argument("--seeds", default=None, help="default 0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="default 40")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out eval every N steps (default: start and end)")
    ap.add_argument("--batch", type=int, default=16, help="rollouts (or SFT examples) per step")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None, help="one lr for all (default: each algorithm's own)")
    ap.add_argument("--teacher-rollouts", type=int, default=3)
    ap.add_argument("--group", type=int, default=8, help="GRPO completions per prompt")
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL=ALGO:KEY=VALUE,... a method of its own (name LABEL in --methods), e.g. "
                         "mass-m67=mass:algo.mask_ratio=0.67")
    ap.add_argument("--keep", default=None, help="directory for the runs (default: a temporary one)")
    ap.add_argument("--random-init", action="store_true", help="random tiny models, no warm start (smoke tests)")
    ap.add_argument("--results", default=None,
                    help="one JSON per finished run, skipped when found again (default with --long: docs/results/self_distill)")
    ap.add_argument("--render", action="store_true", help="only rewrite docs/results/self_distill.md from --results")
    args = ap.parse_args()
    if args.results is None and (args.long or args.render):
        args.results = RESULTS
    if args.render:
        print(render(args.results))
        return
    short = {"steps": 40, "eval_every": None, "seeds": "0,1,2", "methods": "sft,opsd,mass,tesd",
             "settings": "arith,arith-hard"}
    for key, value in (LONG if args.long else short).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    methods, settings = args.methods.split(","), args.settings.split(",")
    args.variants = parse_variants(args.variant)
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    base = os.path.expanduser(args.keep) if args.keep else tempfile.mkdtemp(prefix="self_distill_")
    os.makedirs(base, exist_ok=True)
    # One warm-started model per warm-up task for every run and seed (model.seed stays 0), built once.
    sys.path.insert(0, ROOT)
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.warm_start import ensure

    args.model_paths = {}
    if not args.random_init:
        for s in settings:
            model_cfg = load_config(["+algo=sft", "model=tiny", *SETTINGS[s]], config_schemas()).model
            args.model_paths[s] = ensure(model_cfg, World())
    jobs = [(m, s, seed, args, base) for s in settings for seed in seeds for m in methods]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(run_one, jobs))
    print(f"\n{len(jobs)} runs in {time.perf_counter() - started:.0f}s ({args.workers} side by side); "
          f"{args.steps} steps x {args.batch} rollouts each; accuracy on {args.eval_examples} held-out questions\n")
    print(f"{'setting':11s} {'method':6s} {'before':>7s} {'after (mean +- std)':>20s} {'tokens/s':>9s} {'wall s':>7s}  diagnostics")
    summary = DIAGNOSTICS[len(PATH_DIAGNOSTICS):] + ("teacher_before", "teacher_after")
    table = summarise(results, settings, methods)
    for row in table:
        diag = "  ".join(f"{k.split('/')[-1]}={row[k]:.3f}" for k in summary if k in row)
        print(f"{row['setting']:11s} {row['method']:6s} {row['before']:7.3f} {row['after_mean']:13.3f} +- "
              f"{row['after_std']:.3f} {row['tokens_per_s']:9.0f} {row['wall_s']:7.0f}  {diag}")
    for row in table:
        student, teacher = row["curves"].get("accuracy", {}), row["curves"].get("teacher_accuracy", {})
        if len(student) > 2:  # eval_every below --steps: the held-out curves
            print(f"\ncurve {row['setting']} {row['method']} (held-out accuracy, mean +- std over {len(seeds)} seeds)")
            print(f"  {'step':>5s} {'student':>15s} {'teacher prompt':>15s} {'path differs':>13s}")
            differs = row["curves"].get("path_differs", {})
            for step, (mean, std) in student.items():
                t = f"{teacher[step][0]:.3f} +- {teacher[step][1]:.3f}" if step in teacher else ""
                d = f"{differs[step][0]:.3f}" if step in differs else ""
                print(f"  {step:5d} {mean:.3f} +- {std:.3f} {t:>15s} {d:>13s}")
    path_rows = [row for row in table if any(k in row for k in PATH_DIAGNOSTICS)]
    if path_rows:
        print("\npath diagnostics (per train step, mean over the run | first quarter -> last quarter): teacher top "
              "token = the student's sampled token, on / off the reference's path; kept = MASS's gate")
        for row in path_rows:
            cells = []
            for k in PATH_DIAGNOSTICS:
                if k in row:
                    cells.append(f"{k.split('/')[-1]}={row[k]:.3f} ({row.get(k + '@first', float('nan')):.3f}->"
                                 f"{row.get(k + '@last', float('nan')):.3f})")
            print(f"  {row['setting']:10s} {row['method']:5s} " + "  ".join(cells))
    record = {"steps": args.steps, "eval_every": args.eval_every, "rollouts_per_step": args.batch, "seeds": seeds,
              "table": table}
    from benchmarks.results_io import write_files

    write_files(base, {"self_distill.json": json.dumps(record, indent=1)})
    png = os.path.join(base, "self_distill_curves.png")
    if any(len(row["curves"].get("accuracy", {})) > 1 for row in table) and plot(table, png):
        print(f"\ncurves: {png}")
    print(f"results: {os.path.join(base, 'self_distill.json')}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
