"""AugTree actor-update benchmark: flattened vs shared-prompt replay (one process) vs context-parallel
replay over 2 ranks (lanes and owners modes), on a CPU-sized Qwen3, in one run.

Step = forward + backward of a GRPO-like loss sum_i A_i * sum_t logp_it over the G responses of one
group. Every process uses ONE thread (torch.set_num_threads(1)) so the single-process numbers compare
fairly with the 2-rank runs (one thread per rank, gloo). Timings: median of `repeats` after a warm-up;
for CP the step time of a repeat is the slowest rank's. Also reports the max abs difference between
the shared and flattened parameter gradients, and the planner's choice.

    python benchmarks/augtree_bench.py                       # prompt 1024, G 8, responses 64
    python benchmarks/augtree_bench.py --prompt-len 512 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.loading import random_qwen3  # noqa: E402
from trainer.prompt_sharing import flattened_logprobs, plan_replay, shared_prompt_logprobs  # noqa: E402

VOCAB = 62


def build_model(hidden: int, layers: int, heads: int, intermediate: int, max_pos: int, seed: int = 0):
    return random_qwen3(VOCAB, seed=seed, hidden_size=hidden, num_layers=layers, num_heads=heads,
                        intermediate_size=intermediate, max_positions=max_pos, pad_token_id=0)


def make_group(prompt_len: int, group: int, response_len: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g)
    responses = [torch.randint(1, VOCAB, (response_len,), generator=g) for _ in range(group)]
    advantages = torch.randn(group, generator=g)
    return prompt, responses, advantages


def _rows(prompt, responses):
    P = prompt.numel()
    T = P + max(r.numel() for r in responses)
    ids = torch.zeros(len(responses), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(responses):
        ids[b, :P], ids[b, P: P + r.numel()] = prompt, r
        mask[b, : P + r.numel()] = 1
    return ids, mask, torch.full((len(responses),), P)


def _time(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _single(model, prompt, responses, advantages, repeats: int) -> dict:
    ids, mask, plens = _rows(prompt, responses)
    out = {}
    grads = {}
    for name, fn in (("flattened", flattened_logprobs), ("shared", shared_prompt_logprobs)):
        def step():
            model.zero_grad()
            loss = (fn(model, ids, mask, plens).sum(-1) * advantages).sum()
            loss.backward()
            return loss

        times = _time(step, repeats)
        loss = step()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        out[name] = {"median_s": statistics.median(times), "times_s": times, "loss": loss.item()}
    out["grad_max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(grads["flattened"], grads["shared"]))
    out["grad_max_abs"] = max(a.abs().max().item() for a in grads["flattened"])
    return out


def _cp_worker(args) -> None:
    """One rank of the 2-rank context-parallel timing (launched by `run` through torchrun)."""
    import torch.distributed as dist

    from trainer.context_parallel import ContextParallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = build_model(args.hidden, args.layers, args.heads, args.intermediate, args.max_pos)
    prompt, responses, advantages = make_group(args.prompt_len, args.group, args.response_len)
    result = {}
    for mode in ("lanes", "owners"):
        cp = ContextParallel(mode)

        def step():
            model.zero_grad()
            lps = cp.logprobs(model, prompt, responses)
            loss = sum(a * lp.sum() for a, lp in zip(advantages.tolist(), lps) if lp is not None)
            loss.backward()
            return loss

        step()
        times, total = [], 0.0
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            loss = step()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.item())
        total = torch.tensor([loss.item()])
        dist.all_reduce(total)
        result[mode] = {"median_s": statistics.median(times), "times_s": times, "loss": total.item()}
    if dist.get_rank() == 0:
        Path(args.cp_out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(prompt_len: int = 1024, group: int = 8, response_len: int = 64, hidden: int = 256, layers: int = 4,
        heads: int = 4, intermediate: int = 1024, repeats: int = 3, cp: bool = True) -> dict:
    """Time one actor-update step per variant (see the module docstring); returns a dict of results."""
    torch.set_num_threads(1)
    max_pos = max(2048, prompt_len + response_len)
    model = build_model(hidden, layers, heads, intermediate, max_pos)
    prompt, responses, advantages = make_group(prompt_len, group, response_len)
    result = {"config": dict(prompt_len=prompt_len, group=group, response_len=response_len, hidden=hidden,
                             layers=layers, heads=heads, intermediate=intermediate, repeats=repeats,
                             threads_per_process=1),
              "single": _single(model, prompt, responses, advantages, repeats)}
    result["speedup_shared_vs_flattened"] = (result["single"]["flattened"]["median_s"]
                                             / result["single"]["shared"]["median_s"])
    result["plan_world1"] = vars(plan_replay(prompt_len, [response_len] * group, group, 1))
    result["plan_world2"] = vars(plan_replay(prompt_len, [response_len] * group, group, 2))
    if cp:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "cp.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   __file__, "--cp-worker", "--cp-out", out, "--prompt-len", str(prompt_len), "--group", str(group),
                   "--response-len", str(response_len), "--hidden", str(hidden), "--layers", str(layers),
                   "--heads", str(heads), "--intermediate", str(intermediate), "--max-pos", str(max_pos),
                   "--repeats", str(repeats)]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if not os.path.exists(out):
                raise RuntimeError("context-parallel run failed:\n" + proc.stderr[-3000:])
            result["cp2"] = json.loads(Path(out).read_text())
        flat = result["single"]["flattened"]["median_s"]
        shared = result["single"]["shared"]["median_s"]
        for mode, r in result["cp2"].items():
            r["speedup_vs_flattened"] = flat / r["median_s"]
            r["speedup_vs_shared_1rank"] = shared / r["median_s"]
    return result


def _table(res: dict) -> str:
    c = res["config"]
    lines = [f"AugTree actor update: prompt {c['prompt_len']}, G={c['group']}, responses {c['response_len']}, "
             f"hidden {c['hidden']}, {c['layers']} layers, 1 thread/process, median of {c['repeats']}",
             f"{'variant':<28}{'step s':>10}{'vs flattened':>14}{'loss':>14}"]
    flat = res["single"]["flattened"]["median_s"]
    rows = [("flattened (1 proc)", res["single"]["flattened"]), ("shared-prompt (1 proc)", res["single"]["shared"])]
    rows += [(f"CP {m} (2 ranks)", r) for m, r in res.get("cp2", {}).items()]
    for name, r in rows:
        lines.append(f"{name:<28}{r['median_s']:>10.3f}{flat / r['median_s']:>13.2f}x{r['loss']:>14.5f}")
    s = res["single"]
    lines.append(f"shared vs flattened grads: max abs diff {s['grad_max_abs_diff']:.3e} "
                 f"(max |grad| {s['grad_max_abs']:.3e})")
    p1, p2 = res["plan_world1"], res["plan_world2"]
    lines.append(f"planner: world 1 -> {p1['mode']}; world 2 -> {p2['mode']} (degree {p2['degree']}, "
                 f"lanes {p2['lanes']}): {p2['reason']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-pos", type=int, default=2048)
    ap.add_argument("--no-cp", action="store_true")
    ap.add_argument("--cp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cp-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cp_worker:
        _cp_worker(args)
        return
    res = run(args.prompt_len, args.group, args.response_len, args.hidden, args.layers, args.heads,
              args.intermediate, args.repeats, cp=not args.no_cp)
    print(_table(res))
    print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
