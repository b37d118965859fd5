"""CLM as a user runs it: `torchrun --nproc_per_node=2 train.py +algo=clm` on CPU (random tiny model:
the mechanics, not the learning), and resume mid-run equal to an uninterrupted run (2 ranks, from a model
SFT'd on an easy task file, so the steps have non-zero advantages, update the weights, and the trainer's
log-probs of the sampled tokens are checked against the sampler's)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, tiny_overrides, torchrun_train

pytestmark = pytest.mark.slow

CLM = ["trainer.max_new_tokens=16", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.micro_batch_size=8",
       "algo.num_generations=2", "algo.max_calls=3", "data.n_train=16", "data.n_test=4", "trainer.eval_examples=4",
       "trainer.eval_max_new_tokens=16"]


def test_torchrun_two_ranks_end_to_end(tmp_path, subprocess_env):
    out = tmp_path / "run"
    lines = torchrun_train(out, subprocess_env, *CLM, "algo.reuse=suffix", "algo.reuse_min_span=8",
                           "algo.reuse_reforward=2", "algo.reuse_min_gain=4", "algo.dynamic_sampling=true",
                           "algo.dynamic_max_rounds=2", "algo.dynamic_metric=success", "algo.retire_after=1",
                           "data.budget_range=[200,400]", "data.fold_range=[0.3,0.95]",  # episodes of varied budgets
                           algo="clm")[:-1]
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    # a random model never succeeds: no group has a signal, so both rounds run and the cap is reported
    assert all(x["rollout/generation_rounds"] == 2 and x["rollout/dynamic_cap_hit"] == 1 for x in train)
    # retire_after=1: every task played (2 rounds x 1 task x 2 ranks a step) failed once and is retired,
    # shared by both ranks; none comes back within the epoch, so none is skipped
    assert [x["rollout/retired_unsolved"] for x in train] == [4, 8]
    assert all(x["rollout/retired_solved"] == 0 and x["rollout/retired_skipped"] == 0 for x in train)
    for x in train:
        assert {"clm/success", "clm/compute", "clm/edits", "clm/context_tokens", "clm/overflow"} <= set(x)
        assert x["clm/compute"] > 0
    # no episode of a random model succeeds: every advantage is 0, so each step is empty and skipped whole
    assert [x["train/skipped_steps"] for x in train] == [1, 2]
    assert all(x["clm/skipped_micro_batches"] >= 1 and x["grad_norm"] == 0.0 for x in train)
    assert [x["step"] for x in lines if x["split"] == "eval"] == [0, 2]
    assert (out / "final" / "model.safetensors").exists()


# An episode a 2-layer model learns in 60 SFT steps (`next`, then `answer 7`), so sampled episodes succeed
# about 2 times in 3: groups mix successes and failures and the RL steps really update the weights.
EASY_EPISODE = {"prefix": "say the digit.\n\n", "observations": ["digit 7"], "query": "digit?", "answer": "7"}


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_resume_mid_run_equals_an_uninterrupted_run(tmp_path, subprocess_env, beta):
    """With `algo.beta` the resumed run must also restore the KL reference (the starting weights), not
    take the weights it resumes from as its reference."""
    import json
    import shutil

    from safetensors.torch import load_file

    from trainer import checkpoint

    episodes = tmp_path / "easy.jsonl"
    episodes.write_text("\n".join(json.dumps(EASY_EPISODE) for _ in range(10)) + "\n")
    data = [f"data.path={episodes}", "algo.max_calls=3", "trainer.max_new_tokens=16", "trainer.eval_max_new_tokens=16"]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *tiny_overrides(
        tmp_path / "sft", "data=clm", "data.view=calls", *data[:1], "trainer.max_steps=60", "trainer.batch_size=8",
        "trainer.micro_batch_size=8", "trainer.eval_max_new_tokens=16")], env=subprocess_env, capture_output=True,
        text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = tmp_path / "sft" / "final"

    out = tmp_path / "run"

    def run():
        rows = torchrun_train(out, subprocess_env, *data, f"model.path={start}", "trainer.max_steps=4",
                              "trainer.save_every=2", "trainer.batch_size=2", "trainer.micro_batch_size=8",
                              "algo.num_generations=4", "trainer.lr=1e-4", f"algo.beta={beta}", algo="clm")
        assert all(("clm/kl" in x) == (beta > 0) for x in rows if x["split"] == "train")
        # 2 ranks that really train: steps whose optimizer step ran, and on them the trainer's log-probs of
        # the sampled tokens equal the sampler's (up to relocated K/V, which suffix reuse may add)
        steps = [x for x in rows if x["split"] == "train"]
        trained = [x for x in steps if "rollout/logprob_gap" in x]
        assert trained and steps[-1].get("train/skipped_steps", 0) < len(steps)  # not every step skipped
        assert all(x["rollout/logprob_gap"] < 1e-3 or x.get("clm/relocated_tokens", 0) > 0 for x in trained), trained
        return {x["step"]: (x["loss"], x["clm/advantage_abs"], x["grad_norm"], x["clm/compute"], x["clm/calls"],
                            x["rollout/length"]) for x in rows if x["split"] == "train"}

    whole = run()
    whole_weights = load_file(out / "final" / "model.safetensors")
    # A stop after step 2: only what existed then is kept, and the same command runs again.
    for step, path in checkpoint.complete_checkpoints(str(out)):
        if step > 2:
            shutil.rmtree(path)
    metrics = out / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= 2))
    shutil.rmtree(out / "final")
    resumed = run()
    assert sorted(resumed) == [1, 2, 3, 4]
    assert any(whole[step][1] > 0 for step in (3, 4))  # the resumed steps have non-zero advantages
    for step in (3, 4):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-4, abs=1e-6)
    first = load_file(start / "model.safetensors")
    resumed_weights = load_file(out / "final" / "model.safetensors")
    assert any(not torch.equal(whole_weights[k], first[k]) for k in first)  # RL moved the weights
    for k in whole_weights:
        torch.testing.assert_close(resumed_weights[k], whole_weights[k], rtol=1e-5, atol=1e-6)


def test_deepspeed_is_refused_by_name(tmp_path, subprocess_env):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"),
                           *tiny_overrides(tmp_path / "run", "backend=deepspeed", "backend.zero_stage=1", algo="clm")],
                          env=subprocess_env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "backend=deepspeed: algo clm" in proc.stderr
