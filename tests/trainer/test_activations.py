"""HiLoRe activation management: exactness of recompute, int8 error bounds, compression, the planner."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.loading import TinySpec, build_tiny
from trainer.activations import (COMPRESS, FULL, RECOMPUTE, ActivationConfig, Profile, Quantizer, UnitProfile,
                                 estimate, install, plan_units)

SPEC = TinySpec(hidden_size=64, num_layers=3, num_heads=4, intermediate_size=128)


def _model(dropout: float = 0.0):
    model, tok = build_tiny(SPEC, seed=0)
    if dropout:
        model.config.attention_dropout = dropout
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = dropout
    model.train()
    return model


def _ids(b=2, t=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 60, (b, t), generator=g)


def _step(model, ids, mgr=None, coef=None, rng_seed=None):
    model.zero_grad(set_to_none=True)
    if mgr is not None:
        mgr.set_exposure(coef)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    logp = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    adv = torch.linspace(-1, 1, ids.shape[0])[:, None]
    loss = -(adv * logp).sum() / logp.numel()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _flat(gs):
    return torch.cat([g.reshape(-1) for g in gs])


def test_checkpoint_mode_is_exact():
    model, ids = _model(), _ids()
    loss0, g0 = _step(model, ids)
    mgr = install(model, ActivationConfig(mode="checkpoint"))
    assert mgr.plan() == [RECOMPUTE] * 3
    loss1, g1 = _step(model, ids, mgr)
    assert torch.allclose(loss0, loss1, atol=1e-6)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-6)
    mgr.remove()


def test_recompute_with_dropout_preserves_rng():
    model, ids = _model(dropout=0.1), _ids()
    loss0, g0 = _step(model, ids, rng_seed=123)
    loss_other, _ = _step(model, ids, rng_seed=7)
    assert not torch.allclose(loss0, loss_other)  # dropout is active
    mgr = install(model, ActivationConfig(mode="checkpoint"))
    loss1, g1 = _step(model, ids, mgr, rng_seed=123)
    assert torch.allclose(loss0, loss1, atol=1e-6)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-6)
    mgr.remove()


def test_int8_round_trip_error_bound_by_hand():
    q = Quantizer("int8", group_size=4)
    x = torch.tensor([[0.5, -1.27, 0.3, 0.001], [10.0, 2.0, -3.3, 0.0]])
    p = q.pack(x)
    scale = torch.tensor([1.27 / 127, 10.0 / 127])
    assert torch.allclose(p.scale, scale)
    assert p.scale.dtype == torch.float32 and p.codes.dtype == torch.int8
    assert p.codes.tolist() == [[50, -127, 30, 0], [127, 25, -42, 0]]  # round(x / scale)
    y = q.unpack(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert ((y - x).abs() <= scale[:, None] / 2 + 1e-7).all()
    # a length that is not a multiple of the group size (zero-padded tail), bf16 round trip
    z = torch.randn(3, 7, dtype=torch.bfloat16)
    zz = Quantizer("int8", group_size=64).unpack(Quantizer("int8", group_size=64).pack(z))
    assert zz.dtype == torch.bfloat16 and zz.shape == z.shape
    assert (zz.float() - z.float()).abs().max() <= z.float().abs().max() / 127 / 2 + 1e-2


def test_stochastic_rounding_unbiased_and_fp8():
    x = torch.full((64 * 200,), 0.3)
    x[::64] = 1.27  # amax per group -> scale 0.01, 0.3 / 0.01 = 30 exactly; use 0.305 to be between codes
    x[1::64] = 0.305
    q = Quantizer("int8", group_size=64, stochastic=True, seed=0)
    y = q.unpack(q.pack(x))
    vals = y[1::64]
    assert set(torch.round(vals / 0.01).tolist()) <= {30.0, 31.0}
    assert abs(vals.mean().item() - 0.305) < 0.002
    if hasattr(torch, "float8_e4m3fn"):
        xr = torch.randn(4096)
        for stochastic in (False, True):
            f8 = Quantizer("fp8", group_size=64, stochastic=stochastic)
            rel = ((f8.unpack(f8.pack(xr)) - xr).norm() / xr.norm()).item()
            assert rel < 0.05


def test_compress_all_close_but_not_exact():
    model, ids = _model(), _ids(b=2, t=64)
    _, g0 = _step(model, ids)
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=1024))
    mgr.force_plan([COMPRESS] * 3)
    _, g1 = _step(model, ids, mgr)
    cos = F.cosine_similarity(_flat(g0).double(), _flat(g1).double(), dim=0).item()
    assert cos >= 0.99
    assert not torch.equal(_flat(g0), _flat(g1))
    assert mgr.metrics()["activations/compressed_bytes"].item() > 0
    mgr.remove()


def test_parameters_are_never_compressed():
    model, ids = _model(), _ids()
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=1))  # everything big enough
    mgr.force_plan([COMPRESS] * 3)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    pack, _ = mgr._hooks(0, {})
    seen = []
    for p in model.model.layers[0].parameters():
        out = pack(p)
        seen.append(out is p)
        view = p.t() if p.dim() == 2 else p.view(-1)
        assert pack(view) is view  # a view of a parameter (what F.linear saves) is kept as is
    assert all(seen)
    # whole run under compress: the linears' saved weights come back as the very parameters
    seen_ptrs = []
    orig_unpack = mgr._hooks

    def spy(i, kwargs):
        pk, up = orig_unpack(i, kwargs)

        def pk2(t):
            r = pk(t)
            if t.untyped_storage().data_ptr() in params:
                seen_ptrs.append(r is t)
            return r
        return pk2, up
    mgr._hooks = spy
    _step(model, ids, mgr)
    assert seen_ptrs and all(seen_ptrs)
    mgr.remove()


def test_install_remove_restores_forward():
    model = _model()
    before = [type(layer).forward for layer in model.model.layers]
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert install(model, ActivationConfig(mode="none")) is None
    mgr = install(model, ActivationConfig(mode="checkpoint"))
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    with pytest.raises(ValueError, match="already installed"):
        install(model, ActivationConfig(mode="checkpoint"))
    mgr.remove()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert [type(layer).forward for layer in model.model.layers] == before
    # the model still trains exactly after removal
    ids = _ids()
    _step(model, ids)


@pytest.mark.parametrize("key,kwargs,match", [
    ("mode", {"mode": "fast"}, "trainer.activations="),
    ("budget", {"memory_budget": 0.5}, r"trainer.activation_memory_budget=0.5 must be >= 1.0"),
    ("risk", {"risk_budget": -1.0}, "trainer.activation_risk_budget"),
    ("compress", {"compress": "int4"}, "trainer.activation_compress"),
])
def test_config_validation(key, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationConfig(**kwargs).validate()


# ------------------------------------------------------------------------------------------- planner

def _synthetic(n=6, grads=0.0, head=0.0, err=0.006):
    """Equal units: input 1 KB/token, 28 KB saved (input included), 8 KB compressed."""
    u = [UnitProfile(in_bytes=1e3, full_bytes=28e3, comp_bytes=8e3, max_tensor_bytes=4e3, input_saved=True,
                     fwd_s=1e-6, comp_s=0.4e-6, err=err, grad_bytes=grads) for _ in range(n)]
    return Profile(u, head_bytes_per_token=head)


def test_planner_rules():
    prof, tokens = _synthetic(), 1000
    # huge memory budget, zero risk budget: everything full
    assert plan_units(prof, tokens, 1.0, 100.0, 0.0).plan == [FULL] * 6
    # budget 1.0, zero risk: the checkpointing plan, except that the unit processed first in backward
    # (the last one) costs no peak when kept in full -- checkpointing it is pure overhead
    est = plan_units(prof, tokens, 1.0, 1.0, 0.0)
    assert est.plan == [RECOMPUTE] * 5 + [FULL]
    assert est.ratio <= 1.0 + 1e-9 and est.risk == 0.0
    # the rule for zero exposure: compression carries no risk, so no unit is recomputed when
    # compressing it fits the memory budget and (de)compression is cheaper than recompute
    all_c = estimate(prof, [COMPRESS] * 6, tokens, 0.0)
    est0 = plan_units(prof, tokens, 0.0, all_c.ratio, 0.0)
    assert RECOMPUTE not in est0.plan and est0.risk == 0.0
    assert est0.plan.count(COMPRESS) >= 1
    # same budget with exposure and no risk budget: compression is off, recompute remains
    est1 = plan_units(prof, tokens, 1.0, all_c.ratio, 0.0)
    assert COMPRESS not in est1.plan and RECOMPUTE in est1.plan
    # the risk budget caps the compressed units: err * E per unit
    est2 = plan_units(prof, tokens, 1.0, all_c.ratio, 0.0061 * 2)
    assert est2.plan.count(COMPRESS) <= 2 and est2.risk <= 0.0061 * 2


@pytest.mark.parametrize("budget", [1.0, 1.1, 1.3, 2.0])
@pytest.mark.parametrize("grads,head", [(0.0, 0.0), (5e6, 2e3)])
def test_planned_peak_within_budget(budget, grads, head):
    prof = _synthetic(n=8, grads=grads, head=head)
    for tokens in (100, 1000, 10000):
        for exposure in (0.0, 0.5, 1.0):
            est = plan_units(prof, tokens, exposure, budget, 0.05)
            assert est.ratio <= budget + 1e-9
            assert est.risk <= 0.05 + 1e-12
            assert est.time_s <= est.checkpoint_time_s


def test_longer_microbatch_rescales_plan():
    # parameter gradients are a fixed cost: short micro-batches have room to keep units, long ones not
    prof = _synthetic(n=8, grads=1e7)
    short, long = plan_units(prof, 500, 1.0, 1.1, 0.05), plan_units(prof, 50_000, 1.0, 1.1, 0.05)
    assert short.ratio <= 1.1 + 1e-9 and long.ratio <= 1.1 + 1e-9
    assert short.plan != long.plan
    assert short.plan.count(RECOMPUTE) < long.plan.count(RECOMPUTE)
    # the short plan applied to the long micro-batch would break the budget: re-planning is needed
    assert estimate(prof, short.plan, 50_000, 1.0).ratio > 1.1


def test_hilore_profiles_plans_and_replans():
    model = _model()
    ids = _ids(b=2, t=48)
    _, g0 = _step(model, ids)
    mgr = install(model, ActivationConfig(mode="hilore", memory_budget=1.3))
    coef = torch.ones(2, 47)
    _, g1 = _step(model, ids, mgr, coef)  # profiling step: recompute, exact
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, atol=1e-6)
    assert mgr.profile is not None and len(mgr.profile.units) == 3
    u = mgr.profile.units[0]
    assert u.full_bytes > u.comp_bytes > 0 and u.in_bytes == 64 * 4 and u.input_saved
    assert 0 < u.err < 0.02 and u.fwd_s > 0 and u.comp_s > 0
    _step(model, ids, mgr, coef)
    est = mgr.estimate()
    assert est.tokens == 2 * 48 and est.ratio <= 1.3 + 1e-9
    m = mgr.metrics()
    assert m["activations/recompute_units"] + m["activations/compressed_units"] + m["activations/full_units"] == 3
    # zero exposure (all advantages 0): no risk
    _step(model, ids, mgr, torch.zeros(2, 47))
    assert mgr.metrics()["activations/risk"].item() == 0.0
    assert mgr.metrics()["activations/exposure"].item() == 0.0
    # a longer micro-batch gets a plan made for its own length
    _step(model, _ids(b=4, t=48), mgr, torch.ones(4, 47))
    assert mgr.estimate().tokens == 4 * 48
    mgr.replan()
    assert mgr.profile is None
    mgr.remove()


def test_saved_tensors_with_inf_are_kept_exactly():
    """Shared-prompt replay saves attention masks filled with -inf inside the layers: compressing them
    would give an inf scale and nan gradients; they are kept as they are, the rest compressed."""
    from trainer.prompt_sharing import shared_prompt_logprobs

    model = _model()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 60, (12,), generator=g)
    ids = torch.stack([torch.cat([prompt, torch.randint(3, 60, (n,), generator=g), torch.zeros(20 - n, dtype=torch.long)])
                       for n in (20, 9, 14)])
    attn = (ids != 0).long()
    attn[:, :12] = 1
    lengths = torch.full((3,), 12)

    def grads():
        model.zero_grad(set_to_none=True)
        shared_prompt_logprobs(model, ids, attn, lengths).sum().backward()
        return _flat([p.grad for p in model.parameters()])

    exact = grads()
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=256))
    mgr.force_plan([COMPRESS] * 3)
    approx = grads()
    assert torch.isfinite(approx).all() and mgr.metrics()["activations/compressed_bytes"].item() > 0
    assert F.cosine_similarity(exact.double(), approx.double(), dim=0).item() >= 0.99
    mgr.force_plan(None)
    mgr.replan()  # profiling sees the same tensors: their error must not turn the risk into nan
    grads()
    grads()
    assert all(math.isfinite(u.err) for u in mgr.profile.units)
    assert all(math.isfinite(v.item()) for v in mgr.metrics().values())
    mgr.remove()


def test_gradient_scenarios_hand_computed():
    """2 units, 1000 tokens: input 1 MB, saved 28 MB (27 MB recompute transient), compressed 8 MB
    (4 MB dequantised transient), 10 MB of gradients per unit.
    Checkpointing: fresh max(29 + 10, 28 + 20) = 48 MB; accumulated 29 + 20 = 49 MB.
    [compress, recompute]: fresh max(9 + 27 + 10, 8 + 4 + 20) = 46 MB; accumulated 9 + 27 + 20 = 56 MB."""
    from trainer.activations import ACCUMULATED, FRESH

    prof = _synthetic(n=2, grads=10e6)
    fresh = estimate(prof, [COMPRESS, RECOMPUTE], 1000, 0.0, (FRESH,))
    accumulated = estimate(prof, [COMPRESS, RECOMPUTE], 1000, 0.0, (ACCUMULATED,))
    assert (fresh.peak, fresh.checkpoint_peak) == pytest.approx((46e6, 48e6))
    assert (accumulated.peak, accumulated.checkpoint_peak) == pytest.approx((56e6, 49e6))
    # budget 1.10: keeping the last unit in full fits while no gradient is held yet ([C, F]: fresh
    # max(36 + 10, 8 + 4 + 20) = 46 MB), not once they are all held (36 + 20 = 56 MB > 1.1 x 49)
    assert plan_units(prof, 1000, 0.0, 1.10, 1.0, (FRESH,)).plan == [COMPRESS, FULL]
    assert plan_units(prof, 1000, 0.0, 1.10, 1.0, (ACCUMULATED,)).plan == [COMPRESS, COMPRESS]


def test_manager_plans_for_the_gradients_it_finds():
    from trainer.activations import ACCUMULATED, FRESH

    model, ids = _model(), _ids(b=2, t=64)
    mgr = install(model, ActivationConfig(mode="hilore", min_numel=1024))
    _step(model, ids, mgr)  # profiling micro-batch
    _step(model, ids, mgr)  # zero_grad(set_to_none) first: a step's first micro-batch
    assert mgr._scenario == FRESH
    mgr.set_exposure(None)
    model(input_ids=ids).logits.sum().backward()  # grads now held: the next micro-batch accumulates
    mgr.set_exposure(None)
    model(input_ids=ids).logits.sum().backward()
    assert mgr._scenario == ACCUMULATED
    mgr.remove()
