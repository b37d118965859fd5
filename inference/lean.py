"""Lean decoder: our own forward for Qwen3 / Qwen2 / Llama over the live model's weights.

Why: at rollout sizes the per-step cost of the Hugging Face module stack (mask builders, cache
objects, decorators, ~10 Python calls per op) dominates the arithmetic. This file runs the same
math with a handful of fused torch ops per layer and a pre-allocated KV cache.

What it supports (anything else falls back to the HF path in `hf_backend.py`):
  RMSNorm pre-norm decoder layers, default RoPE (`config.rope_parameters["rope_theta"]`, no
  scaling), GQA, SiLU-gated MLP, optional q/k/v/o/MLP biases (Qwen2, Llama `attention_bias`),
  optional per-head q/k RMSNorm (Qwen3), tied or untied lm_head, full attention only, and only
  plain `torch.nn.Linear` projections (LoRA / quantized linears must run their own forward).

Weights are read by reference from the model at the start of each `generate` call; the fused
q|k|v and gate|up matrices built from them live only for that call, so weight updates between
rollouts are always seen.

KV cache layout: one buffer `(L, 2, B, H_kv, T_max, D)`; rows [0, n) of the batch axis are the
live rows, so dropping finished rows is an in-place gather of the used prefix (no reallocation).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# HF class name -> whether its attention applies per-head q/k RMSNorm.
LEAN_ARCHITECTURES = {"Qwen3ForCausalLM": True, "Qwen2ForCausalLM": False, "LlamaForCausalLM": False}
DEFAULT_ROPE = "default"
SUPPORTED_ACTIVATION = "silu"
FULL_ATTENTION = "full_attention"
KEY, VALUE = 0, 1


# ----------------------------------------------------------------------------- support check


def lean_unsupported_reason(model: nn.Module) -> str | None:
    """Why the lean decoder cannot run `model` exactly, or None when it can."""
    name = type(model).__name__
    if hasattr(model, "peft_config"):
        return f"the model is wrapped by PEFT ({name}); adapters run in their own forward"
    if name not in LEAN_ARCHITECTURES:
        return f"architecture {name} is not one of {sorted(LEAN_ARCHITECTURES)}"
    for check in (_config_reason, _module_reason):
        reason = check(model)
        if reason is not None:
            return reason
    return None


def _config_reason(model: nn.Module) -> str | None:
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", DEFAULT_ROPE) != DEFAULT_ROPE:
        return f"rope_type {rope.get('rope_type')!r} (only default RoPE is implemented)"
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    if getattr(config, "hidden_act", SUPPORTED_ACTIVATION) != SUPPORTED_ACTIVATION:
        return f"activation {config.hidden_act!r} (only silu)"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != FULL_ATTENTION for kind in layer_types):
        return f"layer types {sorted(set(layer_types))} (only full attention)"
    return None


def _module_reason(model: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            return f"{name} is a {type(module).__name__}, not a plain torch.nn.Linear"
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{name or 'model'} has forward hooks the lean path would skip"
    if not hasattr(getattr(model.model, "rotary_emb", None), "inv_freq"):
        return "no model.rotary_emb.inv_freq buffer to build RoPE tables from"
    expected = [model.lm_head, model.model.embed_tokens]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        expected += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        expected += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    for module in expected:
        if type(module) not in (nn.Linear, nn.Embedding):
            return f"{type(module).__name__} where a plain Linear/Embedding was expected"
    return _norm_reason(model)


def _norm_reason(model: nn.Module) -> str | None:
    """Norms are re-implemented as HF's RMSNorm; anything else (a swapped-in norm) must run its own."""
    eps = model.config.rms_norm_eps
    norms = [model.model.norm]
    for layer in model.model.layers:
        attn = layer.self_attn
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attn, name) for name in ("q_norm", "k_norm") if hasattr(attn, name)]
    for norm in norms:
        if not type(norm).__name__.endswith("RMSNorm") or norm.variance_epsilon != eps:
            return f"{type(norm).__name__} is not the architecture's RMSNorm with eps={eps}"
    return None


