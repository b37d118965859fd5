"""Held-out accuracy via the inference engine (greedy), sharded over data-parallel ranks."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from inference import Engine, EngineConfig, SamplingParams
from trainer.distributed import World

EVAL_BATCH = 64


def evaluate(model: torch.nn.Module, tokenizer: Any, task: Any, examples: Sequence[Any], world: World,
             max_new_tokens: int, prompt: Optional[Callable[[Any], str]] = None,
             engine_config: Optional[EngineConfig] = None,
             generate: Optional[Callable[[Sequence[Any]], list[list[int]]]] = None) -> dict[str, float]:
    """Greedy-decode this rank's share of `examples`, verify, and reduce counts over ranks.

    `prompt` maps an example to its prompt text (default: the task's student prompt; the
    self-distillation algorithms also measure the teacher prompt, which carries the reference).
    Returns accuracy (final answer right), step_accuracy (share of checkable steps right) and n.
    `engine_config` configures the inference Engine (None: its defaults). `generate` replaces the
    engine: examples -> greedy completion ids (an algorithm that serves its artifact another way,
    e.g. attuner over the position-independent cache).
    """
    prompt = prompt or task.prompt
    mine = list(examples)[world.rank :: world.size]
    engine = Engine(model, engine_config)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=(tokenizer.eos_token_id,))
    correct = steps_ok = steps_total = 0
    for start in range(0, len(mine), EVAL_BATCH):
        chunk = mine[start : start + EVAL_BATCH]
        if generate is not None:
            outs = generate(chunk)
        else:
            prompts = [tokenizer(prompt(ex), add_special_tokens=False).input_ids for ex in chunk]
            outs = [out.tokens for out in engine.generate(prompts, params)]
        for ex, tokens in zip(chunk, outs):
            result = task.verify(ex, tokenizer.decode(tokens, skip_special_tokens=True))
            correct += int(result.correct)
            steps_ok += result.steps_correct
            steps_total += result.steps_total
    counts = world.all_reduce_sum(torch.tensor([correct, steps_ok, steps_total, len(mine)], dtype=torch.float64))
    correct, steps_ok, steps_total, n = counts.tolist()
    return {"accuracy": correct / max(n, 1), "step_accuracy": steps_ok / max(steps_total, 1), "n": int(n)}
