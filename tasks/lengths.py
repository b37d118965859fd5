"""Length limits applied when the data is loaded: every example a run sees fits the model.

    task = fit_lengths(task, tokenizer, LengthLimits(max_prompt_tokens=1024, max_length=2048, policy="skip"))

Two limits, in tokens of the run's own prompt ids (`models.prompts.prompt_ids`, chat template and
BOS included), each checked on the train and the test examples:
- `max_prompt_tokens`: the student prompt, which rollouts and evals prefill.
- `max_length`: the prompt with the reference solution and EOS (an SFT row), and, for algorithms
  whose teacher reads the reference (`with_teacher`), the teacher prompt too.
A limit left unset is the model's: its positions (`max_position_embeddings`), less one for the
prompt so at least one token can be generated.

What happens to an example over a limit (`policy`):
- `error`: a `DataError` naming the example (a user file's examples are named `file:row`) and the
  lengths, before anything trains.
- `skip`: the example is dropped; one warning per split gives the count and the first few.
- `truncate_left`: the question is shortened from its start until the example fits (the end of the
  question, next to the answer cue, is kept); an example whose other parts alone do not fit is dropped
  and counted like a skip. One warning per split gives the counts. A data=chat row trains as written,
  so nothing of it is shortened: over a limit, it is dropped and counted.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from models.prompts import continuation_lengths, prompt_lengths
from tasks.base import LENGTH_POLICIES, DataError, Example, task_capabilities

SHOWN = 3  # examples named in a warning


@dataclass(frozen=True)
class LengthLimits:
    max_prompt_tokens: Optional[int] = None  # None: the model's positions less one
    max_length: Optional[int] = None  # None: the model's positions
    policy: str = "error"
    with_teacher: bool = False  # the teacher prompt (question + reference) is bounded by max_length too

    def resolved(self, model_positions: Optional[int]) -> "LengthLimits":
        """The limits with the model's positions filled in where unset (and never above them)."""
        if self.policy not in LENGTH_POLICIES:
            raise DataError(f"data.length_policy={self.policy!r} is not one of {', '.join(LENGTH_POLICIES)}")
        prompt, length = self.max_prompt_tokens, self.max_length
        if model_positions:
            prompt = min(prompt or model_positions - 1, model_positions - 1)
            length = min(length or model_positions, model_positions)
        return dataclasses.replace(self, max_prompt_tokens=prompt, max_length=length)


