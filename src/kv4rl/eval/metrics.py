"""Evaluation metrics over repeated samples: unbiased pass@k and mean@k (avg@k).

pass@k uses the unbiased estimator 1 − C(n−c, k)/C(n, k) from n ≥ k samples of which c are correct,
evaluated in exact integers (Python's binomials do not overflow; n = 1024 takes ~25 us) and rounded to
a float once, so pass@1 is exactly the mean accuracy c/n.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import comb

__all__ = ["mean_at_k", "pass_at_k", "summarize"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if n < 0 or c < 0 or k < 1:
        raise ValueError(f"pass_at_k needs n >= 0, c >= 0 and k >= 1, got n={n}, c={c}, k={k}")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} correct samples is more than n={n} samples")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} is more than the n={n} samples drawn")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    # 1 - C(n-c, k) / C(n, k) in exact integers, then rounded once: pass@1 is then exactly c/n, the mean
    # accuracy (the Codex product form 1 - Π(1 - k/i) lost the last bit: 0.33333333333333326 for 1 of 3)
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


def mean_at_k(correct: Sequence[Sequence[bool | float]]) -> float:
    """Mean accuracy (or mean score) over all samples of all problems.

    Each problem's samples are averaged first and problems are then averaged, so every problem weighs
    the same; with the usual equal sample count per problem this is the plain mean over all samples.
    """
    if not correct:
        raise ValueError("mean_at_k needs at least one problem")
    per_problem = []
    for index, samples in enumerate(correct):
        if not samples:
            raise ValueError(f"mean_at_k: problem {index} has no samples")
        per_problem.append(sum(float(s) for s in samples) / len(samples))
    return sum(per_problem) / len(per_problem)


def summarize(correct_per_problem: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, float]:
    """`{"mean@n": ..., "pass@k": ...}` averaged over problems, for each k in `ks` with k <= n.

    Every problem must have the same number n of samples; each sample is a bool (or 0/1).
    """
    if not correct_per_problem:
        raise ValueError("summarize needs at least one problem")
    num_samples = {len(samples) for samples in correct_per_problem}
    if len(num_samples) != 1:
        raise ValueError(f"summarize needs the same number of samples per problem, got {sorted(num_samples)}")
    n = num_samples.pop()
    if n == 0:
        raise ValueError("summarize: problems have no samples")
    num_correct = []
    for index, samples in enumerate(correct_per_problem):
        if any(s not in (0, 1) for s in samples):
            raise ValueError(f"summarize: problem {index} has a sample that is not a bool or 0/1")
        num_correct.append(sum(1 for s in samples if s))
    summary = {f"mean@{n}": mean_at_k(correct_per_problem)}
    for k in sorted(set(ks)):
        if 1 <= k <= n:
            summary[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in num_correct) / len(num_correct)
        elif k < 1:
            raise ValueError(f"summarize: k must be >= 1, got {k}")
    return summary
