"""Routed execution of a layer-skipper in the lean decoder (seam 3: per-layer row routing).

A model with a skipper (`models/skipper.py`) has routers at some layers. At such a layer, per
forward, each row's router says run or skip (g > 0.5), and the rows are served with the trained
arithmetic (`models.skipper.gate_scales`, the same function training uses):

    run rows:     x' = x + o(attn(q, K, V));  out = x' + s_run * mlp(post_norm(x'))
    skipped rows: k, v = the layer's own k|v projection of h (written to the cache, so later
                  tokens attend to them); out = x + s_skip * adapter(h)    -- no q, attention, o or MLP

Three ways to run a routed layer, all with that arithmetic (`mode`):
    masked   every row runs the whole body and the adapter, then each row keeps its branch (the
             reference, and the naive "compute everything, then mix" loop of a plain skipper);
    routed   decode: rows that run are gathered into a dense batch, the others take only the K/V
             projection and the adapter, results scattered back; one row branches directly.
    auto     (default) routed at batch 1; above, a cost gate measured once per model shape and
             batch size (`CostGate`) picks routed or masked for each layer and step from the number
             of rows that run.
Prefill and speculative verification (several new tokens per row) always run masked: their tokens
are routed per token, and the dense body over all of them is one batched pass anyway.

    route = route_for(model, mode="auto")            # None for a model without a skipper
    backend = LeanBackend(model, dims, rope, batch, max_len, route=route)   # the engine does this
    route.stats.skip_ratio()                         # share of skipped routed layer-tokens, decode

The route is registered with the lean decoder (`lean.register_route`, at the end of this module),
so a LeanBackend built without a route serves a skipper model through it (mode auto).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from inference.lean import (
    ROUTE_MODES, Projection, Route, RouteContext, RouteKind, _projection, apply_rope, decoder_layer, register_route,
    rms_norm,
)
from models.skipper import SkipperSpec, gate_scales, gate_values, router_logits

MODES = ROUTE_MODES
CALIBRATION_REPEATS = 5


@dataclass
class SkipWeights:
    """A routed layer's skip-side weights for one call (references to the live modules' tensors)."""

    enc: torch.Tensor  # (r, C)
    norm_weight: torch.Tensor  # (r,)
    dec: torch.Tensor  # (C, r)
    head: torch.Tensor  # (1, C)
    eps: float
    kv: object  # lean.Projection: the k|v part of the layer's fused q|k|v projection
    adapter_gate_up: torch.Tensor  # (2 a, C)
    adapter_down: torch.Tensor  # (C, a)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return router_logits(h, self.enc, self.norm_weight, self.dec, self.head, self.eps)

    def adapter(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.adapter_gate_up).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.adapter_down)


def route_for(model: nn.Module, mode: str = "auto", stats: Optional["SkipStats"] = None,
              timings: Optional[dict] = None) -> Optional["SkipRoute"]:
    """The skip route of a layer-skipper model (its spec and current force), None without one. It
    counts into `stats` and keeps the cost gate's timings in `timings` when given (an engine's, kept
    over its calls), else in its own."""
    state = getattr(model, "skipper_state", None)
    return None if state is None else SkipRoute(state.spec, mode, state.force, stats, timings)


def skipper_unsupported(model: nn.Module) -> Optional[str]:
    """Why the lean path cannot route `model`'s skipper (a routed layer without a plain router and
    adapter), None when it can or the model has no skipper."""
    from models.skipper import Adapter, Router

    state = getattr(model, "skipper_state", None)
    for i in state.spec.layers if state is not None else ():
        skipper = getattr(model.model.layers[i], "skipper", None)
        if skipper is None or type(skipper.router) is not Router or type(skipper.adapter) is not Adapter:
            return f"layer {i} is routed by the skipper but has no plain router and adapter"
    return None


def skip_weights(layer: nn.Module, qkv, dims) -> SkipWeights:
    """Read a routed layer's router, adapter and k|v projection (from the fused q|k|v `qkv`)."""

    skipper = layer.skipper
    router, adapter = skipper.router, skipper.adapter
    n_q = dims.heads * dims.head_dim
    if isinstance(qkv.weight, torch.Tensor):  # float: a view of the fused rows, no copy
        bias = None if qkv.bias is None else qkv.bias[n_q:]
        kv = Projection(qkv.weight[n_q:], bias, qkv.op)
    else:  # low-bit or mixed: the k and v modules' own projection
        attn = layer.self_attn
        kv = _projection(qkv.op if not isinstance(qkv.weight, list) else F.linear, attn.k_proj, attn.v_proj)
    return SkipWeights(
        enc=router.enc.weight.detach(), norm_weight=router.norm_weight.detach(), dec=router.dec.weight.detach(),
        head=router.head.weight.detach(), eps=router.eps, kv=kv,
        adapter_gate_up=torch.cat([adapter.gate_proj.weight, adapter.up_proj.weight]).detach(),
        adapter_down=adapter.down_proj.weight.detach(),
    )


