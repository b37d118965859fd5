"""Dynamic sampling (GRPO): only prompt groups whose rewards spread are trained, more prompts are drawn
until the batch is full or the round cap is hit (said in the metrics), and under torchrun the ranks
stay in step when one of them needs extra rounds."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from algorithms.base import RolloutContext
from algorithms.dynamic_sampling import fill_groups
from algorithms.grpo import GRPO, GRPOConfig, Scored
from selfdistill_helpers import arith, tiny
from tests.conftest import ROOT, tiny_overrides


@dataclass
class G:
    name: str
    spread: bool
    generated_tokens: int = 10


def _stream(batches):
    it = iter(batches)
    drawn = []

    def draw():
        drawn.append(1)
        return next(it)
    return draw, drawn


def test_fill_keeps_only_spread_groups_in_order_and_stops_when_full():
    spread = {"a": False, "b": True, "c": False, "d": True, "e": True, "f": True}
    gen = lambda exs: [G(x, spread[x]) for x in exs]  # noqa: E731
    draw, drawn = _stream([["c", "d"], ["e", "f"]])
    groups, stats = fill_groups(["a", "b"], draw, gen, max_rounds=4)
    assert [g.name for g in groups] == ["b", "d"]  # a and c had no spread; full after round 2
    assert (stats.rounds, stats.filtered, stats.generated_tokens, stats.cap_hit) == (2, 2, 40, False)
    assert len(drawn) == 1
    m = stats.metrics(trained_tokens=20)
    assert m["rollout/generated_per_trained_token"].item() == 2.0 and m["rollout/groups_filtered"].item() == 2
    assert m["rollout/spread_share"].item() == 0.5  # b and d of a, b, c, d


def test_fill_stops_at_its_cap_and_says_so_and_never_returns_nothing():
    gen = lambda exs: [G(x, x == "d") for x in exs]  # noqa: E731
    draw, drawn = _stream([["c", "d"], ["e", "f"], ["g", "h"]])
    groups, stats = fill_groups(["a", "b"], draw, gen, max_rounds=2)
    assert [g.name for g in groups] == ["d"] and stats.cap_hit and stats.rounds == 2 and len(drawn) == 1
    none = lambda exs: [G(x, False) for x in exs]  # noqa: E731
    groups, stats = fill_groups(["a", "b"], _stream([["c", "d"]])[0], none, max_rounds=2)
    assert [g.name for g in groups] == ["a", "b"] and stats.cap_hit  # the first round, all advantages 0
    groups, stats = fill_groups(["a", "b"], None, gen, max_rounds=3)  # no stream to draw from: one round
    assert groups == [G("a", False), G("b", False)] and stats.rounds == 1


def test_grpo_trains_only_groups_with_reward_spread():
    model, tok = tiny()
    task = arith()
    examples = task.train_examples()
    spread_uids = {ex.uid for ex in examples[1::3]}  # one question in three gets differing rewards
    algo = GRPO(GRPOConfig(num_generations=2, dynamic_sampling=True, dynamic_max_rounds=6))

    def score(exs, outs, tok_, task_):  # rewards by design: 0 / 1 within a spread group, 0 / 0 otherwise
        return [Scored(float(ex.uid in spread_uids and k % 2 == 0), True, 0.0, 0.0, 0.0)
                for k, ex in enumerate(exs)]

    algo.score = score
    chunks = iter([examples[i:i + 4] for i in range(4, len(examples), 4)])
    ctx = RolloutContext(task, tok, torch.Generator().manual_seed(0), torch.device("cpu"), 8,
                         policy_fn=lambda: model, draw_examples=lambda: next(chunks))
    batch = algo.make_batch(examples[:4], ctx)
    trained = sorted({u.rsplit("/", 1)[0] for u in batch.uids})
    assert len(trained) == 4 and set(trained) <= spread_uids  # 4 groups, all with spread
    assert batch.metrics["grpo/frac_zero_std"].item() == 0.0 and (batch.policy.advantages != 0).all()
    # by hand: 1 spread question per 3 -> rounds of 4 questions hold 1-2 each; examples[1], [4], [7], [10]
    assert trained == sorted(ex.uid for ex in (examples[1], examples[4], examples[7], examples[10]))
    assert batch.metrics["rollout/generation_rounds"].item() == 3.0
    assert batch.metrics["rollout/groups_filtered"].item() == 8.0 and batch.metrics["rollout/dynamic_cap_hit"] == 0


def test_generated_tokens_count_every_round_sampled():
    """rollout/generated_tokens: the completion tokens sampled for the step, the dropped rounds included
    (what the equal-token comparison of benchmarks/grpo_curve.py adds up); without dynamic sampling, the
    trained completions' tokens."""
    model, tok = tiny()
    task = arith()
    examples = task.train_examples()
    spread_uids = {ex.uid for ex in examples[1::3]}

    def score(exs, outs, tok_, task_):
        return [Scored(float(ex.uid in spread_uids and k % 2 == 0), True, 0.0, 0.0, 0.0) for k, ex in enumerate(exs)]

    for dynamic in (True, False):
        algo = GRPO(GRPOConfig(num_generations=2, dynamic_sampling=dynamic, dynamic_max_rounds=6))
        algo.score = score
        seen = []
        groups = algo._groups
        algo._groups = lambda exs, ctx, **kw: seen.extend(groups(exs, ctx, **kw)) or seen[-len(exs):]
        chunks = iter([examples[i:i + 4] for i in range(4, len(examples), 4)])
        ctx = RolloutContext(task, tok, torch.Generator().manual_seed(0), torch.device("cpu"), 8,
                             policy_fn=lambda: model, draw_examples=lambda: next(chunks))
        batch = algo.make_batch(examples[:4], ctx)
        sampled = sum(len(o.tokens) for gr in seen for o in gr.outs)
        trained = batch.metrics["rollout/length"].item() * batch.input_ids.shape[0]
        assert batch.metrics["rollout/generated_tokens"].item() == sampled > 0
        if dynamic:  # three rounds of 4 prompts sampled, 4 groups trained
            assert len(seen) == 12 and sampled > trained
        else:
            assert len(seen) == 4 and sampled == pytest.approx(trained)


