"""Composable wrappers around the forward of every decoder layer of a causal LM.

Several features change how a decoder layer runs (activation management recomputes or compresses
it, a layer skipper may not run it at all). Each one replacing `layer.forward` on its own would make
the second overwrite the first, and removing either would restore the wrong forward. Here each
feature installs one named *link* of a per-layer chain instead:

    handle = wrap_layers(model, "hilore", wrapper)   # wrapper(index, inner, *args, **kwargs)
    ...
    handle.remove()                                   # or unwrap_layers(model, "hilore")

`wrapper` receives the layer's index in `decoder_layers(model)`, `inner` (the rest of the chain:
call it to run the layer as it would run without this link, any number of times, or not at all)
and the layer's call arguments; what it returns is the layer's output.

Order. Links are sorted by `priority`, then by installation: a link with a higher priority is
outside (called first) of one with a lower priority, and among equal priorities the link installed
later is outside the earlier ones (as stacking decorators). E.g. A then B, both priority 0:
layer(x) -> B(i, A', x) -> A(i, forward, x) -> forward(x).

State. The chain is the layer instance's `forward` attribute (which `nn.Module.__call__` looks up
first); nothing is kept anywhere else. When its last link is removed the instance dict is restored
exactly: `forward` deleted when the class's method was in use, or the previous instance attribute
put back.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from models.anatomy import decoder_layers

Wrapper = Callable[..., Any]  # wrapper(index, inner_forward, *args, **kwargs) -> layer output

_NO_OWN = object()  # marks "the layer had no instance-level forward before the first link"
_order = itertools.count()  # installation order across models (only its relative order matters)


@dataclass(frozen=True)
class _Link:
    name: str
    wrapper: Wrapper
    priority: int
    seq: int


class _Chain:
    """The callable installed as one layer's `forward`: the links around the original forward."""

    def __init__(self, index: int, original: Callable, own: Any):
        self.index = index
        self.original = original  # the forward in use before the first link (bound method or attribute)
        self.own = own  # the layer's previous instance attribute `forward`, or _NO_OWN
        self.links: list[_Link] = []  # innermost first
        self._call: Callable = original

    def rebuild(self) -> None:
        # Composed once per change, not per call: a forward runs for every layer of every micro-batch.
        self.links.sort(key=lambda link: (link.priority, link.seq))
        call = self.original
        for link in self.links:
            call = functools.partial(link.wrapper, self.index, call)
        self._call = call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)


class LayerWrap:
    """Handle of one installed link; `remove()` takes it out of every layer (a second call is a no-op)."""

    def __init__(self, layers: list[nn.Module], name: str):
        self.layers, self.name = layers, name

    @property
    def installed(self) -> bool:
        return bool(self.layers)

    def remove(self) -> None:
        layers, self.layers = self.layers, []
        for layer in layers:
            _remove_link(layer, self.name)


def _chain(layer: nn.Module):
    chain = layer.__dict__.get("forward")
    return chain if isinstance(chain, _Chain) else None


def wrapped_names(layer: nn.Module) -> list[str]:
    """Names of the links around `layer`'s forward, outermost (called first) first."""
    chain = _chain(layer)
    return [link.name for link in reversed(chain.links)] if chain is not None else []


def wrap_layers(model: nn.Module, name: str, wrapper: Wrapper, priority: int = 0) -> LayerWrap:
    """Install `wrapper` as the link `name` around the forward of every decoder layer of `model`
    (see the module docstring for the call convention and the order). Refuses a name already
    installed on these layers, before changing any of them."""
    layers = list(decoder_layers(model, user=name))
    for layer in layers:
        if name in wrapped_names(layer):
            raise ValueError(f"{name}: already installed on the decoder layers of this model "
                             f"(remove it first; installed here: {', '.join(wrapped_names(layer))})")
    seq = next(_order)
    for i, layer in enumerate(layers):
        chain = _chain(layer)
        if chain is None:
            own = layer.__dict__.get("forward", _NO_OWN)
            chain = _Chain(i, layer.forward, own)
            layer.forward = chain
        chain.links.append(_Link(name, wrapper, priority, seq))
        chain.rebuild()
    return LayerWrap(layers, name)


def unwrap_layers(model: nn.Module, name: str) -> None:
    """Remove the link `name` from every decoder layer of `model`; an error when it is not installed."""
    layers = list(decoder_layers(model, user=name))
    if not any(name in wrapped_names(layer) for layer in layers):
        raise ValueError(f"{name}: not installed on the decoder layers of this model")
    for layer in layers:
        _remove_link(layer, name)


def _remove_link(layer: nn.Module, name: str) -> None:
    chain = _chain(layer)
    if chain is None:
        return
    chain.links = [link for link in chain.links if link.name != name]
    if chain.links:
        chain.rebuild()
        return
    if chain.own is _NO_OWN:
        del layer.__dict__["forward"]  # the class's forward is in use again
    else:
        layer.__dict__["forward"] = chain.own
