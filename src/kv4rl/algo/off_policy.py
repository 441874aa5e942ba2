"""Corrections for the gap between the engine that sampled a batch (μ) and the learner (docs/objectives.md,
"Behaviour importance weights" and "Off-policy sequence mask"): both read the engine's log-probs beside the
learner's, and neither carries a gradient. `ppo_clip` applies them to its per-token surrogate."""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

from kv4rl.algo.logprobs import LOG_RATIO_LIMIT

BehaviorIS = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "sequence_geo_truncate",
                     "sequence_geo_mask"]
BEHAVIOR_IS_MODES: tuple[str, ...] = get_args(BehaviorIS)


def behavior_importance_weights(old_logprobs: Tensor, behavior_logprobs: Tensor, valid: Tensor, mode: str,
                                low: float | None, high: float | None) -> tuple[Tensor, Tensor]:
    """(w [B, T], cut [B, T] bool), no gradient: π_old/μ per token (`token_*`), or per response from the sum of
    its tokens' log-ratios (`sequence_*`: their product) or their mean (`sequence_geo_*`: the geometric mean, AReaL's
    sequence level), then clamped to [low, high] (`*_truncate`) or set to 0 outside it
    (`*_mask`); a null bound is no bound. `cut` marks the tokens whose weight was outside. The log-ratio is held
    at ±80 (e^88.7 overflows float32): a weight is at most e^80, never inf, and a masked mode with an upper bound
    drops a response that far off."""
    log_w = torch.where(valid, old_logprobs.detach().double() - behavior_logprobs.detach().double(), 0)
    if mode.startswith("sequence"):
        total = log_w.sum(-1, keepdim=True)
        if mode.startswith("sequence_geo"):
            total = total / valid.sum(-1, keepdim=True).clamp(min=1)
        log_w = torch.where(valid, total.expand_as(log_w), 0)
    w = torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    lo = torch.full_like(w, -math.inf if low is None else low)
    hi = torch.full_like(w, math.inf if high is None else high)
    cut = valid & ((w < lo) | (w > hi))
    w = torch.minimum(torch.maximum(w, lo), hi) if mode.endswith("truncate") else torch.where(cut, 0.0, w)
    return torch.where(valid, w, 0.0), cut


def weight_sums(weights: Tensor, valid: Tensor, mode: str) -> tuple[float, float]:
    """(sum, count) of a batch's behaviour weights whose ratio is their mean (`algo.behavior_is_normalize`, verl's
    rollout_is_batch_normalize): over the valid tokens for a `token_*` mode, over the responses (one weight each)
    for a `sequence_*` mode, as verl averages its token and sequence weights. Sums, so that ranks can add theirs."""
    if mode.startswith("token"):
        return float(weights.sum()), float(valid.sum())
    rows = valid.any(-1)
    per_row = weights.sum(-1) / valid.sum(-1).clamp(min=1)
    return float(per_row[rows].sum()), float(rows.sum())


def off_policy_keep(logprobs: Tensor, behavior_logprobs: Tensor, adv: Tensor, valid: Tensor,
                    threshold: float) -> Tensor:
    """[B, T] bool, no gradient: DeepSeek-V3.2's off-policy sequence mask. A response is kept unless its advantage is
    negative and the mean over its tokens of log μ − log π_θ (the engine's log-prob less the current policy's, a
    forward-KL estimate) is above `threshold`: a response the policy has moved far from is not pushed down further."""
    gap = torch.where(valid, behavior_logprobs.detach().double() - logprobs.detach().double(), 0)
    mean_gap = gap.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
    return ((adv >= 0) | (mean_gap <= threshold)) & valid
