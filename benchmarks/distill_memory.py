"""Peak memory of the self-distillation loss with a real-size vocabulary: token-chunked vs full logits.

A Qwen3-architecture model with a 151,936-token vocabulary (tiny hidden size, so it runs on CPU)
scores one completion of `--tokens` tokens against K teacher views, forward and backward:
  chunked: the MASS/OPSD loss as trained (algorithms/selfdistill.distill_loss): final hidden states only,
           student and teacher logits built `--chunk` tokens at a time (0: auto, 88 here), the
           student chunk recomputed in backward;
  full:    [T, V] student logits and [K, T, V] teacher logits materialised, then the same divergence.
Each mode runs in its own process; peak resident memory (ru_maxrss) is reported above the
process's baseline after the model is built. Last line: JSON, also written to docs/results/distill_memory.json,
with the table rendered into docs/results/distill_memory.md.

    python benchmarks/distill_memory.py                  # T=1024, K=4
    python benchmarks/distill_memory.py --tokens 2048 --modes chunked
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 151_936  # Qwen2/Qwen3 vocabulary


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_mode(mode: str, tokens: int, views: int, chunk: int, hidden: int) -> dict:
    import torch

    from algorithms import losses
    from algorithms.base import Batch, TeacherTerms
    from algorithms.mass import MASSConfig
    from algorithms.selfdistill import distill_loss
    from models.loading import random_qwen3

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = random_qwen3(VOCAB, seed=None, hidden_size=hidden, num_heads=2, intermediate_size=2 * hidden,
                         max_positions=tokens + 8)  # seeded above
    ids = torch.randint(0, VOCAB, (1, tokens))
    mask = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 0] = 0
    teacher_hidden = torch.randn(1, tokens, views, hidden)
    teacher_head = (model.lm_head.weight.detach().clone(), None)
    # the mean of the views: the posterior default also needs each view's evidence, which this
    # synthetic batch does not have (its memory is not what this measures)
    cfg = MASSConfig(temperature=1.1, loss_chunk_tokens=chunk, aggregate="mean")
    baseline = peak_mb()
    started = time.perf_counter()
    if mode == "chunked":
        batch = Batch(ids, mask, loss_mask, teacher=TeacherTerms(teacher_hidden, teacher_head))
        loss = distill_loss(model, batch, torch.tensor(float(tokens - 1)), cfg).loss
    else:
        logits = model(input_ids=ids, attention_mask=mask).logits[0, :-1]  # (T-1, V)
        student = torch.log_softmax(logits.float() / cfg.temperature, -1)
        with torch.no_grad():
            t_logits = torch.einsum("tkh,vh->ktv", teacher_hidden[0, 1:], teacher_head[0])  # (K, T-1, V)
            teacher = losses.aggregate_views(torch.log_softmax(t_logits / cfg.temperature, -1), cfg.aggregate)
        loss = losses.generalized_jsd(student, teacher, cfg.beta).sum() / (tokens - 1)
    loss.backward()
    return {"mode": mode, "loss": loss.item(), "seconds": time.perf_counter() - started,
            "peak_mb_above_baseline": peak_mb() - baseline, "baseline_mb": baseline}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--views", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=0, help="tokens per chunk; 0 = auto from the vocabulary")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--modes", default="chunked,full")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"),
                    help="where distill_memory.json and .md (the table) are written ('' for nowhere)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child, args.tokens, args.views, args.chunk, args.hidden)))
        return
    results = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode, "--tokens", str(args.tokens), "--views", str(args.views),
               "--chunk", str(args.chunk), "--hidden", str(args.hidden)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{mode}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", flush=True)
            results[mode] = {"mode": mode, "failed": True}
            continue
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[mode]
        print(f"{mode:8s} peak +{r['peak_mb_above_baseline']:8.0f} MB   {r['seconds']:6.1f} s   loss {r['loss']:.6f}",
              flush=True)
    summary = {"vocab": VOCAB, "tokens": args.tokens, "views": args.views, "chunk": args.chunk, "results": results}
    ok = [results[m] for m in ("chunked", "full") if m in results and not results[m].get("failed")]
    if len(ok) == 2:
        peaks = [r["peak_mb_above_baseline"] for r in ok]
        summary["memory_ratio_full_over_chunked"] = peaks[1] / max(peaks[0], 1)
        summary["loss_abs_diff"] = abs(ok[0]["loss"] - ok[1]["loss"])
    if args.out:
        write_results(summary, args.out)
    print(json.dumps(summary))


def render(summary: dict) -> str:
    """distill_memory.md: the run's table, from its JSON."""
    from benchmarks.results_io import provenance_lines

    lines = ["# Peak memory of the self-distillation loss (generated by benchmarks/distill_memory.py)", "",
             *provenance_lines(summary.get("meta")),
             f"Vocabulary {summary['vocab']:,}, one completion of {summary['tokens']:,} tokens, K = {summary['views']} "
             f"teacher views, forward and backward; peak resident memory above the process's baseline.", "",
             "| mode | peak above baseline (MB) | seconds | loss |", "|---|---|---|---|"]
    for mode, r in summary["results"].items():
        if r.get("failed"):
            lines.append(f"| {mode} | failed | | |")
        else:
            lines.append(f"| {mode} | {r['peak_mb_above_baseline']:,.0f} | {r['seconds']:.1f} | {r['loss']:.6f} |")
    if "memory_ratio_full_over_chunked" in summary:
        lines += ["", f"Full logits take {summary['memory_ratio_full_over_chunked']:.1f}x the memory of the chunked "
                      f"loss; the losses differ by {summary['loss_abs_diff']:.1e}."]
    return "\n".join(lines) + "\n"


def write_results(summary: dict, out: str) -> None:
    """distill_memory.json and .md under `out`, each written aside and renamed into place."""
    from benchmarks.results_io import write_report

    write_report(out, "distill_memory", summary, render)


if __name__ == "__main__":
    main()
