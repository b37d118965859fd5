"""The HiLoRe planner: pure arithmetic on per-unit measurements (no torch, no model), so a plan can be
computed, tested and reasoned about from numbers alone.

A :class:`Profile` holds per-token figures of every recovery unit (measured by
``trainer.activations.manager``); :func:`estimate` gives a plan's peak memory, risk and time cost,
:func:`plan_units` chooses the treatment of every unit under the memory and risk budgets.

Peak-memory model (bytes, N tokens in the micro-batch). stored_l = N * {full_l, comp_l, in_l} for
{full, compress, recompute}. Backward visits units L-1 .. 0; while unit l is processed, units > l are
freed and unit l adds a transient: recompute -> its saved tensors minus its (already stored) input,
compress -> its largest tensor being dequantised, full -> 0 (each plus ``N * bwd_bytes``, the
gradients of its activations, when the profile gives them: trainer/memory.py does). Non-unit activations (the logits / head
part) add ``N * head_bytes_per_token`` throughout (default: vocab * (dtype bytes + 4): one logits
row in the model dtype and one fp32 log-softmax row per token). Parameter gradients are counted in
two scenarios -- allocated as backward reaches each unit (no gradient held yet: a step's first
micro-batch) and all present (a later micro-batch, accumulating) -- and the manager plans each
micro-batch for the scenario that holds for it (checked from the parameters' .grad), so a step's
later micro-batches may get a leaner plan than its first::

    peak = static + max( sum_l stored_l + head,                                  # end of forward
                         max_l [ sum_{j<=l} stored_j + transient_l + head + grads(l) ] )   # backward of l

where static = parameters + optimizer state (``optimizer_bytes_per_param`` per trainable element,
AdamW 8), resident throughout: the budget is relative to the whole actor-update peak, the figure a
device reports as its max-allocated memory (``optimizer_bytes_per_param=0`` budgets activations and
gradients alone).

The full-checkpointing peak is the same formula with every unit ``recompute``. The planner starts
The full-checkpointing peak is the same formula with every unit ``recompute``. The planner starts
from all-recompute and greedily applies the upgrade (recompute -> compress, recompute -> full,
compress -> full) with the best estimated time saved per byte of peak added, while
``peak <= memory_budget * checkpointing_peak`` (in both gradient scenarios) and
``risk <= risk_budget``. Estimated step-time cost of a plan: recompute costs the unit's forward time,
compress its compression + decompression time, full nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

FULL, COMPRESS, RECOMPUTE = "full", "compress", "recompute"
TREATMENTS = (FULL, COMPRESS, RECOMPUTE)


@dataclass
class UnitProfile:
    """Per-token measurements of one recovery unit (bytes/token, seconds/token)."""

    in_bytes: float  # unit input hidden state (what checkpointing keeps)
    full_bytes: float  # saved tensors in full precision (distinct storages)
    comp_bytes: float  # what the compress hooks keep (codes + scales + tensors kept as they are)
    max_tensor_bytes: float  # largest single compressible saved tensor (dequantisation transient)
    input_saved: bool  # the unit input is among its saved tensors
    fwd_s: float  # forward (= recompute) time
    comp_s: float  # compression + decompression time
    err: float  # relative compression error over the compressed tensors
    grad_bytes: float = 0.0  # absolute: gradient bytes of the unit's trainable parameters
    # backward transient of the unit whatever its treatment (gradients of its activations); the manager's
    # profile leaves it 0 (its budgets are relative), the pre-flight memory check (trainer/memory.py) sets it
    bwd_bytes: float = 0.0


@dataclass
class Profile:
    units: list[UnitProfile]
    head_bytes_per_token: float = 0.0
    other_grad_bytes: float = 0.0  # absolute: trainable parameters outside the units
    static_bytes: float = 0.0  # absolute: parameters + optimizer state, resident throughout the update


@dataclass
class PlanEstimate:
    plan: list[str]
    tokens: int
    exposure: float
    peak: float  # estimated peak activation bytes (max over the gradient scenarios of plan/GC ratio)
    checkpoint_peak: float
    ratio: float  # max over scenarios of peak / checkpointing peak
    risk: float
    time_s: float  # estimated added time (recompute + compress costs)
    checkpoint_time_s: float
    stored_bytes: float  # sum of stored bytes at the end of the forward (units only)


def _peaks(prof: Profile, plan: list[str], tokens: int) -> list[float]:
    """Estimated peak for each gradient scenario (fresh, accumulated); see the module docstring."""
    n = float(tokens)
    head = n * prof.head_bytes_per_token
    stored, trans = [], []
    for u, t in zip(prof.units, plan):
        if t == FULL:
            stored.append(n * u.full_bytes)
            trans.append(n * u.bwd_bytes)
        elif t == COMPRESS:
            stored.append(n * u.comp_bytes)
            trans.append(n * (u.max_tensor_bytes + u.bwd_bytes))
        else:
            stored.append(n * u.in_bytes)
            trans.append(n * (u.full_bytes - (u.in_bytes if u.input_saved else 0.0) + u.bwd_bytes))
    grads = [u.grad_bytes for u in prof.units]
    total_grads = sum(grads) + prof.other_grad_bytes
    fwd_end = sum(stored) + head + prof.static_bytes
    out = []
    for fresh in (True, False):
        peak = fwd_end + (0.0 if fresh else total_grads)
        prefix = list(_accumulate(stored))
        suffix_grads = 0.0
        for l in range(len(stored) - 1, -1, -1):
            suffix_grads += grads[l]
            g = prof.other_grad_bytes + suffix_grads if fresh else total_grads
            peak = max(peak, prefix[l] + trans[l] + head + g + prof.static_bytes)
        out.append(peak)
    return out


def _accumulate(xs):
    s = 0.0
    for x in xs:
        s += x
        yield s


def _cost(prof: Profile, plan: list[str], tokens: int) -> float:
    c = 0.0
    for u, t in zip(prof.units, plan):
        c += u.fwd_s if t == RECOMPUTE else u.comp_s if t == COMPRESS else 0.0
    return c * tokens


def _risk(prof: Profile, plan: list[str], exposure: float) -> float:
    return sum(u.err * exposure for u, t in zip(prof.units, plan) if t == COMPRESS)


FRESH, ACCUMULATED = 0, 1  # gradient scenarios of _peaks: grads allocated during backward / present from the start


def estimate(prof: Profile, plan: list[str], tokens: int, exposure: float,
             scenarios: tuple[int, ...] = (FRESH, ACCUMULATED)) -> PlanEstimate:
    gc = [RECOMPUTE] * len(prof.units)
    peaks, gc_peaks = _peaks(prof, plan, tokens), _peaks(prof, gc, tokens)
    ratio = max(peaks[i] / max(gc_peaks[i], 1.0) for i in scenarios)
    worst = max(scenarios, key=lambda i: peaks[i] / max(gc_peaks[i], 1.0))
    n = float(tokens)
    stored = sum(n * (u.full_bytes if t == FULL else u.comp_bytes if t == COMPRESS else u.in_bytes)
                 for u, t in zip(prof.units, plan))
    return PlanEstimate(list(plan), tokens, exposure, peaks[worst], gc_peaks[worst], ratio,
                        _risk(prof, plan, exposure), _cost(prof, plan, tokens), _cost(prof, gc, tokens), stored)


def plan_units(prof: Profile, tokens: int, exposure: float, memory_budget: float, risk_budget: float,
               scenarios: tuple[int, ...] = (FRESH, ACCUMULATED)) -> PlanEstimate:
    """Plan for a micro-batch of `tokens` tokens at exposure `exposure`.

    Greedy with a few starts: from all-recompute (the checkpointing plan), from all-compress and from
    the longest all-compress prefix / suffix that fit, apply the upgrade (recompute -> compress,
    recompute -> full, compress -> full) with the best estimated time saved per byte of peak added,
    while the peak stays within `memory_budget` x the checkpointing peak (both gradient scenarios) and
    the risk within `risk_budget`. The cheapest plan found wins. `scenarios`: the gradient scenarios
    the plan must fit (the manager passes the one that holds for the micro-batch: FRESH when no
    gradient exists yet, as on a step's first micro-batch, ACCUMULATED otherwise)."""
    n = len(prof.units)
    gc_peaks = _peaks(prof, [RECOMPUTE] * n, tokens)
    limits = [memory_budget * g * (1 + 1e-9) if i in scenarios else math.inf for i, g in enumerate(gc_peaks)]

    def feasible(plan: list[str]) -> bool:
        return (_risk(prof, plan, exposure) <= risk_budget + 1e-12
                and all(p <= lim for p, lim in zip(_peaks(prof, plan, tokens), limits)))

    starts = [[RECOMPUTE] * n]
    for k in range(n, 0, -1):  # longest compressed prefix that fits (backward frees from the top)
        if feasible([COMPRESS] * k + [RECOMPUTE] * (n - k)):
            starts.append([COMPRESS] * k + [RECOMPUTE] * (n - k))
            break
    for k in range(n, 0, -1):
        if feasible([RECOMPUTE] * (n - k) + [COMPRESS] * k):
            starts.append([RECOMPUTE] * (n - k) + [COMPRESS] * k)
            break
    best = None
    for start in starts:
        plan = _greedy(prof, start, tokens, exposure, limits, risk_budget)
        cost = _cost(prof, plan, tokens)
        if best is None or cost < best[0] - 1e-15:
            best = (cost, plan)
    return estimate(prof, best[1], tokens, exposure, scenarios)


def _greedy(prof: Profile, plan: list[str], tokens: int, exposure: float, limits: list[float],
            risk_budget: float) -> list[str]:
    plan = list(plan)
    cur_peaks = _peaks(prof, plan, tokens)
    risk = _risk(prof, plan, exposure)
    upgrades = {RECOMPUTE: (COMPRESS, FULL), COMPRESS: (FULL,), FULL: ()}
    while True:
        best, best_key = None, None
        for l, u in enumerate(prof.units):
            for new in upgrades[plan[l]]:
                old_cost = u.fwd_s if plan[l] == RECOMPUTE else u.comp_s
                new_cost = u.comp_s if new == COMPRESS else 0.0
                saved = (old_cost - new_cost) * tokens
                if saved <= 0:
                    continue
                d_risk = (u.err * exposure if new == COMPRESS else 0.0) - (
                    u.err * exposure if plan[l] == COMPRESS else 0.0)
                if risk + d_risk > risk_budget + 1e-12:
                    continue
                trial = plan.copy()
                trial[l] = new
                peaks = _peaks(prof, trial, tokens)
                if any(p > lim for p, lim in zip(peaks, limits)):
                    continue
                added = max(max(p - c for p, c in zip(peaks, cur_peaks)), 0.0)
                key = (added <= 0.0, saved / (added + 1.0), saved)
                if best_key is None or key > best_key:
                    best, best_key = (l, new, peaks, d_risk), key
        if best is None:
            return plan
        l, new, peaks, d_risk = best
        plan[l] = new
        cur_peaks = peaks
        risk += d_risk
