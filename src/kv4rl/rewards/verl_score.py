"""A verl reward function as a kv4rl reward: verl's `custom_reward_function` is a `compute_score(data_source,
solution_str, ground_truth, extra_info)` called once per response, returning a score or a dict with a `score`.
`VerlScore` calls it as verl's naive reward manager does, with `data_source` and `extra_info` from the row's own
columns (a verl Parquet row keeps them in `Problem.meta`), so a verl user's scorer trains here unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kv4rl.rewards.base import Reward, RewardResult

__all__ = ["VerlScore"]


class VerlScore(Reward):
    """`compute_score` per response: the response's text as `solution_str`, its gold answer as `ground_truth` (the
    text kv4rl read: verl hands a number as a number), the row's `data_source` (None where the file has none) and a
    copy of its `extra_info` ({} where none) with verl's `num_turns` (None: one turn) and `rollout_reward_scores`
    ({}). A dict result gives its `score`; its other keys are not logged."""

    takes_problems = True

    def __init__(self, compute_score: Callable[..., Any]):
        self.compute_score = compute_score

    def score(self, responses: list[str], golds: list[str], problems: list | None = None) -> RewardResult:
        metas = [getattr(p, "meta", None) or {} for p in problems] if problems is not None else [{}] * len(responses)
        scores = []
        for i, (response, gold, meta) in enumerate(zip(responses, golds, metas, strict=True)):
            extra_info = dict(meta.get("extra_info") or {})
            extra_info.update(num_turns=None, rollout_reward_scores={})  # what verl's manager adds, single-turn
            out = self.compute_score(data_source=meta.get("data_source"), solution_str=response, ground_truth=gold,
                                     extra_info=extra_info)
            if isinstance(out, dict):
                if "score" not in out:
                    raise ValueError(f"compute_score returned a dict without 'score' for response {i} of "
                                     f"{len(responses)} (keys {sorted(out)}); verl reads the reward from 'score'")
                out = out["score"]
            scores.append(out)
        return RewardResult(scores)
