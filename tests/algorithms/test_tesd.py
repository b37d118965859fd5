"""TESD: hand-computed rewards, reliability and loss; groups normalised separately; both terms
train; metrics logged."""
from __future__ import annotations

import math

import pytest
import torch

from algorithms.base import Batch, PolicyTerms, TeacherTerms
from algorithms.tesd import TESD, TESDConfig, copies_reference, independence, reliability

from selfdistill_helpers import arith, ctx, tiny, two_steps_change_every_trainable_parameter
from toy import ToyLM


def test_independence_and_reliability_hand_computed():
    cfg = TESDConfig()
    assert math.isclose(independence(-1.2, -0.9, False, False, cfg), -0.3)
    assert math.isclose(independence(-1.2, -0.9, True, False, cfg), -0.8)  # copy penalty 0.5
    assert independence(-0.5, -0.9, False, False, cfg) == 0.0  # more likely without the reference: clipped
    assert independence(-5.0, -0.1, False, True, cfg) == -1.0
    # rewards (B=2, G=2) with lambda 0.5: means 1.0 and -0.25 -> (1.5 / 1.5, 0.25 / 1.5)
    r = reliability(torch.tensor([[1.0, 1.0], [0.0, -0.5]]), 0.5)
    assert torch.allclose(r, torch.tensor([1.0, 0.25 / 1.5]))


def test_copies_reference():
    assert copies_reference([1, 2, 3, 4], [9, 2, 3, 4, 8], 3)
    assert not copies_reference([1, 2, 3, 4], [9, 2, 3, 8, 4], 3)
    assert not copies_reference([1, 2, 3], [1, 2, 3], 0)


def test_loss_hand_computed_student_and_teacher_terms():
    # Row 0 (student, group 0): token 1 with student [1/2, 1/2], teacher [1/4, 3/4], reliability 0.5.
    # Row 1 (teacher rollout, group 1): tokens [0, 1]; p(token 1 | token 0) = 1/2; advantage 2.
    model = ToyLM(torch.zeros(2, 2))
    th = torch.zeros(2, 2, 1, 2)
    th[0, 1, 0] = torch.tensor([0.0, math.log(3.0)])
    batch = Batch(torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2, dtype=torch.long), torch.tensor([[0, 1], [0, 1]]),
                  policy=PolicyTerms(torch.tensor([0.0, 2.0])), token_weights=torch.tensor([[0.0, 0.5], [0.0, 1.0]]),
                  teacher=TeacherTerms(th, (torch.eye(2), None)), row_group=torch.tensor([0, 1]), num_groups=2)
    algo = TESD(TESDConfig(temperature=1.0, beta=0.0, alpha=0.5))
    out = algo.loss(model, batch, torch.tensor([1.0, 1.0]))
    student = 0.5 * (0.25 * math.log(0.5) + 0.75 * math.log(1.5))  # reliability x KL(T || S)
    teacher = -2.0 * 1.0  # -A x ratio (ratio 1 on-policy)
    assert math.isclose(out.loss.item(), student + 0.5 * teacher, rel_tol=1e-5)
    # the teacher term's gradient is the policy gradient -A d log p / d theta (not 0 though the ratio is 1)
    out.loss.backward()
    assert model.model.embed.weight.grad.abs().sum() > 0


