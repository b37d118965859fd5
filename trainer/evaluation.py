"""Held-out accuracy via the inference engine (greedy), and held-out loss on a task's own rows (data=chat),
sharded over data-parallel ranks."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from algorithms.base import pad_right
from algorithms.losses import token_logprobs
from inference import EngineConfig, SamplingParams
from inference.serving import ServeOptions, serve_model
from models.prompts import generation_eos, prompt_ids, stop_ids
from trainer.distributed import World
from tasks import task_capabilities

EVAL_BATCH = 64
LOSS_BATCH = 8  # rows per held-out loss forward (full-vocabulary logits of whole rows)


def was_capped(completion: Any, max_new_tokens: int) -> bool:
    """A completion that ran out of positions before max_new_tokens (the engine cuts every row's budget
    to what the batch's longest prompt leaves in the model), not one that stopped or reached the limit."""
    return completion.finish_reason == "length" and len(completion.tokens) < max_new_tokens


def evaluate(model: torch.nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any], world: World,
             max_new_tokens: int, prompt: Optional[Callable[[Any], str]] = None,
             engine_config: Optional[EngineConfig] = None,
             generate: Optional[Callable[[Sequence[Any]], list[list[int]]]] = None,
             engine: Any = None) -> dict[str, float]:
    """Greedy-decode this rank's share of `examples`, verify, and reduce counts over ranks.

    `prompt` maps an example to its prompt text (default: the task's student prompt; the
    self-distillation algorithms also measure the teacher prompt, which carries the reference).
    Returns accuracy (final answer right), step_accuracy (share of checkable steps right), n and outcomes
    (one character per example of `examples`, in their order: "1" right, "0" not -- the per-question
    record a paired comparison of two runs needs); on a
    task with several valid solution paths (`task.solution_path`, e.g. multipath) also path_differs
    (share of completions whose path is not the reference's) and path_differs_correct (share of the
    right answers reached through fully right working on another path than the reference's).
    `engine_config` configures the inference Engine (None: its defaults); `engine` is one already
    built (an Engine, or a `serving.Server`: an export decoded with its fast paths). `generate`
    replaces the engine: examples -> greedy completion ids (an algorithm that serves its artifact
    another way, e.g. attuner over the position-independent cache).
    """
    prompt = prompt or task.prompt
    mine = list(examples)[world.rank :: world.size]
    if generate is None and engine is None:  # the model behind the serving door, as rollouts decode
        engine = serve_model(model, ServeOptions(engine=engine_config or EngineConfig()), tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=stop_ids(tokenizer, generation_eos(model)))
    correct = steps_ok = steps_total = differs = full_marks = differs_full = capped = 0
    paths = task_capabilities(task).solution_path is not None
    right = []  # this rank's outcomes, in the order of `mine`
    for start in range(0, len(mine), EVAL_BATCH):
        chunk = mine[start : start + EVAL_BATCH]
        if generate is not None:
            outs = generate(chunk)
        else:
            prompts = [prompt_ids(tokenizer, prompt(ex)) for ex in chunk]
            completions = engine.generate(prompts, params)
            capped += sum(was_capped(c, max_new_tokens) for c in completions)
            outs = [out.tokens for out in completions]
        for ex, tokens in zip(chunk, outs):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            result = task.verify(ex, text)
            correct += int(result.correct)
            right.append(bool(result.correct))
            steps_ok += result.steps_correct
            steps_total += result.steps_total
            if paths:
                other = list(task.solution_path(text)) != list(task.solution_path(ex.solution))
                differs += other
                full_marks += result.reward == 1.0
                differs_full += other and result.reward == 1.0
    counts = world.all_reduce_sum(torch.tensor([correct, steps_ok, steps_total, len(mine), differs, full_marks,
                                                differs_full, capped], dtype=torch.float64))
    correct, steps_ok, steps_total, n, differs, full_marks, differs_full, capped = counts.tolist()
    out = {"accuracy": correct / max(n, 1), "step_accuracy": steps_ok / max(steps_total, 1), "n": int(n),
           "outcomes": in_order(world.gather_objects(right))}
    if capped:  # the model's positions cut some completions short of max_new_tokens: say so
        out["capped"] = int(capped)
        if world.is_main:
            print(f"eval: {int(capped)} of {int(n)} completions were cut short of {max_new_tokens} new tokens: "
                  "their batch's longest prompt left fewer positions in the model", flush=True)
    if paths:
        out["path_differs"] = differs / max(n, 1)
        out["path_differs_correct"] = differs_full / max(full_marks, 1)
    return out


def in_order(shares: list[list[bool]]) -> str:
    """Each rank's outcomes (rank r held examples r, r + size, r + 2 size, ...) back in the examples' order,
    one character each ("1" right)."""
    size = len(shares)
    merged = [None] * sum(map(len, shares))
    for rank, share in enumerate(shares):
        merged[rank::size] = share
    return "".join("1" if x else "0" for x in merged)


def scored_rows(examples: Sequence[Any]) -> list[Any]:
    """The held-out examples whose row has a completion to score (prompt-only rows have none)."""
    return [ex for ex in examples if ex.solution]


def heldout_loss(model: torch.nn.Module, rows: Callable[[Any], tuple[list[int], list[int]]], examples: Sequence[Any],
                 world: World, pad_id: int) -> dict[str, float]:
    """Mean negative log-likelihood per loss token of the rows of `examples` that have a completion
    (`rows(ex)` -> ids, loss mask: the task's SFT rows, TRL's `eval_loss`), this rank's share forwarded, the
    sums reduced over ranks. Returns loss, loss_tokens and n; empty when no row has a completion."""
    mine = scored_rows(examples)[world.rank :: world.size]
    device = next(model.parameters()).device
    nll = torch.zeros((), dtype=torch.float64)
    tokens = 0
    with torch.no_grad():
        for start in range(0, len(mine), LOSS_BATCH):
            chunk = [rows(ex) for ex in mine[start : start + LOSS_BATCH]]
            ids, attn = pad_right([c[0] for c in chunk], pad_id, device)  # (B, T)
            mask, _ = pad_right([c[1] for c in chunk], 0, device)  # (B, T)
            logprobs = token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)  # (B, T)
            nll -= (logprobs.double() * mask).sum().cpu()
            tokens += int(mask.sum())
    nll, tokens, n = world.all_reduce_sum(torch.tensor([nll.item(), tokens, len(mine)], dtype=torch.float64)).tolist()
    return {"loss": nll / max(tokens, 1), "loss_tokens": int(tokens), "n": int(n)} if n else {}
