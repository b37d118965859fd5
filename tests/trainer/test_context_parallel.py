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