# ----------------------------------------------------------------------------- statistics


@dataclass
class SkipStats:
    """Counts of one generate call (or several, when a route is reused): per routed layer, rows that
    ran and were skipped in decode steps (one new token per row) and in multi-token forwards
    (prefill / verification, real tokens only), and how each decode step was executed."""

    decode_run: dict[int, int] = field(default_factory=dict)
    decode_skip: dict[int, int] = field(default_factory=dict)
    prefill_run: dict[int, int] = field(default_factory=dict)
    prefill_skip: dict[int, int] = field(default_factory=dict)
    executed: dict[str, int] = field(default_factory=lambda: {"branch": 0, "routed": 0, "masked": 0, "uniform": 0})

    def add(self, table: dict[int, int], layer: int, count: int) -> None:
        table[layer] = table.get(layer, 0) + count

    def skip_ratio(self, decode: bool = True) -> float:
        """Skipped routed layer-tokens over all routed layer-tokens (decode steps, or multi-token forwards)."""
        run, skip = (self.decode_run, self.decode_skip) if decode else (self.prefill_run, self.prefill_skip)
        total = sum(run.values()) + sum(skip.values())
        return sum(skip.values()) / total if total else 0.0

    def layer_skip_ratio(self, decode: bool = True) -> dict[int, float]:
        run, skip = (self.decode_run, self.decode_skip) if decode else (self.prefill_run, self.prefill_skip)
        return {i: skip.get(i, 0) / max(run.get(i, 0) + skip.get(i, 0), 1) for i in sorted(set(run) | set(skip))}


# ----------------------------------------------------------------------------- the cost gate


def _break_even(t_masked: float, t_none: float, t_all: float, n: int) -> float:
    """Largest number of running rows at which routed is predicted no slower than masked, from
    routed timings with no row running (t_none) and every row running (t_all), linear between."""
    if t_none >= t_masked:
        return -1.0  # even all-skip routed is slower: never route
    if t_all <= t_masked:
        return float(n)  # routed always pays
    return n * (t_masked - t_none) / (t_all - t_none)


