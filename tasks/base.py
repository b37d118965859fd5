"""The shared vocabulary of every task: examples, verifier results, rewards, answer extraction, prompts.

A task is a dataset plus a verifier. Everything here is plain Python (no torch, no Hydra) so that
the trainer, the algorithms and `evaluate.py` can share one definition of "correct".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, Sequence, runtime_checkable

ANSWER_MARKER = "####"
NUMERIC_TOLERANCE = 1e-6  # absolute: answers are mostly integers, a relative tolerance would equate 1e6 and 1e6+1
SCORE_MODES = ("answer", "steps", "partial")
LENGTH_POLICIES = ("error", "skip", "truncate_left")  # over a length limit (tasks/lengths.py)


class DataError(ValueError):
    """Bad data or a bad data setting; the message names the file (and row) and what is wrong."""


@dataclass(frozen=True)
class Example:
    question: str
    solution: str  # worked solution, ends with the final-answer line "#### N"
    answer: str  # the final answer as text, e.g. "611"
    uid: str  # stable id, e.g. "arith-train-17" or "file.jsonl:42"
    # Reusable context pieces (tables, documents, skills) placed before the question, each of which a
    # position-independent cache encodes once on its own (data=artifacts, a user row's `artifacts` list).
    artifacts: tuple[str, ...] = ()
    # Earlier turns of a conversational row, (role, content) each: a system prompt and any history
    # before the final user turn, which holds the question. Rendered by the chat template, or as
    # plain text before the prompt without one (models/prompts.py).
    turns: tuple[tuple[str, str], ...] = ()
    # A data=chat row as written (tasks/chat.py: its format, prompt and completion); None for other tasks.
    row: Any = field(default=None, compare=False)
    # Every column of the row as read (reward functions receive them); empty for generated tasks.
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Segments:
    """A prompt cut where a position-independent cache needs it: `prefix + artifacts + query` is the
    prompt text. Each piece is tokenized on its own (`add_special_tokens=False`) and the ids
    concatenated, so the full-prefill reference and the cache read exactly the same tokens."""

    prefix: str  # shared text before the artifacts, encoded once ("" = none)
    artifacts: tuple[str, ...]
    query: str  # everything after the artifacts: the question and the answer cue

    def text(self) -> str:
        return self.prefix + "".join(self.artifacts) + self.query


@dataclass
class VerifyResult:
    correct: bool  # final answer equal to the reference answer
    answer: str | None  # the answer extracted from the completion
    steps_total: int = 0  # checkable steps found in the working (0 when the task has no step checker)
    steps_correct: int = 0

    @property
    def step_accuracy(self) -> float:
        return self.steps_correct / self.steps_total if self.steps_total else 1.0

    @property
    def reward(self) -> float:
        """1.0 only for a right answer reached through fully right working (`score(r, "steps")`).

        The strict choice is the default because a tiny model at temperature 1 often lands on the
        right number through wrong working; rewarding that teaches the wrong skill. Tasks without a
        step checker have `steps_total == 0`, so there this is plain answer correctness.
        """
        return score(self, "steps")


def score(result: VerifyResult, mode: str = "steps") -> float:
    """A scalar reward from a verifier result.

    answer:  1 if the final answer is right.
    steps:   1 if the final answer is right and every checked step is right.
    partial: 0.5 * answer correctness + 0.5 * step accuracy.
    """
    if mode == "answer":
        return float(result.correct)
    if mode == "steps":
        return float(result.correct and result.steps_correct == result.steps_total)
    if mode == "partial":
        return 0.5 * float(result.correct) + 0.5 * result.step_accuracy
    raise ValueError(f"unknown score mode {mode!r}; expected one of {SCORE_MODES}")


@dataclass
class TaskConfig:
    """The keys every task has (`data.X` of a run; configs/data/NAME.yaml lists a task's keys with their
    defaults). A task's own config subclasses this, adds its keys, names itself (`name`'s default) and
    builds its task; `tasks.TASK_CONFIGS` registers it. Plain dataclasses: the trainer validates a run's
    `data` section against the selected task's class, so a key another task reads is an unknown key here.

    The prompt keys are applied by the trainer around any task: the tokenizer's chat template
    (`chat_template`, tasks/chat_template.py) and the length limits (tasks/lengths.py)."""

    name: str = ""
    seed: int = 0  # the task's data seed (generated problems, a held-out split)
    # auto | true | false: render every prompt (student, teacher, rollouts, eval) as the user turn of the
    # tokenizer's chat template; auto = when the tokenizer has one (the embedded tiny model has none)
    chat_template: str = "auto"
    # length limits in tokens of the run's prompt ids, applied at data load (tasks/lengths.py): the student
    # prompt, and prompt + reference solution (+ the teacher prompt for algorithms that read the reference);
    # null = the model's positions. length_policy: error | skip | truncate_left (shorten the question's start)
    max_prompt_tokens: Optional[int] = None
    max_length: Optional[int] = None
    length_policy: str = "error"

    task_class: ClassVar[type] = object  # the Task class `build` makes (tasks.TASKS lists them by name)

    def build(self, check_charset: bool = True) -> Any:
        """The configured task. `check_charset`: refuse template characters outside the embedded tiny
        tokenizer's charset (only where the run's model is the embedded tiny one)."""
        raise NotImplementedError(f"{type(self).__name__} builds no task")

    def validate(self) -> None:
        """Value checks of the shared keys; a subclass extends it with its own. ValueError, one line
        naming the key. Normalises `chat_template` to auto | true | false (booleans and their spellings)."""
        from models.prompts import chat_mode

        try:
            self.chat_template = chat_mode(self.chat_template)
        except ValueError as err:
            raise ValueError(f"data.{err}") from None
        if self.length_policy not in LENGTH_POLICIES:
            raise ValueError(f"data.length_policy={self.length_policy} is not one of {', '.join(LENGTH_POLICIES)}")
        for key in ("max_prompt_tokens", "max_length"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"data.{key}={value} must be > 0 (or null: the model's positions)")
        if self.max_prompt_tokens and self.max_length and self.max_prompt_tokens >= self.max_length:
            raise ValueError(f"data.max_prompt_tokens={self.max_prompt_tokens} must be < data.max_length="
                             f"{self.max_length} (the prompt and its reference solution share max_length)")

    def reference_problem(self) -> Optional[str]:
        """Why this configuration gives no reference solutions, or None when its examples carry them
        (checked before any work for algorithms that distil from references)."""
        return None


@dataclass
class PromptTemplates:
    """The prompt-template keys of a task that renders question prompts (not data=clm, whose context file
    is the whole input). None = the task's own prompt."""

    prompt_template: Optional[str] = None  # must contain {question}
    teacher_template: Optional[str] = None  # must contain {question} and {reference}

    def templates(self) -> dict[str, str]:
        """The set templates as task keyword arguments."""
        return {k: v for k, v in (("prompt_template", self.prompt_template),
                                  ("teacher_template", self.teacher_template)) if v is not None}


