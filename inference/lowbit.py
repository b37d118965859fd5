"""Low-bit linears of the runtime: integer weights, per-token integer activations, integer GEMM.

What training's `models.quant.FakeQuantLinear` simulates in floating point, this file runs for real:

    y = F.linear(fq_tokens(x), fq_weight(W), b)                      (fake quant, training)
      = sx * sum_g sw[:, g] * (qx[:, g] @ qw[:, g]^T) + b             (here: int8 x int8 -> int32)

with qx, sx = quantize_tokens(x) (one fp32 scale per token) and qw, sw = quantize_weight(W) (one
fp32 scale per output channel, or per group of input columns). The integer products are exact
(int32 accumulation); only the scaling is fp32, so the two agree to fp32 rounding.

    model = to_lowbit(fake_quantized_model)          # every FakeQuantLinear -> LowBitLinear
    model = to_lowbit(model, QuantScheme.parse("W4A8", group_size=32))   # or quantize directly
    Engine(model).generate(...)                      # the lean decoder runs the low-bit op

Storage. 8-bit weights: an int8 (out, in) buffer `weight`. 4-bit weights: the packed int32
(out, in / 8) buffer `weight_packed` (`models.quant.pack_int4`, the compressed-tensors layout a
checkpoint stores) plus an int8 (out, in) copy `weight_unpacked`, unpacked once at construction
(and after a state-dict load), not saved: torch has no int4 GEMM on CPU (`torch._int_mm` takes int8
only), so the torch path multiplies the unpacked int8 values. On CUDA with Triton the int4 path
(`lowbit_triton.py`) reads the packed words and unpacks them inside the kernel instead. Scales
are an fp32 (out, groups) buffer `weight_scale` that stays fp32 when the model is cast.

The op, `lowbit_linear(x, weights, bias)`:
  act_bits set      quantize_tokens, then the integer GEMM per weight group (int32 accumulation),
                    partial products scaled by the group's weight scales and summed in fp32, times
                    the token scale, plus bias, in x's dtype. The GEMM: on CPU FBGEMM's u8 x s8
                    kernel, laid out so it stays exact (`cpu_int_matmul`; torch._int_mm where FBGEMM
                    is missing); on CUDA `torch._int_mm`, or for W4 with Triton the fused int4 kernel.
  act_bits None     weight only (W4A16, W8A16): dequantize the weight to x's dtype, then F.linear.

A LowBitLinear is a frozen snapshot: integers, scales and a copy of the bias are taken at
conversion; later updates to the float model it came from are not seen (convert again).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference.lean import LinearKind, register_linear
from models.anatomy import causal_lm
from models.quant import (
    DEFAULT_KEEP, FakeQuantLinear, QuantScheme, dequantize_weight, fake_quant_tokens, int_range, pack_int4,
    quant_targets, quantize_tokens, quantize_weight, token_scale, unpack_int4,
)

__all__ = ["LowBitLinear", "LowBitWeights", "int_matmul", "scaled_int_matmul", "lowbit_linear", "to_lowbit",
           "lowbit_modules"]

# torch._int_mm on CUDA needs more than 16 rows and k, n multiples of 8 (CPU takes any shape).
_CUDA_MIN_ROWS, _CUDA_MULTIPLE = 17, 8


@dataclass(frozen=True)
class LowBitWeights:
    """What the low-bit op needs of one (possibly fused) quantized linear.

    q: int8 (out, in) integers (int4 values unpacked); scale: fp32 (out, groups); packed: the int32
    (out, in / 8) words of 4-bit weights (None for 8-bit).
    """

    q: Tensor
    scale: Tensor
    scheme: QuantScheme
    packed: Optional[Tensor] = None
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # prepacked CPU GEMM operands

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @staticmethod
    def cat(parts: Sequence["LowBitWeights"]) -> "LowBitWeights":
        """Fused along the output axis (q|k|v, gate|up); the parts must share scheme and input width."""
        first = parts[0]
        if any(p.scheme != first.scheme or p.in_features != first.in_features for p in parts):
            raise ValueError("only low-bit weights of one scheme and input width can be fused")
        if len(parts) == 1:
            return first
        packed = None if first.packed is None else torch.cat([p.packed for p in parts])
        return LowBitWeights(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                             first.scheme, packed)


# ----------------------------------------------------------------------------- integer GEMM


def _int_mm(a: Tensor, b: Tensor) -> Tensor:
    """torch._int_mm(a int8 (m, k), b int8 (k, n)) -> int32 (m, n). On CUDA, zero-pads to the
    shapes cuBLAS accepts (zero rows/columns add nothing; the padding is sliced off). On CPU,
    operands in neither row- nor column-major layout (a broadcast, stride 0) are copied first: the
    VNNI kernel of torch 2.13 returns garbage for them (an expanded row, measured on an AVX-512 VNNI
    EPYC; the AVX2 path was right)."""
    if not a.is_cuda:
        return torch._int_mm(_one_layout(a), _one_layout(b))
    (m, k), n = a.shape, b.shape[1]
    mp = max(m, _CUDA_MIN_ROWS)
    kp, np_ = (-(-size // _CUDA_MULTIPLE) * _CUDA_MULTIPLE for size in (k, n))
    if (mp, kp, np_) != (m, k, n):
        a = F.pad(a, (0, kp - k, 0, mp - m))
        b = F.pad(b, (0, np_ - n, 0, kp - k))
    return torch._int_mm(a.contiguous(), _one_layout(b))[:m, :n]  # b: e.g. a group's column slice


def _one_layout(t: Tensor) -> Tensor:
    """`t` if it is row- or column-major, else a column-major copy (a slice or a broadcast)."""
    return t if t.is_contiguous() or t.t().is_contiguous() else t.t().contiguous().t()


def int_matmul(a: Tensor, q: Tensor) -> Tensor:
    """a int8 (m, k) @ q int8 (n, k)^T -> int32 (m, n), exact (int32 accumulation)."""
    return _int_mm(a, q.t())


# The CPU integer GEMM. torch._int_mm (s8 x s8) has no fast kernel on x86 CPUs without VNNI / AMX
# (measured on an AVX2 EPYC: 20-50x slower than fp32 sgemm). FBGEMM's u8 x s8 kernels are fast
# there, but sum adjacent u8 * s8 products in int16 with saturation (AVX2 vpmaddubsw), so each
# case is laid out so that no pair can leave int16 and the int32 result stays exact:
#   4-bit weights (|w| <= 8): activations offset to u8 = a + 128 in [0, 255]: |pair| <= 2*255*8.
#   8-bit weights: a = p - n with p = max(a, 0) in [0, 127], n = max(-a, 0) in [0, 128], both rows
#   of one GEMM (zero point 0): pairs in [-32768, 32512]; the result is the p rows minus the n rows.
_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines
_CPU_GEMM_OP = "linear_with_input_q_dq_qweight_dq_output_fp32"


def _cpu_gemm_available() -> bool:
    return _FBGEMM and hasattr(torch.ops.quantized, _CPU_GEMM_OP)


def _prepack(q: Tensor) -> Any:
    """FBGEMM's packed form of int8 weights (n, k) with unit scales (outputs are raw integer sums).
    torch marks its quantized-tensor constructors deprecated; the warning is silenced here, and
    `_cpu_gemm_available` sends everything to torch._int_mm the day they are gone."""
    import warnings

    n = q.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wq = torch._make_per_channel_quantized_tensor(q.contiguous(), torch.ones(n, dtype=torch.double),
                                                      torch.zeros(n, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(wq, None)


def cpu_int_matmul(a: Tensor, packed: Any, weight_bits: int) -> Tensor:
    """a (m, k) integers (int8, or fp32 holding integers) @ the prepacked int8 weights^T -> (m, n)
    fp32 holding the exact int32 sums (exact in fp32 below 2^24 in magnitude; beyond, one fp32
    rounding, as any fp32 scaling of them)."""
    op = getattr(torch.ops.quantized, _CPU_GEMM_OP)
    x = a.float()
    if weight_bits == 4:
        return op(x, 1.0, 128, packed)
    m = x.shape[0]
    both = op(torch.cat([x.clamp(min=0), (-x).clamp(min=0)]), 1.0, 0, packed)
    return both[:m] - both[m:]


def _cpu_lowbit(x: Tensor, weights: "LowBitWeights") -> Tensor:
    """The CPU low-bit op on x (m, in) -> fp32 (m, out) before bias: quantize_tokens' integers, kept
    in fp32 (the kernel quantizes its input itself, exactly, at scale 1), with no int8 round trip.
    They are rounded here: the kernel adds its zero point before rounding, which would turn values
    just below a half (-7.4999995 + 128 = 120.5 in fp32) into ties."""
    s = weights.scheme
    qmin, qmax = int_range(s.act_bits)
    scale = token_scale(x, s.act_bits)  # (m, 1) fp32
    scaled = (x.float() * (1.0 / scale)).round_().clamp_(qmin, qmax)
    return _scaled_groups(scaled, weights.q, weights.scale, _cpu_packs(weights), s.weight_bits).mul_(scale)


def scaled_int_matmul(a: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """sum over weight groups g of scale[:, g] * (a[:, g] @ q[:, g]^T): fp32 (m, n).

    a: int8 (m, k); q: int8 (n, k); scale: fp32 (n, groups), groups dividing k. One integer GEMM
    per group (exact int32), each partial product scaled in fp32 and summed.
    """
    return _scaled_groups(a, q, scale, None, 8)


def _scaled_groups(a: Tensor, q: Tensor, scale: Tensor, packs: Optional[list], weight_bits: int) -> Tensor:
    """scaled_int_matmul through `torch._int_mm` (packs None) or FBGEMM's prepacked groups."""
    groups = scale.shape[1]
    size = a.shape[1] // groups
    scale = scale.float()
    out = None
    for g in range(groups):
        cols = slice(g * size, (g + 1) * size)
        acc = int_matmul(a[:, cols], q[:, cols]).float() if packs is None else \
            cpu_int_matmul(a[:, cols].contiguous(), packs[g], weight_bits)
        part = acc.mul_(scale[:, g])
        out = part if out is None else out.add_(part)
    return out


