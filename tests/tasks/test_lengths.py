"""Length limits at data load (tasks/lengths.py) and capped completions in eval."""
from __future__ import annotations

import json
import random
import warnings

import pytest

from models.prompts import continuation_ids, prompt_ids
from models.tokenizer import build_char_tokenizer
from tasks import DataError, build_task
from tasks.chat_template import with_chat
from tasks.lengths import LengthFittedTask, LengthLimits, fit_lengths
from tests.tasks.test_chat_template import bos_tokenizer, chat_tokenizer

TOK = build_char_tokenizer()


def text_task(tmp_path, questions, solution="so 1\n#### 1"):
    rows = [{"question": q, "solution": solution, "answer": "1"} for q in questions]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_task("text", path=str(path), test_path=str(path), prompt_template="{question}\n",
                      teacher_template="{question}\nref: {reference}\n")


def test_limits_default_to_the_models_positions():
    assert LengthLimits().resolved(64) == LengthLimits(63, 64, "error")
    assert LengthLimits(10, 500, "skip").resolved(64) == LengthLimits(10, 64, "skip")  # never above the model
    assert LengthLimits(10, None).resolved(None) == LengthLimits(10, None)
    task = build_task("arith", seed=0, n_train=4, n_test=2, digits=2, steps=1)
    assert fit_lengths(task, TOK, LengthLimits()) is task  # nothing to check against


def test_error_names_the_file_row_and_lengths(tmp_path):
    task = text_task(tmp_path, ["short one?", "x" * 80, "short two?"])
    fitted = fit_lengths(task, TOK, LengthLimits(max_prompt_tokens=40, max_length=100))
    with pytest.raises(DataError) as err:
        fitted.train_examples()
    message = str(err.value)
    # the prompt is the 80 characters + "\n" = 81 char tokens
    assert "rows.jsonl:2" in message and "prompt of 81 tokens > data.max_prompt_tokens=40" in message
    assert "\n" not in message and "length_policy=skip" in message


def test_skip_drops_and_counts(tmp_path):
    task = text_task(tmp_path, ["short one?", "x" * 80, "y" * 70, "short two?"])
    fitted = fit_lengths(task, TOK, LengthLimits(max_prompt_tokens=40, max_length=100, policy="skip"))
    with pytest.warns(UserWarning, match=r"2 of 4 examples over the length limits: dropped 2 \(e.g. rows.jsonl:2"):
        kept = fitted.train_examples()
    assert [ex.question for ex in kept] == ["short one?", "short two?"]
    assert fitted.dropped["train"] == 2


def test_max_length_counts_the_solution_and_eos(tmp_path):
    # prompt "abc?\n" = 5 tokens, solution "so 1\n#### 1" = 11 tokens, EOS 1: 17 in all
    task = text_task(tmp_path, ["abc?"])
    assert fit_lengths(task, TOK, LengthLimits(max_length=17)).train_examples()[0].question == "abc?"
    with pytest.raises(DataError, match="prompt \\+ reference of 17 tokens > data.max_length=16"):
        fit_lengths(task, TOK, LengthLimits(max_length=16)).train_examples()
    # the teacher prompt "abc?\nref: so 1\n#### 1\n" = 22 tokens, counted only where the teacher reads it
    with pytest.raises(DataError, match="of 22 tokens > data.max_length=21"):
        fit_lengths(task, TOK, LengthLimits(max_length=21, with_teacher=True)).train_examples()


def test_truncate_left_keeps_the_end_of_the_question_with_the_fewest_cuts(tmp_path):
    question = "".join(random.Random(0).choice("abcdefgh ") for _ in range(120)) + " what is it?"
    task = text_task(tmp_path, [question, "fine?"], solution="#### 1")
    fitted = fit_lengths(task, TOK, LengthLimits(max_prompt_tokens=50, max_length=200, policy="truncate_left"))
    with pytest.warns(UserWarning, match="shortened the question of 1"):
        long, short = fitted.train_examples()
    assert short.question == "fine?"
    assert long.question.endswith(" what is it?") and question.endswith(long.question)
    assert len(prompt_ids(TOK, task.prompt(long))) == 50  # 49 question characters + "\n": the most that fits
    # an example whose solution alone does not fit max_length cannot be saved by cutting the question
    task = text_task(tmp_path, ["q?", "r?"], solution="z" * 60 + "\n#### 1")
    fitted = fit_lengths(task, TOK, LengthLimits(max_prompt_tokens=10, max_length=40, policy="truncate_left"))
    with pytest.raises(DataError, match="no example fits"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted.train_examples()


def test_lengths_are_those_of_the_runs_prompt_ids_chat_and_bos_included():
    arith = build_task("arith", seed=0, n_train=6, n_test=2, digits=2, steps=1)
    for tok in (chat_tokenizer(), bos_tokenizer(), bos_tokenizer("{{ bos_token }}<user>\n{{ messages[0]['content'] }}")):
        task = with_chat(arith, tok, "auto")
        fitted = LengthFittedTask(task, tok, LengthLimits(with_teacher=True))
        examples = task.train_examples()
        prompts, full = fitted.lengths(examples)
        for ex, p, f in zip(examples, prompts, full):
            assert p == len(prompt_ids(tok, task.prompt(ex)))
            assert f == max(p + len(continuation_ids(tok, ex.solution)) + 1,
                            len(prompt_ids(tok, task.teacher_prompt(ex, ex.solution))))
        bound_p, bound_f = fitted.bounds(examples)  # the fast path's bounds never undercount
        assert all(b >= x for b, x in zip(bound_p + bound_f, prompts + full))


def test_clm_keeps_its_own_budget():
    clm = build_task("clm", seed=0, n_train=2, n_test=2)
    assert fit_lengths(clm, TOK, LengthLimits(max_prompt_tokens=5)) is clm


def test_a_run_refuses_an_over_long_row_before_any_eval(tmp_path):
    from tests.conftest import tiny_config
    from trainer.distributed import World
    from trainer.setup import build_session

    task = text_task(tmp_path, ["ok?", "x" * 300])
    cfg = tiny_config(tmp_path / "run", "data.max_prompt_tokens=100")
    with pytest.raises(DataError, match="rows.jsonl:2: prompt of 301 tokens"):
        build_session(cfg, World(), task=task)


def test_eval_reports_completions_cut_short_by_the_models_positions():
    from models.loading import random_qwen3
    from trainer.distributed import World
    from trainer.evaluation import evaluate

    tok = build_char_tokenizer()
    model = random_qwen3(len(tok), max_positions=80, seed=0).eval()
    arith = build_task("arith", seed=0, n_train=4, n_test=4, digits=2, steps=1)
    examples = arith.test_examples()
    longest = max(len(prompt_ids(tok, arith.prompt(ex))) for ex in examples)
    assert longest < 80
    out = evaluate(model, tok, arith, examples, World(), max_new_tokens=60)
    # every row's budget is 80 - longest < 60; a random model rarely emits EOS, so count by hand
    from inference import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=60, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    completions = Engine(model).generate([prompt_ids(tok, arith.prompt(ex)) for ex in examples], params)
    expected = sum(c.finish_reason == "length" for c in completions)
    assert all(len(c.tokens) <= 80 - longest for c in completions)
    assert expected > 0 and out.get("capped", 0) == expected
