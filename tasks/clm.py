"""`clm`: Context Language Model episodes — the model keeps its own context within a token budget.

An episode is a protected prefix (the task), a stream of tool outputs shown one per model call, and
a final query. The context is a file (`tasks.context_file`): after each call the environment appends
the model's turn (or applies its rewrite of the editable part), then the next observation; once the
query is shown the model must answer. Appending alone overflows the budget, so the model has to fold
what it has seen into a short note. Plain Python; the RL algorithm drives `ContextEnv` per call.

    task = ClmTask(seed=0)                       # synthetic kv and chain episodes, budget 200 chars
    env = task.make_env(task.train_examples()[0])
    while not env.done:
        env.step(model(env.prompt()))            # or scripted_output(env, task.compact_at)
    env.outcome, env.success(task)               # "answered" | "overflow" | "call_cap", bool

A kv episode driven by the scripted policy (TINY_FORMAT, `next` = a plain appended turn). Call 1's
prompt is

    keep each key's last value.

    [[ctx_turn 1 role=tool]]
    set b=3 e=1

    [[ctx_turn 2 role=assistant]]

call 1 writes `next`; the environment appends that turn and `[[ctx_turn 3 role=tool]]` `set b=5`.
Past `compact_at * budget` tokens call 2 writes

    rewrite
    [[ctx_turn 1 role=assistant]]
    state b=5 e=1

which replaces turns 1-3 by that one turn; then the query comes as a user turn (`value of b?`) and
the last call writes `answer 5`.

Kinds (seeded; train and test never share an episode; sized for a character-level model with 256
positions: every prompt stays within the 200-character budget and prompt + output within 256):
- `kv`: 4-8 observations `set k=v ...` (1-3 updates, keys a-e, digit values), query `value of k?`,
  answer the latest value of k.
- `chain`: the prefix gives a start value (< 50); each observation is a log line carrying one
  `add d` / `sub d` among filler words (values stay in 0..99); query `final value?`.
- `budget_range=(low, high)` (synthetic kinds): each episode draws its own budget in it, stated at the
  end of its task text (`... budget 345.`); `fold_range=(low, high)`: each episode's scripted policy
  folds past its own share of the budget, drawn in [low, the latest share at which the script still
  solves it] (`last_fold`), so demonstrations fold early, late, or not until they must.
- `path=`: a JSONL file, one episode per line: {"prefix": str, "observations": [str], "query": str,
  "answer": str | number, "budget": int (optional)}; `test_path` likewise, else the last 10% of rows.
  The scripted policy cannot fold a file episode's state, so it only appends there (the calls view
  refuses a file whose episodes it cannot then finish).

Measured (seed 0, 2100 episodes, compact_at 0.5): appending alone overflows every synthetic episode;
the scripted policy answers all of them right in 7.1 calls with 5.5 edits on average; its prompts
are 142 characters on average, 190 at most, and prompt + output + EOS at most 241.

Views: `episodes` (Episode rows; `verify` reads the final call's output) and `calls` (one plain
Example per scripted call: the SFT warm-up; `verify` wants the scripted output exactly).
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from tasks.base import (
    check_charset as reject_outside_charset,
    DataError,
    Example,
    TaskConfig,
    VerifyResult,
    answers_equal,
    split_lines,
)
from tasks.context_file import ROLES, TINY_FORMAT, Action, ContextFile, ContextFormat, Turn, parse_action, render_turns

OUTCOMES = ("running", "answered", "overflow", "call_cap")
VIEWS = ("episodes", "calls")
KINDS = ("kv", "chain")
NEXT = "next"  # the scripted policy's plain turn: "nothing to fold yet"
CLM_MASK_TOKEN = "_"
DEFAULT_BUDGET = 200  # characters = tokens of the tiny tokenizer
DEFAULT_MAX_CALLS = 16
# Fold once the prompt passes half the budget. Below it one more plain turn and the next turn (36 +
# 27 + at most 27 characters for a chain log line) still fit: 100 + 90 <= 200. At 0.55 the worst case
# lands exactly on the budget, and from 0.56 some chain episodes overflow.
DEFAULT_COMPACT_AT = 0.5
MAX_POSITIONS = 256  # the tiny model's context the synthetic kinds are sized for (prompt + output + EOS)
TEST_FRACTION = 0.1  # a task file without test_path: the last 10% of rows
MAX_ATTEMPTS_PER_EPISODE = 50

KV_KEYS = "abcde"
KV_PREFIX = "keep each key's last value.\n\n"
KV_OBSERVATIONS = (4, 8)
KV_UPDATES = (1, 3)
CHAIN_PREFIX = "start at {start}; apply each op.\n\n"
CHAIN_START_MAX = 49
CHAIN_VALUE_MAX = 99
CHAIN_OBSERVATIONS = (4, 8)
CHAIN_FILLERS = ("disk ok", "cpu idle", "net up", "job 7 ran", "fan on", "log sync", "tick 42",
                 "cache hot", "io calm", "gc done", "heap 31", "retry 0")
CHAIN_QUERY = "final value?"

_KV_UPDATE = re.compile(r"\b([a-z])=(\d)\b")
_CHAIN_OP = re.compile(r"\b(add|sub) (\d)\b")
_CHAIN_START = re.compile(r"^start at (\d+);")


@dataclass(frozen=True)
class Episode(Example):
    kind: str = ""  # "kv" | "chain" | "file"
    prefix: str = ""  # protected prefix, ends with "\n\n"
    observations: tuple[str, ...] = ()  # tool outputs, one shown per model call
    query: str = ""  # the final question, shown as a user turn after the last observation
    budget: int = 0  # context token budget; 0 = the task's default
    compact_at: float = 0.0  # the scripted policy's fold share for this episode; 0 = the task's


class EpisodeError(DataError):
    """An episode that cannot run (no prefix, no budget, a budget the prefix already fills)."""


# ---------------------------------------------------------------------------------------------
# The environment


class ContextEnv:
    """One episode's state machine: prompt() -> model output -> step(output) until done.

    State: `context` (the ContextFile), `calls`, `done`, `outcome` (one of OUTCOMES), `answer` (set
    when answered), `shown` (observations shown), `query_shown`, `edits` (rewrites), `malformed`
    (calls whose output was malformed), `last_output`. After each call that does not answer, the next
    observation (or, once, the query) is appended; then the call cap, then the budget is checked on
    `context_tokens()`, the length of the next prompt.
    """

    def __init__(self, episode: Episode, fmt: ContextFormat = TINY_FORMAT, count_tokens: Callable[[str], int] = len,
                 budget: int | None = None, max_calls: int = DEFAULT_MAX_CALLS):
        self.episode, self.fmt, self.count_tokens, self.max_calls = episode, fmt, count_tokens, max_calls
        self.budget = budget if budget is not None else episode.budget
        self._check()
        self.context = ContextFile(episode.prefix, (), fmt)
        self.calls = self.shown = self.edits = self.malformed = 0
        self.done, self.outcome, self.answer, self.query_shown = False, "running", None, False
        self.last_output: str | None = None  # the latest call's output (the answer call's, at the end)
        self._show_next()

    def _check(self) -> None:
        uid = self.episode.uid
        if not self.episode.prefix:
            raise EpisodeError(f"episode {uid}: the protected prefix is empty")
        if not self.budget or self.budget <= 0:
            raise EpisodeError(f"episode {uid}: no context budget (the episode has 0 and none was given)")
        if self.max_calls < 1:
            raise EpisodeError(f"episode {uid}: max_calls must be >= 1, got {self.max_calls}")
        prefix_tokens = self.count_tokens(self.episode.prefix)
        if prefix_tokens >= self.budget:
            raise EpisodeError(f"episode {uid}: budget {self.budget} is smaller than the protected prefix "
                               f"({prefix_tokens} tokens)")

    def prompt(self) -> str:
        return self.context.prompt()

    def context_tokens(self) -> int:
        return self.count_tokens(self.prompt())

    def step(self, output: str) -> Action:
        """Apply one model output; never raises on what the output holds."""
        if self.done:
            raise RuntimeError(f"episode {self.episode.uid} is over ({self.outcome}); step() after done")
        self.calls += 1
        self.last_output = output
        action = parse_action(output, self.fmt)
        if action.kind == "answer":
            self.done, self.outcome, self.answer = True, "answered", action.text
        elif action.kind == "rewrite":
            self.context, bad = self.context.rewrite(action.text)
            self.edits += 1
            action = Action(action.kind, action.text, bad)
        else:
            self.context = self.context.append("assistant", output)
        self.malformed += action.malformed
        if not self.done:
            self._show_next()
            self._check_limits()
        return action

    def _show_next(self) -> None:
        """The next observation as a tool turn, else the query as a user turn once, else nothing."""
        if self.shown < len(self.episode.observations):
            self.context = self.context.append("tool", self.episode.observations[self.shown])
            self.shown += 1
        elif not self.query_shown:
            self.context = self.context.append("user", self.episode.query)
            self.query_shown = True

    def _check_limits(self) -> None:
        if self.calls >= self.max_calls:
            self.done, self.outcome = True, "call_cap"
        elif self.context_tokens() > self.budget:
            self.done, self.outcome = True, "overflow"

    def success(self, task: ClmTask) -> bool:
        return self.outcome == "answered" and task.verify(self.episode, self.last_output).correct


# ---------------------------------------------------------------------------------------------
# The scripted policy (knows the truth; makes the SFT demonstrations and proves the budgets work)


def fold_note(episode: Episode, shown: int) -> str | None:
    """The state after the first `shown` observations as one short note, or None for file episodes."""
    seen = episode.observations[:shown]
    if episode.kind == "kv":
        state = dict(m for obs in seen for m in _KV_UPDATE.findall(obs))
        return "state " + " ".join(f"{k}={state[k]}" for k in sorted(state))
    if episode.kind == "chain":
        value = int(_CHAIN_START.match(episode.prefix).group(1))
        for op, d in (m for obs in seen for m in _CHAIN_OP.findall(obs)):
            value += int(d) if op == "add" else -int(d)
        return f"value {value}"
    return None


def scripted_output(env: ContextEnv, compact_at: float = DEFAULT_COMPACT_AT) -> str:
    """Answer once the query is shown; past compact_at * budget rewrite to one note; else `next`."""
    if env.query_shown:
        return f"{env.fmt.answer} {env.episode.answer}"
    note = fold_note(env.episode, env.shown)
    if note is not None and env.context_tokens() > compact_at * env.budget:
        return env.fmt.rewrite + "\n" + render_turns((Turn("assistant", note),), env.fmt)
    return NEXT


def run_scripted(env: ContextEnv, compact_at: float = DEFAULT_COMPACT_AT) -> list[tuple[str, str]]:
    """Drive `env` to the end with the scripted policy; the (prompt, output) of every call."""
    calls = []
    while not env.done:
        prompt, output = env.prompt(), scripted_output(env, compact_at)
        env.step(output)
        calls.append((prompt, output))
    return calls


def run_append_only(env: ContextEnv) -> ContextEnv:
    """Drive `env` with `next` until the query is shown, then the right answer (no edits at all)."""
    while not env.done:
        env.step(f"{env.fmt.answer} {env.episode.answer}" if env.query_shown else NEXT)
    return env


# ---------------------------------------------------------------------------------------------
# Synthetic episodes


def _kv_episode(rng: random.Random) -> tuple[str, tuple[str, ...], str, str]:
    state: dict[str, int] = {}
    observations = []
    for _ in range(rng.randint(*KV_OBSERVATIONS)):
        keys = rng.sample(KV_KEYS, rng.randint(*KV_UPDATES))
        updates = [(k, rng.randint(0, 9)) for k in keys]
        state.update(updates)
        observations.append("set " + " ".join(f"{k}={v}" for k, v in updates))
    key = rng.choice(sorted(state))
    return KV_PREFIX, tuple(observations), f"value of {key}?", str(state[key])


def _chain_episode(rng: random.Random) -> tuple[str, tuple[str, ...], str, str]:
    value = start = rng.randint(0, CHAIN_START_MAX)
    observations = []
    for _ in range(rng.randint(*CHAIN_OBSERVATIONS)):
        d = rng.randint(0, 9)
        op = rng.choice([o for o, ok in (("add", value + d <= CHAIN_VALUE_MAX), ("sub", value - d >= 0)) if ok])
        value += d if op == "add" else -d
        words = rng.sample(CHAIN_FILLERS, rng.randint(1, 2))
        words.insert(rng.randint(0, len(words)), f"{op} {d}")
        observations.append(", ".join(words))
    return CHAIN_PREFIX.format(start=start), tuple(observations), CHAIN_QUERY, str(value)


GENERATORS = {"kv": _kv_episode, "chain": _chain_episode}


# ---------------------------------------------------------------------------------------------
# Task files


def _row_episode(row: object, where: str, uid: str) -> Episode:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prefix, observations, query = row.get("prefix"), row.get("observations", []), row.get("query")
    answer, budget = row.get("answer"), row.get("budget", 0)
    if not isinstance(prefix, str) or not prefix:
        raise DataError(f"{where}: 'prefix' must be a non-empty string (the protected prefix), got {prefix!r}")
    if not prefix.endswith("\n"):
        raise DataError(f"{where}: 'prefix' must end with a newline, so that the first turn header starts a line")
    if not isinstance(observations, list) or not all(isinstance(o, str) for o in observations):
        raise DataError(f"{where}: 'observations' must be a list of strings, got {observations!r:.80}")
    if not isinstance(query, str) or not query.strip():
        raise DataError(f"{where}: 'query' must be a non-empty string, got {query!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DataError(f"{where}: 'answer' must be a non-empty string or a number, got {answer!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise DataError(f"{where}: 'budget' must be a positive integer, got {budget!r}")
    return Episode(query, "", str(answer).strip(), uid, kind="file", prefix=prefix,
                   observations=tuple(observations), query=query, budget=budget)


def read_task_file(path: str) -> list[Episode]:
    """Episodes of a JSONL task file; DataError naming the file and 1-based line of a bad row."""
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the task file: {e}") from None
    episodes = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {n}: invalid JSON: {e}") from None
        episodes.append(_row_episode(row, f"{path}: line {n}", f"{path}:{n}"))
    if not episodes:
        raise DataError(f"{path}: no episodes")
    return episodes


# ---------------------------------------------------------------------------------------------
# The task


class ClmTask:
    """Context-management episodes (see the module docstring) as a Task, in the episodes or calls view."""

    name = "clm"
    mask_token = CLM_MASK_TOKEN
    renders_own_prompts = True  # the context file is the whole input: no chat template is put around it

    def __init__(self, seed: int = 0, n_train: int = 2000, n_test: int = 100, kinds: dict[str, float] | None = None,
                 budget: int = DEFAULT_BUDGET, max_calls: int = DEFAULT_MAX_CALLS,
                 compact_at: float = DEFAULT_COMPACT_AT, view: str = "episodes", path: str | None = None,
                 test_path: str | None = None, check_charset: bool = True, fmt: ContextFormat = TINY_FORMAT,
                 budget_range: Sequence[int] = (), fold_range: Sequence[float] = ()):
        self.kinds = dict(kinds) if kinds is not None else {k: 1.0 for k in KINDS}
        if view not in VIEWS:
            raise DataError(f"clm: view must be one of {VIEWS}, got {view!r}")
        if not self.kinds or any(k not in KINDS for k in self.kinds) or any(w < 0 for w in self.kinds.values()) \
                or sum(self.kinds.values()) <= 0:
            raise DataError(f"clm: kinds must map some of {KINDS} to weights >= 0 (sum > 0), got {self.kinds}")
        if budget <= 0 or max_calls < 1 or not 0 < compact_at < 1 or n_train < 0 or n_test < 0:
            raise DataError(f"clm: need budget > 0, max_calls >= 1, 0 < compact_at < 1, n_train, n_test >= 0; "
                            f"got {budget}, {max_calls}, {compact_at}, {n_train}, {n_test}")
        if test_path is not None and path is None:
            raise DataError("clm: test_path needs path")
        self.budget_range, self.fold_range = tuple(budget_range), tuple(fold_range)
        if self.budget_range and (len(self.budget_range) != 2 or not 0 < self.budget_range[0] <= self.budget_range[1]):
            raise DataError(f"clm: budget_range must be [low, high] with 0 < low <= high, got {list(budget_range)}")
        if self.fold_range and (len(self.fold_range) != 2 or not 0 < self.fold_range[0] <= self.fold_range[1] < 1):
            raise DataError(f"clm: fold_range must be [low, high] with 0 < low <= high < 1, got {list(fold_range)}")
        if (self.budget_range or self.fold_range) and path is not None:
            raise DataError("clm: budget_range and fold_range shape synthetic episodes; a task file sets its own budgets")
        self.seed, self.n_train, self.n_test, self.budget, self.max_calls = seed, n_train, n_test, budget, max_calls
        self.compact_at, self.view, self.path, self.test_path, self.fmt = compact_at, view, path, test_path, fmt
        self.check_charset = check_charset
        if check_charset:
            headers = "".join(fmt.render_header(0, role) for role in ROLES)
            reject_outside_charset(headers + fmt.rewrite + fmt.answer + NEXT + self.mask_token, "clm")
        self._splits: tuple[list[Example], list[Example]] | None = None

    # -- data ---------------------------------------------------------------------------------

    def train_examples(self) -> list[Example]:
        return self._data()[0]

    def test_examples(self) -> list[Example]:
        return self._data()[1]

    def episodes(self) -> tuple[list[Episode], list[Episode]]:
        """(train, test) episodes, whatever the view."""
        train, test = self._read() if self.path else self._generate()
        return [self._finish(ep) for ep in train], [self._finish(ep) for ep in test]

    def _data(self) -> tuple[list[Example], list[Example]]:
        if self._splits is None:
            train, test = self.episodes()
            self._splits = (train, test) if self.view == "episodes" else (self._calls(train), self._calls(test))
        return self._splits

    def _generate(self) -> tuple[list[Episode], list[Episode]]:
        """Test first (distinct episodes), then train skipping every test episode."""
        test = self._sample(random.Random(f"clm-{self.seed}-test"), self.n_test, set(), True, "test")
        held_out = {_key(ep) for ep in test}
        return self._sample(random.Random(f"clm-{self.seed}-train"), self.n_train, held_out, False, "train"), test

    def _sample(self, rng: random.Random, n: int, exclude: set, unique: bool, split: str) -> list[Episode]:
        kinds, weights = zip(*sorted(self.kinds.items()))
        out: list[Episode] = []
        seen = set(exclude)
        for _ in range(n * MAX_ATTEMPTS_PER_EPISODE):
            if len(out) == n:
                break
            kind = rng.choices(kinds, weights)[0]
            prefix, observations, query, answer = GENERATORS[kind](rng)
            uid, budget = f"clm-{split}-{len(out)}", 0
            if self.budget_range:  # the episode's own budget (a stream of its own), stated in its task text
                budget = random.Random(f"clm-{self.seed}-budget-{uid}").randint(*self.budget_range)
                prefix = f"{prefix.rstrip()} budget {budget}.\n\n"
            ep = Episode(query, "", answer, uid, kind=kind, prefix=prefix,
                         observations=observations, query=query, budget=budget)
            if _key(ep) in seen:
                continue
            if unique:
                seen.add(_key(ep))
            out.append(ep)
        if len(out) < n:
            raise DataError(f"clm: could only make {len(out)} of {n} distinct {split} episodes of kinds {kinds}")
        return out

    def _read(self) -> tuple[list[Episode], list[Episode]]:
        episodes = read_task_file(self.path)
        if self.test_path is not None:
            return episodes, read_task_file(self.test_path)
        n_test = -(-len(episodes) // round(1 / TEST_FRACTION))  # ceil(10%)
        if len(episodes) - n_test < 1:
            raise DataError(f"{self.path}: {len(episodes)} episode(s) leave none for training after the last "
                            f"10% are held out; give test_path")
        return episodes[:-n_test], episodes[-n_test:]

    def _finish(self, ep: Episode) -> Episode:
        """The episode with its scripted transcript as solution (and, with fold_range, its own fold share);
        checked to run (and for the charset)."""
        if self.fold_range:
            ep = dataclasses.replace(ep, compact_at=self._fold_share(ep))
        outputs = [output for _, output in run_scripted(self.make_env(ep), self.fold_at(ep))]
        ep = dataclasses.replace(ep, solution="\n".join(outputs))
        if self.check_charset:
            reject_outside_charset(ep.prefix + "".join(ep.observations) + ep.query + ep.answer + ep.solution,
                                   f"clm: episode {ep.uid}")
        return ep

    def fold_at(self, ep: Episode) -> float:
        """The share of the budget past which the scripted policy folds this episode."""
        return ep.compact_at or self.compact_at

    def _solves(self, ep: Episode, compact_at: float) -> bool:
        env = self.make_env(ep)
        run_scripted(env, compact_at)
        return env.success(self)

    def last_fold(self, ep: Episode, low: float, high: float) -> float:
        """The largest share in [low, high], to 0.01, past which the scripted policy can fold `ep` and still
        solve it (later folds overflow); `low` when none can."""
        if self._solves(ep, high):
            return high
        good, bad = low, high  # bisect: solved at `good` (assumed at low), not at `bad`
        while bad - good > 0.01:
            mid = (good + bad) / 2
            good, bad = (mid, bad) if self._solves(ep, mid) else (good, mid)
        return good

    def _fold_share(self, ep: Episode) -> float:
        """A fold share drawn for `ep` (seeded by the task seed and the episode) in [low, last_fold]:
        episodes of one budget then differ in where, and how often, they fold."""
        low, high = self.fold_range
        u = random.Random(f"clm-{self.seed}-fold-{ep.uid}").random()
        share = round(low + u * (self.last_fold(ep, low, high) - low), 3)
        return share if self._solves(ep, share) else low

    def _calls(self, episodes: Sequence[Episode]) -> list[Example]:
        """Every scripted call as one demonstration; DataError when the script cannot solve an episode."""
        rows = []
        for ep in episodes:
            env = self.make_env(ep)
            calls = run_scripted(env, self.fold_at(ep))
            if not env.success(self):
                raise DataError(f"clm: the scripted policy ends episode {ep.uid} with {env.outcome!r}, so its calls "
                                f"are no demonstration (it folds only kv/chain state; give file budgets that fit)")
            rows += [Example(prompt, output, output, f"{ep.uid}/call{i}")
                     for i, (prompt, output) in enumerate(calls, 1)]
        return rows

    def row_budget(self, example: Example) -> int:
        """The context budget `example`'s rows grow up to (an episode's own, else the task's)."""
        return (example.budget if isinstance(example, Episode) else 0) or self.budget

    def make_env(self, episode: Episode) -> ContextEnv:
        """A fresh environment for one episode with this task's format, budget and call cap."""
        return ContextEnv(episode, self.fmt, len, episode.budget or self.budget, self.max_calls)

    # -- prompts, spans, verification ---------------------------------------------------------

    def prompt(self, example: Example) -> str:
        return self.make_env(example).prompt() if isinstance(example, Episode) else example.question

    def teacher_prompt(self, example: Example, reference: str) -> str:
        return self.prompt(example)  # no privileged view: the context is the whole input

    def solution_spans(self, solution: str) -> list[str]:
        return split_lines(solution)

    def verify(self, example: Example, completion: str) -> VerifyResult:
        """Episodes: the completion (the final call's output) must answer right. Calls: match the script."""
        if isinstance(example, Episode):
            action = parse_action(completion, self.fmt)
            answer = action.text if action.kind == "answer" else None
            return VerifyResult(answers_equal(answer, example.answer), answer)
        return VerifyResult(completion.strip() == example.solution.strip(), completion.strip())


