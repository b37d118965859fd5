"""The embedded default model: built on first use by the warm-start stage, cached by recipe,
deterministic by `model.seed`, rebuilt when the recipe changes; never published unfinished, refused
when its record says it is incomplete, and built once when two processes start together.
(Small recipes here; the real one is measured in the README.)"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT
from trainer import default_model, warm_start
from trainer.config import ModelConfig
from trainer.distributed import World
from trainer.setup import load_model

SMALL = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, warm_start_steps=2,
             warm_start_batch_size=4, warm_start_min_accuracy=0.0)


def _cfg(tmp_path, **kw):
    return ModelConfig(cache_dir=str(tmp_path / "cache"), **{**SMALL, **kw})


def _tiny_model(m):
    warm_start.ensure(m, World())
    return load_model(m, World())


@pytest.mark.slow  # warm-start build: 3.6 s
def test_built_once_then_loaded_from_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path)
    model, tok = _tiny_model(m)
    path = default_model.cache_path(m)
    info = json.loads(open(os.path.join(path, default_model.DONE)).read())
    assert info["recipe"]["steps"] == 2 and 0.0 <= info["accuracy"] <= 1.0
    assert info["steps_done"] == 2 and info["accuracy_floor"] == 0.0
    assert os.path.exists(os.path.join(path, "warm_start_metrics.jsonl"))

    def no_rebuild(*a, **k):
        raise AssertionError("the cached model must be reused")

    monkeypatch.setattr(warm_start, "build", no_rebuild)
    again, _ = _tiny_model(m)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert tok.eos_token_id is not None and len(tok) == model.config.vocab_size


@pytest.mark.slow  # a warm-start build (the artifacts task's 40000 warm-up problems are generated): 4 s
def test_artifacts_warm_start_is_its_own_entry_trained_on_that_task(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path, warm_start_task="artifacts")
    arith = _cfg(tmp_path)
    assert default_model.cache_path(m) != default_model.cache_path(arith)
    assert "task" not in default_model.recipe(arith) and default_model.recipe(arith)["data"] == default_model.WARM_DATA
    warm_start.ensure(m, World())
    path = default_model.cache_path(m)
    record = json.loads(open(os.path.join(path, default_model.DONE)).read())
    assert record["recipe"]["task"] == "artifacts" and record["steps_done"] == 2
    assert record["recipe"]["reference_fraction"] == default_model.WARM_NUMBERS["artifacts"]["reference_fraction"]
    assert not os.path.exists(default_model.cache_path(arith))  # the arith entry was not built
    assert default_model.entry_problem(m) is None


@pytest.mark.slow  # warm-start builds: 26 s
def test_recipe_change_or_seed_gives_new_entry_and_same_seed_same_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path)
    assert default_model.cache_path(m) != default_model.cache_path(_cfg(tmp_path, warm_start_steps=3))
    assert default_model.cache_path(m) != default_model.cache_path(_cfg(tmp_path, seed=1))
    first, _ = _tiny_model(m)
    other = _cfg(tmp_path / "elsewhere")  # same recipe, another cache: rebuilt from scratch
    second, _ = _tiny_model(other)
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)


def test_warm_start_zero_steps_is_random_init(tmp_path):
    m = _cfg(tmp_path, warm_start_steps=0)
    assert warm_start.ensure(m, World()) is None
    model, _ = load_model(m, World())
    assert not (tmp_path / "cache").exists()
    assert model.config.num_hidden_layers == 1


def test_loading_an_unbuilt_entry_names_the_stage(tmp_path):
    with pytest.raises(RuntimeError, match="run the warm-start stage first"):
        load_model(_cfg(tmp_path), World())


@pytest.mark.slow  # warm-start build
def test_incomplete_entry_is_refused_and_rebuilt(tmp_path, monkeypatch, capsys):
    """An entry an older version published after an interrupted build (5 of 300 steps, accuracy 0)."""
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path)
    path = default_model.cache_path(m)
    os.makedirs(path)
    with open(os.path.join(path, default_model.DONE), "w") as fh:
        json.dump({"recipe": default_model.recipe(m), "accuracy": 0.0}, fh)
    with open(os.path.join(path, default_model.METRICS), "w") as fh:
        fh.write(json.dumps({"step": 1, "split": "train", "loss": 3.0}) + "\n")
    assert default_model.entry_problem(m) == "trained 1 of 2 steps"
    _tiny_model(m)
    assert "refusing the cache entry" in capsys.readouterr().out
    assert default_model.entry_problem(m) is None
    assert json.loads(open(os.path.join(path, default_model.DONE)).read())["steps_done"] == 2


def test_entry_below_its_floor_is_refused(tmp_path):
    m = _cfg(tmp_path)
    path = default_model.cache_path(m)
    os.makedirs(path)
    with open(os.path.join(path, default_model.DONE), "w") as fh:
        json.dump({"recipe": default_model.recipe(m), "steps_done": 2, "accuracy": 0.1}, fh)
    assert default_model.entry_problem(m) is None  # this recipe's floor is 0
    assert "below the floor 0.25" in default_model.entry_problem(dataclasses.replace(m, warm_start_min_accuracy=0.25))


@pytest.mark.slow  # warm-start build
def test_build_below_the_floor_publishes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path, warm_start_min_accuracy=1.01)  # unreachable
    with pytest.raises(warm_start.WarmStartError, match="below model.warm_start_min_accuracy"):
        warm_start.ensure(m, World())
    assert _entries(tmp_path) == []


def _entries(tmp_path):
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) if cache.exists() else []


def _train_cmd(tmp_path, out, *extra):
    from tests.conftest import tiny_overrides

    small = ["model=tiny", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
             "model.intermediate_size=64", "model.warm_start_batch_size=4", "model.warm_start_min_accuracy=0",
             f"model.cache_dir={tmp_path / 'cache'}", *extra]
    args = [a for a in tiny_overrides(out, "trainer.max_steps=1") if not a.startswith("model")]
    return [sys.executable, str(ROOT / "train.py"), *args, *small]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_build_publishes_nothing(tmp_path, subprocess_env, sig):
    """A stop signal during the first-time build: the run says so, exits non-zero, and leaves no
    entry behind (a later run builds it from scratch)."""
    proc = subprocess.Popen(_train_cmd(tmp_path, tmp_path / "run", "model.warm_start_steps=100000"),
                            env=subprocess_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    # inside the build's training loop: its first metrics line (the step-0 eval) has been written
    while not list((tmp_path / "cache").glob("tiny-*.tmp-*/metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 5, err[-3000:]
    assert "nothing was published" in err and "Traceback" not in err
    assert _entries(tmp_path) == []
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.slow
def test_two_processes_on_a_cold_cache_build_once(tmp_path, subprocess_env):
    procs = [subprocess.Popen(_train_cmd(tmp_path, tmp_path / f"run{i}", "model.warm_start_steps=30"),
                              env=subprocess_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    stdout = "".join(o for o, _ in outs)
    assert stdout.count("building the warm-started tiny model") == 1
    assert len(_entries(tmp_path)) == 1
    assert all((tmp_path / f"run{i}" / "final" / "config.json").exists() for i in range(2))


@pytest.mark.slow  # warm-start build
def test_a_killed_builders_temporary_directory_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "WARM_EVAL_EXAMPLES", 4)
    m = _cfg(tmp_path)
    stale = f"{default_model.cache_path(m)}.tmp-999999"  # left by a builder killed outright (SIGKILL)
    os.makedirs(os.path.join(stale, "final"))
    _tiny_model(m)
    assert not os.path.exists(stale) and default_model.entry_problem(m) is None
