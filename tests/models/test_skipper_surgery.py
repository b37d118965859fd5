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


@pytest.mark.parametrize("gate", ["hard", "soft"])
def test_decision_gradient_is_the_branch_difference_straight_through(gate):
    """With decision_grad the forward value is unchanged and d loss / d g of every token gains
    <d loss / d out, ran - skipped> (hard gate: that is all of it), ran and skipped computed by hand."""
    m = model()
    state = apply_skipper(m, make_spec(m.config, layers=[1], gate=gate), seed=4)
    layer = m.model.layers[1]
    x = torch.randn(1, 6, 64)
    cos_sin = m.model.rotary_emb(x, torch.arange(6)[None])
    v = torch.randn(1, 6, 64)

    def run(flag):
        state.decision_grad = flag
        with record_gates(m) as rec:
            out = layer(x, position_embeddings=cos_sin, attention_mask=None)
        rec.logits[1].retain_grad()
        (out * v).sum().backward()
        return out.detach(), rec.logits[1].grad.clone(), rec.gates[1].detach()

    plain_out, plain_grad, g = run(False)
    m.zero_grad()
    out, grad, _ = run(True)
    assert torch.equal(out, plain_out)
    with torch.no_grad():
        h = layer.input_layernorm(x)
        attn, _ = layer.self_attn(hidden_states=h, position_embeddings=cos_sin, attention_mask=None)
        after = x + attn
        mlp = layer.mlp(layer.post_attention_layernorm(after))
        run_mask = (g > 0.5)[..., None]
        s_run, s_skip = (g, 1 - g) if gate == "soft" else (run_mask[..., 0].float(), 1 - run_mask[..., 0].float())
        ran = after + s_run[..., None] * mlp
        skipped = x + s_skip[..., None] * layer.skipper.adapter(h)
        extra = ((ran - skipped) * v).sum(-1) * g * (1 - g)  # d/d logit = d/d g * sigmoid'
    expected = extra if gate == "hard" else plain_grad + extra
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4)
