"""Tests for tasks/artifacts.py (the table-lookup task) and the artifacts field of user data."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from models.tokenizer import CHARSET
from tasks import ArtifactTask, DataError, Example, HasArtifacts, Segments, Task, TextTask, build_task, kind_of
from tasks.base import score

KIWO = "[kiwo]\nda=17\nfo=83\nmi=40\n"
LEMA = "[lema]\nda=12\nfo=55\nri=30\n"
BOFU = "[bofu]\nda=64\nfo=21\nku=77\n"
SINGLE = Example("kiwo fo?", "kiwo fo=83\n#### 83", "83", "artifacts-test-single-0", (KIWO,))
SELECT = Example("lema fo?", "lema fo=55\n#### 55", "55", "artifacts-test-select-0", (KIWO, BOFU, LEMA))
COMBINE = Example("kiwo fo+lema da?", "kiwo fo=83\nlema da=12\n83+12=95\n#### 95", "95",
                  "artifacts-test-combine-0", (LEMA, KIWO, BOFU))
SMALL = dict(n_train=1500, n_test=30, n_library=300, n_library_ood=100)


@pytest.fixture(scope="module")
def task():
    return ArtifactTask(seed=3, **SMALL)


def tables(example):
    """{name: {key: value}} of a context, parsed here independently of the task's parser."""
    out = {}
    for text in example.artifacts:
        head, *rows = text.rstrip("\n").split("\n")
        out[head.strip("[]")] = {r.split("=")[0]: int(r.split("=")[1]) for r in rows}
    return out


def asked(example):
    """[(table, key)] the question asks: "kiwo fo?" / "kiwo fo+lema da?"."""
    return [tuple(part.split(" ")) for part in example.question.rstrip("?").split("+")]


def all_examples(task):
    return task.train_examples() + task.test_examples() + task.test_examples_ood()


# ---------------------------------------------------------------------------------------------
# Verifier, on hand-built examples


@pytest.mark.parametrize("example, total", [(SINGLE, 2), (SELECT, 2), (COMBINE, 5)])
def test_reference_solutions_verify_fully(task, example, total):
    r = task.verify(example, example.solution)
    assert (r.correct, r.answer, r.steps_total, r.steps_correct) == (True, example.answer, total, total)
    assert score(r, "steps") == 1.0


@pytest.mark.parametrize("example, completion, correct, total, right", [
    (SINGLE, "kiwo fo=84\n#### 84", False, 2, 1),  # wrong value in the lookup line
    (SINGLE, "kiwo mi=40\n#### 40", False, 2, 1),  # a real row, but not the asked key: chain wrong
    (SELECT, "kiwo fo=83\n#### 83", False, 2, 1),  # right value of the wrong table: chain wrong
    (SELECT, "bofu fo=55\n#### 55", True, 2, 0),  # right answer, wrong table name and no such row
    (SELECT, "zuzu fo=55\n#### 55", True, 2, 0),  # a table not in the context
    (COMBINE, "kiwo fo=80\nlema da=12\n80+12=92\n#### 92", False, 5, 4),  # wrong first lookup value
    (COMBINE, "kiwo fo=83\nlema da=13\n83+13=96\n#### 96", False, 5, 4),  # wrong second lookup value
    (COMBINE, "kiwo fo=83\nlema da=12\n83+12=96\n#### 96", False, 5, 4),  # wrong sum
    (COMBINE, "kiwo fo=83\nlema da=12\n83+13=96\n#### 96", False, 5, 4),  # sum of other operands
    (COMBINE, "kiwo fo=83\nlema da=12\n#### 95", True, 5, 4),  # the sum line missing
    (COMBINE, "lema da=12\nkiwo fo=83\n12+83=95\n#### 95", True, 5, 3),  # lookups out of the asked order
    (COMBINE, "bofu fo=21\nlema da=12\n21+12=33\n#### 33", False, 5, 4),  # a wrong table name
    (SINGLE, "hmm\nkiwo fo=83\n#### 83", True, 3, 2),  # a line that is not the format
    (SINGLE, "#### 83", True, 1, 0),  # the answer with no working
    (SINGLE, "kiwo fo=83\nkiwo fo=83\n#### 83", True, 4, 3),  # a repeated lookup: an extra, failed chain step
])
def test_wrong_working_is_caught(task, example, completion, correct, total, right):
    r = task.verify(example, completion)
    assert (r.correct, r.steps_total, r.steps_correct) == (correct, total, right)