def _key(ep: Episode) -> tuple:
    return ep.prefix, ep.observations, ep.query


@dataclass
class ClmConfig(TaskConfig):
    """data=clm (configs/data/clm.yaml): context-file episodes, synthetic or from a task file. `kinds` weighs
    the episode kinds; n_train / n_test count episodes. No prompt templates: the context file is the
    whole input."""

    name: str = "clm"
    n_train: int = 2000
    n_test: int = 100
    kinds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 1.0))
    budget: int = DEFAULT_BUDGET  # context token budget of a synthetic episode
    compact_at: Optional[float] = None  # the scripted policy rewrites above this share of the budget; None = the task's
    # [low, high]: each synthetic episode draws its own budget in it, stated in its task text ([] = `budget`)
    budget_range: list[int] = field(default_factory=list)
    # [low, high]: each episode's scripted policy folds past its own share drawn in it, capped where the
    # script would overflow ([] = compact_at for all)
    fold_range: list[float] = field(default_factory=list)
    view: str = "episodes"  # episodes (RL) | calls (the scripted policy's calls as SFT rows: the warm-up)
    path: Optional[str] = None  # a JSONL task file, one episode per row
    test_path: Optional[str] = None  # its held-out episodes (None: the last 10% of path's rows)

    task_class = ClmTask

    def validate(self) -> None:
        super().validate()
        if self.view not in VIEWS:
            raise ValueError(f"data.view={self.view} is not one of {', '.join(VIEWS)}")
        if self.chat_template == "true":
            raise ValueError("data.chat_template=true: data=clm writes its own prompts (the context file is the "
                             "whole input); use auto or false")

    def build(self, check_charset: bool = True) -> ClmTask:
        extra = {} if self.compact_at is None else {"compact_at": self.compact_at}
        return ClmTask(seed=self.seed, n_train=self.n_train, n_test=self.n_test, kinds=dict(self.kinds) or None,
                       budget=self.budget, view=self.view, path=self.path, test_path=self.test_path,
                       budget_range=tuple(self.budget_range), fold_range=tuple(self.fold_range),
                       check_charset=check_charset, **extra)
