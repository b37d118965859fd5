"""Self-distillation and policy-gradient loss math: hand-computed values, TRL agreement, and the
token-chunked path against a full-logits reference (values and gradients)."""
from __future__ import annotations

import math

import pytest
import torch

from algorithms import losses


def _logp(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


def test_kl_hand_computed():
    # KL([1/2, 1/2] || [1/4, 3/4]) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3)
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert math.isclose(losses.kl(_logp([0.5, 0.5]), _logp([0.25, 0.75])).item(), expected, rel_tol=1e-12)


def test_generalized_jsd_hand_computed():
    s, t = _logp([0.5, 0.5]), _logp([0.25, 0.75])
    # beta 0.5: M = [0.375, 0.625]; JSD = 0.5 KL(t||M) + 0.5 KL(s||M)
    kl_t = 0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)
    kl_s = 0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)
    assert math.isclose(losses.generalized_jsd(s, t, 0.5).item(), 0.5 * kl_t + 0.5 * kl_s, rel_tol=1e-12)
    # beta 0.1: M = 0.1 t + 0.9 s = [0.475, 0.525]
    m = [0.475, 0.525]
    kl_t = 0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])
    kl_s = 0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    assert math.isclose(losses.generalized_jsd(s, t, 0.1).item(), 0.1 * kl_t + 0.9 * kl_s, rel_tol=1e-12)
    # the limits: beta 0 forward KL(t || s), beta 1 reverse KL(s || t)
    assert math.isclose(losses.generalized_jsd(s, t, 0.0).item(), losses.kl(t, s).item())
    assert math.isclose(losses.generalized_jsd(s, t, 1.0).item(), losses.kl(s, t).item())
    assert losses.generalized_jsd(t, t, 0.5).abs().item() < 1e-12


@pytest.mark.slow  # imports TRL: 6.6 s for the first case in the fast-tier run
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_matches_trl(beta):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, 5, 6]])
    temperature = 1.1
    ref = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    mask = labels != -100
    ours = losses.generalized_jsd(torch.log_softmax(student / temperature, -1),
                                  torch.log_softmax(teacher / temperature, -1), beta)[mask].mean()
    assert torch.allclose(ours, ref, atol=1e-6), (ours, ref)


def test_aggregate_views_hand_computed():
    views = torch.stack([_logp([0.2, 0.8]), _logp([0.6, 0.4])])
    assert torch.allclose(losses.aggregate_views(views, "mean").exp(), torch.tensor([0.4, 0.6], dtype=torch.float64))
    # geometric: sqrt(0.2 * 0.6) : sqrt(0.8 * 0.4) normalised
    a, b = math.sqrt(0.12), math.sqrt(0.32)
    geo = losses.aggregate_views(views, "geometric").exp()
    assert torch.allclose(geo, torch.tensor([a / (a + b), b / (a + b)], dtype=torch.float64))
    # one view: both aggregations are the identity (MASS with K = 1 is OPSD)
    assert torch.allclose(losses.aggregate_views(views[:1], "mean"), views[0])
    assert torch.allclose(losses.aggregate_views(views[:1], "geometric"), views[0])


def test_view_disagreement_and_correction_hand_computed():
    views = torch.stack([_logp([0.2, 0.8]), _logp([0.6, 0.4]), _logp([0.2, 0.8])])
    j = losses.generalized_jsd(views[0], views[1], 0.5).item()
    # pairs (0,1), (0,2), (1,2): JSD j, 0, j -> mean 2j/3
    assert math.isclose(losses.view_disagreement(views).item(), 2 * j / 3, rel_tol=1e-12)
    assert losses.view_disagreement(views[:1]).item() == 0.0
    # teacher [0.7, 0.3] vs student [0.4, 0.6]: the teacher's top token is under-weighted by 0.7 - 0.4 = 0.3
    assert math.isclose(losses.top_gap(_logp([0.4, 0.6]), _logp([0.7, 0.3])).item(), 0.3, rel_tol=1e-12)
    assert math.isclose(losses.top_gap(_logp([0.9, 0.1]), _logp([0.6, 0.4])).item(), -0.3, rel_tol=1e-12)
    # correction mass: the teacher's excess over the student, summed where it is positive
    # teacher [0.7, 0.2, 0.1] vs student [0.4, 0.5, 0.1]: 0.3 on token 0, none on 1 (under), none on 2 (equal)
    assert math.isclose(losses.correction_mass(_logp([0.4, 0.5, 0.1]), _logp([0.7, 0.2, 0.1])).item(), 0.3,
                        rel_tol=1e-9)
    # a broader teacher [0.6, 0.4] over a confident student [0.9, 0.1] still moves 0.3 of mass
    assert math.isclose(losses.correction_mass(_logp([0.9, 0.1]), _logp([0.6, 0.4])).item(), 0.3, rel_tol=1e-9)
    assert losses.correction_mass(_logp([0.3, 0.7]), _logp([0.3, 0.7])).item() < 1e-12
    # view support: tops [1, 1, 0] against the aggregate's top 1 -> 2/3
    tops = torch.stack([_logp([0.2, 0.8]), _logp([0.4, 0.6]), _logp([0.7, 0.3])])
    assert math.isclose(losses.view_support(tops, torch.tensor(1)).item(), 2 / 3, rel_tol=1e-6)


