"""Speculative decoding on the lean decoder: SEED self-drafting or an external drafter model.

    decoder = SpeculativeDecoder(model, mode="seed", decoder_layers=2)          # self-speculative
    decoder = SpeculativeDecoder(model, mode="external", drafter=small_model)   # separate drafter
    completions = decoder.generate(prompt_ids, SamplingParams(temperature=0.0, ...))
    decoder.stats.mean_accepted   # the last call's tokens emitted per verify forward (the acceptance length)

One round, per live row (x = the last emitted token, at position n, its K/V not yet cached):
  1. Draft d_1..d_m. SEED: the EMBEDDING of x goes straight into the top `decoder_layers` layers
     of the target (skipping the lower ones) at its true position; each of those layers attends to
     the cached full-model K/V of that layer (positions < n) plus the drafter's own K/V of the block
     so far; final norm + lm_head give q_1, d_1 is drawn from it, and so on. External: a separate
     causal LM with its own KV cache over the same tokens feeds x, d_1, ... autoregressively.
     adaptive=True stops after a draft whose top probability is below `confidence` (that draft is
     still proposed, so a round drafts at least one token); adaptive=False drafts `draft_len`.
     Drafts never exceed the row's remaining budget minus one (the correction/bonus token).
  2. Verify: ONE full-model forward on [x, d_1..d_m] at positions n..n+m; target distributions
     p_0..p_m are processed exactly like plain sampling (`sampling.py`, fp32).
     Greedy: accept the longest prefix of drafts equal to argmax p, then emit argmax p at the first
     mismatch (or the bonus argmax p_m). Sampling: accept d_i while U * q(d_i) < p(d_i); at the
     first rejection sample from norm(max(p - q, 0)); if all are accepted sample a bonus from p_m.
  3. The verify forward's K/V of the accepted tokens stays as the cache; the rest is rolled back.

KV rollback with one shared write slot (the lean cache `(L, 2, B, H_kv, T_max, D)`): every row
writes its round at the same slots [s, s + m + 1); rows accept different lengths a_r, so after the
round the write slot moves to s + max_r(a_r + 1) and each row's rejected slots are switched off in
the key mask (`key_ok`). Positions are per row (RoPE is applied before caching), so masked holes
are harmless. When the next round would not fit, `ensure_room` gathers every row's valid slots to
the front (left-padded), so the cache only needs prompt + max_new_tokens + draft_len + 2 slots. In
batch 1 nothing is ever masked: the slot just moves back to the accepted prefix.

SEED drafter K/V is written into the target cache's top layers at the round's slots, which the
verify forward overwrites, so it is discarded for free. On a model with a layer skipper's routes the
draft steps run the top layers dense, as SEED trained them (routed, a router would skip layers of
the drafter it never learned to draft without: 1.97 tokens per verify instead of 3.58 on the compose
benchmark's skipper export); verification runs the model's routes, so the output is still the routed
model's. An external drafter's cache is rolled
back the same way; on full acceptance it has never seen d_m, so d_m is fed to it right after the
verify ("draft-cache sync"; rows that need no sync write a masked dummy slot).

This is a mode of the engine's one token loop (`engine.token_loop`): `SpeculativeMode` is its
`Strategy`, so the preamble, the first token (sampled from the prefill logits), stopping and
dropping finished rows are the Engine's own, and outputs follow it exactly: tokens up to and
including a stop token / stop sequence (also when it completes inside a run of accepted drafts),
never more than max_new_tokens, logprobs = log_softmax(logits / T) over the full vocabulary
(T = 1 greedy). Only models the lean decoder supports can run here (a ValueError names why not).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch
from torch import nn

from inference.artifacts import DRAFTER_DEFAULTS, read_drafter_spec
from inference.engine import OnRound, PaddedPrompts, run_generation
from inference.lean import (
    EAGER, Blocks, LeanBackend, compiled_blocks, dense, lean_unsupported_reason, read_dims, rope_tables,
)
from inference.lowbit import LowBitLinear
from inference.rollout import Completion, Emitted
from inference.sampling import SamplingParams, top_k_filter, top_p_filter
from models.quant import FakeQuantLinear

__all__ = ["SpecStats", "SpeculativeDecoder", "SpeculativeMode", "accept_greedy", "accept_sampled",
           "target_probs"]

MODES = ("seed", "external")


@dataclass
class SpecStats:
    """Counters of one `generate` call. steps counts row-verifies (a batched verify of n live rows
    counts n), so mean_accepted is per row."""

    steps: int = 0  # verify forwards (per live row)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens emitted (after stop / length truncation, prefill token included)
    rounds: int = 0  # draft + verify rounds (a batched round counts once)
    round_seconds: float = 0.0  # wall time inside those rounds (each ends with its one host read)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens produced per verify forward: accepted drafts + 1 correction/bonus."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def mean_round_ms(self) -> float:
        """Mean wall time of a round (draft, verify, rollback) in milliseconds."""
        return 1e3 * self.round_seconds / self.rounds if self.rounds else 0.0

    def add(self, other: "SpecStats") -> None:
        """Sum `other`'s counters into these (a server's totals over its calls)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# ----------------------------------------------------------------------------- acceptance rules


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of `sample_next` (temperature, top-k, top-p) in fp32.

    logits: (..., V) -> probs (..., V). Greedy (T = 0) gives softmax(logits) (used only for the
    drafter's confidence; greedy choices are argmax).
    """
    shape = logits.shape
    flat = logits.float().reshape(-1, shape[-1])  # (N, V)
    if params.greedy:
        return flat.softmax(-1).reshape(shape)
    filtered = top_p_filter(top_k_filter(flat / params.temperature, params.top_k), params.top_p)
    return filtered.softmax(-1).reshape(shape)


def accept_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor):
    """Longest prefix of drafts equal to the target argmax, then the target's next token.

    target_argmax: (n, m + 1); drafts: (n, m); limit: (n,) drafts each row really proposed.
    Returns accepted (n,) in [0, limit] and next token (n,) = target_argmax at `accepted`.
    """
    n, m = drafts.shape
    idx = torch.arange(m, device=drafts.device)
    match = (drafts == target_argmax[:, :m]) & (idx[None, :] < limit[:, None])  # (n, m)
    accepted = match.long().cumprod(-1).sum(-1)  # (n,)
    return accepted, target_argmax.gather(1, accepted[:, None]).squeeze(1)


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor,
                   generator: torch.Generator | None):
    """Lossless rejection rule: the emitted tokens are distributed exactly as under p.

    p: (n, m + 1, V) target probs; q: (n, m, V) drafter probs (d_{i+1} ~ q[:, i]); drafts: (n, m);
    limit: (n,) drafts each row proposed. Accept d_{i+1} while U * q_i(d_{i+1}) < p_i(d_{i+1});
    at the first rejection i sample from norm(max(p_i - q_i, 0)); if all `limit` drafts are
    accepted sample a bonus from p_limit. Returns accepted (n,), next token (n,).
    """
    n, m = drafts.shape
    if m:
        u = torch.rand(n, m, generator=generator, device=p.device)  # (n, m)
        p_d = p[:, :m].gather(-1, drafts[..., None]).squeeze(-1)  # (n, m)
        q_d = q.gather(-1, drafts[..., None]).squeeze(-1)  # (n, m)
        idx = torch.arange(m, device=p.device)
        ok = (u * q_d < p_d) & (idx[None, :] < limit[:, None])  # (n, m)
        accepted = ok.long().cumprod(-1).sum(-1)  # (n,)
    else:
        accepted = torch.zeros(n, dtype=torch.long, device=p.device)
    rows = torch.arange(n, device=p.device)
    dist = p[rows, accepted]  # (n, V)
    rejected = accepted < limit  # (n,)
    if m and bool(rejected.any()):
        q_at = q[rows, accepted.clamp(max=m - 1)]  # (n, V)
        residual = (dist - q_at).clamp(min=0)  # (n, V)
        total = residual.sum(-1, keepdim=True)  # (n, 1)
        # p == q exactly (no residual mass) cannot reject; fall back to p for numerical safety.
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), dist)
        dist = torch.where(rejected[:, None], residual, dist)
    return accepted, torch.multinomial(dist, 1, generator=generator).squeeze(1)


def inexact_reason(model: nn.Module) -> str | None:
    """Why greedy speculative decoding of `model` would not reproduce its plain decoding, or None.
    Linears that quantize their input per token (low-bit schemes with activation bits, stored or
    fake-quant) round every activation: the verify pass over several tokens computes attention in a
    different order than one-token decoding, and its last-bit differences move activations across
    rounding boundaries (3 of 16 greedy rows differed on a W4A8 tiny model). Weight-only schemes
    (W4A16, W8A16) are continuous in the input, as full precision is, and are served."""
    for name, module in model.named_modules():
        if isinstance(module, (LowBitLinear, FakeQuantLinear)) and module.scheme.act_bits is not None:
            return (f"{name} quantizes its input per token ({module.scheme.name}); speculative verification "
                    "rounds those activations differently from one-token decoding (weight-only W4A16 / W8A16 "
                    "serve speculatively)")
    return None


# ----------------------------------------------------------------------------- cache with holes


class MaskedCache:
    """A lean KV cache whose rows may hold rejected (masked-out) slots; see the module docstring."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, blocks: Blocks = EAGER):
        self.dims = read_dims(model)
        self.rope = rope_tables(model, capacity + 1)
        self.lean = LeanBackend(model, self.dims, self.rope, batch, capacity, blocks)  # the route the model needs
        self.cache = self.lean.cache
        self.capacity = capacity
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
        """The Engine's prefill (bit-identical first logits). -> last-position logits (B, V)."""
        logits = self.lean.prefill(ids, positions, valid)
        self.key_ok[:, 0, 0, : ids.shape[1]] = valid
        self.slot = ids.shape[1]
        return logits

    def run(self, x: torch.Tensor, positions: torch.Tensor, layers, start: int, route=None) -> torch.Tensor:
        """Run `layers` on hidden states x (n, T, C) written at slots [start, start + T), through
        `route` (None: the model's own).

        Queries see valid keys before `start` and the block causally. -> hidden (n, T, C).
        """
        n, T, _ = x.shape
        end = start + T
        self.key_ok[:n, :, :, start:end] = True
        mask = self.key_ok[:n, :, :, :end]  # (n, 1, 1, end)
        if T > 1:
            keys = torch.arange(end, device=x.device)
            causal = keys[None, :] <= start + torch.arange(T, device=x.device)[:, None]  # (T, end)
            mask = mask & causal  # (n, 1, T, end)
        return self.lean.run(x, positions, layers, start, mask, route)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lean.embed(ids)  # (n, T, C)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., C) -> logits (..., V) in the model dtype."""
        return self.lean.logits(hidden)

    def commit(self, start: int, valid: torch.Tensor, keep: int | None = None) -> None:
        """Keep the first valid[r] slots of the block written at `start`; mask the rest out. `keep`:
        max(valid) when the caller already read it to the host (no second device sync)."""
        if keep is None:
            keep = int(valid.max()) if valid.numel() else 0
        end = start + keep
        if keep:
            slots = torch.arange(start, end, device=valid.device)
            self.key_ok[: self.n, 0, 0, start:end] = slots[None, :] < (start + valid)[:, None]
        self.slot = end

    def ensure_room(self, needed: int) -> None:
        """Compact (gather each row's valid slots to the front) when `needed` slots do not fit."""
        if self.slot + needed <= self.capacity:
            return
        n, S = self.n, self.slot
        ok = self.key_ok[:n, 0, 0, :S]  # (n, S)
        kept = int(ok.sum(-1).max())
        # Stable sort puts each row's masked slots first and its valid slots after, in order.
        order = torch.sort(ok.to(torch.uint8), dim=-1, stable=True).indices[:, S - kept:]  # (n, kept)
        self.cache.gather_slots(order, S)
        self.slot = kept
        if self.slot + needed > self.capacity:
            raise RuntimeError("speculative KV cache overflow; this is a bug in its sizing")

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the live batch, moved to the front in order."""
        self.cache.keep(rows, self.slot)


# ----------------------------------------------------------------------------- the decoder


class SpeculativeDecoder:
    """Lossless speculative generation over a live HF causal LM (lean-decoder architectures).

    mode "seed": self-speculative SEED drafting with the top `decoder_layers` layers of `model`;
    mode "external": `drafter` is a separate small causal LM sharing the tokenizer / vocab.
    adaptive=True: a row stops drafting after a draft whose top probability < confidence (at most
    draft_len drafts); adaptive=False: always draft_len drafts (budget permitting).
    Defaults are the SEED export's (`artifacts.DRAFTER_DEFAULTS`).
    """

    def __init__(self, model: nn.Module, *, mode: str = "seed",
                 decoder_layers: int = DRAFTER_DEFAULTS.decoder_layers, drafter=None,
                 draft_len: int = DRAFTER_DEFAULTS.draft_len, confidence: float = DRAFTER_DEFAULTS.confidence,
                 adaptive: bool = DRAFTER_DEFAULTS.adaptive, max_seq_len: int | None = None,
                 compile: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if draft_len < 1:
            raise ValueError(f"draft_len must be >= 1, got {draft_len}")
        if not 0.0 <= confidence <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {confidence}")
        layers = model.config.num_hidden_layers
        if mode == "seed" and not 1 <= decoder_layers <= layers:
            raise ValueError(f"decoder_layers must be in [1, {layers}], got {decoder_layers}")
        if mode == "external" and drafter is None:
            raise ValueError("mode 'external' needs a drafter model")
        self.model, self.mode, self.drafter = model, mode, drafter if mode == "external" else None
        self.decoder_layers, self.draft_len = decoder_layers, draft_len
        self.confidence, self.adaptive = confidence, adaptive
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        # compile: the cache-free halves of every layer torch.compile'd, in draft steps and verification
        # alike (as EngineConfig.compile does for plain decoding); built once per decoder
        self.blocks = compiled_blocks() if compile else EAGER
        self.stats = SpecStats()  # the last generate call's counts
        self._check()

    @classmethod
    def from_pretrained_dir(cls, model: nn.Module, path, **overrides) -> "SpeculativeDecoder":
        """SEED decoder configured by `path/seed_drafter.json` when present, else the defaults.

        Keys: decoder_layers, draft_len, confidence, adaptive (block_size is the training block
        and is used as draft_len when draft_len is absent); keyword overrides win.
        """
        spec = read_drafter_spec(path)
        kwargs = {"decoder_layers": spec.decoder_layers, "draft_len": spec.draft_len,
                  "confidence": spec.confidence, "adaptive": spec.adaptive}
        return cls(model, mode="seed", **{**kwargs, **overrides})

    def _check(self) -> None:
        for role, module in (("model", self.model), ("drafter", self.drafter)):
            if module is None:
                continue
            reason = lean_unsupported_reason(module) or inexact_reason(module)
            if reason is not None:
                raise ValueError(f"speculative decoding cannot run the {role} exactly: {reason}")
        if self.drafter is not None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            drafter_vocab = self.drafter.get_output_embeddings().weight.shape[0]
            if vocab != drafter_vocab:
                raise ValueError(f"drafter vocab {drafter_vocab} != model vocab {vocab}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None, *, on_round: OnRound | None = None) -> list[Completion]:
        """Complete every prompt (token ids): one Completion per prompt, in order, as `Engine.generate`.
        This call's counts are in `self.stats` afterwards."""
        stats = self.stats = SpecStats()
        if prompts:
            self._check()  # at every call, like the Engine's lean check: model surgery is seen
        models = [self.model] if self.drafter is None else [self.model, self.drafter]

        def mode(batch: PaddedPrompts, new_tokens: int) -> SpeculativeMode:
            return SpeculativeMode(self, batch, params, new_tokens, generator, stats)

        completions = run_generation(models, prompts, params, self.max_seq_len, mode, generator, on_round)
        stats.emitted = sum(len(c.tokens) for c in completions)
        return completions


class SpeculativeMode:
    """The speculative mode of the engine's token loop, for one `generate` call: its caches and
    the draft / verify round (the loop does the prefill sampling, stopping and row dropping)."""

    def __init__(self, spec: SpeculativeDecoder, batch: PaddedPrompts, params: SamplingParams,
                 new_tokens: int, generator, stats: SpecStats | None = None):
        self.spec, self.params, self.generator = spec, params, generator
        self.device = batch.ids.device
        B, P = batch.ids.shape
        # Room for every row's valid tokens plus one round in flight (and a drafter sync slot).
        capacity = P + new_tokens + spec.draft_len + 2
        self.target = MaskedCache(spec.model, B, capacity, spec.blocks)
        self.draft_cache = MaskedCache(spec.drafter, B, capacity, spec.blocks) if spec.drafter is not None else None
        L = self.target.dims.layers
        self.top_layers = range(L - spec.decoder_layers, L)
        self.all_layers = range(L)
        self.stats = stats if stats is not None else SpecStats()
        # The confidence rule stops drafting once no row is confident: a host read per draft step. On
        # the CPU that read is one more op, and the draft steps it saves are the cost that counts; on
        # an accelerator a read stalls the queue, so every round drafts its K steps and the rule only
        # sets which drafts are proposed (`limit`): the same proposals and greedy outputs, one read per
        # round (sampled drafts past the stop draw from the generator, so sampled outputs keep their
        # law, not their exact tokens).
        self.stop_early = spec.adaptive and self.device.type == "cpu"

    def _caches(self) -> list[MaskedCache]:
        return [self.target] if self.draft_cache is None else [self.target, self.draft_cache]

    def prefill(self, batch: PaddedPrompts) -> torch.Tensor:
        """Both caches take the prompts; -> the target's last-position logits (B, V)."""
        logits = self.target.prefill(batch.ids, batch.positions, batch.valid)  # (B, V)
        if self.draft_cache is not None:
            self.draft_cache.prefill(batch.ids, batch.positions, batch.valid)
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        for cache in self._caches():
            cache.keep(rows)

    def round(self, x: torch.Tensor, pos: torch.Tensor, room: torch.Tensor | int) -> Emitted:
        """Draft, verify [x, d_1..d_m] in one forward, roll the caches back to what was accepted.
        x, pos: (n,) last emitted token and its position. -> accepted drafts + the next token."""
        started = time.perf_counter()
        spec, params = self.spec, self.params
        n = x.shape[0]
        remaining = room if isinstance(room, torch.Tensor) else torch.full_like(x, room)  # (n,) >= 1
        cap = (remaining - 1).clamp(max=spec.draft_len)  # (n,) drafts allowed per row
        K = int(cap.max())
        for cache in self._caches():
            cache.ensure_room(K + 1)
        drafts, limit, qs = self._draft(x, pos, cap, K)  # (n, m), (n,), (n, m, V) | None
        m = drafts.shape[1]

        # Verify: one full forward on [x, d_1..d_m] at positions pos..pos+m.
        ids = torch.cat([x[:, None], drafts], 1)  # (n, m + 1)
        positions = pos[:, None] + torch.arange(m + 1, device=self.device)  # (n, m + 1)
        start = self.target.slot
        hidden = self.target.run(self.target.embed(ids), positions, self.all_layers, start)
        logits = self.target.logits(hidden).float()  # (n, m + 1, V)
        if params.greedy:
            accepted, nxt = accept_greedy(logits.argmax(-1), drafts, limit)
            logp = logits.log_softmax(-1)
        else:
            p = target_probs(logits, params)  # (n, m + 1, V)
            accepted, nxt = accept_sampled(p, qs, drafts, limit, self.generator)
            logp = (logits / params.temperature).log_softmax(-1)
        # one host read for the round's bookkeeping: the longest acceptance (the cache's new end) and the counts
        most, total_accepted, total_drafted = torch.stack([accepted.max(), accepted.sum(), limit.sum()]).tolist()
        self.target.commit(start, accepted + 1, most + 1)
        if self.draft_cache is not None:
            self._sync_drafter(ids, positions, accepted, m)

        emitted = torch.cat([drafts, nxt[:, None]], 1)  # (n, m + 1); row r emits [:a_r] + nxt
        emitted.scatter_(1, accepted[:, None], nxt[:, None])
        lp = logp.gather(-1, emitted[..., None]).squeeze(-1)  # (n, m + 1)
        self.stats.steps += n
        self.stats.drafted += total_drafted
        self.stats.accepted += total_accepted
        self.stats.rounds += 1
        self.stats.round_seconds += time.perf_counter() - started  # after the round's host read
        return Emitted(emitted, lp, accepted + 1)

    def _draft(self, x, pos, cap, K):
        """Draft up to K tokens for every live row (rows past their own limit keep drafting while
        any row is active; their extra drafts are never accepted).

        -> drafts (n, m), limit (n,) drafts each row proposed, q (n, m, V) fp32 (None if greedy).
        """
        spec, params = self.spec, self.params
        n = x.shape[0]
        active = cap > 0  # (n,)
        limit = torch.zeros(n, dtype=torch.long, device=self.device)
        drafts, qs = [], []
        token = x
        base = (self.draft_cache or self.target).slot
        for j in range(K):
            # without the confidence rule every row drafts min(cap, K) tokens, known on the host: no read
            if self.stop_early and not bool(active.any()):
                break
            logits = self._draft_logits(token, pos + j, base + j).float()  # (n, V)
            if params.greedy:  # the argmax; the distribution only for the confidence rule
                token = logits.argmax(-1)
                top = (logits.max(-1).values - logits.logsumexp(-1)).exp() if spec.adaptive else None  # (n,)
            else:
                q = target_probs(logits, params)  # (n, V)
                token = torch.multinomial(q, 1, generator=self.generator).squeeze(1)
                qs.append(q)
                top = q.max(-1).values
            drafts.append(token)
            limit += active.long()
            more = j + 1 < cap
            if spec.adaptive:
                more &= top >= spec.confidence
            active &= more
        m = len(drafts)
        draft_ids = torch.stack(drafts, 1) if m else x.new_zeros(n, 0)
        q = torch.stack(qs, 1) if m and not params.greedy else None
        return draft_ids, limit, q

    def _draft_logits(self, token, positions, slot):
        """One drafting step for token (n,) at positions (n,), written at cache slot `slot`."""
        if self.draft_cache is not None:
            cache, layers, route = self.draft_cache, range(self.draft_cache.dims.layers), None
        else:  # SEED: the token embedding straight into the top layers of the target, dense (see the docstring)
            cache, layers, route = self.target, self.top_layers, dense
        hidden = cache.run(cache.embed(token[:, None]), positions[:, None], layers, slot, route)
        return cache.logits(hidden[:, 0])

    def _sync_drafter(self, ids, positions, accepted, m):
        """Roll the drafter back to x, d_1..d_a; feed d_m (ids[:, m]) to rows that accepted all."""
        cache = self.draft_cache
        start = cache.slot
        cache.commit(start, (accepted + 1).clamp(max=m))
        need = accepted == m  # (n,)
        if not bool(need.any()):
            return
        start = cache.slot
        cache.run(cache.embed(ids[:, m:]), positions[:, m:], range(cache.dims.layers), start)
        cache.commit(start, need.long())


# The name tests/algorithms/test_seed.py patches (`_Run._draft`, `_Run._draft_logits`).
_Run = SpeculativeMode
