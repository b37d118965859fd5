"""Prompt text -> prompt ids: the one contract of training, eval, rollouts and the inference CLI.

    chat = use_chat(tokenizer, "auto")              # the tokenizer's chat template, when it has one
    text = render(tokenizer, "What is 2+3?", chat=chat)   # the user turn + the assistant cue
    ids = prompt_ids(tokenizer, text)               # what every prompt of a run is encoded with

Two rules make a prompt's ids the same wherever they are built:
- **Chat template.** With `chat`, a prompt is the user turn (after any earlier turns of a
  conversational row) rendered by the tokenizer's template with the generation cue, as text. Without
  it the prompt is its text, earlier turns first (`plain_turns`).
- **Special tokens.** The text is tokenized without the tokenizer's automatic special tokens, and a
  BOS token is put first when the tokenizer adds one to plain text (`adds_bos`) and the text does
  not already start with it (a template that writes the BOS itself). So a BOS-adding tokenizer's
  prompts start with exactly one BOS, in training and in serving; completions, references and
  solutions (continuations) never get one (`continuation_ids`).
"""
from __future__ import annotations

from typing import Any, Sequence

CHAT_MODES = ("auto", "true", "false")
Turn = tuple[str, str]  # (role, content) of an earlier turn of a conversation
ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = "\x00posttrain-user-content\x00"


class ChatTemplateError(ValueError):
    """A chat template was asked for but cannot be used; the message says why."""


def chat_mode(value: Any) -> str:
    """Normalise `data.chat_template` / a CLI value: auto | true | false (booleans and their spellings accepted)."""
    text = str(value).strip().lower()
    aliases = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}
    text = aliases.get(text, text)
    if text not in CHAT_MODES:
        raise ValueError(f"chat_template={value!r} is not one of {', '.join(CHAT_MODES)}")
    return text


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(tokenizer: Any, mode: Any) -> bool:
    """Whether prompts go through the chat template: auto = when the tokenizer has one; true requires one."""
    mode = chat_mode(mode)
    if mode == "true" and not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(f"chat_template=true but the tokenizer ({name}) has no chat template; "
                                "use chat_template=auto or false, or a tokenizer that has one")
    return mode == "true" or (mode == "auto" and has_chat_template(tokenizer))


def plain_turns(turns: Sequence[Turn]) -> str:
    """Earlier turns of a conversation as plain text (no template): each turn's content on its own line(s)."""
    return "".join(content if content.endswith("\n") else content + "\n" for _, content in turns)


def _messages(turns: Sequence[Turn], content: str) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns] + [{"role": "user", "content": content}]


def render(tokenizer: Any, content: str, turns: Sequence[Turn] = (), chat: bool = False) -> str:
    """The prompt text of a user turn `content` after `turns`: templated with the generation cue, or plain."""
    if not chat:
        return plain_turns(turns) + content
    return tokenizer.apply_chat_template(_messages(turns, content), tokenize=False, add_generation_prompt=True)


def chat_parts(tokenizer: Any, turns: Sequence[Turn] = ()) -> tuple[str, str]:
    """(head, tail): the templated prompt is `head + content + tail` for a content the template writes
    verbatim. Where a prompt must be cut around its content (a position-independent cache's shared
    prefix, artifacts, query) the cut is made here."""
    text = tokenizer.apply_chat_template(_messages(turns, _SENTINEL), tokenize=False, add_generation_prompt=True)
    if text.count(_SENTINEL) != 1:
        raise ChatTemplateError("the chat template does not write the user content verbatim once, so the prompt "
                                "cannot be cut around it")
    head, tail = text.split(_SENTINEL)
    return head, tail


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The id the chat template ends an assistant turn with, when that is one special token (ChatML's
    `<|im_end|>`, Llama 3's `<|eot_id|>`); None without a template or when its turn ends in plain text."""
    if not has_chat_template(tokenizer):
        return None
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template that refuses this conversation (roles, a required system turn): no end of turn known
        return None
    if not isinstance(text, str) or text.count(_SENTINEL) != 1:
        return None
    ids = tokenizer(text.split(_SENTINEL)[1], add_special_tokens=False).input_ids
    if not ids:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(ids[0])
    special = ids[0] in set(tokenizer.all_special_ids) or bool(getattr(added, "special", False))
    return ids[0] if special else None


def generation_eos(model: Any) -> Any:
    """A model's `generation_config.eos_token_id` (an id, a list of ids, or None)."""
    return getattr(getattr(model, "generation_config", None), "eos_token_id", None)


def stop_ids(tokenizer: Any, eos: Any = None) -> tuple[int, ...]:
    """Every id generation stops on: the tokenizer's EOS, `eos` (a model's generation_config.eos_token_id:
    an id or a list; `generation_eos`), and the chat template's end of turn. Rollouts, evals and serving
    all stop on this set, so a model whose end of turn is not its tokenizer's EOS stops at the turn's end."""
    found: list[int] = []
    for value in (getattr(tokenizer, "eos_token_id", None), eos, end_of_turn_id(tokenizer)):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and i >= 0 and i not in found:
                found.append(i)
    return tuple(found)


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a BOS token before plain text by default."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    probe = tokenizer("a").input_ids
    return bool(probe) and probe[0] == bos


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of a prompt's text: no automatic special tokens, exactly one leading BOS where the
    tokenizer adds one (see the module docstring). Every prompt of training, eval, rollouts and the
    CLI is encoded here."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if adds_bos(tokenizer) and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def continuation_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of text that continues a prompt (a solution, a reference, a completion): no special tokens."""
    return tokenizer(text, add_special_tokens=False).input_ids


def prompt_lengths(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """`len(prompt_ids(tokenizer, t))` for each text, tokenized in one batched call."""
    if not texts:
        return []
    rows = tokenizer(list(texts), add_special_tokens=False).input_ids
    if not adds_bos(tokenizer):
        return [len(r) for r in rows]
    bos = tokenizer.bos_token_id
    return [len(r) + (0 if r and r[0] == bos else 1) for r in rows]


def continuation_lengths(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """`len(continuation_ids(tokenizer, t))` for each text, tokenized in one batched call."""
    return [len(r) for r in tokenizer(list(texts), add_special_tokens=False).input_ids] if texts else []


PROBE_TEXT = "The 3 quick brown foxes jumped over 12 lazy dogs; naïve café, 東京, emoji \U0001f600.\n\tx = y + 1"


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why `teacher` does not tokenize as `student` does, or None: the vocabulary size, the special tokens
    (EOS, BOS, UNK and the chat template's end of turn) and the ids of a probe text must all agree, since a
    teacher scores the student's token ids (distillation across tokenizers is not done here)."""
    if len(student) != len(teacher):
        return f"vocabulary sizes differ ({len(student)} vs {len(teacher)})"
    for name in ("eos_token_id", "bos_token_id", "unk_token_id"):
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            return f"{name} differs ({a} vs {b})"
    a, b = end_of_turn_id(student), end_of_turn_id(teacher)
    if a is not None and b is not None and a != b:
        return f"the chat templates end a turn with different ids ({a} vs {b})"
    a, b = student(PROBE_TEXT, add_special_tokens=False).input_ids, teacher(PROBE_TEXT, add_special_tokens=False).input_ids
    if a != b:
        return "a probe text tokenizes to different ids"
    return None
