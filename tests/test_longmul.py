"""The long-multiplication task: hand-worked solutions, every step of every small case re-checked by an
independent parser, an exact verifier, and solution lengths at the GPU testbed's difficulty."""

from __future__ import annotations

import random
import re
import statistics

import pytest

from kv4rl.data.char_tokenizer import UNK, build_char_tokenizer
from kv4rl.data.longmul import LongMulTask, solution, verify
from kv4rl.models.testbed import SPECS
from kv4rl.models.warmup import solution_lengths
from kv4rl.rewards import get_reward

LINE = re.compile(r"(\d+)([*+])(\d+)=((?:\([^)]*\))+)=(\d+)")


def test_hand_worked_solutions() -> None:
    assert solution(12, 3) == "12*3=(2*3+0=6)(1*3+0=3)=36 \\boxed{36}"
    assert solution(5, 0) == "5*0=(5*0+0=0)=0 \\boxed{0}"
    assert solution(4217, 386) == (
        "4217*6=(7*6+0=42)(1*6+4=10)(2*6+1=13)(4*6+1=25)=25302 "
        "4217*8=(7*8+0=56)(1*8+5=13)(2*8+1=17)(4*8+1=33)=33736 "
        "25302+337360=(2+0+0=2)(0+6+0=6)(3+3+0=6)(5+7+0=12)(2+3+1=6)(0+3+0=3)=362662 "
        "4217*3=(7*3+0=21)(1*3+2=5)(2*3+0=6)(4*3+0=12)=12651 "
        "362662+1265100=(2+0+0=2)(6+0+0=6)(6+1+0=7)(2+5+0=7)(6+6+0=12)(3+2+1=6)(0+1+0=1)=1627762 "
        "\\boxed{1627762}")
    assert 4217 * 386 == 1627762


def check_worked(text: str, a: int, b: int) -> int:
    """Re-derive every line and step of a worked solution; returns the boxed value."""
    *lines, boxed = text.split(" ")
    assert lines and boxed == f"\\boxed{{{a * b}}}"
    partials = 0
    for line in lines:
        m = LINE.fullmatch(line)
        assert m, line
        left, op, right, steps, value = int(m[1]), m[2], int(m[3]), m[4], int(m[5])
        parsed = re.findall(r"\(([^)]*)\)", steps)
        carry, kept = 0, []
        if op == "*":
            assert left == a and 0 <= right <= 9
            assert len(parsed) == len(str(a))
            for k, step in enumerate(parsed):
                x, d, c, v = map(int, re.fullmatch(r"(\d)\*(\d)\+(\d+)=(\d+)", step).groups())
                assert (x, d, c, v) == (int(str(a)[-1 - k]), right, carry, x * d + c)
                carry, kept = v // 10, kept + [v]
            assert value == left * right
            partials += 1
        else:
            width = max(len(str(left)), len(str(right)))
            assert len(parsed) == width
            for k, step in enumerate(parsed):
                x, y, c, v = map(int, re.fullmatch(r"(\d)\+(\d)\+(\d+)=(\d+)", step).groups())
                assert (x, y, c, v) == (left // 10**k % 10, right // 10**k % 10, carry, x + y + c)
                carry, kept = v // 10, kept + [v]
            assert value == left + right
            assert right % 10 ** (partials - 1) == 0  # the partial product is shifted by its place
        # the line's value is the last step whole, then the kept digits of the others, highest first
        assert str(value) == str(int(str(kept[-1]) + "".join(str(v % 10) for v in reversed(kept[:-1]))))
    assert partials == len(str(b))
    return int(boxed[len("\\boxed{"):-1])


def test_every_small_case_works_out_and_verifies() -> None:
    reward = get_reward("exact")
    cases = [(a, b) for a in range(0, 120) for b in range(0, 120, 7)]
    rng = random.Random(0)
    cases += [(rng.randint(10**5, 10**7), rng.randint(10**2, 10**6)) for _ in range(300)]
    texts = [solution(a, b) for a, b in cases]
    for (a, b), text in zip(cases, texts):
        assert check_worked(text, a, b) == a * b
        assert verify(text, str(a * b)) == 1.0
    assert reward(texts, [str(a * b) for a, b in cases]).scores == [1.0] * len(cases)


def test_wrong_answers_never_verify() -> None:
    reward = get_reward("exact")
    for a, b in [(0, 0), (7, 9), (123, 45), (4217, 386), (999999, 99999)]:
        right = a * b
        text = solution(a, b)
        for wrong in {right + 1, right - 1, right + 10, right * 10, -right - 1, int(str(right)[::-1]) + 1} - {right}:
            swapped = text.replace(f"\\boxed{{{right}}}", f"\\boxed{{{wrong}}}")
            assert verify(swapped, str(right)) == 0.0
            assert reward([swapped], [str(right)]).scores == [0.0]
        # a right box earlier does not count; the last box is the answer
        assert verify(text + f" \\boxed{{{right + 1}}}", str(right)) == 0.0
        assert verify(text[: -len(str(right)) - 1], str(right)) == 0.0  # unclosed box
        assert verify(text.replace("\\boxed{", "{"), str(right)) == 0.0  # no box
        assert verify(text.replace(f"{{{right}}}", f"{{{right}.0}}"), str(right)) == 0.0


def test_problems_are_deterministic_and_within_the_digit_bounds() -> None:
    task = LongMulTask(min_digits_a=2, max_digits_a=4, min_digits_b=1, max_digits_b=3)
    problems = task.problems(400, seed=5)
    assert problems == task.problems(400, seed=5) and problems != task.problems(400, seed=6)
    seen = set()
    for p in problems:
        a, b = (int(v) for v in p.problem.split("*"))
        seen.add((len(str(a)), len(str(b))))
        assert p.answer == str(a * b) and p.meta["digits"] == (len(str(a)), len(str(b)))
        assert task.target(p) == solution(a, b)
    assert seen == {(da, db) for da in range(2, 5) for db in range(1, 4)}
    assert len({p.id for p in problems}) == len(problems)
    with pytest.raises(ValueError, match="min_digits_a"):
        LongMulTask(min_digits_a=0)
    with pytest.raises(ValueError, match="max_digits_b"):
        LongMulTask(min_digits_b=3, max_digits_b=2)


def test_solutions_tokenize_one_char_per_token_without_unknowns() -> None:
    tokenizer = build_char_tokenizer()
    text = solution(90817, 6043)
    ids = tokenizer.encode(text)
    assert tokenizer.convert_tokens_to_ids(UNK) not in ids
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text) - len("\\boxed{") + 1


def test_gpu_difficulty_gives_long_solutions() -> None:
    lengths = solution_lengths(SPECS["longmul-gpu"], 1000, seed=3)
    assert statistics.mean(lengths) >= 300
    assert min(lengths) >= 200 and max(lengths) <= 2000
    # the rollout limit of the GPU recipe never cuts a worked solution
    assert max(lengths) < 2048
