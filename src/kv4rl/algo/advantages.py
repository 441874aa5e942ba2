"""Advantage estimators (docs/objectives.md) as registered pure functions: `grpo`, `rloo`, REINFORCE++'s two and
verl's `opo`, `grpo_passk`, `gpg` and `remax`, and `raw` (the reward itself).

Every estimator maps one reward per response, groups contiguous (`[g0r0, g0r1, …, g1r0, …]`),
to one advantage per response; the learner broadcasts it over the response's tokens. An estimator that
normalises over the whole learner batch (GRPO's `std_scope: batch`, REINFORCE++'s whitening) reads every
rank's rewards, and REINFORCE++ their token counts, from `WholeBatch`; OPO weighs a group's rewards by this
rank's own token counts.

GRPO divides by the *unbiased* (sample, n−1) standard deviation of the group, as most GRPO
implementations do; the method leaves population vs sample open. Groups whose rewards are all equal
get exactly zero (not a rounding residue of `r − mean`), and a group of one response has no
baseline information, so it gets zero too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kv4rl.algo.config import TOKEN_WEIGHTED, AdvantageConfig

STD_EPS = 1e-6
WHITEN_EPS = 1e-8  # inside the square root, as verl's masked_whiten


@dataclass(frozen=True)
class WholeBatch:
    """Every response of the learner batch, all ranks' groups in one order (in one process, this rank's):
    its rewards and, where an estimator weighs responses by their tokens, each response's token count; and the
    token counts of this rank's own responses (`local_lengths`, beside the estimator's `rewards`); and for ReMax the
    score of each of this rank's groups' greedy response (`baselines`)."""

    rewards: Tensor
    lengths: Tensor | None = None
    local_lengths: Tensor | None = None
    baselines: Tensor | None = None  # ReMax: the reward of each of this rank's groups' greedy response


# (rewards[N], group_size, cfg, whole batch) -> (advantages[N], metrics); `rewards` are this rank's share
AdvantageFn = Callable[[Tensor, int, AdvantageConfig, WholeBatch], tuple[Tensor, dict[str, float]]]
ADVANTAGES: dict[str, AdvantageFn] = {}
# the estimators that read `WholeBatch.lengths` (a caller gathers them over the ranks only for these)


def needs_whole_batch(cfg: AdvantageConfig) -> bool:
    """Whether `cfg`'s advantages read the whole learner batch (under torchrun, every rank's rewards)."""
    return (cfg.std_scope == "batch" and cfg.estimator == "grpo") or cfg.estimator in (*TOKEN_WEIGHTED, "gpg")


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
    centered = _group_centered(grouped)
    if normalize_std and std is not None:
        centered = centered / (std + STD_EPS)
    elif normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, correction=1, keepdim=True) + STD_EPS)
    return centered.reshape(-1).to(out_dtype)


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


def _group_centered(grouped: Tensor) -> Tensor:
    """`r − mean_group` (callers pass float64), exactly 0 in a flat group (and so in a group of one)."""
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return torch.where(_zero_variance(grouped)[:, None], torch.zeros_like(centered), centered)


def flat_group_metrics(rewards: Tensor, group_size: int) -> dict[str, float]:
    """`zero_var_group_frac`: the share of groups whose rewards are all equal (they teach nothing)."""
    return {"zero_var_group_frac": float(_zero_variance(_grouped(rewards, group_size)).float().mean())}


@register_advantage("grpo")
def _grpo(rewards: Tensor, group_size: int, cfg: AdvantageConfig, whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
    std = batch_std(whole.rewards) if cfg.std_scope == "batch" else None
    adv = grpo_advantages(rewards, group_size, cfg.normalize_std, std)
    return adv, flat_group_metrics(rewards, group_size)


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
def _rloo(rewards: Tensor, group_size: int, cfg: AdvantageConfig, whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
    adv = rloo_advantages(rewards, group_size)
    return adv, flat_group_metrics(rewards, group_size)


def reinforce_pp_advantages(rewards: Tensor, group_size: int, lengths: Tensor, baseline: bool = True,
                            whole_rewards: Tensor | None = None) -> Tensor:
    """REINFORCE++ (verl's `reinforce_plus_plus_baseline` / `reinforce_plus_plus` at γ = 1 without a KL reward):
    `c_i = r_i − mean_group` (`baseline`; else `c_i = r_i`), then whitened over every response token of the whole
    batch, `A_i = (c_i − μ) / sqrt(σ² + 1e-8)`, with μ and σ² the mean and the unbiased (N − 1) variance of `c`
    over the batch's N tokens, so a response weighs by its token count. The mean is not added back.

    `lengths`: the token count of each response of the whole batch, `whole_rewards` (whole groups, all ranks';
    by default `rewards`, which is then the whole batch). A flat group's `c` is exactly 0, so its advantage is
    `−μ / σ`, as in verl; a batch whose `c` are all equal gets exactly 0. Float64, returned in the rewards' float
    dtype.
    """
    grouped = _grouped(rewards, group_size)
    out_dtype = grouped.dtype
    whole = grouped if whole_rewards is None else _grouped(whole_rewards, group_size)
    if lengths.shape != (whole.numel(),):
        raise ValueError(f"lengths must hold one token count per response of the whole batch ({whole.numel()}), "
                         f"got shape {tuple(lengths.shape)}")
    weights = lengths.double().to(whole.device)
    tokens = float(weights.sum())
    if bool((weights < 0).any()) or tokens < 2:
        raise ValueError(f"REINFORCE++ whitens over the batch's response tokens: the lengths must be >= 0 and add "
                         f"up to at least 2, got {lengths.tolist()}")

    def centred(g: Tensor) -> Tensor:
        return (_group_centered(g.double()) if baseline else g.double()).reshape(-1)

    c_whole = centred(whole)
    if bool(c_whole.amax() == c_whole.amin()):  # nothing to tell apart: exactly 0, not a rounding residue of c − μ
        return torch.zeros(grouped.numel(), dtype=out_dtype, device=grouped.device)
    mean = (weights * c_whole).sum() / tokens
    var = (weights * (c_whole - mean) ** 2).sum() / (tokens - 1)
    return ((centred(grouped) - mean) / torch.sqrt(var + WHITEN_EPS)).to(out_dtype)


def _reinforce_pp(baseline: bool) -> AdvantageFn:
    def estimator(rewards: Tensor, group_size: int, cfg: AdvantageConfig,
                  whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
        if whole.lengths is None:
            raise ValueError(f"advantage.estimator={cfg.estimator} weighs responses by their tokens: pass the "
                             "response lengths (compute_advantages(lengths=...))")
        adv = reinforce_pp_advantages(rewards, group_size, whole.lengths, baseline, whole.rewards)
        return adv, flat_group_metrics(rewards, group_size)

    return estimator


register_advantage("reinforce_plus_plus_baseline")(_reinforce_pp(baseline=True))
register_advantage("reinforce_plus_plus")(_reinforce_pp(baseline=False))


@register_advantage("opo")
def _opo(rewards: Tensor, group_size: int, cfg: AdvantageConfig, whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
    """OPO (verl's `opo`): `r_i − Σ_j L_j r_j / Σ_j L_j` over the group, the length-weighted mean as the baseline
    (L: token counts); no std. A flat group gets exactly 0."""
    if whole.local_lengths is None:
        raise ValueError("advantage.estimator=opo weighs a group's rewards by their tokens: pass the response lengths "
                         "(compute_advantages(lengths=...))")
    grouped = _grouped(rewards, group_size)
    lengths = whole.local_lengths.double().to(grouped.device)
    if lengths.shape != (grouped.numel(),) or bool((lengths <= 0).any()):
        raise ValueError(f"advantage.estimator=opo needs one token count >= 1 per response ({grouped.numel()}), got "
                         f"{whole.local_lengths.tolist()}")
    values, lengths = grouped.double(), lengths.reshape(grouped.shape)
    baseline = (lengths * values).sum(1, keepdim=True) / lengths.sum(1, keepdim=True)
    adv = torch.where(_zero_variance(values)[:, None], torch.zeros_like(values), values - baseline)
    return adv.reshape(-1).to(grouped.dtype), flat_group_metrics(rewards, group_size)


@register_advantage("grpo_passk")
def _grpo_passk(rewards: Tensor, group_size: int, cfg: AdvantageConfig,
                whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
    """Pass@k training (verl's `grpo_passk`): only the group's best response gets `r_max − r_second`, over the
    group's unbiased std + 1e-6 with `normalize_std`; every other response 0 (so does a tie at the top, and a group
    of one, which has no second)."""
    grouped = _grouped(rewards, group_size)
    values = grouped.double()
    adv = torch.zeros_like(values)
    if group_size > 1:
        top2, where = values.topk(2, dim=1)
        gap = top2[:, 0] - top2[:, 1]
        if cfg.normalize_std:
            gap = gap / (values.std(dim=1, correction=1) + STD_EPS)
        adv = adv.scatter(1, where[:, :1], gap[:, None])
    return adv.reshape(-1).to(grouped.dtype), flat_group_metrics(rewards, group_size)


@register_advantage("gpg")
def _gpg(rewards: Tensor, group_size: int, cfg: AdvantageConfig, whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
    """GPG (verl's `gpg`): `α (r_i − mean_group)`, α = the batch's responses over its responses of non-zero reward
    (all ranks'; at least 1), so a batch of few rewarded responses gets a larger step; no std."""
    everyone = whole.rewards.reshape(-1).double()
    alpha = everyone.numel() / max(int((everyone != 0).sum()), 1)
    grouped = _grouped(rewards, group_size)
    return (alpha * _group_centered(grouped.double())).reshape(-1).to(grouped.dtype), flat_group_metrics(rewards, group_size)


@register_advantage("remax")
def _remax(rewards: Tensor, group_size: int, cfg: AdvantageConfig,
           whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
    """ReMax (verl's `remax`, Li et al. 2023): `r_i − b_g`, the baseline b_g the score of one greedy response to the
    group's prompt, sampled beside the group and not trained on; no std."""
    grouped = _grouped(rewards, group_size)
    if whole.baselines is None or whole.baselines.shape != (grouped.shape[0],):
        got = None if whole.baselines is None else tuple(whole.baselines.shape)
        raise ValueError(f"advantage.estimator=remax needs one greedy response's score per group ({grouped.shape[0]}),"
                         f" got {got} (compute_advantages(baselines=...))")
    baselines = whole.baselines.double().to(grouped.device)
    adv = grouped.double() - baselines[:, None]
    return adv.reshape(-1).to(grouped.dtype), {**flat_group_metrics(rewards, group_size),
                                               "remax/baseline_reward_mean": float(baselines.mean())}


@register_advantage("raw")
def _raw(rewards: Tensor, group_size: int, cfg: AdvantageConfig, whole: WholeBatch) -> tuple[Tensor, dict[str, float]]:
    """The reward itself, no baseline and no std (plain REINFORCE; AReaL's advantages without reward_norm and without
    a critic, whose GAE at discount 1 and zero values gives every token the response's score). A flat group keeps
    its reward; `advantage.whiten` then centres the batch (AReaL's adv_norm)."""
    return rewards.clone(), flat_group_metrics(rewards, group_size)


AREAL_NORM_EPS = 1e-5  # AReaL's NormConfig eps, added to the standard deviation


def whiten_over_tokens(adv: Tensor, lengths: Tensor, over_ranks: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`advantage.whiten` (AReaL's adv_norm with mean_level and std_level batch): `(A_i − μ) / (σ + 1e-5)`, μ and the
    unbiased σ over every response token of the batch, so that a response weighs by its `lengths` entry; the ranks'
    sums (tokens and Σ A, then Σ (A − μ)²) added by `over_ranks` where each holds a share. Float64, in `adv`'s
    dtype."""
    a, w = adv.double(), lengths.double().to(adv.device)
    total = over_ranks or (lambda x: x)
    tokens, summed = total(torch.stack([w.sum(), (w * a).sum()])).tolist()
    if tokens == 0:
        return adv
    mean = summed / tokens
    squares = float(total((w * (a - mean) ** 2).sum().reshape(1)))
    return ((a - mean) / (math.sqrt(squares / max(tokens - 1, 1)) + AREAL_NORM_EPS)).to(adv.dtype)


def compute_advantages(
    rewards: Tensor,
    group_size: int,
    cfg: AdvantageConfig,
    generator: torch.Generator | None = None,
    group_keys: list[int] | None = None,
    batch_rewards: Tensor | None = None,
    lengths: Tensor | None = None,
    batch_lengths: Tensor | None = None,
    over_ranks: Callable[[Tensor], Tensor] | None = None,
    baselines: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Run the configured estimator, then the optional ±σ baseline perturbation, then `cfg.whiten`'s whitening over
    the batch's tokens (`over_ranks` sums its statistics over a torchrun job's ranks; default: one process).

    `batch_rewards`: every reward of the learner batch where `rewards` is one rank's share (torchrun), for the
    estimators that read the whole batch (`needs_whole_batch`; default: `rewards`). `lengths`: each response's
    token count, which REINFORCE++ weighs by (`batch_lengths`: the whole batch's, beside `batch_rewards`).
    `baselines`: ReMax's greedy score per group of `rewards`.

    Metrics: the estimator's own (GRPO: `zero_var_group_frac`), plus `reward_mean`, `reward_std`,
    `adv_mean`, `adv_std`, `adv_absmax` of the final advantages.
    """
    if cfg.estimator == "optimal_token_baseline":
        raise ValueError("advantage.estimator=optimal_token_baseline reads the policy's log-probs and Σπ² of every "
                         "token: the learner's batch builds it (learner_batch), not compute_advantages")
    if cfg.estimator not in ADVANTAGES:
        raise ValueError(
            f"unknown advantage estimator '{cfg.estimator}' (known: {', '.join(sorted(ADVANTAGES))})"
        )
    if (batch_rewards is None) != (batch_lengths is None) and lengths is not None:
        raise ValueError("batch_lengths go with batch_rewards: pass both (the whole batch) or neither")
    whole = WholeBatch(rewards, lengths, lengths, baselines) if batch_rewards is None else \
        WholeBatch(batch_rewards, batch_lengths, lengths, baselines)
    adv, metrics = ADVANTAGES[cfg.estimator](rewards, group_size, cfg, whole)
    if cfg.baseline_noise > 0:
        adv = perturb_baseline(adv, cfg.baseline_noise, generator, group_keys)
    if cfg.whiten:
        if lengths is None:
            raise ValueError("advantage.whiten weighs responses by their tokens: pass the response lengths "
                             "(compute_advantages(lengths=...))")
        adv = whiten_over_tokens(adv, lengths, over_ranks)
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
