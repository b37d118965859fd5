"""CLM: RL for context language models -- the model manages its own context, a file it may rewrite.

An episode (tasks/clm.py) is a protected prefix (system + task) and editable turns; every model call
either appends a turn or rewrites the whole editable part (`REWRITE` + the new turns), and the
context must stay inside a token budget. Per step, for each task episode:

1. G = `num_generations` episodes are played through the session engine (`inference.suffix`): all
   live episodes step in lockstep, one batched `generate` per round, each episode a session whose
   previous K/V the engine reuses (`reuse`: prefix caching by default, exact; `suffix` also relocates
   the spans a rewrite moved; `full` re-prefills). The engine reports what each call forwarded.
2. The task reward r_i (1 when the episode answered right; with `reward_funcs`, the weighted sum of
   reward functions in TRL's signature over the episodes' final outputs, algorithms/rewards.py, in
   which `verifier` is that 1/0) is normalised within the group
   (`algorithms.advantages.group_advantages`; an episode the environment refused, e.g. a budget
   smaller than its protected prefix, is invalid: left out of the statistics, advantage 0).
3. The efficiency advantage of episode i: a_eff_i = clip((mean_c - c_i) / mean_c, -1, 1), mean_c the
   mean compute of the group's successful episodes (c = prefill tokens actually forwarded + decoded
   tokens, as the engine measured them); 0 for failed episodes and for a group with fewer than 2
   successes. It is paid only on edit calls (m = 1 on the tokens of a call whose action rewrites the
   context):  A[call, t] = r_i + w_eff * a_eff_i * m[call].  w_eff = 0 is plain stepwise GRPO.
4. Stepwise training: every model call is one training row, trained under the exact context it was
   generated from (its own prompt ids + its completion); the loss is the clipped policy gradient
   `-min(rho A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A)` on completion tokens, token-mean over
   the global batch (the trainer's normaliser), single pass (old log-probs = the detached current).

    python train.py +algo=clm data=clm
    torchrun --standalone --nproc_per_node=2 train.py +algo=clm data=clm algo.reuse=suffix
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

import torch
from torch import nn

from algorithms import losses
from algorithms.advantages import GroupRollouts, group_advantages
from algorithms.dynamic_sampling import DynamicSampling, ReferenceAndRetirementState, Retirement, fill_groups
from algorithms.base import Batch, LossChunking, PolicyTerms, RolloutContext, StepOutput, Traits
from algorithms.rewards import RewardFunctions, build_rewards, call_rewards, combine, reward_inputs, reward_metrics
from algorithms.rollouts import encode, encode_prompt, rollout_batch
from algorithms.losses import k3_kl
from algorithms.scoring import policy_logprobs, scatter_tokens, student_features
from algorithms.teacher import SelfTeacher
from models.export import export_model
from models.lora import LoRAOptions, train_all_or_lora
from models.prompts import generation_eos, stop_ids
from tasks import DataError
from tasks.clm import ClmTask, ContextEnv, Episode, EpisodeError

if TYPE_CHECKING:  # the runtime is imported where it runs: config loading imports this module and stays light
    from inference import SamplingParams
    from inference.suffix import ReuseConfig, SessionEngine

REUSE_MODES = ("full", "prefix", "suffix")  # inference.suffix.MODES (a test keeps them equal)
DYNAMIC_METRICS = ("signal", "success")


@dataclass
class CLMConfig(LoRAOptions, LossChunking, DynamicSampling, GroupRollouts, RewardFunctions):
    traits: ClassVar[Traits] = Traits(deepspeed=False, tiny_lr=1e-4, lora=True)
    name: str = "clm"
    temperature: float = 1.0  # rollout temperature; the loss divides logits by it too
    top_p: float = 1.0
    w_eff: float = 0.25  # weight of the efficiency advantage on edit calls (0 = plain stepwise GRPO)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    max_calls: int = 16  # model calls per episode; more ends it as `call_cap` (reward 0)
    budget: int = 0  # context token budget; 0 = each episode's own (the task's default)
    # the session engine's cache reuse for rollouts (and eval), and so the compute the efficiency term sees
    reuse: str = "prefix"  # full | prefix | suffix
    reuse_max_spans: int = 6
    reuse_min_span: int = 64
    reuse_reforward: int = 16
    reuse_min_gain: int = 32
    beta: float = 0.0  # k3 KL to the starting weights on every call token (0 = off, no reference copy)
    logprob_batch_size: int = 32  # call rows per no-grad forward for the reference log-probs
    dynamic_metric: str = "signal"  # dynamic sampling's spread: signal (success or the successes' compute differs) | success

    def validate(self) -> None:
        self.check_group_rollouts()
        if self.temperature <= 0:
            raise ValueError(f"algo.temperature={self.temperature} must be > 0 (rollouts sample)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"algo.top_p={self.top_p} must be in (0, 1]")
        if self.w_eff < 0:
            raise ValueError(f"algo.w_eff={self.w_eff} must be >= 0")
        self.check_dynamic_sampling(self.dynamic_metric, DYNAMIC_METRICS)
        if not (0.0 <= self.epsilon_low < 1.0 and self.epsilon_high >= 0.0):
            raise ValueError(f"algo.epsilon_low={self.epsilon_low} must be in [0, 1) and "
                             f"algo.epsilon_high={self.epsilon_high} >= 0")
        if self.max_calls < 1:
            raise ValueError(f"algo.max_calls={self.max_calls} must be >= 1")
        if self.budget < 0 or self.lora_rank < 0:
            raise ValueError("algo.budget and algo.lora_rank must be >= 0")
        self.check_loss_chunking()
        if self.beta < 0:
            raise ValueError(f"algo.beta={self.beta} must be >= 0")
        if self.logprob_batch_size < 1:
            raise ValueError(f"algo.logprob_batch_size={self.logprob_batch_size} must be >= 1")
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"algo.reuse={self.reuse} is not one of {', '.join(REUSE_MODES)}")
        self.reuse_config()  # the engine's own checks, named by key
        self.check_reward_funcs()

    def reuse_config(self) -> "ReuseConfig":
        from inference.suffix import ReuseConfig

        try:
            return ReuseConfig(mode=self.reuse, max_spans=self.reuse_max_spans, min_span=self.reuse_min_span,
                               reforward=self.reuse_reforward, min_gain=self.reuse_min_gain)
        except ValueError as err:
            raise ValueError(f"algo.reuse_*: {err}") from None


# --- the advantage ---------------------------------------------------------------------------------


def efficiency_advantages(compute: torch.Tensor, success: torch.Tensor, group_size: int) -> torch.Tensor:
    """a_eff per episode: clip((mean_c - c) / mean_c, -1, 1) over each group's successful episodes
    (mean_c their mean compute); 0 for the others and for every episode of a group with < 2 successes.
    compute (N,), success (N,) bool, N = groups x group_size -> (N,) fp32.
    Example: compute [100, 300, 50, 80], success [1, 1, 0, 1], one group -> mean_c 160 ->
    [0.375, -0.875, 0, 0.5]."""
    c = compute.double().view(-1, group_size)
    ok = success.view(-1, group_size).double()
    n = ok.sum(1, keepdim=True)
    mean = (c * ok).sum(1, keepdim=True) / n.clamp(min=1)
    a = ((mean - c) / mean.clamp(min=1e-12)).clamp(-1.0, 1.0) * ok
    return torch.where(n < 2, torch.zeros_like(a), a).view(-1).float()


@dataclass
class EpisodeGroup:
    """One task's G episodes in a round of dynamic sampling."""

    trajs: list[Any]
    spread: bool  # a learning signal: success differs within the group, or the successes' compute does
    generated_tokens: int


