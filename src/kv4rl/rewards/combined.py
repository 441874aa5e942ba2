"""Several rewards as one: the verifier (`reward.name`) plus `reward.extra`, each times its `reward.weights` entry.

TRL's `reward_funcs` / `reward_weights`, with one difference that keeps the run's numbers honest: the first
reward is the verifier, so `accuracy` and the periodic evaluation read its own score, not the weighted sum (a
format bonus of 0.6 would otherwise count every well-formatted wrong answer as correct). The sum trains;
each reward's own mean is logged as `rewards/<name>/mean`, as TRL logs it, and an extra reward's stats as
`reward_<name>_<stat>` beside the verifier's `reward_<stat>`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kv4rl.rewards.base import CheckedReward, Reward, RewardFn, RewardResult, call_reward, extract_boxed, register_reward
from kv4rl.rewards.gdpo import normalize_then_sum

__all__ = ["BoxedFormatReward", "WeightedRewards", "overlong_penalties", "reward_metrics", "score_responses",
           "summed_reward_stats", "verifier_name", "with_overlong_penalty"]


class WeightedRewards(Reward):
    """`Σ_k w_k r_k` per response over `parts` = [(name, reward, weight)], the first the verifier."""

    def __init__(self, parts: Sequence[tuple[str, RewardFn, float]]):
        if not parts:
            raise ValueError("WeightedRewards needs at least one reward")
        names = [name for name, _, _ in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"each reward may be named once, got {names}")
        self.parts = list(parts)

    @property
    def verifier(self) -> RewardFn:
        """The first reward: its score says whether a response is correct (accuracy, evaluation)."""
        return self.parts[0][1]

    @property
    def verifier_name(self) -> str:
        return self.parts[0][0]

    takes_problems = True  # handed on to each part that takes them

    def score(self, responses: list[str], golds: list[str], problems: list | None = None) -> RewardResult:
        names, weights = [name for name, _, _ in self.parts], [weight for _, _, weight in self.parts]
        totals = [0.0] * len(responses)
        stats: dict[str, float] = {}
        components: dict[str, list[float]] = {}
        for k, (name, reward, weight) in enumerate(self.parts):
            result = call_reward(reward, responses, golds, problems)
            scores = [float(x) for x in result.scores]
            components[name] = scores
            totals = [t + weight * x for t, x in zip(totals, scores, strict=True)]
            prefix = "" if k == 0 else f"{name}_"  # the verifier's counts keep their names (reward_no_answer)
            stats.update({f"{prefix}{key}": value for key, value in result.stats.items()})
        for i, total in enumerate(totals):  # each score is finite (checked), their weighted sum need not be
            if not math.isfinite(total):
                raise ValueError(f"the weighted sum of rewards {names} with reward.weights {weights} is {total} for "
                                 f"response {i} of {len(totals)}; it must be a finite number (smaller weights?)")
        return RewardResult(totals, stats, components)

    def close(self) -> None:
        """Close every part, even when one fails (its error is raised after the others are closed)."""
        failure: BaseException | None = None
        for _, reward, _ in self.parts:
            close = getattr(reward, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - the first failure is raised once all are closed
                failure = failure or exc
        if failure is not None:
            raise failure


@register_reward("boxed_format")
class BoxedFormatReward(Reward):
    """1.0 for a response that ends its answer in a closed `\\boxed{...}` (whatever it holds), else 0.0: the
    format part of a verifier + format pair (`reward.extra=[boxed_format]`)."""

    def score(self, responses: list[str], golds: list[str]) -> RewardResult:
        return RewardResult([1.0 if extract_boxed(text) is not None else 0.0 for text in responses])


def verifier_name(reward: RewardFn) -> str | None:
    """The name of the reward whose own score says whether a response is correct (None: not known)."""
    if isinstance(reward, WeightedRewards):
        return reward.verifier_name
    return reward.name if isinstance(reward, CheckedReward) else None


def overlong_penalties(lengths: Sequence[int], max_new_tokens: int, buffer: int, factor: float) -> list[float]:
    """DAPO's overlong reward shaping: 0 up to `max_new_tokens - buffer` tokens, then falling linearly to
    `-factor` at `max_new_tokens` (and no lower: a response carried from before a resume that lowered the cap
    may be longer)."""
    expected = max_new_tokens - buffer
    return [max(-factor, min(0.0, -(n - expected) / buffer * factor)) for n in lengths]


def _components(result: RewardResult, verifier: str | None) -> dict[str, list[float]]:
    """`result`'s components, or the verifier's own scores as its one component, before a change to the scores
    (`accuracy` reads the verifier's)."""
    if result.components:
        return dict(result.components)
    return {verifier: [float(x) for x in result.scores]} if verifier is not None else {}


def with_overlong_penalty(result: RewardResult, lengths: Sequence[int], verifier: str | None, max_new_tokens: int,
                          buffer: int, factor: float) -> RewardResult:
    """`result` with `overlong_penalties` added to its scores, and logged as the component `overlong` beside the
    reward's own (the verifier's score, which `accuracy` reads, is kept apart from the penalty)."""
    penalties = overlong_penalties(lengths, max_new_tokens, buffer, factor)
    components = _components(result, verifier)
    components["overlong"] = penalties
    return RewardResult([float(x) + p for x, p in zip(result.scores, penalties, strict=True)], result.stats,
                        components)


def score_responses(reward: RewardFn, texts: list[str], golds: list[str], lengths: Sequence[int], cfg,
                    max_new_tokens: int, problems: list | None = None,
                    group_sizes: Sequence[int] | None = None) -> RewardResult:
    """The run's scores of decoded responses (`lengths`: their token counts; `problems`: each one's problem, for a
    reward that takes them): `reward`'s, plus the overlong penalty, then AReaL's scaling, where `cfg` (the run's
    `reward` section) asks; with `cfg.aggregation=normalize_then_sum`, GDPO's sum of each reward normalised within
    its group (`group_sizes`: the responses' groups, contiguous)."""
    result = call_reward(reward, texts, golds, problems)
    if cfg.aggregation == "normalize_then_sum":
        return _normalized_then_summed(reward, result, lengths, cfg, max_new_tokens, group_sizes)
    if cfg.overlong_buffer:
        result = with_overlong_penalty(result, lengths, verifier_name(reward), max_new_tokens, cfg.overlong_buffer,
                                       cfg.overlong_penalty)
    if cfg.bias != 0 or cfg.scale != 1 or cfg.clip is not None:
        result = rescaled(result, verifier_name(reward), cfg.bias, cfg.scale, cfg.clip)
    return result


def _normalized_then_summed(reward: RewardFn, result: RewardResult, lengths: Sequence[int], cfg, max_new_tokens: int,
                            group_sizes: Sequence[int] | None) -> RewardResult:
    """GDPO's trained scores (`rewards.gdpo`): each reward's own scores times its `reward.weights` entry, and DAPO's
    penalty as a reward of its own in [−1, 0] weighted by `reward.overlong_penalty` (a factor the normalisation
    would otherwise undo; TRL's soft overlong punishment with its `reward_weights` entry). The components are logged
    as `score_responses` logs them, the plain weighted sum as `summed`."""
    if group_sizes is None:
        raise ValueError("reward.aggregation=normalize_then_sum normalises within groups: pass group_sizes")
    if isinstance(reward, WeightedRewards):
        parts = [(weight, result.components[name]) for name, _, weight in reward.parts]
    else:
        parts = [(1.0, [float(x) for x in result.scores])]
    components = _components(result, verifier_name(reward))
    summed = [float(x) for x in result.scores]
    if cfg.overlong_buffer:
        unit = overlong_penalties(lengths, max_new_tokens, cfg.overlong_buffer, 1.0)
        parts.append((cfg.overlong_penalty, unit))
        components["overlong"] = [cfg.overlong_penalty * p for p in unit]
        summed = [x + p for x, p in zip(summed, components["overlong"], strict=True)]
    return RewardResult(normalize_then_sum(parts, group_sizes), result.stats, components, summed)


def rescaled(result: RewardResult, verifier: str | None, bias: float, scale: float, clip: float | None) -> RewardResult:
    """AReaL's reward scaling: each trained score becomes `(r + bias) · scale`, clipped to [−clip, clip] (after the
    overlong penalty, as AReaL scales after it). The verifier's own score stays a component, which `accuracy`
    reads; the components are logged as they were scored."""
    components = _components(result, verifier)
    out = [(float(x) + bias) * scale for x in result.scores]
    if clip is not None:
        out = [min(max(x, -clip), clip) for x in out]
    return RewardResult(out, result.stats, components)


def reward_metrics(result: RewardResult, verifier_name: str | None = None) -> dict[str, float]:
    """`reward_mean` (of the trained scores), `accuracy` (the verifier's score > 0.5, where the scores are a
    weighted sum; else the scores') and, for combined rewards, each reward's mean as `rewards/<name>/mean`."""
    scores = torch.tensor(result.scores, dtype=torch.float64)  # float32 rounds 3e7 + 1
    verified = result.components.get(verifier_name) if verifier_name is not None else None
    verified = scores if verified is None else torch.tensor(verified, dtype=torch.float64)
    out = {"reward_mean": float(scores.mean()), "accuracy": float((verified > 0.5).float().mean())}
    out.update(summed_reward_stats(result))
    if len(result.components) > 1:
        out.update({f"rewards/{name}/mean": float(torch.tensor(values, dtype=torch.float64).mean())
                    for name, values in result.components.items()})
    return out


def summed_reward_stats(result: RewardResult) -> dict[str, float]:
    """Under GDPO's aggregation, `reward_mean` and `reward_std` (population) of the plain weighted sum, as TRL logs
    them: the trained scores average 0 in every group. Empty otherwise (the estimator's own stand)."""
    if result.summed is None:
        return {}
    summed = torch.tensor(result.summed, dtype=torch.float64)
    return {"reward_mean": float(summed.mean()), "reward_std": float(summed.std(correction=0))}
