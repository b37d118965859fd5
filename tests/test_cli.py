"""Entry points as a user runs them: train.py end to end, evaluate.py's JSON line, data errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow  # train.py / evaluate.py subprocesses: 14-23 s per test


def test_train_then_evaluate(tmp_path, subprocess_env):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *tiny_overrides(out, "trainer.max_steps=2")],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final" / "model.safetensors").exists() and (out / "metrics.jsonl").exists()
    ev = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), f"model.path={out / 'final'}", "data=arith",
                         "data.digits=2", "data.steps=1", "data.n_train=64", "data.n_test=8",
                         "trainer.eval_examples=8", "trainer.eval_max_new_tokens=30"],
                        env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["n"] == 8 and 0.0 <= result["accuracy"] <= 1.0


def test_malformed_row_names_file_and_row(tmp_path, subprocess_env):
    data = tmp_path / "train.jsonl"
    rows = [{"question": "1+1?", "solution": "1+1=2\n#### 2", "answer": "2"}, {"question": "2+2?"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "run"
    args = tiny_overrides(out, "data=text", f"data.path={data}", "data.test_fraction=0.5")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert str(data) in proc.stderr and "row 2" in proc.stderr, proc.stderr
    assert not out.exists()


def test_non_utf8_data_file_is_a_one_line_data_error(tmp_path, subprocess_env):
    data = tmp_path / "train.jsonl"
    data.write_bytes('{"question": "caf\xe9 1+1?", "solution": "1+1=2\\n#### 2"}\n'.encode("latin-1"))
    out = tmp_path / "run"
    args = tiny_overrides(out, "data=text", f"data.path={data}", "data.test_fraction=0.5")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"data error: {data}: not UTF-8 text (byte 0xe9 at offset 17); "
                                                "save the file as UTF-8"]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_an_exported_adapter_dir_is_a_model_path_everywhere(tmp_path, subprocess_env):
    """LoRA training exports a PEFT adapter; evaluate.py, train.py and the CLI take that directory as
    a model (its adapter_config.json names the base, loaded and merged through models.loading)."""
    from models.loading import TinySpec, build_tiny

    base = tmp_path / "base"
    model, tok = build_tiny(TinySpec(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128), seed=0)
    model.save_pretrained(base)
    tok.save_pretrained(base)
    lora = tmp_path / "lora"
    args = [a for a in tiny_overrides(lora, "trainer.max_steps=1", algo="opsd") if not a.startswith("model")]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "model=hf", f"model.path={base}",
                           "algo.lora_rank=4", "trainer.max_new_tokens=16"],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = lora / "final"
    assert (adapter / "adapter_config.json").exists() and not (adapter / "config.json").exists()
    readme = (adapter / "README.md").read_text()
    assert ".tmp" not in readme and f"python -m inference {base} --adapter" in readme
    ev = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), f"model.path={adapter}", "data=arith",
                         "data.digits=2", "data.steps=1", "data.n_train=64", "data.n_test=4",
                         "trainer.eval_examples=4", "trainer.eval_max_new_tokens=16"],
                        env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout.strip().splitlines()[-1])["n"] == 4
    more = [a for a in tiny_overrides(tmp_path / "more", "trainer.max_steps=1") if not a.startswith("model")]
    tr = subprocess.run([sys.executable, str(ROOT / "train.py"), *more, "model=hf", f"model.path={adapter}"],
                        env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert tr.returncode == 0, tr.stderr[-3000:]
    assert (tmp_path / "more" / "final" / "config.json").exists()  # continued from the merged weights
