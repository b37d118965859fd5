"""HiLoRe: activation management for the actor update (full / compressed / recomputed recovery units).

Each decoder layer of the causal LM is a *recovery unit*. Its saved activations get one of three
treatments, chosen per micro-batch:

- ``full``: normal autograd (saved tensors kept as they are);
- ``compress``: saved tensors stored compressed through ``torch.autograd.graph.saved_tensors_hooks``
  (per-group symmetric int8 -- or fp8 e4m3 -- with one fp32 scale per group of ``group_size``
  consecutive elements, i.e. groups along the last dim when it is a multiple of the group size);
- ``recompute``: non-reentrant ``torch.utils.checkpoint`` of the layer forward with the RNG state
  preserved (exact gradients, dropout included).

Mode ``checkpoint`` recomputes every unit (the gradient-checkpointing baseline). Mode ``hilore`` plans.

Exposure. Before each micro-batch the trainer calls ``set_exposure(coef)`` with the per-token
``|dL/dlogp_t|`` coefficients of the GRPO loss, (B, T), known before backward (|A_b| * rho_t on
unclipped tokens, 0 on clipped tokens, on A = 0 rows and on padding), or None (uniform: every token 1).
The micro-batch exposure is the mean per-token coefficient::

    E = sum(|coef|) / coef.numel()        (None -> E = 1; all advantages 0 -> E = 0)

so uniform exposure is 1, a GRPO batch with unit-variance advantages is about mean|A| (~0.8), and
zero-coefficient samples and padding expose nothing.

Risk. Profiling measures per unit the relative compression error of its saved tensors
``err_l = sqrt(sum ||x - deq(q(x))||^2 / sum ||x||^2)`` (over the tensors that get compressed).
The risk of compressing unit l is ``err_l * E``; a plan's risk is the sum over its compressed units.
It reads as a first-order bound on the relative error that compression adds to the micro-batch's
gradient (per-unit relative perturbations add up along the backward pass). The default risk budget
0.05 therefore allows about 5% relative gradient perturbation (gradient cosine >= ~0.998). With
E = 0 every plan has risk 0: compression is then only limited by memory and time.

Profiling. The first grad-enabled micro-batch after ``install`` / ``replan`` (``profile_steps`` of
them) runs every unit as ``recompute`` -- exact gradients, checkpointing memory -- and, per unit, also
builds a throw-away autograd graph of the unit on a detached copy of its input, under counting hooks:
full-precision saved bytes (distinct storages), bytes once compressed (what the compress hooks keep),
the largest single saved tensor, whether the unit input itself is saved, the (de)compression time and
the relative compression error. The recompute cost is the measured time of the checkpointed forward.
All byte and time figures are stored per token, so a plan is valid for any micro-batch length.

Peak-memory model (bytes, N tokens in the micro-batch). stored_l = N * {full_l, comp_l, in_l} for
{full, compress, recompute}. Backward visits units L-1 .. 0; while unit l is processed, units > l are
freed and unit l adds a transient: recompute -> its saved tensors minus its (already stored) input,
compress -> its largest tensor being dequantised, full -> 0. Non-unit activations (the logits / head
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
from all-recompute and greedily applies the upgrade (recompute -> compress, recompute -> full,
compress -> full) with the best estimated time saved per byte of peak added, while
``peak <= memory_budget * checkpointing_peak`` (in both gradient scenarios) and
``risk <= risk_budget``. Estimated step-time cost of a plan: recompute costs the unit's forward time,
compress its compression + decompression time, full nothing. It re-plans when the token count of the
micro-batch changes or the exposure moves by more than ``replan_tolerance`` (absolute, in units of
E) from the exposure the plan was made for.
"""
from __future__ import annotations

import functools
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

FULL, COMPRESS, RECOMPUTE = "full", "compress", "recompute"
TREATMENTS = (FULL, COMPRESS, RECOMPUTE)
MODES = ("none", "checkpoint", "hilore")
COMPRESSIONS = ("int8", "fp8")


