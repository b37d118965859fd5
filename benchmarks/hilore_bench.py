"""HiLoRe vs gradient checkpointing vs plain autograd on one GRPO-like actor-update step (CPU).

A Qwen3-architecture model (tiny spec, char tokenizer) runs forward, token log-probs of the sequence,
loss = -(A_b * logp).sum() / N with random advantages (a quarter of the rows 0), backward, and an
AdamW step (lr 0: the weights, and so the gradients compared across modes, stay identical), for
  none:       plain autograd (exact reference gradient);
  checkpoint: every decoder layer recomputed (trainer/activations/, mode "checkpoint");
  hilore:     the planner (mode "hilore"): per layer full / int8-compressed / recomputed, under the
              memory budget (x the estimated checkpointing peak) and the risk budget, with the
              exposure set from the advantages.
Each mode runs in its own interpreters: one for memory (fixed mmap threshold, below), one for time
(default allocator). After the warm-up steps (hilore: its profiling steps, then
one planned step) gradients are dropped, freed memory is returned to the OS (malloc_trim) and the
kernel's peak-RSS mark is reset (/proc/self/clear_refs). Reported peak: VmHWM over the measured steps
above the interpreter before the model existed -- parameters, AdamW state, gradients and
activations, the figure a GPU reports as max allocated and the one the memory budget is relative to
-- and, as `above_MB`, above the parameters + optimizer state alone. The whole-update figure is
`above_MB` + the parameter and AdamW-moment bytes counted exactly (RSS also holds torch.compile's
host-side code for hilore's fused kernels, which is not update memory). Step time: median over the repeats, wall clock and process CPU time (user+sys; the stabler figure
on a shared box; default 1 torch thread because other jobs share the 2 cores). Gradient cosine vs the `none` gradient of the same
step (same weights, inputs and dropout-free model). Also printed: the analytic saved-activation bytes
the hooks counted (per-layer profile) and the planner's estimates. Last line: JSON.

    python benchmarks/hilore_bench.py                      # hidden 512, 8 layers, batch 4 x 256
    python benchmarks/hilore_bench.py --seq 512 --repeats 5
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    """Return freed heap to the OS, reset VmHWM; the resident baseline in KiB."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_kb("VmRSS")