def test_generated_references_verify_fully_in_every_split_and_kind(task):
    for split in ("train", "test", "test_ood"):
        for kind in ("single", "select", "combine"):
            examples = task.examples_of(split, kind)
            assert examples
            for ex in examples:
                r = task.verify(ex, ex.solution)
                assert r.correct and r.steps_total == r.steps_correct > 0, (ex.uid, ex.solution)


def test_generated_answers_are_the_looked_up_values(task):
    for ex in all_examples(task):
        values = [tables(ex)[name][key] for name, key in asked(ex)]
        assert ex.answer == str(sum(values))
        assert ex.solution.endswith(f"#### {sum(values)}")


# ---------------------------------------------------------------------------------------------
# Prompts


def test_prompt_is_the_segments_text(task):
    assert isinstance(task, Task) and isinstance(task, HasArtifacts)
    assert task.prompt(SINGLE) == "[kiwo]\nda=17\nfo=83\nmi=40\nq: kiwo fo?\na: "
    assert task.segments(SELECT) == Segments("", (KIWO, BOFU, LEMA), "q: lema fo?\na: ")
    assert task.teacher_prompt(SINGLE, "R") == KIWO + "q: kiwo fo?\nref: R\na: "
    for ex in all_examples(task)[::50]:
        assert task.prompt(ex) == task.segments(ex).text()
        assert all(a.endswith("\n") for a in ex.artifacts)
    headed = ArtifactTask(prefix="tables:\n", **SMALL)
    assert headed.prompt(SINGLE) == "tables:\n" + KIWO + "q: kiwo fo?\na: "
    assert headed.teacher_prompt(SINGLE, "R") == "tables:\n" + KIWO + "q: kiwo fo?\nref: R\na: "
    assert task.solution_spans(COMBINE.solution) == ["kiwo fo=83\n", "lema da=12\n", "83+12=95\n", "#### 95"]


def test_text_stays_in_the_tokenizer_charset_and_short(task):
    text = "".join(task.prompt(ex) + ex.solution for ex in all_examples(task)[::20])
    assert set(text) <= set(CHARSET)
    assert max(len(task.prompt(ex) + ex.solution) for ex in all_examples(task)) < 200
    wide = ArtifactTask(n_artifacts=16, n_train=20, n_test=5, n_library=300, n_library_ood=100)
    assert max(len(wide.prompt(ex) + ex.solution) for ex in all_examples(wide)) < 1024  # one char, one token
    with pytest.raises(DataError, match="charset"):
        ArtifactTask(prefix="Tables\n", **SMALL)


# ---------------------------------------------------------------------------------------------
# Generation and splits


def test_contexts_have_the_kind_size_and_tables_have_the_format(task):
    for ex in all_examples(task):
        kind = kind_of(ex)
        assert len(ex.artifacts) == (1 if kind == "single" else 4)
        assert len(set(tables(ex))) == len(ex.artifacts)  # distinct table names
        for name, rows in tables(ex).items():
            assert len(name) == 4 and len(rows) == 3 and list(rows) == sorted(rows)
            assert all(len(k) == 2 and 10 <= v <= 99 for k, v in rows.items())
        assert len(asked(ex)) == (2 if kind == "combine" else 1)
        if kind == "combine":
            assert asked(ex)[0][0] != asked(ex)[1][0]


def test_select_keys_overlap_so_the_table_name_decides(task):
    selects = [ex for ex in all_examples(task) if kind_of(ex) == "select"]
    assert len(selects) > 100
    for ex in selects:
        (name, key), = asked(ex)
        holders = {n: rows[key] for n, rows in tables(ex).items() if key in rows}
        assert len(holders) >= 2, ex
        assert list(holders.values()).count(holders[name]) == 1, ex  # every other holder has another value
    for ex in (ex for ex in all_examples(task) if kind_of(ex) == "combine"):
        for name, key in asked(ex):
            holders = {n: rows[key] for n, rows in tables(ex).items() if key in rows}
            assert len(holders) >= 2 and list(holders.values()).count(holders[name]) == 1, ex


