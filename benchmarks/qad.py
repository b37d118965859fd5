"""Quantization-aware distillation, side by side in one run: accuracy of every schedule after export
and reload in our runtime, and the speed and size of the runtime's low-bit path.

Part 1, accuracy (the warm-started embedded default, 4 blocks of width 128): for each format
(`--formats`, default W8A8, W4A8, W4A4) and seed (`--seeds`), at equal steps (`--steps`) and batch:

  FP           the full-precision starting model (our engine);
  PTQ          round-to-nearest (`algo.schedule=ptq`, no training);
  QAT          cross-entropy on worked solutions (`qat`);
  QAD          whole-model KL(teacher || student) from step 0 (`qad`);
  Theseus      segments of 1, 2 blocks matched to the teacher, then whole-model KL (`theseus`);
  Theseus-QAT  the Theseus stages as a warm-up for half the steps, then QAT (`theseus_qat`);
  FP-SFT       the full-precision model trained with SFT for the same steps (`--fp-sft`): the
               reference for QAT, which also trains on the task's worked solutions;

each exported (compressed-tensors), reloaded through the serving door (`inference.serving.load_served`: the low-bit path) and scored
greedily on held-out `arith` questions through the integer matmuls (`acc`); beside it the
in-memory fake-quant model's accuracy as the trainer evaluates it (`fq`) and the share of prompts
whose greedy completion is identical in both (`same`). Theseus runs also report the per-block output error (nmse given the
teacher's input) measured at the end of each stage.

Part 2, the runtime's low-bit path on a wider model (`--wide-hidden`, default 512; random weights,
the speed and size do not depend on them): packed weight bytes of the quantized layers vs fp32, and
prefill / decode tokens/s of the exported model vs the full-precision one at batch 1 and 32
(best of `--repeats` round-robin passes, one thread), with greedy tokens of the export compared to
the fake-quant model's.

    python benchmarks/qad.py                                   # everything (tens of minutes on 2 cores)
    python benchmarks/qad.py --formats W8A8 --seeds 0 --steps 30 --skip-speed
    python benchmarks/qad.py --skip-accuracy                   # part 2 only

Last line: one JSON object with every figure. Each finished run (a seed of a schedule and format, the FP
references, a format's speed) is also written as one JSON file under `--results` (docs/results/qad/, a
folder per setting), and a rerun with the same settings skips the runs found there, so an interrupted
benchmark goes on where it stopped; docs/results/qad.json and qad.md (the tables) are rendered at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.results_io import kept_runs_lines, provenance, provenance_lines, remembered, write_report  # noqa: E402

METHODS = {"QAT": "qat", "QAD": "qad", "Theseus": "theseus", "Theseus-QAT": "theseus_qat"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="W8A8,W4A8,W4A4")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-n", type=int, default=100, help="held-out questions per accuracy")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--wide-hidden", type=int, default=512)
    p.add_argument("--wide-layers", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fp-sft", action=argparse.BooleanOptionalAction, default=True,
                   help="also train the full-precision model with SFT for the same steps (a reference for QAT)")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--results", default=os.path.join(ROOT, "docs", "results", "qad"),
                   help="one JSON file per finished run, under a folder named by the settings; a rerun skips the "
                        "runs found there ('' keeps nothing); qad.json and qad.md (the tables) go beside the folder")
    return p.parse_args(argv)


def run_dirs(args) -> tuple[str | None, str | None]:
    """The folders of this invocation's per-run files: one per accuracy setting, one per speed setting."""
    if not args.results:
        return None, None
    acc = f"accuracy-steps{args.steps}-b{args.batch_size}-lr{args.lr:g}-n{args.eval_n}-t{args.max_new_tokens}"
    speed = f"speed-h{args.wide_hidden}x{args.wide_layers}-p{args.prefill_len}-d{args.decode_tokens}-r{args.repeats}"
    return os.path.join(args.results, acc), os.path.join(args.results, speed)


# --- part 1: accuracy ------------------------------------------------------------------------------------


