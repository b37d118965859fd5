"""The on / off reference-path split of the self-distillation diagnostics (algorithms/selfdistill.py):
token flags on hand-built completions, the agreement and gate shares against hand counts, and the
paths/* metrics logged by OPSD, MASS and TESD on the multipath task."""
from __future__ import annotations

import pytest
import torch

from algorithms.base import Batch
from algorithms.losses import teacher_top_tokens
from algorithms.mass import MASS, MASSConfig
from algorithms.opsd import OPSD, OPSDConfig
from algorithms.selfdistill import on_path_flags, path_metrics
from algorithms.tesd import TESD, TESDConfig
from models.tokenizer import build_char_tokenizer
from tasks import Example, build_task

from selfdistill_helpers import ctx, tiny

REFERENCE = """45+23: 5+3=8, 4+2=6. 45+23=68
68-12: 8-2=6, 6-1=5. 68-12=56
56+31: 6+1=7, 5+3=8. 56+31=87
#### 87"""
OTHER_ORDER = """45+23: 5+3=8, 4+2=6. 45+23=68
68+31: 8+1=9, 6+3=9. 68+31=99
99-12: 9-2=7, 9-1=8. 99-12=87
#### 87"""
EXAMPLE = Example("tom has 45 apples. he gets 23 more, gives away 12 and finds 31 more. how many apples?",
                  REFERENCE, "87", "hand-0")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def task():
    return build_task("multipath", seed=0, n_train=32, n_test=4)


def ids(tok, text: str, eos: bool = True) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids + ([tok.eos_token_id] if eos else [])


def test_same_path_is_on_everywhere_even_with_a_wrong_column(task, tok):
    assert on_path_flags(task, tok, ids(tok, REFERENCE), REFERENCE) == [True] * (len(REFERENCE) + 1)
    wrong_column = REFERENCE.replace("5+3=8, 4+2=6", "5+3=9, 4+2=6", 1)  # an error, not another path
    assert all(on_path_flags(task, tok, ids(tok, wrong_column), REFERENCE))


def test_another_order_leaves_the_path_at_its_first_different_step(task, tok):
    flags = on_path_flags(task, tok, ids(tok, OTHER_ORDER), REFERENCE)
    first = len(OTHER_ORDER.split("\n")[0]) + 1  # the first line and its newline: the same step as the reference
    assert flags == [True] * first + [False] * (len(OTHER_ORDER) - first + 1)  # the rest and EOS are off


def test_diverging_at_the_first_step_and_unfinished_lines(task, tok):
    other_first = "45-12: 5-2=3, 4-1=3. 45-12=33\n33+"
    assert on_path_flags(task, tok, ids(tok, other_first, eos=False), REFERENCE) == [False] * len(other_first)
    unfinished = "45+23: 5+3=8, 4+2=6. 45+23=68\n68+3"  # no header yet on line 2: its path is still on
    assert all(on_path_flags(task, tok, ids(tok, unfinished, eos=False), REFERENCE))
    assert on_path_flags(task, tok, [], REFERENCE) == []


def _batch(tok, rows: list[list[int]]) -> Batch:
    prompt = ids(tok, "q: x\na: ", eos=False)
    width = len(prompt) + max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id)
    loss_mask = torch.zeros_like(input_ids)
    for b, row in enumerate(rows):
        input_ids[b, :len(prompt) + len(row)] = torch.tensor(prompt + row)
        loss_mask[b, len(prompt):len(prompt) + len(row)] = 1
    return Batch(input_ids, (input_ids != tok.pad_token_id).long(), loss_mask)


def test_agreement_and_kept_shares_by_hand(task, tok):
    """Two rollouts: the reference's path and another order. With an identity head the hidden states are
    the logits, so each teacher's top token is set by hand: the `full` teacher agrees with the student on
    every on-path token and on none off it; the `views` teacher (two views, mean of probabilities) agrees
    on the first 10 off-path tokens only."""
    rows = [ids(tok, REFERENCE), ids(tok, OTHER_ORDER)]
    batch = _batch(tok, rows)
    sel = batch.loss_mask.bool()
    sampled = batch.input_ids[sel]
    on = torch.tensor(on_path_flags(task, tok, rows[0], REFERENCE) + on_path_flags(task, tok, rows[1], REFERENCE))
    n, v = sampled.numel(), len(tok)
    other = (sampled + 1) % v
    full = torch.full((n, 1, v), -10.0)
    full[torch.arange(n), 0, torch.where(on, sampled, other)] = 10.0
    views = torch.full((n, 2, v), -10.0)
    off_idx = torch.nonzero(~on).squeeze(1)
    view_top = other.clone()
    view_top[off_idx[:10]] = sampled[off_idx[:10]]
    views[torch.arange(n), 0, view_top] = 10.0  # view 0 is sure; view 1 is flat: the mean's top is view 0's
    kept = torch.zeros(n, dtype=torch.bool)
    kept[torch.nonzero(on).squeeze(1)[:5]] = True
    kept[off_idx[:20]] = True
    head = (torch.eye(v), None)
    tops = {name: teacher_top_tokens(hidden, head) for name, hidden in (("full", full), ("views", views))}
    out = path_metrics(task, tok, [EXAMPLE, EXAMPLE], rows, batch, tops, kept=kept)
    n_on, n_off = int(on.sum()), int((~on).sum())
    assert n_on == len(REFERENCE) + 1 + len(OTHER_ORDER.split("\n")[0]) + 1
    assert out["paths/differs"].item() == pytest.approx(0.5)
    assert out["paths/on_tokens"].item() == pytest.approx(n_on / n)
    assert out["paths/agree_full_on"].item() == 1.0 and out["paths/agree_full_off"].item() == 0.0
    assert out["paths/agree_views_on"].item() == 0.0
    assert out["paths/agree_views_off"].item() == pytest.approx(10 / n_off)
    assert out["paths/kept_on"].item() == pytest.approx(5 / n_on)
    assert out["paths/kept_off"].item() == pytest.approx(20 / n_off)


