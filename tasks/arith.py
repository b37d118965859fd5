"""`arith`: the embedded task — seeded multi-step arithmetic word problems with checkable working.

Small enough for a ~1M-parameter character-level model to learn on a CPU in minutes, and verifiable
step by step, so a reward can tell a right answer from right *working*.

    task = ArithTask(seed=0, digits=3, steps=2, ops=("+", "-"))
    ex = task.train_examples()[0]
    task.verify(ex, ex.solution)   # VerifyResult(correct=True, ..., steps_correct == steps_total)

Question: "tom has 345 apples. he gets 278 more, then gives away 12. how many apples?"

Solution format (one line per operation, then the answer line):

    345+278: 5+8=13, 4+7+1=12, 3+2+1=6. 345+278=623
    623-12: 3-2=1, 2-1=1, 6-0=6. 623-12=611
    #### 611

- A step line is `A op B: <columns>. A op B=C`: the header names the operation, the columns work it
  digit by digit from the ones column up, and the composite equation gives the step result.
- Columns are equations of small ints, separated by ", ". Digits missing from the shorter operand
  are written as 0 so every column has the same shape. The last column writes its full value, so
  its digits lead the result (3+2+1=6 -> 6..., 9+9=18 -> 18...).
  - `+`: `x+y=s`, with `+1` appended when the previous column carried: `4+7+1=12`.
  - `-`: `x-y=d`, with `-1` appended when the previous column borrowed; a column that must borrow
    writes its top digit as 10+x: `13-8=5`, `12-4-1=7` (623-48: 13-8=5, 12-4-1=7, 6-0-1=5).
  - `*` (single-digit multiplier m): `x*m=p`, with `+c` appended for the carry c of the previous
    column: `345*7: 5*7=35, 4*7+3=31, 3*7+3=24. 345*7=2415`.
- The first step starts from the question's first number; each next step starts from the previous
  step's result and uses the question's next number. Values never go negative.

The verifier's step count (`steps_total`) is the sum of:
- per step line (a line starting `A op B:`): one check per column position (max of written and
  expected columns; a column is right only if it is exactly the expected column for `A op B`, which
  implies its arithmetic is right), plus one check for the composite (present, same operands as the
  header, arithmetic right);
- every other equation `lhs=rhs` in the working (lhs ints joined by + - *), checked arithmetically;
- the chain: one check per step (max of expected and written steps): step i must compute
  (previous written result, or the question's first number, op_i, the question's i-th operand).
Everything after the `####` marker is not working and is not checked.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Sequence

from tasks.base import (
    check_charset as reject_outside_charset,
    ANSWER_MARKER,
    DataError,
    Example,
    PromptTemplates,
    TaskConfig,
    VerifyResult,
    answers_equal,
    check_template,
    extract_answer,
    fill_template,
    split_lines,
)

ARITH_PROMPT = "q: {question}\na: "
ARITH_TEACHER_PROMPT = "q: {question}\nref: {reference}\na: "
ARITH_MASK_TOKEN = "_"
OPS = ("+", "-", "*")
MAX_ATTEMPTS_PER_EXAMPLE = 50  # generation gives up (the knobs allow too few distinct problems)

NAMES = (("tom", "he"), ("ann", "she"), ("bob", "he"), ("eve", "she"),
         ("sam", "he"), ("mia", "she"), ("max", "he"), ("zoe", "she"))
ITEMS = ("apples", "pens", "cards", "coins", "books", "eggs", "shells", "stamps", "beads", "marbles")
PHRASES = {
    "+": ("gets {n} more", "finds {n} more", "buys {n} more"),
    "-": ("gives away {n}", "loses {n}", "sells {n}"),
    "*": ("has {n} times as many", "ends up with {n} times as many"),
}

# lhs: ints joined by + - * (at least one operator); rhs: an int. Not preceded by a digit.
_EQUATION = re.compile(r"(?<!\d)(\d+(?:[+*\-]\d+)+)=(-?\d+)(?!\d)")
_HEADER = re.compile(r"^\s*(\d+)([+*\-])(\d+):")


@dataclass(frozen=True)
class Step:
    a: int
    op: str
    b: int

    def result(self) -> int:
        return apply_op(self.a, self.op, self.b)


def apply_op(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


# ---------------------------------------------------------------------------------------------
# Column arithmetic


def column_equations(a: int, op: str, b: int) -> list[str]:
    """The digit-by-digit columns of `a op b`, ones column first (see the module docstring)."""
    if op == "*":
        return _mul_columns(a, b)
    xs, ys = _digits(a), _digits(b)
    n = max(len(xs), len(ys))
    xs, ys = xs + [0] * (n - len(xs)), ys + [0] * (n - len(ys))
    cols, carry = [], 0
    for i, (x, y) in enumerate(zip(xs, ys)):
        last = i == n - 1
        if op == "+":
            s = x + y + carry
            cols.append(f"{x}+{y}{'+1' if carry else ''}={s}")
            carry = s // 10
        else:
            d = x - y - carry
            borrow = d < 0 and not last
            top = f"1{x}" if borrow else f"{x}"
            cols.append(f"{top}-{y}{'-1' if carry else ''}={d + 10 if borrow else d}")
            carry = int(borrow)
    return cols


def _mul_columns(a: int, m: int) -> list[str]:
    cols, carry = [], 0
    for x in _digits(a):
        p = x * m + carry
        cols.append(f"{x}*{m}{f'+{carry}' if carry else ''}={p}")
        carry = p // 10
    return cols


def _digits(n: int) -> list[int]:
    """Decimal digits of a non-negative int, ones first."""
    return [int(c) for c in reversed(str(n))]


def step_line(step: Step) -> str:
    expr = f"{step.a}{step.op}{step.b}"
    return f"{expr}: {', '.join(column_equations(step.a, step.op, step.b))}. {expr}={step.result()}"


def format_solution(steps: Sequence[Step]) -> str:
    return "\n".join([step_line(s) for s in steps] + [f"{ANSWER_MARKER} {steps[-1].result()}"])


def eval_int_expr(expr: str) -> int:
    """Value of ints joined by + - * with the usual precedence (no eval())."""
    tokens = re.findall(r"\d+|[+*\-]", expr)
    total, term, sign = 0, int(tokens[0]), 1
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            term *= int(num)
        else:
            total += sign * term
            term, sign = int(num), (1 if op == "+" else -1)
    return total + sign * term


# ---------------------------------------------------------------------------------------------
# Verification


def parse_steps(solution: str) -> list[tuple[Step, int | None]]:
    """The step lines of a solution as (header step, written composite result or None)."""
    out = []
    for line in solution.split(ANSWER_MARKER, 1)[0].split("\n"):
        m = _HEADER.match(line)
        if m:
            eqs = _EQUATION.findall(line)
            result = int(eqs[-1][1]) if eqs else None
            out.append((Step(int(m.group(1)), m.group(2), int(m.group(3))), result))
    return out


def check_lines(completion: str) -> tuple[int, int, list[tuple[Step, int | None]]]:
    """(checks, right, written steps) of a completion's working lines, without the chain: per step
    line its columns and composite, every other equation arithmetically (module docstring).
    Written steps are (header step, written composite result or None), in order."""
    total = correct = 0
    written: list[tuple[Step, int | None]] = []
    for line in completion.split(ANSWER_MARKER, 1)[0].split("\n"):
        eqs = [(m.group(0), m.group(1), int(m.group(2))) for m in _EQUATION.finditer(line)]
        header = _HEADER.match(line)
        if not header:
            total += len(eqs)
            correct += sum(eval_int_expr(lhs) == rhs for _, lhs, rhs in eqs)
            continue
        step = Step(int(header.group(1)), header.group(2), int(header.group(3)))
        cols, composite = eqs[:-1], (eqs[-1] if eqs else None)
        canon = column_equations(step.a, step.op, step.b)
        total += max(len(cols), len(canon)) + 1
        correct += sum(text == want for (text, _, _), want in zip(cols, canon))
        expr = f"{step.a}{step.op}{step.b}"
        correct += composite is not None and composite[1] == expr and composite[2] == step.result()
        written.append((step, composite[2] if composite else None))
    return total, correct, written


def check_working(completion: str, expected: Sequence[Step]) -> tuple[int, int]:
    """(steps_total, steps_correct) of a completion's working, as defined in the module docstring."""
    total, correct, written = check_lines(completion)
    total += max(len(expected), len(written))
    prev = expected[0].a if expected else None
    for want, (got, result) in zip(expected, written):
        correct += got == Step(prev, want.op, want.b)
        prev = result
    return total, correct