def test_asked_table_position_is_spread_evenly(task):
    positions = Counter()
    selects = [ex for ex in task.train_examples() if kind_of(ex) == "select"]
    for ex in selects:
        positions[list(tables(ex)).index(asked(ex)[0][0])] += 1
    assert set(positions) == {0, 1, 2, 3}
    assert all(0.18 < positions[p] / len(selects) < 0.32 for p in range(4)), positions


def test_deterministic_by_seed():
    a, b, c = (ArtifactTask(seed=s, **SMALL) for s in (5, 5, 6))
    assert a.train_examples() == b.train_examples() and a.test_examples_ood() == b.test_examples_ood()
    assert a.libraries() == b.libraries()
    assert a.train_examples() != c.train_examples() and a.libraries() != c.libraries()


def test_train_never_sees_a_test_problem(task):
    def key(ex):
        return tuple(sorted(tables(ex))), ex.question

    train = {key(ex) for ex in task.train_examples()}
    assert not train & {key(ex) for ex in task.test_examples()}
    assert len({key(ex) for ex in task.test_examples()}) == len(task.test_examples())  # test problems distinct
    library, held_out = task.libraries()
    assert not {n for n, _ in library} & {n for n, _ in held_out}
    train_tables = {name for ex in task.train_examples() for name in tables(ex)}
    ood_tables = {name for ex in task.test_examples_ood() for name in tables(ex)}
    assert ood_tables and not ood_tables & train_tables
    assert ood_tables <= {n for n, _ in held_out}
    assert {name for ex in task.test_examples() for name in tables(ex)} <= {n for n, _ in library}


def test_splits_kinds_uids_and_mix(task):
    assert len(task.train_examples()) == 1500
    test = task.test_examples()
    assert len(test) == 90 and [kind_of(ex) for ex in test[:6]] == ["single", "select", "combine"] * 2
    assert len(task.examples_of("test_ood", "select")) == 30
    assert task.examples_of("test", "select")[17].uid == "artifacts-test-select-17"
    assert task.examples_of("test_ood", "combine")[0].uid == "artifacts-test_ood-combine-0"
    counts = Counter(kind_of(ex) for ex in task.train_examples())
    assert all(400 < counts[k] < 600 for k in ("single", "select", "combine")), counts
    assert sum(len(task.examples_of("train", k)) for k in counts) == 1500
    with pytest.raises(ValueError, match="not an artifacts-task uid"):
        kind_of(Example("q", "#### 1", "1", "d.jsonl:3"))
    with pytest.raises(DataError, match="examples_of"):
        task.examples_of("dev", "single")
    only = ArtifactTask(kinds={"single": 0, "select": 1, "combine": 0}, **SMALL)
    assert {kind_of(ex) for ex in only.train_examples() + only.test_examples()} == {"select"}
    assert len(only.examples_of("test", "combine")) == 30  # every kind is still there to score


@pytest.mark.parametrize("kwargs, match", [
    (dict(kinds={"lookup": 1.0}), "unknown kind"),
    (dict(kinds={"single": 0.0}), "at least one > 0"),
    (dict(n_artifacts=1), "n_artifacts"),
    (dict(rows=0), "rows"),
    (dict(n_library=9000, n_library_ood=500), "exceeds"),
])
def test_bad_knobs_fail_clearly(kwargs, match):
    with pytest.raises(DataError, match=match):
        ArtifactTask(**{**SMALL, **kwargs})


