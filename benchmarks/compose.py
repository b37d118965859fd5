"""Benchmark: the runtime's fast paths stacked -- low-bit weights, a layer skipper's routes, SEED
speculation -- each alone, each pair and all three, against fp32 dense decoding.

Claim measured: decode tokens/s at batch 1, 8 and 32 of every combination, relative to fp32 dense plain
decoding; greedy output of each speculative row equal to its non-speculative row; held-out accuracy of
each row.

The models, trained once into --workdir (each stage a `train.py` run from the one before):
  seed    the 12-layer deepened warm start that benchmarks/speculative.py and skipper.py use, SEED-trained
          (its top `--decoder-layers` layers draft)
  qad     the SEED export quantized by QAD (`--format`, weight-only by default: speculation over
          activation-quantized weights is refused as inexact); it keeps the SEED drafter spec
  skip    a layer skipper over the SEED export (fp32 base)
  qskip   a layer skipper over the QAD export (low-bit base): the export that holds all three
Rows: fp32 = seed plain; lowbit = qad; skip = skip; seed = seed + SEED; lowbit+skip = qskip;
lowbit+seed = qad + SEED; skip+seed = skip + SEED; all three = qskip + SEED. Every row is opened
through the serving door (`load_served`). Accuracy and the equality checks run on the trained models;
the timings run on copies `--widen` times wider (benchmarks/skipper.py's `widen`: the same function
for the float rows; the low-bit rows are widened de-quantized and quantized again with the same scheme,
so their timing model can differ from the trained one by the re-quantization -- `wide_agreement`
says how often their greedy output agrees).

    python benchmarks/compose.py [--widen 4] [--batches 1 8 32] [--new-tokens 48] [--repeats 3]

Prints a table and, last, one JSON line; writes docs/results/compose.json and docs/results/compose.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

ROWS = {  # name -> (export, speculative)
    "fp32": ("seed", None), "lowbit": ("qad", None), "skip": ("skip", None), "seed": ("seed", "seed"),
    "lowbit+skip": ("qskip", None), "lowbit+seed": ("qad", "seed"), "skip+seed": ("skip", "seed"),
    "all three": ("qskip", "seed"),
}
RESULTS = os.path.join(ROOT, "docs", "results")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--decoder-layers", type=int, default=2, help="SEED: the top layers that draft")
    ap.add_argument("--seed-steps", type=int, default=300)
    ap.add_argument("--seed-lr", type=float, default=3e-4,
                    help="SEED's lr (its tiny-model value; model.path would otherwise give the pretrained 1e-5)")
    ap.add_argument("--qad-steps", type=int, default=200)
    ap.add_argument("--skip-steps", type=int, default=300)
    ap.add_argument("--format", default="W4A16", help="QAD's low-bit scheme (weight-only keeps speculation exact)")
    ap.add_argument("--widen", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=96, help="at most, per row (decoding stops at EOS)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eval-examples", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the timings")
    ap.add_argument("--train-threads", type=int, default=2)
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/posttrain/bench-compose"))
    ap.add_argument("--out", default=RESULTS, help="where compose.json and compose.md are written")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- the models


def stage(args, name: str, algo: str, source: str, *extra: str, steps: int) -> str:
    """final/ of one training stage, trained into --workdir unless it is there (a finished run's
    final/ is published whole by the trainer). A stage's directory is named after the chain of stages
    that made it, so a changed upstream stage never reuses a downstream one trained from the old."""
    parent = os.path.basename(os.path.dirname(source)) if os.path.basename(source) == "final" else ""
    out = os.path.join(args.workdir, f"{parent}.{name}-s{steps}" if parent else f"{name}-s{steps}")
    final = os.path.join(out, "final")
    if os.path.exists(os.path.join(final, "serving.json")):
        return final
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"+algo={algo}", "model=hf", f"model.path={source}",
           f"trainer.max_steps={steps}", f"trainer.eval_every={steps}", f"trainer.save_every={steps}",
           "trainer.eval_examples=50", "trainer.resume=never", "logging.wandb=false", "logging.progress=false",
           f"output_dir={out}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.train_threads), WANDB_MODE="disabled")
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} training failed:\n{proc.stderr[-3000:]}")
    print(f"{name}: {algo} ({steps} steps) in {time.perf_counter() - started:.0f} s", flush=True)
    return final


def models(args) -> dict[str, str]:
    from speculative import build_upscaled

    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.default_model import cache_path
    from trainer.distributed import World
    from trainer.warm_start import ensure

    base = os.path.join(args.workdir, f"upscaled-l{args.layers}")
    if not os.path.exists(base):
        cfg = load_config(["+algo=sft"], config_schemas())
        ensure(cfg.model, World())
        os.makedirs(args.workdir, exist_ok=True)
        build_upscaled(cache_path(cfg.model), args.layers, base)
    seed = stage(args, f"seed-lr{args.seed_lr:g}", "seed", base, f"algo.decoder_layers={args.decoder_layers}",
                 f"trainer.lr={args.seed_lr}", steps=args.seed_steps)
    qad = stage(args, f"qad-{args.format}", "qad", seed, f"algo.format={args.format}", steps=args.qad_steps)
    skip = stage(args, "skip", "skipper", seed, steps=args.skip_steps)
    qskip = stage(args, f"qskip-{args.format}", "skipper", qad, steps=args.skip_steps)
    return {"seed": seed, "qad": qad, "skip": skip, "qskip": qskip}


def dequantized(model):
    """A float copy of a model whose linears are LowBitLinear (weights q * scale), skipper kept."""
    from inference.lowbit import lowbit_modules
    from models.quant import dequantize_weight

    model = copy.deepcopy(model)
    for name, module in lowbit_modules(model).items():
        parent, _, child = name.rpartition(".")
        linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(dequantize_weight(module.q, module.weight_scale))
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        setattr(model.get_submodule(parent), child, linear)
    return model


def widened(model, factor: int):
    """`model` `factor` times wider (the timing copy); a low-bit model is widened de-quantized and
    quantized again with its scheme."""
    from skipper import widen

    from inference.lowbit import lowbit_modules, to_lowbit

    low = lowbit_modules(model)
    if not low:
        return widen(model, factor) if factor > 1 else model
    scheme = next(iter(low.values())).scheme
    from models.skipper import skipper_state

    wide = widen(dequantized(model), factor) if factor > 1 else dequantized(model)
    keep = ("lm_head", "model.layers.*.skipper") if skipper_state(wide) is not None else ("lm_head",)
    return to_lowbit(wide, scheme, keep=keep)  # the base's linears only


# ----------------------------------------------------------------------------- measurements


def main(argv=None) -> int:
    args = parse_args(argv)
    from inference import EngineConfig, SamplingParams
    from inference.serving import ServeOptions, load_served, serve_model
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.evaluation import evaluate
    from trainer.setup import build_task_from

    finals = models(args)
    torch.set_num_threads(args.threads)
    task = build_task_from(load_config(["+algo=sft"], config_schemas()).data)  # the task the models trained on
    examples = list(task.test_examples())[: args.eval_examples]
    servers = {row: load_served(finals[export], ServeOptions(speculative=spec)) for row, (export, spec) in ROWS.items()}
    tok = servers["fp32"].tokenizer
    prompts = [tok(task.prompt(ex), add_special_tokens=False).input_ids for ex in list(task.test_examples())[:max(args.batches)]]
    # greedy, stopping at EOS as served (speculative rows emit the same tokens as their plain rows, so
    # every row of an export decodes the same number of tokens)
    greedy = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    from benchmarks.results_io import provenance

    meta = provenance(__file__, argv)
    report: dict = {"args": vars(args), "meta": meta, "models": finals, "rows": {}}
    plain_out = {}
    for row, server in servers.items():
        acc = evaluate(server.model, tok, task, examples, World(), 128, engine=server)["accuracy"]
        out = [c.tokens for c in server.generate(prompts[:8], greedy)]
        entry = {"accuracy": acc}
        export, spec = ROWS[row]
        if spec is None:
            plain_out[export] = out
        else:
            entry["equal_to_plain"] = out == plain_out[export]
            entry["mean_accepted"] = round(server.stats.mean_accepted, 3)
        report["rows"][row] = entry
        print(f"{row}: accuracy {acc:.3f}", flush=True)

    # timings on the widened copies, the rows in turn (a slow spell hits all alike)
    wide_models = {export: widened(servers[next(r for r, (e, s) in ROWS.items() if e == export and s is None)].model,
                                   args.widen) for export in finals}
    wide = {row: serve_model(wide_models[export], ServeOptions(speculative=spec, engine=EngineConfig()))
            for row, (export, spec) in ROWS.items()}
    for row, (export, spec) in ROWS.items():
        if spec is None:  # how often the wide timing copy says what the trained model says
            mine = [c.tokens for c in wide[row].generate(prompts[:8], greedy)]
            report["rows"][row]["wide_agreement"] = sum(a == b for a, b in zip(mine, plain_out[export])) / 8
    for batch in args.batches:
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        best = {row: float("inf") for row in ROWS}
        tokens = {}
        for _ in range(args.repeats):
            for row, server in wide.items():
                start = time.perf_counter()
                done = server.generate(rows, greedy)
                best[row] = min(best[row], time.perf_counter() - start)
                tokens[row] = sum(len(c.tokens) for c in done)
        base = tokens["fp32"] / best["fp32"]
        for row in ROWS:
            rate = tokens[row] / best[row]
            report["rows"][row][f"tok_s_b{batch}"] = round(rate, 1)
            report["rows"][row][f"x_fp32_b{batch}"] = round(rate / base, 3)
        print(f"batch {batch}: " + ", ".join(f"{r} {report['rows'][r][f'x_fp32_b{batch}']:.2f}x" for r in ROWS), flush=True)
    if args.out:
        from benchmarks.results_io import write_report

        write_report(args.out, "compose", report, render)
    print(json.dumps(report))
    return 0


def render(report: dict) -> str:
    """docs/results/compose.md from the run's JSON."""
    from benchmarks.results_io import provenance_lines

    args = argparse.Namespace(**report["args"])
    head = "| row | accuracy | " + " | ".join(f"tok/s b{b} | x fp32 b{b}" for b in args.batches)
    head += " | spec = plain | accepted | wide agreement |"
    lines = ["# Fast paths composed (generated by benchmarks/compose.py)", "", *provenance_lines(report.get("meta")),
             f"{args.layers}-layer deepened warm start, SEED (top {args.decoder_layers} layers draft), QAD {args.format}, a layer "
             f"skipper; timings on copies {args.widen}x wider, greedy to EOS (at most {args.new_tokens} new tokens), "
             f"best of {args.repeats}, "
             f"{args.threads} thread(s); accuracy on {args.eval_examples} held-out arith questions, greedy.", "",
             head, "|" + "---|" * (5 + 2 * len(args.batches))]
    for row, r in report["rows"].items():
        cells = [row, f"{r['accuracy']:.3f}"]
        for b in args.batches:
            cells += [f"{r[f'tok_s_b{b}']:.1f}", f"{r[f'x_fp32_b{b}']:.2f}x"]
        cells += [str(r.get("equal_to_plain", "")), str(r.get("mean_accepted", "")), str(r.get("wide_agreement", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
