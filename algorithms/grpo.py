"""GRPO: group-relative policy optimisation with verifier rewards.

References read for the semantics (no code taken): TRL `GRPOTrainer._compute_loss`, verl
`core_algos.compute_grpo_outcome_advantage` / `agg_loss`. Per step, for each prompt:

1. G = `num_generations` completions are sampled through the inference engine (`temperature`, `top_p`).
2. Each is rewarded by the reward functions (`reward_funcs`, TRL's signature, called once per batch:
   algorithms/rewards.py; default: the task's verifier alone, `reward_mode`: `steps` = right answer
   through fully right working, the default; `answer`; `partial`), their weighted sum over the
   functions that apply (`reward_weights`), plus `format_weight` when the completion states a final
   answer the verifier can read. A completion no function applies to (all None) is invalid: it is
   left out of its group's statistics and gets advantage 0 (counted in `grpo/reward_none`).
3. Advantages `A = (r - mean_group) / (std + eps)`: std of the group (`scale_rewards=group`, unbiased),
   of the whole batch over all ranks (`batch`), or no division (`none`, Dr. GRPO). A group whose
   rewards are all equal, or with fewer than 2 valid samples (G = 1), gets A = 0 (`grpo/frac_zero_std`).
4. Loss per completion token: `-min(rho A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A)` with
   `rho = exp(logp - old_logp)`; `old_logp` is the detached current log-prob for a single pass
   (`num_iterations=1`) or the policy's log-probs stored when the rollouts were made, the same batch
   then being reused for `num_iterations` optimizer steps. With `beta > 0`, `beta x` the k3 KL
   `exp(ref - logp) - (ref - logp) - 1` to the starting weights is added per token.
5. Aggregation (`loss_type`): `token-mean` (over all completion tokens of the global batch),
   `seq-mean-token-mean` (mean over sequences of each sequence's token mean), `dr_grpo` (token sum /
   (sequences x max_new_tokens)). The denominators are global counts (Batch.row_units), so the
   result is exact under gradient accumulation and data parallelism.

Log-probs come from final hidden states and the output head a chunk of tokens at a time, logits
divided by the sampling temperature (algorithms.losses.chunked_token_logprobs): no [B, T, V] fp32
logits. `trainer.prompt_sharing=true` computes each prompt once per group and replays the G responses
against its K/V, with the same loss and gradients: the trainer hands `share_prompts` the log-prob
function of trainer/prompt_sharing.py.

    python train.py +algo=grpo
    torchrun --standalone --nproc_per_node=2 train.py +algo=grpo trainer.activations=hilore
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.advantages import GroupRollouts, group_advantages
from algorithms.base import (Batch, LossChunking, PolicyTerms, RolloutContext, RowShape, StepOutput, TokenLogprobs,
                             Traits)
from algorithms.dynamic_sampling import DynamicSampling, ReferenceAndRetirementState, Retirement, fill_groups
from algorithms.rewards import RewardFunctions, build_rewards, call_rewards, combine, reward_inputs, reward_metrics
from algorithms.rollouts import encode_prompt, greedy_completions, rollout_batch, sample
from algorithms.losses import k3_kl
from algorithms.scoring import policy_logprobs, scatter_tokens, student_features
from algorithms.teacher import SelfTeacher
from models.export import export_model
from models.lora import LoRAOptions, train_all_or_lora
from tasks import DataError, score, task_capabilities

LOSS_TYPES = ("token-mean", "seq-mean-token-mean", "dr_grpo")


@dataclass
class Scored:
    """One completion's reward and the verifier's verdicts."""

    reward: float  # the training reward (0 when no reward function gave one)
    valid: bool  # some reward function gave a value
    correct: float  # the final answer is right
    steps: float  # right answer through right working
    has_answer: float  # states a final answer the verifier reads
    per_func: tuple[float, ...] = ()  # each reward function's value (NaN: it gave None)


@dataclass
class Group:
    """One prompt's G completions in a round of dynamic sampling."""

    example: Any
    prompt: list[int]
    outs: list[Any]
    scored: list[Scored]
    spread: bool
    generated_tokens: int
