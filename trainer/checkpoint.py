"""Atomic, resumable checkpoints that run no code when loaded: `output_dir/checkpoints/step_N/`.

A checkpoint is written into `checkpoints/.tmp-step_N/`, every file fsynced, a COMPLETE marker
added, then renamed to `step_N` (an atomic rename on one filesystem) and the directory fsynced.
A crash mid-save leaves only a `.tmp-*` directory, which `latest_checkpoint` never returns and the
next save clears. Only the newest `keep_last` complete checkpoints are kept.

What a checkpoint holds, each part written by `trainer.state_io` as `NAME.json` (the structure and
every number) plus `NAME.safetensors` (its tensors), never as a pickle:

- `model`, `optimizer`, `scheduler` (and `scaler` under float16): the backend's state, full tensors
  (FSDP2 gathers them on rank 0); DeepSpeed instead writes its own `deepspeed/` folder, which
  :func:`guard_deepspeed` makes it read without running code;
- `trainer_state`: the step, the data stream's position, the algorithm's state (a frozen teacher's or
  reference's weights, counters, its RNG), each rank's rollout generator and each rank's RNG streams.

Loading parses JSON and safetensors headers and copies bytes: a crafted file cannot run anything. Every
problem -- a missing, truncated, replaced or inconsistent file, a checkpoint of another model or world
size -- raises :class:`CheckpointError`, one line naming the file; the parts are read and checked before
any is applied, and train.py exits with code 6 before the first step. A checkpoint of the earlier
format (`*.pt` files written by `torch.save`) is still read, with `torch.load(weights_only=True)` and an
allowlist of the three numpy types its RNG state needs: such a file can only build tensors, containers
and numbers, and one that asks for anything else is refused.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
from typing import Any, Callable, Optional

import torch

from models.model_dir import refused_pickle_reason
from trainer.distributed import World
from trainer.state_io import StateFileError, read_state, state_files, write_state

COMPLETE = "COMPLETE"
STATE_NAME = "trainer_state"
LEGACY_SUFFIX = ".pt"  # the earlier format: NAME.pt, a torch.save pickle
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STATE_KEYS = ("step", "stream", "algo", "rng")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (missing, truncated, tampered or not in a format this
    version reads). The message is one line naming the file and what is wrong; nothing of the
    checkpoint has been applied when it is raised. train.py exits with code 6."""


# --- the parts of a checkpoint --------------------------------------------------------------------


def write_part(value: Any, directory: str, name: str) -> list[str]:
    """Write one part (`NAME.json` + `NAME.safetensors`); returns the file names."""
    return write_state(value, directory, name)


def has_part(directory: str, name: str) -> bool:
    return any(os.path.exists(os.path.join(directory, f))
               for f in (state_files(name)[0], name + LEGACY_SUFFIX))


def read_part(directory: str, name: str, device: torch.device | str = "cpu") -> Any:
    """One part of the checkpoint in `directory`, its tensors on `device`; raises CheckpointError."""
    json_name, _ = state_files(name)
    legacy = os.path.join(directory, name + LEGACY_SUFFIX)
    if not os.path.exists(os.path.join(directory, json_name)) and os.path.exists(legacy):
        return read_legacy(legacy, device)
    try:
        return read_state(directory, name, device)
    except StateFileError as err:
        raise CheckpointError(str(err)) from None


def apply_part(directory: str, name: str, apply: Callable[[Any], Any], state: Any) -> None:
    """`apply(state)`, a load_state_dict; a state that does not fit this run is a CheckpointError."""
    try:
        apply(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError) as err:
        raise CheckpointError(f"{_part_path(directory, name)}: does not fit this run's {name} "
                              f"({type(err).__name__}: {_first_line(err)})") from None


def _part_path(directory: str, name: str) -> str:
    legacy = os.path.join(directory, name + LEGACY_SUFFIX)
    json_path = os.path.join(directory, state_files(name)[0])
    return legacy if os.path.exists(legacy) and not os.path.exists(json_path) else json_path


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split("\n")[0].split())
    return text if len(text) <= 300 else text[:297] + "..."


def legacy_globals() -> list:
    """The only non-container types a checkpoint of the earlier format may name: numpy's RNG state."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    found = [np.ndarray, np.dtype, core.multiarray._reconstruct]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        found += [getattr(dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(dtypes, n)]
    return found


def read_legacy(path: str, device: torch.device | str = "cpu", allow: Optional[list] = None) -> Any:
    """A `torch.save` file read without running code: `weights_only=True` (tensors, containers, numbers)
    plus the allowlist; raises CheckpointError naming what a refused file asked for."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing")
    try:
        with torch.serialization.safe_globals(legacy_globals() + list(allow or [])):
            return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        what = refused_pickle_reason(err)
        raise CheckpointError(f"{path}: refused: not plain checkpoint data ({what}); nothing of it ran") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError) as err:
        raise CheckpointError(f"{path}: not a readable checkpoint file (damaged or truncated: "
                              f"{_first_line(err)})") from None


