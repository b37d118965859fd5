"""`artifacts`: seeded lookups in small named key->value tables ("artifacts"), each placed in the
prompt on its own, so a position-independent cache can encode every table once and reuse it.

    task = ArtifactTask(seed=0, n_artifacts=4, kinds={"single": 1, "select": 1, "combine": 1})
    ex = task.examples_of("test", "select")[0]
    task.segments(ex)              # Segments(prefix, artifacts, query); .text() == task.prompt(ex)
    task.verify(ex, ex.solution)   # VerifyResult(correct=True, ..., steps_correct == steps_total)

An artifact (table) is a bracketed 4-letter name and `rows` lines `key=value` (2-letter keys, sorted,
distinct within a table; 2-digit values 10-99), ending in a newline:

    [kiwo]
    da=17
    fo=83
    mi=40

The prompt is `prefix + artifact_1 + ... + artifact_N + query`, with `prefix` the `artifact_prefix`
key (default "": no shared text) and `query` the prompt template filled with the question
(default "q: {question}\\na: "). The order of the artifacts is shuffled, so the asked table's
position is uniform. Query kinds:

- `single`: one artifact in context; the question names it and one of its keys: `kiwo fo?`
  Solution: `kiwo fo=83\\n#### 83`.
- `select`: `n_artifacts` artifacts; the question names one table and a key. The asked key also
  appears, with a different value, in at least one other table of the context (no other table
  holds it with the same value), so the table name is needed to answer.
- `combine`: `n_artifacts` artifacts; the answer adds two values from two named tables:
  `kiwo fo+lema da?` -> `kiwo fo=83\\nlema da=12\\n83+12=95\\n#### 95`. Each asked key also appears
  (with another value) in another table when `n_artifacts` leaves room (>= 4).

Splits. A LIBRARY of `n_library` tables and a disjoint HELD-OUT library of `n_library_ood` tables
(no shared table name) are generated from the seed. Train examples draw all their tables from the
library, kinds mixed by the `kinds` weights. `test_examples()` (in-domain: library tables; no
(tables, question) identical to a train example) and `test_examples_ood()` (held-out tables only,
so never in any training context) hold `n_test` examples of each kind with weight > 0, interleaved
kind by kind so a truncated evaluation stays balanced; `examples_of(split, kind)` gives one kind of
one split (train | test | test_ood; any kind for the test splits). A uid encodes split and kind:
`artifacts-test-select-17` (`kind_of`). The same seed gives the same examples.

Verification (`steps_total` is the sum of):
- one check per lookup line `NAME KEY=VALUE` of the working: right when the context holds table
  NAME with KEY=VALUE (read from the example's artifacts);
- one check per sum line `A+B=C` (at least as many as the reference has): right when A+B=C and A, B
  are the values of the two lookup lines written before it;
- one check per other non-blank working line: always wrong (not the format);
- the chain: one check per lookup (max of expected and written): the i-th written lookup must name
  the i-th (table, key) the question asks, in order.
Everything after the `####` marker is not working and is not checked.

User data with artifacts (a JSONL row's `artifacts` list of strings) is read by `TextTask`
(`data=text data.path=F.jsonl`), not by this task.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tasks.base import (
    check_charset as reject_outside_charset,
    ANSWER_MARKER,
    DataError,
    Example,
    PromptTemplates,
    Segments,
    TaskConfig,
    VerifyResult,
    answers_equal,
    check_template,
    extract_answer,
    fill_template,
    split_lines,
)

ARTIFACT_PROMPT = "q: {question}\na: "
ARTIFACT_TEACHER_PROMPT = "q: {question}\nref: {reference}\na: "
ARTIFACT_MASK_TOKEN = "_"
KINDS = ("single", "select", "combine")
SPLITS = ("train", "test", "test_ood")
UID_PREFIX = "artifacts"
CONSONANTS = "bcdfghjklmnprstvwxz"
VOWELS = "aeiou"
# Table names: consonant-vowel-consonant-vowel (9025); keys: consonant-vowel (95).
NAMES = tuple(a + b + c + d for a in CONSONANTS for b in VOWELS for c in CONSONANTS for d in VOWELS)
KEYS = tuple(a + b for a in CONSONANTS for b in VOWELS)
VALUE_RANGE = (10, 99)
MAX_ATTEMPTS_PER_EXAMPLE = 50

_HEADER = re.compile(r"^\[([a-z]+)\]$")
_ROW = re.compile(r"^([a-z]+)=(-?\d+)$")
_LOOKUP = re.compile(r"^([a-z]+) ([a-z]+)=(-?\d+)$")
_SUM = re.compile(r"^(-?\d+)\+(-?\d+)=(-?\d+)$")

Table = tuple[str, tuple[tuple[str, int], ...]]  # (name, ((key, value), ...))


# ---------------------------------------------------------------------------------------------
# Text of tables and solutions


def table_text(table: Table) -> str:
    name, rows = table
    return f"[{name}]\n" + "".join(f"{k}={v}\n" for k, v in rows)


def parse_table(text: str) -> tuple[str, dict[str, int]] | None:
    """(name, {key: value}) of an artifact in the table format, or None when it is not one."""
    lines = [l.strip() for l in text.strip().split("\n")]
    head = _HEADER.match(lines[0]) if lines else None
    if head is None:
        return None
    rows = {}
    for line in lines[1:]:
        m = _ROW.match(line)
        if m is None:
            return None
        rows[m.group(1)] = int(m.group(2))
    return head.group(1), rows


def context_tables(artifacts: Sequence[str]) -> dict[str, dict[str, int]]:
    """Every table of a context by name (artifacts that are not tables are left out)."""
    out = {}
    for text in artifacts:
        parsed = parse_table(text)
        if parsed is not None:
            out[parsed[0]] = parsed[1]
    return out


def format_solution(lookups: Sequence[tuple[str, str, int]]) -> str:
    lines = [f"{name} {key}={value}" for name, key, value in lookups]
    values = [v for _, _, v in lookups]
    if len(values) == 2:
        lines.append(f"{values[0]}+{values[1]}={sum(values)}")
    return "\n".join(lines + [f"{ANSWER_MARKER} {sum(values)}"])


def parse_lookups(solution: str) -> list[tuple[str, str]]:
    """The (table, key) of every lookup line of a solution's working, in order."""
    out = []
    for line in solution.split(ANSWER_MARKER, 1)[0].split("\n"):
        m = _LOOKUP.match(line.strip())
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def check_working(completion: str, expected: Sequence[tuple[str, str]], expected_sums: int,
                  tables: Mapping[str, Mapping[str, int]]) -> tuple[int, int]:
    """(steps_total, steps_correct) of a completion's working, as defined in the module docstring."""
    total = correct = sums = 0
    written: list[tuple[str, str]] = []
    values: list[int] = []
    for line in completion.split(ANSWER_MARKER, 1)[0].split("\n"):
        line = line.strip()
        if not line:
            continue
        total += 1
        lookup, add = _LOOKUP.match(line), _SUM.match(line)
        if lookup:
            name, key, value = lookup.group(1), lookup.group(2), int(lookup.group(3))
            correct += tables.get(name, {}).get(key) == value
            written.append((name, key))
            values.append(value)
        elif add:
            a, b, c = (int(add.group(i)) for i in (1, 2, 3))
            correct += a + b == c and len(values) >= 2 and [a, b] == values[-2:]
            sums += 1
        # any other line: counted, never right
    total += max(0, expected_sums - sums)  # a missing sum line is a failed step
    total += max(len(expected), len(written))
    correct += sum(w == e for w, e in zip(written, expected))
    return total, correct


