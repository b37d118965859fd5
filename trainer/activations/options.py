"""The settings of actor-update activation management: the one declaration of every key, its default
and its checks. Imports no torch, so `trainer.config` validates the `trainer.activation*` keys with
it before torch is loaded.

The user-facing keys are flat fields of `trainer.config.TrainerConfig` (a CLI contract):
``trainer.activations`` is :attr:`ActivationConfig.mode` and ``trainer.activation_X`` is
:attr:`ActivationConfig.X`; their defaults are read from here, and :meth:`ActivationConfig.from_trainer`
maps them by name. Fields without a trainer key (``min_numel``, ``seed``, ...) are for code, tests
and benchmarks only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

MODES = ("none", "checkpoint", "hilore")
COMPRESSIONS = ("int8", "fp8")


def trainer_key(name: str) -> str:
    """The TrainerConfig field of ActivationConfig field `name` ("mode" -> "activations")."""
    return "activations" if name == "mode" else f"activation_{name}"


def _key(name: str, value: Any) -> str:
    return f"trainer.{trainer_key(name)}={value}"


@dataclass
class ActivationConfig:
    mode: str = "none"  # none | checkpoint | hilore
    memory_budget: float = 1.10  # x the full-checkpointing peak (estimated, see trainer/activations/planner.py)
    # Sum over compressed units of (relative compression error x exposure): ~ relative gradient
    # perturbation allowed per micro-batch. 0.05 keeps the gradient cosine above ~0.998.
    risk_budget: float = 0.05
    compress: str = "int8"  # int8 | fp8 (torch.float8_e4m3fn)
    group_size: int = 64
    stochastic_rounding: bool = False
    replan_tolerance: float = 0.1  # |E - E_plan| that triggers a re-plan (E in [0, ~1+])
    min_numel: int = 4096  # smaller saved tensors are kept as they are
    profile_steps: int = 1  # grad-enabled micro-batches profiled (times: minimum over them)
    seed: int = 0  # stochastic-rounding generator seed
    fused_kernels: bool = False  # torch.compile the (de)quantisation kernels (one-off compile cost)
    head_bytes_per_token: Optional[float] = None  # non-unit activation bytes per token (None: estimate)
    # Resident during the update besides activations and gradients, so part of the peak the budget is
    # relative to (as a device's max-allocated figure is): the parameters plus this many optimizer-state
    # bytes per trainable parameter element (AdamW: two fp32 moments = 8; 0 to budget activations alone).
    optimizer_bytes_per_param: float = 8.0

    @classmethod
    def from_trainer(cls, trainer: Any) -> "ActivationConfig":
        """The settings the `trainer.activation*` fields of a TrainerConfig describe (not validated).
        Every such field must name a field here: a key added to TrainerConfig alone fails loudly
        instead of being silently ignored."""
        names = {trainer_key(f.name): f.name for f in dataclasses.fields(cls)}
        values = {}
        for f in dataclasses.fields(trainer):
            if f.name == "activations" or f.name.startswith("activation_"):
                if f.name not in names:
                    raise TypeError(f"trainer.{f.name} has no field in ActivationConfig "
                                    f"(trainer/activations/options.py)")
                values[names[f.name]] = getattr(trainer, f.name)
        return cls(**values)

    def validate(self) -> "ActivationConfig":
        """Raise ValueError (one line naming the trainer.activation* key) on a bad value; returns self."""
        if self.mode not in MODES:
            raise ValueError(f"{_key('mode', self.mode)} is not one of {', '.join(MODES)}")
        if not (isinstance(self.memory_budget, (int, float)) and math.isfinite(self.memory_budget)
                and self.memory_budget >= 1.0):
            raise ValueError(f"{_key('memory_budget', self.memory_budget)} must be >= 1.0")
        if not (isinstance(self.risk_budget, (int, float)) and math.isfinite(self.risk_budget)
                and self.risk_budget >= 0.0):
            raise ValueError(f"{_key('risk_budget', self.risk_budget)} must be >= 0")
        if self.compress not in COMPRESSIONS:
            raise ValueError(f"{_key('compress', self.compress)} is not one of {', '.join(COMPRESSIONS)}")
        if not (isinstance(self.group_size, int) and self.group_size >= 1):
            raise ValueError(f"{_key('group_size', self.group_size)} must be an integer >= 1")
        if not self.replan_tolerance >= 0:
            raise ValueError(f"{_key('replan_tolerance', self.replan_tolerance)} must be >= 0")
        if not (isinstance(self.profile_steps, int) and self.profile_steps >= 1):
            raise ValueError(f"{_key('profile_steps', self.profile_steps)} must be an integer >= 1")
        if not self.optimizer_bytes_per_param >= 0:
            raise ValueError(f"{_key('optimizer_bytes_per_param', self.optimizer_bytes_per_param)} must be >= 0")
        if self.head_bytes_per_token is not None and not self.head_bytes_per_token >= 0:
            raise ValueError(f"{_key('head_bytes_per_token', self.head_bytes_per_token)} must be >= 0")
        # Whether this torch has float8_e4m3fn (compress=fp8) is a property of the runtime, not of the
        # settings: `trainer.activations.install` checks it, where torch is loaded anyway.
        return self
