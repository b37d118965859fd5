"""benchmarks/clm.py's RL runs as result files: one JSON per (setting, seed) with the held-out success and
compute of the run's final model and the overrides it ran with, the warm start's row beside them, the
table rendered from the files, and a rerun that reads the finished run back instead of training again."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_clm_rl_runs_are_result_files(tmp_path):
    results = tmp_path / "clm"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "clm.py"), "--steps", "2", "--seeds", "0", "--w-eff", "0.25",
           "--episodes", "4", "--skip-long", "--workers", "1", "--results", str(results), "--tag", "ds",
           "--runs-dir", str(tmp_path / "runs"), "--extra", "trainer.batch_size=2", "algo.dynamic_sampling=true",
           "algo.dynamic_max_rounds=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(results)) == ["w0.25-ds-s0.json", "warm-start.json"]
    run = json.load(open(results / "w0.25-ds-s0.json"))
    warm = json.load(open(results / "warm-start.json"))
    assert run["setting"] == "w0.25-ds" and run["seed"] == 0 and "algo.dynamic_sampling=true" in run["overrides"]
    assert 0.0 <= run["success"] <= 1.0 and run["compute"] > 0 and 0.0 <= warm["success"] <= 1.0
    assert 0.0 <= run["spread_share@first"] <= 1.0 and 0.0 <= run["spread_share@last"] <= 1.0
    # the final JSON line carries the same run the file holds
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rl_runs"] == [run]
    table = (tmp_path / "clm.md").read_text()
    assert f"| w0.25-ds | 1 | {run['success']:.3f} ± 0.000 |" in table
    assert f"Warm start (before RL): success {warm['success']:.3f}" in table
    mtime = os.path.getmtime(results / "w0.25-ds-s0.json")
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "done earlier" in again.stdout and os.path.getmtime(results / "w0.25-ds-s0.json") == mtime


@pytest.mark.slow
def test_slack_runs_have_their_own_warm_start_and_settings(tmp_path):
    results, cache = tmp_path / "clm", tmp_path / "cache"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "clm.py"), "--slack", "--slack-warm-steps", "2", "--cache-dir",
           str(cache), "--steps", "1", "--seeds", "0", "--w-eff", "0", "--episodes", "4", "--skip-long", "--workers",
           "1", "--results", str(results), "--runs-dir", str(tmp_path / "runs"), "--extra", "trainer.batch_size=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(results)) == ["slack-w0.0-s0.json", "slack-warm-start.json"]
    run = json.load(open(results / "slack-w0.0-s0.json"))
    assert run["setting"] == "slack-w0.0"
    assert {"data.budget_range=[200,400]", "data.fold_range=[0.3,0.95]"} <= set(run["overrides"])
    # the RL run started from the slack warm start, built once in the cache and published whole
    built = [d for d in os.listdir(cache) if d.startswith("clm-slack-")]
    assert len(built) == 1 and f"model.path={built[0]}" in run["overrides"]
    record = json.load(open(cache / built[0] / "slack_warm_start.json"))
    assert "trainer.max_steps=2" in record["overrides"] and "data.view=calls" in record["overrides"]
    policies = {r["policy"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["policies"]}
    # the oracle that folds as late as fits spends less than the one that folds past 0.3, both solving all
    late, early = policies["scripted, latest fold that fits"], policies["scripted, fold past 0.3"]
    assert late["success"] == early["success"] == 1.0 and late["compute"] < early["compute"]
    assert "Warm start of the slack episodes (before RL)" in (tmp_path / "clm.md").read_text()
