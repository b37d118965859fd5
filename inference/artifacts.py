"""Files the trainer exports for the runtime: their names and defaults, defined once for both sides.

The trainer writes them (`algorithms/seed.py` exports `seed_drafter.json` next to the model) and the
runtime reads them (`inference/speculative.py`, `python -m inference --speculative seed`). Both
import the name and the defaults from here, so a renamed file or a changed default cannot drift
apart between writer and reader.

    write_drafter_spec(out_dir, DrafterSpec(decoder_layers=3))
    spec = read_drafter_spec(model_dir)     # DrafterSpec(); the defaults when the file is absent

This module imports nothing from the rest of the repo (the trainer imports it at module level).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DRAFTER_DEFAULTS", "DrafterSpec", "SEED_DRAFTER_FILE", "read_drafter_spec", "write_drafter_spec"]

SEED_DRAFTER_FILE = "seed_drafter.json"


@dataclass(frozen=True)
class DrafterSpec:
    """How SEED self-drafting runs a model: the content of `seed_drafter.json`."""

    decoder_layers: int = 2  # k: the top k layers draft
    block_size: int = 4  # training block; the runtime's draft_len when the file has none
    draft_len: int = 4  # max drafted tokens per verify forward
    confidence: float = 0.7  # adaptive: stop drafting after a draft whose top probability is below this
    adaptive: bool = True  # False: always draft draft_len tokens

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DrafterSpec":
        """Missing keys take the defaults, except draft_len, which falls back to block_size (files
        written before draft_len existed drafted one training block). Unknown keys are ignored, so
        a newer trainer's file still loads."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        if "draft_len" not in values and "block_size" in values:
            values["draft_len"] = values["block_size"]
        return cls(**values)


DRAFTER_DEFAULTS = DrafterSpec()


def read_drafter_spec(model_dir: str | os.PathLike) -> DrafterSpec:
    """`model_dir/seed_drafter.json`, or the defaults when the directory has none."""
    path = Path(model_dir) / SEED_DRAFTER_FILE
    if not path.exists():
        return DRAFTER_DEFAULTS
    return DrafterSpec.from_dict(json.loads(path.read_text()))


def write_drafter_spec(out_dir: str | os.PathLike, spec: DrafterSpec) -> Path:
    """Write `out_dir/seed_drafter.json` atomically: a reader sees the old file or the new one,
    never a half-written one."""
    path = Path(out_dir) / SEED_DRAFTER_FILE
    write_json_atomic(path, spec.to_dict())
    return path


def write_json_atomic(path: Path, data: Any) -> None:
    """JSON into a temp file in the same directory (so os.replace is a rename), then replace.

    The temp file is opened like the final one (plain `open`, so the umask's permissions)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
