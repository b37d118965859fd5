"""Lean decoder: our own forward for Qwen3 / Qwen2 / Llama over the live model's weights.

Why: at rollout sizes the per-step cost of the Hugging Face module stack (mask builders, cache
objects, decorators, ~10 Python calls per op) dominates the arithmetic. This file runs the same
math with a handful of fused torch ops per layer and a pre-allocated KV cache.

What it supports (anything else falls back to the HF path in `hf_backend.py`):
  RMSNorm pre-norm decoder layers, default RoPE (`config.rope_parameters["rope_theta"]`, no
  scaling), GQA, SiLU-gated MLP, optional q/k/v/o/MLP biases (Qwen2, Llama `attention_bias`),
  optional per-head q/k RMSNorm (Qwen3), tied or untied lm_head, full attention only, and
  projections whose module type has a registered linear kind (`register_linear`): plain
  `torch.nn.Linear` here; `lowbit.py` registers `LowBitLinear` (real low-bit weights) and training's
  `models.quant.FakeQuantLinear` (the same low-bit op, from integers taken from its live weights).
  Any other Linear subclass (LoRA) must run its own forward.

Weights are read by reference from the model at the start of each `generate` call; the fused
q|k|v and gate|up matrices built from them live only for that call, so weight updates between
rollouts are always seen.

KV cache layout: one buffer `(L, 2, B, H_kv, T_max, D)`; rows [0, n) of the batch axis are the
live rows, so dropping finished rows is an in-place gather of the used prefix (no reallocation).

Three of the engine's seams (see `engine.py`) live here, each a named place a later fast path plugs
into without touching the layer math:
  linear op     every projection (fused q|k|v, o, fused gate|up, down, lm_head) is a `Projection`:
                weights read from the model plus the `LinearOp` that applies them, both looked up
                from the module's type in the linear registry (`register_linear`, `LinearKind`).
                `read_weights` takes the op of the float projections (default `FULL_PRECISION` =
                F.linear). Modules of one kind and key (e.g. low-bit weights of one scheme) are
                fused for q|k|v and gate|up; otherwise each runs alone (see `_projection`).
  routing       `run_layers` runs each layer through a `Route` (attach / begin / call); the base
                `Route` runs every row through the whole layer (`dense`). A model that needs
                another route gets it from the route registry (`register_route`, `RouteKind`):
                `skip_routing.py` registers the layer skipper's.
  cache         `KVCache` owns the K/V buffer and the key mask; the forward writes through
                `KVCache.write(layer, start, k, v)` and reads through `KVCache.read`, so K/V known
                from elsewhere (e.g. a shared prefix) can be written into slots before a prefill
                that runs only the new tokens; `sparse_prefill` runs tokens at arbitrary slots
                over such K/V (the artifact cache, suffix reuse).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Optional

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
    registered()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and type(module) not in LINEAR_KINDS:
            return f"{name} is a {type(module).__name__}, not a plain torch.nn.Linear"
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{name or 'model'} has forward hooks the lean path would skip"
    if not hasattr(getattr(model.model, "rotary_emb", None), "inv_freq"):
        return "no model.rotary_emb.inv_freq buffer to build RoPE tables from"
    if type(model.model.embed_tokens) is not nn.Embedding:
        return f"{type(model.model.embed_tokens).__name__} where a plain Embedding was expected"
    expected = [model.lm_head]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        expected += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        expected += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    for module in expected:
        if type(module) not in LINEAR_KINDS:
            return f"{type(module).__name__} where a plain Linear or a low-bit linear was expected"
    for kind in ROUTE_KINDS:
        reason = kind.unsupported(model)
        if reason is not None:
            return reason
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


# Seam 2, the linear op: (x (..., in), weight, bias (out,) | None) -> (..., out). The weight is
# what the op reads: a float (out, in) tensor for F.linear, `LowBitWeights` for `lowbit_linear`.
LinearOp = Callable[[torch.Tensor, Any, Optional[torch.Tensor]], torch.Tensor]
FULL_PRECISION: LinearOp = F.linear


@dataclass
class Projection:
    """One linear map of the decoder: the weights read from the model and the op that applies them.

    Every projection of the lean forward is called through here, so the op is the one place a
    weight format changes how a projection runs: float weights with F.linear, `LowBitWeights` with
    `lowbit_linear`, or a list of part projections whose outputs are concatenated (`_concat`).
    """

    weight: Any  # (out, in) float tensor | LowBitWeights | list[Projection]
    bias: torch.Tensor | None
    op: LinearOp = FULL_PRECISION

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (C,)
    qkv: Projection  # ((H + 2 H_kv) D, C) fused q|k|v projection
    qk_norm: torch.Tensor | None  # (H + H_kv, D) per-head q_norm rows then k_norm rows (Qwen3)
    o: Projection  # (C, H D)
    post_norm: torch.Tensor  # (C,)
    gate_up: Projection  # (2 I, C) fused gate|up projection
    down: Projection  # (C, I)
    extra: Any = None  # what a route's `attach` adds for this layer (a skip route: its SkipWeights)


@dataclass
class Weights:
    embed: torch.Tensor  # (V, C)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (C,)
    lm_head: Projection  # (V, C)


@dataclass(frozen=True)
class LinearKind:
    """How the lean forward runs projections of one module type (seam 2).

    operand(module): what the op reads in the weight slot (a float (out, in) tensor, LowBitWeights, ...);
    op: the LinearOp that applies it (None: the float op `read_weights` is given, F.linear by default);
    fuse(operands): one operand for modules concatenated along the output axis (q|k|v, gate|up);
    key(module): modules fuse only when their keys are equal (e.g. ("lowbit", scheme)), across kinds too.
    """

    operand: Callable[[nn.Module], Any]
    op: Optional[LinearOp] = None
    fuse: Callable[[list], Any] = torch.cat
    key: Callable[[nn.Module], Any] = lambda module: "float"


# The modules that fill the linear and route registries (seams 2 and 3) when imported. They are imported the
# first time a registry is read, so neither the engine nor any caller imports a fast path to have it run: a new
# weight format or route is one module that calls `register_linear` / `register_route`, plus its name here.
FAST_PATHS = ("inference.lowbit", "inference.skip_routing")
_fast_paths_loaded = False


def registered() -> None:
    """Import the FAST_PATHS modules once, so both registries are complete before they are read."""
    global _fast_paths_loaded
    if not _fast_paths_loaded:
        for name in FAST_PATHS:
            importlib.import_module(name)
        _fast_paths_loaded = True


# The linear registry: module type (exact, not subclasses) -> its kind. Filled by the FAST_PATHS modules
# (`lowbit.py`), never changed afterwards.
LINEAR_KINDS: dict[type, LinearKind] = {nn.Linear: LinearKind(operand=lambda module: module.weight.detach())}


def register_linear(module_type: type, kind: LinearKind) -> None:
    """Run projections of `module_type` with `kind` (one registration per fast path's module)."""
    LINEAR_KINDS[module_type] = kind


def _cat_bias(*linears: nn.Module) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears if lin.bias is not None]
    if not biases:
        return None
    return torch.cat([lin.bias if lin.bias is not None else biases[0].new_zeros(lin.out_features)
                      for lin in linears])


