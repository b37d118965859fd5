"""`text`: user data — question / solution / answer rows from local files, a saved dataset or the hub.

    task = TextTask(path="data/train.jsonl", test_path="data/test.jsonl")
    task = TextTask(path="data/all.parquet", test_fraction=0.1, question_field="problem")
    task = TextTask(path="openai/gsm8k", hub_config="main", solution_field="answer", answer_field=None)

Sources (by what `path` is):
- a file: `.jsonl` / `.ndjson` / `.json` (JSON lines or one JSON array), `.parquet`, `.csv` / `.tsv`.
  A file is one split.
- a directory written by `datasets.save_to_disk` (a `DatasetDict` gives named splits, a `Dataset`
  one split), or a directory holding `<split>.jsonl|json|parquet|csv` files.
- anything else that does not exist locally and does not look like a file path is treated as a
  `datasets` hub name (`datasets.load_dataset(path, hub_config)`); that needs a network.
The test split comes from, in order: `test_path`, `test_fraction` (held out from train, chosen by
`seed`), the source's `test_split`. Without any, `test_examples()` raises `DataError`.

Rows: `question_field` and `solution_field` must be non-empty strings. `answer_field` may be absent
(or `None`): then the answer is extracted from the solution (`extract_answer`). An answer holding a
`####` or `\\boxed{}` is reduced to what they mark. A row with no answer either way is kept with the
answer "" and listed in `unanswered`; the task is then not `verifiable` (no eval accuracy, and an
algorithm whose reward is the verifier refuses it before any work). A solution is trained as written;
with `append_answer_line` one without a `####` line gets `#### <answer>` appended, so every solution
ends the way the default prompt asks.
`solution_field=None` makes the solution just that answer line (for RL-only data).
Artifacts: a row may carry `artifacts_field` (default "artifacts"): a list of non-empty strings
(tables, documents, skills) that becomes `Example.artifacts` and is placed, concatenated as given,
before the templated question (`segments`: no prefix, the artifacts, the filled prompt template), so
end each with a newline. Rows without the field (or with null) get `()`; `artifacts_field=None`
ignores the field. A list from a CSV cell is not possible (a cell is a string, which is refused).
A bad row raises `DataError` naming the file and 1-based row (JSON lines: the line number; CSV: the
data row, header not counted), or with `on_bad_row="skip"` is counted in `task.skipped` and warned.
Conversational rows: a row without a string `question_field` may instead hold `messages` (a list of
{"role", "content"} turns, a final assistant turn being the solution) or `prompt` as a list of turns
with an optional `completion` (one assistant turn or a string). The last prompt turn must be the
user's: it is the question; the turns before it become `Example.turns`, rendered before the prompt
as plain text here and as turns by a chat template (`tasks/chat_template.py`).
The verifier checks the final answer only (`steps_total == 0`).
"""
from __future__ import annotations

import csv
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from tasks.base import (
    ANSWER_MARKER,
    DataError,
    Example,
    PromptTemplates,
    Segments,
    TaskConfig,
    VerifyResult,
    answers_equal,
    check_template,
    extract_answer,
    fill_template,
    hold_out,
    split_lines,
    split_sentences,
)
from models.prompts import ROLES, plain_turns

INSTRUCTION = "Please reason step by step, and put your final answer after ####."
TEXT_PROMPT = "{question}\n" + INSTRUCTION + "\n"
TEXT_TEACHER_PROMPT = (
    "{question}\nHere is a reference solution:\n{reference}\n"
    "After understanding the reference solution, solve the problem yourself. " + INSTRUCTION + "\n"
)
TEXT_MASK_TOKEN = "[...]"
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
FILE_SUFFIXES = JSON_SUFFIXES + (".parquet", ".pq", ".csv", ".tsv")
MIN_LINE_SPANS = 3  # span_by="auto": fewer lines than this (answer line included) -> split sentences
SKIP_REASONS_SHOWN = 3
ON_BAD_ROW = ("error", "skip")
SPAN_BY = ("auto", "line", "sentence")


class _BadRow(Exception):
    """A row that cannot become an Example; the message says what is wrong."""


# ---------------------------------------------------------------------------------------------
# Reading rows: each source yields (1-based row number, raw row); a raw row may be a _BadRow.

Rows = list[tuple[int, Any]]


def _read_json(path: Path) -> Rows:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON array: {e}") from None
    rows: Rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            rows.append((n, _BadRow(f"invalid JSON ({e.msg} at column {e.colno})")))
    return rows


def _read_csv(path: Path) -> Rows:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
        return [(n, row) for n, row in enumerate(reader, start=1)]


def _read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq

    return list(enumerate(pq.read_table(path).to_pylist(), start=1))


