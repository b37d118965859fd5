"""Fallback backend: the model's own Hugging Face forward with a DynamicCache.

Used for anything the lean decoder does not implement exactly (other architectures, RoPE scaling,
sliding windows, PEFT/LoRA wrappers, quantized or otherwise non-plain linears). It is slower per
step but runs whatever forward the model (or a wrapper around it) defines, so it is always right.
It offers the same prefill / decode / keep interface as `lean.LeanBackend`.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache

# transformers 5 renamed `past_key_values` to `cache` on most models; wrappers may still use the
# old name and forward **kwargs.
NEW_CACHE_KWARG, OLD_CACHE_KWARG = "cache", "past_key_values"


def _forward_params(model: nn.Module) -> set[str]:
    """Keyword names the underlying HF model accepts (a PEFT wrapper passes **kwargs through)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return set(inspect.signature(base.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _decoder_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class HFBackend:
    """The HF forward's state for one `generate` call: its cache and a 2-D attention mask."""

    def __init__(self, model: nn.Module, batch: int, max_len: int):
        self.model = model
        params = _forward_params(model)
        self.cache_kwarg = NEW_CACHE_KWARG if NEW_CACHE_KWARG in params else OLD_CACHE_KWARG
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache = DynamicCache(config=_decoder_config(model))
        device = next(model.parameters()).device
        self.mask = torch.ones(batch, max_len, dtype=torch.long, device=device)  # (B, T_max)
        self.slot = 0

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, end: int) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=self.mask[:, :end], position_ids=positions,
            use_cache=True, **{self.cache_kwarg: self.cache}, **self.last_only,
        )
        return out.logits[:, -1]  # (B, V)

    def prefill(self, ids, positions, valid) -> torch.Tensor:
        """ids, positions, valid: (B, P), left-padded -> last-position logits (B, V)."""
        P = ids.shape[1]
        self.mask[:, :P] = valid
        self.slot = P
        return self._run(ids, positions, P)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: (n,) -> logits (n, V)."""
        self.slot += 1
        return self._run(tokens[:, None], positions[:, None], self.slot)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the live batch, in order."""
        self.cache.reorder_cache(rows)
        self.mask = self.mask[rows]
