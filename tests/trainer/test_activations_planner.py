"""trainer/activations/planner.py: the pure planner on synthetic profiles (rules, budgets, the
gradient scenarios computed by hand). No model, no torch."""
from __future__ import annotations

import pytest

from trainer.activations import COMPRESS, FULL, RECOMPUTE, Profile, UnitProfile, estimate, plan_units


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
