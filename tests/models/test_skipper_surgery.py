"""The skipper surgery itself (models/skipper.py): layer checks, the gate arithmetic by hand, removal,
and deep copies that route through their own layers."""
from __future__ import annotations

import copy

import pytest
import torch

from models.loading import random_qwen3
from models.skipper import (
    SkipperError, apply_skipper, check_layers, default_layers, forced, gate_scales, make_spec, record_gates,
    remove_skipper,
)


def model():
    return random_qwen3(64, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128).eval()


def test_layer_choices_and_their_errors():
    assert default_layers(12) == (6, 7, 8, 9, 10, 11) and default_layers(5) == (3, 4)
    assert check_layers([3, 1], 4) == (1, 3)
    with pytest.raises(ValueError, match=r"algo.layers=\[1, 7\]: \[7\] outside the model's 4 layers \(0..3\)"):
        check_layers([1, 7], 4, key="algo.layers")
    with pytest.raises(ValueError, match="names a layer twice"):
        check_layers([2, 2], 4)
    with pytest.raises(ValueError, match="gate='x' is not one of soft, hard"):
        make_spec(model().config, gate="x")


def test_gate_arithmetic_by_hand():
    g = torch.tensor([0.2, 0.5, 0.7], requires_grad=True)
    run, s_run, s_skip = gate_scales(g, "soft")
    assert run.tolist() == [False, False, True]  # strictly above 0.5 runs
    assert torch.allclose(s_run, g) and torch.allclose(s_skip, 1 - g)
    run, s_run, s_skip = gate_scales(g, "hard")
    assert s_run.tolist() == [0.0, 0.0, 1.0] and s_skip.tolist() == [1.0, 1.0, 0.0]
    s_run.sum().backward()  # straight through: d s_run / d g = 1
    assert g.grad.tolist() == [1.0, 1.0, 1.0]


def test_remove_restores_the_base_and_a_second_apply_is_refused():
    m = model()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        base = m(ids).logits
    apply_skipper(m, make_spec(m.config))
    with pytest.raises(SkipperError, match="already has a skipper"):
        apply_skipper(m, make_spec(m.config))
    remove_skipper(m)
    assert not any(".skipper." in k for k in m.state_dict())
    with torch.no_grad():
        assert torch.equal(m(ids).logits, base)


def test_a_deep_copy_routes_through_its_own_layers_and_state():
    m = model()
    apply_skipper(m, make_spec(m.config), seed=2)
    c = copy.deepcopy(m)
    with torch.no_grad():
        for layer in c.model.layers[2:]:
            layer.skipper.router.head.weight.mul_(500)  # only the copy's routers change
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad(), record_gates(c) as rc, record_gates(m) as rm:
        c(ids), m(ids)
    assert set(rc.gates) == set(rm.gates) == {2, 3}  # each model recorded into its own state
    assert not torch.equal(rc.logits[3], rm.logits[3])
    with torch.no_grad(), forced(c, "run"):
        forced_copy = c(ids).logits
    with torch.no_grad():
        routed_original = m(ids).logits
    remove_skipper(m)
    with torch.no_grad():
        assert torch.equal(forced_copy, m(ids).logits)  # the copy forced to run is the base
        assert not torch.equal(routed_original, forced_copy)
