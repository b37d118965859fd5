"""TESD: hand-computed rewards, reliability and loss; groups normalised separately; both terms
train; metrics logged."""
from __future__ import annotations

import math

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
