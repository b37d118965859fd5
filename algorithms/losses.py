"""Pure loss math: tensors in, (loss, metrics) out. No config objects, no .item(), no collectives.

Conventions: logits (B, T, V) at position t predict token t+1; token-aligned tensors (B, T) index
the predicted token, so `token_logprobs(...)[b, t] = log p(x_t | x_<t)` and column 0 is 0.
"""
from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / T) gathered at the next tokens. logits (B, T, V), ids (B, T) -> (B, T)."""
    assert logits.dim() == 3 and logits.shape[:2] == input_ids.shape, (logits.shape, input_ids.shape)
    scaled = logits[:, :-1].float() / temperature  # (B, T-1, V)
    target = input_ids[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
    picked = scaled.gather(-1, target).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # (B, T-1)
    return torch.nn.functional.pad(picked, (1, 0))  # (B, T): position 0 has no prediction


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum()


def nll_loss(logprobs: Tensor, mask: Tensor, normaliser: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level negative log-likelihood summed over masked tokens / normaliser.

    logprobs, mask: (B, T). normaliser: scalar (global target tokens / data-parallel size).
    Example: logprobs [[0, -1, -3]], mask [[0, 1, 1]], normaliser 2 -> loss (1 + 3) / 2 = 2.
    """
    mask = mask.to(logprobs.dtype)
    loss = -masked_sum(logprobs, mask) / normaliser
    n = mask.sum().clamp(min=1)
    return loss, {"nll": -masked_sum(logprobs, mask).detach() / n}


def logprob_gap(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean |trainer - sampler| log-prob over completion tokens: a silent mismatch here corrupts
    every on-policy algorithm, so the trainer logs it every step."""
    mask = mask.to(trainer_logprobs.dtype)
    diff = (trainer_logprobs.detach().float() - rollout_logprobs.float()).abs()
    return masked_sum(diff, mask) / mask.sum().clamp(min=1)