def _read_file(path: Path) -> Rows:
    try:
        return _read_by_suffix(path)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        "save the file as UTF-8") from None


def _read_by_suffix(path: Path) -> Rows:
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _read_json(path)
    if suffix in (".csv", ".tsv"):
        return _read_csv(path)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path)
    raise DataError(f"{path}: unsupported file type {suffix!r}; expected one of {FILE_SUFFIXES}")


def _dataset_rows(ds: Any) -> Callable[[], Rows]:
    return lambda: list(enumerate(ds.to_list(), start=1))


def open_source(path: str, hub_config: str | None = None) -> dict[str | None, Callable[[], Rows]]:
    """Split name -> row loader for `path`; a single-split source has the one key None."""
    p = Path(path).expanduser()
    if p.is_file():
        return {None: lambda: _read_file(p)}
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            import datasets

            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                return {name: _dataset_rows(split) for name, split in ds.items()}
            return {None: _dataset_rows(ds)}
        files = {f.stem: f for f in sorted(p.iterdir()) if f.suffix.lower() in FILE_SUFFIXES}
        if not files:
            raise DataError(f"{path}: directory holds neither a saved dataset nor {FILE_SUFFIXES} files")
        return {stem: (lambda f=f: _read_file(f)) for stem, f in files.items()}
    if p.suffix.lower() in FILE_SUFFIXES or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise DataError(f"{path}: no such file or directory")
    return _open_hub(path, hub_config)


def _open_hub(name: str, hub_config: str | None) -> dict[str | None, Callable[[], Rows]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, hub_config)
    except Exception as e:  # offline, unknown name, bad config: all end here with the name attached
        raise DataError(f"{name}: not a local file or directory, and loading it from the hub failed: "
                        f"{type(e).__name__}: {e}") from e
    return {split: _dataset_rows(d) for split, d in ds.items()}


# ---------------------------------------------------------------------------------------------
# The task