REWARD_MODES = ("answer", "steps", "partial")
DYNAMIC_METRICS = ("reward", "correct")


@dataclass
class GRPOConfig(LoRAOptions, LossChunking, DynamicSampling, GroupRollouts, RewardFunctions):
    traits: ClassVar[Traits] = Traits(prompt_sharing=True, tiny_lr=3e-5, lora=True)
    name: str = "grpo"
    temperature: float = 1.0  # rollout temperature; the loss divides logits by it too
    top_p: float = 1.0
    reward_mode: str = "steps"  # answer | steps | partial (tasks.score)
    format_weight: float = 0.0  # added when the completion states a final answer the verifier reads
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    num_iterations: int = 1  # optimizer steps per generated batch (> 1 stores old log-probs)
    beta: float = 0.0  # k3 KL to the starting weights
    loss_type: str = "token-mean"  # token-mean | seq-mean-token-mean | dr_grpo
    logprob_batch_size: int = 32  # rows per no-grad forward for old / reference log-probs
    dynamic_metric: str = "reward"  # dynamic sampling's spread: reward (the training reward) | correct (the answer)

    def validate(self) -> None:
        self.check_group_rollouts()
        if self.temperature <= 0:
            raise ValueError(f"algo.temperature={self.temperature} must be > 0 (rollouts sample)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"algo.top_p={self.top_p} must be in (0, 1]")
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"algo.reward_mode={self.reward_mode} is not one of {', '.join(REWARD_MODES)}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"algo.loss_type={self.loss_type} is not one of {', '.join(LOSS_TYPES)}")
        if not (0.0 <= self.epsilon_low < 1.0 and self.epsilon_high >= 0.0):
            raise ValueError(f"algo.epsilon_low={self.epsilon_low} must be in [0, 1) and "
                             f"algo.epsilon_high={self.epsilon_high} >= 0")
        if self.num_iterations < 1:
            raise ValueError(f"algo.num_iterations={self.num_iterations} must be >= 1")
        if self.beta < 0 or self.lora_rank < 0:
            raise ValueError("algo.beta and algo.lora_rank must be >= 0")
        self.check_loss_chunking()
        self.check_dynamic_sampling(self.dynamic_metric, DYNAMIC_METRICS)
        if self.logprob_batch_size <= 0:
            raise ValueError(f"algo.logprob_batch_size={self.logprob_batch_size} must be > 0")
        self.check_reward_funcs()


class GRPO(ReferenceAndRetirementState):
    name = "grpo"
    summary_metrics = {"reward": "held-out reward of the reward functions (greedy)"}

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.shared_logprobs: Optional[TokenLogprobs] = None  # trainer.prompt_sharing: see share_prompts
        self.rewards = build_rewards(cfg)  # RewardError (exit 3) when a function cannot be loaded
        self.reference = SelfTeacher("fixed", 0.0)  # the starting weights, for the KL term
        self._reuse: Optional[Batch] = None  # the generated batch while it serves num_iterations steps
        self._iteration = 0
        self.retirement = Retirement(cfg.retire_after)  # retire_after: prompts always / never solved
        if cfg.num_generations == 1:
            warnings.warn("algo.num_generations=1: every group-relative advantage is 0, so GRPO makes no update "
                          "(logged as grpo/frac_zero_std = 1)", stacklevel=2)

    @property
    def rows_per_prompt(self) -> int:
        return self.cfg.num_generations

    def share_prompts(self, token_logprobs: TokenLogprobs) -> None:
        """trainer.prompt_sharing: the loss takes its log-probs from `token_logprobs` (one packed forward
        per prompt group), and each prompt's G rows stay in one micro-batch."""
        self.shared_logprobs = token_logprobs

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return train_all_or_lora(model, self.cfg)

    def weight_copies(self, model: nn.Module) -> int:
        """The KL reference's copy of the starting weights (`beta > 0`, full fine-tuning; trainer/memory.py)."""
        return self.reference.copies(model) if self.cfg.beta > 0 else 0

    def row_shape(self) -> RowShape:
        """The student prompt + a sampled completion of at most trainer.max_new_tokens."""
        return RowShape("sampled")

    def check_task(self, task: Any) -> None:
        """A task without reference answers (data=chat without data.answer_field, data=text rows with none) has
        no verifier: the reward comes from algo.reward_funcs, and nothing may read the verifier's verdicts."""
        if task_capabilities(task).verifiable:
            return
        c = self.cfg
        why = ("the reward is the verifier's (algo.reward_funcs unset or naming 'verifier')"
               if any(r.fn is None for r in self.rewards) else
               "algo.dynamic_metric=correct reads it" if c.dynamic_sampling and c.dynamic_metric == "correct" else
               "algo.retire_after reads its verdicts" if c.retire_after > 0 else
               "algo.format_weight reads its answers" if c.format_weight else None)
        if why is not None:
            raise DataError(f"data={task.name}: its rows have no reference answers to verify, but {why}: give "
                            "algo.reward_funcs=[module:function,...] or answers (data.answer_field)")

    # --- rollouts -------------------------------------------------------------------------------

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        c = self.cfg
        if self._reuse is not None and self._iteration < c.num_iterations:
            self._iteration += 1  # the same rollouts, one more optimizer step against the stored old log-probs
            self._reuse.metrics = {**self._reuse.metrics, "grpo/iteration": torch.tensor(float(self._iteration)),
                                   "rollout/generated_tokens": torch.tensor(0.0)}  # nothing sampled for this one
            return self._reuse
        tok, g = ctx.tokenizer, c.num_generations
        fill, extra_tokens = None, 0
        if c.dynamic_sampling:  # only groups whose rewards spread, more prompts sampled to fill the batch
            self.retirement.begin_step()
            groups, fill = fill_groups(examples, ctx.draw_examples, lambda exs: self._groups(exs, ctx),
                                       c.dynamic_max_rounds, ctx.world)
            if not groups:  # every prompt drawn was retired: train this step's own prompts, retired or not
                groups = self._groups(examples, ctx, skip_retired=False)
                extra_tokens = sum(gr.generated_tokens for gr in groups)
            if c.retire_after > 0:
                self.retirement.share(ctx.world)
        else:
            groups = self._groups(examples, ctx, skip_retired=False)
        examples = [gr.example for gr in groups]
        prompts = [gr.prompt for gr in groups]
        outs = [o for gr in groups for o in gr.outs]
        scored = [x for gr in groups for x in gr.scored]
        rows = [p for p in prompts for _ in range(g)]  # prompt-major: rows b*G .. b*G+G-1
        rewards, valid, metrics = self.reward_metrics(scored)
        adv, zero_std = group_advantages(rewards, valid, g, c.advantage_eps, c.scale_rewards, ctx.world)
        batch = rollout_batch(rows, outs, tok.pad_token_id, ctx.device,
                              [f"{ex.uid}/{k}" for ex in examples for k in range(g)])
        batch.policy = PolicyTerms(adv.to(ctx.device),
                                   prompt_lengths=torch.tensor([len(p) for p in rows], device=ctx.device))
        if self.shared_logprobs is not None:
            batch.share_group = torch.arange(len(examples), device=ctx.device).repeat_interleave(g)
        if c.loss_type == "seq-mean-token-mean":
            batch.row_units = torch.ones(len(rows), device=ctx.device)
        elif c.loss_type == "dr_grpo":
            batch.row_units = torch.full((len(rows),), float(ctx.max_new_tokens), device=ctx.device)
        chunk = c.loss_chunk_tokens
        if c.num_iterations > 1:
            batch.policy.old_logprobs = policy_logprobs(ctx.policy, batch, c.temperature, chunk, c.logprob_batch_size)
        if c.beta > 0:
            with self.reference.weights(ctx.policy) as ref:
                batch.policy.ref_logprobs = policy_logprobs(ref, batch, c.temperature, chunk, c.logprob_batch_size)
        lengths = torch.tensor([float(len(o.tokens)) for o in outs])
        batch.metrics = {**metrics, "grpo/frac_zero_std": zero_std.float().mean(),
                         "grpo/advantage_abs": adv.abs().mean(), "rollout/length": lengths.mean(),
                         "grpo/empty_completions": (lengths == 0).float().mean(),
                         # completion tokens sampled for this step, every dynamic-sampling round included
                         "rollout/generated_tokens": torch.tensor(float(fill.generated_tokens + extra_tokens if fill
                                                                        is not None else lengths.sum()))}
        if fill is not None:
            batch.metrics.update(fill.metrics(int(lengths.sum())))
        if c.retire_after > 0:
            batch.metrics.update(self.retirement.metrics())
        if c.num_iterations > 1:
            self._reuse, self._iteration = batch, 1
            batch.metrics["grpo/iteration"] = torch.tensor(1.0)
        return batch

    def _groups(self, examples: Sequence[Any], ctx: RolloutContext, skip_retired: bool = True) -> list["Group"]:
        """Each example's G completions (one engine call), scored, and whether their `dynamic_metric`
        spreads: the step's rollouts, or one round of dynamic sampling (retired prompts skipped)."""
        c, tok, task, g = self.cfg, ctx.tokenizer, ctx.task, self.cfg.num_generations
        if skip_retired:
            examples = self.retirement.live(examples)
        if not examples:
            return []
        prompts = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
        outs = sample(ctx, [p for p in prompts for _ in range(g)], c.temperature, c.top_p)
        scored = self.score([ex for ex in examples for _ in range(g)], outs, tok, task)
        groups = []
        for b, (ex, prompt) in enumerate(zip(examples, prompts)):
            mine = scored[b * g:(b + 1) * g]
            values = [s.reward if c.dynamic_metric == "reward" else s.correct for s in mine if s.valid]
            groups.append(Group(ex, prompt, outs[b * g:(b + 1) * g], mine, spread=len(set(values)) > 1,
                                generated_tokens=sum(len(o.tokens) for o in outs[b * g:(b + 1) * g])))
            self.retirement.visit(ex.uid, [s.correct for s in mine])
        return groups

    def score(self, examples: Sequence[Any], outs: Sequence[Any], tok: Any, task: Any) -> list["Scored"]:
        """Each completion's reward (None-safe: `valid` False when the reward function gave none) and the
        verifier's verdicts, for completions paired with their examples."""
        c = self.cfg
        texts = [tok.decode(o.tokens, skip_special_tokens=True) for o in outs]
        verified = task_capabilities(task).verifiable
        results = [task.verify(ex, text) for ex, text in zip(examples, texts)] if verified else None
        table = call_rewards(self.rewards, reward_inputs(task, examples, texts, [o.tokens for o in outs]),
                             [ex.uid for ex in examples],
                             [score(r, c.reward_mode) for r in results] if verified else None)  # (N, F)
        totals, valid = combine(table, self.rewards)
        out = []
        for i, (total, ok) in enumerate(zip(totals.tolist(), valid.tolist())):
            r = results[i] if verified else None
            has_answer = r is not None and r.answer is not None
            out.append(Scored(total + c.format_weight * has_answer, ok, float(r.correct) if r else 0.0,
                              score(r, "steps") if r else 0.0, float(has_answer), tuple(table[i].tolist())))
        return out

    def reward_metrics(self, scored: Sequence["Scored"]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        valid_t = torch.tensor([s.valid for s in scored], dtype=torch.bool)
        rewards_t = torch.tensor([s.reward for s in scored])
        n_valid = valid_t.sum().clamp(min=1)
        metrics = {"rollout/reward": (rewards_t * valid_t).sum() / n_valid,
                   "grpo/reward_none": (~valid_t).float().mean(),
                   "grpo/answer_correct": torch.tensor([s.correct for s in scored]).mean(),
                   "grpo/steps_correct": torch.tensor([s.steps for s in scored]).mean(),
                   "grpo/has_answer": torch.tensor([s.has_answer for s in scored]).mean()}
        if scored and scored[0].per_func:
            metrics.update(reward_metrics(torch.tensor([s.per_func for s in scored], dtype=torch.float64),
                                          self.rewards))
        return rewards_t, valid_t, metrics

    def extra_eval(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                   max_new_tokens: int) -> dict[str, float]:
        """With reward functions of the user's: the reward of greedy completions of held-out prompts (`reward`,
        and each function's `rewards/NAME/mean`; TRL's eval reward), the figure a task without reference
        answers has. Empty when the verifier is the only reward (the eval's accuracy says it)."""
        if all(r.fn is None for r in self.rewards) or not examples:
            return {}
        outs = greedy_completions(model, tokenizer, task, examples, max_new_tokens)
        _, _, metrics = self.reward_metrics(self.score(examples, outs, tokenizer, task))
        return {"reward": float(metrics["rollout/reward"]),
                **{k: float(v) for k, v in metrics.items() if k.startswith("rewards/") and k.endswith("/mean")}}

    # --- loss -----------------------------------------------------------------------------------

    def token_logprobs(self, model: nn.Module, micro: Batch) -> torch.Tensor:
        """(N,) log-probs (with grad) of the micro-batch's completion tokens, in loss_mask order."""
        c, sel = self.cfg, micro.loss_mask.bool()
        if self.shared_logprobs is not None:
            return self.shared_logprobs(model, micro.input_ids, micro.attention_mask, micro.policy.prompt_lengths,
                                        c.temperature, c.loss_chunk_tokens)[sel]
        feats, head = student_features(model, micro.input_ids, micro.attention_mask)
        chunk = c.loss_chunk_tokens or losses.auto_chunk(feats.shape[-1] if head is None else head[0].shape[0], 0)
        return losses.chunked_token_logprobs(feats[sel], head, micro.input_ids[sel], c.temperature, chunk)

    def token_weights(self, micro: Batch) -> torch.Tensor:
        """(B, T) weight of each token's loss before the global normaliser: 1, or 1 / the row's
        completion tokens for the sequence mean."""
        mask = micro.loss_mask.float()
        if self.cfg.loss_type == "seq-mean-token-mean":
            return mask / mask.sum(1, keepdim=True).clamp(min=1)
        return mask

    def exposure(self, micro: Batch) -> torch.Tensor:
        """(B, T) |dL/dlogp| per token as known before the forward (rho taken as 1): |A| x the token's
        weight. Tokens of zero-advantage rows are not exposed at all (trainer/activations/)."""
        return micro.policy.advantages.abs().unsqueeze(1) * self.token_weights(micro)

    def zero_loss(self, micro: Batch) -> bool:
        """True when no completion token of `micro` sits in a row with a non-zero advantage and there is
        no KL term: every token's clipped term is then -min(rho 0, clip(rho) 0) = 0, so the loss and its
        gradient are exactly 0 and the trainer skips the micro-batch's forward and backward. With
        `beta > 0` the KL term trains every token whatever its advantage, so nothing is skipped."""
        if self.cfg.beta > 0:
            return False
        live = micro.loss_mask.bool() & (micro.policy.advantages != 0).unsqueeze(1)
        return not bool(live.any())

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        c, sel = self.cfg, micro.loss_mask.bool()
        logp = self.token_logprobs(model, micro)  # (N,)
        terms = micro.policy
        adv = terms.advantages.unsqueeze(1).expand_as(sel)[sel]
        old = terms.old_logprobs[sel] if terms.old_logprobs is not None else logp.detach()
        per_token = losses.clipped_policy_gradient(logp, old, adv, c.epsilon_low, c.epsilon_high)
        metrics: dict[str, torch.Tensor] = {}
        if c.beta > 0:
            kl = k3_kl(terms.ref_logprobs[sel], logp)
            per_token = per_token + c.beta * kl
            metrics["grpo/kl"] = _mean(kl.detach())
        weights = self.token_weights(micro)[sel]
        loss = (per_token * weights).sum() / normaliser
        ratio = torch.exp(logp.detach() - old)
        low = (ratio < 1 - c.epsilon_low) & (adv < 0)
        high = (ratio > 1 + c.epsilon_high) & (adv > 0)
        metrics.update({"grpo/policy_loss": _mean(per_token.detach()), "grpo/ratio": _mean(ratio),
                        "grpo/clip_low": _mean(low.float()), "grpo/clip_high": _mean(high.float())})
        return StepOutput(loss, metrics, scatter_tokens(logp, sel))

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)


def _mean(values: torch.Tensor) -> torch.Tensor:
    return values.float().mean() if values.numel() else values.new_zeros((), dtype=torch.float32)
