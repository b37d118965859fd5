"""`chat`: your own rows in TRL's dataset formats, trained as written.

    data=chat data.path=train.jsonl data.test_fraction=0.1
    data=chat data.path=openai/gsm8k data.hub_config=main data.train_split='train[:10%]'

Formats (decided by the data set's columns, one format per data set):
- conversational: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]}`;
- prompt-completion: `{"prompt": ..., "completion": ...}`, each a string or a list of messages;
- prompt-only (RL: the completion is the model's own): `{"prompt": ...}`;
- language modelling: `{"text": ...}` (SFT only: there is no prompt to answer).
Every column of a row is kept as read (`Example.columns`), for reward functions.

Sources, all read through `datasets`: a `.jsonl` / `.json` / `.parquet` / `.csv` / `.tsv` file (one
split), a directory written by `save_to_disk` (a directory of such directories: `data.hub_config` picks
one), a directory of data files, or a Hub name with `data.hub_config` and `data.revision`. Split names
may carry a slice (`train[:10%]`, `train[100:200]`).

How a row becomes tokens (`ChatTask.row_tokens`, the SFT row) follows TRL's `SFTTrainer`:
- string rows: `tokenizer(prompt + completion + eos)`; the completion starts where the tokenized prompt
  and prompt + completion diverge. Strings are never put through a chat template.
- messages, with the tokenizer's chat template (data.chat_template): the conversation rendered by it.
  The loss (data.loss_on) covers `assistant`: every assistant turn, each with the template's end of
  turn (a template with `{% generation %}` markers marks them itself; otherwise the turn is the text
  between the render of the messages before it, with the generation cue, and the render with it, and
  each of those renders must be a prefix of the next), `completion`: what follows the prompt (the
  trailing assistant turns of a `messages` row), or `all`.
- messages without a template (chat_template=false, or a tokenizer with none, as the embedded tiny
  model's): each turn's content on its own line, then EOS; the same spans are in the loss.
Prompts for rollouts and evals are the prompt rendered the same way with the generation cue, as ids
through `models.prompts.prompt_ids`. Nothing is appended to a row and no answer is required: the eval
reports held-out loss on the loss tokens, and accuracy only where `data.answer_field` names a column
of reference answers (`verify` then compares the completion's final answer with it).
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from models.prompts import ROLES, adds_bos, has_chat_template
from tasks.base import (
    DataError,
    Example,
    TaskConfig,
    VerifyResult,
    answers_equal,
    check_template,
    extract_answer,
    fill_template,
    hold_out,
    split_lines,
    split_sentences,
)

FORMATS = ("messages", "prompt_completion", "prompt", "text")
LOSS_ON = ("assistant", "completion", "all")
FILE_BUILDERS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet",
                 ".csv": "csv", ".tsv": "csv"}
CHAT_TEACHER_PROMPT = ("{question}\n\nHere is a reference response:\n{reference}\n\n"
                       "After reading the reference, write your own response.")
CHAT_MASK_TOKEN = "[...]"
_SPLIT = re.compile(r"^([\w.-]+)(\[.*\])?$")


# ---------------------------------------------------------------------------------------------
# Rows as written


@dataclass(frozen=True)
class Row:
    """One row in its format: `prompt` then `completion`, each a tuple of message dicts or a string.
    messages rows: the prompt is every turn before the trailing assistant turns, which are the completion.
    prompt-only rows have no completion (None); text rows have the prompt "" and the text as completion."""

    format: str
    prompt: Any
    completion: Any

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, tuple)

    def messages(self) -> list[dict]:
        """The whole conversation (conversational rows)."""
        return list(self.prompt) + list(self.completion or ())


def row_format(columns: Sequence[str]) -> str:
    """The data set's format from its column names (TRL's order of precedence)."""
    if "messages" in columns:
        return "messages"
    if "prompt" in columns:
        return "prompt_completion" if "completion" in columns else "prompt"
    if "text" in columns:
        return "text"
    raise DataError(f"expected a 'messages', 'prompt' (with or without 'completion') or 'text' column; "
                    f"the data has {sorted(columns)}")


def parse_row(raw: dict, fmt: str) -> Row:
    """`raw` as a Row of format `fmt`; DataError (without the row's place, the caller adds it) when malformed."""
    if fmt == "messages":
        turns = _messages(raw.get("messages"), "messages")
        k = len(turns)
        while k > 0 and turns[k - 1]["role"] == "assistant":
            k -= 1
        return Row(fmt, turns[:k], turns[k:])
    if fmt == "text":
        return Row(fmt, "", _string(raw, "text"))
    prompt = raw.get("prompt")
    if prompt is None:
        raise DataError("missing 'prompt'")
    prompt = _messages(prompt, "prompt") if isinstance(prompt, list) else _string(raw, "prompt")
    if fmt == "prompt":
        return Row(fmt, prompt, None)
    completion = raw.get("completion")
    if completion is None:
        raise DataError("missing 'completion'")
    if isinstance(prompt, tuple) != isinstance(completion, list):
        raise DataError("'prompt' and 'completion' must both be strings or both be lists of messages")
    completion = _messages(completion, "completion") if isinstance(completion, list) else _string(raw, "completion")
    return Row(fmt, prompt, completion)


def _messages(value: Any, field: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"'{field}' must be a non-empty list of {{'role', 'content'}} messages, "
                        f"got {type(value).__name__ if value is not None else 'nothing'}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(f"'{field}' message {i} must be an object with a 'role' and a 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"'{field}' message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"'{field}' message {i} ({m['role']}) must have a string 'content'")
    return tuple(value)


def _string(raw: dict, field: str) -> str:
    value = raw.get(field)
    if not isinstance(value, str):
        raise DataError(f"'{field}' must be a string, got {type(value).__name__ if value is not None else 'nothing'}")
    return value


# ---------------------------------------------------------------------------------------------
# Reading a split through `datasets`


def load_split(path: str, split: str, hub_config: Optional[str] = None, revision: Optional[str] = None) -> Any:
    """One split (a name with an optional slice, `train[:10%]`) of `path` as a `datasets.Dataset`."""
    m = _SPLIT.match(split.replace(" ", ""))
    if not m:
        raise DataError(f"{path}: split {split!r} is not a name with an optional slice, e.g. train or train[:10%]")
    import datasets

    if not Path(path).expanduser().exists():  # a Hub download: its progress bars stay
        return _load(path, split, m, hub_config, revision)
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # local files read in a blink; their bars would bury a one-line error
    try:
        return _load(path, split, m, hub_config, revision)
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def _load(path: str, split: str, m: re.Match, hub_config: Optional[str], revision: Optional[str]) -> Any:
    p = Path(path).expanduser()
    try:
        if p.is_file():
            return _load_file(p, "train" + (m.group(2) or ""))
        if p.is_dir():
            return _load_dir(p, split, m.group(1), hub_config, revision)
        if p.suffix.lower() in FILE_BUILDERS or path.startswith((".", "/", "~")) or path.count("/") > 1:
            raise DataError(f"{path}: no such file or directory")
        import datasets

        return datasets.load_dataset(path, hub_config, split=split, revision=revision)
    except DataError:
        raise
    except Exception as e:  # datasets' own errors (a bad file, an unknown split or config, offline): one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{path}: could not read split {split!r}: {type(e).__name__}: {first}") from e


def _load_file(p: Path, split: str) -> Any:
    import datasets

    builder = FILE_BUILDERS.get(p.suffix.lower())
    if builder is None:
        raise DataError(f"{p}: unsupported file type {p.suffix!r}; expected one of {', '.join(FILE_BUILDERS)}")
    extra = {"delimiter": "\t"} if p.suffix.lower() == ".tsv" else {}
    return datasets.load_dataset(builder, data_files={"train": str(p)}, split=split, **extra)


def _load_dir(p: Path, split: str, name: str, hub_config: Optional[str], revision: Optional[str]) -> Any:
    import datasets

    configs = sorted(d.name for d in p.iterdir() if d.is_dir() and _saved(d))
    if configs and not _saved(p):  # one saved data set per config: data.hub_config picks one
        if hub_config not in configs:
            raise DataError(f"{p}: holds the saved data sets {', '.join(configs)}; pick one with data.hub_config"
                            + (f" (not {hub_config!r})" if hub_config else ""))
        p = p / hub_config
    elif hub_config and _saved(p):
        raise DataError(f"{p}: one saved data set, without configs; leave data.hub_config unset (not {hub_config!r})")
    if not _saved(p):  # a directory of data files, or a Hub-layout repository with its configs
        return datasets.load_dataset(str(p), hub_config, split=split, revision=revision)
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if name not in ds:
            raise DataError(f"{p}: no split {name!r}; it has {', '.join(sorted(ds))}")
        ds = ds[name]
    return _sliced(ds, name + (_SPLIT.match(split.replace(" ", "")).group(2) or ""))


def _saved(p: Path) -> bool:
    return (p / "dataset_dict.json").exists() or (p / "state.json").exists()


def _sliced(ds: Any, spec: str) -> Any:
    """`ds` cut by the slice of a split spec (`train[:10%]`), as `load_dataset(split=...)` cuts."""
    from datasets import ReadInstruction, concatenate_datasets

    name = spec.split("[", 1)[0]
    parts = ReadInstruction.from_spec(spec).to_absolute({name: len(ds)})
    pieces = [ds.select(range(a.from_, a.to)) for a in parts]
    return pieces[0] if len(pieces) == 1 else concatenate_datasets(pieces)


# ---------------------------------------------------------------------------------------------
# Rendering and tokenizing a row


def render_messages(tokenizer: Any, messages: Sequence[dict], chat: bool, generation: bool) -> str:
    """The messages as text: the chat template's render (`generation`: with the assistant cue), or without a
    template each message's content on its own line."""
    if not chat:
        return "".join(m["content"] if m["content"].endswith("\n") else m["content"] + "\n" for m in messages)
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    return len(os.path.commonprefix([list(a), list(b)]))


def has_generation_markers(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("default", "")
    return bool(re.search(r"\{%-?\s*generation\s*-?%\}", template))


def row_tokens(row: Row, tokenizer: Any, chat: bool, loss_on: str) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a row's SFT sequence (see the module docstring); DataError when no token is in
    the loss, or when the template cannot mark the assistant turns."""
    if row.format == "prompt":
        raise DataError("a prompt-only row has no completion to train on")
    if not row.conversational:
        ids, mask = _string_tokens(row, tokenizer, loss_on)
    elif chat and loss_on == "assistant" and has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(row.messages(), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids, mask = _conversation_tokens(row, tokenizer, chat, loss_on)
    if chat and row.conversational and adds_bos(tokenizer) and (not ids or ids[0] != tokenizer.bos_token_id):
        ids, mask = [tokenizer.bos_token_id] + ids, [0] + mask  # the prompt-ids BOS rule (models/prompts.py)
    if not any(mask):
        raise DataError(f"no token is in the loss (data.loss_on={loss_on}): the row has no "
                        f"{'assistant turn' if loss_on == 'assistant' else 'completion'}")
    return ids, mask


def _string_tokens(row: Row, tokenizer: Any, loss_on: str) -> tuple[list[int], list[int]]:
    """TRL's non-conversational rows: EOS text appended unless there, tokenized with special tokens."""
    eos = tokenizer.eos_token or ""
    completion = row.completion if row.completion.endswith(eos) else row.completion + eos
    ids = list(tokenizer(row.prompt + completion).input_ids)
    if loss_on == "all" or row.format == "text":
        return ids, [1] * len(ids)
    start = _common_prefix(tokenizer(row.prompt).input_ids, ids)
    return ids, [0] * start + [1] * (len(ids) - start)


def _conversation_tokens(row: Row, tokenizer: Any, chat: bool, loss_on: str) -> tuple[list[int], list[int]]:
    messages = row.messages()
    text = render_messages(tokenizer, messages, chat, generation=False) + ("" if chat else tokenizer.eos_token)
    if loss_on == "all":
        ids = _encode(tokenizer, text)[0]
        return ids, [1] * len(ids)
    if loss_on == "completion" or row.format == "prompt_completion":  # TRL's completion mask: the token divergence
        ids = _encode(tokenizer, text)[0]
        start = _common_prefix(_encode(tokenizer, render_messages(tokenizer, row.prompt, chat, True))[0], ids)
        return ids, [0] * start + [1] * (len(ids) - start)
    spans = assistant_spans(tokenizer, messages, chat, text)
    if not chat and messages[-1]["role"] == "assistant":  # without a template the EOS ends the last turn
        spans[-1] = (spans[-1][0], len(text))
    ids, offsets = _encode(tokenizer, text, offsets=True)
    return ids, [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]


def assistant_spans(tokenizer: Any, messages: Sequence[dict], chat: bool, text: str) -> list[tuple[int, int]]:
    """Character spans of `text` (the render of `messages`) that are the assistant turns: from the end of the
    render of the messages before a turn, with the generation cue, to the end of the render with it."""
    spans, last = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_messages(tokenizer, messages[:i], chat, generation=True)
        through = render_messages(tokenizer, messages[: i + 1], chat, generation=False)
        if not through.startswith(before) or not text.startswith(through) or len(before) < last:
            raise DataError(f"the chat template does not render the conversation's prefixes as prefixes of it "
                            f"(message {i}), so its assistant turns cannot be found; use a template with "
                            "{% generation %} markers, or data.loss_on=completion|all")
        spans.append((len(before), len(through)))
        last = len(through)
    return spans


def _encode(tokenizer: Any, text: str, offsets: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Templated text as `apply_chat_template(tokenize=True)` encodes it: no automatic special tokens."""
    out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)
    return list(out.input_ids), [tuple(o) for o in out.get("offset_mapping", [])]


# ---------------------------------------------------------------------------------------------
# The task


class ChatTask:
    """Rows in TRL's formats (see the module docstring). Built unbound; `bind(tokenizer, chat)` gives the copy
    a run reads (`tasks.chat_template.with_chat` binds it), whose prompts and row tokens use that tokenizer."""

    def __init__(self, path: str, test_path: str | None = None, train_split: str = "train",
                 test_split: str = "test", test_fraction: float = 0.0, seed: int = 0, hub_config: str | None = None,
                 revision: str | None = None, loss_on: str = "assistant", answer_field: str | None = None,
                 max_examples: int | None = None, teacher_template: str | None = None, name: str | None = None):
        if loss_on not in LOSS_ON:
            raise DataError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        if not 0.0 <= test_fraction < 1.0:
            raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
        self.name = name or Path(path).stem or path
        self.path, self.loss_on, self.answer_field = path, loss_on, answer_field
        self.teacher_template = check_template(teacher_template or CHAT_TEACHER_PROMPT, ["question", "reference"],
                                               "teacher_template")
        self.mask_token = CHAT_MASK_TOKEN
        self.tokenizer, self.chat = None, False
        self._tokens: dict[str, tuple[list[int], list[int]]] = {}
        self._lengths: dict[str, tuple[int, int]] = {}  # row_lengths, read by the length limits and the memory check
        train = self._examples(load_split(path, train_split, hub_config, revision), path, train_split)
        test = None
        if test_path:
            test = self._examples(load_split(test_path, test_split, hub_config, revision), test_path, test_split)
        elif test_fraction > 0:
            train, test = hold_out(train, test_fraction, seed, path)
        elif not Path(path).expanduser().is_file():
            try:
                test = self._examples(load_split(path, test_split, hub_config, revision), path, test_split)
            except DataError:  # no such split: eval asks for one later and says so
                test = None
        self._train = train[:max_examples] if max_examples is not None else train
        self._test = test
        self.format = self._train[0].row.format

    def _examples(self, ds: Any, path: str, split: str) -> list[Example]:
        fmt = row_format(ds.column_names)
        prefix = Path(path).name if Path(path).expanduser().is_file() else f"{Path(path).name}/{split}"
        out = []
        for n, raw in enumerate(ds, start=1):
            uid = f"{prefix}:{n}"
            try:
                out.append(self._example(raw, fmt, uid))
            except DataError as e:
                raise DataError(f"{uid}: {e}") from None
        if not out:
            raise DataError(f"{path} [{split}]: no rows")
        return out

    def _example(self, raw: dict, fmt: str, uid: str) -> Example:
        row = parse_row(raw, fmt)
        answer = ""
        if self.answer_field is not None:
            value = raw.get(self.answer_field)
            if value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise DataError(f"data.answer_field={self.answer_field}: no string or number in that column")
            answer = str(value).strip()
            if "####" in answer or "\\boxed" in answer:  # a worked solution as the answer column (gsm8k's)
                answer = extract_answer(answer) or answer
        return Example(_question(row), _reply(row), answer, uid, row=row, columns=dict(raw))

    # -- binding ------------------------------------------------------------------------------

    def bind(self, tokenizer: Any, chat: bool) -> "ChatTask":
        """A copy that renders with `tokenizer` (`chat`: its chat template for conversational rows)."""
        bound = copy.copy(self)
        bound.tokenizer, bound.chat = tokenizer, chat and has_chat_template(tokenizer)
        bound._tokens, bound._lengths = {}, {}
        return bound

    @property
    def verifiable(self) -> bool:
        """Whether `verify` means anything: only with reference answers (data.answer_field)."""
        return self.answer_field is not None

    def row_tokens(self, example: Example) -> tuple[list[int], list[int]]:
        """(ids, loss mask) of `example`'s SFT row, computed once per example."""
        if self.tokenizer is None:
            raise RuntimeError("ChatTask.row_tokens needs a bound task (ChatTask.bind)")
        if example.uid not in self._tokens:
            try:
                self._tokens[example.uid] = row_tokens(example.row, self.tokenizer, self.chat, self.loss_on)
            except DataError as e:
                raise DataError(f"{example.uid}: {e}") from None
        return self._tokens[example.uid]

    def row_lengths(self, example: Example) -> tuple[int, int]:
        """(prompt tokens, 0 for a text row; tokens of the whole row, the prompt's + 1 without a completion),
        for the length limits (tasks/lengths.py)."""
        from models.prompts import prompt_ids

        if example.uid in self._lengths:
            return self._lengths[example.uid]
        row = example.row
        prompt = 0 if row.format == "text" else len(prompt_ids(self.tokenizer, self.prompt(example)))
        try:
            whole = len(row_tokens(row, self.tokenizer, self.chat, "all")[0]) if row.completion else prompt + 1
        except DataError as e:
            raise DataError(f"{example.uid}: {e}") from None
        self._lengths[example.uid] = (prompt, whole)
        return prompt, whole

    # -- the Task protocol --------------------------------------------------------------------

    def train_examples(self) -> list[Example]:
        return self._train

    def test_examples(self) -> list[Example]:
        if self._test is None:
            raise DataError(f"{self.path}: no test split; give data.test_path, data.test_fraction or a source "
                            "with a test split")
        return self._test

    def prompt(self, example: Example) -> str:
        row = example.row
        if row.format == "text":
            raise DataError(f"{example.uid}: a text row has no prompt: only +algo=sft trains on text rows")
        if not row.conversational:
            return row.prompt
        return render_messages(self.tokenizer, row.prompt, self.chat, generation=True)

    def teacher_prompt(self, example: Example, reference: str) -> str:
        """The prompt with its last user message (or the string prompt) filled into data.teacher_template."""
        row = example.row
        if row.format == "text" or not row.conversational:
            return fill_template(self.teacher_template, question=self.prompt(example), reference=reference)
        turns = [dict(m) for m in row.prompt]
        last = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=None)
        if last is None:
            raise DataError(f"{example.uid}: the prompt has no user message to put the reference into")
        turns[last]["content"] = fill_template(self.teacher_template, question=turns[last]["content"],
                                               reference=reference)
        return render_messages(self.tokenizer, turns, self.chat, generation=True)

    def solution_spans(self, solution: str) -> list[str]:
        lines = split_lines(solution)
        return lines if len(lines) >= 3 else [s for line in lines for s in split_sentences(line)]

    def verify(self, example: Example, completion: str) -> VerifyResult:
        if not self.verifiable:
            raise DataError(f"data=chat has no verifier without data.answer_field (example {example.uid})")
        answer = extract_answer(completion)
        return VerifyResult(answers_equal(answer, example.answer), answer, 0, 0)


def _question(row: Row) -> str:
    """The last user message's content (conversational), the prompt string, or "" (text rows)."""
    if not row.conversational:
        return row.prompt
    users = [m["content"] for m in row.prompt if m["role"] == "user"]
    return users[-1] if users else ""


def _reply(row: Row) -> str:
    """The reference reply: the completion's text (its messages' contents), "" for prompt-only rows."""
    if not row.completion:
        return ""
    if isinstance(row.completion, str):
        return row.completion
    return "".join(m["content"] for m in row.completion)


@dataclass
class ChatConfig(TaskConfig):
    """data=chat (configs/data/chat.yaml): rows in TRL's formats (tasks/chat.py). `seed` seeds the
    test_fraction split."""

    name: str = "chat"
    path: Optional[str] = None  # required: FILE | DIR | HUB_NAME
    test_path: Optional[str] = None  # held-out rows; None = test_fraction of path, else its test_split
    train_split: str = "train"  # a split name, optionally sliced: train[:10%], train[:500]
    test_split: str = "test"
    test_fraction: float = 0.0
    hub_config: Optional[str] = None  # the data set's config name (load_dataset's second argument)
    revision: Optional[str] = None  # a Hub revision (branch, tag or commit)
    loss_on: str = "assistant"  # assistant | completion | all
    answer_field: Optional[str] = None  # a column of reference answers: then evals report accuracy too
    max_examples: Optional[int] = None
    teacher_template: Optional[str] = None  # the privileged prompt of the distillation algorithms

    task_class = ChatTask

    def validate(self) -> None:
        super().validate()
        if not self.path:
            raise ValueError("data=chat needs data.path=FILE|DIR|HUB_NAME")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"data.loss_on={self.loss_on} is not one of {', '.join(LOSS_ON)}")

    def build(self, check_charset: bool = True) -> ChatTask:
        return ChatTask(path=self.path, test_path=self.test_path, train_split=self.train_split,
                        test_split=self.test_split, test_fraction=self.test_fraction, seed=self.seed,
                        hub_config=self.hub_config, revision=self.revision, loss_on=self.loss_on,
                        answer_field=self.answer_field, max_examples=self.max_examples,
                        teacher_template=self.teacher_template)


__all__ = ["ChatConfig", "ChatTask", "FORMATS", "LOSS_ON", "Row", "load_split", "parse_row", "row_format",
           "row_tokens", "render_messages", "assistant_spans"]
