"""benchmarks/real_selfdistill.py: what each method's train.py run is given (no model is loaded)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import real_selfdistill as rs  # noqa: E402


def args(**kw):
    base = dict(batch=8, prompts=4, group=4, lr=None, grpo=rs.GRPO, stabilisers=rs.STABILISERS)
    return SimpleNamespace(**{**base, **kw})


def test_grpo_runs_prompts_times_group_with_its_own_overrides():
    argv = rs.method_run(args(grpo="algo.reward_mode=steps,algo.dynamic_sampling=true"), "grpo", 1, "SFT")
    assert argv[:6] == ["+algo=grpo", "model.path=SFT", "seed=1", "trainer.batch_size=4", "algo.num_generations=4",
                        "trainer.micro_batch_size=8"]
    assert argv[6:] == ["algo.reward_mode=steps", "algo.dynamic_sampling=true"]
    assert not any(a.startswith("algo.skip_first_tokens") for a in argv)  # the self-distillation stabilisers stay out
    assert rs.GRPO == "algo.reward_mode=steps"


def test_self_distillation_keeps_its_stabilisers_and_sft_has_none():
    opsd = rs.method_run(args(lr=2e-5), "opsd", 0, "SFT")
    assert "trainer.batch_size=8" in opsd and "trainer.lr=2e-05" in opsd
    assert opsd[-3:] == rs.STABILISERS.split(",")
    sft = rs.method_run(args(), "sft", 0, "SFT")
    assert sft == ["+algo=sft", "model.path=SFT", "seed=0", "trainer.batch_size=8", "trainer.micro_batch_size=8"]