def episode_groups(trajs: Sequence[Any], group_size: int, metric: str = "signal") -> list[EpisodeGroup]:
    """Consecutive groups of `group_size` episodes, each with whether it spreads under `metric`:
    `signal` -- its advantages can be non-zero: the successes of its valid episodes differ (the task
    term), or at least two succeeded with different compute (the efficiency term); `success` -- only
    the successes differ."""
    out = []
    for start in range(0, len(trajs), group_size):
        mine = list(trajs[start:start + group_size])
        valid = [t for t in mine if t.valid]
        task = len({bool(t.success) for t in valid}) > 1
        efficiency = len({t.compute for t in valid if t.success}) > 1
        tokens = sum(len(call.completion.tokens) for t in mine for call in t.calls)
        out.append(EpisodeGroup(mine, task or (efficiency and metric == "signal"), tokens))
    return out


def call_advantages(task_adv: torch.Tensor, eff_adv: torch.Tensor, episode_of_call: torch.Tensor,
                    edit_call: torch.Tensor, w_eff: float) -> torch.Tensor:
    """A per call (one training row): r_i + w_eff * a_eff_i * m, m = 1 on edit calls.
    task_adv, eff_adv: (N,) per episode; episode_of_call (R,) long; edit_call (R,) bool -> (R,)."""
    return task_adv[episode_of_call] + w_eff * eff_adv[episode_of_call] * edit_call.float()


