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


def test_micro_batches_trim_token_axis_of_every_tensor_and_keep_groups():

    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 0]])
    attn = (ids != 0).long()
    hidden = torch.arange(3 * 4 * 2 * 5, dtype=torch.float32).view(3, 4, 2, 5)  # (B, T, K, H)
    batch = Batch(ids, attn, attn.clone(), teacher_hidden=hidden, row_group=torch.tensor([0, 1, 1]), num_groups=2,
                  uids=["a", "b", "c"])
    assert batch.num_targets().tolist() == [4, 5]
    micros = batch.micro_batches(2)
    assert [m.uids for m in micros] == [["b", "c"], ["a"]]  # grouped by length
    first = micros[0]
    assert first.input_ids.shape == (2, 3) and first.teacher_hidden.shape == (2, 3, 2, 5)
    assert torch.equal(first.teacher_hidden[1], hidden[2, :3]) and first.row_group.tolist() == [1, 1]
    assert sum(m.num_targets() for m in micros).tolist() == [4, 5]
