"""CLM as a user runs it: `torchrun --nproc_per_node=2 train.py +algo=clm` on CPU (random tiny model:
the mechanics, not the learning), and resume mid-run equal to an uninterrupted run."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides, torchrun_train

pytestmark = pytest.mark.slow

CLM = ["trainer.max_new_tokens=16", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.micro_batch_size=8",
       "algo.num_generations=2", "algo.max_calls=3", "data.n_train=16", "data.n_test=4", "trainer.eval_examples=4",
       "trainer.eval_max_new_tokens=16"]


def test_torchrun_two_ranks_end_to_end(tmp_path, subprocess_env):
    out = tmp_path / "run"
    lines = torchrun_train(out, subprocess_env, *CLM, "algo.reuse=suffix", "algo.reuse_min_span=8",
                           "algo.reuse_reforward=2", "algo.reuse_min_gain=4", algo="clm")[:-1]
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    for x in train:
        assert {"clm/success", "clm/compute", "clm/edits", "clm/context_tokens", "clm/overflow"} <= set(x)
        assert x["clm/compute"] > 0
        assert x["rollout/logprob_gap"] < 1e-3 or x["clm/relocated_tokens"] > 0
    assert [x["step"] for x in lines if x["split"] == "eval"] == [0, 2]
    assert (out / "final" / "model.safetensors").exists()


def test_resume_mid_run_equals_an_uninterrupted_run(tmp_path, subprocess_env):
    def run(out, steps):
        rows = torchrun_train(out, subprocess_env, *CLM, f"trainer.max_steps={steps}", "trainer.save_every=2",
                              algo="clm")
        return {x["step"]: (x["loss"], x["clm/compute"], x["clm/calls"], x["rollout/length"])
                for x in rows if x["split"] == "train"}

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "parts", 2)
    resumed = run(tmp_path / "parts", 4)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-4, abs=1e-6)


def test_deepspeed_is_refused_by_name(tmp_path, subprocess_env):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"),
                           *tiny_overrides(tmp_path / "run", "backend=deepspeed", "backend.zero_stage=1", algo="clm")],
                          env=subprocess_env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "backend=deepspeed: algo clm" in proc.stderr
