"""Advantage estimators (docs/objectives.md) as registered pure functions: `grpo` and `rloo`.

Every estimator maps one reward per response, groups contiguous (`[g0r0, g0r1, …, g1r0, …]`),
to one advantage per response; the learner broadcasts it over the response's tokens.

GRPO divides by the *unbiased* (sample, n−1) standard deviation of the group, as most GRPO
implementations do; the method leaves population vs sample open. Groups whose rewards are all equal
get exactly zero (not a rounding residue of `r − mean`), and a group of one response has no
baseline information, so it gets zero too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kv4rl.algo.config import AdvantageConfig

STD_EPS = 1e-6

# (rewards[N], group_size, cfg, batch std or None) -> (advantages[N], metrics); the batch std is the one of every
# reward of the learner batch, over all ranks, given when `advantage.std_scope` is `batch`
AdvantageFn = Callable[[Tensor, int, AdvantageConfig, float | None], tuple[Tensor, dict[str, float]]]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator '{name}' is already registered")
        ADVANTAGES[name] = fn
        return fn

    return wrap


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per response), got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of size {group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.reshape(-1, group_size)


def _zero_variance(grouped: Tensor) -> Tensor:
    """[num_groups] bool: every reward of the group is the same value."""
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def grpo_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True, std: float | None = None) -> Tensor:
    """`(r − mean_group) / (std_group + 1e-6)` per response (std: unbiased sample std).

    With `normalize_std=False` the result is `r − mean_group`; with `std` given, `(r − mean_group) / (std + 1e-6)`
    (TRL's `scale_rewards: batch`: `std` is the whole batch's, `batch_std`). Computed in float64 and returned in the
    rewards' float dtype: a float32 group mean of rewards on a large offset (1e8 + 8 and 1e8) is rounded
    enough to move every advantage off zero mean, even to the wrong sign.
    """
    grouped = _grouped(rewards, group_size)
    out_dtype = grouped.dtype
    grouped = grouped.double()
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and std is not None:
        centered = centered / (std + STD_EPS)
    elif normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, correction=1, keepdim=True) + STD_EPS)
    flat_groups = _zero_variance(grouped)[:, None]
    return torch.where(flat_groups, torch.zeros_like(centered), centered).reshape(-1).to(out_dtype)


def batch_std(rewards: Tensor) -> float:
    """The unbiased std of every reward in `rewards` (float64; 0 for fewer than two)."""
    flat = rewards.reshape(-1).double()
    return float(flat.std(correction=1)) if flat.numel() > 1 else 0.0


def perturb_baseline(adv: Tensor, sigma: float, generator: torch.Generator | None = None,
                     group_keys: list[int] | None = None) -> Tensor:
    """`adv + ξ` with `ξ = ±sigma`, each sign with probability ½, independently per response.

    Apply it to per-response advantages (1-D, whole groups in order), before broadcasting over tokens.
    `group_keys` (one non-negative int per group, e.g. from `noise_key`) draws each group's signs from its
    own key, so a response's noise does not depend on which rank holds its group or where in the batch it
    sits (drawn from one generator per rank, every data-parallel rank drew the same signs); else from
    `generator`, in batch order.
    """
    if adv.dim() != 1:
        raise ValueError(f"perturb_baseline expects per-response advantages (1-D), got {tuple(adv.shape)}")
    if sigma < 0:
        raise ValueError(f"baseline noise sigma must be >= 0, got {sigma}")
    if group_keys is None:
        bits = torch.randint(0, 2, adv.shape, generator=generator)
    else:
        if not group_keys or adv.numel() % len(group_keys):
            raise ValueError(f"{adv.numel()} advantages do not split into {len(group_keys)} groups")
        size = adv.numel() // len(group_keys)
        bits = torch.cat([torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(key))
                          for key in group_keys])
    signs = bits.to(device=adv.device, dtype=adv.dtype) * 2 - 1
    return adv + sigma * signs


def noise_key(seed: int, iteration: int, group_index: int) -> int:
    """The baseline-noise key of one group of one update (`perturb_baseline`), a non-negative 63-bit int."""
    # plain integer arithmetic: the same key in every process and Python version (unlike hash())
    return ((seed * 1_000_003 + iteration) * 1_000_033 + group_index) % 2**63


@register_advantage("grpo")
def _grpo(rewards: Tensor, group_size: int, cfg: AdvantageConfig, std: float | None) -> tuple[Tensor, dict[str, float]]:
    adv = grpo_advantages(rewards, group_size, cfg.normalize_std, std)
    grouped = _grouped(rewards, group_size)
    zero_var = _zero_variance(grouped).float().mean()
    return adv, {"zero_var_group_frac": float(zero_var)}


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: `r_i − mean_{j≠i} r_j` per response, the leave-one-out baseline (= G/(G−1) · (r_i − mean_group)), in
    float64; no std division. A group of one has no other response to compare with: 0, as GRPO gives it."""
    grouped = _grouped(rewards, group_size)
    out_dtype = grouped.dtype
    grouped = grouped.double()
    if group_size == 1:
        return torch.zeros_like(grouped).reshape(-1).to(out_dtype)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    centered = torch.where(_zero_variance(grouped)[:, None], torch.zeros_like(grouped), grouped - others)
    return centered.reshape(-1).to(out_dtype)


@register_advantage("rloo")
def _rloo(rewards: Tensor, group_size: int, cfg: AdvantageConfig, std: float | None) -> tuple[Tensor, dict[str, float]]:
    adv = rloo_advantages(rewards, group_size)
    return adv, {"zero_var_group_frac": float(_zero_variance(_grouped(rewards, group_size)).float().mean())}


def compute_advantages(
    rewards: Tensor,
    group_size: int,
    cfg: AdvantageConfig,
    generator: torch.Generator | None = None,
    group_keys: list[int] | None = None,
    batch_rewards: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Run the configured estimator, then the optional ±σ baseline perturbation.

    `batch_rewards`: every reward of the learner batch where `rewards` is one rank's share (torchrun), for
    `advantage.std_scope: batch` (default: `rewards`).

    Metrics: the estimator's own (GRPO: `zero_var_group_frac`), plus `reward_mean`, `reward_std`,
    `adv_mean`, `adv_std`, `adv_absmax` of the final advantages.
    """
    if cfg.estimator not in ADVANTAGES:
        raise ValueError(
            f"unknown advantage estimator '{cfg.estimator}' (known: {', '.join(sorted(ADVANTAGES))})"
        )
    std = batch_std(rewards if batch_rewards is None else batch_rewards) if cfg.std_scope == "batch" else None
    adv, metrics = ADVANTAGES[cfg.estimator](rewards, group_size, cfg, std)
    if cfg.baseline_noise > 0:
        adv = perturb_baseline(adv, cfg.baseline_noise, generator, group_keys)
    rewards_f = rewards.double()
    adv_f = adv.double()
    metrics.update(
        reward_mean=float(rewards_f.mean()),
        reward_std=float(rewards_f.std(correction=0)),
        adv_mean=float(adv_f.mean()),
        adv_std=float(adv_f.std(correction=0)),
        adv_absmax=float(adv_f.abs().max()),
    )
    return adv, metrics
