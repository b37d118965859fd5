"""Tasks: a dataset plus a verifier, and answer extraction. Algorithms and the trainer import
tasks; tasks import nothing of theirs (only `models.tokenizer` for the embedded alphabet).

    from tasks import build_task
    task = build_task("arith", seed=0, digits=3, steps=2)          # the embedded task
    task = build_task("multipath", seed=0, digits=2, steps=3)      # arith whose operations go in any order
    task = build_task("text", path="data/train.jsonl", test_fraction=0.1)
    task = build_task("chat", path="chat.jsonl", test_fraction=0.1)   # rows in TRL's formats, trained as written
    task = build_task("artifacts", seed=0, n_artifacts=4)               # table lookups (single/select/combine)
    task = build_task("clm", seed=0, budget=200)                 # context-management episodes (ContextEnv)
    result = task.verify(example, completion)                    # VerifyResult; score(result, mode)

Modules: `base` (Example, VerifyResult, score, extract_answer, answers_equal, mask_spans),
`arith` (ArithTask and its worked-solution format), `multipath` (MultiPathTask: arith problems
with several valid solution orders, verified step by step in any valid order), `artifacts` (ArtifactTask: lookups in named
tables, each a separate prompt artifact), `clm` (ClmTask, ContextEnv, Episode: episodes in which the
model keeps its own context file within a token budget; the file format is `context_file`), `text`
(TextTask: JSONL / Parquet / CSV / saved datasets / hub; rows may carry an `artifacts` list), `chat`
(ChatTask: rows in TRL's dataset formats, tokenized as TRL's SFTTrainer does; `chat_template` is the
wrapper that renders the other tasks' prompts through a tokenizer's chat template). No
Hydra here: tasks take plain keyword arguments.

Each task module also holds the task's config, a `TaskConfig` dataclass of its keys (ArithConfig, ...,
the `data` section of a run), registered in `TASK_CONFIGS` by name; `task_config("arith", digits=3).build()`
makes the task as `data=arith data.digits=3` does. Adding a task: docs/adding-a-task.md.
Run the tests with `python -m pytest tests/tasks -q`.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from tasks.arith import ArithConfig, ArithTask
from tasks.multipath import MultiPathConfig, MultiPathTask
from tasks.artifacts import ArtifactTask, ArtifactsConfig, kind_of
from tasks.clm import ClmConfig, ClmTask, ContextEnv, Episode, EpisodeError, scripted_output
from tasks.context_file import TINY_FORMAT, Action, ContextFile, ContextFormat, Turn, parse_action
from tasks.base import (
    DataError,
    Example,
    HasArtifacts,
    HasSolutionPaths,
    RendersOwnPrompts,
    PromptTemplates,
    Segments,
    Task,
    TaskCapabilities,
    TaskConfig,
    MayLackAnswers,
    TokenizesRows,
    VerifyResult,
    answers_equal,
    extract_answer,
    mask_spans,
    score,
    task_capabilities,
)
from tasks.text import TextConfig, TextTask
from tasks.chat import ChatConfig, ChatTask

# The task registry: each task's config class (its keys, its name, the task it builds). `data=NAME` runs
# the task whose config is named NAME; a new task registers its config here (docs/adding-a-task.md).
TASK_CONFIGS: dict[str, type[TaskConfig]] = {
    c.name: c for c in (ArithConfig, MultiPathConfig, ArtifactsConfig, ClmConfig, TextConfig, ChatConfig)}
TASKS: dict[str, Callable[..., Task]] = {name: c.task_class for name, c in TASK_CONFIGS.items()}
# Named user datasets: a preset is TextTask keyword arguments the caller may override.
PRESETS: dict[str, dict[str, Any]] = {
    "gsm8k": dict(path="openai/gsm8k", hub_config="main", solution_field="answer", answer_field=None,
                  name="gsm8k"),
}


def build_task(name: str, **kwargs: Any) -> Task:
    """A task by name (`TASKS`, built from keyword arguments: "text" takes `path`, ...), a preset, or an existing
    local path (a text task)."""
    if name in TASKS:
        return TASKS[name](**kwargs)
    if name in PRESETS:
        return TextTask(**{**PRESETS[name], **kwargs})
    if os.path.exists(os.path.expanduser(name)):
        return TextTask(path=name, **kwargs)
    raise DataError(f"unknown task {name!r}; expected one of {sorted(TASKS) + sorted(PRESETS)} or an existing path")


def task_config(name: str, **values: Any) -> TaskConfig:
    """The registered config of task `name` with `values` set (`data=NAME` with `data.KEY=VALUE`s, in code).
    DataError naming the task for an unknown name; TypeError naming the key for one the task lacks."""
    if name not in TASK_CONFIGS:
        raise DataError(f"unknown task {name!r}; expected one of {', '.join(sorted(TASK_CONFIGS))}")
    return TASK_CONFIGS[name](**values)


__all__ = [
    "Action", "answers_equal", "ArithConfig", "ChatConfig", "ChatTask", "MayLackAnswers", "TokenizesRows", "ArithTask", "ArtifactsConfig", "ArtifactTask", "build_task",
    "ClmConfig", "ClmTask", "ContextEnv", "ContextFile", "ContextFormat", "DataError", "Episode", "EpisodeError",
    "Example", "extract_answer", "HasArtifacts", "HasSolutionPaths", "kind_of", "mask_spans", "MultiPathConfig",
    "MultiPathTask", "parse_action", "PRESETS", "PromptTemplates", "RendersOwnPrompts", "score", "scripted_output",
    "Segments", "Task", "task_capabilities", "task_config", "TASK_CONFIGS", "TaskCapabilities", "TaskConfig",
    "TASKS", "TextConfig", "TextTask", "TINY_FORMAT", "Turn", "VerifyResult",
]