def test_batch_has_two_groups_normalised_separately():
    model, tok = tiny()
    task = arith()
    algo = TESD(TESDConfig(teacher_rollouts=2))
    examples = task.train_examples()[:3]
    batch = algo.make_batch(examples, ctx(model, tok, task))
    assert len(batch) == 3 + 3 * 2 and batch.num_groups == 2
    targets = batch.num_targets()
    assert targets.shape == (2,)
    assert targets[0] == batch.loss_mask[:3].sum() and targets[1] == batch.loss_mask[3:].sum()
    # student rows carry the reliability of their question; advantages sum to ~0 within each group
    assert torch.allclose(batch.policy.advantages[3:].view(3, 2).sum(1), torch.zeros(3), atol=1e-5)
    sel = batch.loss_mask[:3].bool()
    for b in range(3):
        w = batch.token_weights[b][sel[b]]
        assert torch.allclose(w, w[0].expand_as(w)) and 0 <= w[0] <= 1
    for key in ("tesd/teacher_correct", "tesd/independence", "tesd/reliability", "tesd/reliability_hist/0.0-0.2"):
        assert key in batch.metrics
    assert math.isclose(sum(v.item() for k, v in batch.metrics.items() if "hist" in k), 1.0, rel_tol=1e-6)
    # the trainer's rollout log-prob check holds for student and teacher rows alike
    out = algo.loss(model, batch, targets.float())
    mask = batch.loss_mask.bool()
    assert torch.allclose(out.token_logprobs[mask], batch.rollout_logprobs[mask], atol=1e-4)
    assert {"tesd/student_loss", "tesd/teacher_loss"} <= set(out.metrics)


def test_two_steps_change_every_parameter():
    model, tok = tiny()
    algo = TESD(TESDConfig(teacher_rollouts=2))
    unchanged, _ = two_steps_change_every_trainable_parameter(algo, model, tok, arith())
    assert not unchanged, unchanged


def _planted_correctness(spread_uids):
    """Correctness by design, for G = 2: 1 / 0 within the teacher group of a question in `spread_uids`,
    0 / 0 otherwise (calls come group by group, so their parity is the rollout's index in its group)."""
    calls = []

    def correctness(task, example, text):
        calls.append(1)
        return float(example.uid in spread_uids and len(calls) % 2 == 1)
    return correctness


def test_dynamic_sampling_fills_the_teacher_term_with_groups_that_spread():
    model, tok = tiny()
    task = arith()
    examples = task.train_examples()
    spread_uids = {ex.uid for ex in examples[1::3]}  # one question in three has teacher rollouts that differ
    algo = TESD(TESDConfig(teacher_rollouts=2, dynamic_sampling=True, dynamic_max_rounds=6, independence_weight=0.0))
    algo.correctness = _planted_correctness(spread_uids)
    chunks = iter([examples[i:i + 4] for i in range(4, len(examples), 4)])
    batch = algo.make_batch(examples[:4], ctx(model, tok, task, draw_examples=lambda: next(chunks)))
    # the student term keeps the step's own 4 questions; the teacher term holds 4 groups, all with spread:
    # examples[1] from the first round, then [4], [7], [10] from rounds 2 and 3 (1-2 per round by hand)
    assert batch.uids[:4] == [ex.uid for ex in examples[:4]]
    teacher = sorted({u.rsplit("/", 1)[0] for u in batch.uids[4:]})
    assert teacher == sorted(ex.uid for ex in (examples[1], examples[4], examples[7], examples[10]))
    assert len(batch) == 4 + 4 * 2 and (batch.policy.advantages[4:] != 0).all()
    m = batch.metrics
    assert m["rollout/generation_rounds"].item() == 3.0 and m["rollout/groups_filtered"].item() == 8.0
    assert m["rollout/dynamic_cap_hit"].item() == 0.0 and m["rollout/generated_per_trained_token"].item() >= 1.0
    # reliability comes from the step's own questions' teacher groups: mean correctness 1/2 on examples[1], 0 else
    # (lambda 0), so the student rows weigh 0, 1/2, 0, 0
    weights = [batch.token_weights[b][batch.loss_mask[b].bool()][0].item() for b in range(4)]
    assert weights == [0.0, 0.5, 0.0, 0.0]


