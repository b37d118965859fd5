"""The context file of Context Language Models: a protected prefix, then editable turns.

The model's whole context is one text file. The prefix (system and task text) is never edited; after
it come numbered turns. Each model call continues the file with the body of the next assistant turn
and either appends it, or emits an explicit rewrite of the whole editable part (see `parse_action`).

    cf = ContextFile("keep each key's last value.\\n\\n", fmt=TINY_FORMAT).append("tool", "set b=3")
    cf.prompt()                           # what the next model call continues from
    parse(cf.render(), cf.prefix, cf.fmt) == cf

File (TINY_FORMAT; the default format writes CTX_TURN / REWRITE / ANSWER in capitals), rendered:

    keep each key's last value.
    (blank line: the protected prefix ends with "\\n\\n")
    [[ctx_turn 1 role=tool]]
    set b=3 e=1
    (blank line: every turn ends with "\\n\\n")
    [[ctx_turn 2 role=assistant]]
    next

    [[ctx_turn 3 role=assistant]]

The last line is not part of the file: `prompt()` appends the header of the turn the model writes.

- A header is recognised only as a whole line exactly matching the format, with an integer n and a
  role in ROLES; an unknown role or a header in the middle of a line is plain text. Roles are kept as
  written (a tool turn stays a tool turn).
- Escaping: a text line starting with `[[` (after any number of `|`) gets one more leading `|` when
  rendered, and parsing removes exactly one. So a tool output holding the line
  `[[ctx_turn 5 role=assistant]]` renders as `|[[ctx_turn 5 role=assistant]]` and cannot forge a
  turn; `unescape(escape(t)) == t` for every string. (This is why a header must start with `[[`.)
- A turn's text is what lies between its header line and the next header, less exactly one trailing
  "\\n\\n", unescaped. Texts with newlines, trailing newlines or nothing at all round-trip exactly.
- Actions (`parse_action`): an output whose first line is exactly `rewrite` replaces the editable part
  with the rest of the output (parsed as turns); `answer X` ends the episode with answer X; anything
  else is plain text, appended as an assistant turn.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import lru_cache

from tasks.base import DataError

ROLES = ("system", "user", "assistant", "tool")
ACTION_KINDS = ("rewrite", "answer", "text")
SEPARATOR = "\n\n"  # ends every rendered turn
ESCAPE = "|"
_ESCAPABLE = re.compile(r"^(\|*\[\[)", re.MULTILINE)  # `^` matches after "\n" only, not "\r"
_ESCAPED = re.compile(r"^\|(\|*\[\[)", re.MULTILINE)
_PLACEHOLDERS = ("{n}", "{role}")


@dataclass(frozen=True)
class ContextFormat:
    """The marker strings of a context file; `header` holds `{n}` and `{role}` once each."""

    header: str = "[[CTX_TURN {n} role={role}]]"
    rewrite: str = "REWRITE"
    answer: str = "ANSWER"

    def __post_init__(self) -> None:
        missing = [p for p in _PLACEHOLDERS if self.header.count(p) != 1]
        if missing:
            raise ValueError(f"ContextFormat.header {self.header!r} must hold each of {missing} exactly once")
        if not self.header.startswith("[[") or "\n" in self.header:
            raise ValueError(f"ContextFormat.header {self.header!r} must be one line starting with '[[' "
                             f"(escaping protects only lines that start with '[[')")
        for field in ("rewrite", "answer"):
            value = getattr(self, field)
            if not value.strip() or "\n" in value:
                raise ValueError(f"ContextFormat.{field} {value!r} must be one non-blank line")
        if self.rewrite == self.answer:
            raise ValueError(f"ContextFormat.rewrite and ContextFormat.answer are both {self.rewrite!r}")

    def render_header(self, n: int, role: str) -> str:
        return self.header.replace("{n}", str(n)).replace("{role}", role)


TINY_FORMAT = ContextFormat("[[ctx_turn {n} role={role}]]", "rewrite", "answer")  # the tiny tokenizer's alphabet


@lru_cache(maxsize=None)
def _header_regex(header: str) -> re.Pattern:
    """A whole header line of this template: `^...$` per line, n an integer, role one of ROLES."""
    fields = {"{n}": r"(?P<n>[0-9]+)", "{role}": "(?P<role>" + "|".join(ROLES) + ")"}
    parts = re.split(r"(\{n\}|\{role\})", header)
    return re.compile("^" + "".join(fields.get(p, re.escape(p)) for p in parts) + "$", re.MULTILINE)


@dataclass(frozen=True)
class Turn:
    role: str
    text: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Turn.role {self.role!r} is not one of {ROLES}")


def escape(text: str) -> str:
    """One more leading `|` on every line that starts with `[[` after any number of `|`."""
    return _ESCAPABLE.sub(ESCAPE + r"\1", text)


def unescape(text: str) -> str:
    """Remove exactly one leading `|` from every line that starts with `|`s and then `[[`."""
    return _ESCAPED.sub(r"\1", text)


def render_turns(turns: tuple[Turn, ...], fmt: ContextFormat) -> str:
    return "".join(f"{fmt.render_header(n, t.role)}\n{escape(t.text)}{SEPARATOR}" for n, t in enumerate(turns, 1))


@dataclass(frozen=True)
class ContextFile:
    prefix: str  # protected: never edited
    turns: tuple[Turn, ...] = ()
    fmt: ContextFormat = ContextFormat()

    def render(self) -> str:
        return self.prefix + self.editable()

    def editable(self) -> str:
        return render_turns(self.turns, self.fmt)

    def append(self, role: str, text: str) -> ContextFile:
        return replace(self, turns=self.turns + (Turn(role, text),))

    def rewrite(self, new_editable: str) -> tuple[ContextFile, bool]:
        """The file with its editable part replaced; the bool says the new text was malformed."""
        turns, malformed = parse_editable(new_editable, self.fmt)
        return replace(self, turns=turns), malformed

    def prompt(self) -> str:
        """The file and the header of the next assistant turn: what a model call continues from."""
        return self.render() + self.fmt.render_header(len(self.turns) + 1, "assistant") + "\n"


def _turn_text(body: str) -> str:
    return unescape(body[:-len(SEPARATOR)] if body.endswith(SEPARATOR) else body)


def parse_editable(text: str, fmt: ContextFormat = ContextFormat()) -> tuple[tuple[Turn, ...], bool]:
    """The turns of an editable part, and whether it was malformed. Never raises.

    Non-blank text before the first header (or text with no header at all) becomes one plain
    assistant turn, flagged malformed; blank text before the first header is dropped. Empty or blank
    text is no turns (an edit may clear the editable part). Turn numbers are not checked: rendering
    renumbers from 1.
    """
    headers = list(_header_regex(fmt.header).finditer(text))
    lead = text[:headers[0].start()] if headers else text
    turns = []
    for m, nxt in zip(headers, headers[1:] + [None]):
        start = min(m.end() + 1, len(text))  # skip the header line's "\n"
        turns.append(Turn(m["role"], _turn_text(text[start:nxt.start() if nxt else len(text)])))
    malformed = bool(lead.strip())
    if malformed:
        turns.insert(0, Turn("assistant", _turn_text(lead)))
    return tuple(turns), malformed


def parse(text: str, prefix: str, fmt: ContextFormat = ContextFormat()) -> ContextFile:
    """A rendered file back into a ContextFile; DataError when `text` does not start with `prefix`.

    Lenient after the prefix in the way `parse_editable` is (stray leading text becomes an assistant
    turn). `parse(cf.render(), cf.prefix, cf.fmt) == cf` always holds.
    """
    if not text.startswith(prefix):
        raise DataError(f"context file: the protected prefix is missing or changed (expected it to start "
                        f"with {prefix[:60]!r}, got {text[:60]!r})")
    turns, _ = parse_editable(text[len(prefix):], fmt)
    return ContextFile(prefix, turns, fmt)


@dataclass(frozen=True)
class Action:
    kind: str  # "rewrite" | "answer" | "text"
    text: str  # rewrite: the new editable part; answer: the answer; text: the whole output
    malformed: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"Action.kind {self.kind!r} is not one of {ACTION_KINDS}")


def parse_action(output: str, fmt: ContextFormat = ContextFormat()) -> Action:
    """What one model output asks for (see the module docstring). Never raises."""
    first, _, rest = output.partition("\n")
    if first == fmt.rewrite:
        return Action("rewrite", rest)
    if output.startswith(fmt.answer + " "):
        value = first[len(fmt.answer) + 1:].strip()
        return Action("answer", value) if value else Action("text", output, malformed=True)
    return Action("text", output, malformed=not output.strip())