def _cpu_packs(weights: "LowBitWeights") -> list:
    """FBGEMM operands of `weights`, one per weight group, prepacked on first use and cached."""
    if "fbgemm" not in weights.cache:
        groups = weights.scale.shape[1]
        size = weights.in_features // groups
        weights.cache["fbgemm"] = [_prepack(weights.q[:, g * size:(g + 1) * size]) for g in range(groups)]
    return weights.cache["fbgemm"]


def _triton_ready(x: Tensor, weights: LowBitWeights) -> bool:
    if not x.is_cuda or weights.packed is None:
        return False
    from inference import lowbit_triton  # imports triton: only on a CUDA tensor

    return lowbit_triton.supported(weights.in_features, weights.scheme.group_size or weights.in_features)


def lowbit_linear(x: Tensor, weights: LowBitWeights, bias: Optional[Tensor] = None) -> Tensor:
    """The low-bit linear op: x (..., in) -> (..., out) in x's dtype. Same signature as F.linear
    (a `lean.LinearOp` with LowBitWeights in the weight slot)."""
    scheme = weights.scheme
    if scheme.act_bits is None:  # weight only: activations stay in x's float dtype
        # de-quantized per call: a copy kept with the operands would hold the full-precision weights
        # the format exists to avoid storing
        return F.linear(x, dequantize_weight(weights.q, weights.scale).to(x.dtype), bias)
    lead = x.shape[:-1]
    if _triton_ready(x, weights):
        from inference import lowbit_triton

        qx, sx = quantize_tokens(x.reshape(-1, x.shape[-1]), scheme.act_bits)  # (m, in) int8, (m, 1) fp32
        y = lowbit_triton.int4_matmul(qx, sx, weights.packed, weights.scale)  # (m, out) fp32, token scale in
    elif not x.is_cuda and _cpu_gemm_available():
        y = _cpu_lowbit(x.reshape(-1, x.shape[-1]), weights)  # (m, out) fp32
    else:
        qx, sx = quantize_tokens(x.reshape(-1, x.shape[-1]), scheme.act_bits)
        y = scaled_int_matmul(qx, weights.q, weights.scale).mul_(sx)  # (m, out) fp32
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x.dtype).reshape(*lead, weights.out_features)


