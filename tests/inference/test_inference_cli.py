"""`python -m inference DIR --prompt ...` on a saved tiny model with the local char tokenizer."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from models.tokenizer import build_char_tokenizer

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inference", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, make_model) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_model("qwen3").save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow  # python -m inference subprocess: 8.8 s
def test_cli_generates_and_matches_engine(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference import Engine, SamplingParams

    result = run_cli(str(model_dir), "--prompt", "12+7=", "--max-new-tokens", "12")
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    [out] = Engine(model).generate([tokenizer.encode("12+7=")], params)
    expected = tokenizer.decode(out.tokens, skip_special_tokens=True)
    assert result.stdout.rstrip("\n") == expected and expected


@pytest.mark.parametrize("flag", ["--adapter"])
def test_cli_unsupported_flags_exit_clearly(tmp_path, capsys, flag):
    from inference.__main__ import main

    assert main([str(tmp_path), "--prompt", "1+1=", flag, str(tmp_path)]) != 0
    assert "not supported yet" in capsys.readouterr().err
