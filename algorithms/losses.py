"""Pure loss math: tensors in, (loss, metrics) out. No config objects, no .item(), no collectives.

Conventions: logits (B, T, V) at position t predict token t+1; token-aligned tensors (B, T) index
the predicted token, so `token_logprobs(...)[b, t] = log p(x_t | x_<t)` and column 0 is 0.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from models.anatomy import Head, detach_head, head_logits


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / T) gathered at the next tokens. logits (B, T, V), ids (B, T) -> (B, T)."""
    assert logits.dim() == 3 and logits.shape[:2] == input_ids.shape, (logits.shape, input_ids.shape)
    scaled = logits[:, :-1].float() / temperature  # (B, T-1, V)
    target = input_ids[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
    picked = scaled.gather(-1, target).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # (B, T-1)
    return torch.nn.functional.pad(picked, (1, 0))  # (B, T): position 0 has no prediction


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum()


def nll_loss(logprobs: Tensor, mask: Tensor, normaliser: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level negative log-likelihood summed over masked tokens / normaliser.

    logprobs, mask: (B, T). normaliser: scalar (global target tokens / data-parallel size).
    Example: logprobs [[0, -1, -3]], mask [[0, 1, 1]], normaliser 2 -> loss (1 + 3) / 2 = 2.
    """
    mask = mask.to(logprobs.dtype)
    loss = -masked_sum(logprobs, mask) / normaliser
    n = mask.sum().clamp(min=1)
    return loss, {"nll": -masked_sum(logprobs, mask).detach() / n}


def logprob_gap(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean |trainer - sampler| log-prob over completion tokens: a silent mismatch here corrupts
    every on-policy algorithm, so the trainer logs it every step."""
    mask = mask.to(trainer_logprobs.dtype)
    diff = (trainer_logprobs.detach().float() - rollout_logprobs.float()).abs()
    return masked_sum(diff, mask) / mask.sum().clamp(min=1)


def importance_weights(trainer_logprobs: Tensor, sampler_logprobs: Tensor, clip: float
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """Per token min(pi_train(y) / pi_sampler(y), clip), detached, and its metrics: the mean ratio
    before the cap (`is_ratio`) and the share of tokens the cap bound (`is_clipped`). It reweights an
    on-policy loss toward the policy being trained where the sampler's numerics (bf16, low-bit
    rollouts) drew tokens with other probabilities. (N,) each.
    Example: log-probs now [-1, -1], at sampling [-1, -2], clip 2 -> ratios [1, e = 2.718] -> [1, 2],
    is_ratio 1.859, is_clipped 0.5. No tokens: no metrics."""
    ratio = (trainer_logprobs.detach().float() - sampler_logprobs.float()).exp()
    if ratio.numel() == 0:  # no tokens here (e.g. a micro-batch of TESD teacher rows): nothing to report
        return ratio, {}
    metrics = {"is_ratio": ratio.mean(), "is_clipped": (ratio > clip).float().mean()}
    return ratio.clamp(max=clip), metrics


# --- self-distillation (OPSD, MASS, TESD) -------------------------------------------------------
# Distributions below are log-probabilities (..., V) already divided by the sampling temperature and
# log-softmaxed; divergences are summed over the vocabulary and returned per token (...,).


def kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) summed over the last dim. Example: p = [1/2, 1/2], q = [1/4, 3/4] ->
    0.5 ln 2 + 0.5 ln(2/3) = 0.1438."""
    return (logp.exp() * (logp - logq)).sum(-1)


def generalized_jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """Generalized JSD with mixture M = beta p_T + (1 - beta) p_S:
    `beta KL(p_T || M) + (1 - beta) KL(p_S || M)`; beta = 0 is forward KL(p_T || p_S), beta = 1 reverse
    KL(p_S || p_T) (the two limits are special-cased, as in the GKD paper's Eq. 1 and TRL's GKD loss).

    student_logp, teacher_logp: (..., V) -> (...,).
    """
    if beta == 0.0:
        return kl(teacher_logp, student_logp)
    if beta == 1.0:
        return kl(student_logp, teacher_logp)
    mix = torch.logsumexp(torch.stack([student_logp + math.log1p(-beta), teacher_logp + math.log(beta)]), dim=0)
    return beta * kl(teacher_logp, mix) + (1.0 - beta) * kl(student_logp, mix)


AGGREGATES = ("mean", "geometric", "backed", "confident", "posterior")


def aggregate_views(view_logp: Tensor, mode: str = "mean", evidence: Optional[Tensor] = None,
                    confidence_temperature: float = 0.0) -> Tensor:
    """One teacher distribution from K view-conditioned teachers. view_logp (K, ..., V) -> (..., V).

    mean:      log((1/K) sum_k p_k) -- a Monte-Carlo estimate of the marginal over reference realisations.
    geometric: log_softmax((1/K) sum_k log p_k) -- the normalised geometric mean.
    backed:    the mean over the views that back the mean's top token (their own top is that token):
               views whose masked reference lost the information the token needs drop out there.
    confident: log_softmax(sum_k w_k log p_k), w = softmax_k(-H_k / tau) with H_k the entropy of view k
               in nats and tau = `confidence_temperature` (> 0): a geometric mean in which a view counts
               by its confidence, so the views that kept the information a token needs outweigh those
               that lost it with their masked spans, and the aggregate stays as sharp as they are.
    posterior: the same with w = softmax_k(evidence_k - H_k / tau): `evidence` (K, ...) is each view's
               log-likelihood of the completion written before the token (MASS's `view_evidence`), so
               a view counts by its posterior given what the student wrote (a uniform prior) times its
               confidence (tau <= 0: the posterior alone).
    One view is returned as it is, whatever the mode.
    """
    if view_logp.shape[0] == 1 and mode in AGGREGATES:
        return view_logp[0]
    if mode in ("confident", "posterior"):
        finite = view_logp.clamp(min=torch.finfo(view_logp.dtype).min)
        score = torch.zeros(view_logp.shape[:-1], dtype=view_logp.dtype, device=view_logp.device)  # (K, ...)
        if mode == "posterior":
            if evidence is None:
                raise ValueError("the posterior view aggregate needs each view's evidence (log-likelihood so far)")
            score = score + evidence.to(view_logp.dtype)
        elif confidence_temperature <= 0:
            raise ValueError("the confident view aggregate needs confidence_temperature > 0")
        if confidence_temperature > 0:
            score = score + (view_logp.exp() * finite).sum(-1) / confidence_temperature  # - H_k / tau
        weights = torch.softmax(score, dim=0).unsqueeze(-1)
        return torch.log_softmax((weights * finite).sum(0), dim=-1)
    if mode == "mean":
        return torch.logsumexp(view_logp, dim=0) - math.log(view_logp.shape[0])
    if mode == "geometric":
        return torch.log_softmax(view_logp.mean(0), dim=-1)
    if mode == "backed":
        mean = torch.logsumexp(view_logp, dim=0) - math.log(view_logp.shape[0])
        backs = view_logp.argmax(-1) == mean.argmax(-1).unsqueeze(0)  # (K, ...)
        backs = backs | ~backs.any(0, keepdim=True)  # no view backs it (a mean's top no view has): all count
        masked = view_logp.masked_fill(~backs.unsqueeze(-1), float("-inf"))
        return torch.logsumexp(masked, dim=0) - backs.sum(0).unsqueeze(-1).to(view_logp.dtype).log()
    raise ValueError(f"unknown view aggregation {mode!r}; expected one of {', '.join(AGGREGATES)}")


def view_disagreement(view_logp: Tensor) -> Tensor:
    """Mean pairwise JSD (beta 1/2) between K views, per token. (K, ..., V) -> (...,); 0 when K = 1."""
    k = view_logp.shape[0]
    if k < 2:
        return view_logp.new_zeros(view_logp.shape[1:-1])
    pairs = [generalized_jsd(view_logp[i], view_logp[j], 0.5) for i in range(k) for j in range(i + 1, k)]
    return torch.stack(pairs).mean(0)


def top_gap(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """The probability the teacher's top token has under the teacher minus under the student,
    `p_T(v*) - p_S(v*)` with v* = argmax p_T, per token. (..., V) -> (...,).
    Example: teacher [0.7, 0.3], student [0.4, 0.6] -> 0.7 - 0.4 = 0.3."""
    top = teacher_logp.argmax(-1, keepdim=True)
    return (teacher_logp.gather(-1, top).exp() - student_logp.gather(-1, top).exp()).squeeze(-1)


def correction_mass(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """How much the teacher corrects the student: the teacher's excess mass on the tokens the student
    under-weights, `sum_v max(0, p_T(v) - p_S(v))` (the total-variation distance), per token. 0 where
    they agree; a broad teacher over a confident student scores too, a correction being any mass the
    teacher would move. (..., V) -> (...,).
    Example: teacher [0.7, 0.2, 0.1], student [0.4, 0.5, 0.1] -> 0.3."""
    return (teacher_logp.exp() - student_logp.exp()).clamp(min=0).sum(-1)


def view_support(view_logp: Tensor, top: Tensor) -> Tensor:
    """Share of the K views whose own top token is `top` (the aggregate's). view_logp (K, ..., V),
    top (...,) -> (...,). Example: views with tops [3, 3, 5, 3] and top 3 -> 0.75."""
    return (view_logp.argmax(-1) == top.unsqueeze(0)).float().mean(0)


def teacher_top_k(student_logp: Tensor, teacher_logp: Tensor, k: int, tail: bool = False) -> tuple[Tensor, Tensor]:
    """Both distributions restricted to the teacher's top-k tokens: renormalised there (..., V) -> (..., k),
    or with `tail` kept as they are plus one tail bucket holding each side's mass outside those k tokens
    (..., k + 1), so a student that puts its mass elsewhere still pays for it.
    Example (k = 1, tail): teacher [0.7, 0.2, 0.1], student [0.4, 0.5, 0.1] -> [0.7, 0.3] and [0.4, 0.6]."""
    idx = teacher_logp.topk(k, dim=-1).indices
    student_top, teacher_top = student_logp.gather(-1, idx), teacher_logp.gather(-1, idx)
    if not tail:
        return torch.log_softmax(student_top, dim=-1), torch.log_softmax(teacher_top, dim=-1)

    def with_tail(top: Tensor) -> Tensor:
        inside = torch.logsumexp(top, dim=-1, keepdim=True)  # log of the top-k mass, <= 0
        outside = (-torch.expm1(inside)).clamp(min=torch.finfo(top.dtype).tiny).log()  # log(1 - mass)
        return torch.cat([top, outside], dim=-1)
    return with_tail(student_top), with_tail(teacher_top)


def sampled_token_divergence(student_token_logp: Tensor, teacher_token_logp: Tensor) -> Tensor:
    """Sampled-token form of the distillation signal: `-A_t log p_S(y_t)` with the detached advantage
    `A_t = log p_T(y_t) - log p_S(y_t)` (a policy gradient on the per-token reverse-KL reward)."""
    advantage = (teacher_token_logp - student_token_logp).detach()
    return -advantage * student_token_logp


def weighted_token_loss(per_token: Tensor, weights: Tensor, normaliser: Tensor) -> Tensor:
    """sum_t w_t * loss_t / normaliser; per_token, weights (N,)."""
    return (per_token * weights).sum() / normaliser


# --- group-relative policy gradient (TESD's teacher-oriented term; GRPO); the advantages: algorithms/advantages.py


def clipped_policy_gradient(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float = 0.2,
                            eps_high: float = 0.2) -> Tensor:
    """Per-token PPO-clip loss `-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)`, rho = exp(logp - old).
    logp, old_logp (B, T); advantages (B,) or (B, T) -> (B, T). Clipped tokens get no gradient."""
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)


# --- token-chunked self-distillation over the output head -----------------------------------------
# With a 151k vocabulary and long completions, [B, T, V] fp32 logits for the student plus K teacher
# views do not fit in memory. These functions take final hidden states and the output-head weight,
# and build logits `CHUNK` tokens at a time; the student chunk is recomputed in backward
# (activation checkpointing), so no more than one chunk of logits is ever alive.

CHUNK_LOGIT_ELEMENTS = 2 ** 26  # fp32 logits per chunk over student + views (256 MiB) for auto chunking
MIN_CHUNK, MAX_CHUNK = 16, 4096


def auto_chunk(vocab: int, views: int) -> int:
    """Tokens per chunk so one chunk's student + K view logits hold ~CHUNK_LOGIT_ELEMENTS values
    (the divergence's intermediates are a small multiple of that). 151,936 x 5 -> 88 tokens."""
    return max(MIN_CHUNK, min(MAX_CHUNK, CHUNK_LOGIT_ELEMENTS // (vocab * (views + 1))))


def head_logp(hidden: Tensor, head: Optional[Head], temperature: float) -> Tensor:
    """log_softmax(head(hidden) / T) in fp32. hidden (..., H) -> (..., V). With head None, `hidden`
    already holds logits (the fallback when the head weight is not directly usable); a soft-capped
    head is capped before the temperature, as the model's own logits are."""
    logits = hidden if head is None else head_logits(hidden, head)
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _evidence(view_evidence: Optional[Tensor], sl: slice) -> Optional[Tensor]:
    """(N, K) per-token view evidence -> the chunk's (K, n), or None."""
    return None if view_evidence is None else view_evidence[sl].transpose(0, 1)


def _distill_chunk(student_in: Tensor, student_head: Optional[Head], teacher_hidden: Tensor, teacher_head: Head,
                   targets: Tensor, beta: float, temperature: float, aggregate: str, top_k: int, form: str,
                   view_evidence: Optional[Tensor] = None, confidence_temperature: float = 0.0,
                   top_k_tail: bool = False) -> tuple[Tensor, Tensor]:
    student_logp = head_logp(student_in, student_head, temperature)  # (n, V)
    with torch.no_grad():
        views = head_logp(teacher_hidden.transpose(0, 1), teacher_head, temperature)  # (K, n, V)
        teacher_logp = aggregate_views(views, aggregate, view_evidence, confidence_temperature)  # (n, V)
    token_logp = student_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n,)
    if form == "sampled":
        teacher_token = teacher_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return sampled_token_divergence(token_logp, teacher_token), token_logp
    if top_k > 0:
        student_logp, teacher_logp = teacher_top_k(student_logp, teacher_logp, top_k, top_k_tail)
    return generalized_jsd(student_logp, teacher_logp, beta), token_logp


def chunked_self_distill(student_in: Tensor, student_head: Optional[Head], teacher_hidden: Tensor,
                         teacher_head: Head, targets: Tensor, *, beta: float = 0.5, temperature: float = 1.0,
                         aggregate: str = "mean", top_k: int = 0, form: str = "full",
                         chunk: int = 512, view_evidence: Optional[Tensor] = None,
                         confidence_temperature: float = 0.0, top_k_tail: bool = False) -> tuple[Tensor, Tensor]:
    """Per-token divergence between the student and the (aggregated) teacher, chunked over tokens.

    student_in (N, H) final hidden states predicting `targets` (N,) -- or (N, V) logits with
    student_head None; teacher_hidden (N, K, H) from K teacher views (no grad); teacher_head its
    output head. form "full": generalized JSD(beta) over the vocabulary (or the teacher's top-k
    renormalised, top_k > 0, or with a tail bucket, `top_k_tail`); "sampled": the sampled-token form. `view_evidence` (N, K) and
    `confidence_temperature`: for the `posterior` and `confident` aggregates. Returns (divergence (N,), student log-prob of
    each target (N,)); both carry the student's gradient.
    """
    assert teacher_hidden.dim() == 3 and teacher_hidden.shape[0] == student_in.shape[0] == targets.shape[0]
    if form not in ("full", "sampled"):
        raise ValueError(f"unknown divergence form {form!r}; expected 'full' or 'sampled'")
    teacher_head = detach_head(teacher_head)
    divs, logps = [], []
    for start in range(0, targets.shape[0], chunk):
        sl = slice(start, start + chunk)
        args = (student_in[sl], student_head, teacher_hidden[sl], teacher_head, targets[sl],
                beta, temperature, aggregate, top_k, form, _evidence(view_evidence, sl), confidence_temperature,
                top_k_tail)
        if student_in.requires_grad or (student_head is not None and student_head[0].requires_grad):
            div, logp = checkpoint(_distill_chunk, *args, use_reentrant=False)
        else:
            div, logp = _distill_chunk(*args)
        divs.append(div)
        logps.append(logp)
    if not divs:
        empty = student_in.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(divs), torch.cat(logps)


@torch.no_grad()
def self_distill_diagnostics(student_in: Tensor, student_head: Optional[Head], teacher_hidden: Tensor,
                             teacher_head: Head, *, temperature: float = 1.0, aggregate: str = "mean",
                             chunk: int = 512, view_evidence: Optional[Tensor] = None,
                             confidence_temperature: float = 0.0) -> dict[str, Tensor]:
    """No-grad per-token statistics of K teacher views against the student, chunked over tokens.

    Returns (N,) tensors `disagreement` (mean pairwise JSD of the views), `correction` (teacher's
    excess mass on the tokens the student under-weights, `correction_mass`), `top_gap` (`top_gap`),
    `support` (share of views whose top is the aggregate's), `divergence` (JSD(1/2) student vs
    aggregate), `teacher_top` (the aggregate's top token), and (K, N) `view_shift` (JSD(1/2) of each
    view against the aggregate: how much that view's masking moved it).
    """
    parts: dict[str, list[Tensor]] = {"disagreement": [], "correction": [], "top_gap": [], "support": [],
                                      "divergence": [], "teacher_top": [], "view_shift": []}
    for start in range(0, teacher_hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        student_logp = head_logp(student_in[sl], student_head, temperature)  # (n, V)
        views = head_logp(teacher_hidden[sl].transpose(0, 1), teacher_head, temperature)  # (K, n, V)
        teacher_logp = aggregate_views(views, aggregate, _evidence(view_evidence, sl), confidence_temperature)
        parts["disagreement"].append(view_disagreement(views))
        parts["correction"].append(correction_mass(student_logp, teacher_logp))
        parts["top_gap"].append(top_gap(student_logp, teacher_logp))
        top = teacher_logp.argmax(-1)
        parts["support"].append(view_support(views, top))
        parts["divergence"].append(generalized_jsd(student_logp, teacher_logp, 0.5))
        parts["teacher_top"].append(top)
        parts["view_shift"].append(generalized_jsd(views, teacher_logp.unsqueeze(0).expand_as(views), 0.5))
    k = teacher_hidden.shape[1]
    if not parts["disagreement"]:
        z = teacher_hidden.new_zeros(0, dtype=torch.float32)
        return {"disagreement": z, "correction": z, "top_gap": z, "support": z, "divergence": z, "teacher_top": z.long(),
                "view_shift": z.new_zeros(k, 0)}
    return {name: torch.cat(v, dim=-1) for name, v in parts.items()}


@torch.no_grad()
def teacher_top_tokens(teacher_hidden: Tensor, teacher_head: Head, *, temperature: float = 1.0,
                       aggregate: str = "mean", chunk: int = 512, view_evidence: Optional[Tensor] = None,
                       confidence_temperature: float = 0.0) -> Tensor:
    """(N,) the top token of the teacher's K views aggregated, from (N, K, H) hidden states, chunked
    over tokens (the `teacher_top` of `self_distill_diagnostics` without the student side)."""
    tops = [aggregate_views(head_logp(teacher_hidden[start: start + chunk].transpose(0, 1), teacher_head,
                                      temperature), aggregate,
                            _evidence(view_evidence, slice(start, start + chunk)), confidence_temperature).argmax(-1)
            for start in range(0, teacher_hidden.shape[0], chunk)]
    return torch.cat(tops) if tops else teacher_hidden.new_zeros(0, dtype=torch.long)


def _token_logp_chunk(features: Tensor, head: Optional[Head], targets: Tensor, temperature: float) -> Tensor:
    logp = head_logp(features, head, temperature)  # (n, V)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked_token_logprobs(features: Tensor, head: Optional[Head], targets: Tensor, temperature: float = 1.0,
                           chunk: int = 512) -> Tensor:
    """log_softmax(head(features) / T)[target] per token, chunked (and checkpointed under grad) so
    only one chunk of logits is alive. features (N, H) -- or (N, V) logits with head None -> (N,)."""
    grad = features.requires_grad or (head is not None and head[0].requires_grad)
    parts = []
    for start in range(0, targets.shape[0], chunk):
        args = (features[start: start + chunk], head, targets[start: start + chunk], temperature)
        parts.append(checkpoint(_token_logp_chunk, *args, use_reentrant=False) if grad else _token_logp_chunk(*args))
    if not parts:  # no token: an empty result still tied to the features and the head, so a backward through
        # it gives every parameter a (zero) gradient -- a rank whose micro-batch trains nothing still joins the
        # data-parallel gradient reduction
        anchor = features.sum() * 0 + (head[0].sum() * 0 if head is not None else 0)
        return anchor.float().expand(0)
    return torch.cat(parts)


def k3_kl(ref_logp: Tensor, logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1 >= 0 (GRPO's
    and CLM's `beta` term)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0
