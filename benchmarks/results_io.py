"""A benchmark's result files (docs/results/...): each written aside and renamed into place, so a
reader never sees half a file and an interrupted run leaves the previous one."""
from __future__ import annotations

import os


def write_files(out_dir: str | os.PathLike, files: dict[str, str]) -> None:
    """Write {file name: text} under `out_dir` (created if needed)."""
    os.makedirs(out_dir, exist_ok=True)
    for name, text in files.items():
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)
