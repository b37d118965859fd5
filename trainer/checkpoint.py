"""Atomic, resumable checkpoints: `output_dir/checkpoints/step_N/`.

A checkpoint is written into `checkpoints/.tmp-step_N/`, every file fsynced, a COMPLETE marker
added, then renamed to `step_N` (an atomic rename on one filesystem) and the directory fsynced.
A crash mid-save leaves only a `.tmp-*` directory, which `latest_checkpoint` never returns and the
next save clears. Only the newest `keep_last` complete checkpoints are kept.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional

import torch

from trainer.distributed import World

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.exists(os.path.join(path, COMPLETE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> Optional[str]:
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(output_dir: str, step: int, backend: Any, world: World, state: dict, keep_last: int) -> str:
    """All ranks call this. `state` (trainer/algorithm/data state) is written by rank 0; per-rank RNG
    states are gathered into it so every rank resumes its own streams."""
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp-step_{step}")
    if world.is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    world.barrier()
    backend.save(tmp)
    rng = world.gather_objects(rng_state())
    world.barrier()  # every rank's files are in tmp
    if world.is_main:
        torch.save({**state, "rng": rng}, os.path.join(tmp, STATE_FILE))
        with open(os.path.join(tmp, COMPLETE), "w") as fh:
            fh.write(f"{step}\n")
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step after a resume
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(output_dir, keep_last)
    world.barrier()
    return final


def _prune(output_dir: str, keep_last: int) -> None:
    for _, path in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    root = checkpoint_root(output_dir)
    for name in os.listdir(root):  # leftovers of crashed saves
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_checkpoint(path: str, backend: Any, world: World) -> dict:
    """Restore model/optimizer/scheduler (via the backend) and this rank's RNG; return trainer state."""
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    backend.load(path)
    state = torch.load(os.path.join(path, STATE_FILE), weights_only=False)
    rng = state.pop("rng")
    if len(rng) != world.size:
        raise ValueError(f"{path} was written by {len(rng)} ranks; this run has {world.size}")
    set_rng_state(rng[world.rank])
    return state


def rng_state() -> dict:
    import random

    import numpy as np

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
