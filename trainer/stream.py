"""`PromptStream`: the trainer's endless, seeded, resumable supply of training prompts.

Every rank walks the same global sequence (each epoch a fresh permutation seeded by seed + epoch)
and takes its own contiguous slice of each global batch, so world_size ranks together see exactly
what one rank with the same global batch size would see. The position is global (epoch, offset),
which is why a checkpoint can also be resumed under a different world size.

    stream = PromptStream(task.train_examples(), global_batch_size=64, seed=0, rank=r, world_size=w)
    batch = stream.next_batch()          # 64 // w examples
    state = stream.state_dict()          # {"epoch": ..., "offset": ...}; load_state_dict(state) resumes
"""
from __future__ import annotations

import random
from typing import Iterator, Sequence

from tasks.base import DataError, Example


class PromptStream:
    def __init__(self, examples: Sequence[Example], global_batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        if not examples:
            raise DataError("PromptStream: no examples")
        if global_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"PromptStream: bad global_batch_size={global_batch_size}, rank={rank}, "
                            f"world_size={world_size}")
        if global_batch_size % world_size:
            raise DataError(f"PromptStream: global_batch_size={global_batch_size} is not divisible by "
                            f"world_size={world_size}")
        self.examples, self.seed = list(examples), seed
        self.global_batch_size, self.rank, self.world_size = global_batch_size, rank, world_size
        self.batch_size = global_batch_size // world_size  # this rank's share
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Example]:
        """This rank's slice of the next global batch; a batch may run on into the next epoch."""
        batch: list[Example] = []
        while len(batch) < self.global_batch_size:
            take = min(self.global_batch_size - len(batch), len(self._order) - self.offset)
            batch += [self.examples[i] for i in self._order[self.offset:self.offset + take]]
            self.offset += take
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        start = self.rank * self.batch_size
        return batch[start:start + self.batch_size]

    def __iter__(self) -> Iterator[list[Example]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict) -> None:
        saved = (state.get("num_examples", len(self.examples)), state.get("seed", self.seed))
        if saved != (len(self.examples), self.seed):
            raise DataError(f"PromptStream: state was saved for {state.get('num_examples')} examples and seed "
                            f"{state.get('seed')}, this stream has {len(self.examples)} and seed {self.seed}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)
