"""HiLoRe: activation management for the actor update (full / compressed / recomputed recovery units).

Each decoder layer of the causal LM is a *recovery unit*. Its saved activations get one of three
treatments, chosen per micro-batch:

- ``full``: normal autograd (saved tensors kept as they are);
- ``compress``: saved tensors stored compressed through ``torch.autograd.graph.saved_tensors_hooks``
  (per-group symmetric int8 -- or fp8 e4m3 -- with one fp32 scale per group of ``group_size``
  consecutive elements, i.e. groups along the last dim when it is a multiple of the group size);
- ``recompute``: non-reentrant ``torch.utils.checkpoint`` of the layer forward with the RNG state
  preserved (exact gradients, dropout included).

Mode ``checkpoint`` recomputes every unit (the gradient-checkpointing baseline). Mode ``hilore`` plans.

Exposure. Before each micro-batch the trainer calls ``set_exposure(coef)`` with the per-token
``|dL/dlogp_t|`` coefficients of the GRPO loss, (B, T), known before backward (|A_b| * rho_t on
unclipped tokens, 0 on clipped tokens, on A = 0 rows and on padding), or None (uniform: every token 1).
The micro-batch exposure is the mean per-token coefficient::

    E = sum(|coef|) / coef.numel()        (None -> E = 1; all advantages 0 -> E = 0)

so uniform exposure is 1, a GRPO batch with unit-variance advantages is about mean|A| (~0.8), and
zero-coefficient samples and padding expose nothing.

Risk. Profiling measures per unit the relative compression error of its saved tensors
``err_l = sqrt(sum ||x - deq(q(x))||^2 / sum ||x||^2)`` (over the tensors that get compressed).
The risk of compressing unit l is ``err_l * E``; a plan's risk is the sum over its compressed units.
It reads as a first-order bound on the relative error that compression adds to the micro-batch's
gradient (per-unit relative perturbations add up along the backward pass). The default risk budget
0.05 therefore allows about 5% relative gradient perturbation (gradient cosine >= ~0.998). With
E = 0 every plan has risk 0: compression is then only limited by memory and time.

The package, by concern:

- ``options``: :class:`ActivationConfig`, the one declaration and validation of the settings
  (torch-free: ``trainer.config`` validates the ``trainer.activation*`` keys with it);
- ``planner``: the pure planner (profiles -> peak / risk / cost estimates -> a plan per micro-batch);
- ``quantize``: the int8 / fp8 saved-tensor quantiser;
- ``manager``: :class:`ActivationManager` and :func:`install`: profiling, the saved-tensor hooks,
  checkpointing, installed on the decoder layers through ``models.layer_wrap``.

Importing the package loads only the torch-free ``options`` and ``planner``; the names of
``quantize`` and ``manager`` are loaded on first use, so ``import trainer.config`` (which validates
with ``options``) keeps torch unloaded.
"""
from __future__ import annotations

import importlib

from trainer.activations.options import COMPRESSIONS, MODES, ActivationConfig, trainer_key
from trainer.activations.planner import (ACCUMULATED, COMPRESS, FRESH, FULL, RECOMPUTE, TREATMENTS, PlanEstimate,
                                         Profile, UnitProfile, estimate, plan_units)

_LAZY = {  # public name -> submodule that imports torch
    "Packed": "quantize",
    "Quantizer": "quantize",
    "ActivationManager": "manager",
    "install": "manager",
}

__all__ = ["ACCUMULATED", "COMPRESS", "COMPRESSIONS", "FRESH", "FULL", "MODES", "RECOMPUTE", "TREATMENTS",
           "ActivationConfig", "ActivationManager", "Packed", "PlanEstimate", "Profile", "Quantizer", "UnitProfile",
           "estimate", "install", "plan_units", "trainer_key"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
