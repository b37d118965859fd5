"""The warm-start stage: build the embedded default model's cache entry, once, before a session is
built. `train.py` and `evaluate.py` run it first; `setup.load_model` only ever reads the entry.

The default model is the tiny Qwen3 + character tokenizer warm-started by our own SFT on
`data=arith` (`model.warm_start_task`). Part of the warm-up prompts carry the reference solution
(full, or with steps masked), so the warm model can read a privileged reference -- without that, the
self-teacher of the distillation algorithms would be no better than the student. With
`data=artifacts` the warm start is plain SFT on the artifacts task instead (full prefill of every
table, no reference rows; its own data and recipe numbers in trainer/default_model.py).

Publishing rules (an entry is reused by every later run, so a bad one would poison them all):
- the build trains in a private temporary directory and is published by one atomic rename, only
  after `fit` ran every step of the recipe and the held-out accuracy reached the recipe's floor
  (`model.warm_start_min_accuracy`); both are recorded in the entry's `warm_start.json`;
- a stop signal (SIGTERM, Ctrl-C) during the build publishes nothing;
- an existing entry whose record says it is incomplete is refused and rebuilt;
- a file lock per entry makes a second process that starts at once on a cold cache (two users, a
  benchmark's parallel workers) wait for the first instead of building the same model again.

    path = ensure(cfg.model, world)     # all ranks; rank 0 builds when needed, the others wait
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import json
import os
import shutil
import time
from typing import Iterator, Optional

import torch

from trainer.default_model import (DONE, METRICS, WARM_TASK_DATA, build_notice, cache_path, entry_problem, read_record,
                                   recipe, resolve, shipped_entry, shipped_path, spec)
from trainer.distributed import World

WARM_EVAL_EXAMPLES = 100
WARM_MICRO_BATCH = 32  # two length-grouped micro-batches: student rows and (longer) reference rows


class WarmStartError(RuntimeError):
    """The default model could not be built (interrupted, or below its accuracy floor); nothing was
    published."""


def ensure(m, world: World) -> Optional[str]:
    """The default model's complete cache entry (built here if needed), or None when `m` needs no
    warm start (a model path, or `warm_start_steps=0`). Every rank calls this."""
    m = resolve(m)
    if m.path is not None or m.warm_start_steps == 0:
        return None
    path = cache_path(m)
    error: Optional[BaseException] = None
    if world.is_main:
        try:
            _build_if_needed(m, path)
        except (WarmStartError, KeyboardInterrupt) as err:
            error = err
    # One collective instead of a barrier, so the other ranks learn that rank 0 failed.
    if world.all_reduce_max(torch.tensor(int(error is not None))).item():
        if isinstance(error, KeyboardInterrupt):
            raise WarmStartError("interrupted while building the default model; nothing was published "
                                 "(rerun to build it)") from None
        raise error if error is not None else WarmStartError("rank 0 could not build the default model")
    return path


def _build_if_needed(m, path: str) -> None:
    with entry_lock(path):
        problem = entry_problem(m, path)
        if problem is None:
            return
        if problem != "missing":
            print(f"warning: refusing the cache entry {path} ({problem}); rebuilding it", flush=True)
            _discard(path)
        for stale in glob.glob(f"{glob.escape(path)}.tmp-*"):  # a builder killed outright (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        shipped = shipped_entry(m)
        if shipped is not None:
            install(shipped, path)
            record = read_record(path) or {}
            print(f"installed the shipped default model for {m.warm_start_task} in {path} (built by its recipe, "
                  f"held-out accuracy {record.get('accuracy', float('nan')):.3f})", flush=True)
            return
        print(build_notice(m, path), flush=True)
        build(m, path)


def install(shipped: str, path: str) -> None:
    """Copy the shipped entry into the cache: into a private directory, then one atomic rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shipped, tmp)
    os.replace(tmp, path)


