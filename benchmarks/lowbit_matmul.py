"""Benchmark: one linear, side by side: fp32 F.linear vs the runtime's low-bit op vs the integer GEMMs alone.

Claim measured: what the real integer GEMM of `inference.lowbit.lowbit_linear` costs on this
machine next to the float matmul it replaces, and how much of it is the integer GEMM itself.
Columns, per shape (x (m, k)) (k, n)):
  fp32        F.linear(x, W) on fp32 weights
  W8A8        lowbit_linear: per-token activation quantization + the integer GEMM (int8 weights,
              per-channel scales; on CPU FBGEMM, two passes: see inference/lowbit.py) + scaling
  W4A8        the same op on 4-bit weights, per channel (one FBGEMM pass on CPU)
  W4A8 g128   4-bit weights with groups of 128 columns: one GEMM per group
  fbgemm w4   the CPU integer GEMM alone, 4-bit weights (cpu_int_matmul, one pass)
  fbgemm w8   the CPU integer GEMM alone, 8-bit weights (two passes)
  int_mm      torch._int_mm(int8 (m, k), int8 (k, n)) -> int32 alone (exact, but without VNNI / AMX
              it has no fast CPU kernel: the reason the CPU path uses FBGEMM)
Each figure is the median over `--repeats` samples of the mean time per call (each sample runs
enough calls to last about 20 ms), after a warm-up, under inference_mode.

    python benchmarks/lowbit_matmul.py [--threads N] [--repeats 7]

Prints a table (microseconds per call, and each column's time relative to fp32) and last one
JSON line with all figures, also written to docs/results/lowbit_matmul.json with the table rendered
into docs/results/lowbit_matmul.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.lowbit import LowBitLinear, _cpu_gemm_available, _prepack, cpu_int_matmul, lowbit_linear  # noqa: E402
from models.quant import QuantScheme, quantize_tokens  # noqa: E402

SHAPES = [(1, 512, 1536), (32, 512, 1536), (32 * 64, 512, 1536), (64, 1024, 1024)]  # (m, k, n)
SAMPLE_S = 0.02


def time_call(fn: Callable[[], object], repeats: int) -> float:
    """Median over `repeats` samples of seconds per call."""
    for _ in range(3):
        fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < SAMPLE_S / 4:
        fn()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    inner = max(1, int(SAMPLE_S / per_call))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def bench_shape(m: int, k: int, n: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k)
    w = linear.weight.detach()
    w8 = LowBitLinear.from_linear(linear, QuantScheme.parse("W8A8")).weights()
    w4 = LowBitLinear.from_linear(linear, QuantScheme.parse("W4A8")).weights()
    w4g = LowBitLinear.from_linear(linear, QuantScheme.parse("W4A8", 128)).weights()
    qx, _ = quantize_tokens(x, 8)
    b = w8.q.t()  # (k, n) int8, the layout lowbit_linear hands torch._int_mm
    ops = {
        "fp32": lambda: F.linear(x, w),
        "W8A8": lambda: lowbit_linear(x, w8),
        "W4A8": lambda: lowbit_linear(x, w4),
        "W4A8 g128": lambda: lowbit_linear(x, w4g),
        "int_mm": lambda: torch._int_mm(qx, b),
    }
    if _cpu_gemm_available():
        p4, p8 = _prepack(w4.q), _prepack(w8.q)
        ops["fbgemm w4"] = lambda: cpu_int_matmul(qx.clamp(-8, 7), p4, 4)
        ops["fbgemm w8"] = lambda: cpu_int_matmul(qx, p8, 8)
    with torch.inference_mode():
        return {name: time_call(op, repeats) * 1e6 for name, op in ops.items()}  # microseconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "results"),
                        help="where lowbit_matmul.json and .md (the table) are written ('' for nowhere)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    columns = ["fp32", "W8A8", "W4A8", "W4A8 g128", "int_mm"] + (["fbgemm w4", "fbgemm w8"] if _cpu_gemm_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; microseconds per call "
          f"(x fp32 time in parentheses)")
    print(f"{'shape (m x k)(k x n)':>24} " + " ".join(f"{c:>17}" for c in columns))
    for m, k, n in SHAPES:
        us = bench_shape(m, k, n, args.repeats)
        results.append({"m": m, "k": k, "n": n, "us": us})
        cells = " ".join(f"{us[c]:>9.1f} ({us[c] / us['fp32']:>4.2f}x)" for c in columns)
        print(f"{f'({m}x{k})({k}x{n})':>24} {cells}")
    report = {"bench": "lowbit_matmul", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "repeats": args.repeats, "columns": columns, "results": results}
    if args.out:
        write_results(report, Path(args.out))
    print(json.dumps(report))


def render(report: dict) -> str:
    """lowbit_matmul.md: the run's table, from its JSON."""
    from benchmarks.results_io import provenance_lines

    columns = report["columns"]
    lines = ["# One linear: fp32 vs the low-bit op vs the integer GEMMs (generated by benchmarks/lowbit_matmul.py)", "",
             *provenance_lines(report.get("meta")),
             f"torch {report['torch']}, {report['threads']} thread(s); microseconds per call, median of "
             f"{report['repeats']} samples (x the fp32 time in brackets).", "",
             "| shape (m x k)(k x n) | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for r in report["results"]:
        us = r["us"]
        lines.append(f"| ({r['m']}x{r['k']})({r['k']}x{r['n']}) | "
                     + " | ".join(f"{us[c]:.1f} ({us[c] / us['fp32']:.2f}x)" for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_results(report: dict, out: Path) -> None:
    """lowbit_matmul.json and .md under `out`, each written aside and renamed into place."""
    from benchmarks.results_io import write_report

    write_report(out, "lowbit_matmul", report, render)


if __name__ == "__main__":
    main()
