"""torchrun with 2 ranks on CPU (gloo) matches 1 process with the same global batch, for DDP,
FSDP2 and DeepSpeed ZeRO-1/2/3; and resuming a sharded run matches an uninterrupted one.

Success is judged by what each run wrote (metrics.jsonl, checkpoints, final/), not by the
launcher's exit alone, so a worker dying at exit after its work cannot flake these tests.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides
from trainer import checkpoint

STEPS = 4
PARITY_TOL = 1e-4  # fp32; only the reduction order differs between 1 and 2 ranks
pytestmark = pytest.mark.slow


def _train(out, env, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    args = tiny_overrides(out, f"trainer.max_steps={STEPS}", "trainer.save_every=2", *extra)
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _losses(out, proc) -> list[float]:
    path = out / "metrics.jsonl"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(losses) == STEPS and (out / "final" / "config.json").exists(), proc.stderr[-3000:]
    return losses


def _outcomes(out) -> list[str]:
    """Each eval's per-question outcomes; each string's share of "1" is that eval's accuracy."""
    evals = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in l]
    for e in evals:
        assert len(e["outcomes"]) == e["n"] and set(e["outcomes"]) <= {"0", "1"}
        assert e["outcomes"].count("1") / e["n"] == pytest.approx(e["accuracy"])
    return [e["outcomes"] for e in evals]


class Single(list):
    """The one-process run's training losses, and its evals' per-question outcomes."""

    def __init__(self, losses: list[float], outcomes: list[str]):
        super().__init__(losses)
        self.outcomes = outcomes


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory):
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    out = tmp_path_factory.mktemp("single") / "run"
    losses = _losses(out, _train(out, env, 1, "backend=single"))
    return Single(losses, _outcomes(out))


BACKENDS = [["backend=ddp"], ["backend=fsdp"]] + [
    ["backend=deepspeed", f"backend.zero_stage={z}"] for z in (1, 2, 3)
]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: "-".join(x.split("=")[1] for x in b))
def test_two_ranks_match_one(tmp_path, subprocess_env, single_losses, backend):
    out = tmp_path / "run"
    losses = _losses(out, _train(out, subprocess_env, 2, *backend))
    assert max(abs(a - b) for a, b in zip(losses, single_losses)) < PARITY_TOL, (losses, single_losses)
    # each rank decodes every other question; merged back, the outcomes are one process's, question by question
    assert _outcomes(out) == single_losses.outcomes


@pytest.mark.parametrize("backend", [["backend=fsdp"], ["backend=deepspeed", "backend.zero_stage=3"]],
                         ids=["fsdp", "zero3"])
def test_sharded_resume_matches_uninterrupted(tmp_path, subprocess_env, single_losses, backend):
    out = tmp_path / "run"
    _losses(out, _train(out, subprocess_env, 2, *backend))
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS}")  # as if stopped right after step 2's save
    assert checkpoint.latest_checkpoint(str(out)).endswith("step_2")
    resumed = _train(out, subprocess_env, 2, *backend)
    assert "at step 2" in resumed.stdout, resumed.stdout[-2000:]  # it resumed rather than restarted
    losses = _losses(out, resumed)
    assert max(abs(a - b) for a, b in zip(losses, single_losses)) < PARITY_TOL, (losses, single_losses)


def test_a_rerun_of_a_finished_two_rank_run_trains_nothing_on_either_rank(tmp_path, subprocess_env):
    """torchrun rerun of a finished DDP run: rank 0 says the run is complete, both ranks leave with exit 0,
    nothing is appended or written."""
    out = tmp_path / "run"
    _losses(out, _train(out, subprocess_env, 2, "backend=ddp"))
    before = (out / "metrics.jsonl").read_text()
    again = _train(out, subprocess_env, 2, "backend=ddp")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(f"is already complete at step {STEPS}") == 1, again.stdout[-3000:]
    assert "done:" not in again.stdout and (out / "metrics.jsonl").read_text() == before


def test_warm_start_built_by_rank0_and_shared(tmp_path, subprocess_env):
    """model=tiny under torchrun: rank 0 builds the cache entry while rank 1 waits, then both load it."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    small = ["model=tiny", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
             "model.intermediate_size=64", "model.warm_start_steps=2", "model.warm_start_batch_size=4",
             "model.warm_start_min_accuracy=0",
             f"model.cache_dir={cache}"]
    args = [a for a in tiny_overrides(out, "trainer.max_steps=2", "backend=ddp") if not a.startswith("model")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *args, *small]
    proc = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    entries = [p for p in cache.iterdir() if p.name.startswith("tiny-")]
    assert len(entries) == 1 and (entries[0] / "warm_start.json").exists(), proc.stderr[-3000:]
    assert proc.stdout.count("building the warm-started tiny model") == 1
    assert (out / "final" / "config.json").exists(), proc.stderr[-3000:]