class TextTask:
    """Question/solution/answer data from files or `datasets` (see the module docstring)."""

    def __init__(self, path: str, test_path: str | None = None, train_split: str = "train",
                 test_split: str = "test", test_fraction: float = 0.0, seed: int = 0,
                 question_field: str = "question", solution_field: str | None = "solution",
                 answer_field: str | None = "answer", on_bad_row: str = "error",
                 max_examples: int | None = None, max_test_examples: int | None = None,
                 hub_config: str | None = None, prompt_template: str | None = None,
                 teacher_template: str | None = None, mask_token: str | None = None,
                 append_answer_line: bool = False, span_by: str = "auto", name: str | None = None,
                 artifacts_field: str | None = "artifacts"):
        if on_bad_row not in ON_BAD_ROW:
            raise DataError(f"on_bad_row must be one of {ON_BAD_ROW}, got {on_bad_row!r}")
        if span_by not in SPAN_BY:
            raise DataError(f"span_by must be one of {SPAN_BY}, got {span_by!r}")
        if not 0.0 <= test_fraction < 1.0:
            raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
        self.name = name or Path(path).stem or path
        self.path, self.on_bad_row, self.span_by = path, on_bad_row, span_by
        self.fields = (question_field, solution_field, answer_field)
        self.artifacts_field = artifacts_field
        self.append_answer_line = append_answer_line
        self.prompt_template = check_template(prompt_template or TEXT_PROMPT, ["question"], "prompt_template")
        self.teacher_template = check_template(
            teacher_template or TEXT_TEACHER_PROMPT, ["question", "reference"], "teacher_template")
        self.mask_token = mask_token or TEXT_MASK_TOKEN
        self.skipped = 0
        self.unanswered: list[str] = []  # uids of rows with no answer (then `verifiable` is False)

        source = open_source(path, hub_config)
        train_key = None if None in source else train_split
        if train_key not in source:
            raise DataError(f"{path}: no split {train_split!r}; it has {sorted(source)}")
        train = self._examples(source[train_key](), path, train_key)
        test: list[Example] | None = None
        if test_path:
            test_source = open_source(test_path, hub_config)
            test_key = None if None in test_source else test_split
            if test_key not in test_source:
                raise DataError(f"{test_path}: no split {test_split!r}; it has {sorted(test_source)}")
            test = self._examples(test_source[test_key](), test_path, test_key)
        elif test_fraction > 0:
            train, test = hold_out(train, test_fraction, seed, path)
        elif None not in source and test_split in source:
            test = self._examples(source[test_split](), path, test_split)
        self._train = train[:max_examples] if max_examples is not None else train
        self._test = test[:max_test_examples] if test is not None and max_test_examples is not None else test

    # -- loading ------------------------------------------------------------------------------

    def _examples(self, rows: Rows, path: str, split: str | None) -> list[Example]:
        where = f"{path}" if split is None else f"{path} [{split}]"
        prefix = Path(path).name + ("" if split is None else f"/{split}")
        examples, bad = [], []
        for n, row in rows:
            try:
                examples.append(self._to_example(row, f"{prefix}:{n}"))
            except _BadRow as e:
                if self.on_bad_row == "error":
                    raise DataError(f"{where}: row {n}: {e}") from None
                bad.append(f"row {n}: {e}")
        if bad:
            self.skipped += len(bad)
            shown = "; ".join(bad[:SKIP_REASONS_SHOWN]) + ("; ..." if len(bad) > SKIP_REASONS_SHOWN else "")
            warnings.warn(f"{where}: skipped {len(bad)} bad row(s) of {len(rows)}: {shown}", stacklevel=3)
        if not examples:
            why = f" (all {len(bad)} rows were bad and skipped)" if bad else ""
            raise DataError(f"{where}: no examples{why}")
        return examples

    def _to_example(self, row: Any, uid: str) -> Example:
        if isinstance(row, _BadRow):
            raise row
        if not isinstance(row, dict):
            raise _BadRow(f"expected an object with fields, got {type(row).__name__}")
        q_field, s_field, a_field = self.fields
        turns, question, completion = _conversation(row, q_field)
        answer = _answer(row, a_field)
        if completion is not None:
            solution = completion
        elif s_field is None:
            if answer is None:
                raise _BadRow(f"no answer in field {a_field!r} and no solution field to extract it from")
            solution = f"{ANSWER_MARKER} {answer}"
        else:
            solution = _text(row, s_field)
        if answer is None:
            answer = extract_answer(solution)
            if answer is None:  # trainable as written; only a verifier needs one (`verifiable`)
                self.unanswered.append(uid)
                return Example(question, solution, "", uid, _artifacts(row, self.artifacts_field), turns)
        if self.append_answer_line and ANSWER_MARKER not in solution:
            solution = f"{solution.rstrip()}\n{ANSWER_MARKER} {answer}"
        return Example(question, solution, answer, uid, _artifacts(row, self.artifacts_field), turns)

    @property
    def verifiable(self) -> bool:
        """Whether every row has a reference answer (`verify` means something for each)."""
        return not self.unanswered

    # -- the Task protocol --------------------------------------------------------------------

    def train_examples(self) -> list[Example]:
        return self._train

    def test_examples(self) -> list[Example]:
        if self._test is None:
            raise DataError(f"{self.path}: no test split; give test_path, test_fraction or a source "
                            f"with a test split")
        return self._test

    def segments(self, example: Example) -> Segments:
        """A conversational row's earlier turns (plain text here; a chat template renders them as turns)
        are the shared prefix, then the artifacts, then the templated question."""
        return Segments(plain_turns(example.turns), example.artifacts,
                        fill_template(self.prompt_template, question=example.question))

    def prompt(self, example: Example) -> str:
        return self.segments(example).text()

    def teacher_prompt(self, example: Example, reference: str) -> str:
        query = fill_template(self.teacher_template, question=example.question, reference=reference)
        return plain_turns(example.turns) + "".join(example.artifacts) + query

    def solution_spans(self, solution: str) -> list[str]:
        """Lines ("line"), sentences within lines ("sentence"), or lines unless there are too few ("auto")."""
        lines = split_lines(solution)
        if self.span_by == "line" or (self.span_by == "auto" and len(lines) >= MIN_LINE_SPANS):
            return lines
        return [s for line in lines for s in split_sentences(line)]

    def verify(self, example: Example, completion: str) -> VerifyResult:
        answer = extract_answer(completion)
        return VerifyResult(answers_equal(answer, example.answer), answer, 0, 0)


def _conversation(row: dict, question_field: str) -> tuple[tuple[tuple[str, str], ...], str, str | None]:
    """(earlier turns, question, the assistant's reply or None) of a row.

    A row whose `question_field` holds a string is a plain row: no turns, no reply here. Otherwise a
    conversational row in the dataset formats of chat fine-tuning: `messages` (a list of turns; a
    final assistant turn is the reply) or `prompt` as a list of turns with an optional `completion`
    (a list holding one assistant turn, or a string). The last prompt turn must be the user's: its
    content is the question; the turns before it (a system prompt, history) are kept."""
    if isinstance(row.get(question_field), str) or not (
            isinstance(row.get("messages"), list) or isinstance(row.get("prompt"), list)):
        return (), _text(row, question_field), None
    if isinstance(row.get("messages"), list):
        turns, reply = _turns(row["messages"], "messages"), None
        if turns and turns[-1][0] == "assistant":
            turns, reply = turns[:-1], turns[-1][1]
        where = "messages"
    else:
        turns, reply, where = _turns(row["prompt"], "prompt"), _completion(row.get("completion")), "prompt"
    if not turns or turns[-1][0] != "user":
        raise _BadRow(f"field {where!r}: the last prompt turn must be the user's (it holds the question), got "
                      f"{turns[-1][0] if turns else 'no turns'}")
    return tuple(turns[:-1]), turns[-1][1], reply


