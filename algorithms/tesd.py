"""TESD: Teacher-Evolution Self-Distillation -- OPSD where the self-teacher also learns to teach,
and the student trusts it only as far as its guidance proved reliable.

Paper: Yu, Dong, Zhang et al., "Teacher-Evolution Self-Distillation" (no public code; our reading and
its formulas: docs/tesd.md). Per step, for each question:
1. The student samples one completion (as OPSD); the teacher -- the same weights under the
   privileged prompt -- samples `teacher_rollouts` (G) completions. One engine call does both.
2. Each teacher rollout is rewarded: correctness (the task verifier, `reward_mode`) +
   `independence_weight` x context independence, where independence in [-1, 0] is the per-token
   mean of `log p(y | q) - log p(y | q, s)` (same temperature) minus `copy_penalty` if the rollout
   copies `copy_ngram` consecutive reference tokens, minus `phrase_penalty` if it mentions the
   reference (`reference_phrases`), clipped to [-1, 0].
3. Teacher-oriented term: the group-relative clipped policy gradient (GRPO; advantages over the G
   rollouts of a question) on the teacher rollouts under the privileged prompt, so the self-teacher
   gets better at teaching.
4. Student-oriented term: the OPSD divergence on the student rollout, each sample weighted by its
   teacher's reliability = mean reward of that question's teacher rollouts mapped to [0, 1]
   ((r + lambda) / (1 + lambda)): unreliable guidance is down-weighted, not dropped.
5. Total = student term + alpha x teacher term, each a mean over its own tokens (two loss groups,
   each normalised by its global token count). Both terms and a 5-bin reliability histogram are logged.

Choices that are ours: the independence term's normalisation (per-token mean, one clip for all
three parts), the copy n-gram length in tokens, lambda = 0.5, and single-pass on-policy ratios
(old log-probs = current, detached).

    python train.py +algo=tesd trainer.batch_size=8 algo.teacher_rollouts=3
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.advantages import group_advantages
from algorithms.base import Batch, PolicyTerms, RolloutContext, StepOutput, TeacherTerms, pad_right
from algorithms.dynamic_sampling import DynamicSampling, Retirement, fill_groups
from algorithms.rollouts import completion_mask, encode, encode_prompt, require_references, rollout_batch, sample
from algorithms.scoring import detached_head, predicting, scatter_tokens, student_features, teacher_hidden
from algorithms.selfdistill import (SelfDistillConfig, check_self_distill_config, diagnoses_paths, distill_terms,
                                    path_metrics, reference_teacher_tops, skip_leading_tokens)
from models.anatomy import final_hidden
from models.export import export_model
from models.lora import train_all_or_lora
from tasks import score

STUDENT, TEACHER = 0, 1  # loss groups
RELIABILITY_BINS = 5
REWARD_MODES = ("answer", "steps", "partial")
DYNAMIC_METRICS = ("correct", "reward")


@dataclass
class TESDConfig(SelfDistillConfig, DynamicSampling):
    name: str = "tesd"
    teacher: str = "current"  # TESD trains the teacher itself
    teacher_rollouts: int = 4  # G per question, under the privileged prompt
    alpha: float = 0.5  # weight of the teacher-oriented term
    independence_weight: float = 0.5  # lambda
    reward_mode: str = "steps"  # correctness: answer | steps | partial (tasks.score)
    copy_ngram: int = 32  # tokens; 0 disables the copy penalty
    copy_penalty: float = 0.5
    reference_phrases: list[str] = field(default_factory=lambda: ["the reference", "reference solution"])
    phrase_penalty: float = 0.5
    clip_eps: float = 0.2
    advantage_eps: float = 1e-4
    # dynamic sampling of the teacher term: train only teacher groups whose rewards spread, drawing more
    # questions (teacher rollouts only) to fill it; the student term keeps the step's own questions
    dynamic_metric: str = "correct"  # correct (the verifier's score) | reward (+ independence: spreads almost always)

    def validate(self) -> None:
        check_self_distill_config(self)
        if self.teacher != "current":
            raise ValueError(f"algo.teacher={self.teacher}: tesd trains the teacher itself, so it must be 'current'")
        if self.teacher_rollouts < 2:
            raise ValueError(f"algo.teacher_rollouts={self.teacher_rollouts} must be >= 2 (group-relative advantages)")
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"algo.reward_mode={self.reward_mode} is not one of {', '.join(REWARD_MODES)}")
        self.check_dynamic_sampling(self.dynamic_metric, DYNAMIC_METRICS)
        if self.alpha < 0 or self.independence_weight < 0 or self.copy_ngram < 0:
            raise ValueError("algo.alpha, algo.independence_weight and algo.copy_ngram must be >= 0")


def copies_reference(completion: Sequence[int], reference: Sequence[int], n: int) -> bool:
    """True when `completion` contains n consecutive tokens that also appear consecutively in `reference`."""
    if n <= 0 or len(completion) < n or len(reference) < n:
        return False
    grams = {tuple(reference[i: i + n]) for i in range(len(reference) - n + 1)}
    return any(tuple(completion[i: i + n]) in grams for i in range(len(completion) - n + 1))


def independence(logp_plain: float, logp_privileged: float, copied: bool, mentions: bool, cfg: TESDConfig) -> float:
    """Context independence in [-1, 0]: per-token mean log p(y|q) - log p(y|q,s), minus the copy and
    mention penalties, clipped. Example: -0.3 with a copy (penalty 0.5) -> -0.8."""
    value = logp_plain - logp_privileged - cfg.copy_penalty * copied - cfg.phrase_penalty * mentions
    return min(max(value, -1.0), 0.0)


def reliability(rewards: torch.Tensor, lam: float) -> torch.Tensor:
    """Mean teacher reward per question (G rewards each, rows of `rewards` (B, G)) mapped from
    [-lambda, 1] to [0, 1]."""
    return ((rewards.mean(1) + lam) / (1.0 + lam)).clamp(0.0, 1.0)


@torch.no_grad()
def mean_token_logprobs(model: nn.Module, prompts: list[list[int]], completions: list[list[int]],
                        temperature: float, chunk: int, device: torch.device) -> list[float]:
    """Per row, the mean log-prob of `completions[i]` after `prompts[i]` (no grad)."""
    ids, attn = pad_right([p + c for p, c in zip(prompts, completions)], 0, device)
    sel = completion_mask(prompts, completions, ids).bool()
    hidden = final_hidden(model, ids, attn)
    head = detached_head(model)
    chunk = chunk or losses.auto_chunk(head[0].shape[0], 0)
    logp = losses.chunked_token_logprobs(predicting(hidden)[sel], head, ids[sel], temperature, chunk)
    per_row = scatter_tokens(logp, sel).sum(1) / sel.sum(1).clamp(min=1)
    return per_row.tolist()


@dataclass
class TeacherGroup:
    """One question's G teacher rollouts under the privileged prompt, rewarded."""

    example: Any
    prompt: list[int]  # the privileged prompt
    outs: list[Any]
    rewards: torch.Tensor  # (G,) correctness + independence_weight x independence
    correct: torch.Tensor  # (G,)
    independence: torch.Tensor  # (G,)
    spread: bool  # the dynamic_metric differs within the group
    generated_tokens: int


