"""Benchmark: our inference Engine vs Hugging Face `model.generate`, greedy, same model, one run.

Claim measured: the lean decoder + KV cache + finished-row compaction beats HF generate on
rollout-shaped work. Two cases, each timed for both engines after a warm-up, median of repeats:
  (a) batch 1: one prompt, `--new-tokens` greedy tokens, no stop token;
  (b) batch 32: random prompt lengths in [8, 32] and rollout-like variable completion lengths.

How (b) gets variable lengths from a random-weight model: we first run HF greedy without any stop
token and take as "eos" the token id the model emits most often over all rows. Each row then
stops at its own first occurrence of that id (or runs to `--new-tokens`). Throughput counts, for
BOTH engines, only the tokens each row really produced, up to and including its stop token; HF's
post-stop padding is not counted. Both engines get the same max_new_tokens, and the greedy outputs
are checked to be identical.

Model: by default a tiny random Qwen3 built in-process (hidden 128, 4 layers, 4 heads, 4 KV
heads, head_dim 32, MLP 512, vocab 62, tied embeddings; ~1M parameters; initializer_range 0.2 so
greedy output is not one repeated token). `--model DIR` loads any local HF causal LM instead.

    python benchmarks/generate.py [--model DIR] [--new-tokens 128] [--repeats 5] [--compile] [--threads N]

Also timed: our engine forced onto the HF forward (`use_lean=False`, the path LoRA / quantized /
other architectures take), which shows what batching + compaction alone are worth.

Prints tokens/s per engine and case, the ratios, and last one JSON line with all figures.
Timing runs alternate HF / ours so that drifts of a shared machine hit both alike. On small VMs
(2 vCPUs) torch's default 2 OpenMP threads can make each parallel op cost milliseconds at times;
`--threads 1` gives steadier figures there.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference import Engine, SamplingParams  # noqa: E402
from models.loading import random_qwen3  # noqa: E402

SEED = 0
ROLLOUT_BATCH = 32
PROMPT_LEN_RANGE = (8, 32)  # inclusive, for the batch case
SINGLE_PROMPT_LEN = 16
TINY_INIT_RANGE = 0.2
# The first ids of the tiny char vocabulary are specials; prompts use the rest.
FIRST_PROMPT_ID = 3


def tiny_qwen3() -> Qwen3ForCausalLM:
    return random_qwen3(62, seed=SEED, hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512,
                        max_positions=512, initializer_range=TINY_INIT_RANGE).eval()


def random_prompts(n: int, lengths: tuple[int, int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED + 1)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(FIRST_PROMPT_ID, vocab, (s,), generator=g).tolist() for s in sizes]


def cut_at_stop(tokens: list[int], eos: int | None) -> list[int]:
    """A row's real output: up to and including its first eos."""
    if eos is not None and eos in tokens:
        return tokens[: tokens.index(eos) + 1]
    return tokens


def hf_generate(model, prompts: list[list[int]], new_tokens: int, eos: int | None) -> list[list[int]]:
    """HF greedy over a left-padded batch; returns each row's real output."""
    P = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
        min_new_tokens=0, eos_token_id=eos, pad_token_id=pad, top_k=None, top_p=None, temperature=None,
    )
    return [cut_at_stop(row, eos) for row in out[:, P:].tolist()]


def ours_generate(engine: Engine, prompts, new_tokens: int, eos: int | None) -> list[list[int]]:
    stops = (eos,) if eos is not None else ()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=stops)
    return [c.tokens for c in engine.generate(prompts, params)]


def timed_interleaved(fns: dict[str, Callable[[], list]], repeats: int) -> dict[str, tuple[float, list]]:
    """Median seconds and last outputs of each function over `repeats` interleaved rounds.

    One warm-up call each first; interleaving (a, b, c, a, b, c, ...) makes slow drifts of a
    shared machine hit every contender alike.
    """
    outputs = {name: fn() for name, fn in fns.items()}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            outputs[name] = fn()
            seconds[name].append(time.perf_counter() - start)
    return {name: (statistics.median(seconds[name]), outputs[name]) for name in fns}


