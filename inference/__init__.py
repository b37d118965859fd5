"""Standalone inference runtime: batched generation on token ids with a pre-allocated KV cache.

Used by the trainer for rollouts and eval, and by `python -m inference DIR --prompt TEXT` for
serving. It imports nothing from the rest of the repo except `models/`, and never Hydra.

    from inference import Engine, EngineConfig, SamplingParams
    completions = Engine(model).generate(prompt_ids, SamplingParams(temperature=0.0))

Modules: engine (the one decoding loop, its preamble and the Engine), rollout (output buffers and
the stop rule), lean (our decoder forward, KV cache), hf_backend (HF-forward fallback), sampling,
speculative (a decoding mode of the loop), artifacts (files the trainer exports for the runtime).
"""
from inference.engine import Completion, Engine, EngineConfig
from inference.sampling import SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams"]
