"""Held-out accuracy of a model: `python evaluate.py model.path=DIR data=NAME [trainer.eval_examples=N]`, or
with a recipe's data and eval settings: `python evaluate.py +recipe=NAME model.path=DIR data.path=... data.test_path=...`.

Prints one JSON line with `accuracy`, `step_accuracy` and `n`. A quantized export (compressed-tensors,
e.g. a `+algo=qad` run's final/) is evaluated as served: on the runtime's low-bit path. An export
with a layer skipper (`final/skipper/`, from `+algo=skipper`) is evaluated with its routers on, as
the runtime serves it; the JSON line then also carries `skip_ratio` (skipped routed layer-tokens of
the greedy decode steps).
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from trainer.config import ConfigError, load_config

    from algorithms import config_schemas

    # Evaluation needs no algorithm; reuse the schema with the sft defaults so keys validate the same way.
    # A recipe (+recipe=NAME: its data fields, length limits, dtype and eval sizes) brings its own algorithm.
    overrides = [a for a in argv if not a.lstrip("+").startswith("algo=")]
    if not any(a.lstrip("+").startswith("recipe=") for a in overrides):
        overrides.append("+algo=sft")
    try:
        cfg = load_config(overrides, config_schemas())
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from trainer.distributed import World
    from trainer.evaluation import evaluate
    from trainer.precision import Precision
    from trainer.setup import build_task_from, load_model, model_positions, prompts_for
    from trainer.warm_start import ensure

    world = World()
    ensure(cfg.model, world)  # the default model, when no model.path is given
    model, tokenizer = _load(cfg.model, world, load_model)
    task = prompts_for(build_task_from(cfg.data, cfg.model), tokenizer, cfg.data, world, model_positions(model))
    examples = list(task.test_examples())[: cfg.trainer.eval_examples]
    stats = _skip_stats(model)
    with Precision(cfg.model.dtype).autocast(world.device):  # as a training run's evals (trainer/precision.py)
        result = evaluate(model.eval(), tokenizer, task, examples, world, cfg.trainer.eval_max_new_tokens)
    if stats is not None:
        result["skip_ratio"] = stats.skip_ratio()
    print(json.dumps(result))
    return 0


def _load(m, world, load_model):
    import os

    from models.quant_export import is_compressed

    if m.path is not None and is_compressed(os.path.expanduser(m.path)):
        from inference.quantized import load_quantized

        return load_quantized(os.path.expanduser(m.path), world.device)
    model, tokenizer = load_model(m, world)
    if m.path is not None:
        from models.skipper import find_skipper, load_skipper

        skipper = find_skipper(os.path.expanduser(m.path))
        if skipper is not None:
            load_skipper(model, skipper)
    return model, tokenizer


def _skip_stats(model):
    """For a skipper model: one SkipStats that every engine of this process adds its counts to."""
    if getattr(model, "skipper_state", None) is None:
        return None
    from inference import skip_routing

    stats = skip_routing.SkipStats()
    skip_routing.SHARED_STATS = stats
    return stats


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
