"""Advantage estimators with one value per token (docs/objectives.md), which the learner's batch builds from token
inputs (`learner_batch`), where `advantages`' registered estimators give one per response: verl's REINFORCE++ with a KL
in the reward (each token's return) and its optimal token baseline (a baseline per response step)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from kv4rl.algo.advantages import WHITEN_EPS


def reinforce_pp_token_advantages(scores: Tensor, kl: Tensor, mask: Tensor, coef: float,
                                  over_ranks: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """verl's `reinforce_plus_plus` with a KL in the reward (γ = 1): token t's return is its response's score less
    `coef` times the KL estimates of tokens t and after, `G_t = r − coef · Σ_{s≥t} kl_s` (verl's score sits on the
    last token, its `−coef · kl_s` on each), whitened over every `mask`ed token of the batch: `(G_t − μ) /
    sqrt(σ² + 1e-8)`, σ² the unbiased variance, 0 off the mask. `over_ranks` sums a tensor over the ranks of a
    torchrun job (default: one process holds the batch). Every return equal: exactly 0. [B, T] float64."""
    valid = mask.bool()
    total = over_ranks or (lambda x: x)
    tail = torch.where(valid, kl.double(), 0).flip(-1).cumsum(-1).flip(-1)
    returns = torch.where(valid, scores.double().to(kl.device)[:, None] - coef * tail, 0)
    tokens, summed = total(torch.stack([valid.sum().double(), returns.sum()])).tolist()
    if tokens < 2:
        raise ValueError(f"REINFORCE++ whitens over the batch's response tokens: it needs at least 2, got {tokens:g}")
    mean = summed / tokens
    squares = float(total(torch.where(valid, (returns - mean) ** 2, 0).sum().reshape(1)))
    if squares == 0:
        return torch.zeros_like(returns)
    return torch.where(valid, (returns - mean) / math.sqrt(squares / (tokens - 1) + WHITEN_EPS), 0)


OTB_EPS = 1e-8  # verl's epsilon in the baseline's denominator


def optimal_token_baseline(scores: Tensor, logprobs: Tensor, sum_pi_sq: Tensor, mask: Tensor,
                           group_size: int) -> Tensor:
    """verl's optimal token baseline (`optimal_token_baseline`, without its IS weighting and zero-tail options):
    response-aligned `[B, T]` inputs (π_old's log-prob of each sampled token, Σ_v π_old(v)², the valid tokens),
    groups contiguous. Each token's return is its response's score; the baseline at step t is the group's returns
    weighed by W_t = Σ_{j<=t} (1 − 2π_j + Σπ²_j), the path's accumulated variance proxy, over the responses still
    running at t; A_t = (G_t − B_t) on valid tokens. A group of one keeps its score (no baseline). Float64."""
    valid = mask.double()
    returns = scores.double()[:, None] * valid
    w = (1.0 - 2.0 * torch.exp(logprobs.double()) + sum_pi_sq.double()) * valid
    cumulative = w.cumsum(-1)
    rows, width = valid.shape
    g, wc, m = (x.reshape(rows // group_size, group_size, width) for x in (returns, cumulative, valid))
    baseline = (g * wc * m).sum(1, keepdim=True) / ((wc * m).sum(1, keepdim=True) + OTB_EPS)
    if group_size == 1:
        baseline = torch.zeros_like(baseline)
    return ((g - baseline) * m).reshape(rows, width)
