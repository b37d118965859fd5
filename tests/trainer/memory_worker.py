"""Worker for tests/trainer/test_memory_check.py (and docs/memory.md's figures): for each case, the
pre-flight memory check's estimate (trainer/memory.py) against the measured peak memory of two forward +
backward passes (gradient accumulation) and an AdamW step of a tiny Qwen3 on CPU. Prints one JSON line per case.

    python tests/trainer/memory_worker.py [--quick]
    python tests/trainer/memory_worker.py --rollouts

With --rollouts, the rollouts' estimate (trainer.memory.rollout_estimate) instead: one engine call
(inference.Engine, the lean decoder) of R rows x P prompt tokens + N new tokens, beside the weights and
AdamW's state (already resident in both), against the resident growth of that call.

Measured: the peak resident set (VmHWM of /proc/self/status, reset by writing 5 to /proc/self/clear_refs
just before the step) less the resident set before the step. Compared with it: the check's estimate less
the weights (resident before the step in both), `ratio`, and its live-tensor part alone, `live_ratio`.
The test runs it twice: as train.py runs (glibc's default malloc, what the OOM killer sees: `ratio`), and
with MALLOC_MMAP_THRESHOLD_=65536, where every large tensor is its own mmap, returned to the kernel when
freed, so the resident set follows torch's live tensors and not glibc's arenas (`live_ratio`)."""
from __future__ import annotations

import ctypes
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from algorithms.losses import token_logprobs  # noqa: E402
from models.anatomy import no_kv_cache  # noqa: E402
from models.loading import random_qwen3  # noqa: E402
from trainer.activations import ActivationConfig, install  # noqa: E402
from trainer.memory import Layout, estimate, measure, rollout_estimate  # noqa: E402

VOCAB = 4096
CONFIG = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768, head_dim=64,
              max_positions=4096)
# (activations, attention, rows, tokens): activations of roughly 50 MB - 1 GB
CASES = [(mode, attn, 1, n) for mode in ("none", "checkpoint") for attn in ("eager", "sdpa") for n in (1024, 2048)]
CASES.append(("none", "sdpa", 2, 1024))  # a padded micro-batch of two rows (an explicit attention mask)
MICRO_STEPS = 2  # gradient accumulation (the default SFT step: batch_size 32 / micro_batch_size 16)
# (rows, prompt tokens, new tokens): KV caches of roughly 60 - 250 MB
ROLLOUTS = [(8, 512, 512), (16, 512, 512), (32, 256, 256), (64, 128, 384)]
QUICK = [("none", "eager", 1, 1024), ("checkpoint", "sdpa", 1, 2048)]


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def run_case(mode: str, attn: str, rows: int, tokens: int) -> dict:
    model = random_qwen3(VOCAB, seed=0, attn_implementation=attn, **CONFIG)
    model.train()
    fit = measure(model, torch.device("cpu"), "float32", padded=rows > 1)
    est = estimate(fit, rows, tokens, mode, 8.0, Layout())
    manager = install(model, ActivationConfig(mode=mode)) if mode != "none" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, VOCAB, (rows, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[1:, tokens // 2:] = 0  # the shorter rows padded on the right, as Batch.micro_batches pads
    _trim()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident set
    with no_kv_cache(model):  # as the training loop runs the update: two micro-batches, then the step
        for _ in range(MICRO_STEPS):
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = -token_logprobs(logits, ids).sum() / ids.numel()
            del logits
            loss.backward()
            del loss
    opt.step()
    measured = _status("VmHWM") - before
    predicted, live = est.peak - fit.param_bytes, est.parts["live"] - fit.param_bytes
    if manager is not None and hasattr(manager, "remove"):
        manager.remove()
    del model, opt
    _trim()
    return {"mode": mode, "attention": attn, "rows": rows, "tokens": tokens, "measured_mb": measured / 2 ** 20,
            "estimated_mb": predicted / 2 ** 20, "ratio": predicted / measured, "live_mb": live / 2 ** 20,
            "live_ratio": live / measured, "phase": est.parts["phase"]}


def run_rollout(rows: int, prompt: int, new: int) -> dict:
    from inference import Engine, SamplingParams

    model = random_qwen3(VOCAB, seed=0, attn_implementation="sdpa", **CONFIG)
    fit = measure(model, torch.device("cpu"), "float32", padded=False)
    est = rollout_estimate(fit, rows, prompt + new, 8.0, Layout(), prompt=prompt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():  # AdamW's state exists, as it does between training steps
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    engine = Engine(model)
    prompts = torch.randint(0, VOCAB, (rows, prompt), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=new, temperature=1.0)  # no stop token: every row runs to the end
    _trim()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    outs = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    measured = _status("VmHWM") - before
    assert all(len(o.tokens) == new for o in outs)
    static = est.parts["static"]
    predicted, live = est.peak - static, est.parts["live"] - static
    del model, opt, engine, outs
    _trim()
    return {"rows": rows, "prompt": prompt, "new": new, "measured_mb": measured / 2 ** 20,
            "estimated_mb": predicted / 2 ** 20, "ratio": predicted / measured, "live_mb": live / 2 ** 20,
            "live_ratio": live / measured, "kv_cache_mb": est.parts["kv_cache"] / 2 ** 20}


if __name__ == "__main__":
    torch.manual_seed(0)
    if "--rollouts" in sys.argv:
        for case in ROLLOUTS:
            print(json.dumps(run_rollout(*case)), flush=True)
    else:
        for case in (QUICK if "--quick" in sys.argv else CASES):
            print(json.dumps(run_case(*case)), flush=True)