@dataclass
class ActivationConfig:
    mode: str = "none"  # none | checkpoint | hilore
    memory_budget: float = 1.10  # x the full-checkpointing peak (estimated, see the module docstring)
    # Sum over compressed units of (relative compression error x exposure): ~ relative gradient
    # perturbation allowed per micro-batch. 0.05 keeps the gradient cosine above ~0.998.
    risk_budget: float = 0.05
    compress: str = "int8"  # int8 | fp8 (torch.float8_e4m3fn)
    group_size: int = 64
    stochastic_rounding: bool = False
    replan_tolerance: float = 0.1  # |E - E_plan| that triggers a re-plan (E in [0, ~1+])
    min_numel: int = 4096  # smaller saved tensors are kept as they are
    profile_steps: int = 1  # grad-enabled micro-batches profiled (times: minimum over them)
    seed: int = 0  # stochastic-rounding generator seed
    fused_kernels: bool = False  # torch.compile the (de)quantisation kernels (one-off compile cost)
    head_bytes_per_token: Optional[float] = None  # non-unit activation bytes per token (None: estimate)
    # Resident during the update besides activations and gradients, so part of the peak the budget is
    # relative to (as a device's max-allocated figure is): the parameters plus this many optimizer-state
    # bytes per trainable parameter element (AdamW: two fp32 moments = 8; 0 to budget activations alone).
    optimizer_bytes_per_param: float = 8.0

    def validate(self) -> "ActivationConfig":
        if self.mode not in MODES:
            raise ValueError(f"trainer.activations={self.mode!r} must be one of {', '.join(MODES)}")
        if not (isinstance(self.memory_budget, (int, float)) and math.isfinite(self.memory_budget)
                and self.memory_budget >= 1.0):
            raise ValueError(f"trainer.activation_memory_budget={self.memory_budget} must be >= 1.0")
        if not (isinstance(self.risk_budget, (int, float)) and math.isfinite(self.risk_budget)
                and self.risk_budget >= 0.0):
            raise ValueError(f"trainer.activation_risk_budget={self.risk_budget} must be >= 0")
        if self.compress not in COMPRESSIONS:
            raise ValueError(f"trainer.activation_compress={self.compress!r} must be one of {', '.join(COMPRESSIONS)}")
        if self.compress == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("trainer.activation_compress=fp8 needs torch.float8_e4m3fn (not in this torch)")
        if not (isinstance(self.group_size, int) and self.group_size >= 1):
            raise ValueError(f"trainer.activation_group_size={self.group_size} must be an integer >= 1")
        if not self.replan_tolerance >= 0:
            raise ValueError(f"trainer.activation_replan_tolerance={self.replan_tolerance} must be >= 0")
        if not (isinstance(self.profile_steps, int) and self.profile_steps >= 1):
            raise ValueError(f"trainer.activation_profile_steps={self.profile_steps} must be an integer >= 1")
        if not self.optimizer_bytes_per_param >= 0:
            raise ValueError(f"trainer.activation_optimizer_bytes_per_param={self.optimizer_bytes_per_param} "
                             "must be >= 0")
        if self.head_bytes_per_token is not None and not self.head_bytes_per_token >= 0:
            raise ValueError(f"trainer.activation_head_bytes_per_token={self.head_bytes_per_token} must be >= 0")
        return self


# --------------------------------------------------------------------------------------------------
# Compression
# --------------------------------------------------------------------------------------------------

class Packed:
    """A compressed saved tensor: codes (groups, group_size), fp32 scale per group, original meta."""

    __slots__ = ("codes", "scale", "shape", "dtype", "numel")

    def __init__(self, codes: Tensor, scale: Tensor, shape: torch.Size, dtype: torch.dtype, numel: int):
        self.codes, self.scale, self.shape, self.dtype, self.numel = codes, scale, shape, dtype, numel

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()


def _qmax(kind: str) -> float:
    return 127.0 if kind == "int8" else 448.0


def _quantize_int8(x2: Tensor, qmax: float) -> tuple[Tensor, Tensor]:
    scale = x2.abs().amax(1, keepdim=True).clamp_min(1e-30) / qmax
    return torch.round(x2 / scale).to(torch.int8), scale.squeeze(1)


def _quantize_fp8(x2: Tensor, qmax: float) -> tuple[Tensor, Tensor]:
    scale = x2.abs().amax(1, keepdim=True).clamp_min(1e-30) / qmax
    return (x2 / scale).to(torch.float8_e4m3fn), scale.squeeze(1)


