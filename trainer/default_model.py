"""The embedded default model's cache entry: its recipe, where it lives, and whether an entry there
is complete. Reading only -- building is the warm-start stage (trainer/warm_start.py), which runs
before a session is built and is the only writer.

An entry is `model.cache_dir/tiny-<recipe hash>/`, a plain HF model directory plus `warm_start.json`:
the recipe, the steps trained, the held-out accuracy reached and the accuracy floor it was held to.
It counts as complete only when all the recipe's steps ran and the accuracy reached the floor; an
entry that says otherwise (an interrupted build published by an older version) is refused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

from models.loading import TinySpec

RECIPE_VERSION = 2
DONE = "warm_start.json"
METRICS = "warm_start_metrics.jsonl"
# Same seed as the default data=arith, so the warm-up trains on its train split only and never sees
# its held-out questions.
WARM_DATA = {"seed": 0, "n_train": 20000, "n_test": 200, "digits": 2, "steps": 2, "ops": ["+", "-"]}


def spec(m: Any) -> TinySpec:
    return TinySpec(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size)


def recipe(m: Any) -> dict:
    """What determines the warm-started weights (hashed into the entry's name). `model.seed` seeds
    the model; the run's own `seed` does not enter, so runs with other seeds share one entry."""
    return {
        "version": RECIPE_VERSION,
        "spec": dataclasses.asdict(spec(m)),
        "seed": m.seed,
        "steps": m.warm_start_steps,
        "lr": m.warm_start_lr,
        "batch_size": m.warm_start_batch_size,
        "reference_fraction": m.warm_start_reference_fraction,
        "data": WARM_DATA,
    }


def cache_path(m: Any) -> str:
    key = hashlib.sha256(json.dumps(recipe(m), sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser(m.cache_dir), f"tiny-{key}")


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
    want = recipe(m)["steps"]
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