class TESD:
    name = "tesd"

    def __init__(self, cfg: TESDConfig):
        self.cfg = cfg
        self.retirement = Retirement(cfg.retire_after)  # questions whose teacher always / never solves them

    @property
    def rows_per_prompt(self) -> int:  # 1 student + G teacher rows per question (micro-batch count)
        return 1 + self.cfg.teacher_rollouts

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return train_all_or_lora(model, self.cfg)

    def check_task(self, task: Any) -> None:
        require_references(task.train_examples(), self.name)

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        c, tok, task, g = self.cfg, ctx.tokenizer, ctx.task, self.cfg.teacher_rollouts
        self.retirement.begin_step()
        plain = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
        privileged = [encode_prompt(tok, task.teacher_prompt(ex, ex.solution)) for ex in examples]
        outs = sample(ctx, plain + [p for p in privileged for _ in range(g)], c.temperature, c.top_p)  # one engine call
        student_outs = outs[: len(plain)]
        own = self._teacher_groups(examples, plain, privileged, outs[len(plain):], ctx)  # this step's questions
        trust = reliability(torch.stack([grp.rewards for grp in own]), c.independence_weight)  # (B,)
        fill = None
        if c.dynamic_sampling:  # the teacher term trains groups whose rewards spread, drawing more questions
            rounds = [own]
            groups, fill = fill_groups(examples, ctx.draw_examples,
                                       lambda exs: rounds.pop() if rounds else self._sample_teacher(exs, ctx),
                                       c.dynamic_max_rounds, ctx.world)
            if c.retire_after > 0:
                self.retirement.share(ctx.world)
        else:
            groups = own

        student = rollout_batch(plain, student_outs, tok.pad_token_id, ctx.device, [ex.uid for ex in examples])
        hidden = teacher_hidden(ctx.policy, [[p] for p in privileged], [o.tokens for o in student_outs],
                                [len(p) for p in plain], student.input_ids.shape[1], c.teacher_batch_size, ctx.device,
                                student.uids)
        student.teacher = TeacherTerms(hidden, detached_head(ctx.policy))
        student.token_weights = student.loss_mask.float() * trust.to(ctx.device).unsqueeze(1)
        teacher = rollout_batch([grp.prompt for grp in groups for _ in range(g)], [o for grp in groups for o in grp.outs],
                                tok.pad_token_id, ctx.device,
                                [f"{grp.example.uid}/teacher{k}" for grp in groups for k in range(g)])
        rewards = torch.cat([grp.rewards for grp in groups])
        advantages, _ = group_advantages(rewards, torch.ones_like(rewards, dtype=torch.bool), g, c.advantage_eps)
        teacher.policy = PolicyTerms(advantages.to(ctx.device))
        batch = join(student, teacher)
        parts = {name: torch.cat([getattr(grp, name) for grp in own]).mean() for name in ("correct", "independence")}
        batch.metrics = {"tesd/teacher_correct": parts["correct"], "tesd/independence": parts["independence"],
                         "tesd/teacher_reward": torch.cat([grp.rewards for grp in own]).mean(),
                         **_histogram(trust), "tesd/reliability": trust.mean(),
                         "rollout/reward": torch.tensor(self._mean_reward(task, tok, examples, student_outs))}
        if fill is not None:
            batch.metrics.update(fill.metrics(trained_tokens=int(teacher.loss_mask.sum())))
        if c.retire_after > 0:
            batch.metrics.update(self.retirement.metrics())
        if diagnoses_paths(c, task):
            batch.metrics.update(path_metrics(task, tok, examples, [o.tokens for o in student_outs], student,
                                              reference_teacher_tops(student, c)))
        skip_leading_tokens(batch, c.skip_first_tokens, rows=batch.row_group == STUDENT)  # the distillation rows
        return batch

    def correctness(self, task: Any, example: Any, text: str) -> float:
        """The verifier's score of one completion under `reward_mode` (tasks.score)."""
        return score(task.verify(example, text), self.cfg.reward_mode)

    def _mean_reward(self, task, tok, examples, outs) -> float:
        return sum(self.correctness(task, ex, tok.decode(o.tokens, skip_special_tokens=True))
                   for ex, o in zip(examples, outs)) / max(len(outs), 1)

    def _sample_teacher(self, examples: Sequence[Any], ctx: RolloutContext) -> list["TeacherGroup"]:
        """One round of dynamic sampling: G teacher rollouts for each of `examples` (no student rollout),
        retired questions skipped."""
        tok, task, g = ctx.tokenizer, ctx.task, self.cfg.teacher_rollouts
        examples = self.retirement.live(examples)
        if not examples:
            return []
        plain = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
        privileged = [encode_prompt(tok, task.teacher_prompt(ex, ex.solution)) for ex in examples]
        outs = sample(ctx, [p for p in privileged for _ in range(g)], self.cfg.temperature, self.cfg.top_p)
        return self._teacher_groups(examples, plain, privileged, outs, ctx)

    def _teacher_groups(self, examples, plain, privileged, outs, ctx) -> list["TeacherGroup"]:
        """Each question's G teacher rollouts (question-major in `outs`) with their rewards: correctness +
        independence_weight x context independence, and whether the `dynamic_metric` spreads."""
        c, tok, g = self.cfg, ctx.tokenizer, self.cfg.teacher_rollouts
        logp_plain = mean_token_logprobs(ctx.policy, [plain[i // g] for i in range(len(outs))], [o.tokens for o in outs],
                                         c.temperature, c.loss_chunk_tokens, ctx.device)  # 0: auto
        groups = []
        for b, ex in enumerate(examples):
            mine, reference = outs[b * g:(b + 1) * g], encode(tok, ex.solution)
            correct, indep = [], []
            for k, out in enumerate(mine):
                text = tok.decode(out.tokens, skip_special_tokens=True)
                correct.append(self.correctness(ctx.task, ex, text))
                logp_priv = sum(out.logprobs) / max(len(out.logprobs), 1)
                copied = copies_reference(out.tokens, reference, c.copy_ngram)
                mentions = any(p.lower() in text.lower() for p in c.reference_phrases)
                indep.append(independence(logp_plain[b * g + k], logp_priv, copied, mentions, c))
            correct_t, indep_t = torch.tensor(correct), torch.tensor(indep)
            rewards = correct_t + c.independence_weight * indep_t
            values = correct if c.dynamic_metric == "correct" else rewards.tolist()
            groups.append(TeacherGroup(ex, privileged[b], mine, rewards, correct_t, indep_t, spread=len(set(values)) > 1,
                                       generated_tokens=sum(len(o.tokens) for o in mine)))
            self.retirement.visit(ex.uid, correct)
        return groups

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        """student term / its tokens + alpha x teacher term / its tokens (normaliser (2,))."""
        c = self.cfg
        feats, head = student_features(model, micro.input_ids, micro.attention_mask)  # (B, T, H|V)
        mask = micro.loss_mask.bool()
        is_teacher = (micro.row_group == TEACHER).unsqueeze(1)  # (B, 1)
        sel_s, sel_t = mask & ~is_teacher, mask & is_teacher
        div, weights, logp_s, extra = distill_terms(feats, head, micro, sel_s, c)
        student_term = losses.weighted_token_loss(div, weights, normaliser[STUDENT])
        chunk = c.loss_chunk_tokens or losses.auto_chunk(micro.teacher.head[0].shape[0], 0)
        logp_t = losses.chunked_token_logprobs(feats[sel_t], head, micro.input_ids[sel_t], c.temperature,
                                               chunk)  # (N_t,)
        adv = micro.policy.advantages.unsqueeze(1).expand_as(sel_t)[sel_t]  # (N_t,)
        pg = losses.clipped_policy_gradient(logp_t, logp_t.detach(), adv, c.clip_eps, c.clip_eps)
        teacher_term = pg.sum() / normaliser[TEACHER]
        n_s, n_t = max(int(div.numel()), 1), max(int(pg.numel()), 1)
        metrics = {"tesd/student_loss": (div * weights).detach().sum() / n_s,
                   "tesd/teacher_loss": pg.detach().sum() / n_t, "tesd/divergence": div.detach().sum() / n_s,
                   **{f"tesd/{k}": v for k, v in extra.items()}}
        token_logprobs = scatter_tokens(logp_s, sel_s) + scatter_tokens(logp_t, sel_t)
        return StepOutput(student_term + c.alpha * teacher_term, metrics, token_logprobs)

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)

    def state_dict(self) -> dict:
        """The retired questions (retire_after), the same on every rank."""
        return self.retirement.state_dict() if self.cfg.retire_after > 0 else {}

    def load_state_dict(self, state: dict) -> None:
        self.retirement.load_state_dict(state)

    def rank_state_dict(self) -> dict:
        """This rank's visit streaks towards retirement (retire_after)."""
        return self.retirement.rank_state_dict()

    def load_rank_state_dict(self, state: dict) -> None:
        self.retirement.load_rank_state_dict(state)


def join(student: Batch, teacher: Batch) -> Batch:
    """One batch of student rows (group 0) then teacher rows (group 1), padded to one width."""
    width = max(student.input_ids.shape[1], teacher.input_ids.shape[1])

    def widen(t: Optional[torch.Tensor], rows: int, like: torch.Tensor, fill=0) -> torch.Tensor:
        if t is None:
            shape = (rows, width) + tuple(like.shape[2:])
            return torch.full(shape, fill, dtype=like.dtype, device=like.device)
        pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
        return torch.nn.functional.pad(t, pad, value=fill)

    s, t = student, teacher
    hidden = torch.cat([widen(s.teacher.hidden, len(s), s.teacher.hidden),
                        widen(None, len(t), s.teacher.hidden)])
    advantages = t.policy.advantages
    cat = lambda a, b, fill=0: torch.cat([widen(a, len(s), a, fill), widen(b, len(t), b, fill)])  # noqa: E731
    return Batch(
        input_ids=cat(s.input_ids, t.input_ids), attention_mask=cat(s.attention_mask, t.attention_mask),
        loss_mask=cat(s.loss_mask, t.loss_mask), rollout_logprobs=cat(s.rollout_logprobs, t.rollout_logprobs),
        token_weights=cat(s.token_weights, t.loss_mask.float()), teacher=TeacherTerms(hidden, s.teacher.head),
        policy=PolicyTerms(torch.cat([torch.zeros(len(s), device=advantages.device), advantages])),
        row_group=torch.tensor([STUDENT] * len(s) + [TEACHER] * len(t), device=s.input_ids.device), num_groups=2,
        uids=s.uids + t.uids)


def _histogram(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Share of questions per reliability bin: tesd/reliability_hist/0.0-0.2 ... 0.8-1.0."""
    bins = torch.clamp((values * RELIABILITY_BINS).long(), max=RELIABILITY_BINS - 1)
    counts = torch.bincount(bins, minlength=RELIABILITY_BINS).float() / max(len(values), 1)
    return {f"tesd/reliability_hist/{i / RELIABILITY_BINS:.1f}-{(i + 1) / RELIABILITY_BINS:.1f}": counts[i]
            for i in range(RELIABILITY_BINS)}
