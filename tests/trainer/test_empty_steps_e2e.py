"""An RL step with no reward spread anywhere trains nothing: under torchrun with 2 ranks, GRPO from a
random-init model (every reward 0, so every advantage is 0) logs `train/skipped_steps`, keeps its
learning rate where the schedule stood, and ends with exactly its starting weights, on DDP and on
DeepSpeed ZeRO-1 / ZeRO-3; a run resumed across empty steps counts them as the uninterrupted one."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, tiny_config, tiny_overrides

pytestmark = pytest.mark.slow  # 2-rank torchrun runs, ~25 s each
STEPS = ["trainer.max_steps=4", "trainer.save_every=2", "trainer.max_new_tokens=12", "algo.num_generations=4",
         "trainer.eval_every=1000"]


def _train(out, env, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           *tiny_overrides(out, *STEPS, *extra, algo="grpo")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    path = out / "metrics.jsonl"
    assert path.exists(), proc.stderr[-3000:]
    return proc, [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == "train"]


def _weights(path) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


@pytest.mark.parametrize("backend", [["backend=ddp"], ["backend=deepspeed", "backend.zero_stage=1"],
                                     ["backend=deepspeed", "backend.zero_stage=3"]], ids=["ddp", "zero1", "zero3"])
def test_a_run_with_every_reward_zero_skips_its_steps_and_keeps_its_weights(tmp_path, subprocess_env, backend):
    from trainer.distributed import World
    from trainer.setup import load_model

    out = tmp_path / "run"
    proc, records = _train(out, subprocess_env, *backend)
    assert (out / "final").exists(), proc.stderr[-3000:]
    assert all(r["rollout/reward"] == 0.0 for r in records)  # the premise: no reward anywhere
    assert [r["train/skipped_steps"] for r in records] == [1, 2, 3, 4]
    assert len({r["lr"] for r in records}) == 1  # the schedule never ticked
    start, _ = load_model(tiny_config(tmp_path / "x", algo="grpo").model, World())
    final = _weights(out / "final")
    assert all(torch.equal(final[k], v) for k, v in start.state_dict().items() if k in final)
    if backend == ["backend=ddp"]:  # resumed across the empty steps: the count goes on as before
        shutil.rmtree(out / "checkpoints" / "step_4")
        again, resumed = _train(out, subprocess_env, *backend)
        assert "at step 2" in again.stdout, again.stdout[-2000:]
        assert [r["train/skipped_steps"] for r in resumed] == [1, 2, 3, 4]