@runtime_checkable
class Task(Protocol):
    """What the trainer needs from a task. Concrete tasks: `ArithTask`, `ArtifactTask`, `TextTask`."""

    name: str
    mask_token: str  # placeholder MASS writes in place of a masked span

    def train_examples(self) -> Sequence[Example]: ...
    def test_examples(self) -> Sequence[Example]: ...
    def verify(self, example: Example, completion: str) -> VerifyResult: ...
    def prompt(self, example: Example) -> str: ...
    def teacher_prompt(self, example: Example, reference: str) -> str: ...
    def solution_spans(self, solution: str) -> list[str]: ...


@runtime_checkable
class HasArtifacts(Protocol):
    """A task whose prompts hold artifacts: `segments(ex).text() == prompt(ex)` for every example."""

    def segments(self, example: Example) -> Segments: ...


@runtime_checkable
class HasSolutionPaths(Protocol):
    """A task whose worked solutions read as a path of steps (`solution_path(text)`); `several_paths`:
    whether a question has more than one valid path, so a completion may leave its reference's path
    and still be right (multipath; the path diagnostics compare only then)."""

    several_paths: bool

    def solution_path(self, text: str) -> list[tuple[str, int]]: ...


@runtime_checkable
class RendersOwnPrompts(Protocol):
    """A task whose prompt is the whole model input (data=clm: the context file): no chat template is
    put around it, it keeps within its own token budget, and a row grows up to that budget
    (`row_budget(example)`, in tokens)."""

    renders_own_prompts: bool

    def row_budget(self, example: Example) -> int: ...


