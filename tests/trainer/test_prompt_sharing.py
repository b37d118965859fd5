"""AugTree shared-prompt replay equals the flattened computation (log-probs and every parameter
gradient, fp32), and the replay planner follows its documented cost model."""
from __future__ import annotations

import pytest
import torch

from models.loading import TinySpec, build_tiny
from trainer.prompt_sharing import (CostParams, flattened_logprobs, pack_groups, plan_replay, replay_costs,
                                    shared_prompt_logprobs)

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    m, _ = build_tiny(TinySpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128), seed=0)
    return m


def batch(rows: list[tuple[int, int]], seed: int = 0, extra_pad: int = 2):
    """rows: (prompt id, completion length); prompt id k -> a fixed random prompt of length PROMPTS[k]."""
    g = torch.Generator().manual_seed(seed)
    prompts = {k: torch.randint(3, 62, (n,), generator=g) for k, n in PROMPT_LENS.items()}
    T = max(prompts[k].numel() + c for k, c in rows) + extra_pad
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    plens = []
    for b, (k, c) in enumerate(rows):
        p = prompts[k]
        ids[b, : p.numel()] = p
        ids[b, p.numel(): p.numel() + c] = torch.randint(3, 62, (c,), generator=g)
        ids[b, p.numel() + c:] = torch.randint(3, 62, (T - p.numel() - c,), generator=g)  # pad content must not matter
        mask[b, : p.numel() + c] = 1
        plens.append(p.numel())
    weights = torch.randn(len(rows), T, generator=g)
    return ids, mask, torch.tensor(plens), weights


PROMPT_LENS = {0: 9, 1: 5, 2: 1}


def run(fn, model, ids, mask, plens, weights, temperature):
    model.zero_grad()
    lp = fn(model, ids, mask, plens, temperature=temperature)
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


CASES = {
    "G1": [(0, 6)],
    "G3_unequal": [(0, 4), (0, 7), (0, 2)],
    "two_prompts_interleaved": [(0, 5), (1, 3), (0, 2), (1, 6), (0, 4), (1, 1)],
    "prompt_len_1": [(2, 4), (2, 6), (2, 3)],
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_equals_flattened(model, name, temperature):
    ids, mask, plens, weights = batch(CASES[name])
    ref, ref_grads = run(flattened_logprobs, model, ids, mask, plens, weights, temperature)
    got, grads = run(shared_prompt_logprobs, model, ids, mask, plens, weights, temperature)
    n_completion = int((mask.sum(-1) - plens).sum())
    assert int((ref != 0).sum()) == n_completion  # log-probs exactly at the completion tokens
    assert torch.equal(got != 0, ref != 0)
    assert (got - ref).abs().max() < TOL * max(1.0, ref.abs().max().item())
    for n in ref_grads:
        scale = ref_grads[n].abs().max().clamp_min(1e-12)
        assert ((grads[n] - ref_grads[n]).abs().max() / scale) < TOL, n


def test_prompt_shared_once(model):
    ids, mask, plens, _ = batch(CASES["two_prompts_interleaved"])
    packed, pos, seg, _ = pack_groups(ids, mask, plens)
    assert packed.shape[0] == 2  # one packed row per distinct prompt
    assert packed.shape[1] == max(9 + 5 + 2 + 4, 5 + 3 + 6 + 1)
    assert pos[0, 9].item() == 9 and pos[0, 9 + 5].item() == 9  # every response starts at the prompt length


def test_chunking_and_no_grad(model):
    ids, mask, plens, _ = batch(CASES["G3_unequal"])
    with torch.no_grad():
        a = shared_prompt_logprobs(model, ids, mask, plens, chunk=3)
        b = flattened_logprobs(model, ids, mask, plens)
    assert (a - b).abs().max() < TOL


def test_eager_attention_matches(model):
    ids, mask, plens, weights = batch(CASES["G3_unequal"])
    ref, _ = run(flattened_logprobs, model, ids, mask, plens, weights, 1.0)
    model.config._attn_implementation = "eager"
    try:
        got, _ = run(shared_prompt_logprobs, model, ids, mask, plens, weights, 1.0)
    finally:
        model.config._attn_implementation = "sdpa"
    assert (got - ref).abs().max() < TOL


# --- planner ------------------------------------------------------------------------------------


def test_planner_single_rank():
    assert plan_replay(1024, [64] * 8, 8, 1).mode == "shared"
    p = plan_replay(512, [64], 1, 1)
    assert p.mode == "flattened" and p.degree == 1  # nothing shared: same cost, simpler


def test_planner_prompt_dominated_picks_owners():
    p = plan_replay(32768, [256] * 4, 4, 8)
    assert p.mode == "owners" and 2 <= p.degree <= 8


def test_planner_response_dominated_picks_lanes():
    p = plan_replay(256, [8192] * 16, 16, 8)
    assert p.mode == "lanes" and p.degree * p.lanes <= 8


def test_planner_tiny_work_stays_local():
    p = plan_replay(16, [4] * 2, 2, 8)  # communication latency dwarfs the compute: no context parallelism
    assert p.mode in ("shared", "flattened") and p.degree == 1


@pytest.mark.parametrize("args", [(1024, [64] * 8, 8, 2), (4096, [512] * 8, 8, 4), (128, [2048] * 4, 4, 4),
                                  (100000, [100] * 2, 2, 16)])
def test_planner_follows_cost_model(args):
    plan = plan_replay(*args)
    costs = replay_costs(*args, CostParams())
    assert plan.est_cost == pytest.approx(min(costs.values()))
    assert plan.degree <= args[3] and plan.degree * plan.lanes <= args[3]
    assert plan.costs[f"{plan.mode}/{plan.degree}/{plan.lanes}"] == plan.est_cost
