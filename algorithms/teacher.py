"""Frozen or moving copies of the policy's weights: the self-teacher of the distillation algorithms
and the reference model of KL penalties (GRPO's starting weights)."""
from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Optional

import torch
from torch import nn


class SelfTeacher:
    """The no-grad teacher's weights: `current` (the policy itself), `fixed` (the first step's weights;
    with LoRA, the policy with adapters disabled) or `ema` (a moving average). Frozen copies are
    plain modules with requires_grad off, built after the optimizer, so they never enter it."""

    def __init__(self, mode: str, decay: float):
        self.mode, self.decay = mode, decay
        self.copy: Optional[nn.Module] = None
        self._pending: Optional[dict] = None  # weights restored from a checkpoint before the first step

    @contextlib.contextmanager
    def weights(self, policy: nn.Module) -> Iterator[nn.Module]:
        if self.mode == "current":
            yield policy
        elif self.mode == "fixed" and hasattr(policy, "disable_adapter"):
            with policy.disable_adapter():
                yield policy
        else:
            self._refresh(policy)
            yield self.copy

    def copies(self, policy: nn.Module) -> int:
        """Full copies of `policy`'s weights this teacher keeps: none for `current` and for `fixed` over
        LoRA (the adapters are disabled instead), one otherwise."""
        if self.mode == "current" or (self.mode == "fixed" and hasattr(policy, "disable_adapter")):
            return 0
        return 1

    @torch.no_grad()
    def _refresh(self, policy: nn.Module) -> None:
        if self.copy is None:
            self.copy = copy.deepcopy(policy).requires_grad_(False).eval()
            if self._pending is not None:
                self.copy.load_state_dict(self._pending)
                self._pending = None
            elif self.mode == "ema":
                return  # the first EMA value is the current weights
        if self.mode == "ema":
            live = dict(policy.named_parameters())
            for name, p in self.copy.named_parameters():
                p.lerp_(live[name].detach().to(p.dtype), 1.0 - self.decay)

    def state_dict(self) -> dict:
        if self.copy is None:
            return {"weights": self._pending}
        return {"weights": {k: v.detach().cpu().clone() for k, v in self.copy.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        self._pending, self.copy = state.get("weights"), None