@runtime_checkable
class MayLackAnswers(Protocol):
    """A task of user data whose rows may have no reference answer (data=chat without data.answer_field,
    data=text rows without one): `verifiable` says whether `verify` means anything for every example.
    Without it the eval reports no accuracy and a verifier reward is refused before any work."""

    verifiable: bool


@runtime_checkable
class TokenizesRows(Protocol):
    """A task whose rows train as written (data=chat): bound to the run's tokenizer (`bind`, with `chat`
    saying whether its chat template renders conversational rows), it gives each example's SFT row as
    (ids, loss mask) and its lengths."""

    def bind(self, tokenizer: Any, chat: bool) -> Any: ...
    def row_tokens(self, example: Example) -> tuple[list[int], list[int]]: ...
    def row_lengths(self, example: Example) -> tuple[int, int]: ...


@dataclass(frozen=True)
class TaskCapabilities:
    """What the trainer and the algorithms may ask of a task beyond the `Task` contract, read from
    its typed protocols in one place (`task_capabilities`), so no call site probes attributes."""

    solution_path: Optional[Callable[[str], list]] = None  # HasSolutionPaths
    several_paths: bool = False
    segments: Optional[Callable[[Example], Segments]] = None  # HasArtifacts
    renders_own_prompts: bool = False  # RendersOwnPrompts
    row_budget: Optional[Callable[[Example], int]] = None  # RendersOwnPrompts: tokens a row grows up to
    row_tokens: Optional[Callable[[Example], tuple[list[int], list[int]]]] = None  # TokenizesRows: (ids, mask)
    row_lengths: Optional[Callable[[Example], tuple[int, int]]] = None  # TokenizesRows: (prompt, whole row) tokens
    verifiable: bool = True  # verify() compares with a reference answer (False: a MayLackAnswers task without them)


def task_capabilities(task: Any) -> TaskCapabilities:
    """`task`'s optional capabilities; TypeError naming the task when a declaration is malformed."""
    paths = isinstance(task, HasSolutionPaths)
    own = isinstance(task, RendersOwnPrompts)
    rows = isinstance(task, TokenizesRows)
    lacks = isinstance(task, MayLackAnswers)
    for key, ok in (("several_paths", not paths or isinstance(task.several_paths, bool)),
                    ("renders_own_prompts", not own or isinstance(task.renders_own_prompts, bool)),
                    ("verifiable", not lacks or isinstance(task.verifiable, bool))):
        if not ok:
            raise TypeError(f"task {type(task).__name__}: {key} must be True or False")
    return TaskCapabilities(solution_path=task.solution_path if paths else None,
                            several_paths=paths and task.several_paths,
                            segments=task.segments if isinstance(task, HasArtifacts) else None,
                            renders_own_prompts=own and task.renders_own_prompts,
                            row_budget=task.row_budget if own and task.renders_own_prompts else None,
                            row_tokens=task.row_tokens if rows else None,
                            row_lengths=task.row_lengths if rows else None,
                            verifiable=not lacks or task.verifiable)


# ---------------------------------------------------------------------------------------------
# Answers

# A number: optional sign (not when glued to a word or digit, so "3-2" is not "-2"), thousands
# groups ("1,234") or plain digits, optional decimals.
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_FRACTION = re.compile(r"^\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")


