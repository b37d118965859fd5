"""Reward functions as TRL writes them: `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`.

    algo.reward_funcs=[verifier,my_pkg.rewards:format_reward,./rewards.py:length_penalty]
    algo.reward_weights=[1.0,0.5,0.1]

Each function is called once per batch of completions with:
- `prompts`: each completion's prompt as its row wrote it (data=chat: the `prompt` / `messages` before
  the completion, a string or a list of messages); for the generated tasks the prompt text the model read
  (clm: the episode's question);
- `completions`: the decoded completions (special tokens skipped), strings for string prompts and
  `[{"role": "assistant", "content": text}]` for conversational prompts, as TRL passes them;
- `completion_ids`: each completion's token ids;
- `**columns`: every other column of the rows (a list per column, one entry per completion; data=chat
  keeps every column as read, the generated tasks give `question`, `solution` and `answer`).
It returns one float per completion, or None where it does not apply. The reward of a completion is
the weighted sum of the functions that apply to it (None skipped, as TRL's `nansum`); a completion that
none applies to is invalid (advantage 0). `verifier` names the task's own verifier (`reward_mode`) as
one such function; without `reward_funcs` it is the only one. Each function's mean and std over the
completions it applies to are logged as `rewards/NAME/mean` and `rewards/NAME/std` (TRL's names).

A function that cannot be imported, raises, returns the wrong number of values or a value that is not
a number is a `RewardError` naming the function (and the first offending row): one line, exit 3.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from tasks import DataError

VERIFIER = "verifier"  # the task's own verifier as a reward function


class RewardError(DataError):
    """A reward function that cannot be loaded or returned something unusable; the message names it."""


@dataclass
class RewardFunctions:
    """The reward-function keys (an option group of grpo; see the module docstring)."""

    # "package.module:function", "./file.py:function" or "verifier"; empty = the task's verifier alone
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)  # one per function; empty = all 1.0

    def check_reward_funcs(self) -> None:
        """Each spec's shape and the weights' count (importing waits for the run: RewardError, exit 3)."""
        for spec in self.reward_funcs:
            if spec != VERIFIER and not _split(spec):
                raise ValueError(f"algo.reward_funcs: {spec!r} must look like 'package.module:function', "
                                 "'./file.py:function' or 'verifier'")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs or [VERIFIER]):
            raise ValueError(f"algo.reward_weights has {len(self.reward_weights)} values for "
                             f"{len(self.reward_funcs or [VERIFIER])} reward function(s)")


@dataclass(frozen=True)
class Reward:
    name: str
    fn: Optional[Callable[..., Sequence[Optional[float]]]]  # None: the task's verifier (its scores are passed in)
    weight: float


def _split(spec: str) -> Optional[tuple[str, str]]:
    where, sep, name = spec.rpartition(":")
    return (where, name) if sep and where and name.isidentifier() else None


def load_reward_function(spec: str) -> tuple[str, Callable]:
    """(name, function) of "package.module:function" or "path/to/file.py:function"; RewardError when it cannot
    be loaded."""
    parts = _split(spec)
    if parts is None:
        raise RewardError(f"reward function {spec!r} must look like 'package.module:function' or './file.py:function'")
    where, name = parts
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no such file {where}")
            module_name = f"posttrain_reward_{path.stem}_{abs(hash(str(path)))}"
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        fn = getattr(module, name)
    except Exception as err:  # an import error, a missing name, an error raised by the module itself
        raise RewardError(f"reward function {spec!r} cannot be loaded: {type(err).__name__}: {err}") from None
    if not callable(fn):
        raise RewardError(f"reward function {spec!r} is not callable")
    return name, fn


def build_rewards(opts: RewardFunctions) -> list[Reward]:
    """The configured reward functions, loaded (RewardError when one cannot be); `verifier` has no function of
    its own: `call_rewards` takes the task's verifier scores for it."""
    specs = opts.reward_funcs or [VERIFIER]
    weights = opts.reward_weights or [1.0] * len(specs)
    out = []
    for spec, weight in zip(specs, weights):
        name, fn = (VERIFIER, None) if spec == VERIFIER else load_reward_function(spec)
        out.append(Reward(name, fn, float(weight)))
    names = [r.name for r in out]
    if len(set(names)) != len(names):  # two files' functions of one name: keep the metrics apart
        out = [Reward(f"{r.name}_{i}" if names.count(r.name) > 1 else r.name, r.fn, r.weight)
               for i, r in enumerate(out)]
    return out