def test_teacher_top_k_renormalises_both_sides():
    s, t = _logp([0.1, 0.2, 0.3, 0.4]), _logp([0.5, 0.1, 0.3, 0.1])
    s_k, t_k = losses.teacher_top_k(s, t, 2)  # teacher's top-2: tokens 0 and 2
    assert torch.allclose(t_k.exp(), torch.tensor([0.5 / 0.8, 0.3 / 0.8], dtype=torch.float64))
    assert torch.allclose(s_k.exp(), torch.tensor([0.1 / 0.4, 0.3 / 0.4], dtype=torch.float64))


def test_sampled_token_divergence_value_and_gradient():
    # A = log p_T - log p_S = -0.5 - (-1.5) = 1 (detached); loss = -A log p_S = 1.5; d/d log p_S = -A = -1
    s = torch.tensor([-1.5], requires_grad=True)
    loss = losses.sampled_token_divergence(s, torch.tensor([-0.5]))
    loss.sum().backward()
    assert math.isclose(loss.item(), 1.5) and math.isclose(s.grad.item(), -1.0)


def test_group_advantages_worked_example():
    # docs/grpo.md: rewards [1, 0, 0, 1] in one group -> +-0.8658754 (std unbiased, eps 1e-4)
    from algorithms.advantages import group_advantages

    def adv(rewards, g, **kw):
        return group_advantages(torch.tensor(rewards), torch.ones(len(rewards), dtype=torch.bool), g, **kw)[0]

    assert torch.allclose(adv([1.0, 0.0, 0.0, 1.0], 4, eps=1e-4),
                          torch.tensor([0.8658754, -0.8658754, -0.8658754, 0.8658754]), atol=1e-6)
    assert torch.equal(adv([3.0, 5.0], 1), torch.zeros(2))
    assert torch.allclose(adv([1.0, 0.0], 2, scale="none"), torch.tensor([0.5, -0.5]))


def test_clipped_policy_gradient_worked_example():
    # docs/grpo.md worked example: A = [1, -1]; logp [[-.2, -.4, -.1], [-.7]]; old [[-.5, -.3, -.1], [-.2]]; eps 0.2
    # -> per-token loss [[-1.2, -0.9048374, -1.0], [0.8]]
    logp = torch.tensor([[-0.2, -0.4, -0.1], [-0.7, 0.0, 0.0]])
    old = torch.tensor([[-0.5, -0.3, -0.1], [-0.2, 0.0, 0.0]])
    per_token = losses.clipped_policy_gradient(logp, old, torch.tensor([1.0, -1.0]))
    assert torch.allclose(per_token[0], torch.tensor([-1.2, -0.9048374, -1.0]), atol=1e-6)
    assert math.isclose(per_token[1, 0].item(), 0.8, rel_tol=1e-6)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert math.isclose(((per_token * mask).sum() / 4).item(), -0.5762094, rel_tol=1e-6)  # token-mean


def _reference(student_logits, teacher_view_logits, targets, beta, temperature, aggregate, top_k, form):
    """Unchunked: full logits for student and every view at once."""
    s = torch.log_softmax(student_logits.float() / temperature, -1)
    views = torch.log_softmax(teacher_view_logits.float() / temperature, -1)  # (K, N, V)
    t = losses.aggregate_views(views, aggregate)
    tok = s.gather(-1, targets[:, None]).squeeze(-1)
    if form == "sampled":
        return losses.sampled_token_divergence(tok, t.gather(-1, targets[:, None]).squeeze(-1)), tok
    if top_k:
        s, t = losses.teacher_top_k(s, t, top_k)
    return losses.generalized_jsd(s, t, beta), tok


@pytest.mark.parametrize("beta,aggregate,top_k,form", [(0.5, "mean", 0, "full"), (0.0, "geometric", 0, "full"),
                                                       (1.0, "mean", 5, "full"), (0.5, "mean", 0, "sampled")])
