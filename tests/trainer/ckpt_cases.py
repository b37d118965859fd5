"""Damaged and tampered checkpoints, shared by tests/trainer/test_checkpoint_safety.py (one process) and
tests/trainer/ckpt_worker.py (under torchrun): copy a good checkpoint, break one file of it, resume."""
from __future__ import annotations

import builtins
import os
import pickle
import shutil
from pathlib import Path

import torch

KINDS = ("pickle", "torch_pickle", "truncated", "missing")
NOT_STATE = ("COMPLETE", "latest")  # markers whose content is never parsed (DeepSpeed's `latest`: the tag is given)


class Payload:
    """Unpickling this creates the file `path`: proof that a loader ran code from the checkpoint."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def state_files(ckpt: Path) -> list[str]:
    """Every file of the checkpoint that holds state, relative to it (scripts DeepSpeed copies in are skipped)."""
    out = []
    for dirpath, _, files in os.walk(ckpt):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), ckpt)
            if name not in NOT_STATE and not name.endswith(".py"):
                out.append(rel)
    return sorted(out)


def break_file(ckpt: Path, rel: str, kind: str, marker: str) -> None:
    path = ckpt / rel
    if kind == "pickle":  # a bare pickle, what `pickle.dump` / an attacker's script writes
        path.write_bytes(pickle.dumps({"state": Payload(marker)}))
    elif kind == "torch_pickle":  # the same payload inside torch.save's zip layout
        torch.save({"state": Payload(marker)}, path)
    elif kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "missing":
        path.unlink()
    else:
        raise ValueError(kind)


def broken_copy(good: Path, dest: Path, rel: str, kind: str, marker: str) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(good, dest)
    break_file(dest, rel, kind, marker)
    return dest
