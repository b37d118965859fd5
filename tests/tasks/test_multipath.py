"""Tests for tasks/multipath.py: several valid solution orders, each verified step by step."""
from __future__ import annotations

from collections import Counter

import pytest

from tasks import ArithTask, DataError, Example, MultiPathTask, build_task
from tasks.arith import Step, format_solution
from tasks.multipath import steps_of, valid_orders

QUESTION = "tom has 45 apples. he gets 23 more, gives away 12 and finds 31 more. how many apples?"
# The reference is one of the six valid orders; the others below are written out by hand.
REFERENCE = """45+23: 5+3=8, 4+2=6. 45+23=68
68-12: 8-2=6, 6-1=5. 68-12=56
56+31: 6+1=7, 5+3=8. 56+31=87
#### 87"""
EXAMPLE = Example(QUESTION, REFERENCE, "87", "hand-0")
BY_HAND = {
    (("+", 23), ("-", 12), ("+", 31)): REFERENCE,
    (("+", 23), ("+", 31), ("-", 12)): """45+23: 5+3=8, 4+2=6. 45+23=68
68+31: 8+1=9, 6+3=9. 68+31=99
99-12: 9-2=7, 9-1=8. 99-12=87
#### 87""",
    (("-", 12), ("+", 23), ("+", 31)): """45-12: 5-2=3, 4-1=3. 45-12=33
33+23: 3+3=6, 3+2=5. 33+23=56
56+31: 6+1=7, 5+3=8. 56+31=87
#### 87""",
    (("-", 12), ("+", 31), ("+", 23)): """45-12: 5-2=3, 4-1=3. 45-12=33
33+31: 3+1=4, 3+3=6. 33+31=64
64+23: 4+3=7, 6+2=8. 64+23=87
#### 87""",
    (("+", 31), ("+", 23), ("-", 12)): """45+31: 5+1=6, 4+3=7. 45+31=76
76+23: 6+3=9, 7+2=9. 76+23=99
99-12: 9-2=7, 9-1=8. 99-12=87
#### 87""",
    (("+", 31), ("-", 12), ("+", 23)): """45+31: 5+1=6, 4+3=7. 45+31=76
76-12: 6-2=4, 7-1=6. 76-12=64
64+23: 4+3=7, 6+2=8. 64+23=87
#### 87""",
}
# 3 step lines x (2 columns + composite) + 3 chain checks
FULL_MARKS = 12


def task(steps: int = 3) -> MultiPathTask:
    return MultiPathTask(seed=0, n_train=300, n_test=40, steps=steps)


def test_every_valid_order_gets_full_marks_by_hand():
    t = task()
    assert sorted(t.valid_paths(EXAMPLE)) == sorted(BY_HAND)
    for order, text in BY_HAND.items():
        assert t.solution_path(text) == list(order)
        assert format_solution(steps_of(45, order)) == text  # the hand-written working is the task's format
        r = t.verify(EXAMPLE, text)
        assert (r.correct, r.steps_total, r.steps_correct, r.reward) == (True, FULL_MARKS, FULL_MARKS, 1.0), order


def test_arith_accepts_only_the_reference_order():
    """The same problem under arith's fixed-order chain: another order is a wrong chain."""
    other = BY_HAND[(("-", 12), ("+", 23), ("+", 31))]
    assert ArithTask().verify(EXAMPLE, other).reward == 0.0
    assert task().verify(EXAMPLE, other).reward == 1.0


# For each position, a step that is wrong in the chain but right in its own columns, the later steps
# carrying on from what it wrote: an operation the question does not have, a repeated operation, a
# step that does not start from the previous result.
WRONG_STEPS = {
    0: [[Step(45, "+", 24), Step(69, "-", 12), Step(57, "+", 31)],   # 24 is not in the question
        [Step(46, "+", 23), Step(69, "-", 12), Step(57, "+", 31)]],  # does not start from the start amount
    1: [[Step(45, "+", 23), Step(68, "+", 23), Step(91, "+", 31)],   # +23 a second time
        [Step(45, "+", 23), Step(67, "-", 12), Step(55, "+", 31)]],  # does not start from 68
    2: [[Step(45, "+", 23), Step(68, "-", 12), Step(56, "-", 12)],   # -12 a second time (+31 never used)
        [Step(45, "+", 23), Step(68, "-", 12), Step(56, "+", 13)]],  # 13 is not in the question
}


@pytest.mark.parametrize("position, steps", [(p, s) for p, ss in WRONG_STEPS.items() for s in ss])
def test_a_wrong_step_in_each_position_is_one_wrong_chain_check(position, steps):
    text = format_solution(steps)
    assert text.split("\n")[:position] == REFERENCE.split("\n")[:position]  # right up to the wrong step
    r = task().verify(EXAMPLE, text)
    assert r.steps_total == FULL_MARKS and r.steps_correct == FULL_MARKS - 1
    assert r.reward == 0.0


