"""Process-group setup and teardown, passed around explicitly as a `World` (no global state).

gloo on CPU, NCCL on GPU, chosen automatically. Under torchrun the env vars RANK / WORLD_SIZE /
LOCAL_RANK are set; plain `python train.py` is a world of one with no process group.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: Optional[Any] = None  # the process group; None for a world of one

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(value, dist.ReduceOp.SUM)

    def all_reduce_max(self, value: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(value, dist.ReduceOp.MAX)

    def _all_reduce(self, value: torch.Tensor, op) -> torch.Tensor:
        """A reduced copy on CPU; the input is untouched. NCCL reduces device tensors only."""
        if not self.distributed:
            return value
        value = value.to(self.device, copy=True)
        dist.all_reduce(value, op=op, group=self.group)
        return value.cpu()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_world(timeout_s: int = 1800) -> World:
    """A World for this process: a process group when launched by torchrun with >1 processes."""
    size = launched_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if size == 1:
        return World(device=device)
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if use_cuda else None,
    )
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local_rank, device=device,
                 group=dist.group.WORLD)


def shutdown(world: World, exit_code: int = 0) -> None:
    """Leave without the exit-time crashes gloo workers are prone to.

    A bare destroy_process_group sometimes kills a worker at interpreter exit ("terminate called
    without an active exception") after all work is done; barrier + destroy + flush + os._exit
    skips the interpreter teardown that races with gloo's threads.
    """
    if world.distributed:
        try:
            if exit_code == 0:
                world.barrier()
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to synchronise with
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
