"""Run state on disk without pickle: a nested Python value as a JSON tree plus its tensors in safetensors.

Resuming must never run code from a checkpoint, and `pickle` (what `torch.save` writes) runs whatever
a crafted file asks for. So every piece of state the trainer writes -- model, optimizer, scheduler,
loss scaler, the trainer's own state (step, RNG streams, data position, algorithm state) -- is written
by :func:`write_state` as two files:

- ``NAME.json``: ``{"format": FORMAT, "tree": ...}``, the value with each tensor replaced by a
  reference ``{"__tensor__": KEY}`` (and tuples, non-string-keyed dicts and numpy arrays tagged);
- ``NAME.safetensors``: the tensors under those keys (the key is the value's path, e.g.
  ``state/0/exp_avg``), only when there are any.

Both formats are data only: reading them parses JSON and a safetensors header and copies bytes.
:func:`read_state` raises :class:`StateFileError` (one line naming the file and what is wrong) on
anything it cannot read back exactly.

Supported values: None, bool, int, float (NaN/inf included), str, list, tuple, dict (any keys of
these kinds), torch tensors, numpy arrays and numpy scalars (read back as Python numbers). Anything
else is refused when written, naming its path in the value.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

FORMAT = "posttrain-state-1"
TENSOR, TUPLE, ITEMS, NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
TAGS = (TENSOR, TUPLE, ITEMS, NDARRAY)


class StateFileError(Exception):
    """A state file that cannot be read back: missing, truncated, not this format, or inconsistent."""


def state_files(name: str) -> tuple[str, str]:
    """The (json, safetensors) file names of the state called `name`."""
    return f"{name}.json", f"{name}.safetensors"


def write_state(value: Any, directory: str, name: str) -> list[str]:
    """Write `value` as `directory/NAME.json` (+ `NAME.safetensors` when it holds tensors). Returns the
    file names written. Raises TypeError naming the path of a value it cannot store."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(value, "", tensors, {})
    json_name, st_name = state_files(name)
    written = [json_name]
    if tensors:
        save_file(tensors, os.path.join(directory, st_name))
        written.append(st_name)
    with open(os.path.join(directory, json_name), "w") as fh:
        json.dump({"format": FORMAT, "tensors": st_name if tensors else None, "tree": tree}, fh)
    return written


def read_state(directory: str, name: str, device: torch.device | str = "cpu") -> Any:
    """The value :func:`write_state` wrote as `name` in `directory`, its tensors on `device`."""
    json_name, _ = state_files(name)
    path = os.path.join(directory, json_name)
    doc = _read_json(path)
    tensors = _read_tensors(directory, doc.get("tensors"), device)
    used: set[str] = set()
    try:
        value = _decode(doc["tree"], tensors, used)
    except (KeyError, TypeError, ValueError) as err:
        raise StateFileError(f"{path}: inconsistent state ({type(err).__name__}: {err})") from None
    if used != set(tensors):
        extra = sorted(set(tensors) - used)[:3]
        raise StateFileError(f"{path}: its tensor file holds tensors the state does not name (e.g. {extra})")
    return value


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        raise StateFileError(f"{path}: missing")
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StateFileError(f"{path}: not a JSON state file (damaged or replaced: {err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "tree" not in doc:
        raise StateFileError(f"{path}: not a {FORMAT} file")
    return doc


def _read_tensors(directory: str, name: Any, device) -> dict[str, torch.Tensor]:
    if name is None:
        return {}
    if not isinstance(name, str) or os.path.basename(name) != name:
        raise StateFileError(f"{os.path.join(directory, str(name))}: not a tensor file name of this directory")
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise StateFileError(f"{path}: missing")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise StateFileError(f"{path}: not a readable safetensors file (damaged or replaced: {err})") from None


def _encode(value: Any, path: str, tensors: dict, seen: dict) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {TENSOR: _store(value, path, tensors, seen)}
    if isinstance(value, np.ndarray):
        return {NDARRAY: _store(torch.from_numpy(np.ascontiguousarray(value)), path, tensors, seen),
                "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{path}/{i}", tensors, seen) for i, v in enumerate(value)]
        return {TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in TAGS for k in value):
            return {k: _encode(v, f"{path}/{k}", tensors, seen) for k, v in value.items()}
        return {ITEMS: [[_encode(k, f"{path}/key{i}", tensors, seen), _encode(v, f"{path}/{k}", tensors, seen)]
                        for i, (k, v) in enumerate(value.items())]}
    raise TypeError(f"state at {path or '/'} is a {type(value).__name__}, which a state file cannot hold")


def _store(t: torch.Tensor, path: str, tensors: dict, seen: dict) -> str:
    """The key of `t` in the tensor file. A tensor seen before (tied weights) is stored once; another view
    of an already stored storage is copied (safetensors refuses tensors that share memory)."""
    t = t.detach()
    ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
    if ident is not None and ident in seen:
        return seen[ident]
    key = path.lstrip("/") or "value"
    while key in tensors:  # two paths that read alike ("a/b" as one key and as a nesting)
        key = f"{path.lstrip('/')}#{len(tensors)}"
    storages = seen.setdefault("storages", set())
    shared = bool(t.numel()) and t.untyped_storage().data_ptr() in storages
    if t.numel():
        storages.add(t.untyped_storage().data_ptr())
    t = t.cpu()
    tensors[key] = t.clone() if shared or not t.is_contiguous() else t
    if ident is not None:
        seen[ident] = key
    return key


def _decode(node: Any, tensors: dict, used: set) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors, used) for v in node]
    if not isinstance(node, dict):
        return node
    if TENSOR in node:
        used.add(node[TENSOR])
        return tensors[node[TENSOR]]
    if NDARRAY in node:
        used.add(node[NDARRAY])
        return tensors[node[NDARRAY]].cpu().numpy().astype(np.dtype(node["dtype"]), copy=True)
    if TUPLE in node:
        return tuple(_decode(v, tensors, used) for v in node[TUPLE])
    if ITEMS in node:
        return {_hashable(_decode(k, tensors, used)): _decode(v, tensors, used) for k, v in node[ITEMS]}
    return {k: _decode(v, tensors, used) for k, v in node.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor, np.ndarray)):
        raise TypeError(f"a dict key read back as a {type(key).__name__}")
    return key
