"""Train: `python train.py +algo=NAME [key=value ...]` or `torchrun --nproc_per_node=N train.py +algo=NAME`.

Configuration is validated before anything heavy happens: a bad key, value or algorithm name
exits non-zero with one line naming it, before output_dir is touched.
"""
from __future__ import annotations

import sys

EXIT_CONFIG, EXIT_DATA, EXIT_NONFINITE, EXIT_WARM_START, EXIT_CHECKPOINT, EXIT_MEMORY = 2, 3, 4, 5, 6, 7


def main(argv: list[str]) -> int:
    from trainer.config import ConfigError, load_config

    from algorithms import config_schemas

    try:
        cfg = load_config(argv, config_schemas())
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    return run(cfg)


def run(cfg) -> int:
    from models.anatomy import UnsupportedModel
    from models.model_dir import ModelDirError
    from inference.serving import ServingError
    from models.prompts import ChatTemplateError
    from tasks import DataError
    from trainer.checkpoint import CheckpointError
    from trainer.distributed import init_world, launched_world_size, shutdown
    from trainer.loop import NonFiniteLossError, fit
    from trainer.memory import MemoryCheckError
    from trainer.setup import build_session, completed_run, export_final
    from trainer.warm_start import WarmStartError, ensure

    if cfg.backend.name == "auto":
        cfg.backend.name = "ddp" if launched_world_size() > 1 else "single"
    world = init_world(cfg.backend.dist_timeout_s)
    code = 0
    try:
        done = completed_run(cfg)
        if done is not None:  # nothing would train: say so, with the run's own figures
            if world.is_main:
                print(rerun_message(cfg, *done), flush=True)
            if world.distributed:
                shutdown(world, 0)
            return 0
        ensure(cfg.model, world)  # the default model's warm-start stage (built once, cached)
        session = build_session(cfg, world)
        status = fit(session)
        session.tracker.close()
        if status == "done":
            final = export_final(session)
            if world.is_main:
                print(f"done: {session.step} steps; artifact in {final}", flush=True)
                print(accuracy_summary(session.evals, session.caps.summary_metrics), flush=True)
        elif world.is_main:
            print(f"stopped by signal at step {session.step}; checkpoint saved in {cfg.output_dir}/checkpoints "
                  "(rerun the same command to resume)", flush=True)
    except DataError as err:
        print(f"data error: {err}", file=sys.stderr)
        code = EXIT_DATA
    except (ChatTemplateError, UnsupportedModel, ModelDirError, ServingError) as err:  # found once the tokenizer / model is loaded
        print(f"config error: {err}", file=sys.stderr)
        code = EXIT_CONFIG
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr)
        code = EXIT_NONFINITE
    except WarmStartError as err:
        print(f"error: {err}", file=sys.stderr)
        code = EXIT_WARM_START
    except CheckpointError as err:  # a damaged, tampered or unreadable checkpoint: nothing of it was applied
        print(f"checkpoint error: {err}", file=sys.stderr)
        code = EXIT_CHECKPOINT
    except MemoryCheckError as err:  # the pre-flight memory check (trainer/memory.py): before the first step
        print(f"error: {err}", file=sys.stderr)
        code = EXIT_MEMORY
    if world.distributed:
        shutdown(world, code)  # does not return: see shutdown() for why
    return code


def rerun_message(cfg, step: int, path: str) -> str:
    """What a rerun of a finished run prints: it is complete, its before -> after figures from its own
    metrics.jsonl, and the two ways to train again."""
    from algorithms import build_algorithm
    from algorithms.base import capabilities
    from trainer.setup import recorded_evals

    extra = capabilities(build_algorithm(cfg.algo)).summary_metrics
    return (f"the run in {cfg.output_dir} is already complete at step {step} (trainer.max_steps={cfg.trainer.max_steps}; "
            f"checkpoint {path}, artifact in {cfg.output_dir}/final); nothing was trained.\n"
            f"{accuracy_summary(recorded_evals(cfg.output_dir), extra)}\n"
            "to train again: another output_dir=DIR, or trainer.resume=never to start over in this one (its "
            "metrics.jsonl is moved aside)")


def accuracy_summary(evals: list[dict], extra: dict[str, str] | None = None) -> str:
    """'held-out accuracy: before A (teacher with reference T) -> after B (teacher prompt T')' from this run's evals, then
    one 'NAME: before -> after' line per `extra` eval metric (the algorithm's summary_metrics)."""
    if not evals:
        return "held-out accuracy: no evaluation ran"
    first, last = evals[0], evals[-1]
    if "accuracy" in first:
        teacher = (f" (teacher prompt with reference {first['teacher_accuracy']:.3f})" if "teacher_accuracy" in first
                   else "")
        before = f"step {first['step']} {first['accuracy']:.3f}{teacher}"
        line = f"held-out accuracy (n={last['n']}): {before} -> step {last['step']} {last['accuracy']:.3f}"
        if "teacher_accuracy" in last and last is not first:
            line += f" (teacher prompt {last['teacher_accuracy']:.3f})"
    elif "loss" in first:  # data=chat without reference answers: the held-out loss is the figure
        line = (f"held-out loss (n={last['n']}, {last['loss_tokens']} tokens): step {first['step']} "
                f"{first['loss']:.4f} -> step {last['step']} {last['loss']:.4f}")
    else:
        line = "held-out accuracy: none (rows without reference answers)"
    for key, label in (extra or {}).items():
        if key in first:
            line += (f"\n{label}: step {first['step']} {first[key]:.2f} -> step {last['step']} "
                     f"{last.get(key, float('nan')):.2f}")
    return line


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
