"""Dynamic sampling for group-based RL: keep only the prompt groups whose rewards spread (a group where
every completion scored the same has all advantages 0 and teaches nothing) and generate more prompts
until the batch is full or a cap on generation rounds is reached.

    groups, stats = fill_groups(examples, ctx.draw_examples, generate, max_rounds, ctx.world)

`generate(examples)` samples each example's group and returns one object per example with `spread`
(bool: the group's rewards differ) and `generated_tokens` (completion tokens sampled). Rounds are
agreed across ranks: while any rank is short, every rank draws the next slice of its prompt stream
(a rank already full draws and discards it, without generating), so the streams -- and so resume --
stay in step and no collective is left waiting. When the cap is hit the batch trains on the groups it
found, fewer than asked (`stats.cap_hit`); with none at all it trains the first round's groups, whose
advantages are all 0 (the trainer then skips the optimizer step: `train/skipped_steps`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch


@dataclass
class FillStats:
    rounds: int  # generation rounds this rank ran (its first included)
    filtered: int  # groups generated and dropped for no reward spread
    generated_tokens: int  # completion tokens sampled over all rounds
    cap_hit: bool  # the cap was reached with fewer spread groups than asked for

    def metrics(self, trained_tokens: int) -> dict[str, torch.Tensor]:
        return {"rollout/generation_rounds": torch.tensor(float(self.rounds)),
                "rollout/groups_filtered": torch.tensor(float(self.filtered)),
                "rollout/generated_per_trained_token": torch.tensor(self.generated_tokens / max(trained_tokens, 1)),
                "rollout/dynamic_cap_hit": torch.tensor(float(self.cap_hit))}


def any_rank(world: Any, flag: bool) -> bool:
    """True when `flag` is true on any rank (this process's flag without a world)."""
    if world is None or not getattr(world, "distributed", False):
        return flag
    return bool(world.all_reduce_max(torch.tensor(int(flag))).item())


def fill_groups(examples: Sequence[Any], draw: Optional[Callable[[], Sequence[Any]]],
                generate: Callable[[Sequence[Any]], list[Any]], max_rounds: int, world: Any = None
                ) -> tuple[list[Any], FillStats]:
    """Up to len(examples) groups with reward spread, generated over at most `max_rounds` rounds."""
    want = len(examples)
    kept: list[Any] = []
    first: list[Any] = []
    filtered = generated = rounds = 0
    batch = list(examples)
    for index in range(max_rounds):
        if len(kept) < want:
            groups = generate(batch)
            rounds += 1
            first = first or groups
            for group in groups:
                generated += group.generated_tokens
                if group.spread:
                    kept.append(group)
                else:
                    filtered += 1
        if index + 1 == max_rounds or draw is None or not any_rank(world, len(kept) < want):
            break
        batch = list(draw())  # every rank draws, full or not: the prompt streams stay in step
    stats = FillStats(rounds, filtered, generated, cap_hit=len(kept) < want)
    return (kept[:want] if kept else first), stats
