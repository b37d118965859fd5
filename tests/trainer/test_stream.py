"""PromptStream: the trainer's seeded, resumable, rank-sharded stream of training prompts."""
from __future__ import annotations

import json

import pytest

from tasks import DataError, Example
from trainer.stream import PromptStream


def _examples(n):
    return [Example(f"q{i}", f"#### {i}", str(i), f"u{i}") for i in range(n)]


def test_stream_resumes_exactly():
    examples = _examples(10)
    a = PromptStream(examples, global_batch_size=4, seed=7)
    for _ in range(6):  # 24 examples: past two epoch boundaries
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(5)]
    b = PromptStream(examples, global_batch_size=4, seed=7)
    b.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert [b.next_batch() for _ in range(5)] == expected
    with pytest.raises(DataError, match="state was saved"):
        PromptStream(_examples(11), global_batch_size=4, seed=7).load_state_dict(state)


def test_stream_epochs_cover_every_example_and_reshuffle():
    examples = _examples(12)
    stream = PromptStream(examples, global_batch_size=4, seed=0)
    epoch0 = [e for _ in range(3) for e in stream.next_batch()]
    epoch1 = [e for _ in range(3) for e in stream.next_batch()]
    assert sorted(e.uid for e in epoch0) == sorted(e.uid for e in examples) == sorted(e.uid for e in epoch1)
    assert epoch0 != epoch1 and stream.state_dict()["epoch"] == 2
    straddle = PromptStream(_examples(5), global_batch_size=4, seed=0)
    assert len(straddle.next_batch()) == 4 and len(straddle.next_batch()) == 4  # runs on into epoch 1


def test_stream_rank_shares_concatenate_to_the_global_batch():
    examples = _examples(13)
    single = PromptStream(examples, global_batch_size=6, seed=3)
    ranks = [PromptStream(examples, global_batch_size=6, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(7):
        shares = [s.next_batch() for s in ranks]
        assert len(shares[0]) == 3 and shares[0] + shares[1] == single.next_batch()
    with pytest.raises(DataError, match="not divisible"):
        PromptStream(examples, global_batch_size=6, seed=3, world_size=4)
