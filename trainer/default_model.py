"""The embedded default model's cache entry: its recipe, where it lives, and whether an entry there
is complete. Reading only -- building is the warm-start stage (trainer/warm_start.py), which runs
before a session is built and is the only writer.

The warm-start task is `model.warm_start_task`: `arith` (the default) or `artifacts` (config
loading resolves `auto` to the run's `data.name` when that is one of them, else `arith`; outside
config loading `auto` means `arith`). Each task has its own warm-up data (`WARM_DATA`,
`WARM_DATA_ARTIFACTS`) and measured recipe numbers (`WARM_NUMBERS`), which a `model.warm_start_*`
key left null takes. The arith recipe dict is exactly what it was before the artifacts task existed
(no `task` entry), so its existing cache entries are reused.

An entry is `model.cache_dir/tiny-<recipe hash>/`, a plain HF model directory plus `warm_start.json`:
the recipe, the steps trained, the held-out accuracy reached and the accuracy floor it was held to.
It counts as complete only when all the recipe's steps ran and the accuracy reached the floor; an
entry that says otherwise (an interrupted build published by an older version) is refused.

Shipped weights: `models/default_weights/<task>/` holds an entry built by the default recipe of each
warm-start task (`python -m trainer.warm_start --rebuild TASK` rebuilds one). Float results of CPU
kernels differ by instruction set and processor, and hundreds of SFT steps amplify that into another
model; so a run whose recipe is a shipped one installs those weights (`shipped_entry`) instead of
building, and the default model -- and every figure measured from it -- is the same on every machine.
A recipe of its own (another `model.seed`, shape or `model.warm_start_*` value) is built on first use.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # models.loading imports torch; config loading imports this module and must stay light
    from models.loading import TinySpec

RECIPE_VERSION = 2
DONE = "warm_start.json"
METRICS = "warm_start_metrics.jsonl"
# Same seed as the default data=arith, so the warm-up trains on its train split only and never sees
# its held-out questions.
WARM_DATA = {"seed": 0, "n_train": 20000, "n_test": 200, "digits": 2, "steps": 2, "ops": ["+", "-"]}
# The artifacts warm-up: the default data=artifacts except the train mix (the same seed, libraries and
# n_test, so its test and ood problems are never trained on: the test splits do not depend on `kinds`),
# weighted to select (3 tables of 2 rows: with 4 of 3 the tiny model did not learn to select in the
# time; docs/artifacts.md has the probes).
WARM_DATA_ARTIFACTS = {"seed": 0, "n_train": 40000, "n_test": 200, "n_artifacts": 3, "artifact_rows": 2,
                       "n_library": 8000, "n_library_ood": 500,
                       "kinds": {"single": 2.0, "select": 3.0, "combine": 1.0}, "artifact_prefix": ""}
# The clm warm-up: SFT on the scripted policy's calls (view "calls": every call of a scripted episode is
# one prompt -> output row) over the default data=clm train episodes (same seed, so its test episodes
# are never demonstrated).
WARM_DATA_CLM = {"seed": 0, "n_train": 2000, "n_test": 100, "kinds": {"kv": 1.0, "chain": 1.0}, "budget": 200,
                 "view": "calls"}
# The multipath warm-up: the default data=multipath train split (same seed, so its held-out questions are
# never trained on); each problem's reference is one valid order drawn at random, so the warm model
# sees every order.
WARM_DATA_MULTIPATH = {"seed": 0, "n_train": 20000, "n_test": 200, "digits": 2, "steps": 2, "ops": ["+", "-"]}
WARM_TASK_DATA = {"arith": WARM_DATA, "multipath": WARM_DATA_MULTIPATH, "artifacts": WARM_DATA_ARTIFACTS,
                  "clm": WARM_DATA_CLM}
WARM_START_TASKS = ("auto",) + tuple(WARM_TASK_DATA)
# Recipe numbers per warm-start task, taken by the model.warm_start_* keys left null (configs/model/tiny.yaml).
# arith: the original recipe (300 steps, ~5.5 min on 2 CPU cores). artifacts: plain SFT (no reference
# rows: full prefill of prompt + solution), numbers measured as in docs/artifacts.md. clm: plain SFT on the
# scripted calls, 1088 s on 2 cores, held-out exact match per call 0.33 and greedy episode success 0.17
# (docs/clm.md).
WARM_NUMBERS = {
    "arith": {"steps": 300, "lr": 3e-3, "batch_size": 64, "reference_fraction": 0.5},
    "multipath": {"steps": 300, "lr": 3e-3, "batch_size": 64, "reference_fraction": 0.5},
    "artifacts": {"steps": 3000, "lr": 3e-3, "batch_size": 32, "reference_fraction": 0.0},
    "clm": {"steps": 2000, "lr": 3e-3, "batch_size": 32, "reference_fraction": 0.0},
}
_NUMBER_KEYS = {"steps": "warm_start_steps", "lr": "warm_start_lr", "batch_size": "warm_start_batch_size",
                "reference_fraction": "warm_start_reference_fraction"}


def spec(m: Any) -> "TinySpec":
    from models.loading import TinySpec

    return TinySpec(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size)


def warm_task(m: Any, data_name: Optional[str] = None) -> str:
    """The warm-start task of `m`: its `warm_start_task`, with `auto` = `data_name` when that is a
    warm-start task, else arith."""
    task = getattr(m, "warm_start_task", "auto")
    if task == "auto":
        return data_name if data_name in WARM_TASK_DATA else "arith"
    if task not in WARM_TASK_DATA:
        raise ValueError(f"model.warm_start_task={task} is not one of {', '.join(WARM_START_TASKS)}")
    return task


def resolve(m: Any, data_name: Optional[str] = None) -> Any:
    """`m` with `warm_start_task` resolved and every null `warm_start_*` number set from that task's
    `WARM_NUMBERS` (a copy; `m` is unchanged). Idempotent."""
    task = warm_task(m, data_name)
    numbers = {attr: WARM_NUMBERS[task][key] for key, attr in _NUMBER_KEYS.items() if getattr(m, attr) is None}
    return dataclasses.replace(m, warm_start_task=task, **numbers)


def recipe(m: Any) -> dict:
    """What determines the warm-started weights (hashed into the entry's name). `model.seed` seeds
    the model; the run's own `seed` does not enter, so runs with other seeds share one entry. A task
    other than arith adds a `task` entry (so arith's dict, and hash, are what they always were)."""
    m = resolve(m)
    task = m.warm_start_task
    out = {
        "version": RECIPE_VERSION,
        "spec": dataclasses.asdict(spec(m)),
        "seed": m.seed,
        "steps": m.warm_start_steps,
        "lr": m.warm_start_lr,
        "batch_size": m.warm_start_batch_size,
        "reference_fraction": m.warm_start_reference_fraction,
        "data": WARM_TASK_DATA[task],
    }
    if task != "arith":
        out["task"] = task
    return out


def recipe_key(m: Any) -> str:
    return hashlib.sha256(json.dumps(recipe(m), sort_keys=True).encode()).hexdigest()[:12]


def cache_path(m: Any) -> str:
    return os.path.join(os.path.expanduser(m.cache_dir), f"tiny-{recipe_key(m)}")


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "default_weights")
# Measured build times of the default recipes on 2 CPU cores (seconds), for the notice printed before a
# build: a recipe of its own takes about this, scaled by its steps.
BUILD_SECONDS = {"arith": 326, "multipath": 480, "artifacts": 1923, "clm": 1088}


def shipped_path(task: str) -> str:
    return os.path.join(SHIPPED_DIR, task)


def read_record(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, DONE)) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def shipped_entry(m: Any) -> Optional[str]:
    """The shipped entry for `m`'s warm-start task when it was built by exactly `m`'s recipe and is
    complete, else None."""
    m = resolve(m)
    path = shipped_path(m.warm_start_task)
    record = read_record(path)
    if record is None or json.dumps(record.get("recipe"), sort_keys=True) != json.dumps(recipe(m), sort_keys=True):
        return None
    return path if entry_problem(m, path) is None else None


