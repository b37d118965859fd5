"""Nothing the project loads runs code from the file it reads.

- A source scan: the project's code never unpickles (no `pickle.load(s)`, no `torch.load` but the one in
  trainer/checkpoint.py::read_legacy, which is weights-only with an allowlist; no `weights_only=False`,
  no `np.load(..., allow_pickle=True)`).
- Export directories the runtime loads: a model or adapter whose weights are a crafted `.bin` pickle is
  refused with one line naming the directory, and the payload never runs (transformers and peft read
  `.bin` weights-only; models.loading turns the refusal into ModelDirError). Skippers, SEED drafters and
  quantized exports are JSON + safetensors only, read without pickle.
"""
from __future__ import annotations

import ast
import os
import shutil

import pytest
import torch

from tests.conftest import ROOT
from tests.trainer.ckpt_cases import Payload

SOURCES = ["train.py", "evaluate.py", "algorithms", "inference", "models", "tasks", "trainer", "benchmarks"]


def _python_files():
    for entry in SOURCES:
        path = ROOT / entry
        if path.is_file():
            yield path
        else:
            yield from sorted(path.rglob("*.py"))


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            yield node, name


def test_no_code_path_unpickles_anything_but_the_weights_only_legacy_reader():
    loads = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, name in _calls(tree):
            rel = f"{path.relative_to(ROOT)}:{node.lineno}"
            assert name not in ("pickle.load", "pickle.loads", "pickle.Unpickler", "marshal.loads", "dill.load"), rel
            for kw in node.keywords:
                if kw.arg == "weights_only":
                    assert not (isinstance(kw.value, ast.Constant) and kw.value.value is False), rel
                if kw.arg == "allow_pickle":
                    assert not (isinstance(kw.value, ast.Constant) and kw.value.value is True), rel
            if name == "torch.load":
                loads.append(rel)
    # the benchmark reloads gradients it wrote itself in the same run; everything else reads safetensors / JSON
    assert sorted(l.split(":")[0] for l in loads) == ["benchmarks/hilore_bench.py", "benchmarks/hilore_bench.py",
                                                "trainer/checkpoint.py"], loads


def _tiny_export(tmp_path):
    from models.loading import TinySpec, build_tiny

    model, tok = build_tiny(TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), 0)
    out = tmp_path / "export"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, out


def test_a_model_whose_weights_are_a_crafted_pickle_is_one_line(tmp_path):
    from models.loading import load_pretrained
    from models.model_dir import ModelDirError

    _, out = _tiny_export(tmp_path)
    marker = tmp_path / "ran"
    os.remove(out / "model.safetensors")
    torch.save({"model.embed_tokens.weight": Payload(str(marker))}, out / "pytorch_model.bin")
    with pytest.raises(ModelDirError) as info:
        load_pretrained(str(out))
    assert "\n" not in str(info.value) and str(out) in str(info.value) and "`io.open`" in str(info.value)
    assert not marker.exists()


@pytest.mark.slow  # a LoRA wrap and a python -m inference subprocess: ~8 s
def test_an_adapter_whose_weights_are_a_crafted_pickle_is_one_line(tmp_path, subprocess_env):
    import subprocess
    import sys

    from peft import LoraConfig, get_peft_model

    from models.loading import load_pretrained
    from models.model_dir import ModelDirError

    model, base = _tiny_export(tmp_path)
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    shutil.copy(base / "tokenizer.json", adapter / "tokenizer.json")
    shutil.copy(base / "tokenizer_config.json", adapter / "tokenizer_config.json")
    cfg = (adapter / "adapter_config.json").read_text().replace('"base_model_name_or_path": null',
                                                                 f'"base_model_name_or_path": "{base}"')
    (adapter / "adapter_config.json").write_text(cfg)
    marker = tmp_path / "ran"
    os.remove(adapter / "adapter_model.safetensors")
    torch.save({"w": Payload(str(marker))}, adapter / "adapter_model.bin")
    with pytest.raises(ModelDirError, match="a weights file is not plain data"):
        load_pretrained(str(adapter))
    proc = subprocess.run([sys.executable, "-m", "inference", str(base), "--adapter", str(adapter),
                           "--prompt", "q: 1+1?", "--max-new-tokens", "2"],
                          env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]  # the rest: transformers' progress bars
    assert proc.returncode == 2 and len(errors) == 1 and f"{adapter}: a weights file is not plain data" in errors[0], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