def _concat(x: torch.Tensor, parts: list[Projection], bias: torch.Tensor | None) -> torch.Tensor:
    """The LinearOp of a projection whose parts cannot be fused: each part's output, concatenated."""
    return torch.cat([part(x) for part in parts], dim=-1)


def _projection(linear: LinearOp, *modules: nn.Module) -> Projection:
    """The projection of `modules` fused along the output axis (one module: its own weights).

    Each module's kind comes from the linear registry. Modules whose keys are equal (plain floats;
    low-bit weights of one scheme) are fused: their operands concatenated by the kind's `fuse`, run
    by its op (`linear` for a kind without its own op). Otherwise each module is its own projection
    and the outputs are concatenated.
    """
    registered()
    kinds = [LINEAR_KINDS[type(m)] for m in modules]
    if len({kind.key(m) for kind, m in zip(kinds, modules)}) > 1:
        return Projection([_projection(linear, m) for m in modules], None, _concat)
    kind = kinds[0]
    operands = [k.operand(m) for k, m in zip(kinds, modules)]
    operand = operands[0] if len(operands) == 1 else kind.fuse(operands)
    return Projection(operand, _detach(_cat_bias(*modules)), kind.op or linear)


def _layer_weights(layer: nn.Module, dims: Dims, linear: LinearOp) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qk_norm = None
    if dims.qk_norm:
        q_rows = attn.q_norm.weight.detach().expand(dims.heads, dims.head_dim)
        k_rows = attn.k_norm.weight.detach().expand(dims.kv_heads, dims.head_dim)
        qk_norm = torch.cat([q_rows, k_rows])  # (H + H_kv, D)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_projection(linear, attn.q_proj, attn.k_proj, attn.v_proj),
        qk_norm=qk_norm,
        o=_projection(linear, attn.o_proj),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_projection(linear, mlp.gate_proj, mlp.up_proj),
        down=_projection(linear, mlp.down_proj),
    )


