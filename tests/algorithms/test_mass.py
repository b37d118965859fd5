"""MASS: exact reduction to OPSD, hand-computed aggregation/gate/influence pieces, views, adaptive
masking concentrating on the influential span, every parameter changes, accumulation invariance."""
from __future__ import annotations

import math
import random

import torch

from algorithms.base import Batch, TeacherTerms
from algorithms import losses
from algorithms.mass import (
    MASS, InfluenceTracker, MASSConfig, draw_views, gate_tokens, mask_probs, mask_rates, view_evidence,
    span_influence, split_spans,
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
    algo = MASS(MASSConfig(temperature=1.0, beta=0.0, aggregate="mean"))
    # forward KL(T || S) = 0.4 ln(0.4/0.5) + 0.6 ln(0.6/0.5), weight 1 on token 1, 0 on token 2, normaliser 2
    expected = (0.4 * math.log(0.8) + 0.6 * math.log(1.2)) / 2
    assert math.isclose(algo.loss(model, batch, torch.tensor(2.0)).loss.item(), expected, rel_tol=1e-5)


def test_mask_rates_and_distinct_bernoulli_views():
    assert mask_rates([0.25] * 4, 0.3) == [0.3] * 4
    assert mask_rates([0.7, 0.1, 0.1, 0.1], 0.5) == [1.0, 0.2, 0.2, 0.2]  # capped at 1
    rng = random.Random(0)
    for _ in range(50):  # 3 spans, 8 possible masks: 4 views are always distinct
        views = draw_views(rng, [0.3, 0.3, 0.3], 4)
        assert len({tuple(v) for v in views}) == 4
    # the unmasked reference is a possible view, and is drawn about (1 - 0.3)^3 of the time
    first = [tuple(draw_views(rng, [0.3] * 3, 1)[0]) for _ in range(4000)]
    assert abs(first.count((False, False, False)) / 4000 - 0.7 ** 3) < 0.03
    views = draw_views(rng, [0.9, 0.9, 0.9], 4, full_first=True)  # the whole reference first, then masked draws
    assert views[0] == [False] * 3 and len({tuple(v) for v in views}) == 4
    # with fewer possible masks than views, views repeat rather than loop forever
    assert draw_views(rng, [0.0, 1.0], 3) == [[False, True]] * 3
    assert len({tuple(v) for v in draw_views(rng, [0.5], 4)}) == 2


def test_views_mask_the_reference_spans():
    model, tok = tiny()
    task = arith(steps=4)
    ex = task.train_examples()[0]
    algo = MASS(MASSConfig(num_views=4, mask_ratio=0.5, adaptive_masking=False))
    refs, masks, focus = algo.views(ex, task, tok)
    spans = task.solution_spans(ex.solution)
    assert len(refs) == 4 and focus == 1.0 and len({tuple(m) for m in masks}) == 4
    for ref, mask in zip(refs, masks):
        assert ref.count(task.mask_token) >= sum(mask)
        for span, hidden in zip(spans, mask):
            assert (span.strip() in ref) != hidden or span.strip() in "".join(s for s, h in zip(spans, mask) if not h)
    assert "".join(split_spans(ex.solution, task, tok, "tokens", 5)) == ex.solution


def test_ranks_draw_different_masks_and_their_state_resumes_exactly():
    model, tok = tiny()
    task = arith(steps=4)
    ex = task.train_examples()[0]
    draws = {}
    for rank in (0, 1):
        algo = MASS(MASSConfig(num_views=4, mask_ratio=0.5))
        draws[rank] = [algo.views(ex, task, tok, rank)[1] for _ in range(5)]
    assert draws[0] != draws[1]
    a = MASS(MASSConfig(num_views=4, mask_ratio=0.5))
    a.views(ex, task, tok, 1)
    a.influence.update(ex.uid, [0.1, None, 0.3, 0.2, 0.0])
    b = MASS(MASSConfig(num_views=4, mask_ratio=0.5))
    b.load_rank_state_dict(a.rank_state_dict())
    assert [a.views(ex, task, tok, 1)[1] for _ in range(3)] == [b.views(ex, task, tok, 1)[1] for _ in range(3)]


def test_revisiting_an_example_whose_span_no_view_masked():
    # the crash case: an update leaves a span without an estimate; the next visit must still draw masks
    tracker = InfluenceTracker(decay=0.5, buckets=2)
    tracker.update("q", span_influence([[True, False, False], [True, False, False]], [0.3, 0.1]))
    # span 0: its own 0.2; span 1 shares span 0's position bucket (prior 0.2); span 2: unknown -> their mean
    assert tracker.scores("q", 3) == [0.2, 0.2, 0.2]
    tracker.update("q", [None, 0.6, None])
    assert tracker.scores("q", 3) == [0.2, 0.6, 0.4]
    assert InfluenceTracker(0.5, 2).scores("new", 3) is None
    scores = tracker.scores("q", 3)
    assert math.isclose(sum(mask_probs(scores, 3, 0.5, 1.0)), 1.0)
    # end to end: a task whose references have 3 spans, revisited many times
    model, tok = tiny()
    task = arith()
    algo = MASS(MASSConfig(num_views=2, mask_ratio=0.2, influence_decay=0.5))
    examples = task.train_examples()[:2]
    for step in range(6):
        algo.make_batch(examples, ctx(model, tok, task, seed=step))
    for ex in examples:
        assert None in algo.influence.by_uid[ex.uid] or algo.influence.scores(ex.uid, 3) is not None


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


def _stats(student, views):
    """self_distill_diagnostics on hand-made distributions: student (N, V) probs, views (N, K, V) probs;
    an identity head turns log-probs back into the same distributions at temperature 1."""
    v = len(student[0])
    return losses.self_distill_diagnostics(torch.tensor(student).log(), None, torch.tensor(views).log(),
                                           (torch.eye(v), None), temperature=1.0)


def test_gate_keeps_a_planted_correction_and_drops_agreement_and_lost_information():
    stats = _stats(
        [[0.8, 0.1, 0.1],   # token 0: the student is sure of 0, every view says 1 -> a correction the views back
         [0.6, 0.3, 0.1],   # token 1: every view agrees with the student exactly -> nothing to transfer
         [0.6, 0.3, 0.1],   # token 2: one view knows 1, three (their span masked) guess 2 -> support 1/4
         [0.6, 0.3, 0.1]],  # token 3: views a little sharper than the student (excess mass 0.02)
        [[[0.1, 0.8, 0.1]] * 4,
         [[0.6, 0.3, 0.1]] * 4,
         [[0.005, 0.99, 0.005], [0.3, 0.2, 0.5], [0.3, 0.2, 0.5], [0.3, 0.2, 0.5]],
         [[0.62, 0.28, 0.1]] * 4])
    assert math.isclose(stats["correction"][0].item(), 0.7, rel_tol=1e-5)  # 0.8 - 0.1 on token 1
    assert stats["correction"][1].item() < 1e-6 and stats["support"][2].item() == 0.25
    assert math.isclose(stats["correction"][3].item(), 0.02, rel_tol=1e-3)
    for aggregate in ("geometric", "mean", "backed", "confident"):
        stats_a = _stats([[0.8, 0.1, 0.1]], [[[0.1, 0.8, 0.1]] * 4]) if aggregate != "geometric" else stats
        assert gate_tokens(stats_a, MASSConfig(aggregate=aggregate)).tolist()[0] is True
    assert gate_tokens(stats, MASSConfig()).tolist() == [True, False, False, True]  # the default: margin 0
    assert gate_tokens(stats, MASSConfig(gate_margin=0.05)).tolist() == [True, False, False, False]
    # without the support test the lost-information token passes on its correction mass alone
    assert gate_tokens(stats, MASSConfig(gate_support=0.0)).tolist() == [True, False, True, True]
    # the agreement-quantile gate drops the most disputed tokens, corrections among them
    assert gate_tokens(stats, MASSConfig(gate_support=0.0, gate_agreement_quantile=0.5)).tolist()[2] is False


def test_gate_sets_token_weights_and_logs_kept_fractions():
    model, tok = tiny()
    task = arith()
    algo = MASS(MASSConfig(gate_margin=0.0, gate_support=0.0, gate_agreement_quantile=0.5))
    batch = algo.make_batch(task.train_examples()[:4], ctx(model, tok, task))
    sel = batch.loss_mask.bool()
    kept = batch.token_weights[sel]
    assert set(kept.unique().tolist()) <= {0.0, 1.0} and batch.token_weights[~sel].sum() == 0
    assert math.isclose(batch.metrics["mass/kept_fraction"].item(), kept.mean().item())
    assert 0.4 <= kept.mean().item() <= 0.7  # about half at quantile 0.5 (ties may keep more)
    for key in ("mass/view_disagreement", "mass/correction", "mass/mask_focus", "mass/masked_share",
                "mass/distinct_views", "mass/correction_tokens"):
        assert key in batch.metrics
    # kept_correction_fraction by hand: tokens whose aggregated top is not the sampled one and is under-weighted
    hidden = algo_student_stats(algo, model, batch)
    corrects = (hidden["teacher_top"] != batch.input_ids[sel]) & (hidden["top_gap"] > 0)
    if corrects.any():
        assert math.isclose(batch.metrics["mass/kept_correction_fraction"].item(),
                            kept[corrects].mean().item(), rel_tol=1e-6)


def algo_student_stats(algo, model, batch):
    from algorithms.scoring import detached_head, predicting
    from models.anatomy import final_hidden
    sel = batch.loss_mask.bool()
    student = predicting(final_hidden(model, batch.input_ids, batch.attention_mask))[sel]
    return losses.self_distill_diagnostics(student, detached_head(model), batch.teacher.hidden[sel], batch.teacher.head,
                                           temperature=algo.cfg.temperature)


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


def test_view_evidence_is_how_well_each_view_explains_the_completion_so_far():
    # one row: a prompt position (not a completion token), then completion tokens y = [0, 1, 1];
    # identity head, so the hidden states are the views' log-probs. View A: p(0)=0.8 everywhere;
    # view B: p(0)=0.2. Before y0: uniform. Before y1 (y0 = 0): (0.8, 0.2). Before y2 (y0 y1 = 0 1):
    # (0.8 x 0.2, 0.2 x 0.8) -> (1/2, 1/2).
    a, b = torch.tensor([0.8, 0.2]).log(), torch.tensor([0.2, 0.8]).log()
    hidden = torch.stack([a, b]).expand(1, 4, 2, 2).clone()  # (B=1, T=4, K=2, V=2)
    ids = torch.tensor([[1, 0, 1, 1]])
    sel = torch.tensor([[False, True, True, True]])
    e = view_evidence(hidden, (torch.eye(2), None), ids, sel, 1.0, chunk=2)
    assert e.shape == (1, 4, 2) and torch.allclose(e[0, 2], torch.tensor([0.8, 0.2]).log())
    w = torch.softmax(e, dim=-1)  # the posterior over the two views
    assert torch.allclose(w[0, 1], torch.tensor([0.5, 0.5]))
    assert torch.allclose(w[0, 2], torch.tensor([0.8, 0.2]), atol=1e-6)
    assert torch.allclose(w[0, 3], torch.tensor([0.5, 0.5]), atol=1e-6)


def test_posterior_aggregate_end_to_end_in_a_batch_and_across_micro_batches():
    model, tok = tiny()
    task = arith()
    algo = MASS(MASSConfig(aggregate="posterior", num_views=3))
    batch = algo.make_batch(task.train_examples()[:4], ctx(model, tok, task))
    sel = batch.loss_mask.bool()
    e = batch.teacher.view_evidence
    assert e.shape == sel.shape + (3,) and (e[sel] <= 0).all()
    first = sel.float().argmax(1)  # each row's first completion token: no evidence yet
    assert (e[torch.arange(4), first] == 0).all()
    # the weights travel with their rows: one micro-batch or four give the same gradients
    whole, split = grads(model, algo, batch, 4), grads(model, algo, batch, 1)
    assert all(torch.allclose(whole[n], split[n], atol=1e-6) for n in whole)