class CostGate:
    """Whether routing pays for a decode step of a routed layer, from timings measured once per
    model shape and batch size: the masked layer (every row runs everything) against the routed
    layer with none and with all of the rows running (interpolated linearly in between). A step
    routes when its number of running rows is at most the break-even count. Timings are taken on
    scratch inputs with the layer's real weights and kept in `timings` (an engine's dict, so they
    last as long as the engine; a fresh one per route otherwise): no process-wide cache."""

    def __init__(self, timings: Optional[dict] = None):
        self.timings = timings if timings is not None else {}

    def break_even(self, route: "SkipRoute", layer: int, x: torch.Tensor, w, dims, rope_rows, cache, slot: int,
                   mask) -> float:
        n = x.shape[0]
        key = (_shape_key(w, dims, x), n, slot // 64)
        if key not in self.timings:
            self.timings[key] = self._measure(route, layer, x, w, dims, rope_rows, cache, slot, mask)
        return self.timings[key]

    @staticmethod
    def _measure(route, layer, x, w, dims, rope_rows, cache, slot, mask) -> float:
        # The timing runs write this step's cache slot; the real step that follows rewrites it for every row.
        n = x.shape[0]
        everyone = torch.ones(n, 1, dtype=torch.bool, device=x.device)
        g = torch.full((n, 1), 0.75, device=x.device)

        def timed(fn) -> float:
            fn()  # warm-up
            best = float("inf")
            for _ in range(CALIBRATION_REPEATS):
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            return best

        h = route._norm(x, w, dims)
        t_masked = timed(lambda: route._masked(layer, x, h, w, dims, rope_rows, cache, slot, mask, everyone, g, g))
        t_none = timed(lambda: route._mixed(layer, x, h, w, dims, rope_rows, cache, slot, mask, ~everyone, g, g, 0))
        t_all = timed(lambda: route._mixed(layer, x, h, w, dims, rope_rows, cache, slot, mask, everyone, g, g, n,
                                           force_gather=True))
        return _break_even(t_masked, t_none, t_all, n)


def _shape_key(w, dims, x) -> tuple:
    qkv = w.qkv.weight
    return (x.shape[-1], dims.heads, dims.kv_heads, dims.head_dim, tuple(getattr(qkv, "shape", ())),
            w.extra.adapter_down.shape[-1], str(x.dtype), str(x.device))


# ----------------------------------------------------------------------------- the route


class SkipRoute(Route):
    """The lean forward's routing for a skipper model: called for every layer, it runs a routed
    layer per `mode` and the others densely. `force` ("run" / "skip" / None) overrides the routers
    as `models.skipper.forced` does in training. `valid` (n, T) marks real tokens of the next
    multi-token forward (for the statistics); the backend sets it before a prefill (`begin`)."""

    def __init__(self, spec: SkipperSpec, mode: str = "auto", force: Optional[str] = None,
                 stats: Optional[SkipStats] = None, timings: Optional[dict] = None):
        if mode not in MODES:
            raise ValueError(f"skip mode {mode!r} is not one of {', '.join(MODES)}")
        self.spec, self.mode, self.force = spec, mode, force
        self.gate = CostGate(timings)
        self.stats = stats if stats is not None else SkipStats()
        self.valid: Optional[torch.Tensor] = None

    def begin(self, valid: torch.Tensor) -> None:
        self.valid = valid

    def attach(self, model: nn.Module, weights, dims) -> None:
        """Give each routed layer of the weights just read (`lean.read_weights`) its skip weights."""
        for i in self.spec.layers:
            layer = weights.layers[i]
            layer.extra = skip_weights(model.model.layers[i], layer.qkv, dims)

    def __call__(self, layer: int, x, w, dims, blocks, rope_rows, cache, slot: int, mask):
        if w.extra is None:
            return decoder_layer(x, w, dims, blocks, rope_rows, cache, layer, slot, mask)
        n, T, _ = x.shape
        h = self._norm(x, w, dims)
        g = self.gates(layer, w, h)  # (n, T) fp32
        run, s_run, s_skip = gate_scales(g, self.spec.gate)
        if T > 1:
            self._count_tokens(layer, run)
            return self._masked(layer, x, h, w, dims, rope_rows, cache, slot, mask, run, s_run, s_skip)
        running = int(run.sum())
        self.stats.add(self.stats.decode_run, layer, running)
        self.stats.add(self.stats.decode_skip, layer, n - running)
        how = self._choose(layer, x, w, dims, rope_rows, cache, slot, mask, running)
        self.stats.executed[how] += 1
        if how == "masked":
            return self._masked(layer, x, h, w, dims, rope_rows, cache, slot, mask, run, s_run, s_skip)
        return self._mixed(layer, x, h, w, dims, rope_rows, cache, slot, mask, run, s_run, s_skip, running)

    def gates(self, layer: int, w, h: torch.Tensor) -> torch.Tensor:
        """g (n, T) fp32 of a routed layer from its normed input h (a benchmark's synthetic policy
        overrides this)."""
        return gate_values(w.extra.logits(h), self.force)

    def _choose(self, layer, x, w, dims, rope_rows, cache, slot, mask, running: int) -> str:
        n = x.shape[0]
        if self.mode == "masked":
            return "masked"
        if running in (0, n):
            return "branch" if n == 1 else "uniform"
        if self.mode == "routed":
            return "routed"
        limit = self.gate.break_even(self, layer, x, w, dims, rope_rows, cache, slot, mask)
        return "routed" if running <= limit else "masked"

    def _count_tokens(self, layer: int, run: torch.Tensor) -> None:
        valid = self.valid if self.valid is not None and self.valid.shape == run.shape else None
        real = run if valid is None else run & valid
        total = run.numel() if valid is None else int(valid.sum())
        running = int(real.sum())
        self.stats.add(self.stats.prefill_run, layer, running)
        self.stats.add(self.stats.prefill_skip, layer, total - running)

    # --- the pieces ------------------------------------------------------------------------------

    @staticmethod
    def _norm(x, w, dims):
        return rms_norm(x, w.input_norm, dims.eps)

    @staticmethod
    def _body(x, h, w, dims, rope_rows, cache, layer, slot, mask, s_run, rows=None):
        """The decoder layer (`lean.decoder_layer`) on (a subset of) rows from their normed input h,
        MLP scaled by s_run; K/V written and read for `rows` only when given."""
        return decoder_layer(x, w, dims, None, rope_rows, cache, layer, slot, mask, h=h, mlp_scale=s_run, rows=rows)

    def _masked(self, layer, x, h, w, dims, rope_rows, cache, slot, mask, run, s_run, s_skip):
        ran = self._body(x, h, w, dims, rope_rows, cache, layer, slot, mask, s_run)
        skipped = x + s_skip.to(x.dtype)[..., None] * w.extra.adapter(h)
        return torch.where(run[..., None], ran, skipped)

    def _skip_rows(self, x, h, w, dims, rope_rows, cache, layer, slot, s_skip, rows=None):
        """Skipped rows: only the K/V (written to the cache) and the adapter."""
        n, T, _ = h.shape
        D, Hk = dims.head_dim, dims.kv_heads
        kv = w.extra.kv(h)
        k = kv[..., : Hk * D].view(n, T, Hk, D)
        v = kv[..., Hk * D:].view(n, T, Hk, D)
        if w.qk_norm is not None:
            k = rms_norm(k, w.qk_norm[dims.heads:], dims.eps)
        cos, sin = rope_rows
        k = apply_rope(k, cos, sin)
        if rows is None:
            cache.write(layer, slot, k, v)
        else:
            cache.write_rows(layer, slot, rows, k, v)
        return x + s_skip.to(x.dtype)[..., None] * w.extra.adapter(h)

    def _mixed(self, layer, x, h, w, dims, rope_rows, cache, slot, mask, run, s_run, s_skip, running: int,
               force_gather=False):
        """Decode with per-row decisions (`running` of them run): all rows one way (branch), or
        gathered and scattered."""
        n = x.shape[0]
        if running == n and not force_gather:
            return self._body(x, h, w, dims, rope_rows, cache, layer, slot, mask, s_run)
        if running == 0:
            return self._skip_rows(x, h, w, dims, rope_rows, cache, layer, slot, s_skip)
        flags = run[:, 0]
        ran = flags.nonzero()[:, 0]
        out = torch.empty_like(x)
        pick = lambda t, rows: t.index_select(0, rows)  # noqa: E731
        rows_rope = tuple(pick(t, ran) for t in rope_rows)
        out.index_copy_(0, ran, self._body(pick(x, ran), pick(h, ran), w, dims, rows_rope, cache, layer, slot,
                                           None if mask is None else pick(mask, ran), pick(s_run, ran), rows=ran))
        if running < n:
            skipped = (~flags).nonzero()[:, 0]
            out.index_copy_(0, skipped, self._skip_rows(
                pick(x, skipped), pick(h, skipped), w, dims, tuple(pick(t, skipped) for t in rope_rows), cache,
                layer, slot, pick(s_skip, skipped), rows=skipped))
        return out


def _engine_route(model: nn.Module, context: RouteContext) -> Optional["SkipRoute"]:
    """The skip route an engine builds: its mode, counting into `context.stats["skip"]`, its cost gate's
    timings kept in `context.timings["skip"]`."""
    if getattr(model, "skipper_state", None) is None:
        return None
    return route_for(model, context.mode, context.stats.setdefault(SKIP, SkipStats()),
                     context.timings.setdefault(SKIP, {}))


# Seam 3: a model with a layer skipper is served through its skip route (`lean.register_route`).
SKIP = "skip"
register_route(RouteKind(name=SKIP, route=_engine_route, unsupported=skipper_unsupported))
