"""benchmarks/distill.py's arithmetic, from hand-made result files (the runs themselves are the benchmark's job):
the best learning rate per row, the paired difference and its interval, and the rendered tables."""
from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import distill as bench  # noqa: E402


def result(row, lr, seed, outcomes, curve_end=None):
    final = sum(outcomes) / len(outcomes)
    return {"row": row, "algo": bench.row_algo(row)[0], "lr": lr, "seed": seed, "steps": 200, "eval_examples": len(outcomes),
            "outcomes": outcomes, "final": final, "curve": [(0, 0.5), (200, curve_end if curve_end is not None else final)],
            "teacher": {"steps": 300, "accuracy": 0.9, "command": "torchrun ... +algo=sft"} if "-t" in row else None,
            "command": f"torchrun ... {row} lr {lr}", "wall_s": 1.0}


def test_the_best_rate_is_the_highest_final_accuracy_ties_to_the_lower_rate():
    rs = [result("sft", 1e-4, 0, [1, 1, 0, 0]), result("sft", 1e-3, 0, [1, 1, 1, 0]),
          result("sft", 3e-3, 0, [1, 1, 1, 0]), result("sft", 1e-5, 1, [1, 1, 1, 1])]  # seed 1 is not the sweep
    assert bench.best_lr(rs, "sft") == 1e-3
    assert bench.best_lr(rs, "opsd") is None


def test_the_paired_difference_is_the_mean_over_questions_of_the_seed_means():
    a = [[1, 1, 0, 0], [1, 0, 0, 0]]  # per-question means over the two seeds: 1, .5, 0, 0
    b = [[0, 1, 0, 1], [0, 1, 0, 1]]  # 0, 1, 0, 1
    diff, lo, hi = bench.paired(a, b)
    assert diff == pytest.approx((1 - 0.5 + 0 - 1) / 4)  # -0.125
    assert lo <= diff <= hi and -1 <= lo and hi <= 1
    same, lo0, hi0 = bench.paired(a, a)
    assert same == 0 and lo0 == 0 and hi0 == 0  # identical outcomes: no spread at all


def test_the_tables_are_rendered_from_the_result_files(tmp_path):
    results = tmp_path / "distill"
    results.mkdir()
    files = [result("distill-t300", 1e-4, 0, [1, 1, 1, 0]), result("distill-t300", 3e-4, 0, [1, 0, 0, 0]),
             result("distill-t300", 1e-4, 1, [1, 1, 0, 0]), result("sft", 1e-4, 0, [1, 0, 1, 0]),
             result("sft", 1e-4, 1, [0, 0, 1, 0])]
    for i, r in enumerate(files):  # runs measured at two commits on two days
        r["meta"] = {"commit": "aaa111" if i < 3 else "bbb222", "date": "2026-12-0" + ("1" if i < 3 else "2")}
        (results / f"{r['row']}-lr{r['lr']:g}-s{r['seed']}.json").write_text(json.dumps(r))
    text = bench.render(str(results))
    # each run keeps its own provenance: the table names both commits and which runs each measured
    assert "- `aaa111` (2026-12-01): distill-t300 lr 0.0001 s0, distill-t300 lr 0.0001 s1, distill-t300 lr 0.0003 s0" in text
    assert "- `bbb222` (2026-12-02): sft lr 0.0001 s0, sft lr 0.0001 s1" in text
    assert (tmp_path / "distill.md").read_text() == text
    assert "| distill-t300 | 0.750 | 0.250 | 0.0001 |" in text  # the sweep: lr 1e-4 and 3e-4, best 1e-4
    assert "| distill-t300 | 0.0001 | 2 | 0.625 ± 0.177 | 0.750, 0.500 |" in text  # mean and sample std of seeds
    assert "| 0: 0.500, 200: 0.625 | 1 |" in text  # the curve's mean per eval step, the wall time per run
    diff, lo, hi = bench.paired([[1, 1, 1, 0], [1, 1, 0, 0]], [[1, 0, 1, 0], [0, 0, 1, 0]])
    assert f"| distill-t300 − sft | 2 | {diff:+.3f} | [{lo:+.3f}, {hi:+.3f}] |" in text


def test_a_best_rate_at_the_grids_edge_is_swept_one_step_further():
    grid = [result("sft", lr, 0, outcomes) for lr, outcomes in
            ((3e-5, [0, 0]), (1e-4, [1, 0]), (3e-4, [1, 0]), (1e-3, [1, 1]))]
    assert bench.edge_step(grid, "sft") == 3e-3  # best at the top: 1e-3 -> 3e-3
    assert bench.edge_step(grid + [result("sft", 3e-3, 0, [1, 0])], "sft") is None  # now inside
    low = [result("opsd", lr, 0, outcomes) for lr, outcomes in ((3e-5, [1, 1]), (1e-4, [1, 0]))]
    assert bench.edge_step(low, "opsd") == 1e-5  # best at the bottom: 3e-5 -> 1e-5
    assert bench.edge_step(low + [result("opsd", 1e-5, 0, [1, 0])], "opsd") is None
    assert bench.edge_step([result("x", 1e-4, 0, [1])], "x") is None  # one rate is no grid
