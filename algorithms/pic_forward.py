"""The position-independent artifact cache on the training side: HF forwards over a frozen base, K/V
encoded per artifact, relocated and assembled per row, and a forward of only the new tokens against
it. Shared by Attuner's loss and by anything that measures the cache (benchmarks, eval).

    rows = [segment_ids(tok, task.segments(ex)) for ex in examples]   # token ids per segment
    ctx = encode_context(model, rows)                  # no grad, adapter off: (L, B, H_kv, C, D) K/V
    hidden = student_hidden(model, ctx, new_ids, new_mask)   # (B, Q, H): new tokens over the cache

What the cache holds. The shared prefix (positions 0..P-1) is encoded once. Each artifact is encoded
on its own right after its prefix (positions P..P+T-1, attending to the prefix and itself) and
cached; identical (prefix, artifact) pairs in a batch are encoded once, and the artifacts after one
prefix are encoded together, `batch_size` at a time, right-padded. At use, an artifact placed at
context position s has its keys rotated from P.. to s.. (`inference.relocate.relocate_keys`, the
RoPE delta rotation; values unchanged), and a row's context is prefix + its artifacts in order.
Encoding always runs the frozen base (`models.query_adapter.adapter_disabled`) under no_grad, so the
cache never depends on an adapter.

Batched layout (`ContextKV`): each row's context is right-aligned in C = the batch's longest context
(left pads, masked); the new tokens follow, right-padded to Q, at positions continuing after the
row's own context (`lengths[b] + j`). The attention mask handed to the model is 2D over C + Q slots;
the cache is read-only (`context_cache`: a layer's update returns context + new K/V without storing
them), so a forward that runs a layer twice (activation recompute) sees the same keys.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import Tensor, nn

from inference.relocate import PICError, RopeLayout, relocate_keys, rope_layout
from models.anatomy import causal_lm, final_hidden
from models.prompts import continuation_ids, prompt_ids
from models.query_adapter import adapter_disabled
from tasks.base import Segments

if TYPE_CHECKING:  # transformers loads on first use: configuration never imports it
    from transformers import DynamicCache

PREFIX, QUERY = 0, -1  # segment labels: 0 the shared prefix, k >= 1 artifact k, -1 after the artifacts


@dataclass(frozen=True)
class SegmentIds:
    """A prompt's token ids per segment (each segment tokenized on its own)."""

    prefix: tuple[int, ...]
    artifacts: tuple[tuple[int, ...], ...]
    query: tuple[int, ...]

    def context(self) -> list[int]:
        return list(self.prefix) + [t for a in self.artifacts for t in a]

    def prompt(self) -> list[int]:
        return self.context() + list(self.query)

    def starts(self) -> list[int]:
        """The context position of each artifact's first token."""
        out, pos = [], len(self.prefix)
        for a in self.artifacts:
            out.append(pos)
            pos += len(a)
        return out

    def labels(self) -> list[int]:
        """One segment label per prompt token: PREFIX, k >= 1 for artifact k, QUERY."""
        return ([PREFIX] * len(self.prefix) + [k + 1 for k, a in enumerate(self.artifacts) for _ in a]
                + [QUERY] * len(self.query))


def segment_ids(tokenizer: Any, segments: Segments) -> SegmentIds:
    """Each segment tokenized on its own (`add_special_tokens=False`); empty artifacts are dropped. The
    prefix is encoded as a prompt's start (`models.prompts.prompt_ids`: one leading BOS where the
    tokenizer adds one), so the full prompt starts like any other prompt of the run."""
    enc = lambda text: tuple(continuation_ids(tokenizer, text)) if text else ()  # noqa: E731
    return SegmentIds(tuple(prompt_ids(tokenizer, segments.prefix)), tuple(a for a in map(enc, segments.artifacts) if a),
                      enc(segments.query))