def _dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    return codes.float() * scale[:, None]


_COMPILED: dict[str, Callable] = {}


def _kernel(name: str, fn: Callable, fused: bool) -> Callable:
    if not fused:
        return fn
    if name not in _COMPILED:
        try:
            _COMPILED[name] = torch.compile(fn, dynamic=True)
        except Exception:  # no compiler backend: eager fallback, same results
            _COMPILED[name] = fn
    return _COMPILED[name]


class Quantizer:
    """Per-group symmetric quantiser (int8 codes or fp8 e4m3 values) with an fp32 scale per group.

    Groups are ``group_size`` consecutive elements of the flattened tensor (= groups along the last
    dim when its size is a multiple of the group size; otherwise the tail is zero-padded). int8:
    ``scale = amax / 127``, ``code = round(x / scale)`` (nearest, or stochastic with a seeded
    generator), so the round-trip error is at most ``scale / 2`` per element."""

    def __init__(self, kind: str = "int8", group_size: int = 64, stochastic: bool = False, seed: int = 0,
                 fused: bool = False):
        self.kind, self.group_size, self.stochastic, self.seed = kind, group_size, stochastic, seed
        self.qmax = _qmax(kind)
        self._generators: dict[torch.device, torch.Generator] = {}
        quant = _quantize_int8 if kind == "int8" else _quantize_fp8
        self._quant = _kernel(f"q_{kind}", quant, fused)
        self._dequant = _kernel("dq", _dequantize, fused)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def pack(self, x: Tensor) -> Packed:
        gs, n = self.group_size, x.numel()
        flat = x.detach().reshape(-1)
        if n % gs:
            flat = torch.cat([flat, flat.new_zeros(gs - n % gs)])
        x2 = flat.view(-1, gs)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if self.stochastic:
            scale = x2.abs().amax(1, keepdim=True).clamp_min(1e-30) / self.qmax
            y = x2 / scale
            if self.kind == "int8":
                noise = torch.rand(y.shape, generator=self._generator(y.device), device=y.device)
                codes = torch.floor(y + noise).clamp_(-self.qmax, self.qmax).to(torch.int8)
            else:
                codes = _fp8_stochastic(y, self._generator(y.device))
            return Packed(codes, scale.squeeze(1), x.shape, x.dtype, n)
        codes, scale = self._quant(x2, self.qmax)
        return Packed(codes, scale, x.shape, x.dtype, n)

    @torch.no_grad()
    def unpack(self, p: Packed) -> Tensor:
        out = self._dequant(p.codes, p.scale).reshape(-1)
        if out.numel() != p.numel:
            out = out[: p.numel]
        return out.to(p.dtype).view(p.shape)


def _fp8_stochastic(y: Tensor, gen: torch.Generator) -> Tensor:
    """Stochastic rounding to e4m3: pick one of the two neighbouring representable values."""
    lo = y.to(torch.float8_e4m3fn).float()
    # the neighbour on the other side of y
    step = torch.where(lo == 0, torch.full_like(lo, 2.0 ** -9), lo.abs() * 2.0 ** -3)
    other = torch.where(y >= lo, lo + step, lo - step).clamp_(-448.0, 448.0)
    width = (other - lo).abs().clamp_min(1e-30)
    p_other = ((y - lo).abs() / width).clamp_(0, 1)
    pick = torch.rand(y.shape, generator=gen, device=y.device) < p_other
    return torch.where(pick, other, lo).to(torch.float8_e4m3fn)


class _Shared:
    """One compressed storage, shared by every saved view of it in a unit; the dequantised storage is
    cached (weakly) so views unpacked together dequantise once."""

    __slots__ = ("packed", "owner", "cache")

    def __init__(self, packed: Packed, owner: Any):
        self.packed, self.owner, self.cache = packed, owner, None


class _View:
    __slots__ = ("shared", "shape", "stride")

    def __init__(self, shared: _Shared, shape: torch.Size, stride: tuple):
        self.shared, self.shape, self.stride = shared, shape, stride

    def materialize(self, q: "Quantizer") -> Tensor:
        flat = self.shared.cache() if self.shared.cache is not None else None
        if flat is None:
            flat = q.unpack(self.shared.packed)
            self.shared.cache = weakref.ref(flat)
        return flat.as_strided(self.shape, self.stride, 0)


