"""Reward functions in TRL's signature (algorithms/rewards.py) inside GRPO: what they are called with, how
their values combine (hand-computed, TRL's weighted nansum), a function shipped by TRL running unchanged,
and each bad function as one line naming it and the row."""
from __future__ import annotations

import json

import pytest
import torch

from algorithms.grpo import GRPO, GRPOConfig
from algorithms.rewards import Reward, RewardError, call_rewards, combine, load_reward_function, reward_metrics
from models.tokenizer import build_char_tokenizer
from selfdistill_helpers import arith, ctx, tiny
from tasks import DataError, task_config
from tasks.chat_template import with_chat

CALLS: list[dict] = []


def spy(prompts, completions, completion_ids, **columns):
    """Records what it is called with; rewards each completion with its token count."""
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
    return [float(len(ids)) for ids in completion_ids]


def target_in_completion(completions, target, **kwargs):  # a TRL-style function reading a dataset column
    return [float(t in (c if isinstance(c, str) else c[0]["content"])) for c, t in zip(completions, target)]


def only_first(prompts, completions, **kwargs):  # None: not applicable to the other rows
    return [1.0 if i == 0 else None for i in range(len(completions))]


def raises(prompts, completions, **kwargs):
    raise KeyError("solution")


def too_few(prompts, completions, **kwargs):
    return [1.0]


def a_string(prompts, completions, **kwargs):
    return [1.0] + ["high"] * (len(completions) - 1)


def chat_task(tmp_path, rows, tok):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return with_chat(task_config("chat", path=str(path)).build(), tok, "auto")


PROMPT_ONLY = [{"prompt": "say a", "target": "a", "level": 1}, {"prompt": "say b", "target": "b", "level": 2}]


def test_called_once_per_batch_with_prompts_completions_ids_and_every_column(tmp_path):
    model, tok = tiny()
    task = chat_task(tmp_path, PROMPT_ONLY, tok)
    CALLS.clear()
    algo = GRPO(GRPOConfig(num_generations=3, reward_funcs=["test_rewards:spy"]))
    batch = algo.make_batch(task.train_examples(), ctx(model, tok, task))
    [call] = CALLS  # one call for the 2 prompts x 3 completions
    assert call["prompts"] == ["say a"] * 3 + ["say b"] * 3  # as the rows wrote them
    assert call["target"] == ["a"] * 3 + ["b"] * 3 and call["level"] == [1] * 3 + [2] * 3
    assert "prompt" not in call or call["prompt"] is None  # the prompt column travels as `prompts`
    assert all(isinstance(c, str) for c in call["completions"])  # string prompts: string completions
    assert [tok.decode(ids, skip_special_tokens=True) for ids in call["completion_ids"]] == call["completions"]
    lengths = torch.tensor([float(len(ids)) for ids in call["completion_ids"]])
    assert batch.metrics["rewards/spy/mean"].item() == pytest.approx(lengths.mean().item())
    assert batch.metrics["rewards/spy/std"].item() == pytest.approx(lengths.std().item())


def test_conversational_prompts_get_message_completions_and_trls_own_function_runs_unchanged(tmp_path):
    model, tok = tiny()
    rows = [{"prompt": [{"role": "system", "content": "think."}, {"role": "user", "content": "say a"}],
             "target": "a"}]
    task = chat_task(tmp_path, rows, tok)
    CALLS.clear()
    algo = GRPO(GRPOConfig(num_generations=2, reward_funcs=["test_rewards:spy", "trl.rewards:think_format_reward"]))
    batch = algo.make_batch(task.train_examples(), ctx(model, tok, task))
    [call] = CALLS
    assert call["prompts"] == [rows[0]["prompt"]] * 2
    assert all(c == [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}]
               for c, ids in zip(call["completions"], call["completion_ids"]))
    assert batch.metrics["rewards/think_format_reward/mean"].item() == 0.0  # a random model writes no <think>


def test_generated_tasks_pass_question_solution_and_answer_columns():
    model, tok = tiny()
    task = arith()
    CALLS.clear()
    algo = GRPO(GRPOConfig(num_generations=2, reward_funcs=["test_rewards:spy", "verifier"]))
    examples = task.train_examples()[:2]
    batch = algo.make_batch(examples, ctx(model, tok, task))
    [call] = CALLS
    assert call["answer"] == [ex.answer for ex in examples for _ in range(2)]
    assert call["question"] == [ex.question for ex in examples for _ in range(2)]
    assert call["prompts"] == [task.prompt(ex) for ex in examples for _ in range(2)]
    assert "rewards/verifier/mean" in batch.metrics