def reward_inputs(task: Any, examples: Sequence[Any], texts: Sequence[str], ids: Sequence[Sequence[int]],
                  prompt_of: Optional[Callable[[Any], str]] = None) -> tuple[list, list, list, dict[str, list]]:
    """(prompts, completions, completion_ids, columns) of completions paired with their examples, as TRL's
    GRPOTrainer passes them to a reward function (see the module docstring). `prompt_of`: the prompt of an
    example without a row as written (default: the task's prompt text)."""
    prompt_of = prompt_of or task.prompt
    prompts, completions = [], []
    for ex, text in zip(examples, texts):
        row = ex.row
        prompt = row.prompt if row is not None else prompt_of(ex)
        prompts.append(list(prompt) if isinstance(prompt, tuple) else prompt)
        completions.append([{"role": "assistant", "content": text}] if isinstance(prompt, tuple) else text)
    columns: dict[str, list] = {}
    for i, ex in enumerate(examples):
        row = dict(ex.columns) if ex.columns else {"question": ex.question, "solution": ex.solution,
                                                     "answer": ex.answer}
        for key in row:
            columns.setdefault(key, [None] * len(examples))
        for key, value in row.items():
            if key not in ("prompt", "completion", "completion_ids"):
                columns[key][i] = value
    for key in ("prompt", "completion", "completion_ids"):
        columns.pop(key, None)
    return prompts, completions, [list(x) for x in ids], columns


def call_rewards(rewards: Sequence[Reward], inputs: tuple, uids: Sequence[str],
                 verifier: Optional[Sequence[float]] = None) -> torch.Tensor:
    """(N, F) rewards of N completions from F functions, NaN where a function gave None (`verifier`: the task's
    verifier scores, for the `verifier` entry); RewardError naming the function and the first offending row
    when one raises or returns something unusable."""
    prompts, completions, completion_ids, columns = inputs
    n = len(prompts)
    table = torch.full((n, len(rewards)), float("nan"), dtype=torch.float64)
    for j, r in enumerate(rewards):
        if r.fn is None:
            table[:, j] = torch.tensor(list(verifier), dtype=table.dtype)
            continue
        try:
            values = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except RewardError:
            raise
        except Exception as err:
            raise RewardError(f"reward function {r.name} raised {type(err).__name__}: {err} "
                              f"(on a batch of {n} completions starting with row {uids[0]})") from None
        values = list(values) if values is not None else None
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} values"
            raise RewardError(f"reward function {r.name} returned {got} for {n} completions (one per completion "
                              f"expected; the batch starts with row {uids[0]})")
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not _scalar(v):
                raise RewardError(f"reward function {r.name} returned {v!r} ({type(v).__name__}) for row {uids[i]}: "
                                  "expected a number or None")
            table[i, j] = float(v) if math.isfinite(float(v)) else float("nan")
    return table


def _scalar(v: Any) -> bool:
    """A numpy / torch scalar."""
    return hasattr(v, "item") and getattr(v, "ndim", 1) == 0


def combine(table: torch.Tensor, rewards: Sequence[Reward]) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward, valid) per completion: the weighted sum over the functions that apply (None skipped), and
    whether any applies."""
    weights = torch.tensor([r.weight for r in rewards], dtype=table.dtype)
    valid = ~torch.isnan(table).all(dim=1)
    total = (torch.nan_to_num(table, nan=0.0) * weights).sum(dim=1)
    return total, valid


def reward_metrics(table: torch.Tensor, rewards: Sequence[Reward]) -> dict[str, torch.Tensor]:
    """`rewards/NAME/mean` and `rewards/NAME/std` over the completions each function applies to."""
    out = {}
    for j, r in enumerate(rewards):
        col = table[:, j][~torch.isnan(table[:, j])].float()
        out[f"rewards/{r.name}/mean"] = col.mean() if col.numel() else torch.tensor(0.0)
        out[f"rewards/{r.name}/std"] = col.std() if col.numel() > 1 else torch.tensor(0.0)
    return out
