"""Group-relative advantages shared by the policy-gradient algorithms (GRPO, CLM, TESD's teacher term).

    adv, zero_std = group_advantages(rewards, valid, group_size=G)          # (N,), (N // G,)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SCALES = ("group", "batch", "none")


@dataclass
class GroupRollouts:
    """The keys of the group-relative policy-gradient algorithms (grpo, clm), composed into their
    configs with their check: G samples per prompt, scored against each other."""

    num_generations: int = 8  # G samples per prompt (grpo: completions; clm: episodes per task)
    scale_rewards: str = "group"  # group | batch | none: what the centred rewards are divided by
    advantage_eps: float = 1e-4  # added to the std before dividing

    def check_group_rollouts(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"algo.num_generations={self.num_generations} must be >= 1")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"algo.scale_rewards={self.scale_rewards} is not one of {', '.join(SCALES)}")
        if self.advantage_eps < 0:
            raise ValueError(f"algo.advantage_eps={self.advantage_eps} must be >= 0")


def group_advantages(rewards: torch.Tensor, valid: torch.Tensor, group_size: int, eps: float = 1e-4,
                     scale: str = "group", world: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of (N,) rewards in consecutive groups of `group_size`, only `valid` samples counted.

    Returns (A (N,), zero_std (N // G,) bool: groups that carry no learning signal). Invalid samples
    and groups with < 2 valid samples get A = 0. `scale`: group -> divide by the group's unbiased std;
    batch -> by the std of all valid rewards of the global batch (`world` all-reduces the sums);
    none -> no division (Dr. GRPO).
    Example: rewards [1, 0, 0, 1], G=4 -> mean .5, std .57735 -> A = +-0.5/0.57745 = +-0.8659.
    """
    r = rewards.double().view(-1, group_size)
    v = valid.view(-1, group_size).double()
    n = v.sum(1, keepdim=True)
    mean = (r * v).sum(1, keepdim=True) / n.clamp(min=1)
    centred = (r - mean) * v
    var = (centred ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)
    zero_std = (var.squeeze(1) <= 0) | (n.squeeze(1) < 2)
    if scale == "group":
        centred = centred / (var.sqrt() + eps)
    elif scale == "batch":
        stats = torch.stack([(r * v).sum(), (r * r * v).sum(), v.sum()])
        if world is not None:
            stats = world.all_reduce_sum(stats)
        total, squares, count = stats.tolist()
        batch_var = (squares - total * total / max(count, 1.0)) / max(count - 1.0, 1.0)
        centred = centred / (math.sqrt(max(batch_var, 0.0)) + eps)
    elif scale != "none":
        raise ValueError(f"unknown scale_rewards {scale!r}; expected one of {', '.join(SCALES)}")
    centred = torch.where(n < 2, torch.zeros_like(centred), centred)
    return centred.view(-1).float(), zero_std