def _turns(value: list, field: str) -> list[tuple[str, str]]:
    out = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise _BadRow(f"field {field!r}: turn {i} must be an object with a 'role' and a 'content'")
        role, content = turn["role"], turn.get("content")
        if role not in ROLES:
            raise _BadRow(f"field {field!r}: turn {i} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str) or not content.strip():
            raise _BadRow(f"field {field!r}: turn {i} ({role}) must have non-empty text content")
        out.append((role, content))
    return out


def _completion(value: Any) -> str | None:
    """A conversational row's `completion`: a string, or a list holding one assistant turn; None when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow("field 'completion' is empty")
        return value
    if isinstance(value, list):
        turns = _turns(value, "completion")
        if len(turns) != 1 or turns[0][0] != "assistant":
            raise _BadRow("field 'completion' must hold exactly one assistant turn")
        return turns[0][1]
    raise _BadRow(f"field 'completion' must be a string or a list of turns, got {type(value).__name__}")


def _text(row: dict, field: str) -> str:
    if field not in row or row[field] is None:
        raise _BadRow(f"missing field {field!r} (row has {sorted(k for k in row if k is not None)})")
    value = row[field]
    if not isinstance(value, str):
        raise _BadRow(f"field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _BadRow(f"field {field!r} is empty")
    return value


def _artifacts(row: dict, field: str | None) -> tuple[str, ...]:
    """The row's artifacts: a list of non-empty strings in `field`; () when the row has none."""
    value = row.get(field) if field is not None else None
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _BadRow(f"field {field!r} must be a list of strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise _BadRow(f"field {field!r}: item {i} must be a string, got {type(item).__name__}")
        if not item.strip():
            raise _BadRow(f"field {field!r}: item {i} is empty")
    return tuple(value)


def _answer(row: dict, field: str | None) -> str | None:
    """The row's answer as text, or None when the row has none (then the solution supplies it)."""
    value = row.get(field) if field is not None else None
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadRow(f"field {field!r} must be a string or number, got {type(value).__name__}")
    text = str(value).strip()
    if ANSWER_MARKER in text or "\\boxed" in text:
        text = extract_answer(text) or text
    return text


@dataclass
class TextConfig(PromptTemplates, TaskConfig):
    """data=text (configs/data/text.yaml): user data with configurable field names. `seed` seeds the
    test_fraction split."""

    name: str = "text"
    path: Optional[str] = None  # required: FILE | DIR | HUB_NAME
    test_path: Optional[str] = None  # held-out file; None = test_fraction of path, else its test_split
    train_split: str = "train"
    test_split: str = "test"
    test_fraction: float = 0.0  # > 0 (and no test_path): hold out this share of the training rows
    question_field: str = "question"
    solution_field: Optional[str] = "solution"  # worked solutions; None when the data has none
    answer_field: str = "answer"
    on_bad_row: str = "error"  # error | skip
    max_examples: Optional[int] = None
    artifacts_field: Optional[str] = "artifacts"  # a row's list of artifact strings, placed before the question
    append_answer_line: bool = False  # true: a solution without a #### line gets "#### <answer>" appended

    task_class = TextTask

    def validate(self) -> None:
        super().validate()
        if self.on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"data.on_bad_row={self.on_bad_row} is not one of {', '.join(ON_BAD_ROW)}")
        if not self.path:
            raise ValueError("data=text needs data.path=FILE|DIR|HUB_NAME")

    def reference_problem(self) -> Optional[str]:
        if not self.solution_field:
            return "data.solution_field is empty: set it to the field holding worked solutions"
        return None

    def build(self, check_charset: bool = True) -> TextTask:
        return TextTask(path=self.path, test_path=self.test_path, train_split=self.train_split,
                        test_split=self.test_split, test_fraction=self.test_fraction, seed=self.seed,
                        question_field=self.question_field, solution_field=self.solution_field,
                        answer_field=self.answer_field, on_bad_row=self.on_bad_row, max_examples=self.max_examples,
                        artifacts_field=self.artifacts_field, append_answer_line=self.append_answer_line,
                        **self.templates())
