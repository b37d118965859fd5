"""A separate teacher (`algo.teacher_path`) under FSDP2 and ZeRO-3 is sharded like the student: on 2 ranks
each keeps half its weights, its logits equal the whole teacher's, its greedy decoding (every rank taking
part, rows of different lengths per rank) equals the whole teacher's, and a 2-step distill run trains and
logs the teacher's held-out accuracy. DDP keeps it whole. The memory check counts a teacher by its size."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.loading import TinySpec, build_tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    model, tok = build_tiny(TinySpec(hidden_size=48, num_layers=2, num_heads=2, intermediate_size=96), seed=7)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run_worker(tmp_path, env, teacher_dir, *backend: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).with_name("teacher_shard_worker.py")), str(tmp_path / "run"), teacher_dir, *backend]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.mark.slow  # 2-rank torchrun, ~30 s each
@pytest.mark.parametrize("backend,sharded", [
    (["backend=fsdp"], True),
    (["backend=deepspeed", "backend.zero_stage=3"], True),
    (["backend=ddp"], False),
], ids=["fsdp", "zero3", "ddp"])
def test_the_teacher_is_sharded_like_the_student(tmp_path, subprocess_env, teacher_dir, backend, sharded):
    report = run_worker(tmp_path, subprocess_env, teacher_dir, *backend)
    assert report["sharded"] is sharded
    if sharded:  # half the weights per rank (FSDP pads each parameter's shards to equal size: a few bytes over)
        assert report["full_bytes"] / 2 <= report["rank_bytes"] <= report["full_bytes"] / 2 * 1.02
    else:
        assert report["rank_bytes"] == report["full_bytes"]
    assert report["logit_gap"] < 1e-4
    assert report["greedy_equal"] == [True, True]
    records = report["records"]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["distill/divergence"] >= 0 and r["grad_norm"] > 0 for r in train)
    assert all(0.0 <= r["distill/teacher_accuracy"] <= 1.0 for r in evals) and len(evals) == 2


def test_the_memory_check_counts_a_teacher_by_its_size(teacher_dir):
    """A teacher's share of the memory check is its parameter bytes over the student's (in its dtype)."""
    from algorithms.teacher import ModelTeacher
    from models.loading import load_pretrained

    student, _ = build_tiny(TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), seed=0)
    teacher = load_pretrained(teacher_dir)[0]
    ratio = sum(p.numel() for p in teacher.parameters()) / sum(p.numel() for p in student.parameters())
    assert ModelTeacher(teacher_dir, "float32").copies(student) == pytest.approx(ratio)
    assert ModelTeacher(teacher_dir, "bfloat16").copies(student) == pytest.approx(ratio / 2)
    assert ratio > 1.5  # the teacher is bigger: counting it as one student copy would undercount


@pytest.mark.slow  # peft's LoRA wrap and two loads: ~7 s
def test_a_peft_adapter_teacher_is_its_base_with_the_adapter_merged(tmp_path, teacher_dir):
    """teacher_path may name a PEFT adapter dir: the teacher is its base with the adapter merged in (its logits
    equal peft's own forward of base + adapter), and the memory check counts the base's size."""
    import torch
    from peft import LoraConfig, get_peft_model

    from algorithms.teacher import ModelTeacher
    from models.loading import load_pretrained

    base, tok = load_pretrained(teacher_dir)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    tok.save_pretrained(adapter)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        plain = load_pretrained(teacher_dir)[0](input_ids=ids).logits
    student, _ = build_tiny(TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), seed=0)
    teacher = ModelTeacher(str(adapter), "float32")
    with teacher.weights(student) as model, torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5) and not torch.allclose(got, plain, atol=1e-3)  # the adapter counts
    assert teacher.copies(student) == pytest.approx(ModelTeacher(teacher_dir, "float32").copies(student))
