"""Fake-quantized linears with plain low-bit operators, and the quantization arithmetic shared by
training, export and the runtime.

The convention (symmetric, as compressed-tensors and torchao spell it):

    b-bit integers q in [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1]
    scale = amax / ((qmax - qmin) / 2)        amax = max |x| over the scale's block
    q     = clamp(round(x * (1 / scale)), qmin, qmax)      (round half to even)
    x_hat = q * scale

Weights get one scale per output channel (`group_size=0`) or per group of `group_size` input
columns; activations are quantized dynamically, one scale per token (a row of the last axis).
The backward is the straight-through estimator: the gradient passes unchanged where the rounded
value lies inside [qmin, qmax] and is 0 where the clamp cut it. Scales are computed from the
tensor and treated as constants (no gradient, no learned scale), so a quantized model has exactly
the parameters of the full-precision one and checkpoints, optimizers and exports see plain weights.

    scheme = QuantScheme.parse("W4A8", group_size=32)
    names = apply_fake_quant(model, scheme, keep=("lm_head",))   # decoder-block linears only
    q, scale = quantize_weight(linear.weight, 4, 32)             # what export and the runtime store

`quantize_weight` and `quantize_tokens` are the one place the integers and scales are computed:
the compressed-tensors export stores what `quantize_weight` returns and the runtime's integer
matmul quantizes activations with `quantize_tokens`, so what is served equals what was trained.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.anatomy import causal_lm, decoder_layers

# format name -> (weight bits, activation bits or None for 16-bit activations)
FORMATS: dict[str, tuple[int, Optional[int]]] = {
    "W4A4": (4, 4), "W4A8": (4, 8), "W8A8": (8, 8), "W4A16": (4, None), "W8A16": (8, None),
}
DEFAULT_KEEP = ("lm_head",)


@dataclass(frozen=True)
class QuantScheme:
    """How each quantized linear runs: weight bits, activation bits (None: activations stay in the
    model's float dtype) and the weight group size (0: one scale per output channel)."""

    weight_bits: int
    act_bits: Optional[int]
    group_size: int = 0

    @classmethod
    def parse(cls, fmt: str, group_size: int = 0) -> "QuantScheme":
        if fmt not in FORMATS:
            raise ValueError(f"quantization format {fmt!r} is not one of {', '.join(FORMATS)}")
        if group_size < 0 or group_size == 1:
            raise ValueError(f"group_size={group_size} must be 0 (per output channel) or >= 2")
        weight_bits, act_bits = FORMATS[fmt]
        return cls(weight_bits, act_bits, group_size)

    @property
    def name(self) -> str:
        return f"W{self.weight_bits}A{self.act_bits or 16}"

    def groups(self, in_features: int) -> int:
        """Weight groups per output row; ValueError when group_size does not divide the width."""
        size = self.group_size or in_features
        if in_features % size:
            raise ValueError(f"group_size={self.group_size} does not divide the input width {in_features}")
        return in_features // size


# --- arithmetic ---------------------------------------------------------------------------------------


def int_range(bits: int) -> tuple[int, int]:
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def symmetric_scale(amax: Tensor, bits: int) -> Tensor:
    """amax / ((qmax - qmin) / 2) in fp32, never 0 (an all-zero block gets the smallest normal)."""
    qmin, qmax = int_range(bits)
    scale = amax.float() / ((qmax - qmin) / 2)
    return scale.clamp(min=torch.finfo(torch.float32).tiny)


def quantize(x: Tensor, scale: Tensor, bits: int) -> Tensor:
    """clamp(round(x * (1 / scale)), qmin, qmax) as fp32 integers; `scale` broadcasts against x."""
    qmin, qmax = int_range(bits)
    return torch.clamp(torch.round(x.float() * (1.0 / scale)), qmin, qmax)


class _FakeQuant(torch.autograd.Function):
    """q * scale forward; straight-through backward: identity where round(x / scale) was not clamped."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, bits: int) -> Tensor:
        qmin, qmax = int_range(bits)
        rounded = torch.round(x.float() * (1.0 / scale))
        ctx.save_for_backward((rounded >= qmin) & (rounded <= qmax))
        return (torch.clamp(rounded, qmin, qmax) * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None


def fake_quant(x: Tensor, scale: Tensor, bits: int) -> Tensor:
    """Quantize-dequantize `x` with a given (constant) scale, straight-through gradient."""
    return _FakeQuant.apply(x, scale.detach(), bits)


def weight_scale(weight: Tensor, bits: int, group_size: int = 0) -> Tensor:
    """(out, groups) fp32: one scale per output channel, or per `group_size` input columns."""
    out, width = weight.shape
    size = group_size or width
    if width % size:
        raise ValueError(f"group_size={group_size} does not divide the input width {width}")
    amax = weight.detach().reshape(out, width // size, size).abs().amax(-1)
    return symmetric_scale(amax, bits)


def _per_column(scale: Tensor, width: int) -> Tensor:
    """(out, groups) scales spread to (out, width)."""
    return scale.repeat_interleave(width // scale.shape[1], dim=1)


def quantize_weight(weight: Tensor, bits: int, group_size: int = 0) -> tuple[Tensor, Tensor]:
    """(q int8 (out, in), scale fp32 (out, groups)): the integers and scales a quantized linear
    stores. Training's fake-quant forward computes q * scale from exactly these."""
    scale = weight_scale(weight, bits, group_size)
    q = quantize(weight.detach(), _per_column(scale, weight.shape[1]), bits)
    return q.to(torch.int8), scale


def dequantize_weight(q: Tensor, scale: Tensor) -> Tensor:
    """q (out, in) * its (out, groups) scales -> fp32 (out, in)."""
    return q.float() * _per_column(scale.float(), q.shape[1])


def fake_quant_weight(weight: Tensor, bits: int, group_size: int = 0) -> Tensor:
    scale = weight_scale(weight, bits, group_size)
    return fake_quant(weight, _per_column(scale, weight.shape[1]), bits)


def token_scale(x: Tensor, bits: int) -> Tensor:
    """(..., 1) fp32: one dynamic scale per token (row of the last axis)."""
    return symmetric_scale(x.detach().abs().amax(-1, keepdim=True), bits)


def quantize_tokens(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """(q int8 (..., in), scale fp32 (..., 1)): dynamic symmetric per-token activation quantization."""
    scale = token_scale(x, bits)
    return quantize(x, scale, bits).to(torch.int8), scale


def fake_quant_tokens(x: Tensor, bits: int) -> Tensor:
    return fake_quant(x, token_scale(x, bits), bits)


# --- int4 packing (the compressed-tensors `pack-quantized` layout) -----------------------------------

PACK_FACTOR = 8  # int4 values per int32 word


def pack_int4(q: Tensor) -> Tensor:
    """int8 values in [-8, 7] (out, in) -> int32 (out, in / 8): each value offset by 8 to an unsigned
    nibble, nibble j of a word holding column 8 w + j (bits 4 j .. 4 j + 3, little-endian)."""
    out, width = q.shape
    if width % PACK_FACTOR:
        raise ValueError(f"int4 packing needs an input width divisible by {PACK_FACTOR}, got {width}")
    nibbles = (q.to(torch.int32) + 8).reshape(out, width // PACK_FACTOR, PACK_FACTOR)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    words = (nibbles << shifts).sum(-1, dtype=torch.int64)  # < 2^32: no overflow before the cast
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of pack_int4: int32 (out, in / 8) -> int8 (out, in)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # arithmetic shift, then the low nibble
    return (nibbles - 8).to(torch.int8).reshape(packed.shape[0], -1)


# --- modules ------------------------------------------------------------------------------------------


class _ToIntegers(torch.autograd.Function):
    """clamp(round(x * (1 / scale)), qmin, qmax) as fp32 integers; straight-through backward
    (grad / scale where the rounded value was not clamped, 0 elsewhere)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, bits: int) -> Tensor:
        qmin, qmax = int_range(bits)
        inv = 1.0 / scale
        rounded = torch.round(x.float() * inv)
        ctx.save_for_backward((rounded >= qmin) & (rounded <= qmax), inv)
        return torch.clamp(rounded, qmin, qmax)

    @staticmethod
    def backward(ctx, grad: Tensor):
        inside, inv = ctx.saved_tensors
        return grad * inside.to(grad.dtype) * inv, None, None


def quantized_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scheme: QuantScheme) -> Tensor:
    """F.linear(fq_tokens(x), fq_weight(W), b), computed the way the runtime's integer GEMM computes
    it: the integer products summed per weight group (exact in fp32 while below 2^24, as the
    int32 sums are), times the group's weight scales, summed over groups, times the token scale,
    plus the bias -- the same fp32 operations in the same order as `inference.lowbit`, so a
    quantized export reproduces the fake-quant forward bit for bit. Straight-through gradients."""
    if scheme.act_bits is None:
        return F.linear(x, fake_quant_weight(weight, scheme.weight_bits, scheme.group_size), bias)
    lead, width = x.shape[:-1], x.shape[-1]
    w_scale = weight_scale(weight, scheme.weight_bits, scheme.group_size)  # (out, G)
    qw = _ToIntegers.apply(weight, _per_column(w_scale, width), scheme.weight_bits)  # (out, in)
    flat = x.reshape(-1, width)
    x_scale = token_scale(flat, scheme.act_bits)  # (m, 1)
    qx = _ToIntegers.apply(flat, x_scale, scheme.act_bits)  # (m, in)
    groups = w_scale.shape[1]
    size = width // groups
    y = None
    for g in range(groups):
        cols = slice(g * size, (g + 1) * size)
        part = F.linear(qx[:, cols], qw[:, cols]) * w_scale[:, g]
        y = part if y is None else y + part
    y = y * x_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


class FakeQuantLinear(nn.Linear):
    """An nn.Linear whose forward is F.linear(fq_tokens(x), fq_weight(W), b) (`quantized_linear`):
    same parameters, same state-dict keys, low-bit numerics. The weights stay full precision (the
    optimizer updates them); the quantization is recomputed at every forward."""

    scheme: QuantScheme

    @classmethod
    def wrap(cls, linear: nn.Linear, scheme: QuantScheme) -> "FakeQuantLinear":
        """The same Parameter objects under the fake-quant forward (nothing copied)."""
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        module.weight = linear.weight
        module.bias = linear.bias
        module.scheme = scheme
        return module

    def forward(self, x: Tensor) -> Tensor:
        return quantized_linear(x, self.weight, self.bias, self.scheme)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scheme={self.scheme.name}, group_size={self.scheme.group_size}"


def kept(name: str, keep: Sequence[str]) -> bool:
    """Whether module `name` (or a module containing it) matches a keep pattern (fnmatch)."""
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, pattern) for pattern in keep for p in prefixes)


def check_keep(model: nn.Module, keep: Sequence[str]) -> None:
    """ValueError naming a keep pattern that matches no module of the model."""
    names = [n for n, _ in causal_lm(model).named_modules() if n]
    for pattern in keep:
        if not any(kept(n, [pattern]) for n in names):
            raise ValueError(f"keep pattern {pattern!r} matches no module of the model "
                             f"(module names look like {names[-1]!r})")


def quant_targets(model: nn.Module, scheme: QuantScheme, keep: Sequence[str] = DEFAULT_KEEP) -> dict[str, nn.Linear]:
    """name -> linear for every nn.Linear inside the decoder blocks that no keep pattern covers, in
    module order. Embeddings, norms and the output head are never quantized (they are not block
    linears). ValueError for a keep pattern matching nothing or a group size that does not divide
    a target's input width (naming the layer)."""
    check_keep(model, keep)
    lm = causal_lm(model)
    blocks = {id(m) for layer in decoder_layers(model, user="quantization") for m in layer.modules()}
    targets = {}
    for name, module in lm.named_modules():
        if isinstance(module, nn.Linear) and id(module) in blocks and not kept(name, keep):
            try:
                scheme.groups(module.in_features)
            except ValueError as err:
                raise ValueError(f"{err} of {name}") from None
            if scheme.weight_bits == 4 and module.in_features % PACK_FACTOR:
                raise ValueError(f"int4 weights pack {PACK_FACTOR} per int32: the input width {module.in_features} "
                                 f"of {name} is not divisible by {PACK_FACTOR}")
            targets[name] = module
    if not targets:
        raise ValueError("quantization: no decoder-block linear is left to quantize (keep covers them all)")
    return targets


def apply_fake_quant(model: nn.Module, scheme: QuantScheme, keep: Sequence[str] = DEFAULT_KEEP) -> list[str]:
    """Swap every target linear (`quant_targets`) for a FakeQuantLinear sharing its parameters, in
    place; returns the names swapped. The model stays a transformers model (same class, config,
    state dict)."""
    lm = causal_lm(model)
    targets = quant_targets(model, scheme, keep)
    for name, linear in targets.items():
        parent_name, _, child = name.rpartition(".")
        setattr(lm.get_submodule(parent_name), child, FakeQuantLinear.wrap(linear, scheme))
    return list(targets)


def fake_quant_modules(model: nn.Module) -> dict[str, FakeQuantLinear]:
    """name -> FakeQuantLinear of a model after apply_fake_quant (names relative to the causal LM)."""
    return {n: m for n, m in causal_lm(model).named_modules() if isinstance(m, FakeQuantLinear)}
