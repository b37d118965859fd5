"""Held-out accuracy of a model: `python evaluate.py model.path=DIR data=NAME [trainer.eval_examples=N]`, or
with a recipe's data and eval settings: `python evaluate.py +recipe=NAME model.path=DIR data.path=... data.test_path=...`.

Prints one JSON line with `accuracy`, `step_accuracy` and `n`; for `data=chat`, also the held-out `loss`
(and `loss_tokens`) of its rows, and without reference answers (no `data.answer_field`) only that. A `model.path` export is evaluated as
it is served: opened through the serving door (`inference/serving.py`, `load_served`), so a quantized
export (compressed-tensors, e.g. a `+algo=qad` run's final/) runs on the low-bit path, and an export
with a layer skipper (`final/skipper/`, from `+algo=skipper`) runs with its routers on; the JSON line
then also carries `skip_ratio` (skipped routed layer-tokens of the greedy decode steps).
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
        cfg = load_config(overrides, config_schemas(), training=False)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from tasks import DataError, task_capabilities
    from trainer.distributed import World
    from trainer.evaluation import evaluate, heldout_loss
    from trainer.precision import Precision
    from trainer.setup import build_task_from, load_model, model_positions, prompts_for
    from trainer.warm_start import ensure

    world = World()
    ensure(cfg.model, world)  # the default model, when no model.path is given
    from inference.serving import ServingError

    try:
        server = _served(cfg.model, world)
    except ServingError as err:  # e.g. a skipper for another base, a weight format this runtime cannot run
        print(f"error: {err}", file=sys.stderr)
        return 2
    if server is None:  # the default model: the trainer's own loader
        model, tokenizer = load_model(cfg.model, world)
    else:
        model, tokenizer = server.model, server.tokenizer
    try:
        task = prompts_for(build_task_from(cfg.data, cfg.model), tokenizer, cfg.data, world, model_positions(model))
        examples = list(task.test_examples())[: cfg.trainer.eval_examples]
        caps, result = task_capabilities(task), {}
        with Precision(cfg.model.dtype).autocast(world.device):  # as a training run's evals (trainer/precision.py)
            if caps.row_tokens is not None:  # data=chat: the loss of its held-out rows, as the trainer's eval reports it
                result.update(heldout_loss(model.eval(), caps.row_tokens, examples, world, tokenizer.pad_token_id))
            if caps.verifiable:
                result.update(evaluate(model.eval(), tokenizer, task, examples, world,
                                       cfg.trainer.eval_max_new_tokens, engine=server))
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        return 3
    if server is not None and server.skipper is not None:
        result["skip_ratio"] = server.stats.skip_ratio()
    print(json.dumps(result))
    return 0


def _served(m, world):
    """model.path opened through the serving door (its manifest's fast paths), in fp32 as training
    evals run; None for the default model."""
    import os

    if m.path is None:
        return None
    from inference.serving import ServeOptions, load_served

    return load_served(os.path.expanduser(m.path), ServeOptions(device=str(world.device), dtype="float32",
                                                                trust_remote_code=m.trust_remote_code))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
