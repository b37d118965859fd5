"""benchmarks/self_distill.py's long setting, shrunk to a smoke run: random tiny models, 2 steps with an
eval after each, 2 seeds of OPSD and MASS on the multipath task. Checks what the long setting reports
(the curves per eval step over seeds, the teacher-prompt curve, the path diagnostics), the JSON and
PNG it writes, and that a rerun into the same directory reuses the finished runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

@pytest.mark.slow
def test_long_setting_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "self_distill.py"), "--long", "--random-init", "--steps", "2",
           "--eval-every", "1", "--seeds", "0,1", "--methods", "opsd,mass", "--settings", "multipath", "--batch", "4",
           "--micro", "4", "--eval-examples", "4", "--keep", str(tmp_path), "--results", str(tmp_path / "results"),
           "--extra", "trainer.max_new_tokens=24", "trainer.eval_max_new_tokens=24"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["steps"] == 2 and record["eval_every"] == 1 and record["seeds"] == [0, 1]
    rows = {row["method"]: row for row in record["table"]}
    assert set(rows) == {"opsd", "mass"}
    for row in rows.values():
        for key in ("accuracy", "teacher_accuracy", "path_differs"):
            curve = row["curves"][key]
            assert sorted(int(s) for s in curve) == [0, 1, 2], key  # mean, std over the 2 seeds per eval step
            assert all(len(v) == 2 and 0.0 <= v[0] <= 1.0 for v in curve.values())
        assert len(row["after_per_seed"]) == 2
        assert 0.0 <= row["paths/differs"] <= 1.0
        assert "paths/agree_full_on" in row or "paths/agree_full_off" in row
    assert "paths/kept_on" in rows["mass"] or "paths/kept_off" in rows["mass"]
    assert "curve multipath mass" in proc.stdout and "path diagnostics" in proc.stdout
    assert json.load(open(tmp_path / "self_distill.json")) == record
    png = tmp_path / "self_distill_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one result file per finished run, and the table rendered from them
    assert sorted(os.listdir(tmp_path / "results")) == [f"multipath-{m}-s{seed}.json" for m in ("mass", "opsd")
                                                        for seed in (0, 1)]
    table = (tmp_path / "results.md").read_text()  # rendered beside the results directory
    assert "| multipath | opsd | 2 |" in table and "| multipath | mass | 2 |" in table
    # a rerun reuses every finished run: same results, no run started again
    finished = sorted(p for p in os.listdir(tmp_path) if p.startswith("multipath-"))
    assert len(finished) == 4
    stamps = {p: os.path.getmtime(tmp_path / p / "wall_s") for p in finished}
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["table"] == record["table"]
    assert again.stdout.count("done earlier") == 4
    assert {p: os.path.getmtime(tmp_path / p / "wall_s") for p in finished} == stamps


def test_variants_are_methods_of_their_own():
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import self_distill as bench

    variants = bench.parse_variants(["mass-m67=mass:algo.mask_ratio=0.67,algo.num_views=8", "plain=opsd"])
    assert variants == {"mass-m67": ("mass", ["algo.mask_ratio=0.67", "algo.num_views=8"]), "plain": ("opsd", [])}
    args = argparse.Namespace(variants=variants, batch=16, micro=16, teacher_rollouts=3, group=8, random_init=True,
                              eval_every=25, steps=300, lr=None, eval_examples=200, extra=[])
    argv = bench.overrides("mass-m67", "multipath", 0, args, "OUT")
    assert argv[0] == "+algo=mass" and argv[-3:-1] == ["algo.mask_ratio=0.67", "algo.num_views=8"]
    assert "data=multipath" in argv and "trainer.eval_every=25" in argv
    assert argv[-1] == "trainer.lr=0.0003"  # the rate the run resolves to, written out: part of the run's identity
    assert bench.overrides("mass", "multipath", 0, args, "OUT") == argv[:-3] + argv[-1:]  # the plain method
    args.lr = 1e-4
    assert bench.overrides("mass", "multipath", 0, args, "OUT").count("trainer.lr=0.0001") == 1  # a set rate stays
    for bad in ("nolabel", "=mass:x=1", "label="):
        with pytest.raises(SystemExit, match="expected LABEL=ALGO"):
            bench.parse_variants([bad])


def test_long_table_is_rendered_from_the_result_files(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import self_distill as bench

    results = tmp_path / "self_distill"
    results.mkdir()

    def run(method, seed, curve, teacher):
        return {"method": method, "setting": "arith", "seed": seed, "before": curve[0][1], "after": curve[-1][1],
                "wall_s": 100.0, "tokens_per_s": 50.0, "curve": curve,
                "curves": {"accuracy": curve, "teacher_accuracy": teacher},
                "teacher_before": teacher[0][1], "teacher_after": teacher[-1][1], "overrides": ["+algo=" + method]}

    runs = [run("opsd", 0, [[0, 0.4], [25, 0.6], [50, 0.5]], [[0, 0.9], [25, 0.9], [50, 0.8]]),
            run("opsd", 1, [[0, 0.4], [25, 0.5], [50, 0.6]], [[0, 0.9], [25, 0.9], [50, 0.9]])]
    runs[1]["meta"] = {"commit": "abc1234", "date": "2026-12-01"}  # seed 0 was written before runs kept theirs
    for r in runs:
        (results / f"arith-{r['method']}-s{r['seed']}.json").write_text(json.dumps(r))
    text = bench.render(str(results))
    assert "- `abc1234` (2026-12-01): arith/opsd s1" in text  # each run's own commit, not the rendering's
    assert "- `unknown (written before runs kept their provenance)` (?): arith/opsd s0" in text
    # end 0.5 / 0.6: mean 0.55, std 0.0707; seed 0 ended 0.1 below its best (0.6 at step 25)
    assert "| arith | opsd | 2 | 0.400 | 0.550 ± 0.071 | 0.500 / 0.600 | 0.100 | 0.900 → 0.850 | 100 |" in text
    assert "| 25 | 0.550 ± 0.071 | 0.900 ± 0.000 |" in text
    assert (tmp_path / "self_distill.md").read_text() == text