def kind_of(example: Example) -> str:
    """The query kind of an `ArtifactTask` example, from its uid (`artifacts-test-select-17`)."""
    parts = example.uid.split("-")
    if len(parts) != 4 or parts[0] != UID_PREFIX or parts[2] not in KINDS:
        raise ValueError(f"{example.uid!r} is not an artifacts-task uid (artifacts-SPLIT-KIND-N)")
    return parts[2]


# ---------------------------------------------------------------------------------------------
# The task


class ArtifactTask:
    """Seeded table lookups over a library of artifacts (see the module docstring).

    Knobs: `n_artifacts` tables per select/combine context, `rows` per table, `n_library` /
    `n_library_ood` tables in the training and held-out libraries, `kinds` the train mix
    ({kind: weight}; kinds of weight 0 are left out of train and of `test_examples()`), `n_test` test
    examples per kind and test split, `prefix` the shared text before the artifacts.
    """

    def __init__(self, seed: int = 0, n_train: int = 20000, n_test: int = 200, n_artifacts: int = 4,
                 rows: int = 3, n_library: int = 8000, n_library_ood: int = 500,
                 kinds: Mapping[str, float] | Sequence[str] | None = None, prefix: str = "",
                 prompt_template: str | None = None, teacher_template: str | None = None,
                 mask_token: str | None = None, check_charset: bool = True, name: str = "artifacts"):
        weights = dict.fromkeys(KINDS, 1.0) if kinds is None else (
            dict(kinds) if isinstance(kinds, Mapping) else dict.fromkeys(kinds, 1.0))
        unknown = sorted(set(weights) - set(KINDS))
        if unknown:
            raise DataError(f"artifacts: unknown kind(s) {unknown}; expected some of {KINDS}")
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise DataError(f"artifacts: kinds weights must be >= 0 with at least one > 0, got {weights}")
        if n_artifacts < 2:
            raise DataError(f"artifacts: n_artifacts must be >= 2 (select needs a second table), got {n_artifacts}")
        if not 1 <= rows <= len(KEYS):
            raise DataError(f"artifacts: rows must be in [1, {len(KEYS)}], got {rows}")
        if n_library < 2 * n_artifacts or n_library_ood < 2 * n_artifacts:
            raise DataError(f"artifacts: n_library and n_library_ood must be >= 2 * n_artifacts = {2 * n_artifacts}, "
                            f"got {n_library}, {n_library_ood}")
        if n_library + n_library_ood > len(NAMES):
            raise DataError(f"artifacts: n_library + n_library_ood = {n_library + n_library_ood} exceeds the "
                            f"{len(NAMES)} table names")
        if n_train < 0 or n_test < 0:
            raise DataError(f"artifacts: need n_train, n_test >= 0, got {n_train}, {n_test}")
        self.name, self.seed, self.n_train, self.n_test = name, seed, n_train, n_test
        self.n_artifacts, self.rows, self.n_library, self.n_library_ood = n_artifacts, rows, n_library, n_library_ood
        self.weights = {k: float(weights.get(k, 0.0)) for k in KINDS}
        self.active = tuple(k for k in KINDS if self.weights[k] > 0)
        self.prefix = prefix
        self.prompt_template = check_template(prompt_template or ARTIFACT_PROMPT, ["question"], "prompt_template")
        self.teacher_template = check_template(
            teacher_template or ARTIFACT_TEACHER_PROMPT, ["question", "reference"], "teacher_template")
        self.mask_token = mask_token or ARTIFACT_MASK_TOKEN
        if check_charset:
            fixed = fill_template(self.prompt_template + self.teacher_template, question="", reference="")
            reject_outside_charset(fixed + self.mask_token + prefix, 'artifacts')
        self._libraries: tuple[list[Table], list[Table]] | None = None
        self._splits: dict[str, dict[str, list[Example]]] | None = None
        self._train: list[Example] | None = None

    # -- libraries ----------------------------------------------------------------------------

    def libraries(self) -> tuple[list[Table], list[Table]]:
        """(training library, held-out library): disjoint table names. Cached."""
        if self._libraries is None:
            rng = random.Random(f"artifacts-{self.seed}-library")
            names = rng.sample(NAMES, self.n_library + self.n_library_ood)
            tables = [(n, tuple((k, rng.randint(*VALUE_RANGE)) for k in sorted(rng.sample(KEYS, self.rows))))
                      for n in names]
            self._libraries = (tables[: self.n_library], tables[self.n_library:])
        return self._libraries

    # -- data ---------------------------------------------------------------------------------

    def train_examples(self) -> list[Example]:
        self._generate()
        return self._train

    def test_examples(self) -> list[Example]:
        return self._interleaved("test")

    def test_examples_ood(self) -> list[Example]:
        return self._interleaved("test_ood")

    def examples_of(self, split: str, kind: str) -> list[Example]:
        if split not in SPLITS or kind not in KINDS:
            raise DataError(f"artifacts: examples_of(split, kind) takes a split of {SPLITS} and a kind of {KINDS}, "
                            f"got {split!r}, {kind!r}")
        self._generate()
        if split == "train":
            return [ex for ex in self._train if kind_of(ex) == kind]
        return self._splits[split][kind]

    def _interleaved(self, split: str) -> list[Example]:
        self._generate()
        per_kind = [self._splits[split][k] for k in self.active]
        return [ex for group in zip(*per_kind) for ex in group]

    def _generate(self) -> None:
        """Test splits first (every kind, distinct problems), then train skipping every in-domain test problem."""
        if self._train is not None:
            return
        library, held_out = self.libraries()
        self._splits = {"test": {}, "test_ood": {}}
        seen: set = set()
        for split, tables in (("test", library), ("test_ood", held_out)):
            for kind in KINDS:
                rng = random.Random(f"artifacts-{self.seed}-{split}-{kind}")
                self._splits[split][kind] = self._sample(rng, tables, [kind] * self.n_test, seen, True, split)
        rng = random.Random(f"artifacts-{self.seed}-train")
        kinds = rng.choices(self.active, weights=[self.weights[k] for k in self.active], k=self.n_train)
        self._train = self._sample(rng, library, kinds, seen, False, "train")

    def _sample(self, rng: random.Random, tables: list[Table], kinds: list[str], seen: set, unique: bool,
                split: str) -> list[Example]:
        rows_of = [dict(rows) for _, rows in tables]
        index: dict[str, list[tuple[int, int]]] = {k: [] for k in KEYS}  # key -> [(table, value)]
        for i, rows in enumerate(rows_of):
            for key, value in rows.items():
                index[key].append((i, value))
        out: list[Example] = []
        counts = dict.fromkeys(KINDS, 0)
        for kind in kinds:
            for _ in range(MAX_ATTEMPTS_PER_EXAMPLE):
                problem = self._problem(rng, tables, rows_of, index, kind)
                if problem is None:
                    continue
                context, lookups = problem
                question = "+".join(f"{t} {k}" for t, k, _ in lookups) + "?"
                key = (tuple(sorted(tables[i][0] for i in context)), question)
                if key in seen:
                    continue
                if unique:
                    seen.add(key)
                break
            else:
                raise DataError(f"artifacts: could only make {len(out)} distinct {split} problems of kind {kind!r} "
                                f"with n_library={self.n_library}, n_library_ood={self.n_library_ood}, "
                                f"rows={self.rows}; raise the library sizes")
            uid = f"{UID_PREFIX}-{split}-{kind}-{counts[kind]}"
            counts[kind] += 1
            artifacts = tuple(table_text(tables[i]) for i in context)
            answer = str(sum(v for _, _, v in lookups))
            out.append(Example(question, format_solution(lookups), answer, uid, artifacts))
        return out

    def _problem(self, rng: random.Random, tables: list[Table], rows_of: list[dict[str, int]],
                 index: dict[str, list[tuple[int, int]]], kind: str):
        """(context table indices in prompt order, [(table, key, value) asked]) or None to retry."""
        n_asked = 2 if kind == "combine" else 1
        asked = rng.sample(range(len(tables)), n_asked)
        lookups = []
        for t in asked:
            key, value = rng.choice(tables[t][1])
            lookups.append((t, key, value))
        context = list(asked)
        size = 1 if kind == "single" else self.n_artifacts
        # Tables that share an asked key with another value: at least one per asked key (select: 1 to N-1).
        if kind != "single":
            n_sharers = rng.randint(1, size - 1) if kind == "select" else (1 if size >= 4 else 0)
            for t, key, value in lookups:
                sharers = [u for u, v in index[key] if v != value and u not in context]
                if not sharers and n_sharers:
                    return None  # retry: this key is held by no other table with another value
                context += rng.sample(sharers, min(n_sharers, len(sharers), size - len(context)))
        while len(context) < size:
            u = rng.randrange(len(tables))
            if u in context or any(rows_of[u].get(key) == value for _, key, value in lookups):
                continue  # never a second table with an asked key's value: the name must matter
            context.append(u)
        for t, key, value in lookups:  # the asked tables of a combine question count too
            if any(u != t and rows_of[u].get(key) == value for u in context):
                return None
        rng.shuffle(context)
        return context, [(tables[t][0], key, value) for t, key, value in lookups]

    # -- prompts, spans, verification ---------------------------------------------------------

    def segments(self, example: Example) -> Segments:
        return Segments(self.prefix, example.artifacts, fill_template(self.prompt_template, question=example.question))

    def prompt(self, example: Example) -> str:
        return self.segments(example).text()

    def teacher_prompt(self, example: Example, reference: str) -> str:
        query = fill_template(self.teacher_template, question=example.question, reference=reference)
        return self.prefix + "".join(example.artifacts) + query

    def solution_spans(self, solution: str) -> list[str]:
        """One span per lookup line, the sum line, then the answer line."""
        return split_lines(solution)

    def verify(self, example: Example, completion: str) -> VerifyResult:
        answer = extract_answer(completion)
        expected = parse_lookups(example.solution)
        expected_sums = sum(bool(_SUM.match(l.strip())) for l in example.solution.split(ANSWER_MARKER, 1)[0].split("\n"))
        total, right = check_working(completion, expected, expected_sums, context_tables(example.artifacts))
        return VerifyResult(answers_equal(answer, example.answer), answer, total, right)



