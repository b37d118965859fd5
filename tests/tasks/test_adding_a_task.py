"""Adding a task is one new file and one registration (docs/adding-a-task.md): tests/tasks/copy_task.py,
registered here, runs as `data=copy` with its own keys validated, no YAML file needed."""
from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_config
from tests.tasks.copy_task import CopyConfig, CopyTask, register_copy_task


def _load(*overrides: str):
    from algorithms import config_schemas
    from trainer.config import load_config

    return load_config(["+algo=sft", "data=copy", *overrides], config_schemas())


def test_a_registered_task_composes_from_its_dataclass(monkeypatch):
    register_copy_task(monkeypatch)
    cfg = _load("data.length=6", "data.n_test=3")
    assert cfg.data == CopyConfig(length=6, n_test=3)
    task = cfg.data.build()
    assert isinstance(task, CopyTask) and len(task.test_examples()) == 3
    assert all(len(ex.answer) == 6 for ex in task.train_examples())


def test_a_registered_task_validates_its_own_keys(monkeypatch):
    from trainer.config import ConfigError

    register_copy_task(monkeypatch)
    with pytest.raises(ConfigError, match=r"^unknown key data.digits: data=copy has no key 'digits' \(its keys: name, "
                                          r"seed, .*length\)$"):
        _load("data.digits=2")  # arith's key
    with pytest.raises(ConfigError, match=r"^data.length=0 must be >= 1$"):
        _load("data.length=0")
    with pytest.raises(ConfigError, match=r"^data.max_length=-1 must be > 0"):  # the shared keys' checks apply too
        _load("data.max_length=-1")


def test_an_unregistered_task_is_unknown():
    from algorithms import config_schemas
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^data=copy: no such option \(available: arith, artifacts, chat, clm, multipath, "
                                          r"text\)$"):
        load_config(["+algo=sft", "data=copy"], config_schemas())


@pytest.mark.slow  # builds a session (torch, transformers) and trains 2 steps: seconds
def test_a_registered_task_trains_and_evaluates(tmp_path, monkeypatch):
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session

    register_copy_task(monkeypatch)
    out = tmp_path / "run"
    cfg = tiny_config(out, "data=copy", "data.n_test=4", "trainer.max_steps=2", "trainer.eval_every=2",
                      "trainer.eval_examples=4", "trainer.eval_max_new_tokens=12")
    session = build_session(cfg, World())
    try:
        assert fit(session) == "done"
    finally:
        session.tracker.close()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all(r["n"] == 4 and 0.0 <= r["accuracy"] <= 1.0 for r in evals)