class LengthFittedTask:
    """`task` whose train and test examples fit `limits` (see the module docstring); the rest is `task`'s."""

    def __init__(self, task: Any, tokenizer: Any, limits: LengthLimits):
        self.task, self.tokenizer, self.limits = task, tokenizer, limits
        self._fitted: dict[str, list[Example]] = {}
        self.dropped: dict[str, int] = {}
        self.truncated: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        task = self.__dict__.get("task")
        if task is None:
            raise AttributeError(name)
        return getattr(task, name)

    def train_examples(self) -> list[Example]:
        return self._split("train", self.task.train_examples)

    def test_examples(self) -> list[Example]:
        return self._split("test", self.task.test_examples)

    def _split(self, split: str, load) -> list[Example]:
        if split not in self._fitted:
            self._fitted[split] = self._fit(split, list(load()))
        return self._fitted[split]

    # -- measuring ----------------------------------------------------------------------------

    def lengths(self, examples: list[Example]) -> tuple[list[int], list[int]]:
        """(prompt tokens, full tokens) of each example: the student prompt, and the longest of prompt +
        solution + EOS and (with_teacher) the teacher prompt."""
        tok, task = self.tokenizer, self.task
        rows = task_capabilities(task).row_lengths
        if rows is not None:  # data=chat: its rows as written (a row's SFT tokens are the whole row)
            prompts, full = (list(x) for x in zip(*(rows(ex) for ex in examples))) if examples else ([], [])
        else:
            prompts = prompt_lengths(tok, [task.prompt(ex) for ex in examples])
            solutions = continuation_lengths(tok, [ex.solution for ex in examples])
            full = [p + s + 1 for p, s in zip(prompts, solutions)]
        if self.limits.with_teacher:
            teachers = prompt_lengths(tok, [task.teacher_prompt(ex, ex.solution) for ex in examples])
            full = [max(f, t) for f, t in zip(full, teachers)]
        return prompts, full

    def _over(self, prompt: int, full: int) -> str | None:
        lim = self.limits
        if lim.max_prompt_tokens is not None and prompt > lim.max_prompt_tokens:
            return f"prompt of {prompt} tokens > data.max_prompt_tokens={lim.max_prompt_tokens}"
        if lim.max_length is not None and full > lim.max_length:
            return f"prompt + reference of {full} tokens > data.max_length={lim.max_length}"
        return None

    # -- fitting ------------------------------------------------------------------------------

    def bounds(self, examples: list[Example]) -> tuple[list[int], list[int]]:
        """Upper bounds of `lengths` without tokenizing: a token covers at least one byte of text (BPE,
        WordPiece, Unigram; special tokens are never added here), plus slack for a BOS and a leading
        word-boundary token."""
        size = lambda text: len(text.encode("utf-8")) + 2  # noqa: E731
        task = self.task
        if task_capabilities(task).row_lengths is not None:  # rows are tokenized as written: measure them
            return self.lengths(examples)
        prompts = [size(task.prompt(ex)) for ex in examples]
        full = [p + size(ex.solution) + 1 for p, ex in zip(prompts, examples)]
        if self.limits.with_teacher:
            full = [max(f, size(task.teacher_prompt(ex, ex.solution))) for f, ex in zip(full, examples)]
        return prompts, full

    def _fit(self, split: str, examples: list[Example]) -> list[Example]:
        # Only examples whose cheap bound exceeds a limit are tokenized (most data is far inside them).
        near = [i for i, (p, f) in enumerate(zip(*self.bounds(examples))) if self._over(p, f)]
        prompts, full = self.lengths([examples[i] for i in near])
        over = {i: why for i, p, f in zip(near, prompts, full) if (why := self._over(p, f))}
        if not over:
            return examples
        policy, name = self.limits.policy, self.task.name
        if policy == "error":
            i, why = next(iter(over.items()))
            more = f" (and {len(over) - 1} more)" if len(over) > 1 else ""
            raise DataError(f"{name} [{split}]: example {examples[i].uid}: {why}{more}; set data.length_policy=skip "
                            "to drop such examples or truncate_left to shorten their questions")
        kept, dropped, truncated = [], [], []
        for i, ex in enumerate(examples):
            if i not in over:
                kept.append(ex)
                continue
            short = self._truncate(ex) if policy == "truncate_left" else None
            if short is None:
                dropped.append(f"{ex.uid} ({over[i]})")
            else:
                kept.append(short)
                truncated.append(ex.uid)
        self.dropped[split], self.truncated[split] = len(dropped), len(truncated)
        parts = []
        if truncated:
            parts.append(f"shortened the question of {len(truncated)} (e.g. {', '.join(truncated[:SHOWN])})")
        if dropped:
            parts.append(f"dropped {len(dropped)} (e.g. {'; '.join(dropped[:SHOWN])})")
        warnings.warn(f"{name} [{split}]: {len(over)} of {len(examples)} examples over the length limits: "
                      + "; ".join(parts), stacklevel=2)
        if not kept:
            raise DataError(f"{name} [{split}]: no example fits the length limits ({len(examples)} over them)")
        return kept

    def _truncate(self, ex: Example) -> Example | None:
        """`ex` with the fewest characters cut from the start of its question that make it fit, or None (always
        for a task whose rows train as written)."""
        if task_capabilities(self.task).row_lengths is not None:
            return None
        def fits(cut: int) -> bool:
            short = dataclasses.replace(ex, question=ex.question[cut:])
            [p], [f] = self.lengths([short])
            return self._over(p, f) is None

        lo, hi = 1, len(ex.question)  # the cut: lengths shrink as it grows
        if not fits(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return dataclasses.replace(ex, question=ex.question[lo:])


def fit_lengths(task: Any, tokenizer: Any, limits: LengthLimits, model_positions: Optional[int] = None) -> Any:
    """`task` with examples fitted to `limits` (unset limits: the model's positions). A task that writes
    its own prompts (data=clm: it keeps its context within its own token budget) is returned as is."""
    if task_capabilities(task).renders_own_prompts:
        return task
    limits = limits.resolved(model_positions)
    if limits.max_prompt_tokens is None and limits.max_length is None:
        return task
    return LengthFittedTask(task, tokenizer, limits)
