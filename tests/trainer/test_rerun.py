"""Rerunning a finished run says what it did, and a fresh start never appends to an old metrics.jsonl.

A 2-step run, then the same command again (train.py's `run`, in process): nothing trains, the line says
the run is complete at step 2 with its own before -> after figures read back from its metrics.jsonl (equal
to what the first run printed), and names the two ways to train again. Then `trainer.resume=never`: the
earlier metrics.jsonl is moved aside whole and the new one holds only the new run.
"""
from __future__ import annotations

import os

from tests.conftest import tiny_config
from train import accuracy_summary, run

ARGS = ("trainer.max_steps=2", "trainer.eval_every=1", "trainer.save_every=2")


def _metrics(out) -> str:
    return (out / "metrics.jsonl").read_text()


def test_a_rerun_of_a_finished_run_trains_nothing_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(tiny_config(out, *ARGS)) == 0
    first = capsys.readouterr().out
    summary = next(line for line in first.splitlines() if line.startswith("held-out accuracy"))
    before, files = _metrics(out), sorted(os.listdir(out / "checkpoints"))
    assert run(tiny_config(out, *ARGS)) == 0
    said = capsys.readouterr().out
    assert f"the run in {out} is already complete at step 2" in said and "nothing was trained" in said
    assert summary in said.splitlines()  # the first run's own figures, read back from its metrics
    assert "another output_dir=" in said and "trainer.resume=never" in said
    assert "done:" not in said  # no training, no export
    assert _metrics(out) == before and sorted(os.listdir(out / "checkpoints")) == files
    # more steps than the checkpoint holds: that is a resume, not a finished run
    assert run(tiny_config(out, "trainer.max_steps=3", "trainer.eval_every=1", "trainer.save_every=2")) == 0
    assert "resumed from" in capsys.readouterr().out


def test_accuracy_summary_without_evals():
    assert accuracy_summary([]) == "held-out accuracy: no evaluation ran"


def test_a_fresh_start_moves_the_old_metrics_aside(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(tiny_config(out, *ARGS)) == 0
    old = _metrics(out)
    capsys.readouterr()
    assert run(tiny_config(out, *ARGS, "trainer.resume=never")) == 0
    said = capsys.readouterr().out
    assert f"the earlier run's metrics.jsonl was moved to {out / 'metrics.jsonl'}.old-1" in said
    assert (out / "metrics.jsonl.old-1").read_text() == old
    steps = [line for line in _metrics(out).splitlines()]
    assert len(steps) == len(old.splitlines()) and _metrics(out).startswith('{"step": 0')  # only the new run
    assert run(tiny_config(out, *ARGS, "trainer.resume=never")) == 0
    assert (out / "metrics.jsonl.old-2").exists()  # never overwrites an earlier one either
