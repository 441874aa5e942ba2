"""TRL's `multi_objective_aggregation: normalize_then_sum` (GDPO, arXiv 2601.05242), `reward.aggregation` here.

Summing rewards before GRPO's group normalisation lets the reward with the widest spread set the advantage: a
0/1 verifier beside a format bonus, or beside DAPO's overlong penalty, collapses distinct reward combinations
onto one sum. GDPO normalises each reward within its group first, then takes the weighted sum; the run's
estimator then turns the sum into advantages (TRL divides it by the whole batch's std: `advantage.std_scope=batch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GROUP_STD_EPS", "normalize_then_sum"]

GROUP_STD_EPS = 1e-4  # TRL's: (r - mean) / (std + 1e-4)
# a group's normalised sum spread by at most this x Σ|w| is flat (each normalised reward spreads O(1) or exactly 0)
FLAT_TOLERANCE = 1e-9


def normalize_then_sum(parts: Sequence[tuple[float, Sequence[float]]], group_sizes: Sequence[int]) -> list[float]:
    """`Σ_k w_k (r_k − mean_g r_k) / (std_g r_k + 1e-4)` for each response, over `parts` = [(w_k, r_k)] (each r_k one
    score per response, groups contiguous with `group_sizes`). std is the unbiased one, as TRL's `nanstd`. A reward
    that is flat within a group (every response equal, a group of one included) adds exactly 0 there, and a group
    whose sum comes out flat (rewards that cancel) is exactly 0: TRL's float rounding leaves ~1e-16, never a signal,
    which would keep the group from `rollout.filter_groups` and `zero_var_group_frac`. Computed in float64."""
    if not parts:
        raise ValueError("normalize_then_sum needs at least one reward")
    flat_tol = FLAT_TOLERANCE * sum(abs(weight) for weight, _ in parts)
    total = sum(group_sizes)
    if any(size < 1 for size in group_sizes):
        raise ValueError(f"every group needs at least one response, got sizes {list(group_sizes)}")
    out = torch.zeros(total, dtype=torch.float64)
    for weight, values in parts:
        scores = torch.tensor([float(x) for x in values], dtype=torch.float64)
        if scores.numel() != total:
            raise ValueError(f"a reward has {scores.numel()} scores for {total} responses")
        start = 0
        for size in group_sizes:
            group = scores[start:start + size]
            if size > 1 and bool(group.amax() != group.amin()):
                out[start:start + size] += weight * (group - group.mean()) / (group.std(correction=1) + GROUP_STD_EPS)
            start += size
    start = 0
    for size in group_sizes:  # rewards that cancel (equal weights, complementary 0/1 scores) sum to a flat group,
        group = out[start:start + size]  # up to rounding: exactly 0, as a flat sum is under `sum`
        if bool(group.amax() - group.amin() <= flat_tol):
            group.zero_()
        start += size
    return out.tolist()