def split_rows(input_ids: Tensor, labels: Tensor, attention_mask: Tensor) -> tuple[list[SegmentIds], list[list[int]]]:
    """Right-padded rows whose tokens carry segment labels -> (each row's context as SegmentIds with an
    empty query, each row's new tokens: everything after its artifacts that is not padding)."""
    rows, news = [], []
    for ids, lab, valid in zip(input_ids.tolist(), labels.tolist(), attention_mask.tolist()):
        n = sum(valid)
        ids, lab = ids[:n], lab[:n]
        prefix = tuple(t for t, s in zip(ids, lab) if s == PREFIX)
        k_max = max([s for s in lab if s > 0], default=0)
        artifacts = tuple(tuple(t for t, s in zip(ids, lab) if s == k) for k in range(1, k_max + 1))
        context = len(prefix) + sum(len(a) for a in artifacts)
        if any(s != QUERY for s in lab[context:]):
            raise ValueError("segment labels out of order: prefix, then artifacts 1..k, then the query")
        rows.append(SegmentIds(prefix, artifacts, ()))
        news.append(ids[context:])
    return rows, news


@dataclass
class ContextKV:
    """Each row's assembled context K/V, right-aligned in the batch's longest context C."""

    keys: Tensor  # (L, B, H_kv, C, D), left pads zero
    values: Tensor  # (L, B, H_kv, C, D)
    lengths: Tensor  # (B,) long: real context tokens per row

    @property
    def width(self) -> int:
        return self.keys.shape[-2]

    def mask(self) -> Tensor:
        """(B, C) long: 1 on each row's real context slots (the last lengths[b])."""
        slots = torch.arange(self.width, device=self.lengths.device)
        return (slots[None, :] >= self.width - self.lengths[:, None]).long()

    def row(self, b: int) -> tuple[Tensor, Tensor]:
        """Row b's context without padding: keys, values (L, H_kv, lengths[b], D)."""
        n = int(self.lengths[b])
        return self.keys[:, b, :, self.width - n:], self.values[:, b, :, self.width - n:]


def check_cacheable(model: nn.Module) -> RopeLayout:
    """The model's RoPE layout; PICError when its attention is not full causal attention everywhere
    (a sliding window would drop context slots the cache holds)."""
    config = causal_lm(model).config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or (getattr(config, "use_sliding_window", False)
                                       and getattr(config, "sliding_window", None)):
        raise PICError(f"{type(causal_lm(model)).__name__}: layer types {sorted(kinds)} -- the position-independent "
                       "cache needs full attention in every layer")
    return rope_layout(causal_lm(model))


def _kv(cache: "DynamicCache") -> tuple[Tensor, Tensor]:
    """(L, B, H_kv, T, D) keys and values of a filled cache."""
    return torch.stack([layer.keys for layer in cache.layers]), torch.stack([layer.values for layer in cache.layers])


