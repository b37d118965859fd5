"""The embedded default model: built on first use, cached by recipe, deterministic by seed, and
rebuilt when the recipe changes. (Small recipes here; the real one is measured in the README.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

from trainer.config import ModelConfig
from trainer.distributed import World
from trainer import warm_start

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=2,
             warm_start_batch_size=4)


def _cfg(tmp_path, **kw):
    return ModelConfig(cache_dir=str(tmp_path / "cache"), **{**SMALL, **kw})


@pytest.mark.slow  # warm-start build: 3.6 s
def test_built_once_then_loaded_from_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path)
    model, tok = warm_start.tiny_model(m, World(), seed=0)
    path = warm_start.cache_path(m, seed=0)
    info = json.loads(open(os.path.join(path, warm_start.DONE)).read())
    assert info["recipe"]["steps"] == 2 and 0.0 <= info["accuracy"] <= 1.0
    assert os.path.exists(os.path.join(path, "warm_start_metrics.jsonl"))

    def no_rebuild(*a, **k):
        raise AssertionError("the cached model must be reused")

    monkeypatch.setattr(warm_start, "build", no_rebuild)
    again, _ = warm_start.tiny_model(m, World(), seed=0)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert tok.eos_token_id is not None and len(tok) == model.config.vocab_size


@pytest.mark.slow  # warm-start builds: 26 s
def test_recipe_change_or_seed_gives_new_entry_and_same_seed_same_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path)
    assert warm_start.cache_path(m, 0) != warm_start.cache_path(_cfg(tmp_path, warm_start_steps=3), 0)
    assert warm_start.cache_path(m, 0) != warm_start.cache_path(m, 1)
    first, _ = warm_start.tiny_model(m, World(), seed=0)
    other = _cfg(tmp_path / "elsewhere")  # same recipe, another cache: rebuilt from scratch
    second, _ = warm_start.tiny_model(other, World(), seed=0)
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)


def test_warm_start_zero_steps_is_random_init(tmp_path):
    model, _ = warm_start.tiny_model(_cfg(tmp_path, warm_start_steps=0), World(), seed=0)
    assert not (tmp_path / "cache").exists()
    assert model.config.num_hidden_layers == 1