@pytest.mark.parametrize("position", [0, 1, 2])
def test_a_wrong_column_in_each_position_is_caught(position):
    lines = REFERENCE.split("\n")
    head, rest = lines[position].split(": ", 1)
    first_col = rest.split(",")[0]
    lhs, rhs = first_col.split("=")
    lines[position] = f"{head}: {lhs}={int(rhs) + 1}," + rest.split(",", 1)[1]
    r = task().verify(EXAMPLE, "\n".join(lines))
    # the wrong column is wrong in itself and as an equation of the line's columns
    assert r.steps_correct == FULL_MARKS - 1 and r.reward == 0.0


def test_going_below_zero_is_not_a_valid_order():
    ex = Example("ann has 5 pens. she loses 8 and finds 10 more. how many pens?",
                 "5+10: 5+0=5, 0+1=1. 5+10=15\n15-8: 5-8=-3. 15-8=7\n#### 7", "7", "hand-1")
    assert valid_orders(5, [("-", 8), ("+", 10)]) == [(("+", 10), ("-", 8))]
    negative = "5-8: 5-8=-3. 5-8=-3\n-3+10: 3+0=3. -3+10=7\n#### 7"
    r = task().verify(ex, negative)
    assert r.correct and r.reward == 0.0  # the right number through an invalid order


def test_missing_and_extra_steps_are_counted():
    t = task()
    two = "\n".join(REFERENCE.split("\n")[:2]) + "\n#### 56"
    r = t.verify(EXAMPLE, two)
    assert not r.correct and r.steps_total == 2 * 3 + 3 and r.steps_correct == 2 * 3 + 2
    extra = REFERENCE.replace("#### 87", "87-0: 7-0=7, 8-0=8. 87-0=87\n#### 87")
    r = t.verify(EXAMPLE, extra)
    assert r.steps_total == 4 * 3 + 4 and r.steps_correct == 4 * 3 + 3  # -0 is not an operation of the question


def test_generation_gold_verifies_and_references_cover_the_orders():
    t = task()
    train, test = t.train_examples(), t.test_examples()
    for ex in train[:100] + test:
        r = t.verify(ex, ex.solution)
        assert r.reward == 1.0 and r.steps_correct == r.steps_total
        assert tuple(t.solution_path(ex.solution)) in t.valid_paths(ex)
        assert "then" not in ex.question  # no order is implied by the question
    # references are drawn among the valid orders: problems with 6 orders do not all use one of them
    six = [ex for ex in train if len(t.valid_paths(ex)) == 6]
    firsts = Counter(tuple(t.solution_path(ex.solution)) == t.valid_paths(ex)[0] for ex in six)
    assert len(six) > 50 and 0.05 < firsts[True] / len(six) < 0.4
    # the default: 2 operations, and most problems have both orders
    default = MultiPathTask(seed=0, n_train=300, n_test=40)
    counts = Counter(len(default.valid_paths(ex)) for ex in default.train_examples())
    assert set(counts) <= {1, 2} and counts[2] > 0.6 * len(default.train_examples())
    assert all(len(default.solution_path(ex.solution)) == 2 for ex in default.train_examples())


def test_train_and_test_never_share_a_problem_in_any_order():
    t = MultiPathTask(seed=0, n_train=3000, n_test=200, digits=1)
    key = lambda ex: (t.start_and_ops(ex)[0], tuple(sorted(t.start_and_ops(ex)[1])))
    test_keys = {key(ex) for ex in t.test_examples()}
    assert len(test_keys) == 200
    assert not test_keys & {key(ex) for ex in t.train_examples()}


def test_seeded_and_built_by_name():
    a, b = build_task("multipath", seed=3, n_train=20, n_test=5), MultiPathTask(seed=3, n_train=20, n_test=5)
    assert a.train_examples() == b.train_examples() and a.test_examples() == b.test_examples()
    assert a.train_examples() != MultiPathTask(seed=4, n_train=20, n_test=5).train_examples()
    assert a.train_examples()[0].uid == "multipath-train-0"


def test_bad_knobs_fail_clearly():
    with pytest.raises(DataError, match=r"ops must be a non-empty subset of \('\+', '-'\)"):
        MultiPathTask(ops=("+", "*"))
    with pytest.raises(DataError, match="steps=1 gives one order only"):
        MultiPathTask(steps=1)


def test_arith_data_is_unchanged_by_the_shared_generator():
    """arith's problems (and so its warm-start cache entry) do not move with the refactor that the
    multipath task shares: the first train problem of the default data=arith, as generated before."""
    ex = ArithTask(seed=0, digits=2).train_examples()[0]
    assert ex.question == "sam has 18 stamps. he gives away 5, then buys 6 more. how many stamps?"
    assert ex.solution == "18-5: 8-5=3, 1-0=1. 18-5=13\n13+6: 3+6=9, 1+0=1. 13+6=19\n#### 19"
    assert ex.uid == "arith-train-0"
