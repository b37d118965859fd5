"""MASS: exact reduction to OPSD, hand-computed aggregation/gate/influence pieces, views, adaptive
masking concentrating on the influential span, every parameter changes, accumulation invariance."""
from __future__ import annotations

import math
import random

import torch

from algorithms.base import Batch, TeacherTerms
from algorithms.mass import (
    MASS, InfluenceTracker, MASSConfig, draw_mask, mask_probs, masked_count, span_influence, split_spans,
)
from algorithms.opsd import OPSD, OPSDConfig

from selfdistill_helpers import arith, ctx, grads, tiny, two_steps_change_every_trainable_parameter
from toy import ToyLM


def test_reduces_exactly_to_opsd():
    model, tok = tiny()
    task = arith()
    examples = task.train_examples()[:4]
    mass = MASS(MASSConfig(num_views=1, mask_ratio=0.0, gate=False))
    opsd = OPSD(OPSDConfig())
    b_mass, b_opsd = mass.make_batch(examples, ctx(model, tok, task)), opsd.make_batch(examples, ctx(model, tok, task))
    assert torch.equal(b_mass.input_ids, b_opsd.input_ids)
    assert torch.equal(b_mass.teacher.hidden, b_opsd.teacher.hidden)
    g_mass, g_opsd = grads(model, mass, b_mass, 4), grads(model, opsd, b_opsd, 4)
    loss_mass = mass.loss(model, b_mass, b_mass.num_targets().float()).loss
    loss_opsd = opsd.loss(model, b_opsd, b_opsd.num_targets().float()).loss
    assert torch.equal(loss_mass, loss_opsd)
    assert all(torch.equal(g_mass[n], g_opsd[n]) for n in g_opsd)


def test_loss_hand_computed_with_two_views_and_gate_weights():
    # student [1/2, 1/2]; views [0.2, 0.8] and [0.6, 0.4] -> mean-of-probs teacher [0.4, 0.6]
    model = ToyLM(torch.zeros(2, 2))
    th = torch.zeros(1, 3, 2, 2)
    th[0, 1, 0], th[0, 1, 1] = torch.tensor([0.2, 0.8]).log(), torch.tensor([0.6, 0.4]).log()
    th[0, 2] = th[0, 1]
    batch = Batch(torch.tensor([[0, 1, 0]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]]),
                  teacher=TeacherTerms(th, (torch.eye(2), None)),
                  token_weights=torch.tensor([[0.0, 1.0, 0.0]]))  # gate keeps token 1 only
    algo = MASS(MASSConfig(temperature=1.0, beta=0.0))
    # forward KL(T || S) = 0.4 ln(0.4/0.5) + 0.6 ln(0.6/0.5), weight 1 on token 1, 0 on token 2, normaliser 2
    expected = (0.4 * math.log(0.8) + 0.6 * math.log(1.2)) / 2
    assert math.isclose(algo.loss(model, batch, torch.tensor(2.0)).loss.item(), expected, rel_tol=1e-5)


def test_masked_count_and_draw_mask():
    assert [masked_count(n, 0.3) for n in (0, 1, 2, 3, 10)] == [0, 0, 1, 1, 3]
    assert masked_count(5, 0.0) == 0 and masked_count(5, 1.0) == 5
    mask = draw_mask(random.Random(0), [0.25] * 4, 2)
    assert sum(mask) == 2
    assert draw_mask(random.Random(0), [0.0, 1.0, 0.0], 1) == [False, True, False]


def test_views_mask_the_reference_spans():
    model, tok = tiny()
    task = arith()
    ex = task.train_examples()[0]
    algo = MASS(MASSConfig(num_views=3, mask_ratio=0.5, adaptive_masking=False))
    refs, masks, focus = algo.views(ex, task, tok)
    spans = task.solution_spans(ex.solution)
    assert len(refs) == 3 and focus == 1.0
    for ref, mask in zip(refs, masks):
        assert sum(mask) == masked_count(len(spans), 0.5)
        assert ref.count(task.mask_token) >= sum(mask)
        for span, hidden in zip(spans, mask):
            assert (span.strip() in ref) != hidden or span.strip() in "".join(s for s, h in zip(spans, mask) if not h)
    assert "".join(split_spans(ex.solution, task, tok, "tokens", 5)) == ex.solution


def test_span_influence_and_mask_probs_hand_computed():
    # view 0 masked spans {0, 1} and moved the teacher 0.4; view 1 masked {1} and moved it 0.1
    est = span_influence([[True, True, False], [False, True, False]], [0.4, 0.1])
    assert est[0] == 0.2 and math.isclose(est[1], (0.2 + 0.1) / 2) and est[2] is None
    # scores [1, 1, 4], mean 2: softmax([0.5, 0.5, 2]) mixed half-half with uniform
    p = mask_probs([1.0, 1.0, 4.0], 3, 0.5, 1.0)
    e = [math.exp(0.5), math.exp(0.5), math.exp(2.0)]
    assert all(math.isclose(p[i], 0.5 / 3 + 0.5 * e[i] / sum(e)) for i in range(3))
    assert mask_probs(None, 4, 0.5, 1.0) == [0.25] * 4


def test_adaptive_masking_concentrates_on_the_influential_span():
    tracker = InfluenceTracker(decay=0.5, buckets=4)
    assert tracker.scores("new", 4) is None
    for _ in range(5):  # masking span 2 always moves the teacher, the others barely
        tracker.update("q1", [0.01, 0.01, 0.5, 0.01])
    probs = mask_probs(tracker.scores("q1", 4), 4, 0.5, 1.0)
    assert probs[2] > 0.5 and max(probs[:2] + probs[3:]) < 0.2
    prior = tracker.scores("unseen", 4)  # the position prior carries it to new questions
    assert prior is not None and prior[2] == max(prior)
    restored = InfluenceTracker(0.5, 4)
    restored.load_state_dict(tracker.state_dict())
    assert restored.scores("q1", 4) == tracker.scores("q1", 4)


def test_gate_sets_token_weights_and_logs_kept_fraction():
    model, tok = tiny()
    task = arith()
    algo = MASS(MASSConfig(gate_margin=-1.0, gate_agreement_quantile=0.5))  # correction test always passes
    batch = algo.make_batch(task.train_examples()[:4], ctx(model, tok, task))
    sel = batch.loss_mask.bool()
    kept = batch.token_weights[sel]
    assert set(kept.unique().tolist()) <= {0.0, 1.0} and batch.token_weights[~sel].sum() == 0
    assert math.isclose(batch.metrics["mass/kept_fraction"].item(), kept.mean().item())
    assert 0.4 <= kept.mean().item() <= 0.7  # about half at quantile 0.5 (ties may keep more)
    for key in ("mass/view_disagreement", "mass/correction", "mass/mask_focus"):
        assert key in batch.metrics


def test_two_steps_change_every_parameter():
    model, tok = tiny()
    algo = MASS(MASSConfig(gate_margin=0.0))
    unchanged, _ = two_steps_change_every_trainable_parameter(algo, model, tok, arith())
    assert not unchanged, unchanged


def test_grad_accumulation_invariance():
    model, tok = tiny()
    task = arith()
    algo = MASS(MASSConfig(gate_margin=0.0))
    batch = algo.make_batch(task.train_examples()[:6], ctx(model, tok, task))
    full, accumulated = grads(model, algo, batch, 6), grads(model, algo, batch, 2)
    for name in full:
        assert torch.allclose(full[name], accumulated[name], atol=1e-6, rtol=1e-4), name