def test_dynamic_keys_are_checked():
    with pytest.raises(ValueError, match="algo.dynamic_max_rounds=0 must be >= 1"):
        GRPOConfig(dynamic_max_rounds=0).validate()
    with pytest.raises(ValueError, match="algo.dynamic_metric=acc is not one of reward, correct"):
        GRPOConfig(dynamic_metric="acc").validate()


def spread_on_rank_zero_slices(prompts, completions, completion_ids, question, **columns):
    """A reward for the torchrun test (TRL's signature): spread (0 / 1 by completion length) only for
    questions whose character sum is a multiple of 4, so each rank's slices hold a different number of them."""
    return [float(len(c) % 2) if sum(map(ord, q)) % 4 == 0 else 0.0 for q, c in zip(question, completions)]


@pytest.mark.slow  # one 2-rank torchrun run: ~30 s
def test_two_ranks_stay_in_step_when_one_needs_more_rounds(tmp_path, subprocess_env):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           *tiny_overrides(out, "trainer.max_steps=3", "trainer.max_new_tokens=12", "algo.num_generations=4",
                           "algo.dynamic_sampling=true", "algo.dynamic_max_rounds=5", "algo.dynamic_metric=reward",
                           "algo.retire_after=2",
                           "algo.reward_funcs=[test_dynamic_sampling:spread_on_rank_zero_slices]", algo="grpo")]
    env = dict(subprocess_env, PYTHONPATH=f"{ROOT / 'tests' / 'algorithms'}:{subprocess_env['PYTHONPATH']}")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # metrics are means over the ranks: each rank reports its own rounds
        assert r["rollout/generation_rounds"] >= 1 and "rollout/groups_filtered" in r
        assert r["rollout/retired_unsolved"] >= 0 and "rollout/retired_skipped" in r
        assert r["rollout/generated_per_trained_token"] >= 1.0
    assert any(r["rollout/generation_rounds"] > 1 for r in records)
    # the ranks needed different numbers of rounds in some step (a mean of 4 and 5 is 4.5), and still
    # every group trained had reward spread
    assert any(r["rollout/generation_rounds"] % 1 == 0.5 for r in records)
    assert all(r["grpo/frac_zero_std"] == 0.0 for r in records)