@dataclass
class ArtifactsConfig(PromptTemplates, TaskConfig):
    """data=artifacts (configs/data/artifacts.yaml): lookups in named tables, each a separate prompt
    artifact. `n_test` counts per kind, in each of the in-domain and held-out test splits."""

    name: str = "artifacts"
    n_train: int = 20000
    n_test: int = 200
    n_artifacts: int = 3  # tables in a select / combine context
    artifact_rows: int = 2  # key=value rows per table
    n_library: int = 8000  # tables of the training library (train and in-domain test draw from it)
    n_library_ood: int = 500  # tables of the held-out library (the test_ood split only)
    # the train mix ({kind: weight}); a kind of weight 0 is left out of train and test_examples()
    kinds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 1.0))
    artifact_prefix: str = ""  # shared text before the artifacts ("" = none)

    task_class = ArtifactTask

    def build(self, check_charset: bool = True) -> ArtifactTask:
        return ArtifactTask(seed=self.seed, n_train=self.n_train, n_test=self.n_test, n_artifacts=self.n_artifacts,
                            rows=self.artifact_rows, n_library=self.n_library, n_library_ood=self.n_library_ood,
                            kinds=dict(self.kinds) or None, prefix=self.artifact_prefix,
                            check_charset=check_charset, **self.templates())
