"""The self-distillation teacher's weights: the gated refresh swaps only when held-out accuracy gained
its margin, the drift from step 0 by hand, the teacher-prompt collapse warning, and (2 ranks) MASS
resumed across a refresh equals the uninterrupted run."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from algorithms.teacher import SelfTeacher
from selfdistill_helpers import tiny
from tests.conftest import ROOT, tiny_overrides


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_refresh_swaps_only_when_accuracy_gained_its_margin():
    policy, _ = tiny()
    start = [p.detach().clone() for p in policy.parameters()]
    teacher = SelfTeacher("refresh", 0.0, refresh_margin=0.05)
    with teacher.weights(policy) as t:  # the first step takes the frozen copy
        assert t is not policy and _same(t, policy)
    teacher.after_eval({"accuracy": 0.40}, policy)  # the step-0 eval sets the bar
    _bump(policy, 0.01)
    for acc in (0.44, 0.30):  # +0.04 < margin, then worse: the step-0 weights stay
        teacher.after_eval({"accuracy": acc}, policy)
        assert all(torch.equal(p, s) for p, s in zip(teacher.copy.parameters(), start)) and teacher.refreshes == 0
    metrics, _ = teacher.after_eval({"accuracy": 0.45}, policy)  # +0.05: the current weights become the teacher
    assert _same(teacher.copy, policy) and metrics["teacher_refreshes"] == 1 and teacher.baseline == 0.45
    _bump(policy, 0.01)
    teacher.after_eval({"accuracy": 0.49}, policy)  # the bar moved to 0.45 + 0.05
    assert not _same(teacher.copy, policy) and teacher.refreshes == 1
    restored = SelfTeacher("refresh", 0.0, refresh_margin=0.05)
    restored.load_state_dict(teacher.state_dict())
    with restored.weights(policy) as t:
        assert all(torch.equal(a, b) for a, b in zip(t.parameters(), teacher.copy.parameters()))
    assert restored.baseline == 0.45 and restored.refreshes == 1


def test_fixed_teacher_never_moves_and_the_drift_is_hand_computed():
    policy, _ = tiny()
    fixed = SelfTeacher("fixed", 0.0)
    with fixed.weights(policy):
        pass
    _bump(policy, 0.5)
    fixed.after_eval({"accuracy": 0.9}, policy)
    assert fixed.drift(policy) == 0.0 and not _same(fixed.copy, policy)
    policy, _ = tiny()
    current = SelfTeacher("current", 0.0)
    with current.weights(policy):
        pass
    origin = [p.detach().clone() for p in policy.parameters()]
    _bump(policy, 0.1)
    n = sum(p.numel() for p in origin)
    expected = math.sqrt(n * 0.01 / sum(float(p.pow(2).sum()) for p in origin))
    metrics, _ = current.after_eval({"accuracy": 0.1}, policy)
    assert math.isclose(metrics["teacher_drift"], expected, rel_tol=1e-4)


def test_teacher_prompt_collapse_warns_past_the_margin():
    policy, _ = tiny()
    teacher = SelfTeacher("current", 0.0, warn_drop=0.05)
    assert teacher.after_eval({"accuracy": 0.4, "teacher_accuracy": 0.90}, policy)[1] == []
    assert teacher.after_eval({"accuracy": 0.4, "teacher_accuracy": 0.86}, policy)[1] == []  # 0.04: within
    notes = teacher.after_eval({"accuracy": 0.4, "teacher_accuracy": 0.60}, policy)[1]
    assert len(notes) == 1 and "0.600" in notes[0] and "0.300 below" in notes[0]


@pytest.mark.slow  # the shipped default model, 4 steps at a learning rate that wrecks it: ~20 s
def test_collapse_warning_fires_in_a_run_that_collapses(tmp_path, capsys):
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session
    from trainer.warm_start import ensure

    overrides = [o for o in tiny_overrides(tmp_path / "run", algo="opsd") if not o.startswith("model")]
    cfg = load_config([*overrides, "model=tiny", "algo.teacher=current", "trainer.lr=0.05", "trainer.warmup_steps=0",
                       "trainer.max_steps=4", "trainer.eval_every=4", "trainer.eval_examples=24",
                       "data.steps=2", "trainer.max_new_tokens=48"], config_schemas())
    ensure(cfg.model, World())  # the shipped default model into its cache entry, as train.py's warm-start stage
    session = build_session(cfg, World())
    fit(session)
    session.tracker.close()
    evals = [r for r in session.evals if "teacher_accuracy" in r]
    first, last = evals[0]["teacher_accuracy"], evals[-1]["teacher_accuracy"]
    err = capsys.readouterr().err
    assert first - last > 0.05, (first, last)  # the forced collapse happened
    assert err.count("teacher prompt accuracy") == 1 and f"{last:.3f}" in err


def _mass_run(out, env, *extra):
    args = tiny_overrides(out, "trainer.max_steps=4", "trainer.save_every=2", "trainer.eval_every=2",
                          "algo.teacher=refresh", "algo.teacher_refresh_margin=0", "trainer.max_new_tokens=16",
                          *extra, algo="mass")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    path = out / "metrics.jsonl"
    assert path.exists(), proc.stderr[-3000:]
    return proc, [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # three 2-rank torchrun runs: ~90 s
def test_mass_resumed_across_a_refresh_on_two_ranks_equals_the_uninterrupted_run(tmp_path, subprocess_env):
    straight = tmp_path / "straight"
    _, a = _mass_run(straight, subprocess_env, "trainer.resume=never")
    split = tmp_path / "split"
    _mass_run(split, subprocess_env)
    shutil.rmtree(split / "checkpoints" / "step_4")  # as if stopped right after step 2's save
    resumed, b = _mass_run(split, subprocess_env)
    assert "at step 2" in resumed.stdout, resumed.stdout[-2000:]
    evals = [r for r in a if r["split"] == "eval"]
    assert [r["teacher_refreshes"] for r in evals] == [0, 1, 2]  # margin 0: every later eval swaps the teacher
    train_a, train_b = [r for r in a if r["split"] == "train"], [r for r in b if r["split"] == "train"]
    assert [r["step"] for r in train_b] == [1, 2, 3, 4]
    for ra, rb in zip(train_a, train_b):  # same masks on each rank, same teacher, same influence scores
        for key in ("loss", "grad_norm", "mass/kept_fraction", "mass/mask_focus", "mass/masked_share"):
            assert abs(ra[key] - rb[key]) < 1e-6, (key, ra[key], rb[key])
