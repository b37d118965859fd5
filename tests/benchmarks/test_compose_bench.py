"""benchmarks/compose.py end to end at toy size: the four training stages (SEED, QAD of it, a skipper
over each), every row served through the door, each speculative row equal to its plain row, and the
result files written whole."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # four short training runs and the timings: ~90 s
def test_compose_runs_every_row(tmp_path, capsys):
    from benchmarks.compose import ROWS, main

    out = tmp_path / "results"
    assert main(["--layers", "4", "--decoder-layers", "1", "--seed-steps", "2", "--qad-steps", "2", "--skip-steps", "2",
                 "--widen", "2", "--batches", "1", "3", "--new-tokens", "6", "--repeats", "1", "--eval-examples", "6",
                 "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = report["rows"]
    assert set(rows) == set(ROWS)
    assert all(rows[r]["equal_to_plain"] for r, (_, spec) in ROWS.items() if spec), rows
    assert rows["fp32"]["x_fp32_b1"] == 1.0 and all(rows[r]["tok_s_b3"] > 0 for r in ROWS)
    assert json.loads((out / "compose.json").read_text())["rows"] == rows
    table = (out / "compose.md").read_text()
    assert all(f"| {r} |" in table for r in ROWS) and not list(out.glob("*.tmp"))
    for export in ("qad", "qskip"):  # the drafter spec rode along the two exports that keep their base
        assert json.loads(open(f"{report['models'][export]}/serving.json").read())["drafter"] == "seed_drafter.json"
