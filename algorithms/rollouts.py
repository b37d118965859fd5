"""Rollout helpers shared by the on-policy algorithms: encode prompts, sample completions through the
inference engine, and lay prompt + completion rows out as a training Batch.

    prompts = [encode_prompt(tok, task.prompt(ex)) for ex in examples]
    completions = sample(ctx, prompts, temperature=1.0, top_p=1.0)
    batch = rollout_batch(prompts, completions, tok.pad_token_id, device, uids)
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from algorithms.base import Batch, RolloutContext, pad_right
from models.prompts import continuation_ids, prompt_ids, stop_ids
from tasks import DataError


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt's ids (`models.prompts.prompt_ids`: one leading BOS where the tokenizer adds one)."""
    return prompt_ids(tokenizer, text)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Ids of text that continues a prompt (a solution, a reference, a completion): no special tokens."""
    return continuation_ids(tokenizer, text)


def sample(ctx: RolloutContext, prompts: list[list[int]], temperature: float, top_p: float) -> list[Any]:
    """On-policy completions through the engine, stopping on the model's stop ids (its EOS, its
    generation_config's and its chat template's end of turn: models.prompts.stop_ids)."""
    from inference import SamplingParams

    params = SamplingParams(max_new_tokens=ctx.max_new_tokens, temperature=temperature, top_p=top_p,
                            stop_token_ids=ctx.engine.stop_ids)
    completions = ctx.engine.generate(prompts, params, generator=ctx.generator)
    capped = sum(c.finish_reason == "length" and len(c.tokens) < ctx.max_new_tokens for c in completions)
    if capped:
        warnings.warn(f"rollouts: {capped} of {len(completions)} completions were cut short of trainer.max_new_tokens="
                      f"{ctx.max_new_tokens}: their batch's longest prompt left fewer positions in the model "
                      "(lower data.max_prompt_tokens to keep room)", stacklevel=2)
    return completions


def greedy_completions(model: Any, tokenizer: Any, task: Any, examples: Sequence[Any], max_new_tokens: int
                       ) -> list[Any]:
    """Greedy completions of `examples`' student prompts by `model` behind the serving door, stopping on its stop
    ids (an algorithm's extra eval: GRPO's held-out reward, distill's teacher accuracy)."""
    from inference.serving import ServeOptions, serve_model

    server = serve_model(model, ServeOptions(), tokenizer)
    prompts = [encode_prompt(tokenizer, task.prompt(ex)) for ex in examples]
    return server.generate(prompts, server.params(max_new_tokens=max_new_tokens, temperature=0.0))


def rollout_batch(prompts: list[list[int]], completions: Sequence[Any], pad_id: int, device: torch.device,
                  uids: list[str]) -> Batch:
    """prompt + completion rows; loss on completion tokens; the sampler's log-probs kept for the gap check."""
    ids, attn = pad_right([p + c.tokens for p, c in zip(prompts, completions)], pad_id, device)
    loss_mask = completion_mask(prompts, [c.tokens for c in completions], ids)
    rollout_logprobs = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        rollout_logprobs[i, len(p): len(p) + len(c.tokens)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return Batch(ids, attn, loss_mask, rollout_logprobs=rollout_logprobs.to(device), uids=uids)


def completion_mask(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], ids: torch.Tensor
                    ) -> torch.Tensor:
    """(B, T) 1 on the completion tokens of right-padded prompt + completion rows."""
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        mask[i, len(p): len(p) + len(c)] = 1
    return mask


def rollout_metrics(task: Any, tokenizer: Any, examples: Sequence[Any], completions: Sequence[Any],
                    prefix: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Rewards of the rollouts (the task's verifier) and their mean length, as train metrics."""
    rewards = [task.verify(ex, tokenizer.decode(c.tokens, skip_special_tokens=True)).reward
               for ex, c in zip(examples, completions)]
    metrics = {f"{prefix}/reward": torch.tensor(sum(rewards) / max(len(rewards), 1)),
               f"{prefix}/length": torch.tensor(sum(len(c.tokens) for c in completions) / max(len(completions), 1))}
    return metrics, rewards


def require_references(examples: Sequence[Any], algo_name: str) -> None:
    for ex in examples:
        if not ex.solution or not ex.solution.strip():
            raise DataError(f"{algo_name} needs a reference solution for every question; example {ex.uid} "
                             "has an empty solution (set data.solution_field to the field holding worked solutions)")


def training_completions(source: str, examples: Sequence[Any], prompts: list[list[int]], ctx: RolloutContext,
                         generate: Callable[[list[list[int]], Any], Sequence[Any]]) -> list[list[int]]:
    """The completion tokens of training rows that distil a frozen model (qad, skipper, attuner):
    `source="solutions"`: each example's worked solution + EOS; otherwise the teacher's greedy
    completion of each prompt, up to `ctx.max_new_tokens` and stopping at EOS, from
    `generate(prompts, params)` (the teacher behind the serving door)."""
    tok = ctx.tokenizer
    if source == "solutions":
        return [encode(tok, ex.solution) + [tok.eos_token_id] for ex in examples]
    from inference import SamplingParams

    params = SamplingParams(max_new_tokens=ctx.max_new_tokens, temperature=0.0, stop_token_ids=stop_ids(tok))
    return [list(o.tokens) for o in generate(prompts, params)]
