"""The claim of +algo=distill on the shipped default model: distilling from a stronger teacher on the student's
own samples raises the student's held-out accuracy. The teacher is the default after 150 steps of +algo=sft (held
out ~0.79 vs the student's 0.45); the student distils from it for 50 steps on 2 ranks at lr 3e-4 (measured on
this machine: 0.450 -> 0.57 at step 50, docs/distill.md). n = 100 held-out questions, greedy."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["trainer.resume=never", "logging.wandb=false", "logging.progress=false", "trainer.eval_examples=100"]


def run(out: Path, env: dict, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           f"output_dir={out}", *COMMON, *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]


@pytest.mark.slow  # two 2-rank runs on the shipped default, ~2.5 min
def test_distilling_from_a_stronger_teacher_raises_held_out_accuracy(tmp_path, subprocess_env):
    teacher = run(tmp_path / "teacher", subprocess_env, "+algo=sft", "trainer.max_steps=150", "trainer.eval_every=150",
                  "trainer.save_every=150")
    student = run(tmp_path / "student", subprocess_env, "+algo=distill", f"algo.teacher_path={tmp_path}/teacher/final",
                  "trainer.lr=3e-4", "trainer.max_steps=50", "trainer.eval_every=50", "trainer.save_every=50")
    start, end = student[0]["accuracy"], student[-1]["accuracy"]
    assert teacher[-1]["accuracy"] > teacher[0]["accuracy"] + 0.15  # the teacher is the stronger model ...
    assert student[0]["distill/teacher_accuracy"] > start + 0.15  # ... and the student's eval says so
    assert end >= start + 0.05, (start, end)  # distillation moved the student toward it
