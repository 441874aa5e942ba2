"""Reward functions: one batch signature, a name registry, and final-answer extraction.

A reward scores a whole batch at once (responses with their gold answers) so that a verifier can
amortise a worker round-trip over hundreds of responses, and it returns diagnostic counts
(`timeouts`, `errors`, `no_answer`) next to the scores so the training loop can log them.
Registry entries are factories rather than functions: a verifier that owns a worker process is
created with its options (`get_reward("math_verify", timeout_s=2)`) and released with `close()`
or a `with` block.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

__all__ = [
    "Reward",
    "RewardFn",
    "RewardResult",
    "call_reward",
    "extract_boxed",
    "get_reward",
    "register_reward",
    "registered_rewards",
]


@dataclass
class RewardResult:
    """Per-response scores plus batch-level diagnostic counts; a combined reward (`rewards.combined`) also gives
    each of its rewards' own scores, by name. `summed`: under GDPO's aggregation (`rewards.gdpo`), whose trained
    scores are normalised within each group (mean 0), the plain weighted sum, which `reward_mean` reports."""

    scores: list[float]
    stats: dict[str, float] = field(default_factory=dict)
    components: dict[str, list[float]] = field(default_factory=dict)
    summed: list[float] | None = None

    def rows(self, start: int, stop: int) -> RewardResult:
        """Responses [start, stop): their scores, components and sums (the counts stay the whole batch's)."""
        return RewardResult(self.scores[start:stop], {},
                            {name: values[start:stop] for name, values in self.components.items()},
                            None if self.summed is None else self.summed[start:stop])

    @staticmethod
    def joined(parts: list[RewardResult]) -> RewardResult:
        """`parts` one after another, their counts added up (`summed` only where every part has it)."""
        stats: dict[str, float] = {}
        for part in parts:
            for key, value in part.stats.items():
                stats[key] = stats.get(key, 0.0) + float(value)
        names = parts[0].components.keys() if parts else ()
        summed = None if not parts or any(p.summed is None for p in parts) else [x for p in parts for x in p.summed]
        return RewardResult([x for p in parts for x in p.scores], stats,
                            {name: [x for p in parts for x in p.components[name]] for name in names}, summed)


RewardFn = Callable[[list[str], list[str]], RewardResult]
RewardFactory = Callable[..., RewardFn]

_REGISTRY: dict[str, RewardFactory] = {}


class Reward:
    """Base for reward objects: batch call, `close()`, and use as a context manager.

    Subclasses implement `score`; `__call__` checks that responses and golds pair up. A subclass with
    `takes_problems = True` also gets `problems`, each response's `Problem` (its `meta` holds the data file's
    other fields, e.g. verl's `data_source` and `extra_info`), or None where its caller has none.
    """

    takes_problems = False

    def __call__(self, responses: list[str], golds: list[str], problems: list | None = None) -> RewardResult:
        if len(responses) != len(golds):
            raise ValueError(
                f"reward got {len(responses)} responses but {len(golds)} gold answers; they must pair up"
            )
        if problems is not None and len(problems) != len(responses):
            raise ValueError(f"reward got {len(responses)} responses but {len(problems)} problems; they must pair up")
        if self.takes_problems:
            return self.score(list(responses), list(golds), problems=None if problems is None else list(problems))
        return self.score(list(responses), list(golds))

    def score(self, responses: list[str], golds: list[str]) -> RewardResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release owned resources (worker processes); a no-op for in-process rewards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def call_reward(reward: RewardFn, responses: list[str], golds: list[str], problems: list | None = None) -> RewardResult:
    """`reward(responses, golds)`, with each response's problem where the reward takes them (`Reward.takes_problems`;
    a plain function reward does not)."""
    if problems is not None and getattr(reward, "takes_problems", False):
        return reward(responses, golds, problems=problems)
    return reward(responses, golds)


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Register a factory `(**options) -> RewardFn` under `name` (a class works as its own factory)."""

    def decorator(factory: RewardFactory) -> RewardFactory:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str, **options: Any) -> RewardFn:
    """Build the reward registered as `name`, passing `options` (e.g. `timeout_s`) to its factory."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; known rewards: {', '.join(registered_rewards())}")
    factory = _REGISTRY[name]
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        raise ValueError(f"bad options {sorted(options)} for reward {name!r}: {exc}") from None
    try:
        built = factory(**options)
    except Exception as exc:  # a plug-in's own failure: one line naming it, not a bare traceback
        raise RewardFailed(f"reward {name!r} could not be built: {type(exc).__name__}: {exc}") from exc
    if not callable(built):  # it failed only after the first rollout, "'int' object is not callable"
        raise ValueError(f"reward {name!r}: its factory returned {type(built).__name__}, not a callable reward "
                         f"(responses, golds) -> RewardResult")
    return CheckedReward(name, built)


class RewardFailed(ValueError):
    """A reward's own code raised: said in one line naming the reward (KV4RL_TRACEBACK=1, or train's -v, shows the
    traceback)."""

    show_traceback = True


