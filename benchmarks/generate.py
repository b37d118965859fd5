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

Prints tokens/s per engine and case, the ratios, and last one JSON line with all figures.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference import Engine, SamplingParams  # noqa: E402

SEED = 0
ROLLOUT_BATCH = 32
PROMPT_LEN_RANGE = (8, 32)  # inclusive, for the batch case
SINGLE_PROMPT_LEN = 16
TINY_INIT_RANGE = 0.2
# The first ids of the tiny char vocabulary are specials; prompts use the rest.
FIRST_PROMPT_ID = 3


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(SEED)
    config = Qwen3Config(
        vocab_size=62, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=512, initializer_range=TINY_INIT_RANGE,
    )
    return Qwen3ForCausalLM(config).eval()


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


def timed_pair(fn_a, fn_b, repeats: int) -> tuple[float, list, float, list]:
    """Median seconds of two functions over `repeats` interleaved runs, after one warm-up each.

    Interleaving (a, b, a, b, ...) makes slow drifts of a shared machine hit both alike.
    """
    out_a, out_b = fn_a(), fn_b()
    secs_a, secs_b = [], []
    for _ in range(repeats):
        for fn, secs in ((fn_a, secs_a), (fn_b, secs_b)):
            start = time.perf_counter()
            out = fn()
            secs.append(time.perf_counter() - start)
            out_a, out_b = (out, out_b) if fn is fn_a else (out_a, out)
    return statistics.median(secs_a), out_a, statistics.median(secs_b), out_b


def compare(name: str, model, engine, prompts, new_tokens: int, eos, repeats: int) -> dict:
    hf_s, hf_out, our_s, our_out = timed_pair(
        lambda: hf_generate(model, prompts, new_tokens, eos),
        lambda: ours_generate(engine, prompts, new_tokens, eos), repeats,
    )
    hf_tokens, our_tokens = sum(map(len, hf_out)), sum(map(len, our_out))
    lengths = [len(o) for o in our_out]
    result = {
        "hf_tok_s": hf_tokens / hf_s, "ours_tok_s": our_tokens / our_s,
        "speedup": (our_tokens / our_s) / (hf_tokens / hf_s), "identical": hf_out == our_out,
        "tokens": our_tokens, "min_len": min(lengths), "max_len": max(lengths),
    }
    print(f"[{name}] HF {result['hf_tok_s']:.0f} tok/s ({hf_s * 1e3:.0f} ms), ours "
          f"{result['ours_tok_s']:.0f} tok/s ({our_s * 1e3:.0f} ms), x{result['speedup']:.2f}, "
          f"greedy identical: {result['identical']}, rows' lengths {min(lengths)}..{max(lengths)}")
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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = AutoModelForCausalLM.from_pretrained(args.model).eval() if args.model else tiny_qwen3()
    engine = Engine(model, compile=args.compile)
    vocab = model.get_input_embeddings().num_embeddings
    print(f"model {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"params, lean decoder: {engine.lean_active()}, threads {torch.get_num_threads()}")

    single = random_prompts(1, (SINGLE_PROMPT_LEN, SINGLE_PROMPT_LEN), vocab)
    batch = random_prompts(ROLLOUT_BATCH, PROMPT_LEN_RANGE, vocab)
    eos = most_frequent_token(model, batch, args.new_tokens)
    print(f"batch-{ROLLOUT_BATCH} stop token (most frequent greedy output): {eos}")
    b1 = compare("batch 1", model, engine, single, args.new_tokens, None, args.repeats)
    b32 = compare(f"batch {ROLLOUT_BATCH}", model, engine, batch, args.new_tokens, eos, args.repeats)
    print(json.dumps({
        "model": args.model or "tiny-qwen3", "new_tokens": args.new_tokens, "compile": args.compile,
        "lean": engine.lean_active(), "threads": torch.get_num_threads(), "batch1": b1, f"batch{ROLLOUT_BATCH}": b32,
        "speedup_batch1": b1["speedup"], f"speedup_batch{ROLLOUT_BATCH}": b32["speedup"],
        "identical": b1["identical"] and b32["identical"],
    }))


if __name__ == "__main__":
    main()
