"""MASS: Multi-Mask Selective Self-Distillation -- OPSD whose teacher sees K masked views of the
reference, aggregated, with only reliable token corrections transferred.

Paper: Shen, Hou, Bi et al., "Multi-Mask Selective Self-Distillation" (no public code; our reading
and its formulas: docs/mass.md). Per step, on top of OPSD (algorithms/opsd.py; shared pieces in algorithms/selfdistill.py):
1. Split each reference into spans (`span_unit`: the task's solution steps, sentences, or windows of
   `span_tokens` tokens) and build `num_views` views, each hiding every span with probability
   `mask_ratio` (a Bernoulli draw per span, shaped by the adaptive distribution of step 4) behind the
   task's mask token; a view may hide nothing, the K views of a question are distinct where possible
   (`full_view`: the first is always the whole reference). The K teacher passes run batched.
2. The teacher distribution per completion token aggregates the K views. The default, `posterior`:
   a geometric mean whose weights are each view's posterior given the completion written so far (its
   likelihood of those tokens, uniform prior) times its confidence (exp(-entropy / tau)), with the
   whole reference as view 1 (`full_view`): on the reference's path the views holding what the student
   copies explain it best, off it (another valid path) those that hid the conflicting spans do.
   Alternatives: mean of probabilities (a Monte-Carlo estimate of the marginal over reference
   realisations), `geometric`, `backed` (the mean over the views whose top token is the mean's),
   `confident` (weights from the confidence alone).
3. Selective transfer: token weight 1 only where the aggregated teacher corrects the student (its
   excess mass on the tokens the student under-weights, sum_v max(0, p_T - p_S), above `gate_margin`)
   AND the views back it (at least `gate_support` of them have the aggregate's top token: where most
   views lost the information with their masked spans, the token is dropped); optionally also only
   where the views' mean pairwise JSD is at or below the batch's `gate_agreement_quantile`. Logged:
   mass/kept_fraction and mass/kept_correction_fraction (the kept share of the tokens where the
   aggregate's top is not the sampled token and the student under-weights it).
4. Adaptive masking: each span's influence is how far masking it moved the teacher -- the JSD(1/2)
   between a view and the aggregate, averaged over the completion and shared among the spans that view
   masked -- estimated from the views already computed (no extra passes). Masks are drawn with
   probability `(1 - influence_mix) x uniform + influence_mix x softmax(influence / (temperature x
   mean influence))`.
5. Loss: the OPSD divergence between the student and the aggregated teacher, times the gate.
With num_views=1, mask_ratio=0 and gate=false it is exactly OPSD (tests/algorithms/test_mass.py).

Choices that are ours (the abstract does not fix them): the gate statistics are computed with no
grad in make_batch on the rank's whole batch; influence scores are kept per example uid (an EMA, for
data seen again) with a prior per relative span position (8 buckets, an EMA over all examples) for
unseen questions; the softmax is scale-free (influence divided by its mean over the row's spans).
Each rank draws masks from its own stream (seeded by `seed` and the rank) and keeps its own influence
scores; both are checkpointed per rank (`rank_state_dict`). The designs compared: docs/mass.md.

    torchrun --nproc_per_node=2 train.py +algo=mass
    python train.py +algo=mass algo.num_views=8 algo.mask_ratio=0.5 algo.aggregate=geometric
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.base import Batch, RolloutContext, StepOutput, TeacherTerms
from algorithms.rollouts import encode, encode_prompt, require_references, rollout_batch, rollout_metrics, sample
from algorithms.scoring import detached_head, predicting, teacher_hidden
from algorithms.selfdistill import (SelfDistillConfig, check_self_distill_config, chunk_size, diagnoses_paths,
                                    distill_loss, path_metrics, self_teacher, skip_leading_tokens)
from algorithms.teacher import TeacherModelOptions
from models.anatomy import final_hidden
from models.export import export_model
from models.lora import train_all_or_lora
from tasks import mask_spans
from tasks.base import split_sentences

SPAN_UNITS = ("step", "sentence", "tokens")
MAX_TRACKED_EXAMPLES = 100_000  # influence scores kept per uid (oldest dropped first)
MASK_TRIES = 32  # redraws of a view that repeats an earlier one


@dataclass
class MASSConfig(SelfDistillConfig, TeacherModelOptions):
    name: str = "mass"
    num_views: int = 4  # K masked views of the reference per question
    mask_ratio: float = 0.3  # probability that a view masks a span (Bernoulli per span)
    full_view: bool = True  # the first view is always the whole reference (the others are masked draws)
    span_unit: str = "step"  # step (the task's solution steps) | sentence | tokens
    span_tokens: int = 16  # window size for span_unit=tokens
    aggregate: str = "posterior"  # posterior | geometric | mean | backed | confident (docs/mass.md)
    confidence_temperature: float = 0.3  # nats: confident / posterior weigh a view by exp(-entropy / this); 0 = off
    gate: bool = True
    gate_margin: float = 0.0  # keep tokens where the teacher's excess mass over the student exceeds this
    gate_support: float = 0.5  # ... and at least this share of the views has the aggregate's top token
    gate_agreement_quantile: float = 1.0  # < 1: also drop tokens whose view disagreement is above this batch quantile
    gate_agreement_threshold: float = 0.0  # > 0: an absolute view-disagreement limit instead of the quantile
    adaptive_masking: bool = True
    influence_mix: float = 0.5  # weight of softmax(influence) against uniform when drawing masks
    influence_temperature: float = 1.0
    influence_decay: float = 0.9  # EMA decay of the influence scores
    position_buckets: int = 8  # relative-position prior for questions not seen before

    def validate(self) -> None:
        check_self_distill_config(self)
        self.check_teacher_model()
        if self.num_views < 1:
            raise ValueError(f"algo.num_views={self.num_views} must be >= 1")
        if not 0.0 <= self.mask_ratio <= 1.0:
            raise ValueError(f"algo.mask_ratio={self.mask_ratio} must be in [0, 1]")
        if self.span_unit not in SPAN_UNITS:
            raise ValueError(f"algo.span_unit={self.span_unit} is not one of {', '.join(SPAN_UNITS)}")
        if self.aggregate not in losses.AGGREGATES:
            raise ValueError(f"algo.aggregate={self.aggregate} is not one of {', '.join(losses.AGGREGATES)}")
        if self.confidence_temperature < 0 or (self.aggregate == "confident" and self.confidence_temperature == 0):
            raise ValueError(f"algo.confidence_temperature={self.confidence_temperature} must be >= 0 (> 0 with "
                             "algo.aggregate=confident)")
        if not 0.0 <= self.gate_support <= 1.0:
            raise ValueError(f"algo.gate_support={self.gate_support} must be in [0, 1]")
        if not 0.0 < self.gate_agreement_quantile <= 1.0:
            raise ValueError(f"algo.gate_agreement_quantile={self.gate_agreement_quantile} must be in (0, 1]")
        if not 0.0 <= self.influence_mix <= 1.0 or self.influence_temperature <= 0:
            raise ValueError("algo.influence_mix must be in [0, 1] and algo.influence_temperature > 0")
        if self.span_tokens < 1 or self.position_buckets < 1:
            raise ValueError("algo.span_tokens and algo.position_buckets must be >= 1")


def split_spans(reference: str, task: Any, tokenizer: Any, unit: str, span_tokens: int) -> list[str]:
    """Spans that join back to `reference`."""
    if unit == "step":
        return task.solution_spans(reference)
    if unit == "sentence":
        return split_sentences(reference)
    ids = encode(tokenizer, reference)
    return [tokenizer.decode(ids[i: i + span_tokens]) for i in range(0, len(ids), span_tokens)]


def mask_rates(probs: Sequence[float], ratio: float) -> list[float]:
    """Per-span masking probabilities with mean `ratio` that follow the span distribution `probs`:
    `min(1, ratio x n x probs[j])` (uniform probs give `ratio` for every span)."""
    n = len(probs)
    return [min(1.0, ratio * n * p) for p in probs]


def draw_views(rng: random.Random, rates: Sequence[float], k: int, tries: int = MASK_TRIES,
               full_first: bool = False) -> list[list[bool]]:
    """`k` masks, span j hidden with probability `rates[j]` (a Bernoulli draw per span, so a view may
    hide nothing: the whole reference is a view too), each distinct from the ones before it where
    possible (a duplicate is redrawn up to `tries` times, then kept: with fewer possible masks than
    `k`, or rates of 0 and 1, views must repeat). `full_first`: the first view hides nothing."""
    views: list[list[bool]] = []
    seen: set[tuple[bool, ...]] = set()
    if full_first and k > 0:
        views.append([False] * len(rates))
        seen.add(tuple(views[0]))
    for _ in range(k - len(views)):
        for _ in range(tries):
            mask = tuple(rng.random() < r for r in rates)
            if mask not in seen:
                break
        seen.add(mask)
        views.append(list(mask))
    return views


@torch.no_grad()
def view_evidence(hidden: torch.Tensor, head: Any, input_ids: torch.Tensor, sel: torch.Tensor,
                  temperature: float, chunk: int) -> torch.Tensor:
    """(B, T, K) each view's evidence per completion token: its log-likelihood of the completion written
    before the token, `sum_{s<t} log p_k(y_s)` over the row's completion tokens s in `sel`; its softmax
    over the views is their posterior given that text (a uniform prior). A view whose reference conflicts
    with the path the student is on explains that path badly and loses its weight. hidden (B, T, K, H)
    predicting input_ids (B, T) at the `sel` (B, T) positions."""
    k = hidden.shape[2]
    feats, targets = hidden[sel], input_ids[sel]  # (N, K, H), (N,)
    token = torch.stack([losses.chunked_token_logprobs(feats[:, j], head, targets, temperature, chunk)
                         for j in range(k)], dim=-1)  # (N, K)
    dense = torch.zeros(sel.shape + (k,), dtype=torch.float32, device=hidden.device)
    dense[sel] = token.float()
    return dense.cumsum(1) - dense  # exclusive prefix sums: the tokens before t


def gate_tokens(stats: dict[str, torch.Tensor], cfg: MASSConfig) -> torch.Tensor:
    """The selective-transfer gate over N completion tokens, from `losses.self_distill_diagnostics`.

    Keep a token where the aggregated teacher corrects the student -- its excess mass on the tokens
    the student under-weights is above `gate_margin` -- and the views back that correction -- at least
    `gate_support` of them have the aggregate's top token, so a top that only some views reach (the
    others having lost the information with their masked spans) is dropped. Optionally also drop the
    tokens whose mean pairwise view disagreement is above the batch's `gate_agreement_quantile` (or above
    `gate_agreement_threshold` when > 0). Returns (N,) bool.
    """
    keep = stats["correction"] > cfg.gate_margin
    if cfg.gate_support > 0:
        keep &= stats["support"] >= cfg.gate_support - 1e-6
    agree = stats["disagreement"]
    if cfg.gate_agreement_threshold > 0:
        keep &= agree <= cfg.gate_agreement_threshold
    elif cfg.gate_agreement_quantile < 1.0 and agree.numel():
        keep &= agree <= torch.quantile(agree, cfg.gate_agreement_quantile)
    return keep


class InfluenceTracker:
    """Per-span influence scores: per example uid, with a relative-position prior for new questions."""

    def __init__(self, decay: float, buckets: int):
        self.decay, self.buckets = decay, buckets
        self.by_uid: OrderedDict[str, list[float]] = OrderedDict()
        self.prior = [0.0] * buckets
        self.prior_seen = [False] * buckets

    def bucket(self, j: int, n: int) -> int:
        return min(int(j / n * self.buckets), self.buckets - 1)

    def scores(self, uid: str, n: int) -> Optional[list[float]]:
        """The spans' scores for `uid`: its own estimate where a view has masked the span, else the
        position prior, else (neither known) the mean of the others, so it neither draws nor repels
        masks; None when nothing is known (masks are then drawn uniformly)."""
        known = self.by_uid.get(uid)
        own = known if known is not None and len(known) == n else [None] * n
        prior = [self.prior[self.bucket(j, n)] if self.prior_seen[self.bucket(j, n)] else None for j in range(n)]
        out = [o if o is not None else p for o, p in zip(own, prior)]
        have = [v for v in out if v is not None]
        if not have:
            return None
        fill = sum(have) / len(have)
        return [fill if v is None else v for v in out]

    def update(self, uid: str, estimate: list[Optional[float]]) -> None:
        """Fold one step's estimates in (None: no view masked that span; its score stays unknown or old)."""
        n = len(estimate)
        old = self.by_uid.pop(uid, None)
        new = []
        for j, e in enumerate(estimate):
            prev = old[j] if old is not None and len(old) == n else None
            new.append(prev if e is None else e if prev is None else self.decay * prev + (1 - self.decay) * e)
            if e is not None:
                b = self.bucket(j, n)
                self.prior[b] = e if not self.prior_seen[b] else self.decay * self.prior[b] + (1 - self.decay) * e
                self.prior_seen[b] = True
        self.by_uid[uid] = new
        while len(self.by_uid) > MAX_TRACKED_EXAMPLES:
            self.by_uid.popitem(last=False)

    def state_dict(self) -> dict:
        return {"by_uid": list(self.by_uid.items()), "prior": self.prior, "prior_seen": self.prior_seen}

    def load_state_dict(self, state: dict) -> None:
        self.by_uid = OrderedDict((uid, list(v)) for uid, v in state["by_uid"])
        self.prior, self.prior_seen = list(state["prior"]), list(state["prior_seen"])


