"""Final-answer rewards for maths: `math_verify` (symbolic equivalence) and `exact` (string/integer).

Only the last `\\boxed{...}` of a response is graded; a response without one scores 0 and is counted
as `no_answer` (falling back to the whole text would reward answers the model never committed to).

`math_verify` runs in a separate worker process because sympy can take unbounded time on
adversarial model output, and a thread cannot be interrupted. The worker (spawn context, so it is
safe next to CUDA) imports the check function once and serves many batches over a pipe: the whole
batch goes in one message and results stream back one per item. Each result must arrive within
`timeout_s` of the previous one; if it does not, that item scores 0 and counts as a timeout, the
worker is killed and restarted, and the rest of the batch is resent. The check function is named
by import path (`check_fn="module:function"`) so tests can substitute one that hangs or raises
(`kv4rl.rewards.watchdog`, which `VerlScore` shares). math-verify's own signal-based timeouts are switched off: this watchdog is the single mechanism.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import re
from collections.abc import Callable
from typing import Any

from kv4rl.rewards.base import Reward, RewardResult, extract_boxed, register_reward
from kv4rl.rewards.watchdog import WatchdogWorker

__all__ = ["DEFAULT_CHECK_FN", "ExactReward", "MathVerifyReward", "exact_match", "verify_answer"]

logger = logging.getLogger(__name__)

DEFAULT_CHECK_FN = "kv4rl.rewards.math:verify_answer"



class _DropTimeoutDisabledWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    import math_verify

    # We disable its per-call timeouts on purpose (see the module docstring); silence the reminder.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
    return math_verify.parse, math_verify.verify


_TRAILING_PUNCTUATION = re.compile(r"(?<!\\)[.,;]\s*$")  # not the ',' of a trailing `\,` thin space
_PHANTOM = re.compile(r"\\phantom\s*(?:\{[^{}]*\}|\S)")
_FRAC_ARGUMENT = r"(\{[^{}]*\}|\\[a-zA-Z]+|[0-9a-zA-Z])"
_BARE_FRAC = re.compile(r"\\([dt]?frac)\s*" + _FRAC_ARGUMENT + r"\s*" + _FRAC_ARGUMENT)
_GROUPED_NUMBER = re.compile(r"\{(\d{1,3}(?:,\d{3})+)\}")
_THIN_SPACED_NUMBER = re.compile(r"(?<![\d.])\d{1,3}(?:\\,\d{3})+(?![\d.])")
_BASE_NUMBER = re.compile(r"(\d[0-9A-Za-z]*)_(?:\{(\d{1,2})\}|(\d{1,2}))")  # bases 2-36
# thousands apart by a no-break, thin or narrow no-break space, anywhere; by a plain space, as the whole answer
_UNICODE_SPACED_NUMBER = re.compile(r"(?<![\d.])\d{1,3}(?:[\u00a0\u2009\u202f]\d{3})+(?![\d.])")
_SPACED_NUMBER = re.compile(r"-?\d{1,3}(?: \d{3})+")
_DEGREES = re.compile(r"\s*(?:°|\\degree(?![a-zA-Z]))")
# the root sign and its argument: a brace group, a number, a fraction, a command without arguments (`\pi`), a letter
_ROOT_SIGN = re.compile(r"√\s*(\{[^{}]*\}|\d+(?:\.\d+)?|\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"
                        r"|\\[a-zA-Z]+(?![a-zA-Z]|\s*\{)|[a-zA-Z])")
_FULL_WIDTH = {code: code - 0xFEE0 for code in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}  # ＡＢ１２ -> AB12


def _braced(argument: str) -> str:
    return argument if argument.startswith("{") else "{" + argument + "}"


def tidy_answer(answer: str) -> str:
    """LaTeX that math-verify misreads, rewritten before it parses an answer (gold or boxed): a trailing
    '.', ',' or ';' (it parsed `\\begin{pmatrix}...\\end{pmatrix}.` as -1), the `\\!` thin space and
    `\\phantom` padding, `\\frac` with a bare argument (`\\frac\\pi 2` became 2, `\\frac\\pi{2}` garbage),
    thousands separated by commas in a brace group (`\\frac{1}{29,322,216}`) or by `\\,` (`1\\,000` read as
    1*0). Nine MATH training answers scored right answers 0 and three wrong ones 1 without it."""
    answer = _PHANTOM.sub("", answer.replace("\\!", "")).strip()
    answer = _BARE_FRAC.sub(lambda m: f"\\{m.group(1)}{_braced(m.group(2))}{_braced(m.group(3))}", answer)
    answer = _GROUPED_NUMBER.sub(lambda m: "{" + m.group(1).replace(",", "") + "}", answer)
    answer = _TRAILING_PUNCTUATION.sub("", answer)  # first: the rule below reads `1\,000.` only without its period
    answer = _THIN_SPACED_NUMBER.sub(lambda m: m.group(0).replace("\\,", ""), answer)
    return _unicode_tidied(answer)


def _unicode_tidied(answer: str) -> str:
    """What a model writes in Unicode that math-verify reads as nothing or otherwise: full-width characters (`１８`),
    the degree sign and `\\degree` (`30°` is `30^\\circ`), the root sign (`3√13` is `3\\sqrt{13}`), and thousands
    apart by a no-break or thin space (`1 000`)."""
    answer = answer.translate(_FULL_WIDTH)
    answer = _DEGREES.sub(lambda _: "^{\\circ}", answer)
    answer = _ROOT_SIGN.sub(lambda m: "\\sqrt" + _braced(m.group(1)), answer)
    answer = _UNICODE_SPACED_NUMBER.sub(lambda m: re.sub(r"\D", "", m.group(0)), answer)
    return answer.replace(" ", "") if _SPACED_NUMBER.fullmatch(answer) else answer


def _base_number_value(answer: str) -> int | None:
    """The value of an answer written as a number in a base (`52_8`, `4210_{5}`), else None: math-verify
    drops the subscript, so `52_9` would equal `52_8`."""
    match = _BASE_NUMBER.fullmatch(answer.strip().strip("$").strip())
    if match is None:
        return None
    base = int(match.group(2) or match.group(3))
    try:
        return int(match.group(1), base) if 2 <= base <= 36 else None
    except ValueError:
        return None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# a number, then a unit in words: math-verify read `18 dollars` as 18*d*o*l*l*a*r*s (`18 meters` as 18)
_NUMBER_WITH_UNIT = re.compile(
    r"\\?\$?\s*(" + _NUMBER.pattern + r")(?:\s+|\\ |~)(?:\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}|[A-Za-z]{2,}(?: [A-Za-z]{2,})*)"
    r"(?:\^\{?[23]\}?)?")  # a square or cubic unit: `18~\text{cm}^2`


_TEXT_WRAPPED = re.compile(r"\\(?:text|mbox|mathrm)\{(.*)\}")
# a first word after a number that changes its value rather than names its unit: `2 pi`, `18 thousand`, `18 squared`,
# `18 or more` are not 2 or 18 (`50 meters squared`, `18 dozen eggs` keep their unit dropped)
_NOT_UNITS = frozenset({"pi", "hundred", "thousand", "million", "billion", "trillion", "squared", "cubed", "or", "plus",
                        "minus", "over"})


def _unit_dropped(predicted: str, gold: str) -> str:
    """`predicted` without a trailing unit in words where `gold` is a plain number: `18 dollars`, `18
    \\text{ eggs}` -> `18` against 18 (a GSM8K answer a small model boxes with its unit). Anything else, as it is."""
    if _NUMBER.fullmatch(gold.strip().strip("$").strip()) is None:
        return predicted
    text = predicted.strip()
    wrapped = _TEXT_WRAPPED.fullmatch(text)  # `\text{18 dollars}` whole
    match = _NUMBER_WITH_UNIT.fullmatch(wrapped.group(1).strip() if wrapped else text)
    if match is None:
        return predicted
    unit = [w for w in re.findall(r"[A-Za-z]+", match.group(0)[match.end(1):]) if w not in ("text", "mbox", "mathrm")]
    if unit and unit[0].lower() in _NOT_UNITS:
        return predicted
    return match.group(1)


def verify_answer(predicted: str, gold: str) -> bool:
    """True when the boxed answer `predicted` is mathematically equivalent to `gold` (math-verify), both
    tidied first (`tidy_answer`); two numbers written in bases (`52_8`, `101010_2`) compare by value."""
    parse, verify = _math_verify()
    gold, predicted = tidy_answer(gold), tidy_answer(predicted)
    predicted = _unit_dropped(predicted, gold)
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} does not parse with math-verify")
    gold_value, predicted_value = _base_number_value(gold), _base_number_value(predicted)
    if gold_value is not None and predicted_value is not None:
        return gold_value == predicted_value
    predicted_parsed = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=None))


_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits: `\d` took ١٦ (Arabic-Indic) as 16


def _integer_key(text: str) -> tuple[bool, str]:
    """An integer string's (negative, digits without leading zeros): its value without int(), which refuses
    strings past 4,300 digits (a degenerate response of repeated digits raised out of the reward)."""
    digits = text.lstrip("+-").lstrip("0") or "0"
    return text.startswith("-") and digits != "0", digits


def exact_match(predicted: str, gold: str) -> bool:
    """Equal after stripping surrounding whitespace; two integers compare by value (`007` == `7`, `-0` == `0`)."""
    predicted, gold = predicted.strip(), gold.strip()
    if _INTEGER.fullmatch(predicted) and _INTEGER.fullmatch(gold):
        return _integer_key(predicted) == _integer_key(gold)
    return predicted == gold


def _shortened(text: str, keep: int = 200) -> str:
    """A model's answer for a log line: a degenerate one may be thousands of characters."""
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text):,} characters)"


