"""`python -m inference DIR --prompt ...` on a saved tiny model with the local char tokenizer."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.tokenizer import build_char_tokenizer

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inference", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


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


def test_cli_rejects_a_dir_that_is_not_an_adapter(tmp_path, capsys):
    from inference.__main__ import main

    assert main([str(tmp_path), "--prompt", "1+1=", "--adapter", str(tmp_path)]) != 0
    assert "adapter_config.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def no_tokenizer_dir(tmp_path_factory, make_model) -> Path:
    path = tmp_path_factory.mktemp("no_tokenizer")
    make_model("qwen3").save_pretrained(path)
    return path


@pytest.mark.parametrize("case", ["missing dir", "no tokenizer", "empty prompt", "zero new tokens", "missing drafter"])
def test_cli_bad_requests_are_one_usage_line_naming_the_input(tmp_path, capsys, model_dir, no_tokenizer_dir, case):
    from inference.__main__ import EXIT_USAGE, main

    missing = str(tmp_path / "no" / "such" / "model")
    args, named = {
        "missing dir": ([missing, "--prompt", "1+1="], f"model dir: {missing} does not exist"),
        "no tokenizer": ([str(no_tokenizer_dir), "--prompt", "1+1="], f"model dir: {no_tokenizer_dir} has no tokenizer"),
        "empty prompt": ([str(model_dir), "--prompt", ""], "--prompt is empty"),
        "zero new tokens": ([str(model_dir), "--prompt", "1+1=", "--max-new-tokens", "0"],
                            "--max-new-tokens must be >= 1, got 0"),
        "missing drafter": ([str(model_dir), "--prompt", "1+1=", "--drafter", missing],
                            f"--drafter: {missing} does not exist"),
    }[case]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and err.count("\n") == 1, err


def test_loading_a_dir_without_a_tokenizer_names_it(no_tokenizer_dir, tmp_path):
    """models.loading refuses before any loader runs (the CLI turns this into its usage line)."""
    from models.loading import load_pretrained
    from models.model_dir import ModelDirError

    with pytest.raises(ModelDirError, match=f"^{no_tokenizer_dir} has no tokenizer"):
        load_pretrained(str(no_tokenizer_dir))
    with pytest.raises(ModelDirError, match=f"^{tmp_path / 'gone'} does not exist$"):
        load_pretrained(str(tmp_path / "gone"))


@pytest.mark.slow  # python -m inference subprocess: ~4 s
def test_cli_missing_dir_is_one_line_and_exit_2(tmp_path):
    missing = str(tmp_path / "nothing" / "here")
    result = run_cli(missing, "--prompt", "1+1=")
    assert result.returncode == 2 and result.stderr == f"error: model dir: {missing} does not exist\n", result.stderr


# ----------------------------------------------------------------------------- LoRA adapters


PROMPT = "12+7="
NEW = 12


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, model_dir) -> Path:
    """A LoRA adapter on the saved base with random (non-zero) A and B, saved like export_model
    does: adapter + tokenizer; adapter_config.json names the base dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def engine_text(model, tokenizer) -> str:
    from inference import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    [out] = Engine(model).generate([tokenizer.encode(PROMPT)], params)
    return tokenizer.decode(out.tokens, skip_special_tokens=True)


def cli_text(capsys, *args: str) -> str:
    """stdout of an in-process run (a third-party import warning may precede the completion)."""
    from inference.__main__ import main

    assert main([*args, "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--device", "cpu"]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def merged_and_base_text(model_dir, adapter_dir) -> tuple[str, str]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir).merge_and_unload()
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    return engine_text(merged.eval(), tokenizer), engine_text(base.eval(), tokenizer)


def test_cli_serves_a_lora_adapter_on_its_base(capsys, model_dir, adapter_dir, merged_and_base_text):
    merged, base = merged_and_base_text
    assert merged and merged != base, "the adapter must change the greedy output, or this test shows nothing"
    assert cli_text(capsys, str(model_dir), "--adapter", str(adapter_dir)).endswith(merged + "\n")


def test_cli_serves_an_adapter_dir_alone(capsys, adapter_dir, merged_and_base_text):
    """adapter_config.json names the base; models.loading loads it and merges the adapter."""
    merged, _ = merged_and_base_text
    assert merged and cli_text(capsys, str(adapter_dir)).endswith(merged + "\n")


def test_exported_adapter_readme_names_no_temp_dir(tmp_path, model_dir):
    """export_model writes into a temp dir that is renamed afterwards: the README must not point
    there, and its commands must name the recorded base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from algorithms.opsd import export_model

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                LoraConfig(r=2, target_modules=["q_proj"]))
    out = tmp_path / "final.tmp"
    out.mkdir()
    export_model(peft_model, build_char_tokenizer(), str(out), "opsd")
    readme = (out / "README.md").read_text()
    assert "final.tmp" not in readme and str(tmp_path) not in readme
    assert f"python -m inference {model_dir} --adapter <this directory>" in readme
    assert f"from_pretrained({str(model_dir)!r})" in readme


def test_cli_serves_a_quantized_export_on_the_low_bit_path(tmp_path, capsys, make_model, monkeypatch):
    """A compressed-tensors export (what +algo=qad writes) loads into LowBitLinear modules, and the
    CLI's greedy completion equals the fake-quant model's through the HF forward."""
    from inference import Engine, EngineConfig, SamplingParams
    from inference import lowbit
    from inference.__main__ import main
    from models.quant import QuantScheme, apply_fake_quant
    from models.quant_export import export_compressed

    tokenizer = build_char_tokenizer()
    model = make_model("qwen3").eval()
    apply_fake_quant(model, QuantScheme.parse("W4A8"))
    export_compressed(model, tokenizer, str(tmp_path))
    capsys.readouterr()  # what the export's imports printed
    ops = []
    real = lowbit.cpu_int_matmul
    monkeypatch.setattr(lowbit, "cpu_int_matmul", lambda *a, **k: ops.append(1) or real(*a, **k))
    assert main([str(tmp_path), "--prompt", "12+7=", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    [ref] = Engine(model, EngineConfig(use_lean=False)).generate([tokenizer.encode("12+7=")], params)
    assert printed == tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert ops  # the integer GEMM ran
