"""Rejection of the tokens or responses whose sampling policy μ strayed too far from π_old (verl's `rollout_rs`;
docs/objectives.md, "Rejection of off-policy tokens"): with `algo.old_logprob=recompute`, each token's
log r = log π_old − log μ gives a divergence statistic, per token or over its response, and what falls outside the
bounds leaves the response mask before the update: no loss term, no gradient, and no place in the denominators.
With `behavior` (π_old is μ: verl's bypass mode) `ppo_clip` judges log π_θ − log μ in each pass and drops the
rejected tokens from its surrogate only.

The options and thresholds are written as verl writes them, so a verl config ports unchanged:
`algo.behavior_rs="token_k1,seq_max_k3"` with `algo.behavior_rs_threshold="0.5_2.0,3.0"` (one threshold for
each option, or one for all). The statistics, on log r held to ±20 as verl holds it:
- `k1`: −log r (log μ − log π_old), kept within [log lower, log upper]; a threshold `lower_upper`, or one number
  u for [1/u, u]. As in verl's code the bounds act on −log r, so a pair that is not symmetric keeps
  μ/π_old (not π_old/μ) in [lower, upper].
- `k2`: ½(log r)², `k3`: r − 1 − log r, each kept at or below its one positive threshold.
Per token (`token_k*`), or per response: the sum (`seq_sum_k*`), mean (`seq_mean_k*`) or largest (`seq_max_k2`,
`seq_max_k3`) of its tokens' values, which keeps or rejects every token of the response. A token stays only if
every option keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

REJECTION_OPTIONS: tuple[str, ...] = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOG_RATIO_BOUND = 20.0  # verl's SAFETY_BOUND: log r is held to ±20 before the statistics


@dataclass(frozen=True)
class RejectionRule:
    """One option with its bounds: `k1`'s are on −log r (log lower, log upper); `k2` and `k3` have an upper one."""

    option: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> str:
        return self.option.rsplit("_", 1)[0]  # token, seq_sum, seq_mean, seq_max

    @property
    def estimator(self) -> str:
        return self.option.rsplit("_", 1)[1]


@lru_cache(maxsize=64)  # the loss asks for them in every pass of bypass mode
def rejection_rules(options: str | None, thresholds: str | float | None) -> tuple[RejectionRule, ...]:
    """The rules of `algo.behavior_rs` and `algo.behavior_rs_threshold`, or a ValueError that names the key and the
    entry at fault. No options: no rules (a threshold alone is reported by the settings' unread-key warning)."""
    if options is None:
        return ()
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))  # duplicates once
    if not names:
        raise ValueError(f"algo.behavior_rs: {options!r} names no option (one or more of {', '.join(REJECTION_OPTIONS)}, "
                         "comma-separated; null: no rejection)")
    unknown = [name for name in names if name not in REJECTION_OPTIONS]
    if unknown:
        raise ValueError(f"algo.behavior_rs: unknown option {unknown[0]!r} (known: {', '.join(REJECTION_OPTIONS)})")
    if thresholds is None:
        raise ValueError(f"algo.behavior_rs={options} needs algo.behavior_rs_threshold: one threshold for each option "
                         "or one for all (`lower_upper` ratio bounds or one number u for k1; a positive bound for k2/k3)")
    specs = ([str(thresholds)] if isinstance(thresholds, (int, float)) else
             [part.strip() for part in thresholds.split(",") if part.strip()])
    if len(specs) not in (1, len(names)):
        raise ValueError(f"algo.behavior_rs_threshold: {len(specs)} thresholds for {len(names)} options of "
                         f"algo.behavior_rs ({', '.join(names)}); give one for each, or one for all")
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_rule(name, spec) for name, spec in zip(names, specs))


def _rule(option: str, spec: str) -> RejectionRule:
    where = f"algo.behavior_rs_threshold: {spec!r} for {option}"
    parts = spec.split("_") if option.endswith("k1") else [spec]
    try:
        if any("_" in part for part in parts):  # Python's float() reads 0.5_2 as 0.52
            raise ValueError(spec)
        values = [float(part) for part in parts]
    except ValueError:
        form = "`lower_upper` or one number" if option.endswith("k1") else "one number (k2 and k3 have no lower bound)"
        raise ValueError(f"{where} is not {form}") from None
    if len(values) > 2:
        raise ValueError(f"{where} has {len(values)} bounds; k1 takes `lower_upper` or one number")
    if not all(v > 0 for v in values):  # NaN fails it too; an upper bound may be inf (none)
        raise ValueError(f"{where}: the bounds must be positive numbers")
    if not option.endswith("k1"):
        return RejectionRule(option, upper=values[0])
    lower, upper = values if len(values) == 2 else (1.0 / values[0], values[0])
    if not (lower > 0 and math.isfinite(lower)):
        raise ValueError(f"{where}: the lower bound {lower:g} must be a positive number below inf")
    if not lower < upper:
        raise ValueError(f"{where}: the lower bound {lower:g} must be below the upper {upper:g} (one number u means "
                         "[1/u, u], so it must be above 1); no token would be kept")
    return RejectionRule(option, upper=math.log(upper), lower=math.log(lower))


def rejection_keep(old_logprobs: Tensor, behavior_logprobs: Tensor, valid: Tensor,
                   rules: tuple[RejectionRule, ...]) -> tuple[Tensor, dict[str, Tensor]]:
    """(keep [B, T] bool: the valid tokens every rule keeps; the rejected share of the valid tokens and of the
    responses that have any, `behavior_rs_frac` and `behavior_rs_seq_frac`, as 0-d tensors on the inputs' device,
    so that a loss reads them back with its other metrics in one copy), in float64, no gradient."""
    log_r = torch.where(valid, old_logprobs.detach().double() - behavior_logprobs.detach().double(), 0.0)
    log_r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    values = {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": torch.exp(log_r) - 1.0 - log_r}
    keep = valid.clone()
    lengths = valid.sum(-1)
    for rule in rules:
        stat = torch.where(valid, values[rule.estimator], 0.0)
        if rule.level == "seq_sum":
            stat = stat.sum(-1, keepdim=True)
        elif rule.level == "seq_mean":
            stat = stat.sum(-1, keepdim=True) / lengths.clamp(min=1).unsqueeze(-1)
        elif rule.level == "seq_max":
            stat = torch.where(valid, stat, -math.inf).amax(-1, keepdim=True)
        inside = stat <= rule.upper
        if rule.lower is not None:
            inside = inside & (stat >= rule.lower)
        keep = keep & inside.expand_as(keep)
    rejected = valid & ~keep
    stats = {"behavior_rs_frac": rejected.sum().double() / valid.sum().clamp(min=1),
             "behavior_rs_seq_frac": rejected.any(-1).sum().double() / (lengths > 0).sum().clamp(min=1)}
    return keep, stats