# DeepSpeed writes its own files (torch.save pickles) and reads them with `weights_only=False`. Its engine
# reads every checkpoint file through `engine.checkpoint_engine.load`: guard_deepspeed replaces that with a
# weights_only load whose allowlist is these types (measured on ZeRO-1/2/3 checkpoints: a loss scaler's
# settings, the ZeRO stage enum, a dataclass of fragment offsets; none runs code when built).
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def _deepspeed_allowlist() -> list:
    import importlib

    found = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            pass  # another DeepSpeed version: a file that names it is refused, by name
    return found


def guard_deepspeed(engine: Any) -> None:
    """Make `engine` read its checkpoint files without running code (see DEEPSPEED_GLOBALS)."""
    allow = _deepspeed_allowlist()

    def load(path: str, map_location=None):
        return read_legacy(path, map_location or "cpu", allow)

    engine.checkpoint_engine.load = load


def deepspeed_files(zero_stage: int, world_size: int) -> list[str]:
    """The files DeepSpeed writes for one data-parallel group of `world_size` ranks (no model parallelism)."""
    ranks = range(world_size)
    model = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks] if zero_stage >= 3
             else ["mp_rank_00_model_states.pt"])
    return model + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks]


def vet_deepspeed(folder: str, expected: list[str]) -> None:
    """Check, before DeepSpeed applies anything, that each `expected` file is there, and that every file of
    its checkpoint folder opens and names only allowed types (reads each file's pickle, not its tensors);
    raises CheckpointError."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: missing (DeepSpeed's part of the checkpoint)")
    for name in expected:
        if not os.path.exists(os.path.join(folder, name)):
            raise CheckpointError(f"{os.path.join(folder, name)}: missing")
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in legacy_globals() + _deepspeed_allowlist()}
    allowed |= set(DEEPSPEED_GLOBALS)
    files = sorted(f for f in os.listdir(folder) if f.endswith(LEGACY_SUFFIX))
    if not files:
        raise CheckpointError(f"{folder}: holds no checkpoint files")
    for name in files:
        path = os.path.join(folder, name)
        try:
            named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception as err:  # noqa: BLE001 -- any failure to open it is a damaged file
            raise CheckpointError(f"{path}: not a readable checkpoint file (damaged or truncated: "
                                  f"{_first_line(err)})") from None
        bad = [g for g in named if g not in allowed]  # torch's own tensor-rebuilding globals are not listed
        if bad:
            raise CheckpointError(f"{path}: refused: not plain checkpoint data (it asks to build or call "
                                  f"`{bad[0]}`); nothing of it ran")


def agree(world: World, problem: Optional[CheckpointError]) -> None:
    """Raise on every rank when any rank could not read its part (the first rank's message), so no rank
    goes on into a collective that the others never reach."""
    if world.distributed:
        failed = world.all_reduce_max(torch.tensor([1.0 if problem is not None else 0.0]))
        if float(failed[0]) > 0:
            messages = [m for m in world.gather_objects(None if problem is None else str(problem)) if m]
            raise CheckpointError(messages[0]) from None
    elif problem is not None:
        raise problem


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
        write_part({**state, "rng": rng}, tmp, STATE_NAME)
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
    """Restore model/optimizer/scheduler (via the backend) and this rank's RNG; return trainer state.
    The trainer state is read and checked first, then the backend reads all its parts before applying
    any; every problem is a CheckpointError (one line), raised on every rank."""
    problem, state = None, None
    try:
        state = _read_trainer_state(path, world)
    except CheckpointError as err:
        problem = err
    agree(world, problem)
    backend.load(path)
    rng = state.pop("rng")
    set_rng_state(rng[world.rank])
    return state


def _read_trainer_state(path: str, world: World) -> dict:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {COMPLETE} marker: an interrupted save?)")
    state = read_part(path, STATE_NAME)
    file = _part_path(path, STATE_NAME)
    if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
        missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
        raise CheckpointError(f"{file}: not a trainer state (no {', '.join(missing)})")
    rng = state["rng"]
    if not isinstance(rng, list) or len(rng) != world.size:
        n = len(rng) if isinstance(rng, list) else "?"
        raise CheckpointError(f"{file}: written by {n} ranks; this run has {world.size} (resume with the same "
                              "number of ranks)")
    problem = _rng_problem(rng[world.rank])
    if problem:
        raise CheckpointError(f"{file}: rank {world.rank}'s RNG state {problem}")
    return state


def _rng_problem(state: Any) -> Optional[str]:
    """Why `state` is not an RNG state set_rng_state can apply, checked before anything is applied."""
    import numpy as np

    if not isinstance(state, dict) or any(k not in state for k in ("python", "numpy", "torch")):
        return "is incomplete"
    py, npy, tt = state["python"], state["numpy"], state["torch"]
    if not (isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple)
            and all(isinstance(v, int) for v in py[1])):
        return "has no valid python state"
    if not (isinstance(npy, tuple) and len(npy) == 5 and isinstance(npy[1], np.ndarray)):
        return "has no valid numpy state"
    if not (isinstance(tt, torch.Tensor) and tt.dtype == torch.uint8):
        return "has no valid torch state"
    return None


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
