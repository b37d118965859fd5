"""Position-independent artifact cache (seam 4, cache contents): encode each artifact once, reuse its
K/V at any position, and prefill only the new tokens.

Agents put the same artifacts (skills, documents, memory entries, tables) into many contexts. Here
each artifact is prefilled once on its own -- from position 0, or right after a shared prefix that
is encoded once -- and its K/V are kept by content hash (`ArtifactCache`). A request
`prefix + artifacts + query` is then served by writing the cached K/V into the engine's cache at
the artifact's place in the new context, its keys moved there by the RoPE delta rotation
(`relocate.relocate_keys`, values unchanged), and prefilling only the query tokens against them.

    cache = ArtifactCache(model, prefix=prefix_ids)
    engine = PICEngine(model, cache, PICConfig(mode="pic"), adapter=deltas)  # deltas: query_adapter()
    outs = engine.generate([PICRequest(prefix_ids, (art_a, art_b), query_ids)], params)

Modes (`PICConfig.mode`; all in this one engine, so their comparison is like for like):
  full        the reference: everything prefilled jointly (no cache).
  pic         naive position-independent caching: relocated keys, only the query prefilled.
  ape         position reuse without re-rotation: every artifact keeps the positions it was encoded
              at (right after the prefix), the query starts after the longest one; optionally an
              attention temperature on the artifact keys (`ape_temperature`: keys scaled by 1/t, so
              the query's logits on them are divided by t; values unchanged).
  epic        recompute the first `epic_tokens` (<= 32) tokens of every artifact with the query: the
              per-artifact attention sink is rebuilt in context.
  cacheblend  layer 0 recomputed for every token; at layer 1 the fresh keys of all context tokens are
              compared with the cached ones and the `blend_ratio` share (15%) with the largest
              deviation is recomputed with the query through every later layer.
  full_scores the diagnostic: the PIC cache's values read with the attention probabilities of full
              prefill. A full-prefill twin runs in lockstep over the same tokens (prefill and every
              decode step); at each layer the new tokens' attention weights are the twin's, applied
              to the PIC run's own values. Quality recovered here is lost in attention, not in K/V.
A recomputed token attends to the K/V in the cache at its own layer: the recomputed ones of the
tokens recomputed with it, the cached ones of the others (`lean.sparse_prefill`).

Query-side adapters (Attuner): `adapter` maps layer -> delta of the q_proj weight (out, in). The
artifact cache is always encoded with the base weights; the adapted q projection runs only for the
query and the generated tokens, so the cache never depends on the adapter.

Correctness gate: `check_relocation` encodes a probe artifact on its own at position 0 and, once
more, directly at a far position, relocates the first to the second and compares the next-token
distributions of a probe query read over each (KL); `ArtifactCache(check=True)` runs it on first
use and warns when relocation is wrong for this model (a RoPE layout we misread). Layouts known to
make relocation wrong are refused by name before that (`relocate.rope_layout`).

Layout of one call's cache rows: slots [0, C) hold each row's context (prefix + artifacts), left
padded to the longest context C; slots [C, C + Q) hold its query, left padded to the longest
query Q; decoding continues from slot C + Q. Pad slots are masked through `KVCache.key_ok`;
positions count each row's real tokens, so a row's tokens sit at the positions full prefill gives
them (APE excepted).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inference.engine import PaddedPrompts, check_prompts, eval_mode, token_budget, token_loop
from inference.lean import (
    EAGER, KEY, VALUE, LayerWeights, LeanBackend, Projection, Weights, _attend,
    read_dims, rope_at, rope_tables, sparse_prefill,
)
from inference.relocate import PICError, RopeLayout, relocate_keys, rope_layout
from inference.rollout import Completion
from inference.sampling import SamplingParams

MODES = ("full", "pic", "ape", "epic", "cacheblend", "full_scores")
MAX_EPIC_TOKENS = 32
# A relocated cache whose probe KL against direct encoding exceeds this is wrong, not rounded: fp32
# relocation measures ~1e-10 on the tiny model; a misread RoPE layout gives 1e-2 and more.
RELOCATION_KL_WARN = 1e-4
PROBE_TOKENS = 8


@dataclass(frozen=True)
class PICConfig:
    mode: str = "pic"
    epic_tokens: int = 16  # epic: recomputed leading tokens of each artifact (<= 32)
    blend_ratio: float = 0.15  # cacheblend: share of context tokens recomputed
    ape_temperature: float = 1.0  # ape: the query's attention temperature on artifact keys (1 = off)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PICError(f"PICConfig.mode={self.mode!r} is not one of {', '.join(MODES)}")
        if not 0 <= self.epic_tokens <= MAX_EPIC_TOKENS:
            raise PICError(f"PICConfig.epic_tokens={self.epic_tokens} must be in [0, {MAX_EPIC_TOKENS}]")
        if not 0.0 <= self.blend_ratio <= 1.0:
            raise PICError(f"PICConfig.blend_ratio={self.blend_ratio} must be in [0, 1]")
        if self.ape_temperature <= 0:
            raise PICError(f"PICConfig.ape_temperature={self.ape_temperature} must be > 0")


@dataclass(frozen=True)
class PICRequest:
    """One prompt cut into its cacheable pieces (token ids); the prompt is their concatenation."""

    prefix: tuple[int, ...]
    artifacts: tuple[tuple[int, ...], ...]
    query: tuple[int, ...]

    @classmethod
    def make(cls, prefix: Sequence[int], artifacts: Sequence[Sequence[int]], query: Sequence[int]) -> "PICRequest":
        return cls(tuple(prefix), tuple(tuple(a) for a in artifacts), tuple(query))

    def context_len(self) -> int:
        return len(self.prefix) + sum(len(a) for a in self.artifacts)

    def tokens(self) -> list[int]:
        return [*self.prefix, *(t for a in self.artifacts for t in a), *self.query]


@dataclass
class Encoded:
    """One artifact's K/V as encoded on its own: kv (L, 2, H_kv, T, D) at positions [start, start + T)."""

    kv: Tensor
    start: int

    @property
    def length(self) -> int:
        return self.kv.shape[3]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    encoded_tokens: int = 0