@contextlib.contextmanager
def entry_lock(path: str) -> Iterator[None]:
    """An exclusive lock on `path`'s entry, held while it is checked and built. A process that finds it
    held says so and waits (the holder is building the same recipe)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock_path = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
    with open(lock_path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building {path}", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _discard(path: str) -> None:
    """Move a refused entry out of the way first (one rename), so no reader sees half of it."""
    trash = f"{path}.refused-{os.getpid()}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def build(m, path: str) -> None:
    """SFT the random tiny model on the warm-start task in this process (all cores); publish it atomically
    only when it ran to completion and reached its accuracy floor. Raises WarmStartError otherwise."""
    from algorithms import config_schemas
    from models.loading import build_tiny
    from tasks import task_config
    from trainer.config import BackendConfig, LoggingConfig, TrainConfig, TrainerConfig
    from trainer.loop import fit
    from trainer.setup import build_session, build_task_from, export_final

    m = resolve(m)
    r = recipe(m)
    data = {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
            for k, v in WARM_TASK_DATA[m.warm_start_task].items()}  # copies: the config must not alias the recipe
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cfg = TrainConfig(
        output_dir=tmp, seed=m.seed, model=dataclasses.replace(m, dtype="float32"),  # the recipe is fp32, whatever the run's
        data=task_config(m.warm_start_task, **data),
        backend=BackendConfig(name="single"), logging=LoggingConfig(wandb=False),
        trainer=TrainerConfig(max_steps=r["steps"], batch_size=r["batch_size"], micro_batch_size=WARM_MICRO_BATCH,
                              lr=r["lr"], warmup_steps=max(1, r["steps"] // 20), min_lr_ratio=0.05,
                              eval_every=max(1, r["steps"] // 3), eval_examples=WARM_EVAL_EXAMPLES,
                              save_every=10**9, resume="never"),
        algo=config_schemas()["sft"](reference_fraction=r["reference_fraction"], seed=m.seed),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # torchrun sets 1 thread per worker; this runs alone
    started = time.perf_counter()
    try:
        model, tokenizer = build_tiny(spec(m), m.seed)
        session = build_session(cfg, World(), model=model, tokenizer=tokenizer, task=build_task_from(cfg.data))
        status = fit(session)
        session.tracker.close()
        if status != "done":
            raise WarmStartError(f"the warm start was stopped at step {session.step} of {r['steps']}; nothing was "
                                 f"published in {path} (rerun to build it)")
        accuracy = session.evals[-1]["accuracy"]
        if accuracy < m.warm_start_min_accuracy:
            raise WarmStartError(f"the warm start reached held-out accuracy {accuracy:.3f}, below "
                                 f"model.warm_start_min_accuracy={m.warm_start_min_accuracy}; nothing was published")
        final = export_final(session)
        shutil.copy(os.path.join(tmp, "metrics.jsonl"), os.path.join(final, METRICS))
        record = {"recipe": r, "steps_done": session.step, "accuracy": accuracy,
                  "accuracy_floor": m.warm_start_min_accuracy, "seconds": time.perf_counter() - started}
        with open(os.path.join(final, DONE), "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(final, path)  # atomic publish; the entry lock keeps other builders out
        print(f"warm start done in {record['seconds']:.0f}s, held-out accuracy {accuracy:.2f}", flush=True)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)



# --- the shipped weights (models/default_weights/) ------------------------------------------------


def default_model_config(task: str, cache_dir: Optional[str] = None):
    """The default model's config for `task` (configs/model/tiny.yaml: every warm_start_* number from
    the task's recipe), resolved."""
    from trainer.config import ModelConfig

    m = ModelConfig(warm_start_task=task, warm_start_steps=None)
    if cache_dir is not None:
        m = dataclasses.replace(m, cache_dir=cache_dir)
    return resolve(m)


def ship(task: str, entry: str) -> str:
    """Copy the complete cache entry `entry` (built by `task`'s default recipe on this machine) into
    models/default_weights/TASK, recording the CPU it was built on; replaces the shipped entry in one
    rename. Returns the shipped path."""
    m = default_model_config(task)
    problem = entry_problem(m, entry)
    record = read_record(entry) or {}
    if problem is not None or json.dumps(record.get("recipe"), sort_keys=True) != json.dumps(recipe(m), sort_keys=True):
        raise WarmStartError(f"{entry} is not a complete entry of the default {task} recipe ({problem or 'another recipe'})")
    dest = shipped_path(task)
    tmp, old = f"{dest}.tmp-{os.getpid()}", f"{dest}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(entry, tmp)
    record["built_on"] = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
    with open(os.path.join(tmp, DONE), "w") as fh:
        json.dump(record, fh, indent=1)
    if os.path.exists(dest):
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def main(argv: list[str]) -> int:
    """python -m trainer.warm_start --rebuild TASK [TASK ...]: build each task's default recipe from
    scratch (in a temporary cache) and ship it; --ship TASK ...: ship the entry already built in the
    cache (model.cache_dir's default) by that recipe."""
    import argparse
    import tempfile

    from trainer.default_model import WARM_TASK_DATA as TASKS

    parser = argparse.ArgumentParser(prog="python -m trainer.warm_start", description=main.__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--rebuild", nargs="+", choices=sorted(TASKS), metavar="TASK")
    group.add_argument("--ship", nargs="+", choices=sorted(TASKS), metavar="TASK")
    args = parser.parse_args(argv)
    for task in args.rebuild or []:
        with tempfile.TemporaryDirectory(prefix="warm-rebuild-") as cache:
            m = default_model_config(task, cache)
            path = cache_path(m)
            print(build_notice(m, path, why="--rebuild"), flush=True)
            build(m, path)
            print(f"shipped {task}: {ship(task, path)}", flush=True)
    for task in args.ship or []:
        print(f"shipped {task}: {ship(task, cache_path(default_model_config(task)))}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