def test_prompts_solved_or_failed_every_time_are_retired_and_not_sampled_again():
    model, tok = tiny()
    task = arith()
    a, b, c, d = task.train_examples()[:4]
    outcome = {a.uid: [1.0, 1.0], b.uid: [0.0, 0.0], c.uid: [1.0, 0.0], d.uid: [0.0, 1.0]}
    algo = GRPO(GRPOConfig(num_generations=2, dynamic_sampling=True, dynamic_max_rounds=1, retire_after=2))
    seen = []

    def score(exs, outs, tok_, task_):  # a: always solved, b: never, c / d: mixed (spread, trained)
        seen.extend(ex.uid for ex in exs[::2])
        return [Scored(outcome[ex.uid][k % 2], True, outcome[ex.uid][k % 2], 0.0, 1.0) for k, ex in enumerate(exs)]

    algo.score = score
    ctx = RolloutContext(task, tok, torch.Generator().manual_seed(0), torch.device("cpu"), 6, policy_fn=lambda: model)
    first = algo.make_batch([a, b, c, d], ctx)
    assert algo.retirement.retired == {} and first.metrics["rollout/retired_solved"].item() == 0
    second = algo.make_batch([a, b, c, d], ctx)  # the second visit in a row retires a and b
    assert algo.retirement.retired == {a.uid: "solved", b.uid: "unsolved"}
    assert second.metrics["rollout/retired_solved"].item() == 1 and second.metrics["rollout/retired_unsolved"].item() == 1
    seen.clear()
    third = algo.make_batch([a, b, c, d], ctx)
    assert seen == [c.uid, d.uid] and third.metrics["rollout/retired_skipped"].item() == 2  # not generated again
    restored = GRPO(GRPOConfig(num_generations=2, dynamic_sampling=True, retire_after=2))
    restored.load_state_dict(algo.state_dict())
    restored.load_rank_state_dict(algo.rank_state_dict())
    assert restored.retirement.retired == algo.retirement.retired and restored.retirement.streaks == algo.retirement.streaks
    with pytest.raises(ValueError, match="algo.retire_after=2 must be >= 0, and > 0 only with algo.dynamic_sampling"):
        GRPOConfig(retire_after=2).validate()


def test_retirement_counts_visits_in_a_row_and_shares_them_at_the_step_end():
    from types import SimpleNamespace

    from algorithms.dynamic_sampling import Retirement

    r = Retirement(after=2)
    r.begin_step()
    r.visit("a", [1.0, 1.0])
    r.visit("b", [0.0, 0.0])
    r.visit("c", [1.0, 0.0])  # mixed: no streak
    r.visit("d", [0.5, 0.5])  # a partial score is neither solved nor unsolved
    assert r.streaks == {"a": ("solved", 1), "b": ("unsolved", 1)} and r.retired == {}
    r.visit("a", [0.0, 0.0])  # the outcome changed: the count restarts
    r.visit("b", [0.0, 0.0])  # second unsolved visit in a row: retired at the step's end, not before
    assert r.streaks == {"a": ("unsolved", 1)} and r.retired == {}
    r.share(None)
    assert r.retired == {"b": "unsolved"}
    r.begin_step()
    exs = [SimpleNamespace(uid=u) for u in "abc"]
    assert [e.uid for e in r.live(exs)] == ["a", "c"] and r.skipped == 1
    m = r.metrics()
    assert (m["rollout/retired_solved"].item(), m["rollout/retired_unsolved"].item(), m["rollout/retired_skipped"].item()) \
        == (0.0, 1.0, 1.0)
    again = Retirement(after=2)
    again.load_state_dict(r.state_dict())
    again.load_rank_state_dict(r.rank_state_dict())
    assert again.retired == r.retired and again.streaks == r.streaks
    off = Retirement(after=0)
    off.visit("a", [1.0])
    off.visit("a", [1.0])
    off.share(None)
    assert off.retired == {} and off.streaks == {}