# --- episodes over the session engine --------------------------------------------------------------


@dataclass
class Call:
    """One model call of an episode: the exact prompt it saw and what it produced."""

    prompt: list[int]  # token ids of the context the call was generated from
    completion: Any  # inference Completion (tokens incl. the stop token, sampler log-probs)
    text: str
    kind: str  # the parsed action: rewrite | answer | text
    malformed: bool
    prefill_tokens: int  # prompt tokens the engine forwarded (after its cache reuse)
    decode_tokens: int
    relocated_tokens: int = 0  # prompt tokens whose K/V the engine moved from the previous call (suffix reuse)

    @property
    def edit(self) -> bool:
        return self.kind == "rewrite"


@dataclass
class Trajectory:
    episode: Any
    env: Optional[ContextEnv]
    calls: list[Call] = field(default_factory=list)
    error: Optional[str] = None  # the environment refused the episode (logged; no calls, reward invalid)
    correct: bool = False

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def outcome(self) -> str:
        return "invalid" if self.env is None else self.env.outcome

    @property
    def success(self) -> bool:
        return self.outcome == "answered" and self.correct

    @property
    def compute(self) -> int:
        return sum(c.prefill_tokens + c.decode_tokens for c in self.calls)

    @property
    def edits(self) -> int:
        return sum(c.edit for c in self.calls)


def play_episodes(engine: "SessionEngine", tokenizer: Any, task: ClmTask, episodes: Sequence[Any],
                  params: "SamplingParams", max_calls: int, budget: int = 0, generator: Optional[torch.Generator] = None,
                  max_seq_len: Optional[int] = None) -> list[Trajectory]:
    """Play `episodes` (one trajectory each, in order) through `engine`, every live episode one row of
    each round's batched call; each episode is its own engine session, ended when it finishes."""
    def count(text: str) -> int:
        return len(encode(tokenizer, text))

    fmt = task.fmt
    limit = max_seq_len or engine.model.config.max_position_embeddings
    if not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"max_seq_len={limit} must be a positive int")
    trajectories = []
    for ep in episodes:
        try:
            env = ContextEnv(ep, fmt=fmt, count_tokens=count, budget=budget or task.row_budget(ep), max_calls=max_calls)
            trajectories.append(Trajectory(ep, env))
        except EpisodeError as err:
            trajectories.append(Trajectory(ep, None, error=str(err)))
    live = [i for i, t in enumerate(trajectories) if t.valid]
    try:
        while live:
            prompts = {i: encode_prompt(tokenizer, trajectories[i].env.prompt()) for i in live}
            for i in list(live):
                if len(prompts[i]) >= limit:  # the context no longer fits the model at all: an overflow
                    env = trajectories[i].env
                    env.done, env.outcome = True, "overflow"
                    live.remove(i)
                    engine.end(i)
            if not live:
                break
            outs = engine.generate([prompts[i] for i in live], params, sessions=live, generator=generator)
            for row, (i, out) in enumerate(zip(live, outs)):
                traj, stats = trajectories[i], engine.stats[row]
                text = tokenizer.decode(out.tokens, skip_special_tokens=True)
                action = traj.env.step(text)
                traj.calls.append(Call(prompts[i], out, text, action.kind, action.malformed,
                                       stats.prefill_tokens, stats.decode_tokens, stats.relocated_tokens))
                if traj.env.done and traj.env.outcome == "answered":
                    traj.correct = bool(task.verify(traj.episode, text).correct)
            for i in [i for i in live if trajectories[i].env.done]:
                engine.end(i)
            live = [i for i in live if not trajectories[i].env.done]
    finally:
        engine.clear()
    return trajectories


