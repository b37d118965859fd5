"""Standalone inference runtime: batched generation on token ids with a pre-allocated KV cache.

Used by the trainer for rollouts and eval, and by `python -m inference DIR --prompt TEXT` for
serving. It imports nothing from the rest of the repo except `models/`, and never Hydra.

    from inference import Engine, EngineConfig, SamplingParams
    completions = Engine(model).generate(prompt_ids, SamplingParams(temperature=0.0))

    from inference import ReuseConfig, SessionEngine      # multi-turn sessions reusing their K/V
    completions = SessionEngine(model, ReuseConfig(mode="suffix")).generate(prompt_ids, params, sessions=ids)

Modules: engine (the one decoding loop, its preamble and the Engine), rollout (output buffers and
the stop rule), lean (our decoder forward, KV cache), hf_backend (HF-forward fallback), sampling,
speculative (a decoding mode of the loop), suffix (suffix cache reuse: each session's previous K/V
reused for its next prompt, in place for the common prefix, relocated for moved text), artifacts
(files the trainer exports for the runtime).
"""
from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use: `inference.artifacts` (file names and defaults, read by the trainer's config
# and export code) must not pull in the engine and transformers with it.
_LAZY = {"Completion": "inference.engine", "Engine": "inference.engine", "EngineConfig": "inference.engine",
         "SamplingParams": "inference.sampling", "ReuseConfig": "inference.suffix",
         "SessionEngine": "inference.suffix"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'inference' has no attribute {name!r}")