def mask_probs(scores: Optional[list[float]], n: int, mix: float, temperature: float) -> list[float]:
    """(1 - mix) uniform + mix softmax(score / (temperature x mean score)); uniform without scores."""
    if scores is None or mix == 0 or n == 0:
        return [1.0 / max(n, 1)] * n
    scale = temperature * max(sum(scores) / n, 1e-8)
    top = max(scores)
    exp = [math.exp((s - top) / scale) for s in scores]
    z = sum(exp)
    return [(1 - mix) / n + mix * e / z for e in exp]


def span_influence(masks: list[list[bool]], view_shift: list[float]) -> list[Optional[float]]:
    """Per span: mean over the views that masked it of (view's shift / spans it masked); None if no view did."""
    n = len(masks[0]) if masks else 0
    sums, counts = [0.0] * n, [0] * n
    for mask, shift in zip(masks, view_shift):
        hidden = sum(mask)  # a view that hid nothing moved the teacher by no span
        for j, m in enumerate(mask):
            if m:
                sums[j] += shift / hidden
                counts[j] += 1
    return [s / c if c else None for s, c in zip(sums, counts)]


class MASS:
    name = "mass"

    def __init__(self, cfg: MASSConfig):
        self.cfg = cfg
        self.rng: Optional[random.Random] = None  # this rank's mask stream, seeded at the first batch
        self.teacher = self_teacher(cfg)
        self.influence = InfluenceTracker(cfg.influence_decay, cfg.position_buckets)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return train_all_or_lora(model, self.cfg)

    def weight_copies(self, model: nn.Module) -> float:
        """The frozen (`fixed`) or `ema` teacher's copy, made at the first step, or `teacher_path`'s model
        (trainer/memory.py)."""
        return self.teacher.copies(model)

    def place_frozen(self, place: Callable[[nn.Module], nn.Module]) -> None:
        self.teacher.place_frozen(place)  # teacher_path's model: sharded like the student under FSDP / ZeRO-3

    def check_task(self, task: Any) -> None:
        require_references(task.train_examples(), self.name)

    def mask_stream(self, rank: int) -> random.Random:
        """This rank's mask generator: seeded from (`seed`, rank), so ranks draw different masks."""
        if self.rng is None:
            self.rng = random.Random(f"mass-masks:{self.cfg.seed}:{rank}")
        return self.rng

    def views(self, ex: Any, task: Any, tokenizer: Any, rank: int = 0) -> tuple[list[str], list[list[bool]], float]:
        """K masked references for one example, their masks, and how focused the mask distribution is
        (max probability x spans: 1 = uniform)."""
        c = self.cfg
        spans = split_spans(ex.solution, task, tokenizer, c.span_unit, c.span_tokens)
        scores = self.influence.scores(ex.uid, len(spans)) if c.adaptive_masking else None
        probs = mask_probs(scores, len(spans), c.influence_mix, c.influence_temperature)
        masks = draw_views(self.mask_stream(rank), mask_rates(probs, c.mask_ratio), c.num_views, full_first=c.full_view)
        return [mask_spans(spans, m, task.mask_token) for m in masks], masks, max(probs, default=1.0) * len(spans)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        c, tok, task = self.cfg, ctx.tokenizer, ctx.task
        rank = ctx.world.rank if ctx.world is not None else 0
        prompts = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
        completions = sample(ctx, prompts, c.temperature, c.top_p)
        batch = rollout_batch(prompts, completions, tok.pad_token_id, ctx.device, [ex.uid for ex in examples])
        references, masks, focus = zip(*(self.views(ex, task, tok, rank) for ex in examples))
        shown = self.teacher.view_task(task)  # algo.teacher_chat_template: whose template renders its prompts
        views = [[encode_prompt(tok, shown.teacher_prompt(ex, r)) for r in refs] for ex, refs in zip(examples, references)]
        diagnose = diagnoses_paths(c, task)
        tokens, starts, width = [x.tokens for x in completions], [len(p) for p in prompts], batch.input_ids.shape[1]
        uids = [ex.uid for ex in examples]
        with self.teacher.weights(ctx.policy) as teacher:
            hidden = teacher_hidden(teacher, views, tokens, starts, width, c.teacher_batch_size, ctx.device,
                                    uids)  # (B, T, K, H)
            batch.teacher = TeacherTerms(hidden, detached_head(teacher))
            if c.aggregate == "posterior":
                batch.teacher.view_evidence = view_evidence(
                    hidden, batch.teacher.head, batch.input_ids, batch.loss_mask.bool(), c.temperature,
                    chunk_size(c, batch.teacher.head, batch))
            if diagnose:  # the full-reference teacher (OPSD's), for comparison only: not in the loss
                full = teacher_hidden(teacher, [[encode_prompt(tok, task.teacher_prompt(ex, ex.solution))] for ex in examples],
                                      tokens, starts, width, c.teacher_batch_size, ctx.device, uids)
        batch.metrics, _ = rollout_metrics(task, tok, examples, completions, "rollout")
        kept, views_top = (self._gate_and_influence(batch, examples, list(masks), ctx) if c.gate or c.adaptive_masking
                           else (None, None))
        batch.metrics["mass/mask_focus"] = torch.tensor(sum(focus) / len(focus))
        batch.metrics["mass/masked_share"] = torch.tensor(
            sum(sum(m) for row in masks for m in row) / max(sum(len(m) for row in masks for m in row), 1))
        batch.metrics["mass/distinct_views"] = torch.tensor(
            sum(len({tuple(m) for m in row}) for row in masks) / (len(masks) * c.num_views))
        if diagnose:
            sel, head = batch.loss_mask.bool(), batch.teacher.head
            chunk = chunk_size(c, head, batch)
            if views_top is None:  # no gate statistics were computed: the aggregated views' top token here
                evidence = batch.teacher.view_evidence
                views_top = losses.teacher_top_tokens(hidden[sel], head, temperature=c.temperature,
                                                      aggregate=c.aggregate, chunk=chunk,
                                                      view_evidence=None if evidence is None else evidence[sel],
                                                      confidence_temperature=c.confidence_temperature)
            full_top = losses.teacher_top_tokens(full[sel], head, temperature=c.temperature, chunk=chunk)
            batch.metrics.update(path_metrics(task, tok, examples, tokens, batch,
                                              {"full": full_top, "views": views_top}, kept))
        skip_leading_tokens(batch, c.skip_first_tokens)
        return batch

    @torch.no_grad()
    def _gate_and_influence(self, batch: Batch, examples: Sequence[Any], masks: list[list[list[bool]]],
                            ctx: RolloutContext) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """Token gate (into batch.token_weights) and influence updates, from one no-grad student pass.
        Returns the gate's keep flags over the completion tokens (N,) (None without the gate) and the
        aggregated teacher's top token there (N,), which the path diagnostics reuse."""
        c = self.cfg
        sel = batch.loss_mask.bool()  # (B, T)
        hidden = final_hidden(ctx.policy, batch.input_ids, batch.attention_mask)
        student = predicting(hidden)[sel]  # (N, H)
        stats = losses.self_distill_diagnostics(
            student, detached_head(ctx.policy), batch.teacher.hidden[sel], batch.teacher.head,
            temperature=c.temperature, aggregate=c.aggregate, chunk=chunk_size(c, batch.teacher.head, batch),
            view_evidence=None if batch.teacher.view_evidence is None else batch.teacher.view_evidence[sel],
            confidence_temperature=c.confidence_temperature)
        n = max(int(sel.sum()), 1)
        # correction tokens: the aggregated teacher would change the student's choice (its top is not the
        # sampled token, and the student gives that top less than the teacher does)
        corrects = (stats["teacher_top"] != batch.input_ids[sel]) & (stats["top_gap"] > 0)
        batch.metrics.update({"mass/view_disagreement": stats["disagreement"].sum() / n,
                              "mass/correction": stats["correction"].sum() / n,
                              "mass/correction_tokens": corrects.float().sum() / n,
                              "mass/teacher_student_jsd": stats["divergence"].sum() / n})
        if c.gate and stats["disagreement"].numel():
            keep = gate_tokens(stats, c)
            weights = torch.zeros(sel.shape, dtype=torch.float32, device=sel.device)
            weights[sel] = keep.float()
            batch.token_weights = weights
            batch.metrics["mass/kept_fraction"] = keep.float().mean()
            if corrects.any():  # a rank without correction tokens leaves the metric out (averaged over those that have)
                batch.metrics["mass/kept_correction_fraction"] = keep[corrects].float().mean()
        else:
            keep = None
        if c.adaptive_masking:
            row_of_token = torch.arange(len(batch), device=sel.device).unsqueeze(1).expand_as(sel)[sel]  # (N,)
            for b, ex in enumerate(examples):
                mine = row_of_token == b
                if mine.any():
                    shift = stats["view_shift"][:, mine].mean(1).tolist()  # (K,)
                    self.influence.update(ex.uid, span_influence(masks[b], shift))
        return keep, stats["teacher_top"]

    def after_eval(self, result: dict, model: nn.Module) -> tuple[dict, list[str]]:
        """The teacher's drift and refresh gate at each eval (algorithms/teacher.py)."""
        return self.teacher.after_eval(result, model)

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        return distill_loss(model, micro, normaliser, self.cfg, prefix=self.name)

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)

    def state_dict(self) -> dict:
        """What every rank shares: the teacher's weights (rank 0 writes it)."""
        return {"teacher": self.teacher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.teacher.load_state_dict(state["teacher"])

    def rank_state_dict(self) -> dict:
        """This rank's own: its mask stream and the influence scores of the examples it saw."""
        return {"rng": None if self.rng is None else self.rng.getstate(), "influence": self.influence.state_dict()}

    def load_rank_state_dict(self, state: dict) -> None:
        if state["rng"] is None:
            self.rng = None
        else:
            self.rng = random.Random()
            self.rng.setstate(state["rng"])
        self.influence.load_state_dict(state["influence"])
