"""Suffix cache reuse for multi-turn sessions: each call of a session reuses the K/V of its previous
sequence where the new prompt repeats it, and prefills only the rest.

A session (one agent episode, say) calls the engine many times. Its next prompt is mostly its
previous prompt + the generated output, except where the model rewrote its context: then long runs
of the old text survive at shifted positions. Per row, against the session's stored sequence (the
tokens forwarded last time: prompt + completion but its last token) and that sequence's K/V:

  1. diff old vs new token ids (`difflib.SequenceMatcher(autojunk=False)` opcodes);
  2. the longest common prefix is reused as it is (same tokens, same positions: exact);
  3. mode "suffix": among the later `equal` blocks of >= min_span tokens, the max_spans largest are
     copied and their keys moved to the new positions by the RoPE delta rotation
     (`relocate.relocate_keys`; values carry no position), except the last `reforward` tokens of
     each block, which are forwarded again so the text after a block is read in its new context;
  4. everything else (new text, re-forwarded tails, the last prompt token, whose logits sample
     the first new token) is computed in one `lean.sparse_prefill` over the cache: every computed
     token attends to every earlier slot, reused or computed;
  5. a plan relocating fewer than min_gain tokens falls back to the prefix plan (it does not pay).

Relocation is approximate by design: a relocated token keeps the K/V it had under its old preceding
context (exact only at layer 0, whose K/V depend on the token and its position alone).

    engine = SessionEngine(model, ReuseConfig(mode="suffix"))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0), sessions=episode_ids)
    engine.stats[0].compute          # tokens forwarded (prompt, after reuse) + tokens decoded
    logits = engine.replay(prompts, recorded_outputs, sessions)  # teacher-forced, (B, V) fp32

Cache layout of a call: the engine's, prompts left-padded to the longest P (slots [0, P)), decoding
from slot P. Session state is dropped when the model's weights changed since it was stored (K/V
from old weights would be served as if current), and is held only by the lean decoder path: mode
"full", models the lean decoder cannot run and layer-skipper models (whose routed layers the sparse
prefill does not route) re-prefill everything through the plain `Engine` and hold no state.
"""
from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
from torch import Tensor, nn

from inference.engine import (
    PAD_ID, Engine, EngineConfig, PaddedPrompts, check_prompts, eval_mode, left_pad, run_generation,
)
from inference.lean import KEY, VALUE, LeanBackend, read_dims, rope_tables, routed, sparse_prefill
from inference.relocate import relocate_keys, rope_layout
from inference.rollout import Completion, Emitted
from inference.sampling import SamplingParams, sample_next

__all__ = ["MODES", "ReuseConfig", "ReusePlan", "ReuseStats", "SessionEngine", "Span", "plan_reuse"]

MODES = ("full", "prefix", "suffix")


