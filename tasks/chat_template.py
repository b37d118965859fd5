"""A task's prompts rendered through a tokenizer's chat template.

    task = with_chat(build_task("arith"), tokenizer, "auto")   # the task itself when no template applies
    task.prompt(ex)            # "<|im_start|>user\n...question...<|im_end|>\n<|im_start|>assistant\n"

`TemplatedTask` wraps any task: the student prompt and the teacher prompt (the question with the
privileged reference) each become the content of the user turn, after the example's earlier turns
(a conversational row's system prompt and history), rendered with the generation cue. Everything
else (examples, verifier, spans, mask token, ...) is the wrapped task's, so every algorithm, the
evaluation and the rollouts see templated prompts without knowing about templates. The prompt text
then becomes ids through `models.prompts.prompt_ids`, like any prompt.
"""
from __future__ import annotations

from typing import Any

from models.prompts import ChatTemplateError, chat_parts, plain_turns, render, use_chat
from tasks.base import Example, HasArtifacts, Segments, TokenizesRows, task_capabilities


class TemplatedTask:
    """`task` with its prompts rendered by `tokenizer`'s chat template (see the module docstring)."""

    def __init__(self, task: Any, tokenizer: Any):
        self.task, self.tokenizer = task, tokenizer

    def __getattr__(self, name: str) -> Any:  # everything but the prompts is the wrapped task's
        task = self.__dict__.get("task")
        if task is None:
            raise AttributeError(name)
        if name == "segments" and isinstance(task, HasArtifacts):  # only a task with artifacts has segments
            return self._segments
        return getattr(task, name)

    def _content(self, example: Example, text: str) -> str:
        """The user turn's content: the wrapped task's prompt text without its plain rendering of earlier turns."""
        plain = plain_turns(example.turns)
        if not text.startswith(plain):
            raise ChatTemplateError(f"task {self.task.name}: example {example.uid}: its prompt does not start "
                                    "with its earlier turns")
        return text[len(plain):]

    def prompt(self, example: Example) -> str:
        return render(self.tokenizer, self._content(example, self.task.prompt(example)), example.turns, chat=True)

    def teacher_prompt(self, example: Example, reference: str) -> str:
        text = self.task.teacher_prompt(example, reference)
        return render(self.tokenizer, self._content(example, text), example.turns, chat=True)

    def _segments(self, example: Example) -> Segments:
        """The wrapped segments inside the user turn: the template's head joins the shared prefix, its tail the query."""
        inner = self.task.segments(example)
        head, tail = chat_parts(self.tokenizer, example.turns)
        plain = plain_turns(example.turns)
        if not inner.prefix.startswith(plain):
            raise ChatTemplateError(f"task {self.task.name}: example {example.uid}: its prompt does not start "
                                    "with its earlier turns")
        return Segments(head + inner.prefix[len(plain):], inner.artifacts, inner.query + tail)


def with_chat(task: Any, tokenizer: Any, mode: Any) -> Any:
    """`task` with chat-templated prompts when `mode` (auto | true | false) says so, else `task` itself.

    A task that renders its own prompt (data=clm: the context file is the whole input) is never
    wrapped; asking for a template there (`true`) is an error. A task that tokenizes its rows as written
    (data=chat) renders its own conversational rows: it is bound to the tokenizer instead."""
    if isinstance(task, TokenizesRows):
        return task.bind(tokenizer, use_chat(tokenizer, mode))
    if task_capabilities(task).renders_own_prompts:
        if str(mode).strip().lower() in ("true", "1", "yes", "on"):
            raise ChatTemplateError(f"task {task.name} writes its own prompts (the context file is the whole input); "
                                    "chat_template=true does not apply to it: use auto or false")
        return task
    return TemplatedTask(task, tokenizer) if use_chat(tokenizer, mode) else task