def _covers_storage(t: Tensor) -> bool:
    """t addresses every element of its storage exactly once (offset 0, no overlap, no gaps)."""
    try:
        if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
            return False
    except Exception:
        return False
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# --------------------------------------------------------------------------------------------------
# Model surgery helpers
# --------------------------------------------------------------------------------------------------

def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a HF causal LM (unwrapping DDP/DeepSpeed `.module` and PEFT)."""
    from algorithms.opsd import causal_lm

    m = causal_lm(model)
    decoder = m.get_decoder() if hasattr(m, "get_decoder") else getattr(m, "model", m)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError("trainer.activations: model has no decoder layers (get_decoder().layers)")
    return layers


def _storage_ptr(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return -1


def _tensors_in(obj: Any, out: list) -> list:
    if isinstance(obj, Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors_in(o, out)
    return out


def _model_dtype_bytes_and_vocab(model: nn.Module) -> tuple[int, int]:
    p = next(model.parameters(), None)
    dtype_bytes = p.element_size() if p is not None else 4
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is None:
        try:
            vocab = model.get_output_embeddings().weight.shape[0]
        except Exception:
            vocab = 0
    return dtype_bytes, int(vocab or 0)


# --------------------------------------------------------------------------------------------------
# Profiles and planning
# --------------------------------------------------------------------------------------------------

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
            trans.append(0.0)
        elif t == COMPRESS:
            stored.append(n * u.comp_bytes)
            trans.append(n * u.max_tensor_bytes)
        else:
            stored.append(n * u.in_bytes)
            trans.append(n * (u.full_bytes - (u.in_bytes if u.input_saved else 0.0)))
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


# --------------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------------

class _UnitStats:
    """Accumulates one unit's measurements during a profiled micro-batch."""

    def __init__(self):
        self.tokens = 0
        self.in_bytes = 0.0
        self.full_bytes = 0.0
        self.comp_bytes = 0.0
        self.max_tensor = 0.0
        self.input_saved = False
        self.fwd_s = math.inf
        self.comp_s = math.inf
        self.err_num = 0.0
        self.err_den = 0.0


