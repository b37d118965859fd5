"""lm-eval's `local-completions` model against the HTTP server (inference/server.py) on local task files:
generation on 20 held-out arith questions scores each question as our evaluator does, and a multiple-choice
task's per-choice log-likelihoods are the model's own."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.slow  # a live server and two lm-eval runs: about 30 s
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models

from tests.inference.test_server import start, stop  # noqa: E402

N = 20
NEW = 160  # the trainer's eval_max_new_tokens

GENERATE = """task: arith_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n\\n"]
  max_gen_toks: {new}
  do_sample: false
filter_list:
  - name: answer
    filter:
      - function: regex
        regex_pattern: "#### (-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
CHOICE = """task: mc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def default_model():
    from algorithms import config_schemas
    from trainer.config import load_config
    from trainer.distributed import World
    from trainer.setup import build_task_from
    from trainer.warm_start import ensure

    cfg = load_config(["+algo=sft"], config_schemas())
    return ensure(cfg.model, World()), build_task_from(cfg.data, cfg.model)


def run(url: str, path: str, tasks_dir, task: str, tokenized: bool) -> dict:
    from lm_eval.tasks import TaskManager

    args = (f"base_url={url}/v1/completions,model=tiny,tokenizer={path},tokenizer_backend=huggingface,"
            f"num_concurrent=4,max_retries=1,tokenized_requests={tokenized}")
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[task],
                                   task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True)


def test_lm_eval_scores_generation_as_we_do_and_reads_the_models_own_loglikelihoods(tmp_path, default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.distributed import World
    from trainer.evaluation import evaluate

    path, task = default_model
    examples = list(task.test_examples())[:N]
    (tmp_path / "arith.jsonl").write_text("".join(json.dumps({"prompt": task.prompt(ex), "answer": ex.answer}) + "\n"
                                                  for ex in examples))
    (tmp_path / "arith_local.yaml").write_text(GENERATE.format(data=tmp_path / "arith.jsonl", new=NEW))
    sums = [(2, 3), (10, 7), (31, 4), (5, 5), (12, 20)]
    rows = [{"q": f"q: {a}+{b}?\na: ", "choices": [str(a + b), str(a + b + 1), str(a + b + 10)], "label": 0}
            for a, b in sums]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mc_local.yaml").write_text(CHOICE.format(data=tmp_path / "mc.jsonl"))

    proc, url = start(path)
    try:
        gen = run(url, path, tmp_path, "arith_local", tokenized=False)
        mc = run(url, path, tmp_path, "mc_local", tokenized=True)
    finally:
        assert stop(proc) == 0

    # generation: each question right or wrong as our evaluator (the engine, greedy, our verifier) says
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ours = evaluate(model, tok, task, examples, World(), NEW)
    by_doc = {s["doc_id"]: s for s in gen["samples"]["arith_local"]}
    theirs = "".join("1" if by_doc[i]["exact_match"] else "0" for i in range(N))
    assert theirs == ours["outcomes"], (theirs, ours["outcomes"])
    assert gen["results"]["arith_local"]["exact_match,answer"] == pytest.approx(ours["accuracy"])

    # multiple choice: lm-eval's log-likelihood of each choice is the model's own
    samples = sorted(mc["samples"]["mc_local"], key=lambda s: s["doc_id"])
    assert len(samples) == len(rows)
    for row, sample in zip(rows, samples):
        for choice, resp in zip(row["choices"], sample["resps"]):
            text = row["q"].rstrip()  # lm-eval moves the context's trailing spaces to the continuation
            context = tok(text).input_ids
            cont = tok(row["q"][len(text):] + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([context + cont])).logits[0].float(), -1)
            want = sum(logp[len(context) - 1 + k, t].item() for k, t in enumerate(cont))
            assert resp[0][0] == pytest.approx(want, abs=1e-4)