@dataclass(frozen=True)
class ReuseConfig:
    """How much of a session's previous K/V a call reuses.

    mode: full = re-prefill everything; prefix = reuse the longest common prefix only (exact up
    to fp rounding); suffix = prefix + relocated spans (approximate). max_spans: most relocated
    blocks per prompt; min_span: shortest equal block considered; reforward: tokens at the end of
    each block forwarded again; min_gain: fewest relocated tokens for the suffix plan to be used;
    relocate=False: suffix planning whose spans are never relocated (the prefix plan: exact mode).
    """

    mode: str = "prefix"
    max_spans: int = 6
    min_span: int = 64
    reforward: int = 16
    min_gain: int = 32
    relocate: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ReuseConfig.mode={self.mode!r} is not one of {', '.join(MODES)}")
        for name, least in (("max_spans", 0), ("min_span", 1), ("reforward", 0), ("min_gain", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ReuseConfig.{name}={value!r} must be an int >= {least}")
        if not isinstance(self.relocate, bool):
            raise ValueError(f"ReuseConfig.relocate={self.relocate!r} must be a bool")


@dataclass(frozen=True)
class Span:
    """Relocated tokens: old[old_start : old_start + length] reused at new_start (tail excluded)."""

    old_start: int
    new_start: int
    length: int


@dataclass
class ReusePlan:
    """One prompt's plan: new[:prefix] reused in place, `spans` relocated, `forward` (ascending
    new-prompt positions) computed; the three partition the prompt."""

    prefix: int
    spans: list[Span]
    forward: list[int]

    def reused(self) -> int:
        return self.prefix + sum(span.length for span in self.spans)


# ----------------------------------------------------------------------------- planning


def plan_reuse(old: Sequence[int], new: Sequence[int], cfg: ReuseConfig) -> ReusePlan:
    """The reuse plan of prompt `new` against the session's stored sequence `old` (module docstring).

    The prefix is the longest common prefix (the diff can split a leading equal run it could have
    matched whole), capped so the last prompt token is always forwarded.
    """
    n = len(new)
    if n == 0:
        raise ValueError("empty prompt: its last token must be forwarded to sample the first new token")
    old, new = list(old), list(new)
    if cfg.mode == "full" or not old:
        return _plan(0, [], n)
    prefix = min(_common_prefix(old, new), n - 1)
    spans: list[Span] = []
    if cfg.mode == "suffix" and cfg.relocate:
        opcodes = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        spans = _spans(opcodes, prefix, n, cfg)
        if sum(span.length for span in spans) < cfg.min_gain:
            spans = []
    return _plan(prefix, spans, n)


def _common_prefix(old: list[int], new: list[int]) -> int:
    n = 0
    for a, b in zip(old, new):
        if a != b:
            break
        n += 1
    return n


def _spans(opcodes, prefix: int, n: int, cfg: ReuseConfig) -> list[Span]:
    """The max_spans largest equal blocks after the prefix (>= min_span tokens), each without its
    last `reforward` tokens and never covering the last prompt token; ordered by new position."""
    blocks = []  # (length, new_start, old_start)
    for tag, i1, i2, j1, j2 in opcodes:
        cut = max(prefix - j1, 0)  # a block reaching into the prefix keeps only its part after it
        if tag == "equal" and j2 - j1 - cut >= cfg.min_span:
            blocks.append((j2 - j1 - cut, j1 + cut, i1 + cut))
    blocks.sort(key=lambda b: (-b[0], b[1]))
    spans = []
    for length, new_start, old_start in blocks[: cfg.max_spans]:
        end = min(new_start + length - cfg.reforward, n - 1)
        if end > new_start:
            spans.append(Span(old_start, new_start, end - new_start))
    return sorted(spans, key=lambda s: s.new_start)


def _plan(prefix: int, spans: list[Span], n: int) -> ReusePlan:
    reused = [False] * n
    reused[:prefix] = [True] * prefix
    for span in spans:
        reused[span.new_start: span.new_start + span.length] = [True] * span.length
    return ReusePlan(prefix, spans, [p for p in range(n) if not reused[p]])


# ----------------------------------------------------------------------------- statistics and state


@dataclass
class ReuseStats:
    """One row of a call: prompt tokens, of them reused in place / relocated / forwarded, and the
    tokens generated. `compute` is what the call paid in forwarded tokens."""

    prompt_tokens: int
    prefix_tokens: int
    relocated_tokens: int
    prefill_tokens: int
    decode_tokens: int
    spans: int

    @property
    def compute(self) -> int:
        return self.prefill_tokens + self.decode_tokens


def _stats(plan: ReusePlan, prompt: Sequence[int], generated: int) -> ReuseStats:
    return ReuseStats(len(prompt), plan.prefix, plan.reused() - plan.prefix, len(plan.forward), generated,
                      len(plan.spans))


@dataclass
class SessionState:
    """What a session keeps between calls: the forwarded tokens and their K/V (L, 2, H_kv, T, D),
    and the stamp of the weights that made them."""

    tokens: tuple[int, ...]
    kv: Tensor
    stamp: tuple


def weights_stamp(model: nn.Module) -> tuple:
    """Changes whenever a parameter is updated in place (optimizer steps, load_state_dict: version
    counters), replaced (storage), or cast; stored K/V are reused only under the same stamp."""
    return tuple((p.data_ptr(), p._version, p.dtype) for p in model.parameters())


# ----------------------------------------------------------------------------- the token-loop strategy


class _ReuseStrategy:
    """One call's prefill from the plans (reused K/V written, the rest sparse-prefilled), then plain
    decoding; each row's K/V are captured when it leaves the live batch or the call ends."""

    def __init__(self, model: nn.Module, batch: PaddedPrompts, new_tokens: int, plans: list[ReusePlan],
                 states: list[SessionState | None], params: SamplingParams, generator, rope):
        P = batch.ids.shape[1]
        self.dims = read_dims(model)
        self.rope = rope
        self.backend = LeanBackend(model, self.dims, rope, len(plans), P + new_tokens)
        self.layout = rope_layout(model) if any(plan.spans for plan in plans) else None
        self.plans, self.states, self.params, self.generator = plans, states, params, generator
        self.offsets = [P - int(n) for n in batch.lengths.tolist()]  # first slot of each row's prompt
        self.live = list(range(len(plans)))  # original row of each live cache row
        self.captured: dict[int, Tensor] = {}

    def prefill(self, batch: PaddedPrompts) -> Tensor:
        P = batch.ids.shape[1]
        cache = self.backend.cache
        # Pad slots are never written; an uninitialised NaN there would reach attention (0 x NaN).
        cache.kv[:, :, :, :, :P].zero_()
        cache.key_ok[:, 0, 0, :P] = batch.valid
        self.backend.padded, self.backend.slot = True, P
        for row, (plan, state) in enumerate(zip(self.plans, self.states)):
            self._write_reused(row, plan, state)
        slots = self._forward_slots(batch.ids.device)  # (B, R)
        x = self.backend.embed(batch.ids.gather(1, slots))  # (B, R, C)
        weights = self.backend.weights
        x = sparse_prefill(x, slots, batch.positions.gather(1, slots), self.backend, range(self.dims.layers),
                           weights, weights, self.rope, self.dims, cache.capacity)
        return self.backend.logits(x[:, -1])  # (B, V): slot P - 1, every row's last prompt token

    def _write_reused(self, row: int, plan: ReusePlan, state: SessionState | None) -> None:
        """The prefix's K/V into the row's first slots; each span's values, and its keys rotated from
        their old positions to the new ones (a row's position = its index in the prompt)."""
        kv, off = self.backend.cache.kv, self.offsets[row]  # (L, 2, B, H_kv, T_max, D)
        if plan.prefix:
            kv[:, :, row, :, off: off + plan.prefix] = state.kv[:, :, :, : plan.prefix]
        for span in plan.spans:
            old = state.kv[:, :, :, span.old_start: span.old_start + span.length]  # (L, 2, H_kv, n, D)
            dst = slice(off + span.new_start, off + span.new_start + span.length)
            kv[:, VALUE, row, :, dst] = old[:, VALUE]
            kv[:, KEY, row, :, dst] = relocate_keys(old[:, KEY], span.old_start, span.new_start, self.layout)

    def _forward_slots(self, device: torch.device) -> Tensor:
        """(B, R) cache slots of each row's forwarded tokens, left-filled with copies of the row's first
        one to a common width (a copy computes and writes what the original does)."""
        rows = [[off + p for p in plan.forward] for off, plan in zip(self.offsets, self.plans)]
        width = max(len(r) for r in rows)
        filled = [[r[0]] * (width - len(r)) + r for r in rows]
        return torch.tensor(filled, dtype=torch.long, device=device)

    def round(self, last: Tensor, positions: Tensor, room) -> Emitted:
        logits = self.backend.decode(last, positions)  # (n, V)
        tokens, logprobs = sample_next(logits, self.params, self.generator)
        return Emitted(tokens[:, None], logprobs[:, None])

    def keep(self, rows: Tensor) -> None:
        kept = set(rows.tolist())
        for i, row in enumerate(self.live):
            if i not in kept:  # the row finished: its K/V leave the cache now
                self.captured[row] = self._row_kv(i, row, self.backend.slot)
        self.live = [self.live[i] for i in rows.tolist()]
        self.backend.keep(rows)

    def finish(self) -> None:
        """Capture the rows still live when the loop ended."""
        for i, row in enumerate(self.live):
            self.captured[row] = self._row_kv(i, row, self.backend.slot)

    def _row_kv(self, i: int, row: int, end: int) -> Tensor:
        return self.backend.cache.kv[:, :, i, :, self.offsets[row]: end].clone()  # (L, 2, H_kv, T, D)

    def teacher_force(self, batch: PaddedPrompts, outputs: list[list[int]]) -> None:
        """Forward outputs[b] but its last token after each prompt (one sparse prefill; short rows'
        tails are masked pads) and capture every row's K/V (no row has left the batch)."""
        P = batch.ids.shape[1]
        forced = [list(out[:-1]) for out in outputs]
        M = max(len(f) for f in forced)
        if M:
            device = batch.ids.device
            ids = torch.tensor([f + [PAD_ID] * (M - len(f)) for f in forced], dtype=torch.long, device=device)
            steps = torch.arange(M, device=device)  # (M,)
            lengths = torch.tensor([len(f) for f in forced], device=device)
            self.backend.cache.key_ok[:, 0, 0, P: P + M] = steps[None] < lengths[:, None]
            slots = (P + steps)[None].expand(len(forced), M)  # (B, M)
            positions = batch.lengths[:, None] + steps[None]  # (B, M)
            weights = self.backend.weights
            sparse_prefill(self.backend.embed(ids), slots, positions, self.backend, range(self.dims.layers),
                           weights, weights, self.rope, self.dims, self.backend.cache.capacity)
        for row, f in enumerate(forced):
            self.captured[row] = self._row_kv(row, row, P + len(f))


# ----------------------------------------------------------------------------- the engine


class SessionEngine:
    """Generation for sessions that call again and again, reusing each session's previous K/V
    (`ReuseConfig`); the same completions, sampling and stop rules as `Engine.generate`.

    stats: one `ReuseStats` per row of the last call. Weights are read from the live model at
    every call; a session whose K/V were made with other weights is re-prefilled.
    """

    def __init__(self, model: nn.Module, reuse: ReuseConfig | None = None, config: EngineConfig | None = None):
        self.model = model
        self.reuse = reuse or ReuseConfig()
        self.config = config or EngineConfig()
        self.engine = Engine(model, self.config)  # full re-prefill, and the fallback
        self.max_seq_len = self.engine.max_seq_len
        self.sessions: dict[Hashable, SessionState] = {}
        self.stats: list[ReuseStats] = []
        self._rope = None

    def __len__(self) -> int:
        return len(self.sessions)

    def end(self, session: Hashable) -> None:
        """Forget a session's state (no error if it holds none)."""
        self.sessions.pop(session, None)

    def clear(self) -> None:
        self.sessions.clear()

    def reusing(self) -> bool:
        """Whether the next call reuses K/V: a reuse mode on a model the lean decoder runs densely."""
        return self.reuse.mode != "full" and self.engine.lean_active() and not routed(self.model)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None,
                 *, sessions: Sequence[Hashable]) -> list[Completion]:
        """Complete every prompt (token ids) of its session (sessions[b]); one Completion per prompt, as
        `Engine.generate` (whose arguments come first, in the same order)."""
        self._check(prompts, sessions)
        if not prompts:
            self.stats = []
            return []
        if not self.reusing():
            outs = self.engine.generate(prompts, params, generator)
            self.stats = [_stats(plan_reuse((), p, self.reuse), p, len(o.tokens)) for p, o in zip(prompts, outs)]
            return outs
        stamp = weights_stamp(self.model)
        plans, states = self._plan(prompts, sessions, stamp)
        made: list[_ReuseStrategy] = []

        def reuse(batch: PaddedPrompts, new_tokens: int) -> _ReuseStrategy:
            made.append(self._strategy(batch, new_tokens, plans, states, params, generator))
            return made[0]

        outs = run_generation([self.model], prompts, params, self.max_seq_len, reuse, generator)
        made[0].finish()
        self._store(sessions, [p + o.tokens[:-1] for p, o in zip(prompts, outs)], made[0].captured, stamp)
        self.stats = [_stats(plan, p, len(o.tokens)) for plan, p, o in zip(plans, prompts, outs)]
        return outs

    @torch.no_grad()
    def replay(self, prompts: list[list[int]], outputs: list[list[int]], sessions: Sequence[Hashable]) -> Tensor:
        """Teacher-forced: each prompt prefilled with its reuse plan (stats as in generate), then
        outputs[b] but its last token forwarded, so each session holds what generate would have left
        had it emitted outputs[b]. -> logits of the token after each prompt, (B, V) fp32."""
        self._check(prompts, sessions)
        if len(outputs) != len(prompts):
            raise ValueError(f"{len(outputs)} outputs for {len(prompts)} prompts")
        if not prompts:
            raise ValueError("no prompts to replay")
        check_prompts([p + o for p, o in zip(prompts, outputs)], self.model.get_input_embeddings().num_embeddings)
        forced = max(max(len(o) - 1, 0) for o in outputs)
        if max(len(p) for p in prompts) + forced > self.max_seq_len:
            raise ValueError(f"prompts + outputs do not fit max_seq_len={self.max_seq_len}")
        if not self.reusing():
            self.stats = [_stats(plan_reuse((), p, self.reuse), p, len(o)) for p, o in zip(prompts, outputs)]
            return self._full_logits(prompts)
        stamp = weights_stamp(self.model)
        plans, states = self._plan(prompts, sessions, stamp)
        with self._inference():
            batch = left_pad(prompts, self._device())
            strategy = self._strategy(batch, forced, plans, states, SamplingParams(), None)
            logits = strategy.prefill(batch).float()  # (B, V)
            strategy.teacher_force(batch, outputs)
        self._store(sessions, [p + o[:-1] for p, o in zip(prompts, outputs)], strategy.captured, stamp)
        self.stats = [_stats(plan, p, len(o)) for plan, p, o in zip(plans, prompts, outputs)]
        return logits

    # -- pieces -----------------------------------------------------------------------------------

    def _check(self, prompts: list[list[int]], sessions: Sequence[Hashable]) -> None:
        if len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts")
        if len(set(sessions)) != len(sessions):
            raise ValueError("a session appears twice in one call (its state could hold only one of them)")
        for row, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {row} is empty")

    def _plan(self, prompts, sessions, stamp: tuple) -> tuple[list[ReusePlan], list[SessionState | None]]:
        states = [self.sessions.get(s) for s in sessions]
        states = [s if s is not None and s.stamp == stamp else None for s in states]  # stale weights: no reuse
        plans = [plan_reuse(s.tokens if s is not None else (), p, self.reuse) for s, p in zip(states, prompts)]
        return plans, states

    def _strategy(self, batch: PaddedPrompts, new_tokens: int, plans, states, params, generator) -> _ReuseStrategy:
        self._rope = rope_tables(self.model, batch.ids.shape[1] + new_tokens, self._rope)
        return _ReuseStrategy(self.model, batch, new_tokens, plans, states, params, generator, self._rope)

    def _store(self, sessions, tokens: list[list[int]], captured: dict[int, Tensor], stamp: tuple) -> None:
        for row, (session, seq) in enumerate(zip(sessions, tokens)):
            kv = captured[row]
            assert kv.shape[3] == len(seq), (kv.shape, len(seq))
            self.sessions[session] = SessionState(tuple(seq), kv, stamp)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def _inference(self):
        with eval_mode(self.model), torch.inference_mode():
            yield

    def _full_logits(self, prompts: list[list[int]]) -> Tensor:
        """The plain engine's prefill of the prompts (lean or HF forward): (B, V) fp32."""
        with self._inference():
            batch = left_pad(prompts, self._device())
            backend = self.engine._backend(batch.ids.shape[0], batch.ids.shape[1])
            return backend.prefill(batch.ids, batch.positions, batch.valid).float()
