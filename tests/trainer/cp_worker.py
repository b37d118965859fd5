"""Worker for tests/trainer/test_context_parallel.py: run under torchrun (gloo). For each replay mode,
the context-parallel loss and summed parameter gradients are compared with the flattened single-process
computation; rank 0 prints one JSON line per mode."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Qwen3ForCausalLM  # noqa: E402

from models.loading import random_qwen3  # noqa: E402
from trainer.context_parallel import ContextParallel  # noqa: E402
from trainer.prompt_sharing import flattened_logprobs  # noqa: E402

TEMPERATURE = 0.8


def build_model(seed: int = 0) -> Qwen3ForCausalLM:
    return random_qwen3(62, seed=seed, kv_heads=2, head_dim=16, pad_token_id=0)


def case(prompt_len: int, response_lens: list[int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 62, (prompt_len,), generator=g)
    responses = [torch.randint(1, 62, (n,), generator=g) for n in response_lens]
    weights = torch.randn(len(responses), generator=g).tolist()
    return prompt, responses, weights


def reference(model, prompt, responses, weights):
    P, T = prompt.numel(), prompt.numel() + max(r.numel() for r in responses)
    ids = torch.zeros(len(responses), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(responses):
        ids[b, :P], ids[b, P: P + r.numel()] = prompt, r
        mask[b, : P + r.numel()] = 1
    model.zero_grad()
    lp = flattened_logprobs(model, ids, mask, torch.full((len(responses),), P), TEMPERATURE)
    loss = (lp.sum(-1) * torch.tensor(weights)).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build_model()
    for prompt_len, response_lens in [(37, [5, 9, 3, 7]), (9, [12, 4, 15])]:
        prompt, responses, weights = case(prompt_len, response_lens)
        ref_loss, ref_grads = reference(model, prompt, responses, weights)
        for mode in ("lanes", "owners"):
            model.zero_grad()
            lps = ContextParallel(mode).logprobs(model, prompt, responses, temperature=TEMPERATURE)
            loss = sum(w * lp.sum() for w, lp in zip(weights, lps) if lp is not None)
            loss.backward()
            total = torch.tensor([loss.item()])
            dist.all_reduce(total)
            worst = 0.0
            for n, p in model.named_parameters():
                grad = p.grad.clone()
                dist.all_reduce(grad)
                scale = ref_grads[n].abs().max().clamp_min(1e-12)
                worst = max(worst, ((grad - ref_grads[n]).abs().max() / scale).item())
            if rank == 0:
                print(json.dumps({"mode": mode, "prompt_len": prompt_len, "response_lens": response_lens,
                                  "loss": total.item(), "ref_loss": ref_loss, "max_rel_grad_err": worst}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