# ----------------------------------------------------------------------------- the module


class LowBitLinear(nn.Module):
    """A quantized linear: integer weights, fp32 scales, optional bias; forward = `lowbit_linear`.

    Buffers (no parameters: nothing here trains): `weight` int8 (out, in) for 8-bit weights, or
    `weight_packed` int32 (out, in / 8) plus the unsaved int8 copy `weight_unpacked` for 4-bit
    weights (see the module docstring for why the copy); `weight_scale` fp32 (out, groups); `bias`.
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if scheme.weight_bits == 4 and in_features % 8:
            raise ValueError(f"int4 weights pack 8 per int32: the input width {in_features} is not divisible by 8")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = scheme.groups(in_features)
        if scheme.weight_bits == 4:
            self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 8, dtype=torch.int32,
                                                              device=device))
            self.register_buffer("weight_unpacked", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                                device=device), persistent=False)
        else:
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_quantized(cls, q: Tensor, scale: Tensor, bias: Optional[Tensor], scheme: QuantScheme) -> "LowBitLinear":
        """From the integers and scales `models.quant.quantize_weight` returns (q int8 (out, in) in the
        scheme's weight range, scale (out, groups)); the bias is copied."""
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q must be an int8 (out, in) tensor, got {q.dtype} {tuple(q.shape)}")
        out, width = q.shape
        qmin, qmax = int_range(scheme.weight_bits)
        if q.numel() and (int(q.min()) < qmin or int(q.max()) > qmax):
            raise ValueError(f"{scheme.weight_bits}-bit weights must lie in [{qmin}, {qmax}]")
        if tuple(scale.shape) != (out, scheme.groups(width)):
            raise ValueError(f"scale shape {tuple(scale.shape)} != (out, groups) = {(out, scheme.groups(width))}")
        module = cls(width, out, scheme, bias=bias is not None, device=q.device,
                     dtype=bias.dtype if bias is not None else torch.float32)
        with torch.no_grad():
            if scheme.weight_bits == 4:
                module.weight_packed.copy_(pack_int4(q))
                module.weight_unpacked.copy_(unpack_int4(module.weight_packed))  # from what is stored
            else:
                module.weight.copy_(q)
            module.weight_scale.copy_(scale.float())
            if bias is not None:
                module.bias.copy_(bias.detach())
        return module

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: QuantScheme) -> "LowBitLinear":
        """Quantize a float nn.Linear (or FakeQuantLinear: the same integers its forward uses)."""
        q, scale = quantize_weight(linear.weight.detach(), scheme.weight_bits, scheme.group_size)
        return cls.from_quantized(q, scale, linear.bias, scheme)

    @property
    def q(self) -> Tensor:
        """int8 (out, in): the integers the torch path multiplies."""
        return self.weight_unpacked if self.scheme.weight_bits == 4 else self.weight

    def weights(self) -> LowBitWeights:
        """The op's operands, kept between calls (so a CPU GEMM prepacks once); rebuilt when a
        buffer was replaced (.to(), a state-dict load)."""
        packed = self.weight_packed if self.scheme.weight_bits == 4 else None
        cached = self.__dict__.get("_weights")
        if cached is None or cached.q is not self.q or cached.scale is not self.weight_scale or cached.packed is not packed:
            cached = LowBitWeights(self.q, self.weight_scale, self.scheme, packed)
            self.__dict__["_weights"] = cached
        return cached

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # a frozen low-bit base under trained modules
            return _LowBitThrough.apply(x, self)
        return lowbit_linear(x, self.weights(), self.bias)

    def _apply(self, fn, recurse: bool = True):
        # Module.to(dtype) casts floating buffers; the scales must stay fp32 (only the device moves).
        scale = self.weight_scale
        super()._apply(fn, recurse)
        self.weight_scale = scale.to(self.weight_scale.device)
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.__dict__.pop("_weights", None)  # in-place copies keep the tensors: drop the prepacked operands
        if self.scheme.weight_bits == 4:  # the unsaved int8 copy follows the loaded packed words
            with torch.no_grad():
                self.weight_unpacked.copy_(unpack_int4(self.weight_packed))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme.name}, group_size={self.scheme.group_size}")