def worker(mode: str, hidden: int, layers: int, heads: int, inter: int, seq: int, batch: int, repeats: int,
           threads: int, grad_path: str, budget: float, risk: float, compress: str, fused: bool,
           force_plan: str = "") -> dict:
    import torch

    from models.loading import TinySpec, build_tiny
    from trainer.activations import ActivationConfig, install

    torch.set_num_threads(threads)
    model, tok = build_tiny(TinySpec(hidden_size=hidden, num_layers=layers, num_heads=heads,
                                     intermediate_size=inter), seed=0)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(len(tok.all_special_ids), len(tok), (batch, seq), generator=gen)
    adv = torch.randn(batch, generator=gen)
    adv[: max(1, batch // 4)] = 0.0  # some groups with identical rewards
    coef = adv.abs()[:, None].expand(batch, seq - 1).contiguous()
    n_tok = batch * (seq - 1)

    cfg = ActivationConfig(mode=mode if mode != "none" else "none", memory_budget=budget, risk_budget=risk,
                           compress=compress, profile_steps=2, fused_kernels=fused)
    mgr = install(model, cfg)
    # The optimizer step is part of the actor update, and its state part of the peak. lr 0 keeps the
    # weights (so the gradients compared across modes) identical while AdamW does all its work.
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        if mgr is not None:
            mgr.set_exposure(coef)
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).sum() / n_tok
        loss.backward()
        opt.step()  # leaves .grad as it is: the gradient compared across modes
        return time.perf_counter() - t0, time.process_time() - c0

    warm = 3 if mode == "hilore" else 1  # hilore: 2 profiling steps + 1 planned step
    for _ in range(warm):
        step()
    planned = mgr.plan() if mgr is not None else None
    if force_plan and mgr is not None:  # the memory run measures the plan the timed run's planner chose
        mgr.force_plan([{"F": "full", "C": "compress", "R": "recompute"}[c] for c in force_plan])
        step()
    times, cpu, peaks = [], [], []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        base = _reset_peak()
        wall, c = step()
        times.append(wall)
        cpu.append(c)
        peaks.append((_status_kb("VmHWM") - base) / 1024)  # above parameters + optimizer state
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.save(grads, grad_path)
    # Parameters and AdamW's two moments are resident throughout; counted exactly rather than read from
    # RSS, which here also holds torch.compile's host-side code (hilore's fused kernels), not update memory.
    static_mb = sum(p.numel() * p.element_size() + 2 * p.numel() * 4 for p in model.parameters()) / 2**20
    out = {"mode": mode, "step_s": statistics.median(times), "times": times,
           "cpu_s": statistics.median(cpu), "cpu_times": cpu, "peak_mb": max(peaks) + static_mb,
           "peak_above_static_mb": max(peaks), "static_mb": static_mb,
           "params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
    if mgr is not None:
        out["plan"], out["planned"] = mgr.plan(), planned
        out["metrics"] = {k: float(v) for k, v in mgr.metrics().items()}
        if mgr.profile is not None:
            n = n_tok + batch  # tokens through the layers (full sequence)
            u = mgr.profile.units
            out["saved_full_mb_per_layer"] = [x.full_bytes * n / 2**20 for x in u]
            out["saved_int8_mb_per_layer"] = [x.comp_bytes * n / 2**20 for x in u]
            out["layer_input_mb"] = [x.in_bytes * n / 2**20 for x in u]
            out["recompute_ms"] = [x.fwd_s * n * 1e3 for x in u]
            out["compress_ms"] = [x.comp_s * n * 1e3 for x in u]
            out["rel_err"] = [x.err for x in u]
    return out


def run(hidden: int = 512, layers: int = 8, seq: int = 256, batch: int = 4, repeats: int = 3, heads: int = 8,
        inter: int = 2048, threads: int = 1, budget: float = 1.10, risk: float = 0.05, compress: str = "int8",
        fused: bool = True, modes: tuple = ("none", "checkpoint", "hilore")) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            path = os.path.join(tmp, f"{mode}.pt")
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--hidden", str(hidden),
                   "--layers", str(layers), "--heads", str(heads), "--inter", str(inter), "--seq", str(seq),
                   "--batch", str(batch), "--repeats", str(repeats), "--threads", str(threads),
                   "--budget", str(budget), "--risk", str(risk), "--compress", compress, "--grad-path", path]
            if not fused:
                cmd.append("--no-fused")
            # Memory: a fixed mmap threshold returns large blocks to the OS when freed, so VmHWM tracks
            # live memory -- but every large allocation then page-faults afresh, which distorts time
            # (most for compression, which allocates codes and dequantised buffers). So each mode runs
            # twice: its peak from the process with the fixed threshold, its times from one with the
            # default allocator.
            base_env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            memory_env = dict(base_env, MALLOC_ARENA_MAX="2", MALLOC_MMAP_THRESHOLD_="131072")
            measured = {}
            for kind, env in (("time", base_env), ("memory", memory_env)):
                extra = []
                if kind == "memory" and measured["time"].get("plan"):  # the same plan in both processes
                    extra = ["--force-plan", "".join(t[0].upper() for t in measured["time"]["plan"])]
                proc = subprocess.run(cmd + extra, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise RuntimeError(f"{mode} worker failed:\n{proc.stderr[-3000:]}")
                measured[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode] = {**measured["memory"], **{k: measured["time"][k] for k in
                                                      ("step_s", "times", "cpu_s", "cpu_times")}}
            results[mode]["planned_in_memory_run"] = measured["memory"].get("planned")
        import torch

        ref = torch.load(os.path.join(tmp, "none.pt")) if "none" in modes else None
        for mode in modes:
            if ref is not None and mode != "none":
                g = torch.load(os.path.join(tmp, f"{mode}.pt"))
                g64, r64 = g.double(), ref.double()
                results[mode]["grad_cosine"] = float(g64 @ r64 / (g64.norm() * r64.norm()))
    summary = {"shape": {"hidden": hidden, "layers": layers, "heads": heads, "inter": inter, "seq": seq,
                         "batch": batch, "threads": threads, "budget": budget, "risk": risk, "compress": compress,
                         "fused_kernels": fused}, "modes": results}
    if "checkpoint" in results and "hilore" in results:
        ck, hl = results["checkpoint"], results["hilore"]
        summary["peak_ratio_hilore_vs_checkpoint"] = hl["peak_mb"] / ck["peak_mb"]
        summary["peak_above_static_ratio_hilore_vs_checkpoint"] = hl["peak_above_static_mb"] / ck["peak_above_static_mb"]
        summary["speedup_hilore_vs_checkpoint_pct"] = 100.0 * (ck["step_s"] / hl["step_s"] - 1.0)
        summary["cpu_speedup_hilore_vs_checkpoint_pct"] = 100.0 * (ck["cpu_s"] / hl["cpu_s"] - 1.0)
        summary["grad_cosine_hilore"] = hl.get("grad_cosine")
        summary["grad_cosine_checkpoint"] = ck.get("grad_cosine")
    return summary


def report(s: dict) -> str:
    """The printed table of a run() result."""
    out: list = []
    out.append(f"shape: {s['shape']}")
    out.append("peak_MB: the whole update (parameters + AdamW state + gradients + activations); above_MB: measured"
               " peak RSS above parameters + optimizer state")
    out.append(f"{'mode':<11} {'step_s':>8} {'cpu_s':>8} {'peak_MB':>9} {'above_MB':>9} {'cosine':>8}  plan")
    for mode, r in s["modes"].items():
        cos = r.get("grad_cosine")
        letters = {"full": "F", "compress": "C", "recompute": "R"}
        plan = "".join(letters[t] for t in r.get("plan", []))
        if r.get("planned_in_memory_run") and r["planned_in_memory_run"] != r.get("plan"):
            plan += " (the memory run's own planner: " + "".join(letters[t] for t in r["planned_in_memory_run"]) + ")"
        cosine = "" if cos is None else f"{cos:.6f}"
        out.append(f"{mode:<11} {r['step_s']:8.3f} {r['cpu_s']:8.3f} {r['peak_mb']:9.1f} "
                   f"{r['peak_above_static_mb']:9.1f} {cosine:>8}  {plan}")
    hl = s["modes"].get("hilore", {})
    if "saved_full_mb_per_layer" in hl:
        out.append(f"hooks, per layer (MB): input {[round(x, 1) for x in hl['layer_input_mb']]}")
        out.append(f"  saved full {[round(x, 1) for x in hl['saved_full_mb_per_layer']]}")
        out.append(f"  saved int8 {[round(x, 1) for x in hl['saved_int8_mb_per_layer']]}")
        out.append(f"  recompute ms {[round(x, 1) for x in hl['recompute_ms']]} compress ms "
                   f"{[round(x, 1) for x in hl['compress_ms']]}")
        out.append(f"  rel err {[round(x, 5) for x in hl['rel_err']]}")
        out.append(f"planner: {({k: round(v, 4) for k, v in hl['metrics'].items()})}")
    if "peak_ratio_hilore_vs_checkpoint" in s:
        out.append(f"hilore/checkpoint peak: {s['peak_ratio_hilore_vs_checkpoint']:.3f}  "
                   f"speedup vs checkpoint: wall {s['speedup_hilore_vs_checkpoint_pct']:+.1f}% "
                   f"cpu-time {s['cpu_speedup_hilore_vs_checkpoint_pct']:+.1f}%  "
                   f"cosine: {s['grad_cosine_hilore']:.6f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="1: the box is shared; 2 if idle")
    ap.add_argument("--budget", type=float, default=1.10)
    ap.add_argument("--risk", type=float, default=0.05)
    ap.add_argument("--compress", default="int8")
    ap.add_argument("--no-fused", action="store_true", help="eager (de)quantisation kernels")
    ap.add_argument("--modes", default="none,checkpoint,hilore")
    ap.add_argument("--grad-path", default=None)
    ap.add_argument("--force-plan", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.hidden, a.layers, a.heads, a.inter, a.seq, a.batch, a.repeats,
                                a.threads, a.grad_path, a.budget, a.risk, a.compress, not a.no_fused,
                                a.force_plan)))
        return
    s = run(a.hidden, a.layers, a.seq, a.batch, a.repeats, a.heads, a.inter, a.threads, a.budget, a.risk,
            a.compress, not a.no_fused, tuple(a.modes.split(",")))
    print(report(s))
    print(json.dumps(s))


if __name__ == "__main__":
    main()