def _score_problem(value: Any) -> str | None:
    """Why `value` is no score (None when it is one): a real number (Python, NumPy or a one-element tensor)
    that is finite. A bool is refused by name: `pred == gold` scores are meant as 1.0 / 0.0, say so."""
    if type(value).__name__ in ("bool", "bool_"):  # Python's and NumPy's
        return "a bool, not a score (write float(...) for 1.0 / 0.0)"
    if isinstance(value, (str, bytes)):
        return f"a score must be a finite number, not {type(value).__name__}"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"a score must be a finite number, not {type(value).__name__}"
    except OverflowError:
        return "a score must be a finite number; this one overflows a float"
    if not math.isfinite(number):
        return "a score must be a finite number"
    if abs(number) > MAX_SCORE:  # finite, but its square overflows float32: the group's std, advantages and loss NaN
        return f"a score must be within ±{MAX_SCORE:g}"
    return None


MAX_SCORE = 1e15


_LOGGED_REWARD_STATS = frozenset({"mean", "std"})


def _is_number(value: Any) -> bool:
    """A real number a log row can hold (Python, NumPy or a one-element tensor; NaN and inf log as null)."""
    if isinstance(value, (str, bytes)) or type(value).__name__ in ("bool", "bool_"):
        return False
    try:
        float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


class CheckedReward(Reward):
    """What `get_reward` returns: the built reward, whose results must give one finite score per response. A
    NaN score made every advantage, loss and gradient of its batch NaN, and an infinite one zeroed them (the
    group's rewards all compare equal), so a broken reward plugin trained nothing with no error saying why."""

    takes_problems = True  # handed on to the built reward where it takes them

    def __init__(self, name: str, reward: RewardFn):
        self.name = name
        self.reward = reward

    def score(self, responses: list[str], golds: list[str], problems: list | None = None) -> RewardResult:
        try:
            result = call_reward(self.reward, responses, golds, problems)
        except Exception as exc:  # a ValueError read as a config error, any other a long traceback: neither named it
            raise RewardFailed(f"reward {self.name!r} raised {type(exc).__name__} scoring {len(responses)} responses: "
                               f"{exc} (KV4RL_TRACEBACK=1, or train's -v, shows the traceback)") from exc
        if not hasattr(result, "scores"):  # a plain list failed later as "'list' object has no attribute 'scores'"
            raise ValueError(f"reward {self.name!r} returned {type(result).__name__}; it must return a "
                             f"RewardResult(scores=[one per response], stats={{name: count}})")
        scores = list(result.scores)  # once: a generator would be used up by this check
        stats = dict(getattr(result, "stats", None) or {})
        for key, value in stats.items():
            if key in _LOGGED_REWARD_STATS:  # logged as reward_<key> beside the run's own reward_mean, reward_std
                raise ValueError(f"reward {self.name!r} returned a stat {key!r}, which the run logs itself as "
                                 f"reward_{key}; rename it")
            if not _is_number(value):  # a string failed the row's float() naming neither the reward nor the key
                raise ValueError(f"reward {self.name!r} returned stat {key!r} = {value!r}; a stat must be a number")
        result = RewardResult(scores, stats)
        if len(scores) != len(responses):
            raise ValueError(f"reward {self.name!r} returned {len(scores)} scores for {len(responses)} responses")
        for i, value in enumerate(scores):
            problem = _score_problem(value)
            if problem is not None:
                raise ValueError(f"reward {self.name!r} returned {value!r} for response {i} of {len(responses)}: "
                                 f"{problem}")
        return result

    def close(self) -> None:
        close = getattr(self.reward, "close", None)
        if close is not None:
            close()

    def __getattr__(self, attr: str) -> Any:  # the built reward's own attributes (a worker's process, ...)
        if attr == "reward":
            raise AttributeError(attr)
        return getattr(self.reward, attr)


# `\boxed{...}`; or `\boxed` and the one token after it, as TeX reads an argument without braces, where that token is
# an answer: one digit not followed by another (`\boxed 5.`; `\boxed 18` would box the 1, so it is no answer, group
# 3), a command without arguments (`\boxed\pi`, not `\boxed\frac{1}{2}`) or a letter that starts no word (`\boxed
# x`, not `\boxed as asked`). `\boxedx` is another command; `\framebox`'s optional [width][position] are skipped.
_BOX_OPENING = re.compile(r"\\(?:boxed|fbox|framebox)(?![a-zA-Z])(?:\s*\[[^\]]*\]){0,2}\s*"
                          r"(?:(\{)|(\d(?!\d|[.,]\d)|\\[a-zA-Z]+(?![a-zA-Z])(?!\s*\{)|[a-zA-Z](?![a-zA-Z]))|(\d))")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\framebox{...}`), or None if there is none or it
    is unclosed; a box without braces holds the one token after it, as in TeX, where that token is an answer.

    Braces nest; backslash escapes such as `\\{`, `\\}` and `\\\\` are skipped when counting, so
    `\\boxed{\\{1, 2\\}}` gives `\\{1, 2\\}`. An unclosed last box (a truncated response) gives None
    rather than an earlier box, since the earlier one was not the final answer.
    """
    openings = list(_BOX_OPENING.finditer(text))
    if not openings:
        return None
    if openings[-1].group(3) is not None:  # `\boxed 18`: TeX boxes the 1; no answer, and not an earlier box
        return None
    if openings[-1].group(1) is None:
        return openings[-1].group(2)
    start = openings[-1].end()
    depth = 1
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None
