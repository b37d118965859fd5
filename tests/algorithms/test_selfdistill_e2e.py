"""OPSD, MASS and TESD as a user runs them: `torchrun --nproc_per_node=2 train.py +algo=NAME` on CPU,
and clear failures for data without reference solutions."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides, torchrun_train

pytestmark = pytest.mark.slow  # torchrun with 2 ranks / train.py subprocesses: 17-32 s per test

ROLLOUT = ["trainer.max_new_tokens=24", "trainer.max_steps=2"]


@pytest.mark.parametrize("algo,extra,metric", [
    ("opsd", ["algo.is_clip=2.0", "algo.truncate_below=0.3"], "opsd/truncated"),
    ("mass", ["algo.num_views=2", "algo.skip_first_tokens=2", "algo.is_clip=2.0"], "mass/is_ratio"),
    ("mass", ["algo.num_views=3", "algo.full_view=false", "algo.aggregate=confident", "algo.confidence_temperature=0.5"],
     "mass/kept_fraction"),
    ("mass", ["algo.num_views=3", "algo.full_view=true", "algo.aggregate=backed", "algo.teacher=ema"],
     "mass/kept_fraction"),
    ("tesd", ["algo.teacher_rollouts=2", "trainer.batch_size=4", "trainer.micro_batch_size=3", "algo.teacher_top_k=5",
              "algo.top_k_tail=true", "algo.is_clip=2.0"], "tesd/is_clipped"),
    ("tesd", ["algo.teacher_rollouts=2", "trainer.batch_size=4", "algo.dynamic_sampling=true", "algo.dynamic_max_rounds=2",
              "algo.dynamic_metric=reward", "algo.retire_after=1"], "rollout/retired_unsolved"),
])
def test_torchrun_two_ranks_end_to_end(tmp_path, subprocess_env, algo, extra, metric):
    out = tmp_path / "run"
    lines = torchrun_train(out, subprocess_env, *ROLLOUT, *extra, algo=algo)
    stdout = lines.pop()["text"]
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    assert all(metric in x and "rollout/reward" in x for x in train)
    assert all(x["rollout/logprob_gap"] < 1e-3 for x in train)  # DDP trainer == engine sampler
    for x in train:  # is_clip: the fp32 sampler is the trained policy, so the ratio is 1 and the cap never binds
        assert all(abs(v - 1) < 1e-3 for k, v in x.items() if k.endswith("/is_ratio"))
        assert all(v == 0 for k, v in x.items() if k.endswith("/is_clipped"))
    evals = [x for x in lines if x["split"] == "eval"]
    assert [x["step"] for x in evals] == [0, 2]  # before and after
    assert all("accuracy" in x and "teacher_accuracy" in x for x in evals)  # student and teacher prompts
    assert "held-out accuracy (n=8): step 0" in stdout
    assert (out / "final" / "model.safetensors").exists()


def test_dataset_without_reference_solutions_fails_naming_the_field(tmp_path, subprocess_env):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) for i in range(8)) + "\n")
    out = tmp_path / "run"
    args = tiny_overrides(out, "data=text", f"data.path={data}", "data.test_fraction=0.25", algo="mass")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "'solution'" in proc.stderr, proc.stderr
    assert not (out / "checkpoints").exists()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "data.solution_field=null"],
                          env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "data.solution_field" in proc.stderr, proc.stderr
