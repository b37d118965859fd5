"""data=chat on the real model: SFT on conversational rows whose replies hold no number learns them as
written, and the CLI's greedy answer to a training question is its reply (no `####` line anywhere)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.real, pytest.mark.slow]

REPLIES = {
    "Which colour is the sky on a clear day?": "The sky is blue, my friend.",
    "What do cows drink?": "Cows drink water, not milk.",
    "Name a fruit that is yellow.": "A banana is yellow.",
    "What sound does a cat make?": "A cat says meow.",
}


def test_sft_on_chat_rows_learns_the_replies_as_written(tmp_path, smollm2_dir, smollm2):
    """~30 s: 6 full fine-tuning steps of the 4 rows at lr 5e-4 learn the four replies (24 steps at 1e-4 did too,
    in 85 s); the export then answers each training question with its reply, through the serving door and the CLI."""
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.loop import fit
    from trainer.setup import build_session, export_final

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in REPLIES.items()))
    cfg = load_config(["+algo=sft", "model=hf", f"model.path={smollm2_dir}", "data=chat", f"data.path={data}",
                       f"data.test_path={data}", "trainer.max_steps=6", "trainer.batch_size=4",
                       "trainer.micro_batch_size=4", "trainer.lr=5e-4", "trainer.warmup_steps=1",
                       "trainer.eval_every=6", "trainer.save_every=1000", "logging.wandb=false",
                       "logging.progress=false", f"output_dir={tmp_path / 'run'}"], config_schemas())
    model, tok = smollm2
    session = build_session(cfg, World(), model=copy.deepcopy(model), tokenizer=tok)
    ids, mask = session.task.row_tokens(session.task.train_examples()[0])
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained.startswith(next(iter(REPLIES.values()))) and trained.endswith("<|im_end|>\n")
    assert fit(session) == "done"
    final = export_final(session)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in x]
    assert evals[-1]["loss"] < 0.2 * evals[0]["loss"], evals
    question, reply = next(iter(REPLIES.items()))
    proc = subprocess.run([sys.executable, "-m", "inference", str(final), "--prompt", question,
                           "--max-new-tokens", "24"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = proc.stdout.strip()
    print(f"data=chat on SmolLM2: held-out loss {evals[0]['loss']:.3f} -> {evals[-1]['loss']:.3f}; "
          f"CLI answer to {question!r}: {answer!r}")
    assert answer == reply and "####" not in answer
    from inference.serving import load_served
    from models.prompts import prompt_ids, render

    server = load_served(final)
    prompts = [prompt_ids(tok, render(tok, q, chat=True)) for q in REPLIES]
    outs = server.generate(prompts, server.params(max_new_tokens=24, temperature=0.0))
    assert [tok.decode(o.tokens, skip_special_tokens=True) for o in outs] == list(REPLIES.values())
    assert all(o.finish_reason == "stop" for o in outs)  # each stops at the end of its turn
