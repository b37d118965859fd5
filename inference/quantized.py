"""Load a quantized export (a compressed-tensors checkpoint, e.g. a `+algo=qad` run's `final/`)
into the runtime's low-bit path: each quantized linear becomes a `lowbit.LowBitLinear` holding the
stored integers and scales, every other tensor loads as saved, and the model stays a transformers
model whose lean forward (and HF forward) runs the integer matmuls.

    model, tokenizer = load_quantized("runs/qad/final")
    Engine(model).generate(prompts, params)     # lean decoder, low-bit projections

The checkpoint is read by `models.quant_export.read_compressed` (safetensors directly; the integers
are exactly those the trainer's fake-quant computed), never de-quantized to full-precision weights.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inference.lowbit import LowBitLinear
from models.quant_export import is_compressed, read_compressed

__all__ = ["is_compressed", "load_quantized"]


def load_quantized(path: str, device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
    """(model in eval mode on `device` with LowBitLinear projections, tokenizer) from `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = read_compressed(path)
    model = AutoModelForCausalLM.from_config(ckpt.config)
    quantized_weights = {f"{name}.weight" for name in ckpt.quantized}
    missing, unexpected = model.load_state_dict(ckpt.state, strict=False)
    tied = {"lm_head.weight"} if getattr(ckpt.config, "tie_word_embeddings", False) else set()
    left = set(missing) - quantized_weights - tied
    if left or unexpected:
        raise ValueError(f"{path}: the checkpoint does not match its config (missing {sorted(left)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]})")
    for name, (q, scale) in ckpt.quantized.items():
        parent, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        bias = None if old.bias is None else old.bias.detach()
        setattr(model.get_submodule(parent), child, LowBitLinear.from_quantized(q, scale, bias, ckpt.scheme))
    if tied:
        model.tie_weights()
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)
