"""benchmarks/lr_sweep.py's arithmetic, from hand-made result files (the runs are the benchmark's job): the two
best rates per algorithm, the rendered sweep and seed tables, and each algorithm's paired difference to SFT."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import lr_sweep as bench  # noqa: E402


def result(algo, lr, seed, outcomes, setting="arith", teacher_end=None, commit="abc1234"):
    final = outcomes.count("1") / len(outcomes)
    return {"setting": setting, "algo": algo, "lr": lr, "seed": seed, "steps": 300, "wall_s": 10.0, "before": 0.25,
            "final": final, "n": len(outcomes), "outcomes": outcomes, "curve": [(0, 0.25), (300, final)],
            "teacher_curve": [(0, 0.9), (300, teacher_end)] if teacher_end is not None else [],
            "teacher": None, "overrides": [], "command": f"torchrun ... +algo={algo} trainer.lr={lr:g}",
            "meta": {"commit": commit}}


def test_the_two_best_rates_are_the_highest_seed_0_finals_ties_to_the_lower_rate():
    rs = [result("opsd", 1e-4, 0, "1100"), result("opsd", 3e-4, 0, "1110"), result("opsd", 1e-3, 0, "1110"),
          result("opsd", 3e-3, 0, "1000"), result("opsd", 1e-5, 1, "1111"),  # seed 1 is no sweep run
          result("opsd", 3e-5, 0, "1111", setting="multipath")]  # another setting
    assert bench.best_lrs(rs, "arith", "opsd") == [3e-4, 1e-3]
    assert bench.best_lrs(rs, "arith", "opsd", k=1) == [3e-4]
    assert bench.best_lrs(rs, "multipath", "opsd") == [3e-5]
    assert bench.best_lrs(rs, "arith", "mass") == []


def test_the_tables_come_from_the_result_files(tmp_path):
    results = tmp_path / "lr_sweep"
    results.mkdir()
    runs = [result("sft", 1e-4, 0, "1100"), result("sft", 1e-3, 0, "1110"), result("sft", 1e-3, 1, "1111"),
            result("opsd", 1e-4, 0, "1000", teacher_end=0.75), result("opsd", 1e-3, 0, "0110", teacher_end=0.5),
            result("opsd", 1e-3, 1, "0100", teacher_end=0.5, commit="def5678")]
    for r in runs:
        (results / f"{r['setting']}-{r['algo']}-lr{r['lr']:g}-s{r['seed']}.json").write_text(json.dumps(r))
    text = bench.render(str(results))
    assert (tmp_path / "lr_sweep.md").read_text() == text
    assert "| sft | 0.500 | 0.750 | 0.001, 0.0001 |" in text  # sweep row, best two
    assert "| opsd | 0.250 (0.750) | 0.500 (0.500) | 0.001, 0.0001 |" in text  # teacher prompt in brackets
    # opsd at 1e-3 over seeds 0 and 1: 0.5 and 0.25, mean 0.375, sample std 0.177; both commits shown
    assert "| opsd | 0.001 | 2 | 0.375 ± 0.177 | 0.500, 0.250 | 0: 0.250, 300: 0.375 | 10 | abc1234, def5678 |" in text
    # opsd (1e-3, seeds 0 and 1) minus sft (1e-3, seeds 0 and 1), question by question over the seed means
    diff, lo, hi = bench.paired([[0, 1, 1, 0], [0, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]])
    assert diff == pytest.approx(((0 - 1) + (1 - 1) + (0.5 - 1) + (0 - 0.5)) / 4)
    assert f"| opsd | 0.001 / 0.001 | 2 | {diff:+.3f} | [{lo:+.3f}, {hi:+.3f}] |" in text
    assert (tmp_path / "lr_sweep_curves.png").stat().st_size > 0


def test_a_finished_run_is_skipped_only_for_the_same_overrides(tmp_path, monkeypatch):
    args = SimpleNamespace(keep=str(tmp_path / "keep"), results=str(tmp_path / "res"), steps=300, eval_every=50,
                           teacher_steps=300, extra=[])
    wanted = bench.portable(bench.overrides(args, "multipath", "distill", 3e-4, 0, "OUT", "<teacher>"))
    assert "data=multipath" in wanted and "algo.teacher_path=<teacher>" in wanted and "trainer.lr=0.0003" in wanted
    path = bench.record_path(args.results, "multipath", "distill", 3e-4, 0)
    (tmp_path / "res").mkdir()
    done = dict(result("distill", 3e-4, 0, "10", setting="multipath"), overrides=wanted)
    with open(path, "w") as fh:
        json.dump(done, fh)
    launched = []
    monkeypatch.setattr(bench, "train", lambda *a: launched.append(a) or (_ for _ in ()).throw(RuntimeError("ran")))
    assert bench.run(args, "multipath", "distill", 3e-4, 0, {}) == json.loads(json.dumps(done)) and not launched  # no teacher built either
    args.extra = ["trainer.eval_examples=8"]  # another run now: it launches (here: the teacher first)
    with pytest.raises(RuntimeError, match="ran"):
        bench.run(args, "multipath", "distill", 3e-4, 0, {})
    assert launched


def test_a_run_at_the_defaults_sets_no_rate_or_steps_and_has_its_own_table(tmp_path, monkeypatch):
    args = SimpleNamespace(keep=str(tmp_path / "keep"), results=str(tmp_path / "lr_sweep"), steps=300, eval_every=50,
                           teacher_steps=300, extra=[])
    argv = bench.default_overrides("arith", "mass", 2, "OUT")
    assert argv[:2] == ["+algo=mass", "seed=2"]
    assert not [a for a in argv if a.startswith(("trainer.lr=", "trainer.max_steps=", "trainer.eval_every="))]
    assert bench.record_path(args.results, "arith", "mass", None, 2).endswith("arith-mass-default-s2.json")
    lines = [{"split": "eval", "step": 0, "accuracy": 0.25, "n": 4, "outcomes": "1000", "teacher_accuracy": 0.9},
             {"split": "eval", "step": 200, "accuracy": 0.75, "n": 4, "outcomes": "1110", "teacher_accuracy": 0.8}]
    launched = []
    monkeypatch.setattr(bench, "train", lambda argv, out, ranks: launched.append(argv) or (12.0, lines))
    (tmp_path / "lr_sweep").mkdir()
    sweep = result("mass", 3e-4, 0, "1100")
    (tmp_path / "lr_sweep" / "arith-mass-lr0.0003-s0.json").write_text(json.dumps(sweep))
    first = bench.run(args, "arith", "mass", None, 2, {})
    assert launched == [bench.default_overrides("arith", "mass", 2, str(tmp_path / "keep" / "arith-mass-default-s2"))]
    assert (first["lr"], first["steps"], first["final"]) == (None, 200, 0.75)
    assert bench.run(args, "arith", "mass", None, 2, {})["final"] == 0.75 and len(launched) == 1  # reused
    lines[-1] = dict(lines[-1], accuracy=0.5, outcomes="1100")
    bench.run(args, "arith", "mass", None, 3, {})
    text = (tmp_path / "lr_sweep.md").read_text()
    assert "| mass | 0.0003 | 1 | 0.500 ± 0.000 |" in text  # the sweep table still holds only swept rates
    # two seeds at the defaults: 0.75 and 0.5 -> mean 0.625 [0.5, 0.75]; teacher prompt 0.8 both
    assert "| arith | mass | 200 | 2 | 0.625 [0.500, 0.750] | 0.750, 0.500 | 0: 0.250, 200: 0.625 | 0.800 |" in text
    assert bench.best_lrs(bench.load(args.results), "arith", "mass") == [3e-4]  # a default run is no swept rate
    assert "also sets" not in text  # no run carries --extra overrides


def test_the_extra_overrides_of_a_results_directory_are_named(tmp_path):
    args = SimpleNamespace(steps=300, eval_every=50, extra=["trainer.warmup_steps=50"])
    r = dict(result("opsd", 1e-3, 0, "1100"), overrides=bench.portable(bench.overrides(args, "arith", "opsd", 1e-3, 0, "O")))
    (tmp_path / "warmup50").mkdir()
    (tmp_path / "warmup50" / "arith-opsd-lr0.001-s0.json").write_text(json.dumps(r))
    assert "Every run here also sets `trainer.warmup_steps=50`." in bench.render(str(tmp_path / "warmup50"))