def _boxed_answers(responses: list[str]) -> list[str | None]:
    """The stripped last-box content per response; None when absent, unclosed or empty."""
    answers = []
    for response in responses:
        boxed = extract_boxed(response)
        answers.append(boxed.strip() if boxed is not None and boxed.strip() else None)
    return answers


@register_reward("exact")
class ExactReward(Reward):
    """In-process exact match of the boxed answer, for synthetic tasks with integer/string answers."""

    def score(self, responses: list[str], golds: list[str]) -> RewardResult:
        answers = _boxed_answers(responses)
        scores = [float(a is not None and exact_match(a, g)) for a, g in zip(answers, golds)]
        return RewardResult(scores, {"no_answer": float(answers.count(None))})


@register_reward("math_verify")
class MathVerifyReward(Reward):
    """Boxed answer vs gold with math-verify, in a watchdogged worker process (see module docstring)."""

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        check_fn: str = DEFAULT_CHECK_FN,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if timeout_s <= 0 or startup_timeout_s <= 0:
            raise ValueError(
                f"timeout_s and startup_timeout_s must be positive, got {timeout_s} and {startup_timeout_s}"
            )
        module_name, colon, attribute_path = check_fn.partition(":")
        if not (colon and module_name and attribute_path):
            raise ValueError(f"check_fn must look like 'package.module:function', got {check_fn!r}")
        if check_fn == DEFAULT_CHECK_FN and importlib.util.find_spec("math_verify") is None:
            # named now, before any sampling: the worker would meet it at the first boxed answer
            raise ValueError("reward math_verify needs the math-verify package (pip install math-verify)")
        self.timeout_s = timeout_s
        self.check_fn = check_fn
        self.startup_timeout_s = startup_timeout_s
        self._worker = WatchdogWorker(check_fn, timeout_s=timeout_s, startup_timeout_s=startup_timeout_s,
                                      warmup=("0", "0"), label="math_verify", what="check_fn")

    @property
    def _process(self):
        """The worker process, while one runs (tests kill it)."""
        return self._worker.process

    def score(self, responses: list[str], golds: list[str]) -> RewardResult:
        answers = _boxed_answers(responses)
        items = [(i, (a, g), {}) for i, (a, g) in enumerate(zip(answers, golds)) if a is not None]
        outcomes = self._worker.call_all(items, shown=lambda item: repr(item[1][0][:200])) if items else {}
        scores = [0.0] * len(responses)
        counts = {"no_answer": len(responses) - len(items), "timeouts": 0, "errors": 0}
        for index, (kind, value) in outcomes.items():
            if kind == "ok":
                scores[index] = float(bool(value))
            elif kind == "timeout":
                counts["timeouts"] += 1
            else:
                counts["errors"] += 1
                logger.warning("math_verify check failed on %r: %s", _shortened(answers[index]), value)
        return RewardResult(scores, {name: float(count) for name, count in counts.items()})

    def close(self) -> None:
        self._worker.close()
