"""Per-question outcomes of a held-out eval (trainer/evaluation.py): one character per example, in the
examples' order, whichever rank decoded it -- the record a paired comparison of two runs needs."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from models.tokenizer import build_char_tokenizer
from tasks import build_task
from trainer.evaluation import evaluate, in_order


def test_rank_shares_merge_back_into_the_examples_order():
    # 7 examples over 3 ranks: rank 0 held 0, 3, 6; rank 1 held 1, 4; rank 2 held 2, 5
    shares = [[True, False, True], [False, False], [True, True]]
    assert in_order(shares) == "1010011"  # hand-merged: 0:1 1:0 2:1 3:0 4:0 5:1 6:1
    assert in_order([[True, False]]) == "10"


class FakeWorld:
    """Rank `rank` of `size`; gather_objects returns the shares the other ranks would have decoded."""

    def __init__(self, rank: int, size: int, others: dict[int, list[bool]]):
        self.rank, self.size, self.others = rank, size, others
        self.is_main = rank == 0

    def gather_objects(self, obj):
        return [obj if r == self.rank else self.others[r] for r in range(self.size)]

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value  # the counts are not under test here


def test_evaluate_marks_each_question_by_its_own_verdict():
    tok = build_char_tokenizer()
    task = build_task("arith", seed=0, n_train=4, n_test=6)
    examples = list(task.test_examples())
    wrong = {1, 4}  # these two get another final answer
    answer = lambda ex, i: ex.solution if i not in wrong else ex.solution.rsplit("#### ", 1)[0] + "#### 99999"
    index = {ex.uid: i for i, ex in enumerate(examples)}
    generate = lambda chunk: [tok(answer(ex, index[ex.uid]), add_special_tokens=False).input_ids for ex in chunk]
    one = evaluate(None, tok, task, examples, SimpleNamespace(rank=0, size=1, is_main=True,
                   gather_objects=lambda o: [o], all_reduce_sum=lambda v: v), 40, generate=generate)
    assert one["outcomes"] == "101101" and one["accuracy"] == 4 / 6
    # rank 1 of 2 decodes examples 1, 3, 5; rank 0's share (0, 2, 4) comes back from the gather
    two = evaluate(None, tok, task, examples, FakeWorld(1, 2, {0: [True, True, False]}), 40, generate=generate)
    assert two["outcomes"] == "101101"
