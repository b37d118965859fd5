"""`multipath`: arithmetic word problems with several valid worked solutions.

The sibling of `arith` (same column working, same verifier per line) where the order of the
operations is free: a start amount and `steps` gains / losses (default 2: sums and differences of 3
numbers) that may be applied in any order, as long as the running amount never goes negative.

    task = MultiPathTask(seed=0, digits=2, steps=3)
    ex = task.train_examples()[0]
    task.valid_paths(ex)    # every order the verifier accepts, e.g. [(("+", 23), ("-", 12), ("+", 31)), ...]

Question (steps=3): "tom has 45 apples. he gets 23 more, gives away 12 and finds 31 more. how many apples?"

Two of its valid worked solutions (the reference is one valid order drawn at random per problem):

    45+23: 5+3=8, 4+2=6. 45+23=68            45-12: 5-2=3, 4-1=3. 45-12=33
    68-12: 8-2=6, 6-1=5. 68-12=56            33+31: 3+1=4, 3+3=6. 33+31=64
    56+31: 6+1=7, 5+3=8. 56+31=87            64+23: 4+3=7, 6+2=8. 64+23=87
    #### 87                                   #### 87

Verification is arith's (module docstring of tasks/arith.py) except the chain: step i is right when
it starts from the previous written result (the question's start amount for the first step), uses an
operation of the question not used yet (each once), and does not take the amount below 0. So every
valid order scores full marks, and a step that repeats, invents or skips an operation, starts from
the wrong amount or goes negative is one wrong check.

Why it exists: a teacher shown one reference solution tends to follow that reference's order. On
`arith` there is one order, so a student that differs from the reference has made a mistake; here a
student's own valid order differs from the reference's on most problems, which is the situation
self-distillation with masked reference views (MASS) is built for. `solution_path` gives the order a
text takes, so a trainer can tell on-reference-path tokens from off-path ones.
"""
from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from tasks.arith import (
    ITEMS,
    NAMES,
    PHRASES,
    ArithConfig,
    ArithTask,
    Step,
    apply_op,
    check_lines,
    format_solution,
    parse_steps,
)
from tasks.base import DataError, Example, VerifyResult, answers_equal, extract_answer

MULTIPATH_OPS = ("+", "-")


def valid_orders(start: int, ops: Sequence[tuple[str, int]]) -> list[tuple[tuple[str, int], ...]]:
    """Every distinct order of `ops` whose running amount from `start` never goes below 0."""
    out = []
    for order in sorted(set(itertools.permutations(ops))):
        value = start
        for op, b in order:
            value = apply_op(value, op, b)
            if value < 0:
                break
        else:
            out.append(order)
    return out


def steps_of(start: int, order: Sequence[tuple[str, int]]) -> list[Step]:
    steps, value = [], start
    for op, b in order:
        steps.append(Step(value, op, b))
        value = steps[-1].result()
    return steps


def check_chain_any_order(written: Sequence[tuple[Step, int | None]], start: int,
                          ops: Sequence[tuple[str, int]]) -> tuple[int, int]:
    """(checks, right) of the chain: one check per step (max of expected and written steps); a written
    step is right when it starts from the previous written result, uses a not-yet-used operation of
    `ops` and keeps the amount >= 0."""
    remaining = Counter(ops)
    right, prev = 0, start
    for step, result in written:
        key = (step.op, step.b)
        if step.a == prev and remaining[key] > 0 and step.result() >= 0:
            remaining[key] -= 1
            right += 1
        prev = result
    return max(len(ops), len(written)), right


class MultiPathTask(ArithTask):
    """Word problems whose operations may be applied in any valid order (module docstring).

    Knobs as `ArithTask`, with `ops` a subset of + and - (they commute; "*" would not) and `steps`
    (default 2) the number of gains / losses. The reference solution of each problem is one valid
    order drawn at random; train and test never share a problem (same start and the same operations
    in any order).
    """

    several_paths = True  # a completion may take another valid order than its reference (paths/* metrics)

    def __init__(self, seed: int = 0, n_train: int = 20000, n_test: int = 200, digits: int = 2,
                 min_digits: int = 1, steps: int = 2, ops: Sequence[str] = MULTIPATH_OPS,
                 prompt_template: str | None = None, teacher_template: str | None = None,
                 mask_token: str | None = None, check_charset: bool = True, name: str = "multipath"):
        ops = tuple(ops)
        if not ops or any(op not in MULTIPATH_OPS for op in ops):
            raise DataError(f"multipath: ops must be a non-empty subset of {MULTIPATH_OPS} (operations that "
                            f"commute), got {ops}")
        if steps < 2:
            raise DataError(f"multipath: steps={steps} gives one order only; need steps >= 2")
        super().__init__(seed=seed, n_train=n_train, n_test=n_test, digits=digits, min_digits=min_digits, steps=steps,
                         ops=ops, prompt_template=prompt_template, teacher_template=teacher_template,
                         mask_token=mask_token, check_charset=check_charset, name=name)

    # -- generation -----------------------------------------------------------------------------

    def _example(self, rng: random.Random, steps: list[Step], uid: str) -> Example:
        name, pronoun = rng.choice(NAMES)
        item = rng.choice(ITEMS)
        phrases = [rng.choice(PHRASES[s.op]).format(n=s.b) for s in steps]
        actions = ", ".join(phrases[:-1]) + " and " + phrases[-1]
        question = f"{name} has {steps[0].a} {item}. {pronoun} {actions}. how many {item}?"
        # The question order is valid by construction (_problem keeps the amount >= 0), so there is one.
        order = rng.choice(valid_orders(steps[0].a, [(s.op, s.b) for s in steps]))
        chosen = steps_of(steps[0].a, order)
        return Example(question, format_solution(chosen), str(chosen[-1].result()), uid)

    @staticmethod
    def _problem_key(steps: Sequence[Step]) -> tuple:
        return (steps[0].a,) + tuple(sorted((s.op, s.b) for s in steps))

    # -- paths and verification -------------------------------------------------------------------

    @staticmethod
    def start_and_ops(example: Example) -> tuple[int, list[tuple[str, int]]]:
        """The question's start amount and its operations, read from the reference solution."""
        steps = [s for s, _ in parse_steps(example.solution)]
        return steps[0].a, [(s.op, s.b) for s in steps]

    def valid_paths(self, example: Example) -> list[tuple[tuple[str, int], ...]]:
        return valid_orders(*self.start_and_ops(example))

    def verify(self, example: Example, completion: str) -> VerifyResult:
        start, ops = self.start_and_ops(example)
        total, right, written = check_lines(completion)
        chain_total, chain_right = check_chain_any_order(written, start, ops)
        answer = extract_answer(completion)
        return VerifyResult(answers_equal(answer, example.answer), answer, total + chain_total, right + chain_right)


@dataclass
class MultiPathConfig(ArithConfig):
    """data=multipath (configs/data/multipath.yaml): arith's keys, problems with several valid orders.
    `ops` is a subset of + and - (operations that commute)."""

    name: str = "multipath"

    task_class = MultiPathTask
