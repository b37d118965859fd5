"""A task added the way docs/adding-a-task.md says: this one file (the task and its config) plus one
registration, which the tests make with `register_copy_task` (a real task adds its config class to
`tasks.TASK_CONFIGS`). The task: copy a string of digits, answer after "####"."""
from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.base import (
    ANSWER_MARKER,
    Example,
    PromptTemplates,
    TaskConfig,
    VerifyResult,
    answers_equal,
    check_template,
    extract_answer,
    fill_template,
    split_lines,
)


class CopyTask:
    """Copy `length` digits: "q: copy 4821\\na: " -> "4821\\n#### 4821"."""

    name = "copy"
    mask_token = "_"

    def __init__(self, seed: int = 0, n_train: int = 64, n_test: int = 8, length: int = 4,
                 prompt_template: str | None = None, teacher_template: str | None = None):
        self.prompt_template = check_template(prompt_template or "q: copy {question}\na: ", ["question"],
                                              "prompt_template")
        self.teacher_template = check_template(teacher_template or "q: copy {question}\nref: {reference}\na: ",
                                               ["question", "reference"], "teacher_template")
        rng = random.Random(seed)
        rows = [self._example(rng, length, i) for i in range(n_train + n_test)]
        self._train, self._test = rows[:n_train], rows[n_train:]

    @staticmethod
    def _example(rng: random.Random, length: int, i: int) -> Example:
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        return Example(digits, f"{digits}\n{ANSWER_MARKER} {digits}", digits, f"copy-{i}")

    def train_examples(self) -> list[Example]:
        return self._train

    def test_examples(self) -> list[Example]:
        return self._test

    def prompt(self, example: Example) -> str:
        return fill_template(self.prompt_template, question=example.question)

    def teacher_prompt(self, example: Example, reference: str) -> str:
        return fill_template(self.teacher_template, question=example.question, reference=reference)

    def solution_spans(self, solution: str) -> list[str]:
        return split_lines(solution)

    def verify(self, example: Example, completion: str) -> VerifyResult:
        answer = extract_answer(completion)
        return VerifyResult(answers_equal(answer, example.answer), answer)


@dataclass
class CopyConfig(PromptTemplates, TaskConfig):
    """data=copy: its keys are these plus the shared ones (seed, chat_template, the length limits)."""

    name: str = "copy"
    n_train: int = 64
    n_test: int = 8
    length: int = 4  # digits to copy

    task_class = CopyTask

    def validate(self) -> None:
        super().validate()
        if self.length < 1:
            raise ValueError(f"data.length={self.length} must be >= 1")

    def build(self, check_charset: bool = True) -> CopyTask:
        return CopyTask(seed=self.seed, n_train=self.n_train, n_test=self.n_test, length=self.length,
                        **self.templates())


def register_copy_task(monkeypatch) -> None:
    """The one registration, undone after the test."""
    import tasks

    monkeypatch.setitem(tasks.TASK_CONFIGS, CopyConfig.name, CopyConfig)
    monkeypatch.setitem(tasks.TASKS, CopyConfig.name, CopyTask)
