"""The HiLoRe activation manager: applies a treatment to every decoder layer (recovery unit) of the
actor model, profiles the units and re-plans per micro-batch.

It installs itself as the link ``trainer.activations`` of the shared decoder-layer wrapping
(``models.layer_wrap``), so other features wrapping the same layers compose with it.

Profiling. The first grad-enabled micro-batch after ``install`` / ``replan`` (``profile_steps`` of
them) runs every unit as ``recompute`` -- exact gradients, checkpointing memory -- and, per unit, also
builds a throw-away autograd graph of the unit on a detached copy of its input, under counting hooks:
full-precision saved bytes (distinct storages), bytes once compressed (what the compress hooks keep),
the largest single saved tensor, whether the unit input itself is saved, the (de)compression time and
the relative compression error. The recompute cost is the measured time of the checkpointed forward.
All byte and time figures are stored per token, so a plan is valid for any micro-batch length.

Re-planning. The manager re-plans when the token count of the micro-batch changes, when the
gradient scenario changes (see ``trainer.activations.planner``) or the exposure moves by more than
``replan_tolerance`` (absolute, in units of E) from the exposure the plan was made for.
"""
from __future__ import annotations

import functools
import math
import time
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.anatomy import decoder_layers
from models.layer_wrap import wrap_layers, wrapped_names
from trainer.activations.options import ActivationConfig
from trainer.activations.planner import (ACCUMULATED, COMPRESS, FRESH, FULL, RECOMPUTE, TREATMENTS, PlanEstimate,
                                         Profile, UnitProfile, estimate, plan_units)
from trainer.activations.quantize import Quantizer, _Shared, _View

LINK = "trainer.activations"  # this manager's name in the layers' wrapper chain


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
    """Applies a treatment per decoder layer; see the package and module docstrings for the model and
    the plan. Construct it with `install` (which checks the model first)."""

    def __init__(self, model: nn.Module, cfg: ActivationConfig):
        self.model, self.cfg = model, cfg
        self.layers = list(decoder_layers(model, user=LINK))
        self.quantizer = Quantizer(cfg.compress, cfg.group_size, cfg.stochastic_rounding, cfg.seed,
                                   cfg.fused_kernels)
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
        self._wrap = wrap_layers(model, LINK, self._forward)
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
        """Take the manager off the layers (other wrappers stay); a second call does nothing."""
        self._wrap.remove()

    # internals -----------------------------------------------------------------------------------

    def _warm_kernels(self) -> None:
        for n in (4096, 3 * 4096):
            for dtype in {torch.float32, next(self.model.parameters()).dtype}:
                x = torch.randn(n, dtype=dtype, device=next(self.model.parameters()).device)
                self.quantizer.unpack(self.quantizer.pack(x))

    def _treatment(self, i: int) -> str:
        return self._forced[i] if self._forced is not None else self._plan[i]

    def _forward(self, i: int, orig: Callable, *args, **kwargs):
        """The layer-wrap link: layer i's forward, `orig` being the layer as it runs without it."""
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if i == 0:  # layer 0 starts a micro-batch: a link outside this one must not skip layer 0 past it
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
    if cfg.compress == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError("trainer.activation_compress=fp8 needs torch.float8_e4m3fn (not in this torch)")
    if cfg.mode == "none":
        return None
    for layer in decoder_layers(model, user=LINK):
        if getattr(layer, "gradient_checkpointing", False):
            raise ValueError("trainer.activations: the model's own gradient checkpointing is enabled; "
                             "disable it (model.gradient_checkpointing_disable()) when using this")
        if LINK in wrapped_names(layer):
            raise ValueError("trainer.activations: an activation manager is already installed on this model")
    return ActivationManager(model, cfg)