# ----------------------------------------------------------------------------- weights


@dataclass
class Dims:
    """Sizes of the decoder, read from the config at each call."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qk_norm: bool

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def read_dims(model: nn.Module) -> Dims:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Dims(
        layers=config.num_hidden_layers,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        eps=config.rms_norm_eps,
        qk_norm=LEAN_ARCHITECTURES[type(model).__name__],
    )


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (C,)
    qkv: torch.Tensor  # ((H + 2 H_kv) D, C) fused q|k|v projection
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # (H + H_kv, D) per-head q_norm rows then k_norm rows (Qwen3)
    o: torch.Tensor  # (C, H D)
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # (C,)
    gate_up: torch.Tensor  # (2 I, C) fused gate|up projection
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # (C, I)
    down_bias: torch.Tensor | None


@dataclass
class Weights:
    embed: torch.Tensor  # (V, C)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (C,)
    lm_head: torch.Tensor  # (V, C)


def _cat_bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                      for lin in linears])


def _layer_weights(layer: nn.Module, dims: Dims) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qk_norm = None
    if dims.qk_norm:
        q_rows = attn.q_norm.weight.detach().expand(dims.heads, dims.head_dim)
        k_rows = attn.k_norm.weight.detach().expand(dims.kv_heads, dims.head_dim)
        qk_norm = torch.cat([q_rows, k_rows])  # (H + H_kv, D)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
        qkv_bias=_detach(_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj)),
        qk_norm=qk_norm,
        o=attn.o_proj.weight.detach(),
        o_bias=_detach(attn.o_proj.bias),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
        gate_up_bias=_detach(_cat_bias(mlp.gate_proj, mlp.up_proj)),
        down=mlp.down_proj.weight.detach(),
        down_bias=_detach(mlp.down_proj.bias),
    )


def _detach(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def read_weights(model: nn.Module, dims: Dims) -> Weights:
    """Reference the live weights (fusing q|k|v and gate|up for this call only)."""
    return Weights(
        embed=model.model.embed_tokens.weight.detach(),
        layers=[_layer_weights(layer, dims) for layer in model.model.layers],
        final_norm=model.model.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
    )


# ----------------------------------------------------------------------------- RoPE


@dataclass
class Rope:
    """cos / signed-sin tables for positions [0, T_max), built once and reused while valid.

    `sin_signed = cat(-sin, sin)` so that rotate_half(x) * sin == roll(x, D/2) * sin_signed,
    which is bit-identical to the HF formula with one op fewer.
    """

    inv_freq: torch.Tensor  # (D/2,) fp32, the source the tables were built from
    cos: torch.Tensor  # (T_max, D) fp32
    sin_signed: torch.Tensor  # (T_max, D) fp32


def rope_tables(model: nn.Module, max_len: int, cached: Rope | None = None) -> Rope:
    """Tables from the model's own `inv_freq` buffer, with HF's float32 arithmetic.

    Reading the buffer (not recomputing it from rope_theta) keeps us bit-identical to HF even when
    the model was cast with `.to(bf16)`, which also rounds that buffer.
    """
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().float()  # (D/2,)
    if _still_valid(cached, inv_freq, max_len):
        return cached
    positions = torch.arange(max_len, device=inv_freq.device).float()  # (T_max,)
    freqs = positions[:, None] * inv_freq[None, :]  # (T_max, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T_max, D)
    scale = getattr(rotary, "attention_scaling", 1.0)
    sin = emb.sin()[:, : inv_freq.numel()] * scale
    return Rope(inv_freq, emb.cos() * scale, torch.cat((-sin, sin), dim=-1))


def _still_valid(cached: Rope | None, inv_freq: torch.Tensor, max_len: int) -> bool:
    return (cached is not None and cached.cos.shape[0] >= max_len
            and cached.inv_freq.device == inv_freq.device and torch.equal(cached.inv_freq, inv_freq))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: (B, T, N, D); cos, sin_signed: (B, T, 1, D)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


# ----------------------------------------------------------------------------- forward


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last axis: normalise in fp32, cast back, then scale.

    weight is (D,) or, for the fused per-head q/k norm, (N, D) broadcast over x: (..., N, D).
    The fp32 + 1-D case uses the single fused kernel.
    """
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def attention_inputs(x: torch.Tensor, w: LayerWeights, dims: Dims, cos, sin_signed):
    """Pre-norm, fused q|k|v projection, per-head q/k norm, RoPE.

    x: (B, T, C) -> q (B, T, H, D), k (B, T, H_kv, D), v (B, T, H_kv, D).
    """
    B, T, _ = x.shape
    D, n_qk = dims.head_dim, dims.heads + dims.kv_heads
    qkv = F.linear(rms_norm(x, w.input_norm, dims.eps), w.qkv, w.qkv_bias)  # (B, T, (H + 2 H_kv) D)
    qk = qkv[..., : n_qk * D].view(B, T, n_qk, D)  # (B, T, H + H_kv, D)
    v = qkv[..., n_qk * D:].view(B, T, dims.kv_heads, D)  # (B, T, H_kv, D)
    if w.qk_norm is not None:
        qk = rms_norm(qk, w.qk_norm, dims.eps)
    qk = apply_rope(qk, cos, sin_signed)  # (B, T, H + H_kv, D)
    return qk[:, :, : dims.heads], qk[:, :, dims.heads:], v


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, w: LayerWeights, dims: Dims):
    """Output projection + residual, then the SiLU-gated MLP + residual. x: (B, T, C); attn: (B, T, H D)."""
    x = x + F.linear(attn, w.o, w.o_bias)
    gate, up = F.linear(rms_norm(x, w.post_norm, dims.eps), w.gate_up, w.gate_up_bias).chunk(2, -1)
    return x + F.linear(F.silu(gate) * up, w.down, w.down_bias)  # (B, T, C)