def episode_metrics(trajectories: Sequence[Trajectory], prefix: str = "clm") -> dict[str, torch.Tensor]:
    """Success, outcomes, compute, edits and context lengths, means over the episodes (rank-local)."""
    n = max(len(trajectories), 1)
    played = [t for t in trajectories if t.valid]
    m = max(len(played), 1)
    calls = [c for t in played for c in t.calls]
    contexts = [len(c.prompt) for c in calls]

    def mean(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(float(sum(values)) / max(len(values), 1))

    out = {f"{prefix}/success": torch.tensor(sum(t.success for t in trajectories) / n)}
    for outcome in ("answered", "overflow", "call_cap", "invalid"):
        out[f"{prefix}/{outcome}"] = torch.tensor(sum(t.outcome == outcome for t in trajectories) / n)
    out.update({
        f"{prefix}/compute": torch.tensor(sum(t.compute for t in played) / m),
        f"{prefix}/prefill_tokens": torch.tensor(sum(c.prefill_tokens for c in calls) / m),
        f"{prefix}/decode_tokens": torch.tensor(sum(c.decode_tokens for c in calls) / m),
        f"{prefix}/relocated_tokens": torch.tensor(sum(c.relocated_tokens for c in calls) / m),
        f"{prefix}/edits": torch.tensor(sum(t.edits for t in played) / m),
        f"{prefix}/calls": torch.tensor(len(calls) / m),
        f"{prefix}/malformed": mean([float(c.malformed) for c in calls]),
        f"{prefix}/context_tokens": mean(contexts),
        f"{prefix}/context_tokens_max": torch.tensor(float(max(contexts, default=0))),
        f"{prefix}/context_tokens_final": mean([len(t.calls[-1].prompt) for t in played if t.calls]),
    })
    return out


# --- the algorithm ---------------------------------------------------------------------------------


class CLM(ReferenceAndRetirementState):
    name = "clm"

    def __init__(self, cfg: CLMConfig):
        self.cfg = cfg
        self.retirement = Retirement(cfg.retire_after)  # tasks always / never solved (retire_after)
        self.reference = SelfTeacher("fixed", 0.0)  # the starting weights, for the KL term (beta > 0)
        self.rewards = build_rewards(cfg)  # RewardError (exit 3) when a function cannot be loaded
        if cfg.num_generations == 1:
            warnings.warn("algo.num_generations=1: every group-relative advantage is 0 and the efficiency term "
                          "needs 2 successes per group, so CLM makes no update", stacklevel=2)

    def check_task(self, task: Any) -> None:
        examples = list(task.train_examples()[:1])
        if not isinstance(task, ClmTask) or not examples or not isinstance(examples[0], Episode):
            raise DataError(f"algo clm plays context-file episodes: data={getattr(task, 'name', task)} does not "
                            "provide them (use data=clm, or data=clm data.path=FILE.jsonl)")

    def weight_copies(self, model: nn.Module) -> int:
        """The KL reference's copy of the starting weights (`beta > 0`, full fine-tuning; trainer/memory.py)."""
        return self.reference.copies(model) if self.cfg.beta > 0 else 0

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return train_all_or_lora(model, self.cfg)

    def engine(self, model: nn.Module, engine_config: Any = None) -> "SessionEngine":
        from inference.engine import EngineConfig
        from inference.serving import ServeOptions, serve_model

        options = ServeOptions(engine=engine_config or EngineConfig())
        return serve_model(model, options).sessions(self.cfg.reuse_config())

    # --- rollouts ---------------------------------------------------------------------------------

    def make_batch(self, examples: Sequence[Any], ctx: RolloutContext) -> Batch:
        from inference import SamplingParams

        c, g, tok = self.cfg, self.cfg.num_generations, ctx.tokenizer
        params = SamplingParams(max_new_tokens=ctx.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
                                stop_token_ids=ctx.engine.stop_ids)
        engine = self.engine(ctx.policy, ctx.engine_config)

        def play(exs: Sequence[Any]) -> list[Any]:
            episodes = [ex for ex in exs for _ in range(g)]  # task-major: episodes b*G .. b*G+G-1
            return play_episodes(engine, tok, ctx.task, episodes, params, c.max_calls, c.budget, ctx.generator)

        def groups_of(exs: Sequence[Any]) -> list[EpisodeGroup]:  # one round; retired tasks are not played
            exs = self.retirement.live(exs)
            groups = episode_groups(play(exs), g, c.dynamic_metric) if exs else []
            for gr in groups:
                self.retirement.visit(gr.trajs[0].episode.uid, [float(t.success) for t in gr.trajs if t.valid])
            return groups

        fill = None
        if c.dynamic_sampling:  # only groups with a signal (success differs, or efficiency among successes)
            self.retirement.begin_step()
            groups, fill = fill_groups(examples, ctx.draw_examples, groups_of, c.dynamic_max_rounds, ctx.world)
            if not groups:  # every task drawn was retired: play this step's own tasks, retired or not
                groups = episode_groups(play(examples), g, c.dynamic_metric)
            if c.retire_after > 0:
                self.retirement.share(ctx.world)
            trajs = [t for gr in groups for t in gr.trajs]
            examples = [gr.trajs[0].episode for gr in groups]
        else:
            trajs = play(examples)
        for t in trajs:
            if t.error is not None:
                warnings.warn(f"clm: episode {t.episode.uid} skipped: {t.error}", stacklevel=2)
        rewards, valid, reward_stats = self.episode_rewards(trajs, ctx.task)
        task_adv, zero_std = group_advantages(rewards, valid, g, c.advantage_eps, c.scale_rewards, ctx.world)
        eff_adv = efficiency_advantages(torch.tensor([float(t.compute) for t in trajs]),
                                        torch.tensor([t.success for t in trajs], dtype=torch.bool), g)
        calls = [(i, k, call) for i, t in enumerate(trajs) for k, call in enumerate(t.calls)]
        if not calls:  # every episode refused: one empty row, so this rank still joins the backward
            first = encode(tok, examples[0].prefix or " ")[:1] or [tok.eos_token_id]
            batch = Batch(*_one_row(first, ctx.device), uids=[f"{examples[0].uid}/none"])
            batch.policy = PolicyTerms(torch.zeros(1, device=ctx.device))
        else:
            episode_of = torch.tensor([i for i, _, _ in calls])
            edit = torch.tensor([call.edit for _, _, call in calls], dtype=torch.bool)
            adv = call_advantages(task_adv, eff_adv, episode_of, edit, c.w_eff)
            batch = rollout_batch([call.prompt for _, _, call in calls], [call.completion for _, _, call in calls],
                                  tok.pad_token_id, ctx.device,
                                  [f"{trajs[i].episode.uid}/{i % g}/call{k}" for i, k, _ in calls])
            batch.policy = PolicyTerms(adv.to(ctx.device),
                                       prompt_lengths=torch.tensor([len(call.prompt) for _, _, call in calls],
                                                                   device=ctx.device))
        if c.beta > 0:  # every call token's log-prob under the starting weights
            with self.reference.weights(ctx.policy) as ref:
                batch.policy.ref_logprobs = policy_logprobs(ref, batch, c.temperature, c.loss_chunk_tokens,
                                                            c.logprob_batch_size)
        lengths = [float(len(call.completion.tokens)) for _, _, call in calls]
        batch.metrics = {**episode_metrics(trajs), "clm/frac_zero_std": zero_std.float().mean(),
                         "clm/advantage_abs": task_adv.abs().mean(), "clm/efficiency_abs": eff_adv.abs().mean(),
                         "rollout/reward": rewards.mean(), **reward_stats,
                         "rollout/length": torch.tensor(sum(lengths) / max(len(lengths), 1))}
        if fill is not None:
            batch.metrics.update(fill.metrics(int(sum(lengths))))
        if c.retire_after > 0:
            batch.metrics.update(self.retirement.metrics())
        return batch

    def episode_rewards(self, trajs: Sequence[Trajectory], task: Any
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(reward, valid, rewards/NAME metrics) per episode: the reward functions called once over the episodes'
        final outputs (the prompt is the episode's, the completion its last call's text), `verifier` being
        success; an episode the environment refused, or that no function applies to, is invalid."""
        success = [float(t.success) for t in trajs]
        refused = torch.tensor([not t.valid for t in trajs], dtype=torch.bool)
        last = [t.calls[-1] if t.calls else None for t in trajs]
        inputs = reward_inputs(task, [t.episode for t in trajs], [c.text if c else "" for c in last],
                               [list(c.completion.tokens) if c else [] for c in last], lambda ep: ep.question)
        table = call_rewards(self.rewards, inputs, [t.episode.uid for t in trajs], success)  # (N, F)
        rewards, valid = combine(table, self.rewards)
        return rewards.float(), valid & ~refused, reward_metrics(table, self.rewards)

    # --- loss -------------------------------------------------------------------------------------

    def zero_loss(self, micro: Batch) -> bool:
        """True when no loss token of `micro` sits in a call row with a non-zero advantage: the clipped
        term is then exactly 0 with a zero gradient, so the trainer skips the micro-batch, and a step where
        every micro-batch is so skips its optimizer step. With `beta > 0` the KL term trains every token."""
        if self.cfg.beta > 0:
            return False
        live = micro.loss_mask.bool() & (micro.policy.advantages != 0).unsqueeze(1)
        return not bool(live.any())

    def loss(self, model: nn.Module, micro: Batch, normaliser: torch.Tensor) -> StepOutput:
        c, sel = self.cfg, micro.loss_mask.bool()
        feats, head = student_features(model, micro.input_ids, micro.attention_mask)
        chunk = c.loss_chunk_tokens or losses.auto_chunk(feats.shape[-1] if head is None else head[0].shape[0], 0)
        logp = losses.chunked_token_logprobs(feats[sel], head, micro.input_ids[sel], c.temperature, chunk)
        adv = micro.policy.advantages.unsqueeze(1).expand_as(sel)[sel]
        per_token = losses.clipped_policy_gradient(logp, logp.detach(), adv, c.epsilon_low, c.epsilon_high)
        metrics = {}
        if c.beta > 0:  # the k3 KL to the starting weights, as GRPO's
            kl = k3_kl(micro.policy.ref_logprobs[sel], logp)
            per_token = per_token + c.beta * kl
            metrics["clm/kl"] = kl.detach().float().mean() if kl.numel() else torch.zeros(())
        # no loss tokens (every episode refused, or a zero-weight filler micro-batch): the empty log-probs stay
        # tied to every weight (losses.chunked_token_logprobs), so the zero loss still joins the gradient sync
        loss = per_token.sum() / normaliser
        metrics["clm/policy_loss"] = per_token.detach().float().mean() if per_token.numel() else torch.zeros(())
        return StepOutput(loss, metrics, scatter_tokens(logp, sel))

    # --- eval: episodes played greedily, the final call's output verified ------------------------------

    def eval_completions(self, model: nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any],
                         max_new_tokens: int) -> list[list[int]]:
        from inference import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                stop_token_ids=stop_ids(tokenizer, generation_eos(model)))
        trajs = play_episodes(self.engine(model), tokenizer, task, examples, params, self.cfg.max_calls,
                              self.cfg.budget)
        return [list(t.calls[-1].completion.tokens) if t.outcome == "answered" else [] for t in trajs]

    def export(self, model: nn.Module, tokenizer: Any, out_dir: str) -> None:
        export_model(model, tokenizer, out_dir, self.name)


def _one_row(ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.tensor([ids], dtype=torch.long, device=device)
    return t, torch.ones_like(t), torch.zeros_like(t)
