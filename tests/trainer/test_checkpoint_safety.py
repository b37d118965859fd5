"""Checkpoints run no code when loaded, and a damaged one is one line.

For every file of a real checkpoint in turn: a crafted pickle in its place (bare, and in torch.save's zip
layout), a truncated copy and a missing file each end the resume in one CheckpointError line naming the
file, and the pickle's payload -- which creates a marker file when unpickled -- never runs. The same on 2
DDP ranks and on DeepSpeed ZeRO-2 under torchrun (tests/trainer/ckpt_worker.py). A checkpoint of the
earlier `torch.save` format still resumes exactly, and a tampered one of that format is refused.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, tiny_config, tiny_overrides
from tests.trainer.ckpt_cases import KINDS, Payload, broken_copy, state_files
from trainer import checkpoint
from trainer.checkpoint import CheckpointError
from trainer.distributed import World
from trainer.loop import fit
from trainer.setup import build_session
from trainer.state_io import read_state


def _train(out, *extra):
    session = build_session(tiny_config(out, *extra), World())
    fit(session)
    session.tracker.close()
    return session


def _losses(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A 2-step SFT run's step-2 checkpoint (single process)."""
    out = tmp_path_factory.mktemp("good") / "run"
    _train(out, "trainer.max_steps=2", "trainer.save_every=2")
    return out / "checkpoints" / "step_2"


