"""Moving cached keys to new positions: the RoPE delta rotation, the one implementation shared by the
position-independent artifact cache (`pic.py`) and suffix cache reuse.

A key cached at position o holds R(o) k (RoPE rotation R by the angles o * inv_freq, after any
per-head k-norm). The same key at position n is R(n) k = R(n - o) R(o) k, so relocating it needs
only the cached key and the delta rotation; values carry no position and are never touched.
The angles are composed from fp32 tables the way the model builds its own (angle = float32(p *
inv_freq)), with

    cos(n - o) = cos_n cos_o + sin_n sin_o,    sin(n - o) = sin_n cos_o - cos_n sin_o,

so a relocated key matches the key computed at n up to fp32 rounding. The rotation runs in fp32
and is cast back to the cache dtype.

Layouts (`RopeLayout`, read from a model by `rope_layout`):
  half         rotate-half (GPT-NeoX / Llama / Qwen): dims i and i + r/2 of the rotary part pair up;
  interleaved  rotate-every-two (GPT-J, Cohere): dims 2i and 2i + 1 pair up;
  partial      only the first `rotary_dim` = 2 * len(inv_freq) dims of a head rotate (Phi, StableLM,
               GPT-NeoX with rotary_pct < 1); the rest pass unchanged.
Static RoPE scalings (linear, llama3, yarn: a fixed inv_freq, and an attention factor that
multiplies every key alike and commutes with the rotation) relocate exactly. RoPE whose
frequencies depend on the sequence length (dynamic NTK, longrope's short/long switch) cannot: a
key cached under one set of frequencies is not a rotation away from a key under another, so such
models are refused by name (`RelocationError`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

HALF, INTERLEAVED = "half", "interleaved"
# HF model types whose rotary embedding pairs adjacent dims (rotate-every-two).
INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "chatglm", "glm"})
# rope_type values whose frequencies depend on the current sequence length.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


class PICError(ValueError):
    """A request or model the position-independent cache cannot serve; the message says why. Defined here,
    the lightest module of the cache, so that training code (algorithms/pic_forward.py) raises the same
    error without importing the engine; `inference.pic` exports it."""


class RelocationError(ValueError):
    """A model whose RoPE layout makes relocating cached keys wrong; the message names why."""


@dataclass(frozen=True)
class RopeLayout:
    """What the delta rotation needs to know about a model's rotary embedding."""

    inv_freq: Tensor  # (r/2,) fp32 frequencies, as the model's own buffer holds them
    layout: str = HALF  # half | interleaved
    rope_type: str = "default"

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()


def _rotary_module(model: nn.Module) -> nn.Module | None:
    inner = getattr(model, "model", model)
    for candidate in (getattr(inner, "rotary_emb", None), getattr(getattr(inner, "layers", [None])[0], "self_attn",
                                                                 None)):
        if candidate is None:
            continue
        rotary = candidate if hasattr(candidate, "inv_freq") else getattr(candidate, "rotary_emb", None)
        if rotary is not None and hasattr(rotary, "inv_freq"):
            return rotary
    return None


def rope_layout(model: nn.Module) -> RopeLayout:
    """The RoPE layout of an HF causal LM (or its inner `.model`); RelocationError naming the reason
    when relocation would be wrong (length-dependent frequencies) or the layout is unknown."""
    config = model.config
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    name = type(model).__name__
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise RelocationError(f"{name} uses rope_type={rope_type!r}, whose frequencies depend on the sequence "
                              "length: a cached key is not a rotation away from the key at another position")
    rotary = _rotary_module(model)
    if rotary is None:
        raise RelocationError(f"{name} has no rotary embedding with an inv_freq buffer: relocation needs RoPE")
    layout = INTERLEAVED if getattr(config, "model_type", "") in INTERLEAVED_MODEL_TYPES else HALF
    inv_freq = rotary.inv_freq.detach().float()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if 2 * inv_freq.numel() > head_dim:
        raise RelocationError(f"{name}: inv_freq has {inv_freq.numel()} frequencies for head_dim {head_dim}")
    return RopeLayout(inv_freq, layout, rope_type)


def rope_angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin of the angles float32(p * inv_freq): positions (T,) -> each (T, r/2) fp32."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
    return angles.cos(), angles.sin()


def delta_rotation(old: Tensor, new: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos(n - o), sin(n - o) per position pair from the fp32 tables: old, new (T,) -> each (T, r/2)."""
    cos_o, sin_o = rope_angles(old, inv_freq)
    cos_n, sin_n = rope_angles(new, inv_freq)
    return cos_n * cos_o + sin_n * sin_o, sin_n * cos_o - cos_n * sin_o


def relocate_keys(keys: Tensor, old: Tensor | int, new: Tensor | int, rope: RopeLayout) -> Tensor:
    """Keys cached at positions `old` rotated to positions `new`; values need no relocation.

    keys: (..., T, D) with the position axis second to last (an HF cache layer (B, H_kv, T, D), the
    engine's (L, 2, B, H_kv, T, D) key half, one artifact's (L, H_kv, T, D)); old, new: (T,) long
    positions, or ints meaning the start of a run of T consecutive positions. Only the first
    `rope.rotary_dim` dims rotate. Computed in fp32, returned in keys' dtype (a new tensor).
    """
    T, D = keys.shape[-2], keys.shape[-1]
    old, new = _positions(old, T, keys.device), _positions(new, T, keys.device)
    if torch.equal(old, new):
        return keys.clone()
    r = rope.rotary_dim
    cos, sin = delta_rotation(old, new, rope.inv_freq)  # (T, r/2)
    k = keys.to(torch.float32)
    rot = k[..., :r]
    if rope.layout == HALF:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
        turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    elif rope.layout == INTERLEAVED:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        raise RelocationError(f"unknown RoPE layout {rope.layout!r}; expected {HALF} or {INTERLEAVED}")
    out = turned if r == D else torch.cat((turned, k[..., r:]), dim=-1)
    return out.to(keys.dtype)


def _positions(p: Tensor | int, T: int, device: torch.device) -> Tensor:
    if isinstance(p, int):
        return torch.arange(p, p + T, device=device)
    p = p.to(device)
    if p.shape != (T,):
        raise ValueError(f"positions of shape {tuple(p.shape)} for {T} cached keys")
    return p
