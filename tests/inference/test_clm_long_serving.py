"""The serving benchmark's long trajectories (benchmarks/clm.py): the two edit patterns at the
reference's scale hold what the numbers in docs/clm.md rest on -- every episode ends answered inside its
budget, the kept logs reach spans of >= 64 tokens, and the suffix plan finds them (one block when the
rewrite re-emits the kept text, one block per kept turn when a command deletes the old turns)."""
from __future__ import annotations

import pytest

from benchmarks.clm import deletion_trajectories, long_episodes, long_trajectories
from inference.suffix import ReuseConfig, plan_reuse
from models.tokenizer import build_char_tokenizer
from tasks.clm import _CHAIN_OP, _CHAIN_START
from tasks.context_file import TINY_FORMAT, parse_action

BUDGET, KEEP = 2048, 2


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _previous(traj, k):
    """What a session holds before call k: call k-1's prompt + output but its last token."""
    prompt, out = traj[k - 1]
    return prompt + out[:-1]


def test_long_episodes_answer_is_the_chain_value():
    for ep in long_episodes(5, seed=3):
        value = int(_CHAIN_START.match(ep.prefix).group(1))
        for obs in ep.observations:
            (op, d), = _CHAIN_OP.findall(obs)  # exactly one op per log
            value += int(d) if op == "add" else -int(d)
        assert str(value) == ep.answer
        assert min(map(len, ep.observations)) > 150  # long logs: kept turns exceed the 64-token spans


@pytest.mark.parametrize("make", [long_trajectories, deletion_trajectories])
def test_long_trajectories_end_answered_inside_the_budget(tok, make):
    trajs = make(tok, TINY_FORMAT, 3, BUDGET, 0.75, KEEP)
    for traj, ep in zip(trajs, long_episodes(3, 0)):
        assert all(len(prompt) <= BUDGET for prompt, _ in traj)
        last = tok.decode(traj[-1][1], skip_special_tokens=True)
        action = parse_action(last, TINY_FORMAT)
        assert action.kind == "answer" and action.text == ep.answer
        assert max(len(p) for p, _ in traj) > 0.75 * BUDGET  # the context really reached the compaction point


def test_rewrite_edits_relocate_one_block_and_deletions_one_per_kept_turn(tok):
    cfg = {k: ReuseConfig(mode="suffix", max_spans=k) for k in (1, 6)}
    rewrite = long_trajectories(tok, TINY_FORMAT, 2, BUDGET, 0.75, KEEP)
    drop = deletion_trajectories(tok, TINY_FORMAT, 2, BUDGET, 0.75, KEEP)
    edited = 0
    for traj in rewrite:
        for k in range(1, len(traj)):
            if tok.decode(traj[k - 1][1], skip_special_tokens=True).startswith("rewrite\n"):
                plan = plan_reuse(_previous(traj, k), traj[k][0], cfg[6])
                # the rewrite's own output (note + kept logs, renumbered alike) is one equal block
                assert len(plan.spans) == 1 and plan.spans[0].old_start >= len(traj[k - 1][0])
                edited += 1
    assert edited >= 2
    edited = 0
    for traj in drop:
        for k in range(1, len(traj)):
            if tok.decode(traj[k - 1][1], skip_special_tokens=True).startswith("drop "):
                one, six = (plan_reuse(_previous(traj, k), traj[k][0], cfg[n]) for n in (1, 6))
                assert len(six.spans) == KEEP and all(s.old_start < len(traj[k - 1][0]) for s in six.spans)
                assert len(one.spans) == 1 and len(one.forward) > len(six.forward)
                edited += 1
    assert edited >= 2
