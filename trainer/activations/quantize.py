"""Saved-tensor compression for HiLoRe: a per-group symmetric quantiser (int8 codes or fp8 e4m3
values, one fp32 scale per group of ``group_size`` consecutive elements), its eager or
``torch.compile``-fused kernels, and the shared compressed storage the compress hooks hand to autograd
(every saved view of one storage is packed once and dequantised once)."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import Tensor


class Packed:
    """A compressed saved tensor: codes (groups, group_size), fp32 scale per group, original meta."""

    __slots__ = ("codes", "scale", "shape", "dtype", "numel")

    def __init__(self, codes: Tensor, scale: Tensor, shape: torch.Size, dtype: torch.dtype, numel: int):
        self.codes, self.scale, self.shape, self.dtype, self.numel = codes, scale, shape, dtype, numel

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()


def _qmax(kind: str) -> float:
    return 127.0 if kind == "int8" else 448.0


def _quantize_int8(x2: Tensor, qmax: float) -> tuple[Tensor, Tensor]:
    scale = x2.abs().amax(1, keepdim=True).clamp_min(1e-30) / qmax
    return torch.round(x2 / scale).to(torch.int8), scale.squeeze(1)


def _quantize_fp8(x2: Tensor, qmax: float) -> tuple[Tensor, Tensor]:
    scale = x2.abs().amax(1, keepdim=True).clamp_min(1e-30) / qmax
    return (x2 / scale).to(torch.float8_e4m3fn), scale.squeeze(1)


def _dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    return codes.float() * scale[:, None]


_COMPILED: dict[str, Callable] = {}


def _kernel(name: str, fn: Callable, fused: bool) -> Callable:
    if not fused:
        return fn
    if name not in _COMPILED:
        try:
            _COMPILED[name] = torch.compile(fn, dynamic=True)
        except Exception:  # no compiler backend: eager fallback, same results
            _COMPILED[name] = fn
    return _COMPILED[name]


class Quantizer:
    """Per-group symmetric quantiser (int8 codes or fp8 e4m3 values) with an fp32 scale per group.

    Groups are ``group_size`` consecutive elements of the flattened tensor (= groups along the last
    dim when its size is a multiple of the group size; otherwise the tail is zero-padded). int8:
    ``scale = amax / 127``, ``code = round(x / scale)`` (nearest, or stochastic with a seeded
    generator), so the round-trip error is at most ``scale / 2`` per element."""

    def __init__(self, kind: str = "int8", group_size: int = 64, stochastic: bool = False, seed: int = 0,
                 fused: bool = False):
        self.kind, self.group_size, self.stochastic, self.seed = kind, group_size, stochastic, seed
        self.qmax = _qmax(kind)
        self._generators: dict[torch.device, torch.Generator] = {}
        quant = _quantize_int8 if kind == "int8" else _quantize_fp8
        self._quant = _kernel(f"q_{kind}", quant, fused)
        self._dequant = _kernel("dq", _dequantize, fused)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def pack(self, x: Tensor) -> Packed:
        gs, n = self.group_size, x.numel()
        flat = x.detach().reshape(-1)
        if n % gs:
            flat = torch.cat([flat, flat.new_zeros(gs - n % gs)])
        x2 = flat.view(-1, gs)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if self.stochastic:
            scale = x2.abs().amax(1, keepdim=True).clamp_min(1e-30) / self.qmax
            y = x2 / scale
            if self.kind == "int8":
                noise = torch.rand(y.shape, generator=self._generator(y.device), device=y.device)
                codes = torch.floor(y + noise).clamp_(-self.qmax, self.qmax).to(torch.int8)
            else:
                codes = _fp8_stochastic(y, self._generator(y.device))
            return Packed(codes, scale.squeeze(1), x.shape, x.dtype, n)
        codes, scale = self._quant(x2, self.qmax)
        return Packed(codes, scale, x.shape, x.dtype, n)

    @torch.no_grad()
    def unpack(self, p: Packed) -> Tensor:
        out = self._dequant(p.codes, p.scale).reshape(-1)
        if out.numel() != p.numel:
            out = out[: p.numel]
        return out.to(p.dtype).view(p.shape)


def _fp8_stochastic(y: Tensor, gen: torch.Generator) -> Tensor:
    """Stochastic rounding to e4m3: pick one of the two neighbouring representable values."""
    lo = y.to(torch.float8_e4m3fn).float()
    # the neighbour on the other side of y
    step = torch.where(lo == 0, torch.full_like(lo, 2.0 ** -9), lo.abs() * 2.0 ** -3)
    other = torch.where(y >= lo, lo + step, lo - step).clamp_(-448.0, 448.0)
    width = (other - lo).abs().clamp_min(1e-30)
    p_other = ((y - lo).abs() / width).clamp_(0, 1)
    pick = torch.rand(y.shape, generator=gen, device=y.device) < p_other
    return torch.where(pick, other, lo).to(torch.float8_e4m3fn)


class _Shared:
    """One compressed storage, shared by every saved view of it in a unit; the dequantised storage is
    cached (weakly) so views unpacked together dequantise once."""

    __slots__ = ("packed", "owner", "cache")

    def __init__(self, packed: Packed, owner: Any):
        self.packed, self.owner, self.cache = packed, owner, None


class _View:
    __slots__ = ("shared", "shape", "stride")

    def __init__(self, shared: _Shared, shape: torch.Size, stride: tuple):
        self.shared, self.shape, self.stride = shared, shape, stride

    def materialize(self, q: "Quantizer") -> Tensor:
        flat = self.shared.cache() if self.shared.cache is not None else None
        if flat is None:
            flat = q.unpack(self.shared.packed)
            self.shared.cache = weakref.ref(flat)
        return flat.as_strided(self.shape, self.stride, 0)
