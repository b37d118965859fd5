"""models/layer_wrap.py: named wrappers around the decoder layers compose, come off one by one, and
the last one out restores the layers' forward exactly."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from models.layer_wrap import unwrap_layers, wrap_layers, wrapped_names
from models.loading import TinySpec, build_tiny
from tests.conftest import ROOT

SPEC = TinySpec(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64)


def _model():
    model, _ = build_tiny(SPEC, seed=0)
    return model.eval()


def _ids():
    return torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))


def _recorder(name, calls):
    def wrapper(index, inner, *args, **kwargs):
        calls.append((name, "enter", index))
        out = inner(*args, **kwargs)
        calls.append((name, "exit", index))
        return out
    return wrapper


def _state(model):
    return [dict(layer.__dict__) for layer in model.model.layers]


def test_two_wrappers_both_run_later_one_outside():
    model, ids = _model(), _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    calls = []
    a = wrap_layers(model, "a", _recorder("a", calls))
    b = wrap_layers(model, "b", _recorder("b", calls))
    assert all(wrapped_names(layer) == ["b", "a"] for layer in model.model.layers)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert torch.equal(out, ref)  # pass-through wrappers change nothing
    # per layer, in layer order: b enters, a enters, the layer runs, a exits, b exits
    expected = [(n, e, i) for i in range(3) for n, e in (("b", "enter"), ("a", "enter"), ("a", "exit"),
                                                           ("b", "exit"))]
    assert calls == expected
    a.remove(), b.remove()


def test_priority_orders_links_regardless_of_installation():
    model, ids = _model(), _ids()
    calls = []
    wrap_layers(model, "outer", _recorder("outer", calls), priority=10)
    wrap_layers(model, "mid", _recorder("mid", calls))
    wrap_layers(model, "inner", _recorder("inner", calls), priority=-1)
    assert wrapped_names(model.model.layers[0]) == ["outer", "mid", "inner"]
    with torch.no_grad():
        model(input_ids=ids)
    assert [n for n, e, i in calls if i == 0 and e == "enter"] == ["outer", "mid", "inner"]
    for name in ("mid", "outer", "inner"):
        unwrap_layers(model, name)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_removing_one_leaves_the_other_working_then_original_restored():
    model, ids = _model(), _ids()
    before_state = _state(model)
    before_fn = [type(layer).forward for layer in model.model.layers]
    assert all("forward" not in s for s in before_state)
    calls = []
    a = wrap_layers(model, "a", _recorder("a", calls))
    scale = wrap_layers(model, "scale", lambda i, inner, *args, **kw: _scaled(inner(*args, **kw)))
    a.remove()
    assert all(wrapped_names(layer) == ["scale"] for layer in model.model.layers)
    calls.clear()
    with torch.no_grad():
        scaled = model(input_ids=ids).logits
    assert calls == []  # "a" is gone
    scale.remove()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert not torch.allclose(scaled, plain)  # "scale" did run while it was installed
    assert _state(model) == before_state  # the instance dicts are exactly as before
    assert [type(layer).forward for layer in model.model.layers] == before_fn
    scale.remove()  # a second removal does nothing


def _scaled(out):
    # a decoder layer returns the hidden states (a tensor, or a tuple whose first item is one)
    if isinstance(out, tuple):
        return (out[0] * 2.0,) + out[1:]
    return out * 2.0


def test_an_instance_forward_is_put_back_by_identity():
    model = _model()
    layer = model.model.layers[1]
    own = layer.forward  # a bound method stored on the instance, as another patcher would leave it
    layer.forward = own
    h = wrap_layers(model, "a", lambda i, inner, *args, **kw: inner(*args, **kw))
    assert layer.__dict__["forward"] is not own
    h.remove()
    assert layer.__dict__["forward"] is own
    assert all("forward" not in other.__dict__ for j, other in enumerate(model.model.layers) if j != 1)


def test_same_name_twice_is_refused_before_any_change():
    model = _model()
    wrap_layers(model, "a", lambda i, inner, *args, **kw: inner(*args, **kw))
    snapshot = [layer.__dict__["forward"].links[:] for layer in model.model.layers]
    with pytest.raises(ValueError, match="a: already installed"):
        wrap_layers(model, "a", lambda i, inner, *args, **kw: inner(*args, **kw))
    assert [layer.__dict__["forward"].links for layer in model.model.layers] == snapshot
    unwrap_layers(model, "a")
    with pytest.raises(ValueError, match="not installed"):
        unwrap_layers(model, "a")
    wrap_layers(model, "a", lambda i, inner, *args, **kw: inner(*args, **kw))  # free again once removed
    unwrap_layers(model, "a")


def test_wrapper_may_run_inner_twice_with_gradients():
    """A link may call the rest of the chain more than once (activation recompute does): gradients
    flow through the call whose output is returned. No KV cache: a second run would append its keys."""
    model, ids = _model(), _ids()
    model.zero_grad()
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]

    def twice(i, inner, *args, **kwargs):
        with torch.no_grad():
            inner(*args, **kwargs)
        return inner(*args, **kwargs)

    h = wrap_layers(model, "twice", twice)
    model.zero_grad()
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    for a, b in zip(ref, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    h.remove()


def test_models_package_does_not_import_trainer_or_algorithms():
    code = ("import sys, models.layer_wrap, models.anatomy; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('trainer', 'algorithms')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
