"""Position-independent caching and Attuner: accuracy of every prefill mode, and time to first token.

Accuracy (`--skip-accuracy` to leave out): the embedded tiny model warm-started on `data=artifacts`
by full-prefill SFT, served greedily over held-out `artifacts` questions in each mode of
`inference/pic.py` -- full prefill (the reference), naive PIC, CacheBlend (15% recomputed), EPIC
(16 leading tokens per artifact), APE (no re-rotation), the full_scores diagnostic -- and Attuner
(naive PIC with the query-side adapter trained by `+algo=attuner`, one run per seed, cached in
`--workdir`), per query kind (single: one artifact provided; select: the question names one of
several; combine: two of several) and split (in-domain tables; held-out tables never in training).
Reported per cell: accuracy mean +- std over `--seeds` Attuner training seeds (the other modes are
deterministic: one value), and the share of the full-vs-PIC gap Attuner recovers on select.
Beside accuracy, the distribution gap, which does not need a model that solves the task: the mean
next-token KL(full prefill || student over the cache) in nats per token, and top-1 agreement, over
the held-out worked solutions (teacher-forced; Attuner's own objective), for naive PIC and each
Attuner seed, and the share of naive PIC's KL that Attuner removes ("KL closed", where PIC's KL is
at least KL_FLOOR). `--config` swaps the base model and task for every part, e.g. a pretrained
model: `--config model=hf model.path=DIR data.n_artifacts=4 data.artifact_rows=3` (its Attuner runs
take `--extra trainer.lr=...`).

Time to first token (`--skip-ttft`): one request of N artifacts (2, 4, 8, 16; `--artifact-tokens`
tokens each, random ids) + a `--query-tokens` query, on the tiny shape and a wider one (`--wide`),
artifacts already in the cache (their one-time encoding is reported apart). Timed: everything from
the request to the first token's logits -- writing the cached K/V with their relocation, any
recompute, and the query prefill. Modes run round-robin `--repeats` times; the median is kept.
One thread; last line JSON. Writes docs/results/attuner_ttft.{json,md} and
docs/results/attuner_accuracy-NAME.{json,md} (NAME: tiny, or `--name`), one file per finished
accuracy run under docs/results/attuner/NAME/ (a rerun skips those).

    python benchmarks/attuner.py                  # accuracy (trains attuner once per seed, cached) + TTFT
    python benchmarks/attuner.py --skip-accuracy  # TTFT only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from inference.pic import ArtifactCache, PICConfig, PICEngine, PICRequest  # noqa: E402

TTFT_MODES = ("full", "pic", "ape", "epic", "cacheblend")


# ----------------------------------------------------------------------------- time to first token


def ttft_model(shape: str):
    from models.loading import random_qwen3

    if shape == "tiny":  # the embedded default's shape (models/loading.py: TinySpec 128/4/4/512)
        return random_qwen3(64, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512, head_dim=32,
                            max_positions=4096).eval()
    hidden, layers, heads, inter = (int(x) for x in shape.split("x"))
    return random_qwen3(1024, hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=inter,
                        head_dim=hidden // heads, kv_heads=max(1, heads // 4), max_positions=4096).eval()


def measure_ttft(shape: str, counts, artifact_tokens: int, query_tokens: int, repeats: int) -> dict:
    model = ttft_model(shape)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(3, vocab, (artifact_tokens,), generator=g).tolist() for _ in range(max(counts))]
    query = torch.randint(3, vocab, (query_tokens,), generator=g).tolist()
    cache = ArtifactCache(model)
    start = time.perf_counter()
    cache.get_many(pool)
    encode_ms = (time.perf_counter() - start) * 1e3
    engines = {m: PICEngine(model, cache, PICConfig(mode=m)) for m in TTFT_MODES}
    out = {"shape": shape, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
           "encode_all_ms": encode_ms, "probe_kl": cache.probe_kl, "by_count": {}}
    for n in counts:
        request = [PICRequest.make([], pool[:n], query)]
        times = {m: [] for m in TTFT_MODES}
        for m in TTFT_MODES:  # warm-up
            engines[m].first_logits(request)
        for _ in range(repeats):
            for m in TTFT_MODES:
                engines[m].first_logits(request)
                times[m].append(engines[m].stats.ttft_s * 1e3)
        med = {m: statistics.median(v) for m, v in times.items()}
        out["by_count"][n] = {"ms": med, "speedup_vs_full": {m: med["full"] / med[m] for m in TTFT_MODES},
                              "context_tokens": n * artifact_tokens}
    return out


def print_ttft(res: dict) -> None:
    print(f"\n== time to first token, {res['shape']} ({res['params_m']:.1f}M params; artifacts pre-encoded: "
          f"{res['encode_all_ms']:.0f} ms for all, relocation check KL {res['probe_kl']:.1e}) ==")
    print(f"{'artifacts':>9} {'ctx tok':>7} " + " ".join(f"{m + ' ms':>13}" for m in TTFT_MODES)
          + "   x full (pic / ape / epic / cacheblend)")
    for n, row in res["by_count"].items():
        ms = " ".join(f"{row['ms'][m]:13.2f}" for m in TTFT_MODES)
        sp = " / ".join(f"{row['speedup_vs_full'][m]:.2f}" for m in TTFT_MODES[1:])
        print(f"{n:>9} {row['context_tokens']:>7} {ms}   {sp}")


# ----------------------------------------------------------------------------- accuracy

ACCURACY_MODES = ("full", "pic", "cacheblend", "epic", "ape", "full_scores")
KINDS = ("single", "select", "combine")
SPLITS = ("test", "test_ood")
DEFAULT_WORKDIR = os.path.expanduser("~/.cache/posttrain/bench-attuner")
KL_FLOOR = 1e-3  # nats/token: a naive-PIC KL below this is no gap to close (the "KL closed" row shows "-")
ACC_FLOOR = 0.05  # a full-vs-PIC accuracy gap below this is within the noise of 100 questions: no gap to recover


def base_model(overrides=()):
    """The model of `+algo=attuner data=artifacts` with `overrides` (default: the embedded tiny model
    warm-started on data=artifacts, built once and cached), its tokenizer and task."""
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.setup import build_task_from, load_model
    from trainer.warm_start import ensure

    cfg = load_config(["+algo=attuner", "data=artifacts", "logging.wandb=false", *overrides], config_schemas())
    ensure(cfg.model, World())
    model, tok = load_model(cfg.model, World())
    return model.eval(), tok, build_task_from(cfg.data, cfg.model)


def train(args, seed: int) -> str:
    """final/ of a `+algo=attuner` run with adapter seed and data order `seed` (cached in --workdir)."""
    extra = [*args.config, *args.extra]
    name = f"attuner-s{seed}-n{args.steps}" + ("-" + "-".join(extra) if extra else "")
    out = os.path.join(args.workdir, "".join(c if c.isalnum() or c in "-." else "_" for c in name))
    final = os.path.join(out, "final")
    if not os.path.exists(os.path.join(final, "attuner.json")):
        import subprocess

        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "+algo=attuner", "data=artifacts", f"seed={seed}",
               f"algo.seed={seed}", f"trainer.max_steps={args.steps}", f"trainer.eval_every={args.steps}",
               f"trainer.save_every={args.steps}", "trainer.eval_examples=50", "trainer.resume=never",
               "logging.wandb=false", "logging.progress=false", f"output_dir={out}", *extra]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.train_threads), WANDB_MODE="disabled")
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"attuner training failed:\n{proc.stderr[-3000:]}")
        print(f"trained attuner seed {seed} ({args.steps} steps) in {time.perf_counter() - started:.0f}s", flush=True)
    return final


def accuracy(server, tok, task, examples, max_new_tokens: int = 48) -> float:
    from inference.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    outs = server.generate([task.segments(ex) for ex in examples], params)
    return sum(task.verify(ex, tok.decode(o.tokens, skip_special_tokens=True)).correct
               for ex, o in zip(examples, outs)) / len(examples)


def measure_accuracy(args, kept=lambda name: None) -> dict:
    """Accuracy per prefill mode and per Attuner seed, and the distribution gap. Each part is one
    result file (`kept(name)`: its path, or None to keep nothing), so an interrupted run goes on."""
    from benchmarks.results_io import remembered
    from inference.pic import PICServer, load_query_adapter

    model, tok, task = base_model(args.config)
    sets = {(split, kind): task.examples_of(split, kind)[: args.eval_examples] for split in SPLITS for kind in KINDS}
    cells = {f"{kind}/{split}": ex for (split, kind), ex in sets.items()}
    batches: dict = {}

    def gap_of(student) -> dict:
        if not batches:  # the teacher's full-prefill states, made once per cell for every student
            batches.update({c: gap_batches(model, tok, task, ex) for c, ex in cells.items()})
        return {c: distribution_gap(student, b) for c, b in batches.items()}

    table: dict = {}
    provenance: dict = {}  # each kept run's own commit and date (results_io.remembered)
    for mode in args.modes:
        def run_mode(mode=mode):
            server = PICServer(model, tok, PICConfig(mode=mode), adapter={})
            return {c: accuracy(server, tok, task, ex) for c, ex in cells.items()}

        table[mode] = remembered(kept(f"mode-{mode}"), run_mode, provenance)
        print(f"{mode:>12}: " + "  ".join(f"{k} {v:.3f}" for k, v in table[mode].items()), flush=True)
    dist = {"pic": remembered(kept("kl-pic"), lambda: gap_of(model), provenance)}
    print("  kl pic: " + "  ".join(f"{c} {v[0]:.4f}/{v[1]:.3f}" for c, v in dist["pic"].items()), flush=True)
    runs = []
    for seed in range(args.seeds):
        def run_seed(seed=seed):
            from peft import PeftModel

            path = train(args, seed)
            server = PICServer(model, tok, PICConfig(mode="pic"), adapter=load_query_adapter(model, path))
            acc = {c: accuracy(server, tok, task, ex) for c, ex in cells.items()}
            student = PeftModel.from_pretrained(model, path).eval()
            try:
                return {"accuracy": acc, "kl": gap_of(student)}
            finally:
                student.unload()

        res = remembered(kept(f"attuner-s{seed}-n{args.steps}"), run_seed, provenance)
        runs.append(res["accuracy"])
        dist[f"attuner_s{seed}"] = res["kl"]
        print(f"  attuner s{seed}: " + "  ".join(f"{k} {v:.3f}" for k, v in runs[-1].items()), flush=True)
        print(f"  kl attuner s{seed}: " + "  ".join(f"{c} {v[0]:.4f}/{v[1]:.3f}" for c, v in res["kl"].items()),
              flush=True)
    att = [row for name, row in dist.items() if name.startswith("attuner")]
    # share of naive PIC's KL that Attuner removes; only where there is a gap to close (>= KL_FLOOR)
    kl_closed = {c: 1 - statistics.mean(r[c][0] for r in att) / dist["pic"][c][0]
                 if dist["pic"][c][0] >= KL_FLOOR else None for c in dist["pic"]} if att else {}
    table["attuner"] = {c: statistics.mean(r[c] for r in runs) for c in cells} if runs else {}
    table["attuner_std"] = {c: statistics.pstdev([r[c] for r in runs]) if len(runs) > 1 else 0.0
                            for c in cells} if runs else {}
    recovered = gap_recovered(table) if runs else {}
    return {"n_per_cell": args.eval_examples, "steps": args.steps, "seeds": args.seeds, "table": table,
            "attuner_runs": runs, "gap_recovered": recovered, "distribution_gap": dist, "kl_gap_closed": kl_closed,
            "runs": provenance}


def gap_recovered(table: dict) -> dict:
    """Per cell, the share of the full-vs-PIC accuracy gap that Attuner recovers; None where the gap
    is under ACC_FLOOR (nothing to recover beyond noise)."""
    out = {}
    for c in table["attuner"]:
        gap = table["full"][c] - table["pic"][c]
        out[c] = (table["attuner"][c] - table["pic"][c]) / gap if gap >= ACC_FLOOR else None
    return out


@torch.no_grad()
def gap_batches(model, tok, task, examples, batch: int = 16) -> list:
    """Attuner batches of `examples` (worked solutions as targets) with the frozen base's full-prefill
    teacher states filled in: made once per cell and read by every student."""
    from algorithms.attuner import Attuner, AttunerConfig
    from algorithms.base import RolloutContext

    algo = Attuner(AttunerConfig())
    ctx = RolloutContext(task, tok, torch.Generator().manual_seed(0), torch.device("cpu"), max_new_tokens=0,
                         policy_fn=lambda: model)
    return [algo.make_batch(examples[start : start + batch], ctx) for start in range(0, len(examples), batch)]


@torch.no_grad()
def distribution_gap(student, batches) -> tuple[float, float]:
    """(mean next-token KL(full prefill || student over the PIC cache) in nats per token, top-1
    agreement) over the target tokens of `batches` (gap_batches): Attuner's own objective,
    teacher-forced, on held-out rows. `student` is the plain base (= naive PIC) or a PeftModel with
    a trained q_proj adapter; the cache is always encoded by the base."""
    from algorithms.attuner import Attuner, AttunerConfig

    algo = Attuner(AttunerConfig())
    kl = agree = tokens = 0.0
    for micro in batches:
        out = algo.loss(student, micro, torch.tensor(1.0))
        n = float(micro.loss_mask.sum())
        kl += float(out.metrics["attuner/kl"]) * n
        agree += float(out.metrics["attuner/student_top1_agree"]) * n
        tokens += n
    return kl / tokens, agree / tokens


def print_accuracy(res: dict) -> None:
    cells = list(res["table"]["full"])
    print(f"\n== held-out accuracy, n={res['n_per_cell']} per cell (attuner: mean +- std of {res['seeds']} seeds, "
          f"{res['steps']} steps) ==")
    print(f"{'mode':>12} " + " ".join(f"{c:>15}" for c in cells))
    for mode in [m for m in res["table"] if m != "attuner_std"]:
        row = res["table"].get(mode)
        if not row:
            continue
        std = res["table"]["attuner_std"] if mode == "attuner" else {}
        print(f"{mode:>12} " + " ".join(f"{row[c]:>9.3f}" + (f" +-{std[c]:.2f}" if c in std else "      ") for c in cells))
    rec = res["gap_recovered"]
    print(f"{'gap closed':>12} " + " ".join(f"{rec[c]:>15.2f}" if rec.get(c) is not None else f"{'-':>15}" for c in cells))
    gap = res["distribution_gap"]
    print("\n== distribution gap to full prefill over the worked solutions: KL nats/token (top-1 agreement) ==")
    print(f"{'student':>12} " + " ".join(f"{c:>15}" for c in cells))
    for name, row in gap.items():
        print(f"{name:>12} " + " ".join(f"{row[c][0]:>7.1e} ({row[c][1]:.3f})" for c in cells))
    closed = res["kl_gap_closed"]
    if closed:
        print(f"{'KL closed':>12} " + " ".join(f"{closed[c]:>15.2f}" if closed[c] is not None else f"{'-':>15}"
                                               for c in cells))


# ----------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--artifact-tokens", type=int, default=64)
    ap.add_argument("--query-tokens", type=int, default=16)
    ap.add_argument("--wide", default="512x8x8x2048", help="HIDDENxLAYERSxHEADSxINTERMEDIATE of the wide shape")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="attuner training steps per seed")
    ap.add_argument("--eval-examples", type=int, default=100, help="held-out questions per kind and split")
    ap.add_argument("--workdir", default=DEFAULT_WORKDIR)
    ap.add_argument("--train-threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(ACCURACY_MODES), choices=ACCURACY_MODES,
                    help="base prefill modes whose accuracy is measured")
    ap.add_argument("--config", nargs="*", default=[],
                    help="config overrides for the base model and task, and the attuner runs (e.g. a real model: "
                         "model=hf model.path=DIR data.n_artifacts=4)")
    ap.add_argument("--extra", nargs="*", default=[], help="extra train.py overrides for the attuner runs only")
    ap.add_argument("--name", default=None,
                    help="the accuracy results' name (default: tiny without --config / --extra, else a hash of them)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"),
                    help="attuner_ttft.{json,md} and attuner_accuracy-NAME.{json,md} go here, one file per "
                         "finished accuracy run under attuner/NAME/ (a rerun skips those); '' writes nothing")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if not {"full", "pic"} <= set(args.modes):
        ap.error(f"--modes must include full and pic (the reference and the baseline), got {' '.join(args.modes)}")
    from benchmarks.results_io import provenance, write_report

    torch.set_num_threads(args.threads)
    name = args.name or results_name(args)
    meta = provenance()
    report: dict = {"threads": args.threads}
    if not args.skip_accuracy:
        def kept(part: str):
            return os.path.join(args.out, "attuner", name, part + ".json") if args.out else None

        res = measure_accuracy(args, kept)
        print_accuracy(res)
        report["accuracy"] = res
        if args.out:
            acc = {"name": name, "config": args.config, "extra": args.extra, "meta": meta, **res}
            write_report(args.out, f"attuner_accuracy-{name}", acc, render_accuracy)
    if not args.skip_ttft:
        report["ttft"] = []
        for shape in ("tiny", args.wide):
            res = measure_ttft(shape, args.counts, args.artifact_tokens, args.query_tokens, args.repeats)
            print_ttft(res)
            report["ttft"].append(res)
        if args.out:
            ttft = {"meta": meta, "threads": args.threads, "repeats": args.repeats, "artifact_tokens": args.artifact_tokens,
                    "query_tokens": args.query_tokens, "shapes": report["ttft"]}
            write_report(args.out, "attuner_ttft", ttft, render_ttft)
    print(json.dumps(report))


def results_name(args) -> str:
    """tiny for the default model, runs and eval size; otherwise a short hash of what changes them
    (so per-run files of another setting are never read back as this one's)."""
    defaults = parser().parse_args([])
    if not args.config and not args.extra and (args.steps, args.eval_examples) == (defaults.steps,
                                                                                    defaults.eval_examples):
        return "tiny"
    import hashlib

    key = [args.config, args.extra, args.steps, args.eval_examples]
    return "cfg-" + hashlib.sha1(json.dumps(key).encode()).hexdigest()[:8]


CELL_NAMES = {"single/test": "single", "select/test": "select", "combine/test": "combine",
              "single/test_ood": "single, held-out tables", "select/test_ood": "select, held-out",
              "combine/test_ood": "combine, held-out"}


def render_accuracy(res: dict) -> str:
    """docs/results/attuner_accuracy-NAME.md from its JSON."""
    from benchmarks.results_io import kept_runs_lines, provenance_lines

    table, cells = res["table"], list(res["table"]["full"])
    head = "| {} | " + " | ".join(CELL_NAMES.get(c, c) for c in cells) + " |"
    rule = "|" + "---|" * (1 + len(cells))
    setting = " ".join(res["config"]) or "the tiny default warm-started on data=artifacts"
    lines = [f"# PIC and Attuner accuracy: {res['name']} (generated by benchmarks/attuner.py)", "",
             *provenance_lines(res.get("meta")), *kept_runs_lines(res.get("runs") or {}),
             f"Model and task: {setting}; Attuner `+algo=attuner` {res['steps']} steps per seed"
             + (f" with `{' '.join(res['extra'])}`" if res["extra"] else "") + f", {res['seeds']} seeds. Greedy "
             f"accuracy on {res['n_per_cell']} held-out questions per cell.", "", head.format("mode"), rule]
    for mode, row in table.items():
        if mode in ("attuner_std",) or not row:
            continue
        std = table.get("attuner_std", {}) if mode == "attuner" else {}
        label = f"attuner ({res['seeds']} seeds, mean ± std)" if mode == "attuner" else mode
        lines.append("| " + " | ".join([label] + [f"{row[c]:.2f}" + (f" ± {std[c]:.2f}" if c in std else "")
                                                   for c in cells]) + " |")
    rec = res.get("gap_recovered") or {}
    if rec:
        lines.append(f"| share of the full-vs-PIC accuracy gap recovered (gap ≥ {ACC_FLOOR:g} only) | "
                     + " | ".join("—" if rec.get(c) is None else f"{rec[c]:.2f}" for c in cells) + " |")
    lines += ["", "Distribution gap to full prefill over the held-out worked solutions (teacher-forced, Attuner's "
                  "own objective): mean next-token KL(full prefill ‖ student over the cache) in nats per token, "
                  "top-1 agreement in brackets.", "", head.format("student"), rule]
    for student, row in res["distribution_gap"].items():
        lines.append("| " + " | ".join([student] + [f"{row[c][0]:.1e} ({row[c][1]:.3f})" for c in cells]) + " |")
    closed = res.get("kl_gap_closed") or {}
    if closed:
        lines.append(f"| share of PIC's KL removed (KL ≥ {KL_FLOOR:g} only) | "
                     + " | ".join("—" if closed.get(c) is None else f"{closed[c]:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render_ttft(res: dict) -> str:
    """docs/results/attuner_ttft.md from its JSON."""
    from benchmarks.results_io import provenance_lines

    lines = ["# Time to first token over cached artifacts (generated by benchmarks/attuner.py)", "",
             *provenance_lines(res.get("meta")),
             f"One request of N artifacts of {res['artifact_tokens']} random tokens and a {res['query_tokens']}-token "
             f"query, artifacts already cached; everything from the request to the first token's logits is timed "
             f"(writing and relocating the cached K/V, any recompute, the query prefill); {res['threads']} thread(s), "
             f"median of {res['repeats']} rounds run round-robin."]
    for shape in res["shapes"]:
        lines += ["", f"## {shape['shape']} ({shape['params_m']:.1f}M parameters)", "",
                  f"Encoding all artifacts once: {shape['encode_all_ms']:.0f} ms; relocation check KL "
                  f"{shape['probe_kl']:.1e}.", "",
                  "| artifacts | context tokens | " + " | ".join(f"{m} ms" for m in TTFT_MODES) + " | "
                  + " | ".join(f"{m} speedup" for m in TTFT_MODES[1:]) + " |", "|" + "---|" * (1 + 2 * len(TTFT_MODES))]
        for n, row in shape["by_count"].items():
            lines.append("| " + " | ".join([str(n), str(row["context_tokens"])]
                                           + [f"{row['ms'][m]:.2f}" for m in TTFT_MODES]
                                           + [f"{row['speedup_vs_full'][m]:.2f}x" for m in TTFT_MODES[1:]]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