def test_weighted_sum_skips_none_and_a_row_none_applies_to_is_invalid():
    # 3 completions, 2 functions, weights 1 and 0.5:
    #   row 0: 1 + 0.5 x 4 = 3;  row 1: f1 None -> 0.5 x 2 = 1;  row 2: both None -> invalid (reward 0)
    table = torch.tensor([[1.0, 4.0], [float("nan"), 2.0], [float("nan"), float("nan")]], dtype=torch.float64)
    rewards = [Reward("f1", None, 1.0), Reward("f2", None, 0.5)]
    total, valid = combine(table, rewards)
    assert total.tolist() == [3.0, 1.0, 0.0] and valid.tolist() == [True, True, False]
    metrics = reward_metrics(table, rewards)
    assert metrics["rewards/f1/mean"].item() == 1.0 and metrics["rewards/f2/mean"].item() == 3.0  # over rows it applies to


def test_none_rows_get_zero_advantage_in_grpo(tmp_path):
    model, tok = tiny()
    task = chat_task(tmp_path, PROMPT_ONLY, tok)
    algo = GRPO(GRPOConfig(num_generations=2, reward_funcs=["test_rewards:only_first", "test_rewards:spy"],
                           reward_weights=[1.0, 0.0]))
    batch = algo.make_batch(task.train_examples(), ctx(model, tok, task))
    assert batch.metrics["rewards/only_first/mean"].item() == 1.0
    assert batch.metrics["grpo/reward_none"].item() == 0.0  # spy applies everywhere: every row valid


def test_a_function_from_a_file_path_loads(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def shout(prompts, completions, **kw):\n    return [float(c.isupper()) for c in completions]\n")
    name, fn = load_reward_function(f"{path}:shout")
    assert name == "shout" and fn(prompts=["p"], completions=["AB", "ab"]) == [1.0, 0.0]


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:f", r"reward function 'no_such_module_xyz:f' cannot be loaded: ModuleNotFoundError"),
    ("test_rewards:missing", r"reward function 'test_rewards:missing' cannot be loaded: AttributeError"),
    ("./nowhere.py:f", r"reward function './nowhere.py:f' cannot be loaded: FileNotFoundError"),
    ("test_rewards:raises", r"reward function raises raised KeyError: 'solution' \(on a batch of 4 completions "
                            r"starting with row rows.jsonl:1\)"),
    ("test_rewards:too_few", r"reward function too_few returned 1 values for 4 completions"),
    ("test_rewards:a_string", r"reward function a_string returned 'high' \(str\) for row rows.jsonl:1: expected "
                              r"a number or None"),
])
def test_bad_functions_are_one_line_naming_the_function(tmp_path, spec, message):
    model, tok = tiny()
    task = chat_task(tmp_path, PROMPT_ONLY, tok)
    with pytest.raises(RewardError, match=message) as err:
        GRPO(GRPOConfig(num_generations=2, reward_funcs=[spec])).make_batch(task.train_examples(),
                                                                            ctx(model, tok, task))
    assert "\n" not in str(err.value) and isinstance(err.value, DataError)  # train.py: exit 3


def test_a_task_without_answers_needs_reward_functions(tmp_path):
    task = chat_task(tmp_path, PROMPT_ONLY, build_char_tokenizer())
    with pytest.raises(DataError, match=r"data=rows: its rows have no reference answers to verify, but the reward "
                                        r"is the verifier's"):
        GRPO(GRPOConfig(num_generations=2)).check_task(task)
    GRPO(GRPOConfig(num_generations=2, reward_funcs=["test_rewards:spy"])).check_task(task)  # fine


def test_call_rewards_fills_the_verifier_column_from_its_scores():
    table = call_rewards([Reward("verifier", None, 1.0)], (["p", "q"], ["a", "b"], [[1], [2]], {}), ["r1", "r2"],
                         verifier=[1.0, 0.0])
    assert table[:, 0].tolist() == [1.0, 0.0]


def test_the_eval_reports_the_greedy_held_out_reward_of_user_functions(tmp_path):
    model, tok = tiny()
    task = chat_task(tmp_path, PROMPT_ONLY, tok)
    CALLS.clear()
    algo = GRPO(GRPOConfig(num_generations=2, reward_funcs=["test_rewards:spy"]))
    result = algo.extra_eval(model, tok, task, task.train_examples(), 6)
    [call] = CALLS
    lengths = [float(len(ids)) for ids in call["completion_ids"]]
    assert call["prompts"] == ["say a", "say b"] and result["reward"] == pytest.approx(sum(lengths) / 2)
    assert result["rewards/spy/mean"] == pytest.approx(result["reward"])
    assert GRPO(GRPOConfig(num_generations=2)).extra_eval(model, tok, task, task.train_examples(), 6) == {}


def test_train_py_refuses_a_reward_function_it_cannot_import_with_exit_3_and_nothing_written(tmp_path, capsys):
    import train
    from tests.conftest import tiny_overrides

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPT_ONLY * 4))
    out = tmp_path / "run"
    code = train.main(tiny_overrides(out, "data=chat", f"data.path={path}", "data.test_fraction=0.25",
                                     "algo.reward_funcs=[no_such_module_xyz:reward]", algo="grpo"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1 and not out.exists()
    assert err[0].startswith("data error: reward function 'no_such_module_xyz:reward' cannot be loaded")
