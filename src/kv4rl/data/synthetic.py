"""Exact-answer integer arithmetic: the task behind the CPU demo and the end-to-end tests.

Why this task: its answers are checkable without a model or a math parser, its difficulty is a few
integer knobs, and a model of a few hundred thousand parameters can learn part of it in seconds, which
leaves room for RL to show reward rising on a laptop.

Format: the problem is an expression such as `12+7-3`; the model sees `PROMPT_TEMPLATE` filled in
(`12+7-3=`) and should answer `\\boxed{16}` followed by EOS (`target_text` gives the text part; EOS is a
token, added by whoever tokenizes). Operators follow the usual precedence (`*` before `+`/`-`,
left to right otherwise), so Python's `eval` is an independent check of `answer`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kv4rl.data.types import Problem

PROMPT_TEMPLATE = "{problem}="
BOXED_PREFIX = "\\boxed{"
_ALLOWED_OPS = frozenset("+-*")
_INTEGER = re.compile(r"-?[0-9]+")


def target_text(answer: str | int) -> str:
    """The ideal response text for `answer`, without the EOS token that must follow it."""
    return f"{BOXED_PREFIX}{answer}}}"


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of `o0 op1 o1 op2 o2 ...` with `*` binding tighter than `+` and `-`."""
    if len(operators) != len(operands) - 1:
        raise ValueError(f"need one operator between each pair of operands, got {operands} and {operators}")
    total = 0
    sign = 1
    product = operands[0]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            product *= value
            continue
        total += sign * product
        sign = 1 if op == "+" else -1
        product = value
    return total + sign * product


def verify(response: str, answer: str) -> float:
    """1.0 iff the last box of `response` holds the integer `answer`, else 0.0: the `exact` reward's rule,
    which RL is trained on (`kv4rl.rewards.math.exact_match` of `extract_boxed`), so the warm-up's measured
    accuracy is the reward's. A sign (`+16`) is allowed; `16.0`, `16 apples` or no closed box score 0.0.
    """
    from kv4rl.rewards.base import extract_boxed
    from kv4rl.rewards.math import exact_match

    if _INTEGER.fullmatch(answer.strip()) is None:
        raise ValueError(f"answer must be an integer string, got {answer!r}")
    contents = extract_boxed(response)
    return float(contents is not None and exact_match(contents, answer))


@dataclass(frozen=True, kw_only=True, slots=True)
class ArithmeticTask:
    """Expressions of `min_terms`..`max_terms` operands drawn from 0..`max_value`, joined by `ops`."""

    min_terms: int = 2
    max_terms: int = 3
    max_value: int = 10
    ops: str = "+-"

    def __post_init__(self) -> None:
        if self.min_terms < 1:
            raise ValueError(f"min_terms must be at least 1, got {self.min_terms}")
        if self.max_terms < self.min_terms:
            raise ValueError(f"max_terms ({self.max_terms}) must be >= min_terms ({self.min_terms})")
        if self.max_value < 0:
            raise ValueError(f"max_value must be non-negative, got {self.max_value}")
        if not self.ops or not set(self.ops) <= _ALLOWED_OPS or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be distinct characters from '+-*', got {self.ops!r}")

    def sample(self, rng: random.Random) -> Problem:
        """One problem drawn with `rng`; its id is derived from the expression."""
        num_terms = rng.randint(self.min_terms, self.max_terms)
        operands = [rng.randint(0, self.max_value) for _ in range(num_terms)]
        operators = [rng.choice(self.ops) for _ in range(num_terms - 1)]
        expression = str(operands[0]) + "".join(op + str(v) for op, v in zip(operators, operands[1:]))
        answer = str(evaluate(operands, operators))
        return Problem(problem=expression, answer=answer, id=f"arith:{expression}", meta={"terms": num_terms})

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, the same for the same `seed`; ids `arith-<seed>-<index>` are unique per list."""
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        rng = random.Random(seed)
        drawn = (self.sample(rng) for _ in range(n))
        return [
            Problem(problem=p.problem, answer=p.answer, id=f"arith-{seed}-{index}", meta=p.meta)
            for index, p in enumerate(drawn)
        ]

    def prompt(self, problem: Problem) -> str:
        """The text the model is given for `problem`."""
        return PROMPT_TEMPLATE.format(problem=problem.problem)
