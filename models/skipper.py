"""Dynamic layer skipping: a router and an adapter per routed decoder layer (the skipper surgery).

At each routed layer (default: the upper half of the stack) every token's router decides whether
the token runs the layer or skips it:

    h      = input_layernorm(x)                                  the layer's own normed input
    g      = sigmoid(head(dec(tanh(RMSNorm(enc(h))))))           enc H -> H/16, dec H/16 -> H, head H -> 1,
                                                                 no biases; RMSNorm over the bottleneck
    run    = g > 0.5
    run rows:     x' = x + attn(h);  out = x' + s_run * mlp(post_norm(x'))
    skipped rows: out = x + s_skip * adapter(h)                  adapter: SwiGLU, intermediate size / 16

A skipped token still writes that layer's K/V, computed from the layer's own k/v projections of h,
so later tokens attend to it as usual; only its query, attention output and MLP are not computed.

The gate arithmetic (`gate`, trained and served alike -- `gate_scales` is the one function both
call) is
    soft   s_run = g,  s_skip = 1 - g (the router learns through the scales);
    hard   the straight-through 0/1 decision: s_run = s_skip = 1 in value, gradient of g.
Forcing every router to run (`forced(model, "run")`: g = 1) gives exactly the base model; forcing
every router to skip (`forced(model, "skip")`: g = 0) gives the adapter-only path.

    spec = make_spec(model.config, layers=None, gate="soft")    # layers None: the upper half
    apply_skipper(model, spec)                                   # adds layer.skipper, routes the forward
    with record_gates(model) as rec: model(ids)                  # rec.logits[layer]: (B, T) router logits
    save_skipper(model, "final/skipper"); load_skipper(base, "final/skipper")

The training forward computes every branch for every token and mixes them (as the released
FlexiDepth model does); the runtime (`inference/skip_routing.py`) gathers the rows that run and
gives the others only the K/V projection and the adapter, with the same arithmetic.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.anatomy import UnsupportedModel, causal_lm, decoder_layers
from models.layer_wrap import LayerWrap, wrap_layers

GATES = ("soft", "hard")
FORCES = (None, "run", "skip")
THRESHOLD = 0.5  # a token runs the layer when g > THRESHOLD
REDUCTION = 16  # router bottleneck H / 16 and adapter intermediate I / 16
LINK = "skipper"  # the layer_wrap link name
SKIPPER_DIR = "skipper"  # inside an export: final/skipper/
CONFIG_FILE = "skipper.json"
WEIGHTS_FILE = "skipper.safetensors"
ROUTER_INIT_STD = 0.02  # router and adapter init (normal); the adapter's down projection starts at 0


class SkipperError(ValueError):
    """A skipper that does not fit the model it is applied to (one line, naming what differs)."""


@dataclass(frozen=True)
class SkipperSpec:
    """What the routed layers are and how they gate: the content of `skipper.json` (with the base
    model's shape, checked when the skipper is loaded onto a base)."""

    layers: tuple[int, ...]  # routed decoder layers, ascending
    gate: str  # soft | hard
    hidden_size: int
    num_layers: int
    router_dim: int  # the router's bottleneck width
    adapter_dim: int  # the adapter's intermediate width
    eps: float  # the RMSNorm eps inside the router (the model's rms_norm_eps)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["layers"] = list(self.layers)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SkipperSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(known - set(data))
        if missing:
            raise SkipperError(f"skipper config lacks {', '.join(missing)}")
        values = {k: data[k] for k in known}
        values["layers"] = tuple(int(i) for i in values["layers"])
        return cls(**values)

    def check_model(self, config: Any, where: str = "the skipper") -> None:
        """SkipperError when the base model's shape (config) is not the one this skipper was trained on."""
        for name, have in (("num_layers", config.num_hidden_layers), ("hidden_size", config.hidden_size)):
            want = getattr(self, name)
            if want != have:
                raise SkipperError(f"{where} was trained for a model with {name}={want}; this model has {have}")


LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")  # what a routed layer runs


def skipper_unsupported_reason(model: nn.Module) -> str | None:
    """Why a skipper cannot route `model`'s decoder layers, or None. A routed layer runs the pre-norm
    block `x + attn(input_layernorm(x))`, then `mlp(post_attention_layernorm(.))` (Llama, Qwen, Mistral,
    Gemma, Phi-3 layout), and the router's RMSNorm takes the config's `rms_norm_eps`."""
    lm = causal_lm(model)
    name = type(lm).__name__
    if getattr(lm.config, "rms_norm_eps", None) is None:
        return f"{name} has no rms_norm_eps in its config (the router's RMSNorm takes it)"
    for i, layer in enumerate(decoder_layers(lm, user="skipper")):
        missing = [part for part in LAYER_PARTS if not hasattr(layer, part)]
        if missing:
            return (f"{name}'s decoder layer {i} ({type(layer).__name__}) has no {', '.join(missing)}: a routed "
                    f"layer runs the pre-norm block input_layernorm -> self_attn, post_attention_layernorm -> mlp")
    return None


def check_supported(model: nn.Module) -> None:
    """ValueError naming the architecture when `skipper_unsupported_reason` has a reason."""
    reason = skipper_unsupported_reason(model)
    if reason is not None:
        raise UnsupportedModel(f"algo=skipper cannot route this model: {reason}")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """The upper half of the stack: 12 layers -> 6..11 (an odd count routes the smaller half)."""
    return tuple(range(num_layers - num_layers // 2, num_layers))


def check_layers(layers: Sequence[int], num_layers: int, key: str = "layers") -> tuple[int, ...]:
    """Sorted, unique layer indices inside [0, num_layers); ValueError naming `key` otherwise."""
    layers = tuple(int(i) for i in layers)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{key}={list(layers)}: {bad} outside the model's {num_layers} layers (0..{num_layers - 1})")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{key}={list(layers)} names a layer twice")
    if not layers:
        raise ValueError(f"{key}=[] routes no layer")
    return tuple(sorted(layers))


def make_spec(config: Any, layers: Optional[Sequence[int]] = None, gate: str = "soft",
              reduction: int = REDUCTION) -> SkipperSpec:
    """The spec for a model config: `layers` None = the upper half."""
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not one of {', '.join(GATES)}")
    n = config.num_hidden_layers
    chosen = default_layers(n) if layers is None else check_layers(layers, n)
    return SkipperSpec(chosen, gate, config.hidden_size, n, max(1, config.hidden_size // reduction),
                       max(1, config.intermediate_size // reduction), float(config.rms_norm_eps))


# --- modules --------------------------------------------------------------------------------------------


class Router(nn.Module):
    """logit(h) = head(dec(tanh(RMSNorm(enc(h))))): (..., H) -> (..., ) in the model dtype."""

    def __init__(self, hidden: int, width: int, eps: float):
        super().__init__()
        self.enc = nn.Linear(hidden, width, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(width))
        self.dec = nn.Linear(width, hidden, bias=False)
        self.head = nn.Linear(hidden, 1, bias=False)
        self.eps = eps

    def forward(self, h: Tensor) -> Tensor:
        return router_logits(h, self.enc.weight, self.norm_weight, self.dec.weight, self.head.weight, self.eps)


def router_logits(h: Tensor, enc: Tensor, norm_weight: Tensor, dec: Tensor, head: Tensor, eps: float) -> Tensor:
    """The router's arithmetic on (..., H) -> (..., ): one function for the module and the runtime,
    so a served decision is computed exactly as in training."""
    z = F.linear(h, enc)
    z = norm_weight * F.rms_norm(z.float(), (z.shape[-1],), None, eps).to(z.dtype)
    return F.linear(F.linear(torch.tanh(z), dec), head).squeeze(-1)


class Adapter(nn.Module):
    """The skipped rows' update: down(silu(gate(h)) * up(h)), no biases."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LayerSkipper(nn.Module):
    """A routed layer's trainable parts, registered as `layer.skipper`."""

    def __init__(self, spec: SkipperSpec):
        super().__init__()
        self.router = Router(spec.hidden_size, spec.router_dim, spec.eps)
        self.adapter = Adapter(spec.hidden_size, spec.adapter_dim)

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        for linear in (self.router.enc, self.router.dec, self.router.head, self.adapter.gate_proj,
                       self.adapter.up_proj):
            with torch.no_grad():
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * ROUTER_INIT_STD)
        with torch.no_grad():
            self.router.norm_weight.fill_(1.0)
            self.adapter.down_proj.weight.zero_()  # a fresh skip adds nothing: x passes unchanged


# --- the gate arithmetic (training and serving) ------------------------------------------------------------


def gate_values(logits: Tensor, force: Optional[str]) -> Tensor:
    """g in [0, 1], fp32, from router logits; forced: all ones (run) or all zeros (skip)."""
    if force == "run":
        return torch.ones_like(logits, dtype=torch.float32)
    if force == "skip":
        return torch.zeros_like(logits, dtype=torch.float32)
    return logits.float().sigmoid()


def gate_scales(g: Tensor, gate: str) -> tuple[Tensor, Tensor, Tensor]:
    """(run (bool), s_run, s_skip), each shaped like g (fp32): the one definition of the arithmetic.

    soft: s_run = g, s_skip = 1 - g. hard: the 0/1 decision d with a straight-through gradient
    (d + g - g.detach(): exactly 0 or 1 in value), s_run = d, s_skip = 1 - d."""
    run = g > THRESHOLD
    if gate == "soft":
        return run, g, 1.0 - g
    decision = run.to(g.dtype) + (g - g.detach())
    return run, decision, 1.0 - decision


def decisions(g: Tensor) -> Tensor:
    """The 0/1 run decision with a straight-through gradient of g (the skip penalty's quantity)."""
    return (g > THRESHOLD).to(g.dtype) + (g - g.detach())


# --- surgery and the training forward ---------------------------------------------------------------------


@dataclass
class GateRecord:
    """What one forward's routers said, per routed layer: logits (B, T) and g (B, T) fp32 (with grad)."""

    logits: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    gates: dict[int, Tensor] = dataclasses.field(default_factory=dict)


class SkipperState:
    """The skipper of one model (stored as `lm.skipper_state`): its spec, the link that routes the
    layers' forward, the force mode, and the active gate recorder."""

    def __init__(self, spec: SkipperSpec, link: Optional[LayerWrap]):
        self.spec, self.link = spec, link
        self.force: Optional[str] = None
        self.record: Optional[GateRecord] = None
        # training only: pass the gradient of the run/skip decision itself to the router, straight
        # through, as (run branch - skip branch) for every token -- instead of the scales' gradient
        # under the hard gate, added to it under the soft one; the forward value is unchanged
        self.decision_grad = False


def skipper_state(model: nn.Module) -> Optional[SkipperState]:
    """The model's skipper (through any wrapper), or None when it has none."""
    return getattr(causal_lm(model), "skipper_state", None)


def routed_layers(model: nn.Module) -> dict[int, LayerSkipper]:
    """layer index -> its LayerSkipper, for a model with a skipper ({} without)."""
    state = skipper_state(model)
    if state is None:
        return {}
    layers = decoder_layers(model, user="skipper")
    return {i: layers[i].skipper for i in state.spec.layers}


def apply_skipper(model: nn.Module, spec: SkipperSpec, seed: int = 0) -> SkipperState:
    """Add a router + adapter to each routed layer (`layer.skipper`) and route those layers' forward.

    New parameters are initialised from `seed` (normal, std 0.02; the adapter's output projection
    0). Refuses a model that already has a skipper or whose shape differs from the spec's."""
    lm = causal_lm(model)
    if skipper_state(lm) is not None:
        raise SkipperError("the model already has a skipper")
    spec.check_model(lm.config)
    layers = decoder_layers(lm, user="skipper")
    param = next(lm.parameters())
    generator = torch.Generator().manual_seed(seed)
    for i in spec.layers:
        skipper = LayerSkipper(spec)
        skipper.reset_parameters(generator)
        layers[i].skipper = skipper.to(device=param.device, dtype=param.dtype)
    state = SkipperState(spec, None)
    state.link = wrap_layers(lm, LINK, _RoutedForward(list(layers), state))
    lm.skipper_state = state
    return state


class _RoutedForward:
    """The layer_wrap link of a skipper model. An object (not a closure) so that a deep copy of the
    model (FSDP's full-model copy, a benchmark's) routes through the copy's own layers and state."""

    def __init__(self, layers: list[nn.Module], state: SkipperState):
        self.layers, self.state = layers, state

    def __call__(self, index: int, inner, *args, **kwargs):
        if index not in self.state.spec.layers:
            return inner(*args, **kwargs)
        return _routed_forward(self.layers[index], index, self.state, *args, **kwargs)


def remove_skipper(model: nn.Module) -> None:
    """Undo `apply_skipper`: the layers' forward and modules are the base model's again."""
    lm = causal_lm(model)
    state = skipper_state(lm)
    if state is None:
        return
    state.link.remove()
    layers = decoder_layers(lm, user="skipper")
    for i in state.spec.layers:
        del layers[i].skipper
    del lm.skipper_state


def _routed_forward(layer: nn.Module, index: int, state: SkipperState, hidden_states: Tensor, *args, **kwargs):
    """A routed decoder layer in training (and in the HF fallback of the runtime): every branch for
    every token, mixed by the decisions. The attention runs on every token, so every token's K/V
    (and an HF cache, when one is passed) comes from this layer's k/v projections of h."""
    if args:
        raise TypeError("a routed decoder layer takes its inputs after hidden_states by keyword")
    skipper: LayerSkipper = layer.skipper
    h = layer.input_layernorm(hidden_states)
    logits = skipper.router(h)  # (B, T)
    g = gate_values(logits, state.force)
    if state.record is not None:
        state.record.logits[index], state.record.gates[index] = logits, g
    run, s_run, s_skip = gate_scales(g, state.spec.gate)
    decision_grad = state.decision_grad and state.force is None and torch.is_grad_enabled()
    if decision_grad and state.spec.gate == "hard":  # the decision's gradient replaces the scales'
        s_run, s_skip = s_run.detach(), s_skip.detach()
    attn, _ = layer.self_attn(hidden_states=h, **kwargs)
    after_attn = hidden_states + attn
    mlp = layer.mlp(layer.post_attention_layernorm(after_attn))
    dtype = hidden_states.dtype
    ran = after_attn + s_run.to(dtype)[..., None] * mlp
    skipped = hidden_states + s_skip.to(dtype)[..., None] * skipper.adapter(h)
    out = torch.where(run[..., None], ran, skipped)
    if decision_grad:  # value + 0 exactly (g - g.detach() is 0); d out / d g gains ran - skipped
        out = out + (g - g.detach()).to(dtype)[..., None] * (ran - skipped).detach()
    return out


@contextlib.contextmanager
def forced(model: nn.Module, force: Optional[str]) -> Iterator[None]:
    """Within the block every router of `model` is forced: "run" (g = 1: the base model), "skip"
    (g = 0: the adapter-only path) or None (the routers decide)."""
    if force not in FORCES:
        raise ValueError(f"force={force!r} is not one of {FORCES}")
    state = skipper_state(model)
    if state is None:
        raise SkipperError("the model has no skipper")
    previous, state.force = state.force, force
    try:
        yield
    finally:
        state.force = previous


@contextlib.contextmanager
def record_gates(model: nn.Module) -> Iterator[GateRecord]:
    """Within the block, each forward's router logits and gates are kept (the last forward's win)."""
    state = skipper_state(model)
    if state is None:
        raise SkipperError("the model has no skipper")
    record, previous = GateRecord(), state.record
    state.record = record
    try:
        yield record
    finally:
        state.record = previous


def skipper_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for skipper in routed_layers(model).values() for p in skipper.parameters()]


# --- files ------------------------------------------------------------------------------------------------


def skipper_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The skipper's weights keyed `layers.<i>.<router|adapter>.<name>` (what skipper.safetensors holds)."""
    out = {}
    for i, skipper in routed_layers(model).items():
        for name, tensor in skipper.state_dict().items():
            out[f"layers.{i}.{name}"] = tensor.detach().cpu().contiguous()
    return out


def base_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict without the skipper's entries (the unchanged base)."""
    return {k: v for k, v in causal_lm(model).state_dict().items() if ".skipper." not in k}


README = """# Layer skipper

Router and adapter weights for dynamic layer skipping, trained on top of the base model in the
directory above this one (that directory is the unchanged base, loadable on its own with
`AutoModelForCausalLM.from_pretrained`).

- `skipper.json`: the routed layers, the gate arithmetic (`soft` or `hard`), and the base model's
  shape (`num_layers`, `hidden_size`), which is checked when the skipper is loaded.
- `skipper.safetensors`: per routed layer, the router (`enc`, `norm_weight`, `dec`, `head`) and the
  adapter (`gate_proj`, `up_proj`, `down_proj`).

Serve the base with the skipper (routed execution: skipped tokens run only the K/V projection and
the adapter):

    python -m inference <export dir> --prompt "12+7="                 # finds skipper/ itself
    python -m inference <base dir> --skipper <this directory> --prompt "12+7="

In Python: `model, tok = load_pretrained(base); load_skipper(model, "<this directory>")` (from
`models.skipper`), then `Engine(model)`.
"""


def save_skipper(model: nn.Module, out_dir: str) -> None:
    """Write skipper.json, skipper.safetensors and a README into `out_dir` (created)."""
    from safetensors.torch import save_file

    state = skipper_state(model)
    if state is None:
        raise SkipperError("the model has no skipper to save")
    os.makedirs(out_dir, exist_ok=True)
    save_file(skipper_state_dict(model), os.path.join(out_dir, WEIGHTS_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as fh:
        json.dump(state.spec.to_dict(), fh, indent=2)
    with open(os.path.join(out_dir, "README.md"), "w") as fh:
        fh.write(README)


def is_skipper_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, CONFIG_FILE))


def find_skipper(model_dir: str) -> Optional[str]:
    """`model_dir/skipper` when an export carries a skipper, else None."""
    path = os.path.join(model_dir, SKIPPER_DIR)
    return path if is_skipper_dir(path) else None


def read_spec(skipper_dir: str) -> SkipperSpec:
    path = os.path.join(skipper_dir, CONFIG_FILE)
    if not os.path.exists(path):
        raise SkipperError(f"{skipper_dir} is not a skipper dir (no {CONFIG_FILE})")
    try:
        with open(path) as fh:
            data = json.load(fh)
    except json.JSONDecodeError as err:
        raise SkipperError(f"{path} is not valid JSON ({err})") from None
    spec = SkipperSpec.from_dict(data)
    if spec.gate not in GATES:
        raise SkipperError(f"{path}: gate={spec.gate!r} is not one of {', '.join(GATES)}")
    return spec


def load_skipper(model: nn.Module, skipper_dir: str) -> SkipperState:
    """Apply the skipper saved in `skipper_dir` to `model` (its base); SkipperError naming the
    mismatch when the skipper was trained for another shape of model, or its weights do not fit."""
    from safetensors.torch import load_file

    spec = read_spec(skipper_dir)
    lm = causal_lm(model)
    spec.check_model(lm.config, where=f"the skipper in {skipper_dir}")
    try:
        check_layers(spec.layers, lm.config.num_hidden_layers)
    except ValueError as err:
        raise SkipperError(f"the skipper in {skipper_dir}: {err}") from None
    weights = load_file(os.path.join(skipper_dir, WEIGHTS_FILE))
    state = apply_skipper(lm, spec)
    try:
        for i, skipper in routed_layers(lm).items():
            prefix = f"layers.{i}."
            own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
            expected = skipper.state_dict()
            if set(own) != set(expected):
                raise SkipperError(f"{skipper_dir}: layer {i} has weights {sorted(own)}, expected {sorted(expected)}")
            for name, tensor in own.items():
                if tensor.shape != expected[name].shape:
                    raise SkipperError(f"{skipper_dir}: layers.{i}.{name} has shape {tuple(tensor.shape)}, "
                                       f"expected {tuple(expected[name].shape)}")
            skipper.load_state_dict(own)
    except BaseException:
        remove_skipper(lm)
        raise
    return state