def compare(name: str, model, engines: dict[str, Engine], prompts, new_tokens: int, eos,
            repeats: int) -> dict:
    """HF generate vs each engine on the same prompts; tokens/s counts only real output tokens."""
    fns = {"hf": lambda: hf_generate(model, prompts, new_tokens, eos)}
    for label, engine in engines.items():
        fns[label] = functools.partial(ours_generate, engine, prompts, new_tokens, eos)
    timed = timed_interleaved(fns, repeats)
    rate = {label: sum(map(len, out)) / secs for label, (secs, out) in timed.items()}
    hf_out, our_out = timed["hf"][1], timed["ours"][1]
    lengths = [len(o) for o in our_out]
    result = {f"{label}_tok_s": r for label, r in rate.items()}
    result.update({
        "speedup": rate["ours"] / rate["hf"], "identical": all(timed[k][1] == hf_out for k in engines),
        "tokens": sum(lengths), "min_len": min(lengths), "max_len": max(lengths),
    })
    if "ours_hf_path" in rate:
        result["speedup_hf_path"] = rate["ours_hf_path"] / rate["hf"]
    figures = ", ".join(f"{label} {r:.0f} tok/s ({timed[label][0] * 1e3:.0f} ms)" for label, r in rate.items())
    print(f"[{name}] {figures}; ours/HF x{result['speedup']:.2f}, greedy identical: "
          f"{result['identical']}, rows' lengths {min(lengths)}..{max(lengths)}")
    return result


def most_frequent_token(model, prompts, new_tokens: int) -> int:
    outputs = hf_generate(model, prompts, new_tokens, eos=None)
    return collections.Counter(t for row in outputs for t in row).most_common(1)[0][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="local HF model dir (default: tiny random Qwen3)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile our decode step")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"),
                        help="generate.json / generate.md go here ('' writes nothing)")
    args = parser.parse_args()
    from benchmarks.results_io import provenance

    meta = provenance()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = AutoModelForCausalLM.from_pretrained(args.model).eval() if args.model else tiny_qwen3()
    # Only the stop token we pass may stop HF (a loaded generation_config may carry its own eos).
    model.generation_config.eos_token_id = None
    engine = Engine(model, compile=args.compile)
    # Our loop (batching, compaction, sampling) around the HF forward: what non-lean models get.
    engines = {"ours": engine, "ours_hf_path": Engine(model, use_lean=False)}
    vocab = model.get_input_embeddings().num_embeddings
    print(f"model {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"params, lean decoder: {engine.lean_active()}, threads {torch.get_num_threads()}")

    single = random_prompts(1, (SINGLE_PROMPT_LEN, SINGLE_PROMPT_LEN), vocab)
    batch = random_prompts(ROLLOUT_BATCH, PROMPT_LEN_RANGE, vocab)
    eos = most_frequent_token(model, batch, args.new_tokens)
    print(f"batch-{ROLLOUT_BATCH} stop token (most frequent greedy output): {eos}")
    b1 = compare("batch 1", model, engines, single, args.new_tokens, None, args.repeats)
    b32 = compare(f"batch {ROLLOUT_BATCH}", model, engines, batch, args.new_tokens, eos, args.repeats)
    report = {
        "model": args.model or "tiny-qwen3", "new_tokens": args.new_tokens, "compile": args.compile,
        "lean": engine.lean_active(), "threads": torch.get_num_threads(), "repeats": args.repeats, "meta": meta,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "batch1": b1, f"batch{ROLLOUT_BATCH}": b32,
        "speedup_batch1": b1["speedup"], f"speedup_batch{ROLLOUT_BATCH}": b32["speedup"],
        "identical": b1["identical"] and b32["identical"],
    }
    if args.out:
        from benchmarks.results_io import write_report

        write_report(args.out, "generate", report, render)
    print(json.dumps(report))


def render(report: dict) -> str:
    """docs/results/generate.md from the run's JSON."""
    from benchmarks.results_io import provenance_lines

    lines = ["# Engine vs HF generate (generated by benchmarks/generate.py)", "", *provenance_lines(report.get("meta")),
             f"Model: {report['model']} ({report.get('params_m', 0):.2f}M parameters), lean decoder "
             f"{'on' if report['lean'] else 'off'}{', compiled' if report['compile'] else ''}; greedy, at most "
             f"{report['new_tokens']} new tokens, {report['threads']} thread(s), median of {report.get('repeats', '?')} "
             "interleaved rounds. tokens/s counts only each row's real output (up to and including its stop token); "
             "`ours (HF forward)` is our loop around the HF forward (`use_lean=False`).", "",
             "| case | HF generate tok/s | ours tok/s | ours (HF forward) tok/s | ours / HF | ours (HF forward) / HF "
             "| greedy identical | rows' lengths |", "|---|---|---|---|---|---|---|---|"]
    for key, case in (("batch1", "batch 1"), (f"batch{ROLLOUT_BATCH}", f"batch {ROLLOUT_BATCH}, variable lengths")):
        r = report[key]
        lines.append(f"| {case} | {r['hf_tok_s']:.0f} | {r['ours_tok_s']:.0f} | {r['ours_hf_path_tok_s']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['speedup_hf_path']:.2f}x | {r['identical']} | "
                     f"{r['min_len']}..{r['max_len']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