def train_and_export(overrides: list[str], out: str, algo: str = "qad"):
    """One in-process training run (`train.py` without the process): returns (session, final dir)."""
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final
    from trainer.warm_start import ensure

    cfg = load_config([f"+algo={algo}", f"output_dir={out}", "logging.wandb=false", "logging.progress=false",
                       "trainer.eval_examples=4", "trainer.eval_max_new_tokens=4", "trainer.eval_every=100000",
                       "trainer.save_every=100000", "trainer.resume=never", *overrides], config_schemas())
    world = World()
    ensure(cfg.model, world)
    session = build_session(cfg, world)
    assert fit(session) == "done"
    session.tracker.close()
    return session, export_final(session)


def greedy(model, tokenizer, prompts, max_new_tokens, use_lean):
    from inference import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    return [list(o.tokens) for o in Engine(model, EngineConfig(use_lean=use_lean)).generate(prompts, params)]


def score(task, tokenizer, examples, completions) -> float:
    ok = [task.verify(ex, tokenizer.decode(c, skip_special_tokens=True)).correct for ex, c in zip(examples, completions)]
    return sum(ok) / len(ok)


def stage_errors(out: str, num_layers: int) -> list[list[float]]:
    """The per-block errors before training (the first measurement, on the round-to-nearest student),
    then per stage those of its last measurement (metrics.jsonl)."""
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    first, last = None, {}
    for r in rows:
        if r.get("split") == "train" and "qad/block_error/0" in r:
            errors = [round(r[f"qad/block_error/{i}"], 5) for i in range(num_layers)]
            first = errors if first is None else first
            last[int(r["qad/stage"])] = errors
    return [first] + [last[s] for s in sorted(last)]


def accuracy_part(args, work: str, kept_meta: dict | None = None) -> dict:
    import torch

    from inference.serving import load_served
    from models.anatomy import decoder_layers
    from models.loading import load_pretrained
    from trainer.config import load_config
    from algorithms import config_schemas
    from trainer import default_model
    from trainer.setup import build_task_from

    base = load_config(["+algo=qad"], config_schemas())
    from trainer.distributed import World
    from trainer.warm_start import ensure

    ensure(base.model, World())
    start, tokenizer = load_pretrained(default_model.cache_path(base.model))
    task = build_task_from(base.data)
    examples = list(task.test_examples())[: args.eval_n]
    prompts = [tokenizer(task.prompt(ex), add_special_tokens=False).input_ids for ex in examples]
    num_layers = len(decoder_layers(start))
    keep, _ = run_dirs(args)
    at = (lambda name: os.path.join(keep, name + ".json")) if keep else (lambda name: None)
    fp = remembered(at("fp"), lambda: score(task, tokenizer, examples,
                                            greedy(start, tokenizer, prompts, args.max_new_tokens, None)), kept_meta)
    print(f"FP accuracy {fp:.3f} (n={len(examples)})", flush=True)
    common = [f"trainer.batch_size={args.batch_size}", f"trainer.micro_batch_size={args.batch_size}",
              f"trainer.lr={args.lr}", "trainer.warmup_steps=5", f"algo.block_error_every={max(1, args.steps // 12)}"]
    table: dict = {"FP": fp, "formats": {}}
    if args.fp_sft:  # the same steps of plain SFT on the full-precision model: what training on the task adds
        accs = []
        for seed in map(int, args.seeds.split(",")):
            def sft_run(seed=seed):
                out = os.path.join(work, f"sft-{seed}")
                _, final = train_and_export([f"trainer.max_steps={args.steps}", f"seed={seed}", *common[:-1]], out, "sft")
                model = load_served(final).model
                acc = score(task, tokenizer, examples, greedy(model, tokenizer, prompts, args.max_new_tokens, None))
                shutil.rmtree(out, ignore_errors=True)
                return acc

            accs.append(remembered(at(f"fp-sft-s{seed}"), sft_run, kept_meta))
            print(f"FP-SFT seed {seed}: {accs[-1]:.3f}", flush=True)
        table["FP-SFT"] = {"acc": accs, "acc_mean": statistics.mean(accs)}
    for fmt in filter(None, args.formats.split(",")):
        entry: dict = {}
        runs = [("PTQ", "ptq", 0)] + [(m, s, seed) for m, s in METHODS.items() for seed in map(int, args.seeds.split(","))]
        for label, schedule, seed in runs:
            def quantized_run(fmt=fmt, schedule=schedule, seed=seed):
                out = os.path.join(work, f"{fmt}-{schedule}-{seed}")
                steps = 0 if schedule == "ptq" else args.steps
                started = time.perf_counter()
                session, final = train_and_export([f"algo.format={fmt}", f"algo.schedule={schedule}",
                                                   f"trainer.max_steps={steps}", f"seed={seed}", *common], out)
                fq_model = session.backend.full_model().eval()
                fq_out = greedy(fq_model, tokenizer, prompts, args.max_new_tokens, None)  # lean: the trainer's eval path
                served = load_served(final).model  # the serving door: the low-bit path
                rt_out = greedy(served, tokenizer, prompts, args.max_new_tokens, True)
                result = {"acc": score(task, tokenizer, examples, rt_out), "fq": score(task, tokenizer, examples, fq_out),
                          "same": sum(a == b for a, b in zip(rt_out, fq_out)) / len(prompts),
                          "seconds": round(time.perf_counter() - started, 1)}
                if schedule in ("theseus", "theseus_qat"):
                    result["stage_block_error"] = stage_errors(out, num_layers)
                shutil.rmtree(out, ignore_errors=True)
                return result

            result = remembered(at(f"{fmt}-{schedule}-s{seed}"), quantized_run, kept_meta)
            entry.setdefault(label, []).append(result)
            print(f"{fmt} {label:12s} seed {seed}: {json.dumps(result)}", flush=True)
        table["formats"][fmt] = {
            label: {"acc_mean": statistics.mean(r["acc"] for r in rs), "fq_mean": statistics.mean(r["fq"] for r in rs),
                    "acc": [r["acc"] for r in rs], "same_mean": statistics.mean(r["same"] for r in rs),
                    **({"stage_block_error": rs[0]["stage_block_error"]} if "stage_block_error" in rs[0] else {})}
            for label, rs in entry.items()}
    torch.set_num_threads(args.threads)
    return table


