"""A benchmark's result files (docs/results/...): each written aside and renamed into place, so a
reader never sees half a file and an interrupted run leaves the previous one."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional


def write_files(out_dir: str | os.PathLike, files: dict[str, str]) -> None:
    """Write {file name: text} under `out_dir` (created if needed)."""
    os.makedirs(out_dir, exist_ok=True)
    for name, text in files.items():
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)


def remembered(path: Optional[str], run: Callable[[], Any]) -> Any:
    """The result of `run()` (JSON-able), read from `path` when an earlier run finished it, else
    computed and written there: one file per finished run, so an interrupted benchmark goes on where it
    stopped. path None: computed, kept nowhere."""
    if path and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    result = run()
    if path:
        write_files(os.path.dirname(path), {os.path.basename(path): json.dumps(result)})
    return result
