"""Every activation mode end to end through the loop, on padded batches, with and without prompt
sharing, for SFT and GRPO, on 1 rank (in process) and 2 ranks (torchrun).

`checkpoint` recomputes every block exactly, so its losses equal `none`'s; `hilore` compresses some
saved tensors, so its first loss (computed before any update) equals `none`'s and later ones stay
close. A training forward that built a KV cache used to crash every recompute on padded rows
(attention saw 2T keys for T queries)."""
from __future__ import annotations

import json
import os

import pytest

from tests.conftest import tiny_config, torchrun_train
from trainer.distributed import World
from trainer.loop import fit
from trainer.setup import build_session

pytestmark = pytest.mark.slow

GRPO = ["trainer.max_new_tokens=24", "trainer.max_steps=2", "trainer.batch_size=4", "trainer.micro_batch_size=4",
        "algo.num_generations=4", "trainer.resume=never",
        "algo.reward_funcs=[tests.rewards:length_reward]"]  # a dense reward: the random model's steps train
SFT = ["trainer.max_steps=2", "trainer.resume=never"]
CASES = {  # name -> (algo, overrides)
    "sft": ("sft", SFT),
    "grpo": ("grpo", GRPO),
    "grpo-sharing": ("grpo", [*GRPO, "trainer.prompt_sharing=true"]),
}


def _losses(out_dir) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if r["split"] == "train"]


def _run_in_process(out, algo, overrides, mode):
    session = build_session(tiny_config(out, *overrides, f"trainer.activations={mode}", algo=algo), World())
    assert fit(session) == "done"
    session.tracker.close()
    return session


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_mode_trains_on_padded_batches_one_rank(tmp_path, case):
    algo, overrides = CASES[case]
    reference = _run_in_process(tmp_path / "none", algo, overrides, "none")
    batch = reference.algo.make_batch(reference.stream.next_batch(), _ctx(reference))
    assert (batch.attention_mask == 0).any(), "the test needs padded rows"
    base = _losses(tmp_path / "none")
    for mode in ("checkpoint", "hilore"):
        session = _run_in_process(tmp_path / mode, algo, overrides, mode)
        assert session.activations is not None
        got = _losses(tmp_path / mode)
        assert len(got) == 2
        if mode == "checkpoint":
            assert got == pytest.approx(base, rel=1e-5, abs=1e-7)
        else:
            assert got[0] == pytest.approx(base[0], rel=1e-5, abs=1e-7)
            assert got[1] == pytest.approx(base[1], rel=0.05, abs=1e-4)


def _ctx(session):
    from trainer.loop import rollout_context

    return rollout_context(session)


@pytest.mark.parametrize("case,mode", [("sft", "checkpoint"), ("sft", "hilore"), ("grpo", "checkpoint"),
                                       ("grpo", "hilore"), ("grpo-sharing", "checkpoint")])
def test_modes_on_two_ranks(tmp_path, subprocess_env, case, mode):
    algo, overrides = CASES[case]
    lines = torchrun_train(tmp_path / "run", subprocess_env, *overrides, f"trainer.activations={mode}", algo=algo)
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    assert all("activations/recompute_units" in x for x in train)
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
