"""Every algorithm, 2 steps on the real model with its chat template, in this process (one loaded model,
deep-copied per run); then export -> reload -> serve through `python -m inference`, and a LoRA
adapter served with --adapter."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.real, pytest.mark.slow]

SMALL = ["data.digits=2", "data.steps=1", "data.n_train=64", "data.n_test=8", "trainer.max_steps=2",
         "trainer.batch_size=2", "trainer.micro_batch_size=2", "trainer.max_new_tokens=8",
         "trainer.eval_examples=2", "trainer.eval_max_new_tokens=8", "trainer.eval_every=1000",
         "trainer.save_every=1000", "trainer.warmup_steps=1", "logging.wandb=false", "logging.progress=false"]
RUNS = {  # algorithm -> its own overrides, kept to the smallest meaningful sizes
    "sft": [],
    "grpo": ["algo.num_generations=2"],
    "opsd": [],
    "mass": ["algo.num_views=2"],
    "tesd": ["algo.teacher_rollouts=2"],
    "seed": [],
    "qad": [],
    "skipper": [],
}


def run(tmp_path, model_dir, loaded, algo, *extra):
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    model, tok = loaded
    out = tmp_path / algo
    cfg = load_config([f"+algo={algo}", "model=hf", f"model.path={model_dir}", "data.chat_template=true", *SMALL,
                       *RUNS.get(algo, []), *extra, f"output_dir={out}"], config_schemas())
    session = build_session(cfg, World(), model=copy.deepcopy(model), tokenizer=tok)
    assert fit(session) == "done"
    session.tracker.close()
    final = Path(export_final(session))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return session, final, records


@pytest.mark.parametrize("algo", sorted(RUNS))
def test_each_algorithm_trains_two_steps_with_the_chat_template(tmp_path, smollm2_dir, smollm2, algo):
    session, final, records = run(tmp_path, smollm2_dir, smollm2, algo)
    ex = session.task.train_examples()[0]
    assert session.task.prompt(ex).startswith("<|im_start|>")  # the template's turns, not the raw question
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e4 for r in train)  # finite
    assert any(final.iterdir())  # the exported artifact


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "inference", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.rstrip("\n")


def greedy(model, tok, question, new=12):
    from inference import Engine, SamplingParams
    from models.prompts import prompt_ids, render

    params = SamplingParams(max_new_tokens=new, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    [out] = Engine(model.eval()).generate([prompt_ids(tok, render(tok, question, chat=True))], params)
    return tok.decode(out.tokens, skip_special_tokens=True)


def test_export_reload_serve(tmp_path, smollm2_dir, smollm2):
    from models.loading import load_pretrained

    _, final, _ = run(tmp_path, smollm2_dir, smollm2, "sft")
    question = "What is 12 plus 7?"
    served = cli(str(final), "--prompt", question, "--max-new-tokens", "12")
    model, tok = load_pretrained(str(final))
    assert served == greedy(model, tok, question) and served


def test_lora_adapter_served_with_adapter(tmp_path, smollm2_dir, smollm2):
    from models.loading import load_pretrained
    from peft import PeftModel

    _, final, _ = run(tmp_path, smollm2_dir, smollm2, "opsd", "algo.lora_rank=4", "trainer.lr=1e-3")
    assert (final / "adapter_config.json").exists()
    question = "What is the capital of France?"
    served = cli(smollm2_dir, "--adapter", str(final), "--prompt", question, "--max-new-tokens", "12")
    base, tok = load_pretrained(smollm2_dir)
    merged = PeftModel.from_pretrained(base, str(final)).merge_and_unload()
    assert served == greedy(merged, tok, question) and served
