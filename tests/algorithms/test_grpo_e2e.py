"""GRPO as a user runs it: `torchrun --nproc_per_node=2 train.py +algo=grpo` on CPU, plain and with
shared-prompt replay + HiLoRe activation management switched on."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides, torchrun_train

pytestmark = pytest.mark.slow  # torchrun with 2 ranks: 14-44 s per test in the baseline

GRPO = ["trainer.max_new_tokens=24", "trainer.max_steps=2", "trainer.batch_size=4", "trainer.micro_batch_size=4",
        "algo.num_generations=4"]


@pytest.mark.parametrize("extra", [
    [],
    ["trainer.prompt_sharing=true", "trainer.activations=hilore", "algo.loss_type=seq-mean-token-mean"],
], ids=["plain", "sharing-hilore"])
def test_torchrun_two_ranks_end_to_end(tmp_path, subprocess_env, extra):
    # a dense reward (the completion's length), so the random-init model's groups have spread and every
    # step trains (with the verifier's reward it scores 0 everywhere and every step is empty: skipped)
    out = tmp_path / "run"
    lines = torchrun_train(out, subprocess_env, *GRPO, *extra, "algo.reward_funcs=[tests.rewards:length_reward]",
                           algo="grpo")[:-1]
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    for x in train:
        assert {"rollout/reward", "grpo/frac_zero_std", "grpo/clip_low"} <= set(x)
        assert x["rollout/logprob_gap"] < 1e-3  # trainer log-probs == the engine's sampling log-probs
        assert x["train/skipped_steps"] == 0
    if extra:
        assert all("activations/recompute_units" in x for x in train)
    assert [x["step"] for x in lines if x["split"] == "eval"] == [0, 2]
    assert (out / "final" / "model.safetensors").exists()


def test_prompt_sharing_needs_grouped_rollouts(tmp_path, subprocess_env):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"),
                           *tiny_overrides(tmp_path / "run", "trainer.prompt_sharing=true", algo="sft")],
                          env=subprocess_env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "trainer.prompt_sharing=true: algo sft" in proc.stderr


def test_resume_on_two_ranks_continues_each_ranks_rollout_stream(tmp_path, subprocess_env):
    """4 steps in one go == 2 steps, stop, resume, 2 more: every rank's sampling generator is saved."""
    def run(out, steps):
        rows = torchrun_train(out, subprocess_env, *GRPO, f"trainer.max_steps={steps}", "trainer.save_every=2",
                              algo="grpo")
        return {x["step"]: (x["loss"], x["rollout/reward"], x["rollout/length"]) for x in rows if x["split"] == "train"}

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "parts", 2)
    resumed = run(tmp_path / "parts", 4)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-4, abs=1e-6)


@pytest.mark.slow  # one 2-rank torchrun run: ~30 s
def test_a_trl_style_reward_reading_a_column_on_two_ranks_with_dynamic_sampling(tmp_path, subprocess_env):
    """data=chat prompt-only rows with a `target` column; the reward function reads it (TRL's signature), runs on
    each rank's completions, and its mean is logged as rewards/NAME/mean."""
    import json

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {w}", "target": w}) + "\n"
                            for w in ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")))
    out = tmp_path / "run"
    lines = torchrun_train(out, subprocess_env, *GRPO, "data=chat", f"data.path={data}", "data.test_fraction=0.25",
                           "algo.reward_funcs=[tests.rewards:target_reward]", "algo.dynamic_sampling=true",
                           algo="grpo")
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    evals = [x for x in lines if x["split"] == "eval"]  # prompt-only rows: the greedy held-out reward is the figure
    assert evals and all("accuracy" not in x and x["reward"] > 0 for x in evals)
    for x in train:
        assert x["rewards/target_reward/mean"] > 0 and "rewards/target_reward/std" in x
        assert x["rollout/reward"] == pytest.approx(x["rewards/target_reward/mean"], rel=1e-5)