# --- part 2: speed and size of the low-bit path ------------------------------------------------------------


def speed_part(args, work: str, kept_meta: dict | None = None) -> dict:
    import torch

    from inference import Engine, EngineConfig, SamplingParams
    from inference.serving import load_served
    from models.loading import random_qwen3
    from models.quant import QuantScheme, apply_fake_quant
    from models.quant_export import export_compressed, packed_weight_bytes
    from models.tokenizer import build_char_tokenizer

    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    H = args.wide_hidden
    fp = random_qwen3(len(tok), hidden_size=H, num_layers=args.wide_layers, num_heads=H // 64,
                      intermediate_size=3 * H, max_positions=args.prefill_len + args.decode_tokens + 8,
                      initializer_range=0.05).eval()
    results: dict = {"model": {"hidden": H, "layers": args.wide_layers, "intermediate": 3 * H}, "formats": {}}
    _, keep = run_dirs(args)

    def measure(fmt: str) -> dict:
        import copy

        # prompts drawn per format, so a rerun that skips a finished format times the others on the
        # prompts an uninterrupted run would have used
        gen = torch.Generator().manual_seed(zlib.crc32(fmt.encode()))
        fq = copy.deepcopy(fp)
        apply_fake_quant(fq, QuantScheme.parse(fmt))
        out = os.path.join(work, f"wide-{fmt}")
        export_compressed(fq, tok, out)
        served = load_served(out).model
        sizes = packed_weight_bytes(out)
        row: dict = {"weight_bytes_ratio": sizes["quantized_bytes"] / sizes["fp32_bytes"]}
        for batch in (1, 32):
            prompts = torch.randint(3, len(tok), (batch, args.prefill_len), generator=gen).tolist()
            timings = {"fp": {}, "lowbit": {}}
            for _ in range(args.repeats):  # round robin: a slow spell hits both alike
                for name, model in (("fp", fp), ("lowbit", served)):
                    for phase, new in (("prefill", 1), ("decode", args.decode_tokens)):
                        engine = Engine(model, EngineConfig(use_lean=True))
                        params = SamplingParams(max_new_tokens=new, temperature=0.0)
                        t0 = time.perf_counter()
                        engine.generate(prompts, params)
                        timings[name].setdefault(phase, []).append(time.perf_counter() - t0)
            for name in timings:
                pre = min(timings[name]["prefill"])
                dec = max(min(timings[name]["decode"]) - pre, 1e-9)  # decode steps beyond the prefill
                timings[name] = {"prefill_tok_s": batch * args.prefill_len / pre,
                                 "decode_tok_s": batch * (args.decode_tokens - 1) / dec}
            row[f"batch{batch}"] = {**timings,
                                    "prefill_speedup": timings["lowbit"]["prefill_tok_s"] / timings["fp"]["prefill_tok_s"],
                                    "decode_speedup": timings["lowbit"]["decode_tok_s"] / timings["fp"]["decode_tok_s"]}
        prompts = torch.randint(3, len(tok), (8, 32), generator=gen).tolist()
        a = greedy(served, tok, prompts, 24, True)
        b = greedy(fq, tok, prompts, 24, None)
        row["greedy_same_as_fake_quant"] = sum(x == y for x, y in zip(a, b)) / len(prompts)
        return row

    for fmt in filter(None, args.formats.split(",")):
        results["formats"][fmt] = remembered(os.path.join(keep, f"{fmt}.json") if keep else None,
                                             lambda fmt=fmt: measure(fmt), kept_meta)
        print(f"{fmt}: {json.dumps(results['formats'][fmt])}", flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="bench-qad-")
    out: dict = {"args": vars(args), "meta": provenance(__file__, argv), "runs": {}}
    try:
        if not args.skip_accuracy:
            out["accuracy"] = accuracy_part(args, work, out["runs"])
        if not args.skip_speed:
            out["speed"] = speed_part(args, work, out["runs"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.results:
        write_tables(out, os.path.dirname(os.path.abspath(args.results)))
    print("\n" + render(out))
    print(json.dumps(out))
    return 0


def render(out: dict) -> str:
    """qad.md: the accuracy and speed tables of a run, from its JSON."""
    a = out["args"]
    lines = ["# Quantization-aware distillation (generated by benchmarks/qad.py)", "", *provenance_lines(out.get("meta")),
             *kept_runs_lines(out.get("runs") or {})]
    if "accuracy" in out:
        t = out["accuracy"]
        labels = ["PTQ", *METHODS]
        sft = f"; the FP model after the same steps of SFT: {t['FP-SFT']['acc_mean']:.3f}" if "FP-SFT" in t else ""
        lines += [f"Held-out accuracy (n = {a['eval_n']}, greedy) of each export reloaded through the serving door "
                  f"(the low-bit path), mean over seeds {a['seeds']}; the fake-quant model as the trainer evaluates "
                  f"it in brackets. {a['steps']} steps, batch {a['batch_size']}, lr {a['lr']:g}. FP (the starting "
                  f"model): {t['FP']:.3f}{sft}.", "",
                  "| format | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for fmt, entry in t["formats"].items():
            lines.append(f"| {fmt} | " + " | ".join(
                f"{entry[l]['acc_mean']:.3f} ({entry[l]['fq_mean']:.3f})" for l in labels if l in entry) + " |")
    if "speed" in out:
        m = out["speed"]["model"]
        lines += ["", f"The low-bit path on a {m['hidden']}-wide, {m['layers']}-block random model, "
                      f"{a['threads']} thread(s), best of {a['repeats']}: tokens/s low-bit / fp32 (speedup).", "",
                  "| format | weight bytes vs fp32 | prefill b1 | decode b1 | prefill b32 | decode b32 | greedy = fake-quant |",
                  "|---|---|---|---|---|---|---|"]
        for fmt, r in out["speed"]["formats"].items():
            cells = []
            for b in (1, 32):
                for phase in ("prefill", "decode"):
                    x = r[f"batch{b}"]
                    cells.append(f"{x['lowbit'][phase + '_tok_s']:.0f} / {x['fp'][phase + '_tok_s']:.0f} "
                                 f"({x[phase + '_speedup']:.2f}x)")
            lines.append(f"| {fmt} | {r['weight_bytes_ratio']:.3f} | " + " | ".join(cells)
                         + f" | {r['greedy_same_as_fake_quant']:.2f} |")
    return "\n".join(lines) + "\n"


def write_tables(out: dict, where: str) -> None:
    """qad.json and qad.md under `where`, each written aside and renamed into place."""
    write_report(where, "qad", out, render)


if __name__ == "__main__":
    sys.exit(main())
