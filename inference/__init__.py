"""Standalone inference runtime: batched generation on token ids with a pre-allocated KV cache.

Used by the trainer for rollouts and eval, and by `python -m inference DIR --prompt TEXT` for
serving. It imports nothing from the rest of the repo except `models/`, and never Hydra.

    from inference import Engine, SamplingParams
    completions = Engine(model).generate(prompt_ids, SamplingParams(temperature=0.0))
"""
from inference.engine import Completion, Engine
from inference.sampling import SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