class ActivationManager:
    """Applies a treatment per decoder layer; see the module docstring for the model and the plan."""

    def __init__(self, model: nn.Module, cfg: ActivationConfig):
        self.model, self.cfg = model, cfg
        self.layers = list(decoder_layers(model))
        self.quantizer = Quantizer(cfg.compress, cfg.group_size, cfg.stochastic_rounding, cfg.seed,
                                   cfg.fused_kernels)
        self._originals: list[Callable] = []
        self._plan: list[str] = [RECOMPUTE if cfg.mode == "checkpoint" else FULL] * len(self.layers)
        self._forced: Optional[list[str]] = None
        self.profile: Optional[Profile] = None
        self._stats: list[_UnitStats] = []
        self._profiled_steps = 0
        self._profiling = False
        self._exposure = 1.0
        self._exposure_tokens: Optional[int] = None
        self._estimate: Optional[PlanEstimate] = None
        self._live_bytes = 0.0  # bytes kept by the compress hooks in the current micro-batch
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._scenario = FRESH
        if cfg.fused_kernels:
            self._warm_kernels()
        self._own_forward = []  # whether `forward` was an instance attribute before install
        for i, layer in enumerate(self.layers):
            orig = layer.forward
            self._originals.append(orig)
            self._own_forward.append("forward" in layer.__dict__)
            layer.forward = functools.partial(self._forward, i, orig)
        if cfg.mode == "hilore":
            self.replan()

    # public API ----------------------------------------------------------------------------------

    def set_exposure(self, coef: Optional[Tensor]) -> None:
        """Per-token |dL/dlogp| (B, T) before the micro-batch's forward/backward; None = uniform."""
        if coef is None:
            self._exposure, self._exposure_tokens = 1.0, None
            return
        n = coef.numel()
        self._exposure = float(coef.detach().abs().sum()) / n if n else 0.0
        self._exposure_tokens = n

    def replan(self) -> None:
        """Profile again on the next grad-enabled micro-batch (hilore mode), then plan."""
        if self.cfg.mode != "hilore":
            return
        self.profile, self._estimate, self._profiled_steps = None, None, 0
        self._stats = [_UnitStats() for _ in self.layers]

    def plan(self) -> list[str]:
        return list(self._forced if self._forced is not None else self._plan)

    def force_plan(self, plan: Optional[list[str]]) -> None:
        """Pin a treatment per unit (tests, experiments); None returns to the configured mode."""
        if plan is not None:
            plan = list(plan)
            if len(plan) != len(self.layers) or any(t not in TREATMENTS for t in plan):
                raise ValueError(f"plan must list one of {TREATMENTS} per unit ({len(self.layers)} units)")
        self._forced = plan

    def estimate(self, tokens: Optional[int] = None) -> Optional[PlanEstimate]:
        """The planner's estimate of the current plan (optionally for another token count)."""
        if self.profile is None:
            return None
        if tokens is None:
            return self._estimate
        return estimate(self.profile, self.plan(), tokens, self._exposure)

    def plan_for(self, tokens: int, exposure: Optional[float] = None) -> PlanEstimate:
        """Plan (without applying it) for a micro-batch of `tokens` tokens."""
        if self.profile is None:
            raise RuntimeError("no profile yet: run one grad-enabled micro-batch first")
        e = self._exposure if exposure is None else exposure
        return plan_units(self.profile, tokens, e, self.cfg.memory_budget, self.cfg.risk_budget)

    def metrics(self) -> dict[str, Tensor]:
        plan = self.plan()
        m = {
            "activations/recompute_units": float(plan.count(RECOMPUTE)),
            "activations/compressed_units": float(plan.count(COMPRESS)),
            "activations/full_units": float(plan.count(FULL)),
            "activations/exposure": float(self._exposure),
        }
        est = self._estimate
        if est is not None:
            m.update({
                "activations/risk": est.risk,
                "activations/planned_bytes": est.peak,
                "activations/checkpoint_bytes": est.checkpoint_peak,
                "activations/peak_ratio": est.ratio,
                "activations/est_time_saved_s": est.checkpoint_time_s - est.time_s,
            })
        m["activations/compressed_bytes"] = float(self._live_bytes)
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in m.items()}

    def remove(self) -> None:
        for layer, orig, own in zip(self.layers, self._originals, self._own_forward):
            if own:
                layer.forward = orig
            else:
                layer.__dict__.pop("forward", None)
        self._originals, self._own_forward = [], []

    # internals -----------------------------------------------------------------------------------

    def _warm_kernels(self) -> None:
        for n in (4096, 3 * 4096):
            for dtype in {torch.float32, next(self.model.parameters()).dtype}:
                x = torch.randn(n, dtype=dtype, device=next(self.model.parameters()).device)
                self.quantizer.unpack(self.quantizer.pack(x))

    def _treatment(self, i: int) -> str:
        return self._forced[i] if self._forced is not None else self._plan[i]

    def _forward(self, i: int, orig: Callable, *args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if i == 0:
            self._begin_microbatch(hidden)
        if self._profiling and self._forced is None:
            return self._profile_unit(i, orig, hidden, args, kwargs)
        t = self._treatment(i)
        if t == RECOMPUTE:
            return checkpoint(functools.partial(orig, **kwargs), *args, use_reentrant=False,
                              preserve_rng_state=True)
        if t == COMPRESS:
            pack, unpack = self._hooks(i, kwargs)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return orig(*args, **kwargs)
        return orig(*args, **kwargs)

    def _begin_microbatch(self, hidden: Optional[Tensor]) -> None:
        self._live_bytes = 0.0
        if self.cfg.mode != "hilore":
            return
        tokens = int(hidden.shape[:-1].numel()) if hidden is not None else 0
        if self.profile is None:
            self._profiling = True
            self._plan = [RECOMPUTE] * len(self.layers)
            return
        # Gradients already held (a later micro-batch of the step) stay resident through the whole
        # backward; on a step's first micro-batch they are allocated as backward proceeds.
        scenario = ACCUMULATED if any(p.grad is not None for p in self._trainable) else FRESH
        if (self._estimate is None or tokens != self._estimate.tokens or scenario != self._scenario
                or abs(self._exposure - self._estimate.exposure) > self.cfg.replan_tolerance):
            self._estimate = plan_units(self.profile, tokens, self._exposure, self.cfg.memory_budget,
                                        self.cfg.risk_budget, (scenario,))
            self._plan, self._scenario = list(self._estimate.plan), scenario

    def _skip_ptrs(self, i: int, kwargs: dict) -> set:
        """Storages never compressed in unit i: its parameters and tensors shared across units."""
        ptrs = {_storage_ptr(p) for p in self.layers[i].parameters()}
        ptrs.update(_storage_ptr(t) for t in _tensors_in(kwargs, []))
        return ptrs

    def _eligible(self, t: Tensor, skip: set) -> bool:
        """Compressible: a floating, non-parameter tensor of >= min_numel elements that covers its whole
        storage without overlap (contiguous or a permutation of contiguous), not shared across units."""
        return (t.is_floating_point() and t.numel() >= self.cfg.min_numel and t.layout == torch.strided
                and not isinstance(t, nn.Parameter) and not (t.requires_grad and t.is_leaf)
                and _covers_storage(t) and _storage_ptr(t) not in skip)

    def _hooks(self, i: int, kwargs: dict):
        skip = self._skip_ptrs(i, kwargs)
        seen: dict[int, _Shared] = {}
        q = self.quantizer

        def pack(t: Tensor):
            if not self._eligible(t, skip):
                return t
            ptr = _storage_ptr(t)
            shared = seen.get(ptr)
            if shared is None or shared.owner() is None:  # storage not packed yet (or address reused)
                packed = q.pack(t.as_strided((t.numel(),), (1,), 0))
                if not bool(torch.isfinite(packed.scale).all()):  # inf / nan inside (e.g. a -inf mask fill)
                    return t  # kept exactly: a scale of inf would turn every value of its group into nan
                shared = _Shared(packed, weakref.ref(t))
                self._live_bytes += shared.packed.nbytes()
                seen[ptr] = shared
            return _View(shared, t.shape, t.stride())

        def unpack(p):
            return p.materialize(q) if isinstance(p, _View) else p

        return pack, unpack

    def _profile_unit(self, i: int, orig: Callable, hidden: Tensor, args: tuple, kwargs: dict):
        st = self._stats[i]
        sync = _sync_fn(hidden)
        # 1. the real graph: recompute (exact gradients, checkpointing memory); its time = recompute cost
        sync()
        t0 = time.perf_counter()
        out = checkpoint(functools.partial(orig, **kwargs), *args, use_reentrant=False, preserve_rng_state=True)
        sync()
        fwd = time.perf_counter() - t0
        # 2. a throw-away graph of the unit under counting hooks (RNG state restored afterwards)
        skip = self._skip_ptrs(i, kwargs)
        storages: dict[int, int] = {}
        kept: dict[int, int] = {}
        acc = {"comp": 0.0, "max": 0.0, "t": 0.0, "num": 0.0, "den": 0.0, "input": False}
        x_in = hidden.detach().requires_grad_(True)
        in_ptr = _storage_ptr(x_in)
        q = self.quantizer

        refs: dict[int, int] = {}  # packed storage -> saved references (each one unpacks in backward)
        unpack_s: dict[int, float] = {}
        nonfinite: set = set()

        def pack(t: Tensor):
            ptr = _storage_ptr(t)
            if ptr in skip:
                return t  # parameters / shared inputs: held anyway, not the unit's activations
            nbytes = t.untyped_storage().nbytes() if ptr != -1 else t.numel() * t.element_size()
            storages[ptr] = max(storages.get(ptr, 0), nbytes)
            if ptr == in_ptr:
                acc["input"] = True
            if ptr in nonfinite or not self._eligible(t, skip):
                kept[ptr] = max(kept.get(ptr, 0), nbytes)
                return t
            refs[ptr] = refs.get(ptr, 0) + 1
            if ptr in unpack_s:
                return t
            flat = t.as_strided((t.numel(),), (1,), 0)
            sync()
            s0 = time.perf_counter()
            p = q.pack(flat)
            sync()
            s1 = time.perf_counter()
            if not bool(torch.isfinite(p.scale).all()):  # holds inf/nan: the compress hook keeps it exact
                nonfinite.add(ptr)
                refs.pop(ptr)
                kept[ptr] = max(kept.get(ptr, 0), nbytes)
                return t
            r = q.unpack(p)
            sync()
            acc["t"] += s1 - s0
            unpack_s[ptr] = time.perf_counter() - s1
            acc["comp"] += p.nbytes()
            acc["max"] = max(acc["max"], float(nbytes))
            xf = flat.detach().float()
            acc["num"] += float((xf - r.float()).pow(2).sum())
            acc["den"] += float(xf.pow(2).sum())
            return t

        margs = (x_in,) + tuple(args[1:]) if args else ()
        mkw = dict(kwargs) if args else {**kwargs, "hidden_states": x_in}
        with torch.random.fork_rng(devices=_rng_devices(hidden)):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                junk = orig(*margs, **mkw)
        del junk
        # a storage saved by k ops is dequantised up to k times in backward (cache permitting)
        acc["t"] += sum(unpack_s[ptr] * refs[ptr] for ptr in unpack_s)
        tokens = int(hidden.shape[:-1].numel())
        in_bytes = hidden.numel() * hidden.element_size()
        full = float(sum(storages.values()))
        comp = acc["comp"] + float(sum(kept.values()))
        st.tokens = tokens
        st.in_bytes = in_bytes / tokens
        st.full_bytes = full / tokens
        st.comp_bytes = comp / tokens
        st.max_tensor = acc["max"] / tokens
        st.input_saved = acc["input"]
        st.fwd_s = min(st.fwd_s, fwd / tokens)
        st.comp_s = min(st.comp_s, acc["t"] / tokens)
        st.err_num, st.err_den = acc["num"], acc["den"]
        if i == len(self.layers) - 1:
            self._finish_profile_step()
        return out

    def _finish_profile_step(self) -> None:
        self._profiled_steps += 1
        if self._profiled_steps < self.cfg.profile_steps:
            return
        self._profiling = False
        dtype_bytes, vocab = _model_dtype_bytes_and_vocab(self.model)
        head = (self.cfg.head_bytes_per_token if self.cfg.head_bytes_per_token is not None
                else float(vocab * (dtype_bytes + 4)))
        unit_params = {id(p) for layer in self.layers for p in layer.parameters()}
        units = []
        for layer, st in zip(self.layers, self._stats):
            grads = float(sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad))
            err = math.sqrt(st.err_num / st.err_den) if st.err_den > 0 else 0.0
            units.append(UnitProfile(st.in_bytes, st.full_bytes, st.comp_bytes, st.max_tensor, st.input_saved,
                                     st.fwd_s, st.comp_s, err, grads))
        other = float(sum(p.numel() * p.element_size() for p in self.model.parameters()
                          if p.requires_grad and id(p) not in unit_params))
        params = list(self.model.parameters())
        static = float(sum(p.numel() * p.element_size() for p in params)
                       + self.cfg.optimizer_bytes_per_param * sum(p.numel() for p in params if p.requires_grad))
        self.profile = Profile(units, head, other, static)


def _sync_fn(t: Optional[Tensor]) -> Callable[[], None]:
    if t is not None and t.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _rng_devices(t: Optional[Tensor]) -> list:
    if t is not None and t.device.type == "cuda":
        return [t.device]
    return []


def install(model: nn.Module, cfg: ActivationConfig) -> Optional[ActivationManager]:
    """Wrap the decoder layers' forwards per `cfg.mode`; None for mode "none"."""
    cfg.validate()
    if cfg.mode == "none":
        return None
    for layer in decoder_layers(model):
        if getattr(layer, "gradient_checkpointing", False):
            raise ValueError("trainer.activations: the model's own gradient checkpointing is enabled; "
                             "disable it (model.gradient_checkpointing_disable()) when using this")
        if isinstance(layer.__dict__.get("forward"), functools.partial):
            raise ValueError("trainer.activations: an activation manager is already installed on this model")
    return ActivationManager(model, cfg)
