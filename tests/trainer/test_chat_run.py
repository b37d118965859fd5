"""data.chat_template through the config and a real run: a local model dir whose tokenizer has a template."""
from __future__ import annotations

import json

import pytest

from models.loading import TinySpec, build_tiny
from tests.conftest import tiny_config
from tests.tasks.test_chat_template import TEMPLATE
from trainer.config import ConfigError

HF = ["model=hf", "data.digits=2", "data.steps=1", "data.n_train=64", "data.n_test=8"]


@pytest.fixture
def chat_model_dir(tmp_path):
    model, tok = build_tiny(TinySpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), seed=0)
    tok.chat_template = TEMPLATE
    path = tmp_path / "chat_model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_chat_template_values_are_checked(tmp_path, chat_model_dir):
    assert tiny_config(tmp_path / "a").data.chat_template == "auto"
    assert tiny_config(tmp_path / "b", "data.chat_template=false").data.chat_template == "false"
    with pytest.raises(ConfigError, match="data.chat_template='maybe' is not one of auto, true, false"):
        tiny_config(tmp_path / "c", "data.chat_template=maybe")
    with pytest.raises(ConfigError, match="embedded tiny model's tokenizer has no chat template"):
        tiny_config(tmp_path / "d", "data.chat_template=true")
    cfg = tiny_config(tmp_path / "e", *HF, f"model.path={chat_model_dir}", "data.chat_template=true")
    assert cfg.data.chat_template == "true"
    (chat_model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((chat_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (chat_model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"model.path={chat_model_dir} has no chat template"):
        tiny_config(tmp_path / "f", *HF, f"model.path={chat_model_dir}", "data.chat_template=true")


@pytest.mark.parametrize("algo", ["sft", "grpo"])
def test_a_run_renders_every_prompt_through_the_template(tmp_path, chat_model_dir, algo, capsys):
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session

    cfg = tiny_config(tmp_path / "run", *HF, f"model.path={chat_model_dir}", "data.chat_template=auto",
                      "trainer.max_steps=1", "trainer.batch_size=4", "trainer.micro_batch_size=4",
                      "trainer.max_new_tokens=8", "trainer.eval_max_new_tokens=8", algo=algo)
    session = build_session(cfg, World())
    ex = session.task.train_examples()[0]
    assert session.task.prompt(ex).startswith("<user>\n") and session.task.prompt(ex).endswith("<assistant>\n")
    assert "chat template" in capsys.readouterr().out
    assert fit(session) == "done"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "train" and r["step"] == 1 for r in records)


@pytest.mark.slow  # torchrun with 2 ranks: ~25 s
def test_two_ranks_with_a_chat_template_and_truncated_prompts(tmp_path, chat_model_dir, subprocess_env):
    """The chat wrapper and the length fitting under torchrun: GRPO's padded rollout batches on 2 ranks, every
    prompt over data.max_prompt_tokens and shortened by truncate_left (the same on both ranks)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           "+algo=grpo", *HF, f"model.path={chat_model_dir}", "data.chat_template=true", "data.max_prompt_tokens=40",
           "data.length_policy=truncate_left", "algo.num_generations=2", "trainer.max_steps=2", "trainer.batch_size=4",
           "trainer.micro_batch_size=2", "trainer.max_new_tokens=8", "trainer.eval_max_new_tokens=8",
           "trainer.eval_examples=4", "trainer.save_every=1000", "trainer.eval_every=1000",
           "logging.wandb=false", "logging.progress=false", f"output_dir={out}"]
    proc = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shortened the question of" in proc.stderr and "chat template" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
    assert (out / "final" / "config.json").exists()