class _LowBitThrough(torch.autograd.Function):
    """The integer op's output forward; backward, the gradient with respect to x of training's
    fake-quant linear: the stored weights de-quantized, the tokens fake-quantized
    (`models.quant.fake_quant_tokens`: straight through the rounding, through the token scale).
    Nothing of the module trains; gradients reach the modules below it (a layer skipper's routers
    trained over a low-bit base, `+algo=skipper model.path=QAD_EXPORT`)."""

    @staticmethod
    def forward(ctx, x: Tensor, module: "LowBitLinear") -> Tensor:
        ctx.module = module
        ctx.save_for_backward(x)
        return lowbit_linear(x, module.weights(), module.bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        module = ctx.module
        weight = dequantize_weight(module.q, module.weight_scale).to(x.dtype)  # (out, in): the stored grid
        bits = module.scheme.act_bits
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            out = F.linear(fake_quant_tokens(x, bits) if bits is not None else x, weight)
            (grad_x,) = torch.autograd.grad(out, x, grad)
        return grad_x, None


# ----------------------------------------------------------------------------- model conversion


def to_lowbit(model: nn.Module, scheme: QuantScheme | None = None, keep: Sequence[str] = DEFAULT_KEEP) -> nn.Module:
    """Replace linears by LowBitLinear, in place; returns the model.

    scheme None: every FakeQuantLinear (after `models.quant.apply_fake_quant`), each with its own
    scheme (ValueError when there is none). Given a scheme: the decoder-block linears
    `models.quant.quant_targets(model, scheme, keep)` picks (plain or fake-quant).
    """
    lm = causal_lm(model)
    if scheme is None:
        targets = {n: (m, m.scheme) for n, m in lm.named_modules() if isinstance(m, FakeQuantLinear)}
        if not targets:
            raise ValueError("to_lowbit: the model has no FakeQuantLinear; pass a scheme to quantize it directly")
    else:
        targets = {n: (m, scheme) for n, m in quant_targets(model, scheme, keep).items()}
    for name, (linear, module_scheme) in targets.items():
        parent, _, child = name.rpartition(".")
        setattr(lm.get_submodule(parent), child, LowBitLinear.from_linear(linear, module_scheme))
    return model


def lowbit_modules(model: nn.Module) -> dict[str, LowBitLinear]:
    """name -> LowBitLinear of a converted model (names relative to the causal LM)."""
    return {n: m for n, m in causal_lm(model).named_modules() if isinstance(m, LowBitLinear)}


# ----------------------------------------------------------------------------- the lean decoder's linear op


def _fake_quant_weights(module: FakeQuantLinear) -> LowBitWeights:
    """The low-bit op's operands of training's FakeQuantLinear, quantized now from its live weights by
    `models.quant.quantize_weight` (the integers its own forward uses), so the trainer's eval of a
    fake-quant student runs exactly what its export will serve."""
    s = module.scheme
    q, scale = quantize_weight(module.weight.detach(), s.weight_bits, s.group_size)
    packed = pack_int4(q) if s.weight_bits == 4 and q.is_cuda else None  # the Triton kernel reads packed words
    return LowBitWeights(q, scale, s, packed)


def _lowbit_key(module) -> tuple:
    return ("lowbit", module.scheme)  # stored and fake-quant weights of one scheme fuse together


# Seam 2: projections of these module types run the integer GEMM (`lean.register_linear`).
register_linear(LowBitLinear, LinearKind(operand=LowBitLinear.weights, op=lowbit_linear, fuse=LowBitWeights.cat,
                                         key=_lowbit_key))
register_linear(FakeQuantLinear, LinearKind(operand=_fake_quant_weights, op=lowbit_linear, fuse=LowBitWeights.cat,
                                            key=_lowbit_key))
