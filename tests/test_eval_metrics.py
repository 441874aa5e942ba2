"""pass@k against brute-force enumeration of k-subsets; mean@k and summarize on hand-worked examples."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from kv4rl.eval.metrics import mean_at_k, pass_at_k, summarize


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct sample."""
    labels = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(labels, k))
    return Fraction(sum(any(subset) for subset in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == float(brute_force_pass_at_k(n, c, k))  # one rounding: exact


def test_pass_at_k_is_stable_for_large_n():
    n, c, k = 2048, 5, 300  # C(2048, 300) is far beyond float range
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == float(exact)


def test_pass_at_k_edge_cases():
    assert pass_at_k(16, 0, 4) == 0.0
    assert pass_at_k(16, 16, 4) == 1.0
    assert pass_at_k(16, 1, 16) == 1.0  # k = n: the single correct sample is always drawn
    assert pass_at_k(16, 0, 16) == 0.0
    assert pass_at_k(16, 4, 1) == 0.25
    assert all(pass_at_k(n, c, 1) == c / n for n in range(1, 40) for c in range(n + 1))  # pass@1 is mean@n


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (4, 1, 5, "more than the n=4"),
        (4, 5, 2, "c=5"),
        (-1, 0, 1, "n >= 0"),
        (4, -1, 1, "c >= 0"),
        (4, 1, -2, "k >= 1"),
        (4, 1, 0, "k >= 1"),
    ],
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_mean_at_k():
    assert mean_at_k([[True, False, True, True], [False, False, False, False]]) == pytest.approx(0.375)
    assert mean_at_k([[0.5, 1.0], [0.0, 0.25]]) == pytest.approx(0.4375)
    # Problems weigh equally even with unequal sample counts: (1 + 1/4) / 2.
    assert mean_at_k([[1], [0, 0, 0, 1]]) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="at least one problem"):
        mean_at_k([])
    with pytest.raises(ValueError, match="problem 1 has no samples"):
        mean_at_k([[1], []])


def test_summarize_hand_worked():
    correct = [[True, False, False, False], [True, True, False, False]]
    summary = summarize(correct, ks=[1, 2, 4, 8])
    # pass@2: problem 0 gives 1 - C(3,2)/C(4,2) = 1/2, problem 1 gives 1 - C(2,2)/C(4,2) = 5/6.
    assert summary == pytest.approx(
        {"mean@4": 3 / 8, "pass@1": 3 / 8, "pass@2": (1 / 2 + 5 / 6) / 2, "pass@4": 1.0}
    )


def test_summarize_rejects_bad_input():
    with pytest.raises(ValueError, match="same number of samples"):
        summarize([[True], [True, False]], ks=[1])
    with pytest.raises(ValueError, match="not a bool or 0/1"):
        summarize([[True, 0.5]], ks=[1])
    with pytest.raises(ValueError, match="k must be >= 1"):
        summarize([[True, False]], ks=[0])
    with pytest.raises(ValueError, match="at least one problem"):
        summarize([], ks=[1])