def _detach(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def read_weights(model: nn.Module, dims: Dims, linear: LinearOp = FULL_PRECISION) -> Weights:
    """Reference the live weights (fusing q|k|v and gate|up for this call only); every float
    projection, lm_head included, applies them with `linear`; other kinds with their registered op.
    (A route's `attach` may add to them: a skip route fills `LayerWeights.extra` of its routed layers.)"""
    return Weights(
        embed=model.model.embed_tokens.weight.detach(),
        layers=[_layer_weights(layer, dims, linear) for layer in model.model.layers],
        final_norm=model.model.norm.weight.detach(),
        lm_head=_projection(linear, model.lm_head),
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
    return project_qkv(rms_norm(x, w.input_norm, dims.eps), w, dims, cos, sin_signed)


def project_qkv(h: torch.Tensor, w: LayerWeights, dims: Dims, cos, sin_signed):
    """`attention_inputs` from the already normed input h: (B, T, C)."""
    B, T, _ = h.shape
    D, n_qk = dims.head_dim, dims.heads + dims.kv_heads
    qkv = w.qkv(h)  # (B, T, (H + 2 H_kv) D)
    qk = qkv[..., : n_qk * D].view(B, T, n_qk, D)  # (B, T, H + H_kv, D)
    v = qkv[..., n_qk * D:].view(B, T, dims.kv_heads, D)  # (B, T, H_kv, D)
    if w.qk_norm is not None:
        qk = rms_norm(qk, w.qk_norm, dims.eps)
    qk = apply_rope(qk, cos, sin_signed)  # (B, T, H + H_kv, D)
    return qk[:, :, : dims.heads], qk[:, :, dims.heads:], v


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, w: LayerWeights, dims: Dims):
    """Output projection + residual, then the SiLU-gated MLP + residual. x: (B, T, C); attn: (B, T, H D)."""
    x = x + w.o(attn)
    return x + mlp_block(x, w, dims)  # (B, T, C)


def mlp_block(x: torch.Tensor, w: LayerWeights, dims: Dims) -> torch.Tensor:
    """The SiLU-gated MLP of the post-attention norm of x (no residual): (B, T, C) -> (B, T, C)."""
    gate, up = w.gate_up(rms_norm(x, w.post_norm, dims.eps)).chunk(2, -1)  # (B, T, I) each
    return w.down(F.silu(gate) * up)


class Blocks(NamedTuple):
    """The two cache-free halves of a layer; eager functions or their torch.compile'd versions.

    The cache write and attention stay outside so a compiled graph never mutates the big cache.
    """

    inputs: Callable = attention_inputs
    output_and_mlp: Callable = attention_output_and_mlp


EAGER = Blocks()


def compiled_blocks() -> Blocks:
    """torch.compile'd halves (dynamic shapes: the batch shrinks and T differs in prefill). An engine
    builds them once and keeps them (torch's own compile cache serves a second engine's)."""
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


# ----------------------------------------------------------------------------- cache contents


class KVCache:
    """Seam 4, the cache contents: every layer's K/V in one pre-allocated buffer, plus a key mask.

    kv: (L, 2, B, H_kv, T_max, D); key_ok: (B, 1, 1, T_max) bool, False where a slot holds no key a
    query may see (left pads, rejected drafts). Rows [0, n) of the batch axis are the live rows.
    The forward only goes through `write` and `read`, so whatever fills slots [0, s) before a
    forward that starts at slot s (a prefix's K/V computed by someone else, say) is attended to
    exactly as if that forward had written it. (Such a forward over T > 1 tokens needs an explicit
    mask: with mask None, SDPA's is_causal aligns the query block to key 0, right only at slot 0.)
    """

    def __init__(self, dims: Dims, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.kv = torch.empty(  # (L, 2, B, H_kv, T_max, D)
            dims.layers, 2, batch, dims.kv_heads, max_len, dims.head_dim, dtype=dtype, device=device
        )
        self.key_ok = torch.ones(batch, 1, 1, max_len, dtype=torch.bool, device=device)  # (B, 1, 1, T_max)
        self.n = batch

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (n, T, H_kv, D) of the live rows -> slots [start, start + T) of `layer`."""
        end = start + k.shape[1]
        kv = self.kv[layer]  # (2, B, H_kv, T_max, D)
        kv[KEY, : self.n, :, start:end] = k.transpose(1, 2)  # (n, H_kv, T, D)
        kv[VALUE, : self.n, :, start:end] = v.transpose(1, 2)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, end) of `layer`, live rows: (n, H_kv, end, D) each."""
        kv = self.kv[layer]
        return kv[KEY, : self.n, :, :end], kv[VALUE, : self.n, :, :end]

    def write_rows(self, layer: int, start: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (len(rows), T, H_kv, D) of the live rows `rows` -> their slots [start, start + T)."""
        end = start + k.shape[1]
        kv = self.kv[layer]
        # advanced indexing does not cast as a slice assignment does (under autocast k, v come in the
        # compute dtype, the cache holds the weights')
        kv[KEY, rows, :, start:end] = k.transpose(1, 2).to(kv.dtype)
        kv[VALUE, rows, :, start:end] = v.transpose(1, 2).to(kv.dtype)

    def read_rows(self, layer: int, end: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` of the live rows `rows` only (a gathered copy): (len(rows), H_kv, end, D) each."""
        kv = self.kv[layer]
        return kv[KEY, :, :, :end].index_select(0, rows), kv[VALUE, :, :, :end].index_select(0, rows)

    def keep(self, rows: torch.Tensor, used: int, mask: bool = True) -> None:
        """Keep only `rows` (indices into the live rows), moved to the front in order; only slots
        [0, used) are copied. mask=False skips the key mask (all True when nothing is padded)."""
        n = rows.numel()
        self.kv[:, :, :n, :, :used] = self.kv[:, :, rows, :, :used]
        if mask:
            self.key_ok[:n] = self.key_ok[rows]
        self.n = n

    def gather_slots(self, order: torch.Tensor, used: int) -> None:
        """Rearrange slots: new slot j of live row r is old slot order[r, j] (order: (n, S') indices
        into [0, used)), key mask included; slots from S' on are left stale."""
        n, kept = order.shape
        L, two, _, H, _, D = self.kv.shape
        index = order[None, None, :, None, :, None].expand(L, two, n, H, kept, D)
        self.kv[:, :, :n, :, :kept] = self.kv[:, :, :n, :, :used].gather(4, index)
        self.key_ok[:n, 0, 0, :kept] = self.key_ok[:n, 0, 0, :used].gather(1, order)


# ----------------------------------------------------------------------------- per-layer routing


def decoder_layer(x, w: LayerWeights, dims: Dims, blocks: Blocks, rope_rows, cache: KVCache, layer: int,
                  slot: int, mask, *, h: torch.Tensor | None = None, mlp_scale: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None):
    """One pre-norm block on new tokens written at slots [slot, slot + T). x: (n, T, C) -> (n, T, C).

    A route may pass `h` (x already normed), `mlp_scale` (n, T) multiplying the MLP's output per token,
    and `rows` (indices of the cache's live rows that x holds: K/V written and read for those only)."""
    if h is None and mlp_scale is None and rows is None:  # the plain layer: the two (compilable) halves
        q, k, v = blocks.inputs(x, w, dims, *rope_rows)  # (n, T, H, D), (n, T, H_kv, D), (n, T, H_kv, D)
    else:
        q, k, v = project_qkv(rms_norm(x, w.input_norm, dims.eps) if h is None else h, w, dims, *rope_rows)
    end = slot + x.shape[1]
    if rows is None:
        cache.write(layer, slot, k, v)
        keys, values = cache.read(layer, end)  # (n, H_kv, S, D) each
    else:
        cache.write_rows(layer, slot, rows, k, v)
        keys, values = cache.read_rows(layer, end, rows)
    attn = _attend(q, keys, values, mask, dims)  # (n, T, H D)
    if mlp_scale is None:
        return blocks.output_and_mlp(x, attn, w, dims)  # (n, T, C)
    after = x + w.o(attn)
    return after + mlp_scale.to(x.dtype)[..., None] * mlp_block(after, w, dims)


class Route:
    """Seam 3, per-layer routing: how each layer runs, asked by `run_layers` for every layer.

    This base runs every row through the whole layer (`dense`). A fast path's route overrides
    `__call__` and, where it needs them, `attach` (the weights just read for a call: add what the
    route's layers need) and `begin` (before a multi-token forward: which tokens are real)."""

    def attach(self, model: nn.Module, weights: "Weights", dims: Dims) -> None:
        pass

    def begin(self, valid: torch.Tensor) -> None:
        pass

    def __call__(self, layer: int, x, w: LayerWeights, dims: Dims, blocks: Blocks, rope_rows, cache: KVCache,
                 slot: int, mask) -> torch.Tensor:
        return decoder_layer(x, w, dims, blocks, rope_rows, cache, layer, slot, mask)


dense = Route()


# How a route runs its routed rows, chosen per engine (`EngineConfig.skip_mode`): auto (a cost gate that
# measures both once per shape), routed (only the rows that run a layer go through it), masked (every row
# runs and the skipped ones are masked out).
ROUTE_MODES = ("auto", "routed", "masked")


@dataclass
class RouteContext:
    """What one engine keeps for the routes it builds, over its calls: the mode it was asked for
    (ROUTE_MODES), each kind's counts (`stats[kind name]`, e.g. a skip route's SkipStats; pass a dict to
    share them, as a Server does) and each kind's measured timings (`timings[kind name]`)."""

    mode: str = "auto"
    stats: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RouteKind:
    """A route some models need (seam 3): `route(model, context)` builds it for a model that needs it (None
    otherwise), counting into `context.stats[name]`; `unsupported(model)` says why the lean path cannot
    run such a model (None: it can)."""

    name: str
    route: Callable[[nn.Module, RouteContext], Optional[Route]]
    unsupported: Callable[[nn.Module], Optional[str]] = lambda model: None


# The route registry, filled by the FAST_PATHS modules (`skip_routing.py`), never changed afterwards.
ROUTE_KINDS: list[RouteKind] = []


def register_route(kind: RouteKind) -> None:
    ROUTE_KINDS.append(kind)


def model_route(model: nn.Module, context: RouteContext | None = None) -> Route:
    """The route `model` needs: the first registered kind that builds one (with `context`: the engine's
    mode, counts and timings; None: a fresh one), else `dense`."""
    registered()
    context = RouteContext() if context is None else context
    for kind in ROUTE_KINDS:
        route = kind.route(model, context)
        if route is not None:
            return route
    return dense


def routed(model: nn.Module) -> bool:
    """Whether some registered route kind claims `model` (its layers do not all run densely): what a cache
    that assumes dense layers (suffix reuse, the position-independent cache) asks instead of naming a kind."""
    return model_route(model) is not dense


def run_layers(x, layers: Iterable[int], weights: Weights, dims: Dims, blocks: Blocks, rope_rows,
               cache: KVCache, slot: int, mask, route: Route = dense) -> torch.Tensor:
    """Run `layers` (in order) on hidden states x: (n, T, C) at slots [slot, slot + T) -> (n, T, C),
    each through `route` (seam 3)."""
    for layer in layers:
        x = route(layer, x, weights.layers[layer], dims, blocks, rope_rows, cache, slot, mask)
    return x


def rope_at(rope: Rope, positions: torch.Tensor, dtype: torch.dtype):
    """RoPE tables gathered at positions (n, T): cos, sin_signed, each (n, T, 1, D) in `dtype`."""
    return (rope.cos[positions].unsqueeze(2).to(dtype), rope.sin_signed[positions].unsqueeze(2).to(dtype))


def forward(weights: Weights, dims: Dims, blocks: Blocks, rope: Rope, ids, positions, cache: KVCache,
            slot: int, mask, route: Route = dense):
    """Run the decoder on new tokens written at cache slots [slot, slot + T).

    ids, positions: (n, T) for the cache's n live rows; mask: (n, 1, T, slot + T) bool or None.
    Returns logits of the LAST position, in the model dtype: (n, V).
    """
    x = F.embedding(ids, weights.embed)  # (n, T, C)
    rows = rope_at(rope, positions, x.dtype)
    x = run_layers(x, range(len(weights.layers)), weights, dims, blocks, rows, cache, slot, mask, route)
    last = rms_norm(x[:, -1], weights.final_norm, dims.eps)  # (n, C)
    return weights.lm_head(last)  # (n, V)


def sparse_prefill(x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, backend: "LeanBackend", layers,
                   base: Weights, query: Weights, rope: Rope, dims: Dims, context_end: int) -> torch.Tensor:
    """Tokens at arbitrary cache slots through `layers`, over K/V that other slots already hold.

    At each layer the tokens' K/V are written into their own slots first; then each token attends
    to every slot at or before its own that the key mask allows: computed K/V where this call
    wrote them, whatever the cache held elsewhere (K/V copied in from a store, relocated ones).
    Tokens at slots >= context_end take the q projection of `query` (an adapter's), the others
    that of `base`; K/V and everything after attention always come from `base`. A slot listed
    twice in a row computes and writes the same thing twice (callers left-fill rows that way).

    x: (B, R, C) hidden states; slots, positions: (B, R), slots ascending per row. -> (B, R, C).
    """
    cache = backend.cache
    B, R = slots.shape
    S = int(slots.max()) + 1
    keys_at = torch.arange(S, device=slots.device)  # (S,)
    causal = keys_at[None, None, :] <= slots[:, :, None]  # (B, R, S)
    own = keys_at[None, None, :] == slots[:, :, None]  # a query always sees itself: no empty softmax row
    mask = ((causal & cache.key_ok[:, 0, :, :S]) | own)[:, None]  # (B, 1, R, S)
    adapted = slots >= context_end  # (B, R)
    batch_rows = torch.arange(B, device=slots.device)[:, None].expand(B, R)  # (B, R)
    cos_sin = rope_at(rope, positions, x.dtype)
    for layer in layers:
        wb, wq = base.layers[layer], query.layers[layer]
        q, k, v = attention_inputs(x, wb, dims, *cos_sin)  # (B, R, H, D), (B, R, H_kv, D) x 2
        if wq is not wb and bool(adapted.any()):
            q_query, _, _ = attention_inputs(x, wq, dims, *cos_sin)
            q = torch.where(adapted[:, :, None, None], q_query, q)
        kv = cache.kv[layer]  # (2, B, H_kv, T_max, D)
        # advanced indexing: (B, R, H_kv, D); unlike a slice assignment it does not cast, and under autocast
        # k and v come out in the compute dtype while the cache holds the weights' dtype
        kv[KEY, batch_rows, :, slots] = k.to(kv.dtype)
        kv[VALUE, batch_rows, :, slots] = v.to(kv.dtype)
        keys, values = cache.read(layer, S)  # (B, H_kv, S, D) each
        x = attention_output_and_mlp(x, _attend(q, keys, values, mask, dims), wb, dims)  # (B, R, C)
    return x


# ----------------------------------------------------------------------------- per-call state


class LeanBackend:
    """The lean decoder's state for one `generate` call: weights, KV cache, key mask.

    linear: the op of every float projection (seam 2; other kinds run their registered op);
    route: per-layer routing (seam 3); None = the one the model needs (`model_route`: its registered
    route, e.g. a layer skipper's, else `dense`). The route is handed the weights read here
    (`Route.attach`) and told which prompt tokens are real before a prefill (`Route.begin`).
    """

    def __init__(self, model: nn.Module, dims: Dims, rope: Rope, batch: int, max_len: int,
                 blocks: Blocks = EAGER, linear: LinearOp = FULL_PRECISION, route: Route | None = None):
        self.weights = read_weights(model, dims, linear)
        route = model_route(model) if route is None else route
        route.attach(model, self.weights, dims)
        self.dims, self.rope, self.blocks, self.route = dims, rope, blocks, route
        self.cache = KVCache(dims, batch, max_len, self.weights.embed.dtype, self.weights.embed.device)
        self.padded = False
        self.slot = 0

    @property
    def kv(self) -> torch.Tensor:
        return self.cache.kv  # (L, 2, B, H_kv, T_max, D)

    @property
    def key_ok(self) -> torch.Tensor:
        return self.cache.key_ok  # (B, 1, 1, T_max)

    @property
    def n(self) -> int:
        return self.cache.n

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
        self.route.begin(valid)
        logits = forward(self.weights, self.dims, self.blocks, self.rope, ids, positions, self.cache, 0, mask,
                         self.route)
        self.slot = P
        return logits

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: (n,) -> logits (n, V); appends one slot to the cache."""
        end = self.slot + 1
        mask = self.key_ok[: self.n, :, :, :end] if self.padded else None  # (n, 1, 1, S)
        logits = forward(self.weights, self.dims, self.blocks, self.rope, tokens[:, None],
                         positions[:, None], self.cache, self.slot, mask, self.route)
        self.slot = end
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the live rows), moving them to the front in order."""
        self.cache.keep(rows, self.slot, mask=self.padded)

    def run(self, x: torch.Tensor, positions: torch.Tensor, layers: Iterable[int], start: int, mask,
            route: Route | None = None) -> torch.Tensor:
        """Run `layers` on hidden states x (n, T, C) at positions (n, T), written at slots
        [start, start + T), under `mask` (n, 1, T, start + T) -> hidden (n, T, C). `route`: this
        call's routing (None: the backend's own)."""
        rows = rope_at(self.rope, positions, x.dtype)
        return run_layers(x, layers, self.weights, self.dims, self.blocks, rows, self.cache, start, mask,
                          self.route if route is None else route)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (n, T) -> (n, T, C)."""
        return F.embedding(ids, self.weights.embed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: hidden (..., C) -> logits (..., V) in the model dtype."""
        return self.weights.lm_head(rms_norm(hidden, self.weights.final_norm, self.dims.eps))