def test_chunked_matches_full_logits_reference(beta, aggregate, top_k, form):
    torch.manual_seed(0)
    n, k, h, v = 23, 3, 8, 40
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    t_hidden, t_weight = torch.randn(n, k, h), torch.randn(v, h)
    targets = torch.randint(0, v, (n,))
    kw = dict(beta=beta, temperature=1.1, aggregate=aggregate, top_k=top_k, form=form)
    div, tok = losses.chunked_self_distill(hidden, (weight, None), t_hidden, (t_weight, None), targets, chunk=5, **kw)
    (div.sum() + tok.sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_div, ref_tok = _reference(hidden @ weight.T, torch.einsum("nkh,vh->knv", t_hidden, t_weight), targets, **kw)
    (ref_div.sum() + ref_tok.sum()).backward()
    assert torch.allclose(div, ref_div, atol=1e-5) and torch.allclose(tok, ref_tok, atol=1e-5)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5) and torch.allclose(grads[1], weight.grad, atol=1e-5)
    # the logits fallback (head None) gives the same numbers
    div2, _ = losses.chunked_self_distill((hidden @ weight.T).detach(), None, t_hidden, (t_weight, None), targets,
                                          chunk=7, **kw)
    assert torch.allclose(div2, ref_div.detach(), atol=1e-5)


def test_chunked_token_logprobs_matches_log_softmax():
    torch.manual_seed(1)
    feats, weight, targets = torch.randn(9, 4), torch.randn(13, 4), torch.randint(0, 13, (9,))
    expected = torch.log_softmax(feats @ weight.T / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    got = losses.chunked_token_logprobs(feats, (weight, None), targets, 0.7, chunk=4)
    assert torch.allclose(got, expected, atol=1e-6)


def test_backed_aggregate_is_the_mean_of_the_views_that_reach_the_means_top():
    # mean [0.35, 0.475, 0.175] has top 1; views 0 and 1 have top 1 -> mean of those two
    views = torch.stack([_logp([0.1, 0.8, 0.1]), _logp([0.2, 0.7, 0.1]), _logp([0.5, 0.2, 0.3]), _logp([0.6, 0.2, 0.2])])
    backed = losses.aggregate_views(views, "backed").exp()
    assert torch.allclose(backed, torch.tensor([0.15, 0.75, 0.1], dtype=torch.float64))
    # per token: a second token where every view agrees is the plain mean
    both = torch.stack([views, torch.stack([_logp([0.7, 0.2, 0.1])] * 4)], dim=1)  # (K, 2, V)
    out = losses.aggregate_views(both, "backed").exp()
    assert torch.allclose(out[0], backed) and torch.allclose(out[1], torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64))


def test_confident_aggregate_weights_views_by_their_entropy():
    # view A = [0.9, 0.05, 0.05], view B uniform. H_A = 0.9 ln(1/0.9) + 0.1 ln 20 = 0.394397 nats,
    # H_B = ln 3 = 1.098612; w_A = 1 / (1 + e^-(H_B - H_A)) = 0.669116. B is flat, so it adds a constant
    # to every log-prob: p_T is proportional to p_A^0.669116.
    views = torch.stack([_logp([0.9, 0.05, 0.05]), _logp([1 / 3, 1 / 3, 1 / 3])])
    w = 0.669116
    raw = [0.9 ** w, 0.05 ** w, 0.05 ** w]
    expected = torch.tensor([x / sum(raw) for x in raw], dtype=torch.float64)  # [0.8669, 0.0666, 0.0666]
    got = losses.aggregate_views(views, "confident", confidence_temperature=1.0).exp()
    assert torch.allclose(got, expected, atol=1e-5)
    # sharper than the plain geometric mean (p_A^0.5), which the flat view tempers more
    assert got[0] > losses.aggregate_views(views, "geometric").exp()[0] + 0.05
    # a lower temperature trusts the confident view more: tau 0.3 -> w_A = 1 / (1 + e^-(0.704215 / 0.3)) = 0.912726
    w = 0.912726
    raw = [0.9 ** w, 0.05 ** w, 0.05 ** w]
    assert torch.allclose(losses.aggregate_views(views, "confident", confidence_temperature=0.3).exp(),
                          torch.tensor([x / sum(raw) for x in raw], dtype=torch.float64), atol=1e-5)
    # equal views: that view; one view: returned as it is
    same = torch.stack([_logp([0.6, 0.3, 0.1])] * 3)
    assert torch.allclose(losses.aggregate_views(same, "confident", confidence_temperature=1.0).exp(),
                          torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64))
    assert torch.equal(losses.aggregate_views(views[:1], "confident"), views[0])
    with pytest.raises(ValueError, match="confidence_temperature > 0"):
        losses.aggregate_views(views, "confident")


