"""Skipping micro-batches whose loss is exactly zero (GRPO rows with all-zero advantages): the
parameters after a step equal those of the unskipped run, the skip count is logged, nothing is skipped
with a KL term or under DeepSpeed, and under torchrun the ranks agree on what they skip."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from algorithms.base import Batch, Capabilities, PolicyTerms, capabilities
from algorithms.grpo import GRPO, GRPOConfig
from tests.conftest import ROOT
from tests.trainer.skip_helpers import grpo_session, patterned_batch
from trainer.distributed import World
from trainer.loop import skipped_micro_batches, train_step

KEY = "grpo/skipped_micro_batches"
SKIPPED = "train/skipped_steps"


def _params(s) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in s.backend.full_model().named_parameters()}


def _step_both(tmp_path, patterns):
    """Train the same patterned batches with skipping and without; returns (records, records, params, params)."""
    fast = grpo_session(tmp_path / "skip", World())
    full = grpo_session(tmp_path / "full", World(), skipping=False)
    assert all(torch.equal(a, b) for a, b in zip(_params(fast).values(), _params(full).values()))
    start = _params(fast)
    records = ([], [])
    for step, live in enumerate(patterns, 1):
        batch = patterned_batch(fast, live)
        for s, out in zip((fast, full), records):
            s.step = step
            out.append(train_step(s, batch))
    for s in (fast, full):
        s.tracker.close()
    return records, _params(fast), _params(full), start


def test_parameters_equal_the_unskipped_run(tmp_path):
    # step 1 mixes zero and non-zero micro-batches, the last one zero (the sync moves to micro-batch 2);
    # step 2 has only its last micro-batch non-zero
    patterns = [[True, False, True, False], [False, False, False, True]]
    (fast, full), after_fast, after_full, start = _step_both(tmp_path, patterns)
    for name, p in after_full.items():
        torch.testing.assert_close(after_fast[name], p, rtol=0, atol=1e-7, msg=name)
    assert all(not torch.equal(after_full[n], start[n]) for n in start)  # the comparison has teeth
    assert [r[KEY] for r in fast] == [2.0, 3.0]  # by hand: the zero micro-batches
    assert [r[SKIPPED] for r in fast] == [0, 0] and KEY not in full[0]
    for a, b in zip(fast, full):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def _optimizer_state(s) -> dict:
    return {k: (v.clone() if torch.is_tensor(v) else v) for st in s.backend.optimizer.state.values() for k, v in st.items()}


def test_an_empty_step_leaves_weights_optimizer_and_schedule_exactly_unchanged(tmp_path):
    """All micro-batches zero (every group without reward spread, no KL): no optimizer step. The
    unskipped path would still move the weights (AdamW's momentum from step 1), so 'unchanged' is
    what skipping the step buys."""
    s = grpo_session(tmp_path / "run", World())
    s.step = 1
    train_step(s, patterned_batch(s, [True, True, False, False]))  # a real step: Adam has moments now
    weights, opt, sched, lr = _params(s), s.backend.optimizer.state_dict(), s.backend.scheduler.state_dict(), s.backend.lr
    moments = {n: {k: v.clone() for k, v in st.items()} for n, st in s.backend.optimizer.state.items()}
    s.step = 2
    record = train_step(s, patterned_batch(s, [False] * 4))
    assert record[SKIPPED] == 1 and record[KEY] == 4.0 and record["loss"] == 0.0 and record["grad_norm"] == 0.0
    assert all(torch.equal(p, weights[n]) for n, p in _params(s).items())
    assert s.backend.scheduler.state_dict() == sched and s.backend.lr == lr
    assert opt["state"].keys() == s.backend.optimizer.state_dict()["state"].keys()
    for n, st in s.backend.optimizer.state.items():
        assert all(torch.equal(v, moments[n][k]) for k, v in st.items())
    full = grpo_session(tmp_path / "full", World(), skipping=False)  # without skipping the same step moves them
    full.step = 1
    train_step(full, patterned_batch(full, [True, True, False, False]))
    before = _params(full)
    full.step = 2
    train_step(full, patterned_batch(full, [False] * 4))
    assert any(not torch.equal(p, before[n]) for n, p in _params(full).items())
    for x in (s, full):
        x.tracker.close()


def _micro(adv, mask_rows=((1, 1, 1), (1, 1, 0))) -> Batch:
    mask = torch.tensor([[0, *r] for r in mask_rows])
    return Batch(torch.ones_like(mask), torch.ones_like(mask), mask, policy=PolicyTerms(torch.tensor(adv)))


def test_zero_loss_is_true_exactly_when_no_trained_token_has_an_advantage():
    algo = GRPO(GRPOConfig())
    assert capabilities(algo).zero_loss is not None
    assert algo.zero_loss(_micro([0.0, 0.0]))
    assert not algo.zero_loss(_micro([0.0, -0.5]))
    assert algo.zero_loss(_micro([0.0, 0.7], mask_rows=((1, 1, 1), (0, 0, 0))))  # the non-zero row trains nothing
    assert not algo.zero_loss(_micro([0.0, float("nan")]))  # a NaN advantage is not known to be zero


def test_zero_advantages_give_an_exactly_zero_gradient_and_a_kl_term_does_not():
    """The claim the skip rests on, checked on a real model: with beta = 0 a zero-advantage
    micro-batch's loss and every gradient are exactly 0; with beta > 0 (policy moved off its reference)
    they are not, and zero_loss says so."""
    from tests.algorithms.selfdistill_helpers import arith, ctx, tiny

    model, tok = tiny()
    task = arith()
    for beta in (0.0, 0.1):
        algo = GRPO(GRPOConfig(num_generations=2, beta=beta))
        algo.prepare_model(model)
        batch = algo.make_batch(task.train_examples()[:2], ctx(model, tok, task, max_new_tokens=8))
        batch.policy.advantages = torch.zeros(len(batch))
        if beta:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        model.zero_grad()
        out = algo.loss(model, batch, batch.num_targets().float())
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if beta == 0.0:
            assert algo.zero_loss(batch) and out.loss.item() == 0.0
            assert grads and all(not g.any() for g in grads)
        else:
            assert not algo.zero_loss(batch) and out.loss.item() > 0.0
            assert any(g.any() for g in grads)


def test_beta_never_skips(tmp_path):
    s = grpo_session(tmp_path / "kl", World(), "algo.beta=0.1")
    batch = patterned_batch(s, [False, False, True, False])
    record = train_step(s, batch)
    s.tracker.close()
    assert record[KEY] == 0.0


def test_deepspeed_skips_whole_empty_steps_only_and_algorithms_without_the_capability_nothing():
    algo = GRPO(GRPOConfig())
    session = SimpleNamespace(caps=capabilities(algo), world=World(), backend=SimpleNamespace())
    assert skipped_micro_batches(session, [_micro([0.0, 0.0])] * 3) == [True] * 3  # an empty step
    mixed = [_micro([0.0, 0.0]), _micro([0.0, 1.0]), _micro([0.0, 0.0])]
    assert skipped_micro_batches(session, mixed) == [True, False, True]
    from trainer.backends import DeepSpeedBackend

    session.backend = SimpleNamespace(fixed_micro_steps=DeepSpeedBackend.fixed_micro_steps)
    assert skipped_micro_batches(session, mixed) == [False] * 3  # its count of backwards must be reached
    assert skipped_micro_batches(session, [_micro([0.0, 0.0])] * 3) == [True] * 3  # none at all: no step either
    session = SimpleNamespace(caps=Capabilities(), world=World(), backend=SimpleNamespace())  # e.g. SFT
    assert skipped_micro_batches(session, [_micro([0.0, 0.0])] * 3) == [False] * 3


@pytest.mark.slow  # torchrun with 2 ranks
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_two_ranks_agree_on_what_they_skip(tmp_path, subprocess_env, backend):
    """Rank 0's micro-batches are all zero, rank 1's are not (step 1), then both all zero (step 2):
    no hang, both ranks skip the same micro-batches, the weights after step 1 equal the unskipped
    2-rank run's, and the empty step 2 leaves them as they were on both ranks (the unskipped run moves)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer" / "skip_worker.py"), str(tmp_path), backend]
    proc = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    # step 1: rank 0 [0 0 0 0], rank 1 [0 1 1 0] -> micro-batches 0 and 3 skipped on both (the sync on 2);
    # step 2: all zero everywhere -> the whole step
    assert result["skipped"] == [[0, 3], [0, 1, 2, 3]] and result["same_skips_on_ranks"]
    assert result["counts"] == [2.0, 4.0] and result["skipped_steps"] == [0, 1]
    assert result["step1_diff_vs_unskipped"] <= 1e-6
    assert not result["empty_step_moved"] and result["unskipped_empty_step_moved"]
    assert result["max_diff_between_ranks"] == 0.0
