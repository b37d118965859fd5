"""Sampling parameters and the per-step token choice (greedy, temperature, top-k, top-p).

Kept apart from the engine so the filtering rules can be unit-tested on hand-made distributions,
and so every backend (lean decoder, HF fallback, later speculative paths) samples the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Logits masked out by top-k / top-p; -inf gives exactly zero probability after softmax.
MASKED_LOGIT = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy (argmax)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 => off
    stop_token_ids: tuple[int, ...] = ()  # the stop token is included in the output tokens
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # pre-tokenized stop strings; included in output

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(len(seq) == 0 for seq in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Mask all but the k largest logits of each row. logits: [B, V] -> [B, V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, MASKED_LOGIT)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the nucleus: the smallest set of top tokens whose probability sums to >= p.

    A token is dropped when the tokens ranked above it already reach p, so the top token is always
    kept. logits: [B, V] -> [B, V].
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)  # (B, V)
    mass_above = probs.cumsum(dim=-1) - probs  # (B, V) probability of strictly higher-ranked tokens
    drop_sorted = mass_above >= p  # (B, V)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, MASKED_LOGIT)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row and return it with its log-probability.

    The log-probability is log_softmax(logits / T) over the FULL vocabulary (T = 1 when greedy),
    i.e. before top-k/top-p truncation, because that is what a trainer's forward pass computes.
    logits: [B, V] (any float dtype) -> tokens [B] int64, logprobs [B] fp32.
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # (B,)
        logprobs = logits.log_softmax(dim=-1)  # (B, V)
    else:
        scaled = logits / params.temperature  # (B, V)
        logprobs = scaled.log_softmax(dim=-1)  # (B, V)
        filtered = top_p_filter(top_k_filter(scaled, params.top_k), params.top_p)
        probs = filtered.softmax(dim=-1)  # (B, V)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B,)
    return tokens, chosen
