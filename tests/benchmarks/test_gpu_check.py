"""benchmarks/gpu_check.py, run here on the CPU over a tiny saved model: every section reports, the
low-bit op equals the exact CPU path, the Engine equals HF generate, each algorithm takes a bf16
autocast step, and every speculative composition equals its plain decoding."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from models.loading import random_qwen3
    from models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    path = tmp_path_factory.mktemp("tiny")
    random_qwen3(len(tok), hidden_size=64, num_layers=4, kv_heads=2, initializer_range=0.2).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_an_unknown_section_is_one_line(capsys):
    from benchmarks.gpu_check import main

    assert main(["--sections", "lowbit,warp"]) == 2
    assert capsys.readouterr().err == "error: --sections: unknown ['warp']; known: lowbit, engine, steps, compose\n"


@pytest.mark.slow  # every algorithm's training step and the compositions: ~15 s
def test_every_section_passes_on_the_cpu(tiny_dir, tmp_path, capsys):
    from algorithms import REGISTRY
    from benchmarks.gpu_check import main

    assert main(["--model", str(tiny_dir), "--device", "cpu", "--width", "256", "--new-tokens", "12",
                 "--repeats", "1", "--workdir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = report["sections"]
    assert all(v["rel_diff"] == 0.0 for k, v in s["lowbit"].items() if k != "int_mm_equal")  # the same CPU path
    assert s["engine"]["batch1"]["equal_rows"] == 1.0 and s["engine"]["batch32"]["equal_rows"] == 1.0
    assert set(s["steps"]) == set(REGISTRY)
    assert all(row.get("finite") for row in s["steps"].values()), s["steps"]
    spec = {k: v for k, v in s["compose"].items() if k.endswith("+seed")}
    assert len(spec) == 4 and all(v["equal_to_plain"] for v in spec.values()), s["compose"]
