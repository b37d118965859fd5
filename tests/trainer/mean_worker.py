"""Worker for tests/trainer/test_loop.py: under torchrun (gloo, 2 ranks) the train record's reduction
of metrics that only some ranks report; rank 0 prints the result as one JSON line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.distributed import World  # noqa: E402
from trainer.loop import _mean_over_ranks  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = World(rank=rank, size=dist.get_world_size(), group=dist.group.WORLD)
    values = {"loss": torch.tensor(1.0 + rank), "shared": torch.tensor(10.0 * (rank + 1))}
    values[f"only_{rank}"] = torch.tensor(5.0 + rank)  # a different key on each rank, same count
    if rank == 1:
        values["extra"] = torch.tensor(7.0)  # and one rank with more keys than the other
    out = _mean_over_ranks(world, values)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
