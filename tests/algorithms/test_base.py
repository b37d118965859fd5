"""Batch plumbing shared by every algorithm."""
from __future__ import annotations

import torch

from algorithms.base import Batch, pad_right


def test_micro_batches_group_by_length_cover_every_row_once_and_trim():
    rows = [[1] * 5, [2] * 2, [3] * 4, [4] * 1]
    ids, attn = pad_right(rows, pad_id=0, device=torch.device("cpu"))
    batch = Batch(ids, attn, attn.clone(), advantages=torch.tensor([0.5, 0.2, 0.4, 0.1]), uids=["a", "b", "c", "d"])
    micros = batch.micro_batches(2)
    assert [m.uids for m in micros] == [["d", "b"], ["c", "a"]]
    assert [tuple(m.input_ids.shape) for m in micros] == [(2, 2), (2, 5)]
    assert micros[0].input_ids.tolist() == [[4, 0], [2, 2]]
    assert torch.equal(micros[1].advantages, torch.tensor([0.4, 0.5]))
    assert sum(int(m.num_targets()) for m in micros) == int(batch.num_targets())