def test_posterior_aggregate_is_the_weighted_geometric_mean():
    # weights 3/4, 1/4 over A = [0.9, 0.05, 0.05], B = [0.2, 0.6, 0.2]:
    # p_T proportional to A^0.75 B^0.25 = [0.9^.75 0.2^.25, 0.05^.75 0.6^.25, 0.05^.75 0.2^.25]
    views = torch.stack([_logp([0.9, 0.05, 0.05]), _logp([0.2, 0.6, 0.2])])
    raw = [0.9 ** 0.75 * 0.2 ** 0.25, 0.05 ** 0.75 * 0.6 ** 0.25, 0.05 ** 0.75 * 0.2 ** 0.25]
    expected = torch.tensor([x / sum(raw) for x in raw], dtype=torch.float64)
    evidence = torch.tensor([0.75, 0.25], dtype=torch.float64).log()  # the views' posterior, as log-likelihoods
    got = losses.aggregate_views(views, "posterior", evidence).exp()  # confidence_temperature 0: posterior alone
    assert torch.allclose(got, expected, atol=1e-6)
    # equal evidence: the plain geometric mean; one view far more likely: that view
    assert torch.allclose(losses.aggregate_views(views, "posterior", torch.zeros(2, dtype=torch.float64)),
                          losses.aggregate_views(views, "geometric"), atol=1e-9)
    assert torch.allclose(losses.aggregate_views(views, "posterior", torch.tensor([-80.0, 0.0], dtype=torch.float64)),
                          views[1], atol=1e-9)
    # with the confidence term: w = softmax(evidence - H / tau); H_A = 0.394397, H_B = 0.950271 (by hand:
    # 0.2 ln 5 x 2 + 0.6 ln(1/0.6)), tau 0.5 -> w_A = 1 / (1 + (1/3) e^-((0.950271 - 0.394397) / 0.5)) = 0.901176
    w = 0.901176
    raw = [0.9 ** w * 0.2 ** (1 - w), 0.05 ** w * 0.6 ** (1 - w), 0.05 ** w * 0.2 ** (1 - w)]
    got = losses.aggregate_views(views, "posterior", evidence, confidence_temperature=0.5).exp()
    assert torch.allclose(got, torch.tensor([x / sum(raw) for x in raw], dtype=torch.float64), atol=1e-5)
    with pytest.raises(ValueError, match="needs each view's evidence"):
        losses.aggregate_views(views, "posterior")


def test_teacher_top_k_with_a_tail_bucket_keeps_the_mass_outside():
    # k = 1: teacher [0.7, 0.2, 0.1] -> its top is token 0; student [0.4, 0.5, 0.1]
    s, t = _logp([0.4, 0.5, 0.1]), _logp([0.7, 0.2, 0.1])
    s_k, t_k = losses.teacher_top_k(s, t, 1, tail=True)
    assert torch.allclose(s_k.exp(), torch.tensor([0.4, 0.6], dtype=torch.float64))
    assert torch.allclose(t_k.exp(), torch.tensor([0.7, 0.3], dtype=torch.float64))
    # the divergence over the k + 1 buckets: forward KL = 0.7 ln(0.7/0.4) + 0.3 ln(0.3/0.6)
    expected = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
    assert math.isclose(losses.generalized_jsd(s_k, t_k, 0.0).item(), expected, rel_tol=1e-9)
    # without the tail both sides renormalise to [1] and the divergence is 0
    s1, t1 = losses.teacher_top_k(s, t, 1)
    assert losses.generalized_jsd(s1, t1, 0.0).item() == 0.0
    # through the chunked loss (identity head: hidden = log-probs)
    div, _ = losses.chunked_self_distill(s.float().unsqueeze(0), None, t.float().view(1, 1, 3),
                                         (torch.eye(3), None), torch.tensor([0]), beta=0.0, top_k=1, top_k_tail=True)
    assert math.isclose(div.item(), expected, rel_tol=1e-5)


def test_importance_weights_cap_the_ratio_and_report_it():
    now = torch.tensor([-1.0, -1.0, -2.0])
    sampled = torch.tensor([-1.0, -2.0, -1.0])  # ratios 1, e, 1/e
    weights, metrics = losses.importance_weights(now.requires_grad_(), sampled, clip=2.0)
    assert torch.allclose(weights, torch.tensor([1.0, 2.0, math.exp(-1.0)]))
    assert not weights.requires_grad  # a weight, not a path for the gradient
    assert math.isclose(metrics["is_ratio"].item(), (1 + math.e + math.exp(-1)) / 3, rel_tol=1e-6)
    assert math.isclose(metrics["is_clipped"].item(), 1 / 3, rel_tol=1e-6)
    empty, none = losses.importance_weights(torch.zeros(0), torch.zeros(0), clip=2.0)
    assert empty.numel() == 0 and none == {}  # no tokens (a micro-batch of TESD teacher rows): no metrics
