"""Load a quantized export (a compressed-tensors checkpoint, e.g. a `+algo=qad` run's `final/`)
into the runtime's low-bit path: each quantized linear becomes a `lowbit.LowBitLinear` holding the
stored integers and scales, every other tensor loads as saved, and the model stays a transformers
model whose lean forward (and HF forward) runs the integer matmuls.

    model, tokenizer = load_quantized("runs/qad/final")
    Engine(model).generate(prompts, params)     # lean decoder, low-bit projections
    save_quantized(model, tokenizer, "out")     # the inverse: the stored integers and scales, as they are

The checkpoint is read by `models.quant_export.read_compressed` (safetensors directly; the integers
are exactly those the trainer's fake-quant computed), never de-quantized to full-precision weights.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from inference.lowbit import LowBitLinear, lowbit_modules
from models.anatomy import causal_lm
from models.quant_export import (
    compress_layer, ct_scheme, is_compressed, plain_state, read_compressed, stored_scheme, unquantized_linears,
)

__all__ = ["is_compressed", "load_quantized", "save_quantized"]


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


def save_quantized(model: nn.Module, tokenizer: Any, out_dir: str, state: dict | None = None) -> None:
    """A compressed-tensors checkpoint of a model whose quantized linears are LowBitLinear modules (one
    loaded by `load_quantized`, e.g. the frozen base of a skipper trained over a QAD export): each
    module's stored integers and scales, written by the compressed-tensors compressor exactly as they
    are (`quant_export.compress_layer` checks it), every other tensor as in `state` (default: the
    model's state dict; pass a filtered one to leave modules out). The config gets its
    quantization_config back; the tokenizer is saved beside it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    lm = causal_lm(model)
    modules = lowbit_modules(lm)
    schemes = {m.scheme for m in modules.values()}
    if len(schemes) != 1:
        raise ValueError(f"save_quantized: one low-bit scheme per model is supported, found {len(schemes)}")
    (scheme,) = schemes
    group = ct_scheme(scheme)
    state = plain_state(lm) if state is None else {k: v.detach().cpu() for k, v in state.items()}
    ignore = [n for n in unquantized_linears(lm) if f"{n}.weight" in state]
    for name, module in modules.items():
        for key in [k for k in state if k.startswith(f"{name}.")]:
            del state[key]
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().cpu()
        state.update({f"{name}.{k}": v for k, v in compress_layer(module.q.cpu(), module.weight_scale.cpu(), group).items()})
    qconfig = QuantizationConfig(config_groups={"group_0": group}, format=group.format, ignore=ignore,
                                 quantization_status="compressed")
    lm.save_pretrained(out_dir, state_dict=state)
    ModelCompressor(quantization_config=qconfig).update_config(out_dir)
    tokenizer.save_pretrained(out_dir)


# ----------------------------------------------------------------------------- the serving door's weight format


def _detect(path: str) -> str | None:
    return stored_scheme(path).name if is_compressed(path) else None


def _refuse(manifest: Any, options: Any) -> str | None:
    if options.adapter:
        return (f"weights compressed ({manifest.scheme}): a LoRA adapter ({options.adapter}) cannot be merged into "
                "low-bit weights")
    if options.speculative and not str(manifest.scheme).endswith("A16"):
        return (f"scheme {manifest.scheme} quantizes activations per token: speculative verification rounds them "
                f"differently from one-token decoding, so speculative={options.speculative} would not be exact "
                "(weight-only W4A16 / W8A16 serve speculatively)")
    return None


def _register() -> None:
    from inference.serving import WeightFormat, register_weights

    register_weights(WeightFormat(name="compressed", detect=_detect, load=load_quantized, refuse=_refuse))


_register()
