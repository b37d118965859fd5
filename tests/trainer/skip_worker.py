"""Worker for tests/trainer/test_skip_zero_loss.py: under torchrun (gloo, 2 ranks, DDP or FSDP2) GRPO
steps whose micro-batches are zero on one rank and not on the other, with and without skipping.
Rank 0 prints one JSON line: the skipped micro-batch indices per step (checked equal on both ranks),
the logged counts, how far the weights are from the unskipped run's after the mixed step, whether the
empty step moved them, and how far apart the ranks are."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.trainer.skip_helpers import grpo_session, patterned_batch  # noqa: E402
from trainer import loop  # noqa: E402
from trainer.distributed import init_world, shutdown  # noqa: E402

PATTERNS = {0: [[False] * 4, [False] * 4], 1: [[False, True, True, False], [False] * 4]}


def full_params(s) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in s.backend.full_model().parameters()])


def main() -> None:
    out, backend = Path(sys.argv[1]), sys.argv[2]
    world = init_world()
    seen: list[list[int]] = []
    agreed = loop.skipped_micro_batches

    def spy(s, micros):
        skip = agreed(s, micros)
        if s.caps.zero_loss is not None:
            seen.append([i for i, x in enumerate(skip) if x])
        return skip

    loop.skipped_micro_batches = spy
    fast = grpo_session(out / "skip", world, f"backend={backend}")
    full = grpo_session(out / "full", world, f"backend={backend}", skipping=False)
    counts, skipped_steps, after = [], [], []
    for step, live in enumerate(PATTERNS[world.rank], 1):
        batch = patterned_batch(fast, live)
        for s in (fast, full):
            s.step = step
            record = loop.train_step(s, batch)
            if s is fast:
                counts.append(record["grpo/skipped_micro_batches"])
                skipped_steps.append(record["train/skipped_steps"])
        after.append((full_params(fast), full_params(full)))
    (fast1, full1), (fast2, full2) = after
    both = world.gather_objects((seen, fast2))
    if world.is_main:
        print(json.dumps({"skipped": seen, "counts": counts, "skipped_steps": skipped_steps,
                          "same_skips_on_ranks": both[0][0] == both[1][0],
                          "step1_diff_vs_unskipped": (fast1 - full1).abs().max().item(),
                          "empty_step_moved": bool((fast2 != fast1).any()),
                          "unskipped_empty_step_moved": bool((full2 != full1).any()),
                          "max_diff_between_ranks": (both[0][1] - both[1][1]).abs().max().item()}), flush=True)
    for s in (fast, full):
        s.tracker.close()
    shutdown(world)


if __name__ == "__main__":
    main()
