"""Tests for tasks/: answers, the arith task and its step checker, user data loading."""
from __future__ import annotations

import json
import warnings

import pytest

from models.tokenizer import CHARSET
from tasks import (
    ArithTask,
    DataError,
    Example,
    Task,
    TextTask,
    VerifyResult,
    answers_equal,
    build_task,
    extract_answer,
    mask_spans,
    score,
)
from tasks.arith import column_equations, eval_int_expr, parse_steps

GOLD = """345+278: 5+8=13, 4+7+1=12, 3+2+1=6. 345+278=623
623-12: 3-2=1, 2-1=1, 6-0=6. 623-12=611
#### 611"""
GOLD_EXAMPLE = Example("tom has 345 apples. he gets 278 more, then gives away 12. how many apples?",
                       GOLD, "611", "hand-0")


# ---------------------------------------------------------------------------------------------
# Answers and scores


@pytest.mark.parametrize("text, want", [
    ("so it is 5\n#### 42", "42"),
    ("#### -3.5", "-3.5"),
    ("#### $1,234 dollars", "1234"),
    ("#### 7\nthen \\boxed{9}", "7"),  # the #### line wins over \boxed
    ("the answer is \\boxed{12}.", "12"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("we get 3 apples, then 1,250 pears.", "1250"),
    ("3-2=1", "1"),
    ("x = -4", "-4"),
    ("last 2.50 then 7", "7"),
    ("no numbers here", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_answers_equal():
    assert answers_equal("1,234", "1234.0")
    assert answers_equal("0.5", "\\frac{1}{2}") and answers_equal("3/4", "0.75")
    assert answers_equal("1e-7", "0")  # within the absolute tolerance 1e-6
    assert not answers_equal("1000000", "1000001")  # no relative tolerance
    assert answers_equal(" yes ", "yes") and not answers_equal("yes", "no")
    assert not answers_equal(None, "1")


def test_score_modes_and_reward():
    right_bad_steps = VerifyResult(correct=True, answer="5", steps_total=4, steps_correct=3)
    assert score(right_bad_steps, "answer") == 1.0
    assert score(right_bad_steps, "steps") == 0.0 == right_bad_steps.reward
    assert score(right_bad_steps, "partial") == pytest.approx(0.5 + 0.5 * 0.75)
    no_steps = VerifyResult(correct=True, answer="5")
    assert no_steps.step_accuracy == 1.0 and no_steps.reward == 1.0
    assert score(VerifyResult(False, None, 2, 2), "partial") == 0.5
    with pytest.raises(ValueError, match="score mode"):
        score(no_steps, "bogus")


def test_mask_spans_keeps_layout():
    spans = ["a: 1+1=2\n", "b: 2+2=4\n", "#### 4"]
    assert mask_spans(spans, [False, True, True], "_") == "a: 1+1=2\n_\n_"
    with pytest.raises(ValueError):
        mask_spans(spans, [True], "_")


# ---------------------------------------------------------------------------------------------
# arith: format and generation


def test_column_equations_match_the_documented_format():
    assert column_equations(345, "+", 278) == ["5+8=13", "4+7+1=12", "3+2+1=6"]
    assert column_equations(623, "-", 48) == ["13-8=5", "12-4-1=7", "6-0-1=5"]
    assert column_equations(623, "-", 618) == ["13-8=5", "2-1-1=0", "6-6=0"]
    assert column_equations(1000, "-", 1) == ["10-1=9", "10-0-1=9", "10-0-1=9", "1-0-1=0"]
    assert column_equations(12, "+", 345) == ["2+5=7", "1+4=5", "0+3=3"]
    assert column_equations(345, "*", 7) == ["5*7=35", "4*7+3=31", "3*7+3=24"]
    assert eval_int_expr("4*7+3") == 31 and eval_int_expr("12-4-1") == 7 and eval_int_expr("2+3*4-1") == 13


@pytest.mark.parametrize("kwargs", [{}, {"ops": ("+", "-", "*"), "steps": 3}, {"digits": 4, "steps": 1}])
def test_arith_alphabet_is_the_tokenizer_charset(kwargs):
    task = ArithTask(n_train=300, n_test=50, **kwargs)
    allowed = set(CHARSET)
    for ex in task.train_examples() + task.test_examples():
        spans = task.solution_spans(ex.solution)
        masked = mask_spans(spans, [i % 2 == 0 for i in range(len(spans))], task.mask_token)
        text = ex.question + ex.solution + task.prompt(ex) + task.teacher_prompt(ex, masked)
        assert set(text) <= allowed, sorted(set(text) - allowed)


def test_arith_charset_check_rejects_uppercase_templates():
    with pytest.raises(DataError, match="charset"):
        ArithTask(n_train=10, n_test=5, prompt_template="Q: {question}\nA: ")
    ArithTask(n_train=10, n_test=5, prompt_template="Q: {question}\nA: ", check_charset=False)
    with pytest.raises(DataError, match="placeholder"):
        ArithTask(teacher_template="q: {question}\na: ")


def test_arith_is_deterministic_and_seeded():
    a = ArithTask(seed=3, n_train=200, n_test=50)
    b = ArithTask(seed=3, n_train=200, n_test=50)
    c = ArithTask(seed=4, n_train=200, n_test=50)
    assert a.train_examples() == b.train_examples() and a.test_examples() == b.test_examples()
    assert a.train_examples() != c.train_examples()
    assert len(a.train_examples()) == 200 and len(a.test_examples()) == 50
    assert len({ex.uid for ex in a.train_examples() + a.test_examples()}) == 250


def test_arith_train_and_test_are_disjoint():
    task = ArithTask(n_train=5000, n_test=200, digits=2)  # a small space, so collisions would happen

    def problem(ex):
        steps = [s for s, _ in parse_steps(ex.solution)]
        return (steps[0].a,) + tuple((s.op, s.b) for s in steps)

    train, test = task.train_examples(), task.test_examples()
    assert not {ex.question for ex in train} & {ex.question for ex in test}
    assert not {problem(ex) for ex in train} & {problem(ex) for ex in test}
    assert len({problem(ex) for ex in test}) == len(test)


def test_arith_values_never_negative_and_knobs_hold():
    task = ArithTask(n_train=1000, n_test=10, digits=3, steps=3, ops=("-",))
    for ex in task.train_examples():
        steps = parse_steps(ex.solution)
        assert len(steps) == 3 and all(s.op == "-" and len(str(s.b)) <= 3 for s, _ in steps)
        assert all(result >= 0 for _, result in steps) and int(ex.answer) >= 0
    mul = ArithTask(n_train=200, n_test=10, ops=("*",), steps=1)
    assert all(2 <= parse_steps(ex.solution)[0][0].b <= 9 for ex in mul.train_examples())


def test_arith_bad_knobs_fail_clearly():
    with pytest.raises(DataError, match="ops"):
        ArithTask(ops=("/",))
    with pytest.raises(DataError, match="distinct"):
        ArithTask(n_train=10, n_test=1000, digits=1, steps=1, ops=("*",)).test_examples()


def test_arith_spans_join_back_and_prompts():
    task = ArithTask(n_train=50, n_test=5)
    ex = task.train_examples()[0]
    spans = task.solution_spans(ex.solution)
    assert "".join(spans) == ex.solution and len(spans) == task.steps + 1
    assert task.prompt(ex) == f"q: {ex.question}\na: "
    assert task.teacher_prompt(ex, "_\nref") == f"q: {ex.question}\nref: _\nref\na: "
    assert isinstance(task, Task)


# ---------------------------------------------------------------------------------------------
# arith: the verifier


@pytest.mark.parametrize("kwargs", [{}, {"ops": ("+", "-", "*"), "steps": 3, "digits": 4}])
def test_gold_solutions_verify_fully(kwargs):
    task = ArithTask(n_train=1000, n_test=20, **kwargs)
    for ex in task.train_examples():
        r = task.verify(ex, ex.solution)
        assert r.correct and r.answer == ex.answer, (ex, r)
        assert r.steps_total > 0 and r.steps_correct == r.steps_total, (ex.solution, r)
        assert r.reward == 1.0


def test_hand_made_gold_counts():
    r = ArithTask(n_train=1, n_test=1).verify(GOLD_EXAMPLE, GOLD)
    # 3 + 3 columns, 2 composites, 2 chain checks.
    assert (r.correct, r.steps_total, r.steps_correct) == (True, 10, 10)


@pytest.mark.parametrize("bad, wrong", [
    (GOLD.replace("4+7+1=12", "4+7+1=13"), 1),  # a column's arithmetic is wrong
    (GOLD.replace("4+7+1=12", "4+7=11"), 1),  # a dropped carry (true arithmetic, wrong column)
    (GOLD.replace("4+7+1=12", "4+6+2=12"), 1),  # right total from the wrong digits
    (GOLD.replace("3-2=1, 2-1=1, 6-0=6", "3-2=1, 6-0=6"), 2),  # a missing column misaligns the rest
    # A wrong composite, and the next step does not start from it (a chain break).
    (GOLD.replace("345+278=623", "345+278=633"), 2),
    # Self-consistent working on the wrong operand (a chain break).
    (GOLD.replace("623-12: 3-2=1, 2-1=1", "623-11: 3-1=2, 2-1=1").replace("623-12=611", "623-11=612"), 1),
])
def test_right_answer_through_wrong_working_is_caught(bad, wrong):
    r = ArithTask(n_train=1, n_test=1).verify(GOLD_EXAMPLE, bad)
    assert r.correct  # the #### line still says 611
    assert r.steps_total - r.steps_correct == wrong, r
    assert r.reward == 0.0 and score(r, "answer") == 1.0 and 0.5 < score(r, "partial") < 1.0


def test_chain_break_and_missing_steps_are_caught():
    task = ArithTask(n_train=1, n_test=1)
    # Starts from a different number: arithmetic is self-consistent, the chain is not.
    wrong_start = "346+277: 6+7=13, 4+7+1=12, 3+2+1=6. 346+277=623\n" + GOLD.split("\n", 1)[1]
    r = task.verify(GOLD_EXAMPLE, wrong_start)
    assert r.correct and r.steps_total - r.steps_correct == 1
    # Only the answer line: nothing checkable written, both chain steps missing.
    r = task.verify(GOLD_EXAMPLE, "#### 611")
    assert r.correct and (r.steps_total, r.steps_correct) == (2, 0)
    # An extra step line counts as a chain break.
    extra = GOLD.replace("\n####", "\n611+0: 1+0=1, 1+0=1, 6+0=6. 611+0=611\n####")
    r = task.verify(GOLD_EXAMPLE, extra)
    assert r.correct and r.steps_total - r.steps_correct == 1


def test_wrong_answer_and_garbage():
    task = ArithTask(n_train=1, n_test=1)
    r = task.verify(GOLD_EXAMPLE, GOLD.replace("#### 611", "#### 612"))
    assert not r.correct and r.answer == "612" and r.steps_correct == r.steps_total
    r = task.verify(GOLD_EXAMPLE, "")
    assert not r.correct and r.answer is None and r.reward == 0.0
    r = task.verify(GOLD_EXAMPLE, "q: 1+1=3 so 5*2-1=9\n#### 611")  # free equations are checked too
    assert r.correct and (r.steps_total, r.steps_correct) == (4, 1)


def test_random_corruptions_of_gold_are_caught():
    task = ArithTask(n_train=300, n_test=5, ops=("+", "-", "*"))
    caught = 0
    for i, ex in enumerate(task.train_examples()):
        # Change one digit of the working (before the #### line).
        working, tail = ex.solution.split("####")
        positions = [j for j, c in enumerate(working) if c.isdigit()]
        j = positions[(7 * i) % len(positions)]
        bad = working[:j] + str((int(working[j]) + 1) % 10) + working[j + 1:] + "####" + tail
        r = task.verify(ex, bad)
        caught += r.steps_correct < r.steps_total
    assert caught == 300


# ---------------------------------------------------------------------------------------------
# User data


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {"question": "What is 2+3?", "solution": "2+3=5.\n#### 5", "answer": "5"},
    {"question": "What is 10*3?", "solution": "10 times 3 is 30.", "answer": 30},
    {"question": "Total of 1,200 and 34?", "solution": "We add them.\nThe total is 1,234."},
    {"question": "Half of 3?", "solution": "3/2 = 1.5", "answer": "\\boxed{1.5}"},
]


def test_jsonl_loading_and_answers(tmp_path):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    task = TextTask(path=path, test_fraction=0.25, seed=1, append_answer_line=True)
    examples = sorted(task.train_examples() + task.test_examples(), key=lambda e: e.uid)
    assert [e.uid for e in examples] == ["d.jsonl:1", "d.jsonl:2", "d.jsonl:3", "d.jsonl:4"]
    assert [e.answer for e in examples] == ["5", "30", "1234", "1.5"]
    assert examples[0].solution == ROWS[0]["solution"]  # already has its #### line
    assert examples[1].solution == "10 times 3 is 30.\n#### 30"  # answer line appended (asked for)
    as_written = TextTask(path=path, test_fraction=0.25, seed=1)  # the default: solutions as written
    assert sorted(e.solution for e in as_written.train_examples() + as_written.test_examples()) == sorted(
        r["solution"] for r in ROWS)
    assert len(task.test_examples()) == 1 and task.skipped == 0
    ex = examples[2]
    assert task.verify(ex, "so the total is \\boxed{1,234}").correct
    r = task.verify(ex, "I think 1233.")
    assert not r.correct and r.steps_total == 0 and r.answer == "1233"
    assert task.prompt(ex).startswith(ex.question + "\n") and "after ####" in task.prompt(ex)
    assert "Here is a reference solution:\nREF\n" in task.teacher_prompt(ex, "REF")
    assert isinstance(task, Task)


def test_test_fraction_is_deterministic_and_test_path(tmp_path):
    rows = [{"question": f"q{i}", "solution": f"#### {i}"} for i in range(40)]
    path = str(write_jsonl(tmp_path / "d.jsonl", rows))
    a, b = TextTask(path=path, test_fraction=0.25, seed=0), TextTask(path=path, test_fraction=0.25, seed=0)
    assert a.test_examples() == b.test_examples() and len(a.test_examples()) == 10
    assert not {e.uid for e in a.train_examples()} & {e.uid for e in a.test_examples()}
    assert TextTask(path=path, test_fraction=0.25, seed=1).test_examples() != a.test_examples()
    t = TextTask(path=path, test_path=str(write_jsonl(tmp_path / "t.jsonl", rows[:3])), max_examples=5)
    assert len(t.train_examples()) == 5
    assert [e.uid for e in t.test_examples()] == ["t.jsonl:1", "t.jsonl:2", "t.jsonl:3"]
    with pytest.raises(DataError, match="no test split"):
        TextTask(path=path).test_examples()


def test_field_renaming_parquet_and_csv(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    renamed = [{"problem": r["question"], "worked": r["solution"]} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "d.parquet")
    task = TextTask(path=str(tmp_path / "d.parquet"), question_field="problem", solution_field="worked",
                    answer_field=None)
    assert [e.answer for e in task.train_examples()] == ["5", "30", "1234", "1.5"]
    assert task.train_examples()[0].uid == "d.parquet:1"

    (tmp_path / "d.csv").write_text('problem,worked,final\n"What is 2+3?","2+3=5",5\n"Sum, please","1+1=2",2\n')
    task = TextTask(path=str(tmp_path / "d.csv"), question_field="problem", solution_field="worked",
                    answer_field="final")
    assert [(e.question, e.answer) for e in task.train_examples()] == [("What is 2+3?", "5"), ("Sum, please", "2")]


def test_saved_dataset_dir_and_build_task(tmp_path):
    import datasets

    rows = [{"question": r["question"], "solution": r["solution"], "answer": str(r.get("answer", ""))} for r in ROWS]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                               "validation": datasets.Dataset.from_list(rows[3:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    task = build_task("text", path=str(tmp_path / "saved"), test_split="validation")
    assert len(task.train_examples()) == 3 and task.test_examples()[0].answer == "1.5"
    assert task.train_examples()[0].uid == "saved/train:1"
    with pytest.raises(DataError, match="no split 'training'"):
        TextTask(path=str(tmp_path / "saved"), train_split="training")
    # A directory of split files, reached through build_task by path.
    (tmp_path / "splits").mkdir()
    write_jsonl(tmp_path / "splits" / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "splits" / "test.jsonl", ROWS[:1])
    task = build_task(str(tmp_path / "splits"))
    assert len(task.train_examples()) == 4 and len(task.test_examples()) == 1
    assert isinstance(build_task("arith", n_train=5, n_test=2), ArithTask)
    with pytest.raises(DataError, match="unknown task 'nope'"):
        build_task("nope")


@pytest.mark.parametrize("row, why", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected an object"),
    ({"solution": "#### 1"}, "missing field 'question'"),
    ({"question": "  ", "solution": "#### 1"}, "field 'question' is empty"),
    ({"question": 7, "solution": "#### 1"}, "field 'question' must be a string, got int"),
    ({"question": "q", "solution": "#### 1", "answer": True}, "field 'answer' must be a string or number"),
])
def test_bad_row_names_file_and_row(tmp_path, row, why):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], row, ROWS[2]])
    with pytest.raises(DataError) as e:
        TextTask(path=str(path))
    assert f"{path}: row 3: " in str(e.value) and why in str(e.value)


def test_a_row_without_an_answer_trains_as_written_and_makes_the_task_unverifiable(tmp_path):
    from tasks import task_capabilities

    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"question": "Give me tips.", "solution": "Here are tips: rest."}])
    task = TextTask(path=str(path))
    tips = task.train_examples()[1]
    assert tips.solution == "Here are tips: rest." and tips.answer == "" and "####" not in tips.solution
    assert task.unanswered == ["d.jsonl:2"] and not task.verifiable
    assert not task_capabilities(task).verifiable
    assert task_capabilities(TextTask(path=str(write_jsonl(tmp_path / "e.jsonl", ROWS[:2])))).verifiable