def solution_path(text: str) -> list[tuple[str, int]]:
    """The path a solution (or completion) takes: (op, operand) of each step line, in order."""
    return [(step.op, step.b) for step, _ in parse_steps(text)]


# ---------------------------------------------------------------------------------------------
# Generation


def _number(rng: random.Random, lo_digits: int, hi_digits: int, cap: int | None = None) -> int:
    """A random int with between lo_digits and hi_digits digits (>= 1), at most `cap`."""
    if cap is not None:
        hi_digits = min(hi_digits, len(str(cap)))
        lo_digits = min(lo_digits, hi_digits)
    d = rng.randint(lo_digits, hi_digits)
    lo, hi = (10 ** (d - 1) if d > 1 else 1), 10**d - 1
    return rng.randint(lo, hi if cap is None else min(hi, cap))


class ArithTask:
    """Seeded multi-step word problems with digit-by-digit worked solutions (see module docstring).

    Knobs: `digits` / `min_digits` bound the operands' digit counts, `steps` is the number of chained
    operations, `ops` the allowed operations ("*" multiplies by a single digit 2-9). Train and test
    never share a problem (same numbers and operations); the same seed gives the same examples.
    Templates take `{question}` / `{reference}`; `check_charset` rejects characters outside the
    tiny model's tokenizer alphabet.
    """

    several_paths = False  # one valid order of operations: the path diagnostics have nothing to compare

    def __init__(self, seed: int = 0, n_train: int = 20000, n_test: int = 200, digits: int = 3,
                 min_digits: int = 1, steps: int = 2, ops: Sequence[str] = ("+", "-"),
                 prompt_template: str | None = None, teacher_template: str | None = None,
                 mask_token: str | None = None, check_charset: bool = True, name: str = "arith"):
        ops = tuple(ops)
        if not ops or any(op not in OPS for op in ops):
            raise DataError(f"arith: ops must be a non-empty subset of {OPS}, got {ops}")
        if not 1 <= min_digits <= digits:
            raise DataError(f"arith: need 1 <= min_digits <= digits, got {min_digits}, {digits}")
        if steps < 1 or n_train < 0 or n_test < 0:
            raise DataError(f"arith: need steps >= 1 and n_train, n_test >= 0, got {steps}, {n_train}, {n_test}")
        self.name, self.seed, self.n_train, self.n_test = name, seed, n_train, n_test
        self.digits, self.min_digits, self.steps, self.ops = digits, min_digits, steps, ops
        self.prompt_template = check_template(prompt_template or ARITH_PROMPT, ["question"], "prompt_template")
        self.teacher_template = check_template(
            teacher_template or ARITH_TEACHER_PROMPT, ["question", "reference"], "teacher_template")
        self.mask_token = mask_token or ARITH_MASK_TOKEN
        if check_charset:
            fixed = fill_template(self.prompt_template + self.teacher_template, question="", reference="")
            reject_outside_charset(fixed + self.mask_token, 'arith')
        self._splits: tuple[list[Example], list[Example]] | None = None

    # -- data ---------------------------------------------------------------------------------

    def train_examples(self) -> list[Example]:
        return self._generate()[0]

    def test_examples(self) -> list[Example]:
        return self._generate()[1]

    def _generate(self) -> tuple[list[Example], list[Example]]:
        """Test first (distinct problems), then train skipping every test problem. Cached."""
        if self._splits is None:
            test_rng = random.Random(f"{self.name}-{self.seed}-test")
            train_rng = random.Random(f"{self.name}-{self.seed}-train")
            test = self._sample(test_rng, self.n_test, exclude=set(), unique=True, split="test")
            held_out = {self._key(ex) for ex in test}
            train = self._sample(train_rng, self.n_train, exclude=held_out, unique=False, split="train")
            self._splits = (train, test)
        return self._splits

    def _sample(self, rng: random.Random, n: int, exclude: set, unique: bool, split: str) -> list[Example]:
        out: list[Example] = []
        seen = set(exclude)
        for _ in range(n * MAX_ATTEMPTS_PER_EXAMPLE):
            if len(out) == n:
                break
            steps = self._problem(rng)
            key = self._problem_key(steps)
            if key in seen:
                continue
            if unique:
                seen.add(key)
            out.append(self._example(rng, steps, f"{self.name}-{split}-{len(out)}"))
        if len(out) < n:
            raise DataError(f"{self.name}: could only make {len(out)} of {n} distinct {split} problems with "
                            f"digits={self.digits}, steps={self.steps}, ops={self.ops}; raise digits or steps")
        return out

    def _problem(self, rng: random.Random) -> list[Step]:
        value = _number(rng, self.min_digits, self.digits)
        steps = []
        for _ in range(self.steps):
            feasible = [op for op in self.ops if op != "-" or value >= 1]
            op = rng.choice(feasible) if feasible else "-"  # only "-" allowed and value 0: subtract 0
            if op == "+":
                b = _number(rng, self.min_digits, self.digits)
            elif op == "-":
                b = _number(rng, self.min_digits, self.digits, cap=value) if value >= 1 else 0
            else:
                b = rng.randint(2, 9)
            steps.append(Step(value, op, b))
            value = steps[-1].result()
        return steps

    def _example(self, rng: random.Random, steps: list[Step], uid: str) -> Example:
        """The word problem of `steps` and its worked solution (the operations in question order)."""
        name, pronoun = rng.choice(NAMES)
        item = rng.choice(ITEMS)
        actions = ", then ".join(rng.choice(PHRASES[s.op]).format(n=s.b) for s in steps)
        question = f"{name} has {steps[0].a} {item}. {pronoun} {actions}. how many {item}?"
        return Example(question, format_solution(steps), str(steps[-1].result()), uid)

    @staticmethod
    def _problem_key(steps: Sequence[Step]) -> tuple:
        """What makes two problems the same (train and test never share one)."""
        return (steps[0].a,) + tuple((s.op, s.b) for s in steps)

    def _key(self, ex: Example) -> tuple:
        return self._problem_key([s for s, _ in parse_steps(ex.solution)])

    # -- prompts, spans, verification ---------------------------------------------------------

    def prompt(self, example: Example) -> str:
        return fill_template(self.prompt_template, question=example.question)

    def teacher_prompt(self, example: Example, reference: str) -> str:
        return fill_template(self.teacher_template, question=example.question, reference=reference)

    def solution_spans(self, solution: str) -> list[str]:
        """One span per step line, then the answer line."""
        return split_lines(solution)

    def solution_path(self, text: str) -> list[tuple[str, int]]:
        """(op, operand) per step line: the order in which a solution applies the question's operations."""
        return solution_path(text)

    def verify(self, example: Example, completion: str) -> VerifyResult:
        answer = extract_answer(completion)
        expected = [s for s, _ in parse_steps(example.solution)]
        total, right = check_working(completion, expected)
        return VerifyResult(answers_equal(answer, example.answer), answer, total, right)



@dataclass
class ArithConfig(PromptTemplates, TaskConfig):
    """data=arith (configs/data/arith.yaml): the embedded multi-step arithmetic problems."""

    name: str = "arith"
    n_train: int = 20000
    n_test: int = 200
    digits: int = 2  # largest operand size in digits
    steps: int = 2  # operations (solution steps) per problem
    ops: list[str] = field(default_factory=lambda: ["+", "-"])

    task_class = ArithTask

    def build(self, check_charset: bool = True) -> ArithTask:
        return self.task_class(seed=self.seed, n_train=self.n_train, n_test=self.n_test, digits=self.digits,
                               steps=self.steps, ops=tuple(self.ops), check_charset=check_charset, **self.templates())