class Blocks(NamedTuple):
    """The two cache-free halves of a layer; eager functions or their torch.compile'd versions.

    The cache write and attention stay outside so a compiled graph never mutates the big cache.
    """

    inputs: Callable = attention_inputs
    output_and_mlp: Callable = attention_output_and_mlp


EAGER = Blocks()


@functools.cache
def compiled_blocks() -> Blocks:
    """torch.compile'd halves (dynamic shapes: the batch shrinks and T differs in prefill)."""
    return Blocks(torch.compile(attention_inputs, dynamic=True),
                  torch.compile(attention_output_and_mlp, dynamic=True))


def _attend(q, k_cache, v_cache, mask, dims: Dims) -> torch.Tensor:
    """q: (B, T, H, D); caches: (B, H_kv, S, D); mask: (B, 1, T, S) bool or None -> (B, T, H D)."""
    B, T, H, D = q.shape
    if T == 1:
        # One query per row: fold the GQA group into the query axis, (B, H_kv, G, D), so every
        # query head reads its shared K/V head without repeating the cache.
        q = q.reshape(B, dims.kv_heads, dims.groups, D)
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)  # (B, H_kv, G, D)
        return out.reshape(B, 1, H * D)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache, v_cache, attn_mask=mask, is_causal=mask is None,
        enable_gqa=dims.groups > 1,
    )  # (B, H, T, D)
    return out.transpose(1, 2).reshape(B, T, H * D)


def decoder_layer(x, w: LayerWeights, dims: Dims, blocks: Blocks, rope_rows, kv, slot: int, mask):
    """One pre-norm block. x: (B, T, C); kv: (2, B, H_kv, T_max, D) this layer's cache."""
    T = x.shape[1]
    q, k, v = blocks.inputs(x, w, dims, *rope_rows)
    kv[KEY, :, :, slot: slot + T] = k.transpose(1, 2)  # (B, H_kv, T, D)
    kv[VALUE, :, :, slot: slot + T] = v.transpose(1, 2)
    end = slot + T
    attn = _attend(q, kv[KEY, :, :, :end], kv[VALUE, :, :, :end], mask, dims)  # (B, T, H D)
    return blocks.output_and_mlp(x, attn, w, dims)  # (B, T, C)