def _forward_kv(lm: nn.Module, ids: Tensor, mask: Tensor, positions: Tensor,
                past: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """K/V (L, n, H_kv, P + T, D) after a forward of `ids` over `past` (L, n, H_kv, P, D) or nothing."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    if past is not None:
        for i in range(past[0].shape[0]):
            cache.update(past[0][i], past[1][i], i)
    lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return _kv(cache)


@torch.no_grad()
def encode_artifacts(model: nn.Module, rows: Sequence[SegmentIds], batch_size: int = 32
                     ) -> tuple[dict, dict]:
    """The frozen base's K/V of every distinct prefix and (prefix, artifact) pair in `rows`, each at
    its encoded positions: ({prefix: (k, v) (L, H_kv, P, D)}, {(prefix, artifact): (k, v) (L, H_kv, T,
    D) at positions P..P+T-1})."""
    lm = causal_lm(model)
    device = next(lm.parameters()).device
    prefixes: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}
    pieces: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Tensor, Tensor]] = {}
    with adapter_disabled(model):
        for prefix in dict.fromkeys(r.prefix for r in rows):
            if prefix:
                ids = torch.tensor([prefix], device=device)
                k, v = _forward_kv(lm, ids, torch.ones_like(ids), torch.arange(len(prefix), device=device)[None], None)
                prefixes[prefix] = k[:, 0], v[:, 0]
            todo = sorted(dict.fromkeys(a for r in rows if r.prefix == prefix for a in r.artifacts), key=len)
            P = len(prefix)
            for start in range(0, len(todo), batch_size):
                part = todo[start: start + batch_size]
                width = max(map(len, part))
                ids = torch.zeros(len(part), width, dtype=torch.long)
                mask = torch.zeros(len(part), P + width, dtype=torch.long)
                mask[:, :P] = 1
                for i, a in enumerate(part):
                    ids[i, : len(a)] = torch.tensor(a)
                    mask[i, P: P + len(a)] = 1
                positions = (P + torch.arange(width, device=device))[None].expand(len(part), -1)
                past = None
                if P:
                    pk, pv = prefixes[prefix]
                    past = pk[:, None].expand(-1, len(part), -1, -1, -1), pv[:, None].expand(-1, len(part), -1, -1, -1)
                k, v = _forward_kv(lm, ids.to(device), mask.to(device), positions, past)
                for i, a in enumerate(part):
                    pieces[(prefix, a)] = k[:, i, :, P: P + len(a)], v[:, i, :, P: P + len(a)]
    return prefixes, pieces


@torch.no_grad()
def encode_context(model: nn.Module, rows: Sequence[SegmentIds], batch_size: int = 32) -> ContextKV:
    """Each row's context K/V from independently encoded artifacts, relocated to their places in the
    row (`relocate_keys`) and right-aligned in the batch's longest context. Frozen base, no grad."""
    rope = check_cacheable(model)
    prefixes, pieces = encode_artifacts(model, rows, batch_size)
    lm = causal_lm(model)
    config = lm.config
    device = next(lm.parameters()).device
    lengths = torch.tensor([len(r.context()) for r in rows], dtype=torch.long, device=device)
    C = int(lengths.max()) if len(rows) else 0
    n_kv = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sample = next(iter(pieces.values()), None) or next(iter(prefixes.values()), None)
    dtype = sample[0].dtype if sample is not None else next(lm.parameters()).dtype
    keys = torch.zeros(config.num_hidden_layers, len(rows), n_kv, C, head_dim, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    for b, r in enumerate(rows):
        at = C - int(lengths[b])
        if r.prefix:
            pk, pv = prefixes[r.prefix]
            keys[:, b, :, at: at + len(r.prefix)], values[:, b, :, at: at + len(r.prefix)] = pk, pv
        for a, s in zip(r.artifacts, r.starts()):
            k, v = pieces[(r.prefix, a)]
            keys[:, b, :, at + s: at + s + len(a)] = relocate_keys(k, len(r.prefix), s, rope)
            values[:, b, :, at + s: at + s + len(a)] = v
    return ContextKV(keys, values, lengths)


@functools.cache
def _context_layer() -> type:
    """A cache layer holding fixed context K/V: `update` returns context + new K/V and stores nothing
    (defined on first use, so that importing this module does not load transformers)."""
    from transformers.cache_utils import DynamicLayer

    class ContextLayer(DynamicLayer):
        def __init__(self, keys: Tensor, values: Tensor):
            super().__init__()
            self.keys, self.values = keys, values
            self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            return (torch.cat([self.keys.to(key_states.dtype), key_states], dim=-2),
                    torch.cat([self.values.to(value_states.dtype), value_states], dim=-2))

    return ContextLayer


def context_cache(ctx: ContextKV, config: Any) -> "DynamicCache":
    """A read-only HF cache over the assembled context (one read-only layer per decoder layer)."""
    from transformers import DynamicCache

    layer = _context_layer()
    cache = DynamicCache(config=config)
    cache.layers = [layer(ctx.keys[i], ctx.values[i]) for i in range(ctx.keys.shape[0])]
    return cache


def student_hidden(model: nn.Module, ctx: ContextKV, new_ids: Tensor, new_mask: Tensor) -> Tensor:
    """Final hidden states (B, Q, H) of the new tokens (right-padded (B, Q), mask 1 on real ones) read
    against the context cache: positions lengths[b] + j, a 2D mask over the C context slots (left pads
    masked) and the Q new slots. Runs `model` as given (adapter on), with the gradient of the new
    tokens only: the context K/V are constants."""
    positions = ctx.lengths[:, None] + torch.arange(new_ids.shape[1], device=new_ids.device)[None]
    if ctx.width == 0:
        return final_hidden(model, new_ids, new_mask, position_ids=positions)
    attn = torch.cat([ctx.mask().to(new_mask.device), new_mask.long()], dim=1)
    cache = context_cache(ctx, causal_lm(model).config)
    return final_hidden(model, new_ids, attn, position_ids=positions, cache=cache)
