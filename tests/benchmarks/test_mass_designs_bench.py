"""benchmarks/mass_designs.py renders its tables from the per-run result files (the runs are the
benchmark's job): one row per run, and the mean gain per data set, budget and design over the seeds."""
from __future__ import annotations

import json
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import mass_designs  # noqa: E402


def _run(name, before, after, t_before, t_after, last=200):
    return {"name": name, "command": f"torchrun ... {name}", "wall_s": 100.0,
            "evals": [{"step": 0, "accuracy": before, "teacher_accuracy": t_before},
                      {"step": last, "accuracy": after, "teacher_accuracy": t_after}]}


def test_tables_are_rendered_from_the_result_files(tmp_path, monkeypatch):
    monkeypatch.setattr(mass_designs, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(mass_designs, "TABLE", tmp_path / "table.md")
    (tmp_path / "results").mkdir()
    runs = [_run("multipath-opsd-s0", 0.14, 0.20, 0.7, 0.6), _run("multipath-opsd-s1", 0.14, 0.30, 0.7, 0.8),
            _run("multipath-mass-gate-s0", 0.14, 0.24, 0.7, 0.7),
            _run("arith-mass-gate-s0-lr1e-4", 0.45, 0.58, 0.905, 0.875, last=100)]
    for r in runs:
        (tmp_path / "results" / f"{r['name']}.json").write_text(json.dumps(r))
    mass_designs.render()
    text = (tmp_path / "table.md").read_text()
    assert "| multipath-opsd-s1 | 0.140 (0.700) |  | 200: 0.300 (0.800) |" in text
    assert "| arith-mass-gate-s0-lr1e-4 | 0.450 (0.905) | 0.580 (0.875) | 100: 0.580 (0.875) |" in text
    # opsd on multipath: gains 0.06 and 0.16 -> mean 0.11, std 0.0707; teacher -0.1 and +0.1 -> 0
    assert "| multipath | defaults | opsd | 2 | +0.110 ± 0.071 | +0.000 |" in text
    assert "| multipath | defaults | mass-gate | 1 | +0.100 ± 0.000 | +0.000 |" in text
    assert "| arith | lr1e-4 | mass-gate | 1 | +0.130 ± 0.000 | -0.030 |" in text
