"""Long multiplication with a written scratchpad: the testbed task whose responses run to hundreds of tokens.

Why this task: the research questions (4-bit KV history behind the 144 INT8-protected positions, a
finite future-KL window H) only bite when responses are much longer than those windows, yet the
reward must stay exact and free to compute. A worked long multiplication is both: every step is a
one-digit operation the model can learn, the length grows with the operands' digits (the difficulty
knob), and the final answer is an integer checked by value.

Format (character-level, over the tokenizer of `kv4rl.data.char_tokenizer`): the prompt is `a*b=`; the
response multiplies `a` by each digit of `b` from the lowest, one digit of `a` at a time with its
carry, then adds each shifted partial product into the running sum, one column at a time:

    4217*6=(7*6+0=42)(1*6+4=10)(2*6+1=13)(4*6+1=25)=25302 4217*8=(...)=33736
    25302+337360=(2+0+0=2)(0+6+0=6)(3+3+0=6)(5+7+0=12)(2+3+1=6)(0+3+0=3)=362662 ... \\boxed{1627762}

Each step `(x*d+c=v)` / `(x+y+c=v)` keeps `v mod 10` as the next digit and carries `v // 10`; the last
step's `v` is written whole, so the line's value is that `v` followed by the kept digits in reverse.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kv4rl.data.synthetic import PROMPT_TEMPLATE, target_text
from kv4rl.data.synthetic import verify as verify  # the same exact check: last box, an integer, by value
from kv4rl.data.types import Problem

__all__ = ["PROMPT_TEMPLATE", "LongMulTask", "solution", "verify"]


def _digits_low_first(value: int) -> list[int]:
    return [int(ch) for ch in reversed(str(value))]


def _multiply_line(a: int, digit: int) -> tuple[str, int]:
    """`a*d=(steps)=value`, one step per digit of `a` from the lowest, carrying into the next."""
    steps, carry = [], 0
    for x in _digits_low_first(a):
        value = x * digit + carry
        steps.append(f"({x}*{digit}+{carry}={value})")
        carry = value // 10
    return f"{a}*{digit}=" + "".join(steps) + f"={a * digit}", a * digit


def _add_line(total: int, shifted: int) -> tuple[str, int]:
    """`s+p=(steps)=value`, one column per digit of the longer operand, from the lowest, with carries."""
    left, right = _digits_low_first(total), _digits_low_first(shifted)
    width = max(len(left), len(right))
    left, right = left + [0] * (width - len(left)), right + [0] * (width - len(right))
    steps, carry = [], 0
    for x, y in zip(left, right):
        value = x + y + carry
        steps.append(f"({x}+{y}+{carry}={value})")
        carry = value // 10
    return f"{total}+{shifted}=" + "".join(steps) + f"={total + shifted}", total + shifted


def solution(a: int, b: int) -> str:
    """The full worked response for `a*b` (without the EOS token that must follow it)."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    lines, total = [], 0
    for place, digit in enumerate(_digits_low_first(b)):
        line, partial = _multiply_line(a, digit)
        lines.append(line)
        if place == 0:
            total = partial
            continue
        line, total = _add_line(total, partial * 10**place)
        lines.append(line)
    return " ".join(lines) + " " + target_text(total)


@dataclass(frozen=True, kw_only=True, slots=True)
class LongMulTask:
    """`a*b` with `a` of `min_digits_a`..`max_digits_a` digits and `b` of `min_digits_b`..`max_digits_b`.

    Operands have exactly the drawn number of digits (no leading zero); more digits mean longer
    worked solutions (about 12 tokens per digit of `a`, per digit of `b`, plus the column additions).
    """

    min_digits_a: int = 2
    max_digits_a: int = 3
    min_digits_b: int = 1
    max_digits_b: int = 2

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            low, high = getattr(self, f"min_digits_{name}"), getattr(self, f"max_digits_{name}")
            if low < 1:
                raise ValueError(f"min_digits_{name} must be at least 1, got {low}")
            if high < low:
                raise ValueError(f"max_digits_{name} ({high}) must be >= min_digits_{name} ({low})")

    def sample(self, rng: random.Random) -> Problem:
        """One problem drawn with `rng`; its id is derived from the expression."""
        a = _draw(rng, rng.randint(self.min_digits_a, self.max_digits_a))
        b = _draw(rng, rng.randint(self.min_digits_b, self.max_digits_b))
        expression = f"{a}*{b}"
        return Problem(problem=expression, answer=str(a * b), id=f"longmul:{expression}",
                       meta={"digits": (len(str(a)), len(str(b)))})

    def problems(self, n: int, seed: int) -> list[Problem]:
        """`n` problems, the same for the same `seed`; ids `longmul-<seed>-<index>` are unique per list."""
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        rng = random.Random(seed)
        drawn = (self.sample(rng) for _ in range(n))
        return [Problem(problem=p.problem, answer=p.answer, id=f"longmul-{seed}-{index}", meta=p.meta)
                for index, p in enumerate(drawn)]

    def prompt(self, problem: Problem) -> str:
        return PROMPT_TEMPLATE.format(problem=problem.problem)

    def target(self, problem: Problem) -> str:
        """The worked response the supervised warm-up teaches for `problem`."""
        a, b = (int(v) for v in problem.problem.split("*"))
        return solution(a, b)


def _draw(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
