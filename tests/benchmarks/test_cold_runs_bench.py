"""benchmarks/cold_runs.py renders its table from the per-run result files (the runs themselves take
minutes each and are the benchmark's job, not the suite's)."""
from __future__ import annotations

import json
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import cold_runs  # noqa: E402


def test_the_table_is_rendered_from_the_result_files(tmp_path, monkeypatch):
    monkeypatch.setattr(cold_runs, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(cold_runs, "TABLE", tmp_path / "cold_runs.md")
    (tmp_path / "results").mkdir()
    machine = {"cores": 2, "cpu_capability": "AVX512", "python": "3.11.7", "date": "2026-12-05"}
    for algo, seconds, code in (("sft", 130.0, 0), ("clm", 1100.0, 0), ("qad", 50.0, 1)):
        (tmp_path / "results" / f"{algo}.json").write_text(json.dumps({
            "algo": algo, "seconds": seconds, "exit_code": code, "machine": machine, "summary": f"held-out {algo}",
            "default_model": ["installed the shipped default model for arith in /c/tiny-1 (built by its recipe, held-out "
                              "accuracy 0.450)"] if algo == "sft" else []}))
    cold_runs.render()
    rows = {line.split("|")[1].strip(): line for line in (tmp_path / "cold_runs.md").read_text().splitlines()
            if line.startswith("| `")}
    assert len(rows) == len(cold_runs.ALGOS)
    assert "2.2 min (done) | yes | shipped arith installed (held-out 0.450) | held-out sft" in rows["`sft`"]
    assert "18.3 min (done) | **no**" in rows["`clm`"] and "(exit code 1) | **no**" in rows["`qad`"]
    assert "not measured yet" in rows["`grpo`"]
