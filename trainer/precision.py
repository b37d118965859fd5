"""Training precision: `model.dtype` names the compute dtype of a run.

    float32            parameters, optimizer state and compute in fp32 (no autocast, also on GPU).
    bfloat16 / float16 mixed precision: the trainable parameters ("master weights") and the AdamW state
                       stay fp32, and every forward of the run -- the loss, the no-grad teacher / reference
                       passes and the engine's rollouts and evals -- runs under
                       torch.autocast(device_type, dtype), on CPU and GPU alike. float16 also scales the
                       loss (torch.amp.GradScaler) so small gradients do not flush to zero.

AdamW applied to bf16 parameters loses every update below half a bf16 ulp of the weight: on the tests'
tiny model, 3 SFT steps at lr 1e-5 changed 15% of the weight elements that way, against 100% in fp32 and
100% here (update cosine with fp32's 0.9992, relative error 0.04; tests/trainer/test_mixed_precision.py).
Why autocast rather than a bf16 model plus a separate fp32 copy: autocast keeps one set of weights (fp32),
so rollouts, eval, checkpoints, resume, export and every backend read the very tensors the optimizer
updates, with nothing to keep in sync; matmuls and attention run in the low-precision dtype, reductions,
softmax and norms in fp32 as autocast decides. The cost is memory: 4 bytes per weight, frozen copies
(a fixed / EMA teacher, a reference model) included. Frozen weights may be
low precision (a caller's bf16 base under LoRA); only what the optimizer updates must be fp32, and
`masters` / `check_masters` make sure of that.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Precision:
    dtype: str = "float32"  # model.dtype: float32 | bfloat16 | float16

    @property
    def compute(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def mixed(self) -> bool:
        return self.dtype != "float32"

    @property
    def scales_loss(self) -> bool:
        return self.dtype == "float16"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The context every forward of the run runs in. fp32 disables autocast explicitly (an outer
        autocast of the caller does not leak into an fp32 run)."""
        if not self.mixed:
            return torch.autocast(device.type, enabled=False)
        return torch.autocast(device.type, dtype=self.compute)

    def grad_scaler(self, device: torch.device):
        """torch.amp.GradScaler for float16 (dynamic loss scaling), None otherwise."""
        return torch.amp.GradScaler(device.type) if self.scales_loss else None

    def describe(self) -> str:
        if not self.mixed:
            return "precision: fp32 parameters, optimizer state and compute"
        line = f"precision: {SHORT[self.dtype]} compute (autocast), fp32 master weights and optimizer state"
        return line + (", dynamic loss scaling" if self.scales_loss else "")


def masters(model: nn.Module) -> list[str]:
    """Cast every trainable floating-point parameter that is not fp32 to fp32, in place; returns their
    names. A model loaded by this project is already fp32; this covers a caller's in-memory model."""
    cast = []
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
            cast.append(name)
    return cast


def check_masters(params) -> None:
    """Refuse to build an optimizer over low-precision parameters: AdamW would silently drop updates."""
    for p in params:
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"a trainable parameter of shape {tuple(p.shape)} is {str(p.dtype).removeprefix('torch.')}: "
                             "the optimizer updates fp32 master weights only (model.dtype sets the compute dtype)")