def content_key(prefix: Sequence[int], tokens: Sequence[int]) -> str:
    """The content hash an artifact's K/V are stored under (the prefix it was encoded after included)."""
    h = hashlib.sha256()
    h.update(len(prefix).to_bytes(8, "little"))
    for part in (prefix, tokens):
        h.update(torch.tensor(list(part), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- lean parts of a model


@contextlib.contextmanager
def plain_view(model: nn.Module):
    """The HF model under `model` with every LoRA-wrapped projection swapped for its base layer for
    the duration (a PEFT model's base weights, read by the lean decoder); restored afterwards."""
    inner = model.get_base_model() if hasattr(model, "peft_config") else model
    swapped = []
    for _, module in list(inner.named_modules()):
        for child_name, child in list(module.named_children()):
            base = getattr(child, "base_layer", None)
            if base is not None and hasattr(child, "lora_A"):
                swapped.append((module, child_name, child))
                setattr(module, child_name, base)
    try:
        yield inner
    finally:
        for module, child_name, child in swapped:
            setattr(module, child_name, child)


def adapter_deltas(model: nn.Module) -> dict[int, Tensor]:
    """layer -> the q_proj weight delta (out, in) of a PEFT LoRA model's active adapter (an Attuner
    adapter); PICError when the adapter touches anything but q_proj. {} for a plain model."""
    if not hasattr(model, "peft_config"):
        return {}
    deltas: dict[int, Tensor] = {}
    inner = model.get_base_model()
    for i, layer in enumerate(inner.model.layers):
        for name, module in layer.named_modules():
            if not hasattr(module, "lora_A") or not getattr(module, "active_adapters", None):
                continue
            if not name.endswith("q_proj"):
                raise PICError(f"the adapter adapts layer {i}'s {name}: a query-side adapter adapts q_proj only "
                               "(anything else would change the cached K/V)")
            adapter = module.active_adapters[0]
            if adapter in module.lora_A:
                deltas[i] = module.get_delta_weight(adapter).detach()
    return deltas


def query_weights(base: Weights, deltas: Mapping[int, Tensor], dims) -> Weights:
    """The weights of the new tokens: `base` with each adapted layer's q rows of the fused q|k|v
    projection replaced by W_q + delta (float projections only)."""
    if not deltas:
        return base
    layers = list(base.layers)
    n_q = dims.heads * dims.head_dim
    for i, delta in deltas.items():
        w = layers[i]
        if not isinstance(w.qkv.weight, Tensor):
            raise PICError(f"layer {i}: a query adapter needs a float q|k|v projection, not {type(w.qkv.weight).__name__}")
        fused = w.qkv.weight.clone()
        fused[:n_q] += delta.to(fused.dtype)
        layers[i] = dataclasses.replace(w, qkv=Projection(fused, w.qkv.bias, w.qkv.op))
    return dataclasses.replace(base, layers=layers)


def pic_unsupported_reason(model: nn.Module) -> str | None:
    """Why the position-independent cache cannot serve `model` (its base, without adapters), or None.
    Algorithms that train for this cache (attuner) ask it at setup, before any work."""
    from inference.lean import routed

    if routed(model):  # a registered route (e.g. a layer skipper) claims it: its layers do not all run densely
        return "the position-independent cache does not serve a model with routed layers (e.g. a layer skipper)"
    # The PEFT check of lean_unsupported_reason is left out: `plain_view` already swapped every LoRA
    # layer for its base (PEFT leaves a `peft_config` attribute on the model it wraps).
    from inference.lean import LEAN_ARCHITECTURES, _config_reason, _module_reason

    name = type(model).__name__
    reason = (f"architecture {name} is not one of {sorted(LEAN_ARCHITECTURES)}" if name not in LEAN_ARCHITECTURES
              else _config_reason(model) or _module_reason(model))
    if reason is not None:
        return f"the position-independent cache runs on the lean decoder, which cannot run this model: {reason}"
    return None


def _lean_model(model: nn.Module) -> None:
    reason = pic_unsupported_reason(model)
    if reason is not None:
        raise PICError(reason)


# ----------------------------------------------------------------------------- the artifact cache


class ArtifactCache:
    """K/V of artifacts encoded independently with a model's base weights, stored by content hash.

    Every artifact is encoded after `prefix` (its K/V at positions [len(prefix), len(prefix) + T))
    attending to the prefix and itself only. The store belongs to one model's weights: after the
    base changes, build a new cache. `check=True` runs the relocation gate once, on first encode.
    """

    def __init__(self, model: nn.Module, prefix: Sequence[int] = (), max_len: int | None = None,
                 check: bool = True, batch_size: int = 32):
        self.model = model
        self.prefix = tuple(prefix)
        self.max_len = max_len or model.config.max_position_embeddings
        self.batch_size = batch_size
        self.entries: dict[str, Encoded] = {}
        self.stats = CacheStats()
        self.check = check
        self.probe_kl: float | None = None
        with plain_view(model) as plain:
            _lean_model(plain)
            self.rope: RopeLayout = rope_layout(plain)
        self._prefix_kv: Encoded | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def nbytes(self) -> int:
        return sum(e.nbytes() for e in self.entries.values())

    def _plain(self):
        return plain_view(self.model)

    def prefix_kv(self) -> Encoded | None:
        if not self.prefix:
            return None
        if self._prefix_kv is None:
            self._prefix_kv = self._encode_batch([self.prefix], with_prefix=False)[0]
        return self._prefix_kv

    def get(self, tokens: Sequence[int]) -> Encoded:
        """The cached K/V of one artifact, encoded now when not stored yet."""
        return self.get_many([tokens])[0]

    def get_many(self, artifacts: Sequence[Sequence[int]]) -> list[Encoded]:
        """The cached K/V of each artifact (missing ones encoded together, in batches)."""
        keys = [content_key(self.prefix, a) for a in artifacts]
        missing = {}
        for key, tokens in zip(keys, artifacts):
            if key in self.entries:
                self.stats.hits += 1
            elif key not in missing:
                missing[key] = tuple(tokens)
                self.stats.misses += 1
        if missing:
            self._check_lengths(missing.values())
            if self.check and self.probe_kl is None:
                self.gate(next(iter(missing.values())))
            items = list(missing.items())
            for start in range(0, len(items), self.batch_size):
                chunk = items[start : start + self.batch_size]
                for (key, tokens), enc in zip(chunk, self._encode_batch([t for _, t in chunk])):
                    self.entries[key] = enc
                    self.stats.encoded_tokens += len(tokens)
        return [self.entries[k] for k in keys]

    def _check_lengths(self, artifacts) -> None:
        for tokens in artifacts:
            if not tokens:
                raise PICError("an artifact is empty")
            if len(self.prefix) + len(tokens) >= self.max_len:
                raise PICError(f"an artifact of {len(tokens)} tokens (after a {len(self.prefix)}-token prefix) does not "
                               f"fit the cache of {self.max_len} positions")

    @torch.inference_mode()
    def _encode_batch(self, artifacts: Sequence[Sequence[int]], with_prefix: bool = True,
                      start: int | None = None) -> list[Encoded]:
        """Prefill artifacts (right-padded; pads never reach a real token) after the prefix."""
        with self._plain() as plain, eval_mode(plain):
            return encode_independently(plain, artifacts, self.prefix_kv() if with_prefix else None,
                                        self.max_len, start)

    def gate(self, probe: Sequence[int] | None = None, far: int | None = None) -> float:
        """The relocation check (see the module docstring): KL of the probe query's next-token
        distributions over the relocated cache vs over the artifact encoded at the far position;
        warns above RELOCATION_KL_WARN. Returns the largest KL."""
        self.probe_kl = 0.0  # set first: the probe's own encodes must not re-enter the gate
        with self._plain() as plain, eval_mode(plain):
            kl = check_relocation(plain, probe, None, self.max_len, self.rope, far)
        self.probe_kl = kl
        if kl > RELOCATION_KL_WARN:
            warnings.warn(f"position-independent cache: relocated keys disagree with keys encoded at the new position "
                          f"(probe next-token KL {kl:.2e} > {RELOCATION_KL_WARN:g}) for {type(plain).__name__} with RoPE "
                          f"layout {self.rope.layout!r}, rotary dims {self.rope.rotary_dim}: relocation is wrong for this "
                          "model; serve it with full prefill", RuntimeWarning, stacklevel=3)
        return kl


def encode_independently(model: nn.Module, artifacts: Sequence[Sequence[int]], prefix: Encoded | None,
                         max_len: int, start: int | None = None) -> list[Encoded]:
    """K/V of each artifact prefilled on its own by the lean decoder over `model`'s weights: after
    the prefix's K/V when given (slots [0, P)), at positions [start, start + T) (default: P)."""
    dims = read_dims(model)
    rope = rope_tables(model, max_len)
    P = 0 if prefix is None else prefix.length
    first = P if start is None else start
    T = max(len(a) for a in artifacts)
    backend = LeanBackend(model, dims, rope, len(artifacts), P + T)
    cache = backend.cache
    ids = torch.zeros(len(artifacts), T, dtype=torch.long, device=cache.kv.device)
    for row, tokens in enumerate(artifacts):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    positions = torch.arange(first, first + T, device=ids.device)[None].expand(len(artifacts), T)
    mask = None
    if P:
        cache.kv[:, :, :, :, :P] = prefix.kv[:, :, None]
        mask = torch.ones(T, P + T, dtype=torch.bool, device=ids.device)
        mask[:, P:] = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        mask = mask[None, None]
    from inference.lean import forward

    forward(backend.weights, dims, EAGER, rope, ids, positions, cache, P, mask)
    return [Encoded(cache.kv[:, :, row, :, P : P + len(tokens)].clone(), first) for row, tokens in enumerate(artifacts)]


def check_relocation(model: nn.Module, probe: Sequence[int] | None, prefix: Encoded | None, max_len: int,
                     rope: RopeLayout, far: int | None = None) -> float:
    """Largest next-token KL, over the probe query's tokens, between the probe artifact encoded at its
    cache position and relocated to `far`, and the same artifact encoded directly at `far` (both
    after the prefix, both read by the same probe query). Zero up to rounding when relocation is
    right; a misread RoPE layout shows as a large KL."""
    vocab = model.config.vocab_size
    P = 0 if prefix is None else prefix.length
    g = torch.Generator().manual_seed(0)
    tokens = list(probe) if probe else torch.randint(0, vocab, (16,), generator=g).tolist()
    tokens = tokens[: max(1, min(len(tokens), (max_len - P) // 4))]
    query = torch.randint(0, vocab, (PROBE_TOKENS,), generator=g).tolist()
    T = len(tokens)
    far = far if far is not None else max(P, min(max_len - T - PROBE_TOKENS - 1, P + 3 * T + 37))
    cached = encode_independently(model, [tokens], prefix, max_len)[0]
    direct = encode_independently(model, [tokens], prefix, max_len, start=far)[0]
    moved = relocate(cached, far, rope)
    logps = []
    for enc in (moved, direct):
        logits = _read_over(model, prefix, enc, query, far + T, max_len)  # (Q, V)
        logps.append(F.log_softmax(logits.float(), -1))
    kl = (logps[1].exp() * (logps[1] - logps[0])).sum(-1)
    return float(kl.max())


def _read_over(model: nn.Module, prefix: Encoded | None, enc: Encoded, query: Sequence[int], start_pos: int,
               max_len: int) -> Tensor:
    """Logits (Q, V) of every query token read over [prefix, enc] (batch of one, contiguous slots)."""
    dims = read_dims(model)
    rope = rope_tables(model, max_len)
    P = 0 if prefix is None else prefix.length
    S = P + enc.length
    Q = len(query)
    backend = LeanBackend(model, dims, rope, 1, S + Q)
    if P:
        backend.cache.kv[:, :, 0, :, :P] = prefix.kv
    backend.cache.kv[:, :, 0, :, P:S] = enc.kv
    ids = torch.tensor([query], dtype=torch.long, device=backend.cache.kv.device)
    positions = torch.arange(start_pos, start_pos + Q, device=ids.device)[None]
    mask = torch.ones(Q, S + Q, dtype=torch.bool, device=ids.device)
    mask[:, S:] = torch.ones(Q, Q, dtype=torch.bool, device=ids.device).tril()
    x = backend.embed(ids)
    hidden = backend.run(x, positions, range(dims.layers), S, mask[None, None])
    return backend.logits(hidden)[0]


def relocate(enc: Encoded, new_start: int, rope: RopeLayout) -> Encoded:
    """The artifact's K/V with its keys moved from [start, start + T) to [new_start, new_start + T)."""
    kv = enc.kv.clone()
    kv[:, KEY] = relocate_keys(enc.kv[:, KEY], enc.start, new_start, rope)
    return Encoded(kv, new_start)


# ----------------------------------------------------------------------------- serving


@dataclass
class PICStats:
    """What the last call computed: tokens prefilled per layer-0 pass, recomputed context tokens, the
    artifacts served from the cache, and the seconds to the first token's logits."""

    query_tokens: int = 0
    recomputed_context_tokens: int = 0
    cached_artifacts: int = 0
    relocated_tokens: int = 0
    ttft_s: float = 0.0
    extra: dict = field(default_factory=dict)


class PICEngine:
    """Generation over requests cut into prefix / artifacts / query, in one of `MODES`.

    model: the served model (a PEFT model with a q_proj-only adapter is read as base + adapter);
    cache: its ArtifactCache (default: a new one, no prefix); adapter: layer -> q delta, overriding
    the one read from a PEFT model (None: read it).
    """

    def __init__(self, model: nn.Module, cache: ArtifactCache | None = None, config: PICConfig | None = None,
                 adapter: Mapping[int, Tensor] | None = None, max_seq_len: int | None = None):
        self.model = model
        self.config = config or PICConfig()
        self.cache = cache if cache is not None else ArtifactCache(model)
        self.adapter = dict(adapter) if adapter is not None else adapter_deltas(model)
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        self.stats = PICStats()

    @torch.no_grad()
    def first_logits(self, requests: Sequence[PICRequest]) -> Tensor:
        """The prefill alone: each request's next-token logits after its last query token, (B, V)
        (what time to first token measures)."""
        self._check(requests)
        with self.cache._plain() as plain, eval_mode(plain), torch.inference_mode():
            strategy = _PICStrategy(self, plain, requests, 1, SamplingParams(max_new_tokens=1), None)
            return strategy.prefill(strategy.batch)

    @torch.no_grad()
    def generate(self, requests: Sequence[PICRequest], params: SamplingParams,
                 generator: torch.Generator | None = None) -> list[Completion]:
        if not requests:
            return []
        self._check(requests)
        prompts = [r.tokens() for r in requests]
        with self.cache._plain() as plain:
            check_prompts(prompts, plain.get_input_embeddings().num_embeddings)
            new_tokens = token_budget(prompts, params, self.max_seq_len)
            with eval_mode(plain), torch.inference_mode():
                strategy = _PICStrategy(self, plain, requests, new_tokens, params, generator)
                run = token_loop(strategy, strategy.batch, params, new_tokens, generator)
        return run.completions()

    def _check(self, requests: Sequence[PICRequest]) -> None:
        if not requests:
            raise PICError("no requests")
        for r in requests:
            if tuple(r.prefix) != self.cache.prefix:
                raise PICError(f"a request's prefix ({len(r.prefix)} tokens) is not the cache's shared prefix "
                               f"({len(self.cache.prefix)} tokens)")
            if not r.query:
                raise PICError("a request has an empty query: the last prompt token must be prefilled")
            if len(r.tokens()) >= self.max_seq_len:
                raise PICError(f"a request of {len(r.tokens())} tokens leaves no room in max_seq_len={self.max_seq_len}")


class _PICStrategy:
    """The token-loop strategy of one PICEngine call: a prefill that writes cached K/V and computes
    only what the mode recomputes, then plain decoding with the query weights."""

    def __init__(self, engine: PICEngine, model: nn.Module, requests: Sequence[PICRequest], new_tokens: int,
                 params: SamplingParams, generator):
        self.engine, self.cfg, self.params, self.generator = engine, engine.config, params, generator
        self.requests = list(requests)
        dims = read_dims(model)
        self.dims = dims
        B = len(requests)
        self.C = max(r.context_len() for r in requests)
        self.Q = max(len(r.query) for r in requests)
        S = self.C + self.Q
        self.rope = rope_tables(model, max(self.engine.max_seq_len, S + new_tokens))
        self.backend = LeanBackend(model, dims, self.rope, B, S + new_tokens)
        self.backend_model = model
        self.base = self.backend.weights
        self.backend.weights = query_weights(self.base, engine.adapter, dims)
        device = self.backend.cache.kv.device
        self.device = device
        # The token loop's view: ids/valid over the S prefill slots, next positions per row.
        ids = torch.zeros(B, S, dtype=torch.long)
        valid = torch.zeros(B, S, dtype=torch.bool)
        positions = torch.zeros(B, S, dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        self.ctx_start = []  # first context slot per row
        for row, r in enumerate(requests):
            c, q = r.context_len(), len(r.query)
            ctx = [*r.prefix, *(t for a in r.artifacts for t in a)]
            c0, q0 = self.C - c, S - q
            if ctx:
                ids[row, c0 : self.C] = torch.tensor(ctx, dtype=torch.long)
            ids[row, q0:] = torch.tensor(r.query, dtype=torch.long)
            valid[row, c0 : self.C] = True
            valid[row, q0:] = True
            q_start = self._query_start(r)
            positions[row, c0 : self.C] = torch.arange(c)
            positions[row, q0:] = torch.arange(q_start, q_start + q)
            lengths[row] = q_start + q
            self.ctx_start.append(c0)
        self.batch = PaddedPrompts(ids.to(device), valid.to(device), positions.to(device), lengths.to(device))

    def _query_start(self, r: PICRequest) -> int:
        if self.cfg.mode == "ape" and r.artifacts:
            return len(r.prefix) + max(len(a) for a in r.artifacts)
        return r.context_len()

    # -- the prefill ------------------------------------------------------------------------------

    def prefill(self, batch: PaddedPrompts) -> Tensor:
        started = time.perf_counter()
        stats = self.engine.stats = PICStats()
        cache = self.backend.cache
        S = self.C + self.Q
        cache.key_ok[:, 0, 0, :S] = batch.valid
        # Pad slots are never written here; masked or not, an uninitialised NaN there would reach
        # the attention output (0 weight x NaN), so the prefill slots start at zero.
        cache.kv[:, :, :, :, :S].zero_()
        self.backend.padded, self.backend.slot = True, S
        if self.cfg.mode == "full":
            logits = self._full(batch, stats)
        else:
            self._write_context(stats)
            if self.cfg.mode in ("pic", "ape"):
                logits = self._query_prefill(batch, stats)
            elif self.cfg.mode == "full_scores":
                logits = self._scores_prefill(batch, stats)
            elif self.cfg.mode == "epic":
                logits = self._epic(batch, stats)
            else:
                logits = self._cacheblend(batch, stats)
        stats.ttft_s = time.perf_counter() - started
        return logits

    def _full(self, batch: PaddedPrompts, stats: PICStats) -> Tensor:
        """Every token prefilled jointly with the base weights, then the query weights for decoding
        (an adapter, if any, is off for the reference)."""
        from inference.lean import forward

        S = self.C + self.Q
        valid = batch.valid
        causal = torch.ones(S, S, dtype=torch.bool, device=self.device).tril()
        mask = (causal & self.backend.cache.key_ok[:, :, :, :S]) | torch.eye(S, dtype=torch.bool, device=self.device)
        stats.query_tokens = int(valid.sum())
        self.backend.weights = self.base
        return forward(self.base, self.dims, EAGER, self.rope, batch.ids, batch.positions, self.backend.cache, 0, mask)

    def _write_context(self, stats: PICStats) -> None:
        """Cached K/V of every row's prefix and artifacts into its context slots, keys relocated to
        the artifact's place (ape: left where they were encoded, scaled by 1/ape_temperature). One
        relocation per row: the row's artifacts concatenated, with per-token old and new positions."""
        cache, store = self.backend.cache, self.engine.cache
        prefix = store.prefix_kv()
        encoded = store.get_many([a for r in self.requests for a in r.artifacts])
        stats.cached_artifacts = len(encoded)
        it = iter(encoded)
        for row, r in enumerate(self.requests):
            slot = self.ctx_start[row]
            if prefix is not None:
                cache.kv[:, :, row, :, slot : slot + prefix.length] = prefix.kv
                slot += prefix.length
            parts = [next(it) for _ in r.artifacts]
            if not parts:
                continue
            kv = torch.cat([e.kv for e in parts], dim=3) if len(parts) > 1 else parts[0].kv
            n = kv.shape[3]
            if self.cfg.mode == "ape":
                if self.cfg.ape_temperature != 1.0:
                    kv = kv.clone()
                    kv[:, KEY] = kv[:, KEY] / self.cfg.ape_temperature
                cache.kv[:, :, row, :, slot : slot + n] = kv
                continue
            old = torch.cat([torch.arange(e.start, e.start + e.length) for e in parts]).to(self.device)
            new = torch.arange(len(r.prefix), len(r.prefix) + n, device=self.device)
            cache.kv[:, VALUE, row, :, slot : slot + n] = kv[:, VALUE]
            cache.kv[:, KEY, row, :, slot : slot + n] = relocate_keys(kv[:, KEY], old, new, store.rope)
            stats.relocated_tokens += int((old != new).sum())

    def _query_prefill(self, batch: PaddedPrompts, stats: PICStats) -> Tensor:
        """Only the query tokens (slots [C, C + Q)) over the written context."""
        from inference.lean import forward

        C, S = self.C, self.C + self.Q
        cache = self.backend.cache
        causal = torch.ones(self.Q, self.Q, dtype=torch.bool, device=self.device).tril()
        allowed = torch.ones(self.Q, S, dtype=torch.bool, device=self.device)
        allowed[:, C:] = causal
        diag = torch.zeros(self.Q, S, dtype=torch.bool, device=self.device)
        diag[:, C:] = torch.eye(self.Q, dtype=torch.bool, device=self.device)
        mask = (allowed & cache.key_ok[:, :, :, :S]) | diag  # (B, 1, Q, S)
        stats.query_tokens = int(batch.valid[:, C:].sum())
        return forward(self.backend.weights, self.dims, EAGER, self.rope, batch.ids[:, C:], batch.positions[:, C:],
                       cache, C, mask)

    def _epic(self, batch: PaddedPrompts, stats: PICStats) -> Tensor:
        """The first epic_tokens tokens of every artifact recomputed with the query from layer 0."""
        k = self.cfg.epic_tokens
        chosen = []
        for row, r in enumerate(self.requests):
            slots, slot = [], self.ctx_start[row] + len(r.prefix)
            for a in r.artifacts:
                slots += range(slot, slot + min(k, len(a)))
                slot += len(a)
            chosen.append(slots)
        return self._recompute(batch, chosen, stats)

    def _cacheblend(self, batch: PaddedPrompts, stats: PICStats) -> Tensor:
        """Layer 0 for every token; then the blend_ratio share of context tokens whose layer-1 keys
        deviate most from the cached ones, recomputed with the query through the later layers."""
        B, S = len(self.requests), self.C + self.Q
        all_slots = [[s for s in range(S) if bool(batch.valid[row, s])] for row in range(B)]
        x, slots = self._sparse_layers(batch, all_slots, range(0, 1))  # (B, R, C)
        if self.dims.layers == 1:
            return self.backend.logits(x[:, -1])  # the last slot is every row's last query token
        w1 = self.base.layers[1]
        pos = torch.stack([batch.positions[row, slots[row]] for row in range(B)])
        _, k_fresh, _ = _inputs(x, w1, self.dims, self.rope, pos)  # (B, R, H_kv, D)
        chosen = []
        for row in range(B):
            ctx = [j for j, s in enumerate(slots[row].tolist()) if s < self.C]
            if not ctx:
                chosen.append([])
                continue
            idx = slots[row, ctx]
            cached = self.backend.cache.kv[1, KEY, row][:, idx].transpose(0, 1)  # (n, H_kv, D)
            dev = (k_fresh[row, ctx].float() - cached.float()).pow(2).sum((-1, -2))  # (n,)
            n_pick = int(round(self.cfg.blend_ratio * len(ctx)))
            top = dev.topk(n_pick).indices if n_pick else dev.new_zeros(0, dtype=torch.long)
            chosen.append(sorted(idx[top].tolist()))
        # Layers >= 1: the chosen context tokens and the query, from layer 0's outputs.
        return self._recompute(batch, chosen, stats, first_layer=1, layer0=(x, slots))

    def _recompute(self, batch: PaddedPrompts, chosen: list[list[int]], stats: PICStats, first_layer: int = 0,
                   layer0=None) -> Tensor:
        """Context slots `chosen` (per row) and every query slot through layers [first_layer, L)."""
        C, S = self.C, self.C + self.Q
        rows = []
        for row in range(len(self.requests)):
            q_slots = [s for s in range(C, S) if bool(batch.valid[row, s])]
            rows.append(sorted(set(chosen[row])) + q_slots)
        stats.recomputed_context_tokens = sum(len(set(c)) for c in chosen)
        stats.query_tokens = int(batch.valid[:, C:].sum())
        if layer0 is None:
            x, slots = self._sparse_layers(batch, rows, range(first_layer, self.dims.layers))
        else:
            x0, slots0 = layer0
            picked = []
            for row in range(len(self.requests)):
                where = {s: j for j, s in enumerate(slots0[row].tolist())}
                picked.append(torch.tensor([where[s] for s in _left_fill(rows[row], self._width(rows))],
                                           device=self.device))
            x = torch.stack([x0[row, picked[row]] for row in range(len(self.requests))])
            x, slots = self._sparse_layers(batch, rows, range(first_layer, self.dims.layers), x=x)
        return self.backend.logits(x[:, -1])  # the last slot is every row's last query token

    @staticmethod
    def _width(rows: list[list[int]]) -> int:
        return max(len(r) for r in rows)

    def _sparse_layers(self, batch: PaddedPrompts, rows: list[list[int]], layers, x: Tensor | None = None):
        """Run the tokens at slots rows[b] (ascending) through `layers`; each row's list is filled on
        the left with copies of its first slot to a common width (a copy computes and writes exactly
        what the original does). Returns hidden (B, R, C) and the slots (B, R)."""
        R = self._width(rows)
        slots = torch.stack([torch.tensor(_left_fill(r, R), dtype=torch.long) for r in rows]).to(self.device)
        if x is None:
            x = self.backend.embed(batch.ids.gather(1, slots))
        pos = batch.positions.gather(1, slots)
        x = sparse_prefill(x, slots, pos, self.backend, layers, self.base, self.backend.weights, self.rope,
                            self.dims, self.C)
        return x, slots

    # -- the full_scores diagnostic -----------------------------------------------------------------

    def _scores_prefill(self, batch: PaddedPrompts, stats: PICStats) -> Tensor:
        """The twin prefills everything (same slot layout); the PIC run only the query, with the
        twin's attention weights on the query rows."""
        S, C = self.C + self.Q, self.C
        twin = self.twin = LeanBackend(self.backend_model, self.dims, self.rope, len(self.requests),
                                       self.backend.cache.capacity)
        twin.cache.kv[:, :, :, :, :S].zero_()
        twin.cache.key_ok[:, 0, 0, :S] = batch.valid
        twin.padded, twin.slot = True, S
        eye = torch.eye(S, dtype=torch.bool, device=self.device)
        mask = (torch.ones(S, S, dtype=torch.bool, device=self.device).tril() & twin.cache.key_ok[:, :, :, :S]) | eye
        stats.query_tokens = int(batch.valid[:, C:].sum())
        return self._lockstep(batch.ids, batch.positions, mask, start=0, pic_from=C)

    def _lockstep(self, ids: Tensor, positions: Tensor, mask: Tensor, start: int, pic_from: int) -> Tensor:
        """ids/positions (n, T) at slots [start, start + T) for the twin; the PIC run takes the
        tokens from slot pic_from on. Returns the PIC run's last-position logits (n, V)."""
        twin, pic = self.twin, self.backend
        off = pic_from - start
        x_t = twin.embed(ids)
        x_p = x_t[:, off:]
        rows_t = rope_at(self.rope, positions, x_t.dtype)
        rows_p = tuple(r[:, off:] for r in rows_t)
        end = start + ids.shape[1]
        from inference.lean import attention_inputs, attention_output_and_mlp

        for layer in range(self.dims.layers):
            wb, wq = self.base.layers[layer], pic.weights.layers[layer]
            q_t, k_t, v_t = attention_inputs(x_t, wb, self.dims, *rows_t)
            twin.cache.write(layer, start, k_t, v_t)
            keys_t, values_t = twin.cache.read(layer, end)
            probs = _attention_probs(q_t[:, off:], keys_t, mask[..., off:, :], self.dims)  # (n, H, T', S)
            attn_t = _attend(q_t, keys_t, values_t, mask, self.dims)
            x_t = attention_output_and_mlp(x_t, attn_t, wb, self.dims)
            _, k_p, v_p = attention_inputs(x_p, wq, self.dims, *rows_p)
            pic.cache.write(layer, pic_from, k_p, v_p)
            _, values_p = pic.cache.read(layer, end)
            heads = values_p.repeat_interleave(self.dims.groups, dim=1)  # (n, H, S, D)
            attn_p = (probs @ heads.to(probs.dtype)).to(x_p.dtype)  # (n, H, T', D)
            attn_p = attn_p.transpose(1, 2).reshape(x_p.shape[0], x_p.shape[1], -1)
            x_p = attention_output_and_mlp(x_p, attn_p, wq, self.dims)
        return pic.logits(x_p[:, -1])

    # -- decoding ---------------------------------------------------------------------------------

    def round(self, last: Tensor, positions: Tensor, room) :
        from inference.rollout import Emitted
        from inference.sampling import sample_next

        if self.cfg.mode == "full_scores":
            end = self.backend.slot + 1
            mask = self.backend.cache.key_ok[: self.backend.n, :, :, :end]
            logits = self._lockstep(last[:, None], positions[:, None], mask, self.backend.slot, self.backend.slot)
            self.backend.slot = self.twin.slot = end
        else:
            logits = self.backend.decode(last, positions)
        tokens, logprobs = sample_next(logits, self.params, self.generator)
        return Emitted(tokens[:, None], logprobs[:, None])

    def keep(self, rows: Tensor) -> None:
        self.backend.keep(rows)
        if self.cfg.mode == "full_scores":
            self.twin.keep(rows)


def _attention_probs(q: Tensor, keys: Tensor, mask: Tensor, dims) -> Tensor:
    """softmax(q k^T / sqrt(D)) under the bool mask, fp32: q (n, T, H, D), keys (n, H_kv, S, D),
    mask (n, 1, T, S) -> (n, H, T, S)."""
    k = keys.repeat_interleave(dims.groups, dim=1).float()  # (n, H, S, D)
    scores = q.transpose(1, 2).float() @ k.transpose(-1, -2) / dims.head_dim ** 0.5  # (n, H, T, S)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def _left_fill(slots: list[int], width: int) -> list[int]:
    return [slots[0]] * (width - len(slots)) + list(slots)


def _inputs(x: Tensor, w: LayerWeights, dims, rope, positions: Tensor):
    from inference.lean import attention_inputs

    return attention_inputs(x, w, dims, *rope_at(rope, positions, x.dtype))


# ----------------------------------------------------------------------------- files and adapters


def read_artifacts(paths: Sequence[str]) -> list[str]:
    """Artifact texts from files: a `.jsonl` file holds one artifact per line (a JSON string, or an
    object with a "text" field), a `.json` file a list of them, any other file is one artifact (its
    whole text). PICError naming the file (and 1-based row) on a missing, unreadable or malformed
    file, or an empty artifact."""
    import json
    import os

    out: list[str] = []
    for path in paths:
        if not os.path.isfile(path):
            raise PICError(f"artifacts file {path}: no such file")
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except UnicodeDecodeError:
            raise PICError(f"artifacts file {path}: not UTF-8 text") from None
        if path.endswith(".jsonl"):
            items = []
            for row, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    items.append((row, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise PICError(f"artifacts file {path}, row {row}: invalid JSON ({err.msg})") from None
        elif path.endswith(".json"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise PICError(f"artifacts file {path}: invalid JSON ({err.msg}, line {err.lineno})") from None
            if not isinstance(data, list):
                raise PICError(f"artifacts file {path}: expected a JSON list of artifacts, got {type(data).__name__}")
            items = list(enumerate(data, start=1))
        else:
            items = [(1, text)]
        for row, item in items:
            value = item.get("text") if isinstance(item, dict) else item
            if not isinstance(value, str) or not value:
                raise PICError(f"artifacts file {path}, row {row}: an artifact must be a non-empty string "
                               f"(or an object with a non-empty \"text\"), got {type(value).__name__}")
            out.append(value)
    if not out:
        raise PICError(f"no artifacts in {', '.join(paths)}")
    return out


def load_query_adapter(base: nn.Module, adapter_dir: str) -> dict[int, Tensor]:
    """The q_proj deltas of the PEFT adapter in `adapter_dir` over `base` (base left unchanged);
    PICError when the adapter does not fit the base or adapts anything but q_proj."""
    from peft import PeftModel

    from models.loading import plain_weights
    from models.model_dir import ModelDirError

    try:
        with plain_weights(adapter_dir):  # a weights pickle that is not plain data: one line, nothing of it ran
            peft_model = PeftModel.from_pretrained(base, adapter_dir)
    except ModelDirError as err:
        raise PICError(str(err)) from None
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PICError(f"adapter {adapter_dir} does not match the base model: {first}") from None
    try:
        deltas = adapter_deltas(peft_model)
    finally:
        peft_model.unload()
    return deltas


# ----------------------------------------------------------------------------- text in, completions out


def request_of(tokenizer, segments) -> PICRequest:
    """A PICRequest from a prompt cut into `segments` (`.prefix`, `.artifacts`, `.query` texts):
    each piece tokenized on its own without special tokens, so full prefill of the concatenated
    ids and the cache read exactly the same tokens."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids if text else []

    return PICRequest.make(ids(segments.prefix), [ids(a) for a in segments.artifacts], ids(segments.query))


class PICServer:
    """Completions for prompts given as segments, grouped by shared prefix (one ArtifactCache per
    prefix, kept across calls: the model's base weights must not change while it lives)."""

    def __init__(self, model: nn.Module, tokenizer, config: PICConfig | None = None,
                 adapter: Mapping[int, Tensor] | None = None, batch_size: int = 64):
        self.model, self.tokenizer, self.config = model, tokenizer, config or PICConfig()
        self.adapter = adapter
        self.batch_size = batch_size
        self.caches: dict[tuple[int, ...], ArtifactCache] = {}

    def generate(self, segments: Sequence, params: SamplingParams,
                 generator: torch.Generator | None = None) -> list[Completion]:
        requests = [request_of(self.tokenizer, s) for s in segments]
        out: list[Completion | None] = [None] * len(requests)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.prefix, []).append(i)
        for prefix, rows in groups.items():
            if prefix not in self.caches:
                self.caches[prefix] = ArtifactCache(self.model, prefix=prefix)
            engine = PICEngine(self.model, self.caches[prefix], self.config, adapter=self.adapter)
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                for i, completion in zip(chunk, engine.generate([requests[i] for i in chunk], params, generator)):
                    out[i] = completion
        return out  # type: ignore[return-value]
