"""AugTree context-parallel replay over 2 ranks (torchrun, gloo) equals the flattened single-process
computation, for both modes (lanes: rotating prompt K/V; owners: queries to stationary prompt-K/V
owners), on the loss and every parameter gradient (summed over ranks). The worker
(tests/trainer/cp_worker.py) prints one JSON line per (case, mode) from rank 0; success is judged by
those lines, not by the launcher's exit alone."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from trainer.context_parallel import cp_layout

TOL = 1e-5


@pytest.mark.slow  # 2-rank torchrun: 19 s
def test_two_ranks_match_flattened(subprocess_env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer" / "cp_worker.py")]
    proc = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert len(rows) == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["mode"] for r in rows} == {"lanes", "owners"}
    for r in rows:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * max(1.0, abs(r["ref_loss"])), r
        assert r["max_rel_grad_err"] < TOL, r


def test_layout_every_rank_has_prompt_and_response():
    lay = cp_layout(10, [5, 1, 7, 2, 2], 3)
    assert lay.bounds == [(0, 3), (3, 6), (6, 10)]
    assert all(lay.local[r] for r in range(3))
    assert sorted(i for r in range(3) for i in lay.local[r]) == list(range(5))
    with pytest.raises(ValueError):
        cp_layout(10, [5], 2)


def test_import_registers_nothing():
    """The attention function is registered per call, not when the module is imported."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import trainer.context_parallel as cp

    assert not any(name.startswith(cp.ATTN_NAME) for name in ALL_ATTENTION_FUNCTIONS)
    assert not hasattr(cp, "_STATE")


@pytest.fixture
def one_rank_world(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_equals_flattened_and_restores_the_model(one_rank_world):
    """On one rank every mode is the flattened computation; the model's attention implementation
    and the attention registry are as before after each call, and after a failing call."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tests.trainer.cp_worker import TEMPERATURE, build_model, case, reference
    from trainer.context_parallel import ATTN_NAME, ContextParallel

    model = build_model()
    impl = model.config._attn_implementation
    registered = set(ALL_ATTENTION_FUNCTIONS)
    prompt, responses, weights = case(9, [4, 6])
    ref_loss, ref_grads = reference(model, prompt, responses, weights)
    for mode in ("lanes", "owners"):
        model.zero_grad()
        lps = ContextParallel(mode).logprobs(model, prompt, responses, temperature=TEMPERATURE)
        loss = sum(w * lp.sum() for w, lp in zip(weights, lps))
        loss.backward()
        assert abs(loss.item() - ref_loss) <= TOL * max(1.0, abs(ref_loss))
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad, ref_grads[n], rtol=TOL, atol=TOL * ref_grads[n].abs().max().item()), n
        assert model.config._attn_implementation == impl and set(ALL_ATTENTION_FUNCTIONS) == registered
    cp = ContextParallel("lanes")
    with pytest.raises(RuntimeError, match="boom"):
        with cp.attention(model, cp.layout(9, [4, 6])):
            assert model.config._attn_implementation.startswith(ATTN_NAME)
            raise RuntimeError("boom")
    assert model.config._attn_implementation == impl and set(ALL_ATTENTION_FUNCTIONS) == registered
    with pytest.raises(ValueError, match="mode=ring"):
        ContextParallel("ring")