def build_notice(m: Any, path: str, why: Optional[str] = None) -> str:
    """What a first-use build prints before it starts: what it builds, why, and about how long."""
    m = resolve(m)
    task = m.warm_start_task
    seconds = BUILD_SECONDS[task] * m.warm_start_steps / WARM_NUMBERS[task]["steps"]
    why = why or ("its recipe differs from the shipped one (model.seed, the model's shape or a model.warm_start_* "
                  "key)" if read_record(shipped_path(task)) is not None else "no weights are shipped for it")
    return (f"building the warm-started tiny model for {task} in {path}, once: {why}; about "
            f"{max(1, round(seconds / 60))} minutes on 2 CPU cores ({m.warm_start_steps} SFT steps)")


def entry_problem(m: Any, path: Optional[str] = None) -> Optional[str]:
    """None when the entry at `path` (default: the recipe's) is complete; else why it is not."""
    path = path or cache_path(m)
    record_path = os.path.join(path, DONE)
    if not os.path.exists(record_path):
        return "missing" if not os.path.exists(path) else f"no {DONE} record"
    try:
        with open(record_path) as fh:
            record = json.load(fh)
    except (OSError, ValueError) as err:
        return f"unreadable {DONE}: {err}"
    want = resolve(m).warm_start_steps
    steps = record.get("steps_done", _last_train_step(os.path.join(path, METRICS)))
    if steps != want:
        return f"trained {steps} of {want} steps"
    floor = max(m.warm_start_min_accuracy, record.get("accuracy_floor", 0.0))
    accuracy = record.get("accuracy")
    if accuracy is None or accuracy < floor:
        return f"held-out accuracy {accuracy} is below the floor {floor}"
    return None


def _last_train_step(metrics_path: str) -> Optional[int]:
    """The last train step in an entry's metrics (entries recorded before `steps_done` existed)."""
    try:
        with open(metrics_path) as fh:
            steps = [r["step"] for r in map(json.loads, fh) if r.get("split") == "train"]
    except (OSError, ValueError):
        return None
    return steps[-1] if steps else None