def test_skip_bad_rows_counts_and_warns(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], "{oops", {"question": "q"}, ROWS[1]])
    with pytest.warns(UserWarning, match=r"skipped 2 bad row\(s\) of 4: row 2: invalid JSON.*row 3: missing"):
        task = TextTask(path=str(path), on_bad_row="skip")
    assert task.skipped == 2 and [e.uid for e in task.train_examples()] == ["bad.jsonl:1", "bad.jsonl:4"]


def test_empty_and_missing_sources_fail_naming_the_path(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=f"{empty}: no examples"):
        TextTask(path=str(empty))
    all_bad = write_jsonl(tmp_path / "allbad.jsonl", ["{x", "{y"])
    with pytest.raises(DataError, match=r"allbad.jsonl: no examples \(all 2 rows were bad"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            TextTask(path=str(all_bad), on_bad_row="skip")
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=f"{missing}: no such file"):
        TextTask(path=str(missing))
    with pytest.raises(DataError, match="on_bad_row"):
        TextTask(path=str(empty), on_bad_row="ignore")


def test_text_spans_join_back(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    task = TextTask(path=str(path))
    for ex in task.train_examples():
        assert "".join(task.solution_spans(ex.solution)) == ex.solution
    one_line = "First we add. Then we double it! So 8.\n#### 8"
    assert task.solution_spans(one_line) == ["First we add. ", "Then we double it! ", "So 8.\n", "#### 8"]
    assert TextTask(path=str(path), span_by="line").solution_spans(one_line) == [
        "First we add. Then we double it! So 8.\n", "#### 8"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_non_utf8_file_is_a_data_error_naming_the_file(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    text = '{"question": "caf\xe9?", "solution": "#### 1"}\n' if suffix == ".jsonl" else "question,solution\ncaf\xe9?,#### 1\n"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(DataError) as e:
        TextTask(path=str(path))
    assert str(path) in str(e.value) and "not UTF-8" in str(e.value) and "0xe9" in str(e.value)
