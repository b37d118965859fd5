"""Triton kernel of the int4 low-bit linear on GPU: int8 per-token activations x packed int4 weights.

    out[m, n] = xs[m] * sum_g ws[n, g] * sum_{k in group g} a[m, k] * w[n, k]

a: int8 (M, K) quantized tokens (int8 or int4-valued, A8 / A4); xs: fp32 (M, 1) their scales;
w: the int4 weights as stored, int32 (N, K / 8) words in the `models.quant.pack_int4` layout
(nibble j of word i holds column 8 i + j, offset by 8), unpacked inside the kernel; ws: fp32
(N, groups) scales, one group (per output channel) or K / group_size groups. Each program owns a
(BLOCK_M, BLOCK_N) output tile; per weight group it accumulates tl.dot of int8 tiles into an int32
accumulator (exact), then adds accumulator * group scale into an fp32 tile; the token scale is
applied once at the end. The weights are never materialised as int8 in memory.

`lowbit.lowbit_linear` dispatches here for 4-bit weights with quantized activations on CUDA when
triton imports and `supported` says yes (a group width divisible by 32, the smallest K tile used:
int8 tl.dot needs K >= 32 on current GPUs); everything else runs the torch path. Under
TRITON_INTERPRET=1 the kernel runs on CPU tensors (the tests do that, in a subprocess, since the
variable must be set before triton is imported).
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a GPU extra
    triton = None

AVAILABLE = triton is not None
BLOCK_KS = (64, 32)  # the K tile: the largest of these dividing the group width (int8 MMA: K >= 32)
BLOCK_N = 64


def block_k(group_width: int) -> int | None:
    """The K tile for a weight group of `group_width` columns, or None when none divides it."""
    return next((b for b in BLOCK_KS if group_width % b == 0), None)


def supported(in_features: int, group_width: int) -> bool:
    """Whether the kernel runs this shape: triton imported and a K tile divides the group width."""
    return AVAILABLE and in_features % group_width == 0 and block_k(group_width) is not None


if AVAILABLE:

    @triton.jit
    def _int4_matmul_kernel(a_ptr, w_ptr, ws_ptr, xs_ptr, out_ptr, M, N, GROUPS,
                            stride_am, stride_wn, stride_sn, stride_om,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) token rows
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) output channels
        rk = tl.arange(0, BLOCK_K)  # (BK,)
        m_ok, n_ok = rm < M, rn < N
        out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, GROUPS):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for start in range(0, GROUP, BLOCK_K):
                k = g * GROUP + start + rk  # (BK,) input columns
                a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=m_ok[:, None], other=0)  # (BM, BK)
                words = tl.load(w_ptr + rn[None, :] * stride_wn + (k[:, None] // 8),
                                mask=n_ok[None, :], other=0)  # (BK, BN) int32, each word read for its 8 columns
                # Arithmetic shift then the low nibble: correct for words with the sign bit set too.
                b = (((words >> ((k[:, None] % 8) * 4)) & 0xF) - 8).to(tl.int8)  # (BK, BN) in [-8, 7]
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            scale = tl.load(ws_ptr + rn * stride_sn + g, mask=n_ok, other=0.0)  # (BN,)
            out += acc.to(tl.float32) * scale[None, :]
        xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)  # (BM,)
        out = out * xs[:, None]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


def int4_matmul(a: Tensor, xs: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
    """a int8 (M, K), xs fp32 (M, 1), packed int32 (N, K / 8), scale fp32 (N, groups) -> fp32 (M, N)."""
    if not AVAILABLE:
        raise RuntimeError("int4_matmul needs triton (pip install triton)")
    M, K = a.shape
    N, groups = scale.shape
    group = K // groups
    if packed.shape != (N, K // 8) or not supported(K, group):
        raise ValueError(f"int4_matmul: unsupported shapes a {tuple(a.shape)}, packed {tuple(packed.shape)}, "
                         f"scale {tuple(scale.shape)} (group width {group} needs a divisor in {BLOCK_KS})")
    a, packed = a.contiguous(), packed.contiguous()
    scale = scale.float().contiguous()
    xs = xs.float().reshape(M).contiguous()
    out = torch.empty(M, N, dtype=torch.float32, device=a.device)
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, BLOCK_N))
    _int4_matmul_kernel[grid](a, packed, scale, xs, out, M, N, groups,
                              a.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
                              GROUP=group, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k(group))
    return out
