"""Files the trainer exports for the runtime: their names and defaults, defined once for both sides.

The trainer writes them (`algorithms/seed.py` exports `seed_drafter.json` next to the model; every
export gets a `serving.json` manifest, `inference/serving.py`) and the runtime reads them
(`inference/serving.py`, `inference/speculative.py`, `python -m inference`). Both import the names
and the defaults from here, so a renamed file or a changed default cannot drift apart between
writer and reader.

    write_drafter_spec(out_dir, DrafterSpec(decoder_layers=3))
    spec = read_drafter_spec(model_dir)     # DrafterSpec(); the defaults when the file is absent
    manifest = read_manifest(model_dir)     # ServingManifest, or None when the export has none

This module imports nothing from the rest of the repo (the trainer imports it at module level).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ATTUNER_FILE", "DRAFTER_DEFAULTS", "carry_drafter_spec", "DrafterSpec", "EXPORT_KINDS", "ManifestError", "SEED_DRAFTER_FILE",
           "SERVING_FILE", "SERVING_VERSION", "ServingManifest", "read_drafter_spec", "read_manifest",
           "write_drafter_spec", "write_manifest"]

SEED_DRAFTER_FILE = "seed_drafter.json"
ATTUNER_FILE = "attuner.json"  # an Attuner export: what the query-side adapter is and the base it fits
SERVING_FILE = "serving.json"  # every export's manifest: what it holds and how it is served
SERVING_VERSION = 1


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


def carry_drafter_spec(source_dir: str | os.PathLike, out_dir: str | os.PathLike) -> bool:
    """Copy `source_dir`'s seed_drafter.json into `out_dir` when the source has one and `out_dir` has
    none (an export that keeps its starting model's function: a skipper's frozen base, QAD's quantized
    copy). Returns whether it was copied."""
    if not (Path(source_dir) / SEED_DRAFTER_FILE).exists() or (Path(out_dir) / SEED_DRAFTER_FILE).exists():
        return False
    write_drafter_spec(out_dir, read_drafter_spec(source_dir))
    return True


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


# ----------------------------------------------------------------------------- the serving manifest

# What an export directory is: a full model; a PEFT LoRA adapter over a base; a model with a SEED
# drafter spec; a base with a layer skipper; a compressed-tensors low-bit model; a query-side
# adapter for the position-independent artifact cache.
EXPORT_KINDS = ("model", "lora", "seed", "skipper", "quantized", "attuner")
# Full-precision weights load as saved; any other `weights` names a stored format whose loader registers with
# the serving door (`inference.serving.register_weights`; the door refuses a name none registered).
FLOAT_WEIGHTS = ("float32", "bfloat16", "float16")


class ManifestError(ValueError):
    """A serving.json that cannot be read: the message names the file and the field."""


@dataclass(frozen=True)
class ServingManifest:
    """The content of `serving.json`: what an export holds and which fast paths serve it.

    kind: one of EXPORT_KINDS. base: the base model dir an adapter applies to (lora, attuner); None
    when this dir holds the weights. weights: the stored weight format (a FLOAT_WEIGHTS dtype, or a
    registered stored format such as "compressed"); `scheme` names its low-bit scheme (e.g. "W4A8"). skipper: the sub-dir holding a
    layer skipper. drafter: the SEED drafter spec file. adapter: "lora" or "attuner" when the dir is
    itself a PEFT adapter. artifact_cache: how a position-independent artifact cache serves it (an
    Attuner export: the cache is the base's, the adapter runs on the query). stop_ids: the
    tokenizer's end-of-sequence ids. vocab_size: the tokenizer's size (a drafter must share it).
    """

    kind: str
    weights: str = "float32"
    scheme: str | None = None
    base: str | None = None
    skipper: str | None = None
    drafter: str | None = None
    adapter: str | None = None
    artifact_cache: dict[str, Any] | None = None
    stop_ids: tuple[int, ...] = ()
    vocab_size: int | None = None
    version: int = SERVING_VERSION

    def __post_init__(self) -> None:
        if self.kind not in EXPORT_KINDS:
            raise ManifestError(f"{SERVING_FILE}: kind {self.kind!r} is not one of {', '.join(EXPORT_KINDS)}")
        if not self.weights:
            raise ManifestError(f"{SERVING_FILE}: field weights is empty")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["stop_ids"] = list(self.stop_ids)
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = SERVING_FILE) -> "ServingManifest":
        """The inverse of to_dict. ManifestError naming `where` and the field for a missing kind, a
        format version newer than this runtime reads, or a field of the wrong type; unknown keys are
        ignored (a newer minor field still loads)."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
        version = data.get("version", SERVING_VERSION)
        if not isinstance(version, int) or version > SERVING_VERSION:
            raise ManifestError(f"{where}: field version={version!r}: this runtime reads format version "
                                f"{SERVING_VERSION} and older")
        if "kind" not in data:
            raise ManifestError(f"{where}: field kind is missing")
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        for key in ("kind", "weights", "scheme", "base", "skipper", "drafter", "adapter"):
            if key in values and values[key] is not None and not isinstance(values[key], str):
                raise ManifestError(f"{where}: field {key} must be a string, got {values[key]!r}")
        stop = values.get("stop_ids", [])
        if not isinstance(stop, list) or not all(isinstance(i, int) for i in stop):
            raise ManifestError(f"{where}: field stop_ids must be a list of token ids, got {stop!r}")
        values["stop_ids"] = tuple(stop)
        try:
            return cls(**values)
        except ManifestError as err:
            raise ManifestError(str(err).replace(SERVING_FILE, where, 1)) from None


def read_manifest(model_dir: str | os.PathLike) -> ServingManifest | None:
    """`model_dir/serving.json`, or None when the export has none (written before manifests existed)."""
    path = Path(model_dir) / SERVING_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ManifestError(f"{path}: not valid JSON ({err})") from None
    return ServingManifest.from_dict(data, str(path))


def write_manifest(out_dir: str | os.PathLike, manifest: ServingManifest) -> Path:
    """Write `out_dir/serving.json` atomically."""
    path = Path(out_dir) / SERVING_FILE
    write_json_atomic(path, manifest.to_dict())
    return path