def test_the_payload_is_live(tmp_path):
    """The crafted files would run code under a plain pickle load: the tests below can fail."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps({"state": Payload(str(marker))}))
    assert marker.exists()
    marker.unlink()
    torch.save({"state": Payload(str(marker))}, tmp_path / "f.pt")
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert marker.exists()


def test_a_checkpoint_is_json_and_safetensors_only(good):
    files = state_files(good)
    assert files == ["model.json", "model.safetensors", "optimizer.json", "optimizer.safetensors", "scheduler.json",
                     "trainer_state.json", "trainer_state.safetensors"]
    for name in files:  # none of them is a pickle (protocol 2+ starts with 0x80) or a torch zip (PK)
        head = (good / name).read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", name
    state = read_state(str(good), "trainer_state")
    assert state["step"] == 2 and len(state["rng"]) == 1 and set(state["rng"][0]) >= {"python", "numpy", "torch"}


@pytest.mark.slow  # 28 resumes: ~10 s
def test_every_broken_file_is_one_line_and_runs_nothing(good, tmp_path):
    marker = tmp_path / "payload-ran"
    for rel in state_files(good):
        for kind in KINDS:
            case = broken_copy(good, tmp_path / "case", rel, kind, str(marker))
            cfg = tiny_config(tmp_path / "resumed", "trainer.max_steps=3", f"trainer.resume={case}")
            with pytest.raises(CheckpointError) as info:
                build_session(cfg, World())
            message = str(info.value)
            assert "\n" not in message and str(case / rel) in message, (rel, kind, message)
            assert not marker.exists(), (rel, kind)
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists() or not _losses(tmp_path / "resumed")


def test_the_messages_say_what_is_wrong(good, tmp_path):
    marker = str(tmp_path / "ran")

    def error(rel, kind):
        case = broken_copy(good, tmp_path / "case", rel, kind, marker)
        with pytest.raises(CheckpointError) as info:
            checkpoint.load_checkpoint(str(case), _Untouched(), World())
        return str(info.value)

    assert error("trainer_state.json", "missing").endswith("trainer_state.json: missing")
    assert "not a JSON state file" in error("trainer_state.json", "pickle")
    assert "not a readable safetensors file" in error("trainer_state.safetensors", "torch_pickle")
    assert "not a JSON state file" in error("trainer_state.json", "truncated")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        checkpoint.load_checkpoint(str(tmp_path / "nothing"), _Untouched(), World())
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        checkpoint.load_checkpoint(str(tmp_path / "absent"), _Untouched(), World())
    assert not os.path.exists(marker)


class _Untouched:
    """A backend that must not be reached: the trainer state is checked before the backend reads."""

    def load(self, path):
        raise AssertionError("the backend was loaded from a checkpoint whose trainer state is broken")


def test_a_checkpoint_of_another_world_size_is_refused_before_the_backend(good, tmp_path):
    case = tmp_path / "case"
    shutil.copytree(good, case)
    state = read_state(str(case), "trainer_state")
    state["rng"] = state["rng"] * 2
    checkpoint.write_part(state, str(case), "trainer_state")
    with pytest.raises(CheckpointError, match="written by 2 ranks; this run has 1"):
        checkpoint.load_checkpoint(str(case), _Untouched(), World())


def test_a_checkpoint_of_another_model_is_one_line(good, tmp_path):
    cfg = tiny_config(tmp_path / "wider", "model.hidden_size=96", f"trainer.resume={good}")
    with pytest.raises(CheckpointError, match=r"model.json: does not fit this run's model \(RuntimeError"):
        build_session(cfg, World())


def _to_legacy(ckpt):
    """Rewrite a checkpoint in the earlier format: each part as NAME.pt written by torch.save."""
    for name in ("model", "optimizer", "scheduler", "trainer_state"):
        torch.save(read_state(str(ckpt), name), ckpt / f"{name}.pt")
        for f in (f"{name}.json", f"{name}.safetensors"):
            if (ckpt / f).exists():
                (ckpt / f).unlink()


@pytest.mark.slow  # three short runs: ~4 s
def test_a_checkpoint_of_the_earlier_format_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    _train(straight, "trainer.max_steps=4", "trainer.resume=never")
    split = tmp_path / "split"
    _train(split, "trainer.max_steps=4", "trainer.save_every=2")
    shutil.rmtree(split / "checkpoints" / "step_4")
    _to_legacy(split / "checkpoints" / "step_2")
    assert sorted(os.listdir(split / "checkpoints" / "step_2")) == [
        "COMPLETE", "model.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt"]
    session = _train(split, "trainer.max_steps=4", "trainer.save_every=2")
    assert session.step == 4
    a, b = _losses(straight), _losses(split)
    assert len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-6, (a, b)
    # the next checkpoint it wrote is in the new format
    assert "trainer_state.json" in os.listdir(split / "checkpoints" / "step_4")


def test_a_tampered_checkpoint_of_the_earlier_format_is_refused(good, tmp_path):
    marker = tmp_path / "ran"
    case = tmp_path / "case"
    shutil.copytree(good, case)
    _to_legacy(case)
    for name in ("model.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt"):
        saved = (case / name).read_bytes()
        torch.save({"state": Payload(str(marker))}, case / name)
        with pytest.raises(CheckpointError, match=rf"{name}: refused: not plain checkpoint data \(it asks to build "
                                                  r"or call `io.open`\)"):
            build_session(tiny_config(tmp_path / "r", f"trainer.resume={case}"), World())
        assert not marker.exists()
        (case / name).write_bytes(saved)


@pytest.mark.slow  # a train.py subprocess: ~6 s
def test_train_py_prints_one_line_and_exits_6(good, tmp_path, subprocess_env):
    marker = tmp_path / "ran"
    case = broken_copy(good, tmp_path / "case", "optimizer.json", "pickle", str(marker))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"),
                           *tiny_overrides(out, "trainer.max_steps=3", f"trainer.resume={case}")],
                          env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 6, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == [f"checkpoint error: {case / 'optimizer.json'}: not a JSON state file (damaged or replaced: "
                     f"{lines[0].split('(damaged or replaced: ', 1)[1]}"], proc.stderr
    assert not marker.exists()
    assert not list((out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else True


@pytest.mark.slow  # torchrun with 2 ranks: ~40 s each
@pytest.mark.parametrize("backend", [["backend=ddp"], ["backend=deepspeed", "backend.zero_stage=2"]],
                         ids=["ddp", "zero2"])
def test_two_ranks_refuse_every_broken_file_together(tmp_path, subprocess_env, backend):
    marker = tmp_path / "payload-ran"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "trainer" / "ckpt_worker.py"), str(tmp_path), str(marker), *backend]
    proc = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    rows = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert proc.returncode == 0 and rows, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = {r["file"] for r in rows}
    expected = {"trainer_state.json", "trainer_state.safetensors"} | (
        {f"deepspeed/{f}" for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    "zero_pp_rank_1_mp_rank_00_optim_states.pt")}
        if backend[0] == "backend=deepspeed" else
        {"model.json", "model.safetensors", "optimizer.json", "optimizer.safetensors", "scheduler.json"})
    assert files == expected
    for r in rows:  # both ranks raised, each with one line naming the broken file
        assert r["ranks"] == [0, 1], r
        for message in r["errors"]:
            assert "\n" not in message and r["file"] in message, r
    assert not marker.exists()
