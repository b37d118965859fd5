"""Shared by tests/trainer/test_skip_zero_loss.py and its torchrun worker: GRPO sessions on the tiny
model and batches whose micro-batches have zero or non-zero advantages by design."""
from __future__ import annotations

import dataclasses

import torch

from tests.conftest import tiny_config
from trainer.loop import rollout_context
from trainer.setup import build_session

MICRO = 2  # rows per micro-batch: 2 prompts per rank x 4 completions -> 4 micro-batches per rank
GRPO = ["trainer.max_new_tokens=12", f"trainer.micro_batch_size={MICRO}",
        "algo.num_generations=4", "trainer.lr=1e-2", "trainer.warmup_steps=1", "trainer.max_steps=3"]


def grpo_session(out_dir, world, *extra: str, skipping: bool = True):
    """A GRPO session with 2 prompts per rank; `skipping=False` is the unoptimised path (every
    micro-batch runs)."""
    cfg = tiny_config(out_dir, *GRPO, f"trainer.batch_size={2 * world.size}", *extra, algo="grpo")
    s = build_session(cfg, world)
    if not skipping:
        s.caps = dataclasses.replace(s.caps, zero_loss=None)
    return s


def patterned_batch(s, live: list[bool]):
    """A fresh rollout batch whose j-th micro-batch (in `Batch.micro_batches` order: rows sorted by
    length) has non-zero advantages when live[j], all-zero ones otherwise."""
    batch = s.algo.make_batch(s.stream.next_batch(), rollout_context(s))
    order = torch.sort(batch.attention_mask.sum(1).cpu(), stable=True).indices
    adv = torch.zeros(len(batch))
    for j, on in enumerate(live):
        rows = order[j * MICRO:(j + 1) * MICRO]
        if on:
            adv[rows] = torch.linspace(-1.0, 1.0, len(rows)) + 0.25  # no zero among them
    batch.policy.advantages = adv.to(batch.input_ids.device)
    # the layout is what the test asked for (an empty completion would make a live micro-batch zero)
    nonzero = [bool((m.loss_mask.bool() & (m.policy.advantages != 0)[:, None]).any()) for m in batch.micro_batches(MICRO)]
    assert nonzero == list(live), (nonzero, live)
    return batch