def test_dynamic_sampling_stops_at_its_cap_and_trains_the_first_round():
    model, tok = tiny()
    task = arith()
    examples = task.train_examples()
    algo = TESD(TESDConfig(teacher_rollouts=2, dynamic_sampling=True, dynamic_max_rounds=2, independence_weight=0.0))
    algo.correctness = _planted_correctness(set())  # no group's correctness ever spreads
    chunks = iter([examples[i:i + 3] for i in range(3, len(examples), 3)])
    batch = algo.make_batch(examples[:3], ctx(model, tok, task, draw_examples=lambda: next(chunks)))
    assert [u.rsplit("/", 1)[0] for u in batch.uids[3:]] == [ex.uid for ex in examples[:3] for _ in range(2)]
    assert batch.metrics["rollout/dynamic_cap_hit"].item() == 1.0 and batch.metrics["rollout/generation_rounds"] == 2
    assert (batch.policy.advantages == 0).all()  # no spread: the teacher term is 0, the student term trains
    # with the independence term on, the same flat-correctness groups get advantages from it alone: the
    # default metric (correct) still filters them, as the rounds and the cap say
    algo = TESD(TESDConfig(teacher_rollouts=2, dynamic_sampling=True, dynamic_max_rounds=2))
    algo.correctness = _planted_correctness(set())
    chunks = iter([examples[i:i + 3] for i in range(3, len(examples), 3)])
    batch = algo.make_batch(examples[:3], ctx(model, tok, task, draw_examples=lambda: next(chunks)))
    assert batch.metrics["rollout/dynamic_cap_hit"].item() == 1.0 and batch.metrics["rollout/groups_filtered"] == 6


def test_dynamic_keys_are_checked():
    with pytest.raises(ValueError, match="algo.dynamic_max_rounds=0 must be >= 1"):
        TESDConfig(dynamic_max_rounds=0).validate()
    with pytest.raises(ValueError, match="algo.dynamic_metric=acc is not one of correct, reward"):
        TESDConfig(dynamic_metric="acc").validate()


def test_questions_the_teacher_always_or_never_solves_are_retired_from_the_teacher_term():
    model, tok = tiny()
    task = arith()
    a, b, c, d, *rest = task.train_examples()
    solved = {a.uid: [1.0, 1.0], b.uid: [0.0, 0.0]}  # a: the teacher always solves it, b: never; others mixed
    calls = []

    def correctness(task_, ex, text):
        calls.append(ex.uid)
        return solved.get(ex.uid, [1.0, 0.0])[(len(calls) - 1) % 2]

    algo = TESD(TESDConfig(teacher_rollouts=2, dynamic_sampling=True, dynamic_max_rounds=2, retire_after=2,
                           independence_weight=0.0))
    algo.correctness = correctness
    step = lambda: algo.make_batch([c, d], ctx(model, tok, task, draw_examples=lambda: [a, b]))  # noqa: E731
    first = step()  # c, d spread: no extra round, nothing visits a or b
    assert first.metrics["rollout/generation_rounds"] == 1 and algo.retirement.retired == {}
    calls.clear()
    # a round that draws a and b: their groups have no spread (filtered), one visit each
    ex_batch = algo.make_batch([a, b], ctx(model, tok, task, draw_examples=lambda: [a, b]))
    assert ex_batch.metrics["rollout/generation_rounds"] == 2 and ex_batch.metrics["rollout/retired_solved"] == 1
    assert algo.retirement.retired == {a.uid: "solved", b.uid: "unsolved"}  # 2 visits in a row each
    calls.clear()
    third = algo.make_batch([a, b], ctx(model, tok, task, draw_examples=lambda: [a, b]))
    # their own round still samples the teacher (the student's reliability needs it); the extra round skips them
    # (scored: the own round's 2 x 2 teacher rollouts, then the 2 student rollouts; nothing in round 2)
    assert calls == [a.uid, a.uid, b.uid, b.uid, a.uid, b.uid]
    assert third.metrics["rollout/retired_skipped"] == 2
    restored = TESD(TESDConfig(teacher_rollouts=2, dynamic_sampling=True, retire_after=2))
    restored.load_state_dict(algo.state_dict())
    restored.load_rank_state_dict(algo.rank_state_dict())
    assert restored.retirement.retired == algo.retirement.retired
    with pytest.raises(ValueError, match="algo.retire_after=2 must be >= 0, and > 0 only with algo.dynamic_sampling"):
        TESDConfig(retire_after=2).validate()