@pytest.mark.slow  # imports trainer.setup (torch, transformers): seconds
def test_build_task_and_the_data_config():
    from tasks import ArtifactsConfig
    from trainer.setup import build_task_from

    t = build_task_from(ArtifactsConfig(n_train=50, n_test=4, n_artifacts=3, artifact_rows=2,
                                        n_library=100, n_library_ood=40, artifact_prefix="t:\n"))
    assert isinstance(t, ArtifactTask) and t.name == "artifacts"
    ex = t.examples_of("test", "select")[0]
    assert len(ex.artifacts) == 3 and all(len(tables(ex)[n]) == 2 for n in tables(ex))
    assert t.prompt(ex).startswith("t:\n[") and len(t.test_examples()) == 12
    assert isinstance(build_task("artifacts", **SMALL), ArtifactTask)


@pytest.mark.slow  # imports trainer.setup (torch, transformers): seconds
def test_the_charset_check_applies_to_the_tiny_tokenizer_only():
    from tasks import ArithConfig, ArtifactsConfig
    from trainer.config import ModelConfig
    from trainer.setup import build_task_from

    data = ArtifactsConfig(n_train=10, n_test=2, n_artifacts=2, artifact_rows=2, n_library=20,
                           n_library_ood=10, artifact_prefix="Each Table:\n")
    with pytest.raises(DataError, match=r"\['E', 'T'\] are outside the tiny tokenizer's charset"):
        build_task_from(data)  # the embedded tiny model: upper case would become <unk>
    with pytest.raises(DataError, match="outside the tiny tokenizer's charset"):
        build_task_from(data, ModelConfig())
    t = build_task_from(data, ModelConfig(name="hf", path="/some/pretrained"))  # its own tokenizer
    assert t.prompt(t.examples_of("test", "single")[0]).startswith("Each Table:\n[")
    arith = ArithConfig(n_train=10, n_test=2, prompt_template="Q: {question}\nA: ")
    with pytest.raises(DataError, match="outside the tiny tokenizer's charset"):
        build_task_from(arith)
    assert build_task_from(arith, ModelConfig(name="hf", path="/p")).prompt_template.startswith("Q: ")


# ---------------------------------------------------------------------------------------------
# User data: a row's artifacts list (TextTask)


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


ROW = {"question": "kiwo fo?", "solution": "kiwo fo=83\n#### 83", "artifacts": [KIWO, LEMA]}
PLAIN = {"question": "what is 2+3?", "solution": "2+3=5\n#### 5"}


def test_user_rows_carry_artifacts_before_the_question(tmp_path):
    task = TextTask(path=str(write_jsonl(tmp_path / "d.jsonl", [ROW, PLAIN])), prompt_template="q: {question}\na: ",
                    teacher_template="q: {question}\nref: {reference}\na: ")
    with_artifacts, plain = task.train_examples()
    assert with_artifacts.artifacts == (KIWO, LEMA) and plain.artifacts == ()
    assert task.prompt(with_artifacts) == KIWO + LEMA + "q: kiwo fo?\na: "
    assert task.segments(with_artifacts) == Segments("", (KIWO, LEMA), "q: kiwo fo?\na: ")
    assert task.prompt(plain) == "q: what is 2+3?\na: " == task.segments(plain).text()
    assert task.teacher_prompt(with_artifacts, "R") == KIWO + LEMA + "q: kiwo fo?\nref: R\na: "
    renamed = TextTask(path=str(write_jsonl(tmp_path / "r.jsonl", [{**PLAIN, "docs": ["a\n"]}])), artifacts_field="docs")
    assert renamed.train_examples()[0].artifacts == ("a\n",)
    ignored = TextTask(path=str(tmp_path / "d.jsonl"), artifacts_field=None)
    assert ignored.train_examples()[0].artifacts == ()


@pytest.mark.parametrize("artifacts, why", [
    (KIWO, "field 'artifacts' must be a list of strings, got str"),
    ({"t": KIWO}, "field 'artifacts' must be a list of strings, got dict"),
    ([KIWO, 7], "field 'artifacts': item 1 must be a string, got int"),
    ([" \n"], "field 'artifacts': item 0 is empty"),
])
def test_bad_artifacts_name_file_and_row(tmp_path, artifacts, why):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROW, PLAIN, {**ROW, "artifacts": artifacts}])
    with pytest.raises(DataError) as e:
        TextTask(path=str(path))
    assert str(e.value) == f"{path}: row 3: {why}"
