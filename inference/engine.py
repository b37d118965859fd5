"""Batched generation on token ids: one decoding loop, left-padded prefill, then rounds of new tokens.

Used for rollouts, eval and serving. Works on token ids only (tokenizing is the caller's job).

    engine = Engine(model)                      # lean decoder when the model allows it
    engine = Engine(model, EngineConfig(max_seq_len=512))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, stop_token_ids=(eos,)))
    outs[0].tokens, outs[0].logprobs, outs[0].finish_reason

How a call runs (`run_generation`, the same for every decoding mode):
  1. The preamble, once: prompts are checked, the new-token budget is cut to what max_seq_len
     leaves, the model(s) run in eval mode under inference_mode, and prompts are left-padded to
     the longest, P (each row's positions start at 0 at its first real token, pad keys are masked).
  2. The mode prefills (prompt K/V into a cache pre-allocated for the whole call) and the first
     token of every row is sampled from the prefill logits (see `sampling.py`).
  3. Rounds until every row is done: the mode turns each live row's last token into one or more
     new tokens, `Rollout.record` applies the one stop rule (stop ids, stop sequences, the
     budget), and finished rows are dropped from the batch (a gather of the live cache rows), so
     the batch shrinks as rollouts of very different lengths finish.

The four seams, each a named place a later fast path plugs in without a second copy of the loop:
  (1) token loop    `token_loop` + a `Strategy` (a decoding mode: prefill, then per round
                    propose/verify tokens for the live rows). `OneToken` here is plain decoding;
                    `speculative.SpeculativeMode` drafts and verifies. Preamble and stopping
                    (`rollout.StopRule`) exist once, in this loop.
  (2) linear op     `lean.Projection` / `lean.LinearOp`: every projection of the lean forward is
                    a callable read from the weights, its op looked up from the module's type in
                    the linear registry (`lean.register_linear`: F.linear on full-precision
                    weights; `lowbit.py` registers `lowbit_linear` -- integer GEMMs -- for the
                    LowBitLinear modules of a quantized export and training's FakeQuantLinear).
  (3) routing       `lean.Route`, run per layer by `lean.run_layers`; the base `lean.dense` runs
                    all rows through every layer, and a model that needs another route gets it from
                    the route registry (`lean.register_route`; `skip_routing.py` registers the
                    layer skipper's).
  (4) cache         `lean.KVCache`: the forward writes K/V only through `KVCache.write(layer,
                    start, k, v)` and reads through `KVCache.read`, so K/V from elsewhere can be
                    written into slots before a prefill of only the new tokens.

Two backends serve plain decoding: the lean decoder (`lean.py`, our own forward over the same
weights; the speed path) and the model's HF forward (`hf_backend.py`; the always-correct fallback).
Both give the same tokens. Weights are read from the live model at every call, so a trainer can
update the model between rollouts without telling the engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from inference.hf_backend import HFBackend
from inference.lean import (
    EAGER, ROUTE_MODES, LeanBackend, Rope, RouteContext, compiled_blocks, lean_unsupported_reason, model_route,
    read_dims, rope_tables,
)
from inference.rollout import Completion, Emitted, Rollout
from inference.sampling import SamplingParams, sample_next

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams"]

# Token id written into pad slots of left-padded prompts; any valid id works since pads are masked.
PAD_ID = 0


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine runs; every field has the behaviour of a bare `Engine(model)` as default.

    max_seq_len: cache capacity (prompt + completion); None = config.max_position_embeddings.
    use_lean: None = lean decoder when the model supports it (checked at every call, so model
    surgery after construction is respected); True = require it (ValueError naming why not);
    False = always the HF forward.
    compile: torch.compile the cache-free halves of each lean layer (lean path only); off by
    default because on CPU its first call costs tens of seconds (see benchmarks/generate.py).
    skip_mode: how a layer-skipper model's routed layers run on the lean path
    (`skip_routing.py`): auto (a measured cost gate picks per step), routed, or masked.
    """

    max_seq_len: int | None = None
    use_lean: bool | None = None
    compile: bool = False
    skip_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.skip_mode not in ROUTE_MODES:
            raise ValueError(f"EngineConfig.skip_mode={self.skip_mode!r} is not one of {', '.join(ROUTE_MODES)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        """The inverse of to_dict; an unknown key is an error (a typo would otherwise be ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown EngineConfig keys {unknown}; known: {sorted(known)}")
        return cls(**data)


class Backend(Protocol):
    """Forward + KV cache for one call. prefill: (B, P) -> (B, V); decode: (n,) -> (n, V)."""

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor: ...

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def keep(self, rows: torch.Tensor) -> None: ...


# ----------------------------------------------------------------------------- the preamble


@dataclass
class PaddedPrompts:
    ids: torch.Tensor  # (B, P) left-padded token ids
    valid: torch.Tensor  # (B, P) bool, False on pads
    positions: torch.Tensor  # (B, P) 0 at each row's first real token (pads: 0)
    lengths: torch.Tensor  # (B,) real prompt lengths


def left_pad(prompts: list[list[int]], device: torch.device) -> PaddedPrompts:
    """Left-pad so every row's last prompt token sits in the same slot, P - 1."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    P = int(lengths.max())
    ids = torch.full((len(prompts), P), PAD_ID, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    valid = torch.arange(P)[None, :] >= (P - lengths)[:, None]  # (B, P)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
    return PaddedPrompts(ids.to(device), valid.to(device), positions.to(device), lengths.to(device))


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {row} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {row} has a token id outside [0, {vocab_size})")


def token_budget(prompts: list[list[int]], params: SamplingParams, max_seq_len: int) -> int:
    """New tokens per row: max_new_tokens, cut to what the longest prompt leaves in max_seq_len."""
    longest = max(len(p) for p in prompts)
    if longest >= max_seq_len:
        raise ValueError(f"prompt of {longest} tokens leaves no room in max_seq_len={max_seq_len}")
    return min(params.max_new_tokens, max_seq_len - longest)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Run in eval mode, then restore every submodule's own training flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


# ----------------------------------------------------------------------------- the token loop


class Strategy(Protocol):
    """A decoding mode of the token loop (seam 1): what a round does for the live rows."""

    def prefill(self, batch: PaddedPrompts) -> torch.Tensor:
        """Write the prompts into the mode's cache(s); -> logits of each row's first token (B, V)."""

    def round(self, last: torch.Tensor, positions: torch.Tensor, room: torch.Tensor | int) -> Emitted:
        """last, positions: (n,) each live row's last emitted token (not cached yet) and its
        position; room: tokens each row may still emit. -> the tokens each row emits next
        (1 <= count <= room)."""

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the live rows) in the cache(s), in order."""


# Called after every round with the call's Rollout (`progress`, `emitted` read what each row has so far);
# returns the rows (caller's order) to end now, their place in the batch freed (`Rollout.cancel`).
OnRound = Callable[[Rollout], "set[int] | None"]


def token_loop(strategy: Strategy, batch: PaddedPrompts, params: SamplingParams, new_tokens: int,
               generator: torch.Generator | None, max_rounds: int | None = None,
               on_round: OnRound | None = None) -> Rollout:
    """Prefill, sample every row's first token, then rounds until every row is done (or
    `max_rounds` rounds ran: tests stop a run midway to look at its caches). `on_round` sees every
    round (a server streams from it) and may end rows."""
    run = Rollout(batch.ids.shape[0], new_tokens, params, batch.ids.device)
    logits = strategy.prefill(batch)  # (B, V)
    first, logprob = sample_next(logits, params, generator)  # (B,), (B,)
    emitted = Emitted(first[:, None], logprob[:, None])
    last, positions = first, batch.lengths.clone()  # (n,) last emitted token and its position
    rounds = 0
    while True:
        live = run.record(emitted)  # (n',) rows still running, or None if all are
        ended = on_round(run) if on_round is not None else None
        if ended and not run.done:
            kept = run.cancel(ended)
            if kept is not None:
                live = kept if live is None else live[kept]
        if run.done or rounds == max_rounds:
            return run
        if live is not None:
            strategy.keep(live)
            last, positions = last[live], positions[live]
        emitted = strategy.round(last, positions, run.room())
        last, positions = emitted.last(), positions + emitted.advance()
        rounds += 1


def run_generation(models: Sequence[nn.Module], prompts: list[list[int]], params: SamplingParams,
                   max_seq_len: int, make_strategy: Callable[[PaddedPrompts, int], Strategy],
                   generator: torch.Generator | None, on_round: OnRound | None = None) -> list[Completion]:
    """The preamble and the loop, for any mode. models[0] is the target (its vocab checks the
    prompts, its device holds the batch); every model runs in eval mode, restored afterwards.
    make_strategy(padded batch, new-token budget) builds the mode for this call; `on_round`: token_loop's."""
    if not prompts:
        return []
    target = models[0]
    check_prompts(prompts, target.get_input_embeddings().num_embeddings)
    new_tokens = token_budget(prompts, params, max_seq_len)
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(eval_mode(model))
        # inference_mode on top of no_grad: skips view/version tracking, ~20% per step on CPU here.
        stack.enter_context(torch.inference_mode())
        batch = left_pad(prompts, next(target.parameters()).device)
        strategy = make_strategy(batch, new_tokens)
        return token_loop(strategy, batch, params, new_tokens, generator, on_round=on_round).completions()


class OneToken:
    """Plain decoding: each round decodes every live row's last token and samples the next one."""

    def __init__(self, backend: Backend, params: SamplingParams, generator: torch.Generator | None):
        self.backend, self.params, self.generator = backend, params, generator

    def prefill(self, batch: PaddedPrompts) -> torch.Tensor:
        return self.backend.prefill(batch.ids, batch.positions, batch.valid)  # (B, V)

    def round(self, last: torch.Tensor, positions: torch.Tensor, room: torch.Tensor | int) -> Emitted:
        logits = self.backend.decode(last, positions)  # (n, V)
        tokens, logprobs = sample_next(logits, self.params, self.generator)  # (n,), (n,)
        return Emitted(tokens[:, None], logprobs[:, None])

    def keep(self, rows: torch.Tensor) -> None:
        self.backend.keep(rows)


# ----------------------------------------------------------------------------- the engine


# Marks an Engine keyword argument that was not passed (None is a meaningful use_lean value).
_FROM_CONFIG: Any = object()


class Engine:
    """Batched generation over a live `transformers` causal LM; see `EngineConfig` for the knobs.

    Engine(model, config) or, as before configs existed, Engine(model, max_seq_len=..., use_lean=...,
    compile=...); a keyword that is passed overrides the config's field. A model that needs a
    route (a layer skipper's, `lean.model_route`) gets it from the route registry; the route counts
    into `route_stats[its kind]` (a skip route: a SkipStats under "skip"), summed over this engine's
    calls (pass a dict to share them, e.g. a Server's).
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, *,
                 max_seq_len: int | None = _FROM_CONFIG, use_lean: bool | None = _FROM_CONFIG,
                 compile: bool = _FROM_CONFIG, route_stats: dict | None = None):
        passed = {"max_seq_len": max_seq_len, "use_lean": use_lean, "compile": compile}
        overrides = {key: value for key, value in passed.items() if value is not _FROM_CONFIG}
        self.config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.model = model
        self.use_lean = self.config.use_lean
        self.compile = self.config.compile
        self.max_seq_len = self.config.max_seq_len or model.config.max_position_embeddings
        if self.use_lean:
            self._require_lean()
        self._rope: Rope | None = None  # RoPE tables, reused across calls while still valid
        self._compiled = None  # the torch.compile'd layer halves (compile=True), built on first use
        self.route = None  # the last lean call's route (seam 3)
        # the routes' mode, counts (route_stats, e.g. a skip route's under "skip"; shared when passed) and
        # cost-gate timings, measured once per shape for this engine (lean.RouteContext)
        self.routes = RouteContext(self.config.skip_mode, {} if route_stats is None else route_stats)

    def _require_lean(self) -> None:
        reason = lean_unsupported_reason(self.model)
        if reason is not None:
            raise ValueError(f"use_lean=True but the lean decoder cannot run this model: {reason}")

    def lean_active(self) -> bool:
        """Whether the next call runs the lean decoder."""
        if self.use_lean is None:
            return lean_unsupported_reason(self.model) is None
        if self.use_lean:
            self._require_lean()
        return self.use_lean

    def _backend(self, batch: int, max_len: int) -> Backend:
        if not self.lean_active():
            return HFBackend(self.model, batch, max_len)
        dims = read_dims(self.model)
        self._rope = rope_tables(self.model, max_len, self._rope)
        if self.compile and self._compiled is None:
            self._compiled = compiled_blocks()
        blocks = self._compiled if self.compile else EAGER
        backend = LeanBackend(self.model, dims, self._rope, batch, max_len, blocks,
                              route=model_route(self.model, self.routes))
        self.route = backend.route
        return backend

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None, *, on_round: OnRound | None = None) -> list[Completion]:
        """Complete every prompt (token ids). Returns one Completion per prompt, in order. `on_round`
        (token_loop's) sees each round's tokens and may end rows early."""

        def plain(batch: PaddedPrompts, new_tokens: int) -> OneToken:
            backend = self._backend(batch.ids.shape[0], batch.ids.shape[1] + new_tokens)
            return OneToken(backend, params, generator)

        return run_generation([self.model], prompts, params, self.max_seq_len, plain, generator, on_round)