def _number_text(text: str) -> str | None:
    """The first number in `text` with thousands commas removed, or None."""
    m = _NUMBER.search(text)
    return m.group(0).replace(",", "") if m else None


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution or completion.

    Priority: the first `#### X` line (the number in X, or X itself when it holds none), then the
    last `\\boxed{X}` (same rule; `\\frac{a}{b}` kept whole), then the last number in the text.
    Numbers come back without thousands commas: "1,234" -> "1234".
    """
    marker = text.find(ANSWER_MARKER)
    if marker >= 0:
        line = text[marker + len(ANSWER_MARKER):].split("\n", 1)[0].strip()
        if line:
            return _number_text(line) or line
    boxed = _last_boxed(text)
    if boxed:
        if _FRACTION.match(boxed.replace(" ", "")):
            return boxed
        return _number_text(boxed) or boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def to_number(text: str) -> float | None:
    """Parse "1,234", "-3.5", "$12", "50%", "3/4" or "\\frac{3}{4}" as a float; None if not a number."""
    s = text.strip().replace(",", "").replace(" ", "").lstrip("$").rstrip("%").rstrip(".")
    frac = _FRACTION.match(s) or re.match(r"^(-?[\d.]+)/(-?[\d.]+)$", s)
    try:
        if frac:
            den = float(frac.group(2))
            return float(frac.group(1)) / den if den else None
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def answers_equal(a: str | None, b: str | None) -> bool:
    """Numerically equal within 1e-6 when both parse as numbers; else equal as stripped strings."""
    if a is None or b is None:
        return False
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        return abs(x - y) <= NUMERIC_TOLERANCE
    return a.strip() == b.strip()


# ---------------------------------------------------------------------------------------------
# Prompts and spans


def fill_template(template: str, **values: str) -> str:
    """Replace `{name}` placeholders literally, so other braces (e.g. `\\boxed{}`) are left alone."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def check_template(template: str, required: Sequence[str], what: str) -> str:
    missing = [k for k in required if "{" + k + "}" not in template]
    if missing:
        raise DataError(f"{what} {template!r} lacks the placeholder(s) {', '.join('{' + k + '}' for k in missing)}")
    return template


def hold_out(examples: list[Example], fraction: float, seed: int, path: str) -> tuple[list, list]:
    """(train, test): a seeded random `fraction` of `examples` split off as the test set; both keep the order."""
    import random

    n_test = max(1, round(fraction * len(examples)))
    if n_test >= len(examples):
        raise DataError(f"{path}: test_fraction={fraction} of {len(examples)} examples leaves no training data")
    held = set(random.Random(f"holdout-{seed}").sample(range(len(examples)), n_test))
    return [ex for i, ex in enumerate(examples) if i not in held], [ex for i, ex in enumerate(examples) if i in held]


def mask_spans(spans: Sequence[str], masked: Sequence[bool], mask_token: str) -> str:
    """The reference with every masked span replaced by `mask_token`.

    A span's trailing whitespace (its newline) is kept, so the teacher still sees where each step
    was and how many steps there were.
    """
    if len(spans) != len(masked):
        raise ValueError(f"{len(spans)} spans but {len(masked)} mask flags")
    out = []
    for span, hide in zip(spans, masked):
        if hide:
            body = span.rstrip()
            out.append(mask_token + span[len(body):] if body else span)
        else:
            out.append(span)
    return "".join(out)


def split_lines(text: str) -> list[str]:
    """Lines of `text`, each keeping its newline; blank lines join the line before. Joins back to `text`."""
    spans: list[str] = []
    for line in text.splitlines(keepends=True):
        if spans and not line.strip():
            spans[-1] += line
        else:
            spans.append(line)
    return spans


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, each keeping the whitespace after it. Joins back to `text`."""
    spans, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        spans.append(text[start:m.end()])
        start = m.end()
    if start < len(text):
        spans.append(text[start:])
    return spans


def check_charset(text: str, task: str) -> None:
    """DataError when `text` has characters outside the tiny tokenizer's alphabet (they would become <unk>)."""
    from models.tokenizer import CHARSET  # the tiny tokenizer's alphabet is the source of truth

    bad = sorted(set(text) - set(CHARSET))
    if bad:
        raise DataError(f"{task}: characters {bad!r} are outside the tiny tokenizer's charset "
                        f"(they would become <unk>); pass check_charset=False for another tokenizer")