def forward(weights: Weights, dims: Dims, blocks: Blocks, rope: Rope, ids, positions, kv, slot: int, mask):
    """Run the decoder on new tokens written at cache slots [slot, slot + T).

    ids, positions: (B, T); kv: (L, 2, B, H_kv, T_max, D); mask: (B, 1, T, slot + T) bool or
    None. Returns logits of the LAST position, in the model dtype: (B, V).
    """
    x = F.embedding(ids, weights.embed)  # (B, T, C)
    dtype = x.dtype
    rope_rows = (rope.cos[positions].unsqueeze(2).to(dtype),  # (B, T, 1, D)
                 rope.sin_signed[positions].unsqueeze(2).to(dtype))
    for layer, w in enumerate(weights.layers):
        x = decoder_layer(x, w, dims, blocks, rope_rows, kv[layer], slot, mask)
    last = rms_norm(x[:, -1], weights.final_norm, dims.eps)  # (B, C)
    return F.linear(last, weights.lm_head)  # (B, V)


# ----------------------------------------------------------------------------- per-call state


class LeanBackend:
    """The lean decoder's state for one `generate` call: weights, KV cache, key mask."""

    def __init__(self, model: nn.Module, dims: Dims, rope: Rope, batch: int, max_len: int,
                 blocks: Blocks = EAGER):
        self.weights = read_weights(model, dims)
        self.dims, self.rope, self.blocks = dims, rope, blocks
        dtype, device = self.weights.embed.dtype, self.weights.embed.device
        self.kv = torch.empty(  # (L, 2, B, H_kv, T_max, D)
            dims.layers, 2, batch, dims.kv_heads, max_len, dims.head_dim, dtype=dtype, device=device
        )
        self.key_ok = torch.ones(batch, 1, 1, max_len, dtype=torch.bool, device=device)  # (B, 1, 1, T_max)
        self.padded = False
        self.n = batch
        self.slot = 0

    def prefill(self, ids, positions, valid) -> torch.Tensor:
        """ids, positions, valid: (B, P), left-padded -> last-position logits (B, V)."""
        assert ids.shape == positions.shape == valid.shape and ids.shape[0] == self.n, ids.shape
        P = ids.shape[1]
        self.padded = not bool(valid.all())
        mask = None
        if self.padded:
            self.key_ok[:, 0, 0, :P] = valid
            causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()  # (P, P)
            diag = torch.eye(P, dtype=torch.bool, device=ids.device)
            # Pad queries see only themselves, so no softmax row is empty (their output is unused).
            mask = (causal & self.key_ok[:, :, :, :P]) | diag  # (B, 1, P, P)
        logits = forward(self.weights, self.dims, self.blocks, self.rope, ids, positions, self.kv, 0, mask)
        self.slot = P
        return logits

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: (n,) -> logits (n, V); appends one slot to the cache."""
        n, end = self.n, self.slot + 1
        mask = self.key_ok[:n, :, :, :end] if self.padded else None  # (n, 1, 1, S)
        live_kv = self.kv[:, :, :n]  # (L, 2, n, H_kv, T_max, D)
        logits = forward(self.weights, self.dims, self.blocks, self.rope, tokens[:, None],
                         positions[:, None], live_kv, self.slot, mask)
        self.slot = end
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the live rows), moving them to the front in order."""
        used = self.slot
        n = rows.numel()
        self.kv[:, :, :n, :, :used] = self.kv[:, :, rows, :, :used]
        if self.padded:
            self.key_ok[:n] = self.key_ok[rows]
        self.n = n
