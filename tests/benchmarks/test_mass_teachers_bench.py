"""benchmarks/mass_teachers.py scores teachers against the task's valid next tokens: the valid
solutions of a multipath question are every valid order (by hand), of an arith question its reference."""
from __future__ import annotations

import sys
from types import SimpleNamespace

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import mass_teachers  # noqa: E402
from tasks import build_task  # noqa: E402
from tasks.arith import format_solution  # noqa: E402
from tasks.base import Example  # noqa: E402
from tasks.multipath import MultiPathTask, steps_of  # noqa: E402


class Tok:
    """Characters as ids, EOS 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(ch) for ch in text])


def test_valid_solutions_are_every_valid_order_on_multipath_and_the_reference_on_arith():
    task = MultiPathTask(n_train=4, n_test=2)
    # 45 +23 -12: both orders keep the amount >= 0
    reference = format_solution(steps_of(45, [("+", 23), ("-", 12)]))
    other = format_solution(steps_of(45, [("-", 12), ("+", 23)]))
    ex = Example("q", reference, "56", "u")
    solutions, ref = mass_teachers.valid_solutions(task, ex, Tok())
    assert ref == [ord(ch) for ch in reference] + [0]
    assert sorted(solutions) == sorted([[ord(ch) for ch in s] + [0] for s in (reference, other)])
    # 5 -7 +3: subtracting first would go below 0, one order only
    one = format_solution(steps_of(5, [("+", 3), ("-", 7)]))
    assert mass_teachers.valid_solutions(task, Example("q", one, "1", "v"), Tok())[0] == [[ord(ch) for ch in one] + [0]]
    arith = build_task("arith", n_train=4, n_test=2)
    ex = arith.train_examples()[0]
    assert mass_teachers.valid_solutions(arith, ex, Tok())[0] == [[ord(ch) for ch in ex.solution] + [0]]
