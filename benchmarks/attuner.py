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

Time to first token (`--skip-ttft`): one request of N artifacts (2, 4, 8, 16; `--artifact-tokens`
tokens each, random ids) + a `--query-tokens` query, on the tiny shape and a wider one (`--wide`),
artifacts already in the cache (their one-time encoding is reported apart). Timed: everything from
the request to the first token's logits -- writing the cached K/V with their relocation, any
recompute, and the query prefill. Modes run round-robin `--repeats` times; the median is kept.
One thread; last line JSON.

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


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--artifact-tokens", type=int, default=64)
    ap.add_argument("--query-tokens", type=int, default=16)
    ap.add_argument("--wide", default="512x8x8x2048", help="HIDDENxLAYERSxHEADSxINTERMEDIATE of the wide shape")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict = {"threads": args.threads}
    if not args.skip_ttft:
        report["ttft"] = []
        for shape in ("tiny", args.wide):
            res = measure_ttft(shape, args.counts, args.artifact_tokens, args.query_tokens, args.repeats)
            print_ttft(res)
            report["ttft"].append(res)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
