"""benchmarks/grpo_curve.py shrunk to a smoke run on a random tiny model: the plain and dynamic-sampling
runs, then the plain run stretched to the dynamic run's sampled tokens; one result file per run, the
table rendered from them, and a rerun that starts nothing again."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_grpo_curve_smoke(tmp_path):
    results = tmp_path / "curve"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "grpo_curve.py"), "--random-init", "--seeds", "0", "--steps", "2",
           "--eval-every", "1", "--eval-examples", "4", "--prompts", "2", "--group", "4", "--workers", "1",
           "--keep", str(tmp_path / "runs"), "--results", str(results),
           "--extra", "trainer.max_new_tokens=16", "trainer.eval_max_new_tokens=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {m: json.load(open(results / f"arith-{m}-s0.json")) for m in ("grpo", "grpo-ds", "grpo-eqtok")}
    assert sorted(os.listdir(results)) == [f"arith-{m}-s0.json" for m in ("grpo-ds", "grpo-eqtok", "grpo")]
    for r in runs.values():  # the cumulative count at the last eval is the run's total
        assert r["generated_tokens"] > 0 and r["generated_curve"][-1][1] == r["generated_tokens"]
    # the stretched run's step count comes from the two 2-step runs' sampled tokens
    want = max(1, round(2 * runs["grpo-ds"]["generated_tokens"] / runs["grpo"]["generated_tokens"]))
    assert f"trainer.max_steps={want}" in runs["grpo-eqtok"]["overrides"]
    assert "algo.dynamic_sampling=true" in runs["grpo-ds"]["overrides"]
    assert not any("dynamic_sampling" in o for o in runs["grpo-eqtok"]["overrides"])
    table = (tmp_path / "curve.md").read_text()
    assert "| generated | wall s |" in table
    for m in ("grpo", "grpo-ds", "grpo-eqtok"):
        assert f"| arith | {m} | 1 |" in table
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done earlier") == 3