def test_tasks_without_paths_log_nothing(tok):
    class NoPaths:
        pass

    batch = _batch(tok, [ids(tok, "x")])
    assert path_metrics(NoPaths(), tok, [EXAMPLE], [ids(tok, "x")], batch, {}) == {}


@pytest.mark.parametrize("algo", [
    lambda: OPSD(OPSDConfig()),
    lambda: MASS(MASSConfig(num_views=3)),
    lambda: TESD(TESDConfig(teacher_rollouts=2)),
], ids=["opsd", "mass", "tesd"])
def test_algorithms_log_the_split_on_multipath(algo, task):
    model, tok = tiny()
    batch = algo().make_batch(task.train_examples()[:4], ctx(model, tok, task, max_new_tokens=40))
    keys = {k for k in batch.metrics if k.startswith("paths/")}
    assert {"paths/differs", "paths/on_tokens"} <= keys
    assert keys & {"paths/agree_full_on", "paths/agree_full_off"}
    for k in keys:
        assert 0.0 <= batch.metrics[k].item() <= 1.0, k
    if isinstance(algo(), MASS):
        assert keys & {"paths/agree_views_on", "paths/agree_views_off"}
        assert keys & {"paths/kept_on", "paths/kept_off"}
        assert batch.teacher.hidden.shape[2] == 3  # the full-reference pass is not one of the loss's views
    off = algo()
    off.cfg.path_diagnostics = False
    assert not any(k.startswith("paths/") for k in off.make_batch(task.train_examples()[:4],
                                                                  ctx(model, tok, task)).metrics)
    # arith has one path: nothing is logged and (MASS) no full-reference pass runs, even with the key on
    arith = build_task("arith", seed=0, n_train=8, n_test=4)
    on = algo()
    calls = []
    if isinstance(on, MASS):
        import algorithms.mass as mass_module

        real = mass_module.teacher_hidden
        mass_module.teacher_hidden = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        metrics = on.make_batch(arith.train_examples()[:4], ctx(model, tok, arith)).metrics
    finally:
        if isinstance(on, MASS):
            mass_module.teacher_hidden = real
    assert not any(k.startswith("paths/") for k in metrics)
    assert calls == ([1] if isinstance(on, MASS) else [])  # MASS: the views' pass only


def test_eval_reports_how_often_the_greedy_path_differs(task, tok):
    """evaluate() on three held-out answers: the reference's path, another valid order (right), and
    another order with a wrong column (wrong working)."""
    from trainer.distributed import World
    from trainer.evaluation import evaluate

    wrong = OTHER_ORDER.replace("8+1=9", "8+1=8")
    texts = {"a": REFERENCE, "b": OTHER_ORDER, "c": wrong}
    examples = [Example(EXAMPLE.question, REFERENCE, "87", uid) for uid in texts]
    out = evaluate(None, tok, task, examples, World(), 40,
                   generate=lambda chunk: [ids(tok, texts[ex.uid], eos=False) for ex in chunk])
    assert out["accuracy"] == 1.0  # every answer is 87
    assert out["path_differs"] == pytest.approx(2 / 3)
    assert out["path_differs_correct"] == pytest.approx(1 / 2)  # of the 2 with fully right working, 1 differs
    arith = build_task("arith", seed=0, n_train=4, n_test=4)
    assert "path_differs" in evaluate(None, tok, arith, examples[:1], World(), 40,
                                      generate=lambda chunk: [ids(tok, REFERENCE, eos=False)])


def test_gate_statistics_give_the_same_top_token_as_the_diagnostics_helper():
    """MASS reuses the aggregated teacher's top token from its gate statistics for paths/agree_views_*."""
    from algorithms.losses import self_distill_diagnostics

    g = torch.Generator().manual_seed(0)
    n, k, h, v = 37, 3, 8, 11
    student, teacher = torch.randn(n, h, generator=g), torch.randn(n, k, h, generator=g)
    head = (torch.randn(v, h, generator=g), None)
    for aggregate in ("mean", "geometric"):
        stats = self_distill_diagnostics(student, head, teacher, head, temperature=1.1, aggregate=aggregate, chunk=5)
        want = teacher_top_tokens(teacher, head, temperature=1.1, aggregate=aggregate, chunk=7)
        assert torch.equal(stats["teacher_top"], want)
