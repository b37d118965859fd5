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

Shared by GRPO, CLM's stepwise GRPO and TESD's teacher term: the keys (the `DynamicSampling` option
group, with their check) and the difficulty filter across epochs (`Retirement`, `retire_after`). Each
algorithm declares its own `dynamic_metric`, since what spreads differs between them.
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
    spread: int = 0  # groups generated with reward spread (those past a full batch included)

    def metrics(self, trained_tokens: int) -> dict[str, torch.Tensor]:
        return {"rollout/generation_rounds": torch.tensor(float(self.rounds)),
                "rollout/groups_filtered": torch.tensor(float(self.filtered)),
                "rollout/generated_per_trained_token": torch.tensor(self.generated_tokens / max(trained_tokens, 1)),
                "rollout/dynamic_cap_hit": torch.tensor(float(self.cap_hit)),
                # the share of the groups generated that carried a signal: 1 - frac_zero_std before filtering
                "rollout/spread_share": torch.tensor(self.spread / max(self.spread + self.filtered, 1))}


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
    filtered = generated = rounds = spread = 0
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
                    spread += 1
                else:
                    filtered += 1
        if index + 1 == max_rounds or draw is None or not any_rank(world, len(kept) < want):
            break
        batch = list(draw())  # every rank draws, full or not: the prompt streams stay in step
    stats = FillStats(rounds, filtered, generated, cap_hit=len(kept) < want, spread=spread)
    return (kept[:want] if kept else first), stats


@dataclass
class DynamicSampling:
    """The dynamic-sampling keys of the group-based algorithms (grpo, clm, tesd), composed into their
    configs; each also declares `dynamic_metric` (which spread counts) with the values it accepts."""

    dynamic_sampling: bool = False  # train only groups whose metric spreads, sampling more prompts to fill the batch
    dynamic_max_rounds: int = 4  # generation rounds per step at most, the first included
    retire_after: int = 0  # > 0 (with dynamic_sampling): retire a prompt whose group was all right, or all
    # wrong, on this many visits in a row; it is not sampled again

    def check_dynamic_sampling(self, metric: str, metrics: Sequence[str]) -> None:
        """`dynamic_max_rounds` >= 1, the config's `dynamic_metric` (declared by each algorithm's config,
        passed as `metric`) one of `metrics`, `retire_after` >= 0 and > 0 only with `dynamic_sampling`."""
        if self.dynamic_max_rounds < 1:
            raise ValueError(f"algo.dynamic_max_rounds={self.dynamic_max_rounds} must be >= 1")
        if metric not in metrics:
            raise ValueError(f"algo.dynamic_metric={metric} is not one of {', '.join(metrics)}")
        if self.retire_after < 0 or (self.retire_after > 0 and not self.dynamic_sampling):
            raise ValueError(f"algo.retire_after={self.retire_after} must be >= 0, and > 0 only with "
                             "algo.dynamic_sampling=true (retired prompts are replaced by drawing more)")


class Retirement:
    """Online difficulty filtering across epochs (`retire_after` = n > 0): a prompt whose group was all
    right, or all wrong, on n visits in a row is retired and not generated again. Each rank counts the
    visits of the prompts it generated (`rank_state_dict`); the retirements of a step are shared with
    every rank at its end (`share`), since a prompt may fall on another rank next epoch, and saved once
    (`state_dict`). With n = 0 nothing is counted."""

    def __init__(self, after: int):
        self.after = after
        self.retired: dict[str, str] = {}  # uid -> "solved" | "unsolved", the same on every rank
        self.streaks: dict[str, tuple[str, int]] = {}  # this rank's visits: uid -> (outcome, visits in a row)
        self._newly: list[tuple[str, str]] = []
        self.skipped = 0  # retired prompts passed over this step

    def begin_step(self) -> None:
        self._newly, self.skipped = [], 0

    def live(self, examples: Sequence[Any]) -> list[Any]:
        """`examples` less the retired ones (counted in `skipped`)."""
        live = [ex for ex in examples if ex.uid not in self.retired]
        self.skipped += len(examples) - len(live)
        return live

    def visit(self, uid: str, correct: Sequence[float]) -> None:
        """Count one visit of a prompt whose group scored `correct` (1 right, 0 wrong; partial scores
        break a streak); at n visits in a row with the same outcome it is retired at the step's end."""
        if self.after <= 0 or not correct:
            return
        outcome = "solved" if all(x >= 1.0 for x in correct) else "unsolved" if all(x <= 0.0 for x in correct) else None
        if outcome is None:
            self.streaks.pop(uid, None)
            return
        previous, count = self.streaks.get(uid, (outcome, 0))
        count = count + 1 if previous == outcome else 1
        self.streaks[uid] = (outcome, count)
        if count >= self.after:
            self._newly.append((uid, outcome))
            self.streaks.pop(uid)

    def share(self, world: Any) -> None:
        """Every rank's retirements of this step, on every rank (called by all ranks at the same point)."""
        parts = world.gather_objects(self._newly) if world is not None and getattr(world, "distributed", False) \
            else [self._newly]
        for part in parts:
            self.retired.update(dict(part))
        self._newly = []

    def metrics(self) -> dict[str, torch.Tensor]:
        kinds = list(self.retired.values())
        return {"rollout/retired_solved": torch.tensor(float(kinds.count("solved"))),
                "rollout/retired_unsolved": torch.tensor(float(kinds.count("unsolved"))),
                "rollout/retired_skipped": torch.tensor(float(self.skipped))}

    def state_dict(self) -> dict:
        return {"retired": dict(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.retired = dict(state.get("retired", {}))

    def rank_state_dict(self) -> dict:
        return {"streaks": {uid: list(v) for uid, v in self.streaks.items()}}

    def load_rank_state_dict(self, state: dict) -> None:
        self.streaks = {uid: (v[0], int(v[1])) for uid, v in state.get("streaks", {}).items()}


class ReferenceAndRetirementState:
    """The checkpointed state of an RL algorithm with a frozen KL reference (`self.reference`, saved when
    `cfg.beta > 0`) and a `self.retirement` (grpo, clm). Rollouts are not saved: a resumed run generates
    afresh (grpo's batch reused for num_iterations, clm's engine sessions)."""

    def state_dict(self) -> dict:
        """What every rank shares (rank 0 writes it): the reference's weights and the retired prompts."""
        state = {"reference": self.reference.state_dict()} if self.cfg.beta > 0 else {}
        if self.cfg.retire_after > 0:
            state.update(self.retirement.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        if "reference" in state:
            self.reference.load_state_dict(state["reference"])
        self.retirement.load_state_dict(state)

    def rank_state_dict(self) -> dict:
        """This rank's visit streaks towards retirement (retire_after)."""
        return self.retirement.rank_state_dict()

    def load_rank_state_dict(self, state: dict) -> None:
        self.retirement.load_rank_state_dict(state)
