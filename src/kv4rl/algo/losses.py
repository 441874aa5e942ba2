"""The built-in policy losses (docs/objectives.md), registered like any plug-in (see `registry`).

`loss_fn(inp: LossInputs, cfg: AlgoConfig) -> (loss, metrics)`; pick one with `get_loss(cfg.loss)`.
Each declares its own `algo.*` keys (`PPOClipSettings`, `FutureKLSettings`) and the inputs it reads.
Tensors are `[B, T]` (B responses, T response positions); `mask` is nonzero at valid tokens.
Padding never reaches a loss or a gradient, even when it holds NaN or ±inf.

- `ppo_clip` (§3.1): `−agg(min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A))` with `ρ = π_θ/π_old`; `π_old` is
  the engine's μ (`old_logprob: behavior`) or the learner's own start-of-iteration log-probs
  (`recompute`). Dual clip (c > 1): for A < 0 the surrogate is `max(min(…), c·A)`, so a ratio
  above c stops pushing that token down.
- `future_kl` (§3.2): `−agg(sg(g_t) · log π_θ(y_t))`, `g_t = w_t (A_t − β clipF(F_t^H))`, with the
  future-KL credit `F_t^H` of `c_k = log π_θ − log μ` (detached, taken from the current π_θ; μ is
  always the behaviour policy, `old_logprob` does not apply). No ratio clipping.
- Both add `kl_ref_coef · agg(penalty)` when `kl_ref_coef > 0` and `ref_logprobs` is given (`algo.kl_ref_type`:
  k3 by default, or k1, k2, abs), and log `kl_ref` (token mean of k3) whenever `ref_logprobs` is given.

Metrics are Python floats describing this call's valid tokens. To combine micro-batches
(`combine_metrics`), names ending in `_max` or `absmax` take the max (all of them describe
non-negative quantities, so an empty micro-batch reports 0); a name `<x>_std` (a standard deviation
over valid tokens, logged beside `<x>_mean`) is the std over all of them, from each part's mean and
std; every other name is a mean weighted by the micro-batch's valid-token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from kv4rl.algo.logprobs import LOG_RATIO_LIMIT, k3_kl, ref_kl_terms
from kv4rl.algo.off_policy import behavior_importance_weights, off_policy_keep
from kv4rl.algo.ppo_settings import PPOClipSettings
from kv4rl.algo.rejection import rejection_keep, rejection_rules
from kv4rl.algo.surrogates import surrogate_objective
from kv4rl.algo.registry import LOSSES, LossFn, LossInputs, get_loss, register_loss, require_choice

if TYPE_CHECKING:
    from kv4rl.algo.config import AlgoConfig

__all__ = ["LOSSES", "FutureKLSettings", "LossFn", "LossInputs", "PPOClipSettings", "combine_metrics",
           "future_kl_credit", "future_kl_loss", "get_loss", "ppo_clip_loss", "register_loss"]




def future_kl_credit(log_ratio: Tensor, mask: Tensor, horizon: int | None) -> Tensor:
    """`F_t = Σ_{k=t}^{min(t+H−1, T_i)} c_k` per row (`horizon=None`: to the end): `[B, T] -> [B, T]`.

    The window counts positions; padded positions contribute 0 and get F = 0. Computed as a
    reverse cumulative sum minus the same sum shifted by H, in float64 so the difference of two
    long sums does not lose the small window.
    """
    if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
        raise ValueError(f"horizon must be an integer >= 1 or None (full tail), got {horizon!r}")
    if log_ratio.shape != mask.shape or log_ratio.dim() != 2:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)} must both be [B, T]"
        )
    valid = mask.bool()
    c = torch.where(valid, log_ratio.double(), 0.0)
    tail = c.flip(-1).cumsum(-1).flip(-1)  # tail[:, t] = Σ_{k ≥ t} c_k
    length = c.shape[-1]
    if horizon is not None and horizon < length:
        tail = tail - torch.nn.functional.pad(tail[:, horizon:], (0, horizon))
    return torch.where(valid, tail, 0.0).to(log_ratio.dtype)


def combine_metrics(parts: Sequence[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Merge `(metrics, num_valid_tokens)` of micro-batches per the convention in the docstring."""
    keys = dict.fromkeys(key for metrics, _ in parts for key in metrics)
    merged = {}
    for key in keys:
        present = [(m[key], w) for m, w in parts if key in m]
        weight = sum(w for _, w in present)
        if key.endswith(("_max", "absmax")):
            merged[key] = max(value for value, _ in present)
        elif key.endswith("_std") and all(key.removesuffix("_std") + "_mean" in m for m, _ in parts if key in m):
            # the second moments add: Var = Σ w (σ² + μ²) / W − μ̄² (a mean of the parts' stds left out the
            # spread between micro-batches)
            mean_key = key.removesuffix("_std") + "_mean"
            moments = [(m[key], m[mean_key], w) for m, w in parts if key in m]
            mean = sum(mu * w for _, mu, w in moments) / weight if weight else 0.0
            second = sum((sd * sd + mu * mu) * w for sd, mu, w in moments) / weight if weight else 0.0
            merged[key] = max(second - mean * mean, 0.0) ** 0.5
        else:
            merged[key] = sum(v * w for v, w in present) / weight if weight else 0.0
    return merged


def _mean(values: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, values, 0).sum() / valid.sum().clamp(min=1)


def _max(values: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, values, 0).max() if values.numel() else values.new_zeros(())


def _floats(stats: dict[str, Tensor]) -> dict[str, float]:
    """One device→host copy for all metrics."""
    if not stats:
        return {}
    values = torch.stack([torch.as_tensor(v).detach().double().reshape(()) for v in stats.values()])
    return dict(zip(stats, values.tolist()))


def _with_ref_kl(
    loss: Tensor, inp: LossInputs, cfg: AlgoConfig, valid: Tensor, stats: dict[str, Tensor],
    weight: Tensor | None = None,
) -> Tensor:
    """`loss` plus `algo.kl_ref_coef` times the aggregated reference-KL penalty, each token's term times `weight`
    where given (the ratio π_θ/π_old of `algo.kl_ref_unbiased`, with its gradient, as TRL's)."""
    if inp.ref_logprobs is None:
        return loss
    logp = torch.where(valid, inp.logprobs, 0)
    ref_logp = torch.where(valid, inp.ref_logprobs.detach(), 0)
    # ρ held at e^LOG_RATIO_LIMIT, as the PPO ratio is: one token the policy pushed below e^-88 of the
    # reference's probability overflowed expm1 to inf in float32 and skipped the whole batch's step. Summed in
    # float64: ~6,000 tokens at the limit overflow a float32 sum (their mean, <= e^80, fits float32)
    held = torch.maximum(logp, ref_logp - LOG_RATIO_LIMIT).double()
    k3 = k3_kl(held, ref_logp.double())
    stats["kl_ref"] = _mean(k3.detach(), valid).to(loss.dtype)  # the KL's estimate whatever algo.kl_ref_type
    if cfg.kl_ref_coef > 0:
        penalty = k3 if cfg.kl_ref_type == "k3" else ref_kl_terms(held, ref_logp.double(), cfg.kl_ref_type)
        if weight is not None:  # the samples are π_old's: E_old[ρ · k] is the KL under π_θ (DeepSeek-V3.2)
            penalty = penalty * weight.double()
        if cfg.kl_ref_clamp is not None:  # verl's low_var_kl: a token past the cap adds the cap, and no gradient
            penalty = penalty.clamp(max=cfg.kl_ref_clamp)
        term = inp.aggregate(penalty, valid, cfg.loss_agg, filtered=False)  # every token, as TRL's (top_entropy_quantile)
        loss = loss + cfg.kl_ref_coef * term.to(loss.dtype)
    return loss


def _ppo_clip_inputs(cfg: AlgoConfig) -> set[str]:
    """π_old is either the engine's log-probs or a recompute by the learner; both with `behavior_is`."""
    s = cfg.section("ppo_clip")
    old = "old_logprobs" if s.old_logprob == "recompute" else "behavior_logprobs"
    engine = s.behavior_is != "none" or s.off_policy_mask is not None or s.behavior_rs is not None
    # a response's weight is over all its sampled tokens, those rejected too (verl weighs before it rejects)
    whole = s.behavior_is.startswith("sequence") and s.behavior_rs is not None
    norm = {"behavior_is_norm"} if s.behavior_is_normalize else set()
    return {old, "ref_logprobs"} | ({"behavior_logprobs"} if engine else set()) | ({"sampled_mask"} if whole else set()) | norm


@register_loss("ppo_clip", settings=PPOClipSettings, inputs=_ppo_clip_inputs)
def ppo_clip_loss(inp: LossInputs, cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    s: PPOClipSettings = cfg.section("ppo_clip")
    valid = inp.valid_mask()
    if s.old_logprob == "recompute":
        old_logprobs = inp.need("old_logprobs", "algo.old_logprob=recompute")
    else:
        old_logprobs = inp.need("behavior_logprobs")
    trained = valid  # in verl's bypass mode, the tokens `behavior_rs` keeps in this pass (π_θ against μ)
    side_stats = {}  # the rejection's shares, and the weights' batch mean when they are normalised
    if s.behavior_rs is not None and s.old_logprob == "behavior":
        keep, side_stats = rejection_keep(inp.logprobs, inp.need("behavior_logprobs", "algo.behavior_rs"), valid,
                                        rejection_rules(s.behavior_rs, s.behavior_rs_threshold))
        trained = valid & keep
    log_ratio = torch.where(valid, inp.logprobs - old_logprobs.detach(), 0)
    if s.ratio_level == "sequence":  # within a row: the same in any micro-batch; over the kept tokens
        kept_ratio = torch.where(trained, log_ratio, 0)
        row_mean = kept_ratio.sum(-1, keepdim=True) / trained.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(valid, row_mean.expand_as(log_ratio), 0)
    # e^88.7 overflows float32, and an infinite ratio made a clipped token's gradient and an A = 0 token's loss
    # NaN; past ±LOG_RATIO_LIMIT (e^80 ≈ 5.5e34, far beyond any clip range) the ratio is held there
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = torch.where(valid, inp.advantages.detach(), 0)
    # a token behavior_rs rejected in this pass adds no term, nor its ratio to VESPO's response weight
    kept_log_ratio = log_ratio if trained is valid else torch.where(trained, log_ratio, 0)
    surrogate, found = surrogate_objective(s, ratio, kept_log_ratio, adv, torch.where(valid, inp.logprobs, 0),
                                           old_logprobs)
    kept = None
    if s.off_policy_mask is not None:
        kept = off_policy_keep(inp.logprobs, inp.need("behavior_logprobs", "algo.off_policy_mask"), adv, valid,
                               s.off_policy_mask)
        surrogate = torch.where(kept, surrogate, torch.zeros((), dtype=surrogate.dtype, device=surrogate.device))
    weights = None
    if s.behavior_is != "none":
        sampled = valid if inp.sampled_mask is None else inp.sampled_mask.bool()
        weights, cut = behavior_importance_weights(old_logprobs, inp.need("behavior_logprobs", "algo.behavior_is"),
                                                   sampled, s.behavior_is, s.behavior_is_min, s.behavior_is_max)
        weights, cut = torch.where(valid, weights, 0.0), cut & valid
        if s.behavior_is_normalize:  # by the whole learner batch's mean weight (verl's rollout_is_batch_normalize)
            norm = inp.need("behavior_is_norm", "algo.behavior_is_normalize")
            weights = weights / norm
            side_stats["behavior_is_norm_factor"] = _mean(norm, valid)
        surrogate = surrogate * weights.to(surrogate.dtype)
    loss = -inp.aggregate(surrogate, trained, cfg.loss_agg)

    kl_weight = torch.where(valid, ratio, 0) if s.kl_ref_unbiased else None
    ratio = ratio.detach()
    stats = {"ratio_mean": _mean(ratio, valid), "ratio_max": _max(ratio, valid)}
    if s.surrogate == "clip":
        clipped_high = valid & (adv > 0) & (ratio > 1.0 + s.eps_high)
        clipped_low = valid & (adv < 0) & (ratio < 1.0 - s.eps_low)
        stats.update(clip_frac=_mean((clipped_high | clipped_low).double(), valid),
                     clip_frac_low=_mean(clipped_low.double(), valid), clip_frac_high=_mean(clipped_high.double(), valid))
    elif s.surrogate == "cispo":  # TRL's cispo_clip_ratio: capped tokens of positive advantage
        stats["cispo_clip_frac"] = _mean((valid & (adv > 0) & (ratio > s.cispo_max)).double(), valid)
    elif s.surrogate == "vespo":
        stats["vespo_weight_mean"] = _mean(found["vespo_weights"], trained)
    elif s.surrogate == "dppo":  # prime-rl's is_masked, is_masked_high, is_masked_low
        high, low = found["dppo_high"], found["dppo_low"]
        stats.update(dppo_masked_frac=_mean((valid & (high | low)).double(), valid),
                     dppo_masked_frac_high=_mean((valid & high).double(), valid),
                     dppo_masked_frac_low=_mean((valid & low).double(), valid))
    elif s.surrogate == "ipo":  # prime-rl's is_masked
        stats["ipo_masked_frac"] = _mean((valid & found["ipo_dropped"]).double(), valid)
    if s.dual_clip is not None:
        stats["dual_clip_frac"] = _mean(((adv < 0) & (ratio > s.dual_clip)).double(), valid)
    stats.update(side_stats)
    if kept is not None:  # the tokens of the responses it dropped
        stats["off_policy_masked_frac"] = _mean((valid & ~kept).double(), valid)
    if weights is not None:
        stats.update(behavior_is_mean=_mean(weights, valid), behavior_is_max=_max(weights, valid),
                     behavior_is_cut_frac=_mean(cut.double(), valid))
    loss = _with_ref_kl(loss, inp, cfg, valid, stats, weight=kl_weight)
    return loss, _floats(stats)


@dataclass(kw_only=True)
class FutureKLSettings:
    """`future_kl`'s keys: cost β, window H, importance weights, and the clamp C of F (null: off)."""

    beta: float = 0.3
    horizon: int | Literal["full"] = "full"
    is_mode: Literal["none", "token", "sequence"] = "token"
    is_cap: float = 2.0
    future_cost_clip: float | None = None

    @property
    def horizon_tokens(self) -> int | None:
        """The credit window in tokens, or None for the full tail."""
        return None if self.horizon == "full" else self.horizon

    def validate(self) -> None:
        require_choice("algo.is_mode", self.is_mode, ("none", "token", "sequence"))
        if not self.beta >= 0.0:
            raise ValueError(f"algo.beta must be >= 0, got {self.beta}")
        if self.horizon != "full" and (
            isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 1
        ):
            raise ValueError(f"algo.horizon must be an integer >= 1 or 'full', got {self.horizon!r}")
        if not self.is_cap > 0.0:
            raise ValueError(f"algo.is_cap must be > 0, got {self.is_cap}")
        if self.future_cost_clip is not None and not self.future_cost_clip > 0.0:
            raise ValueError(f"algo.future_cost_clip must be > 0 (or null), got {self.future_cost_clip}")


def _importance_weights(log_ratio: Tensor, valid: Tensor, s: FutureKLSettings) -> tuple[Tensor, Tensor]:
    """(w [B, T], capped [B, T] bool) for `s.is_mode`; `log_ratio` is 0 at padding."""
    if s.is_mode == "none":
        return torch.ones_like(log_ratio), torch.zeros_like(valid)
    if s.is_mode == "token":
        raw = torch.exp(log_ratio)
    elif s.is_mode == "sequence":
        lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1)
        raw = torch.exp(log_ratio.sum(dim=-1, keepdim=True) / lengths).expand_as(log_ratio)
    else:
        raise ValueError(f"algo.is_mode: unknown importance weighting '{s.is_mode}'")
    return raw.clamp(max=s.is_cap), raw > s.is_cap


@register_loss("future_kl", settings=FutureKLSettings, inputs={"behavior_logprobs", "ref_logprobs"})
def future_kl_loss(inp: LossInputs, cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    s: FutureKLSettings = cfg.section("future_kl")
    valid = inp.valid_mask()
    log_ratio = torch.where(valid, inp.logprobs.detach() - inp.need("behavior_logprobs").detach(), 0)
    credit = future_kl_credit(log_ratio, valid, s.horizon_tokens)
    charged = credit
    if s.future_cost_clip is not None:
        charged = credit.clamp(-s.future_cost_clip, s.future_cost_clip)
    weights, capped = _importance_weights(log_ratio, valid, s)
    adv = torch.where(valid, inp.advantages.detach(), 0)
    coef = torch.where(valid, weights * (adv - s.beta * charged), 0)
    loss = -inp.aggregate(coef * inp.logprobs, valid, cfg.loss_agg)

    credit_mean = _mean(credit, valid)
    stats = {
        "future_credit_mean": credit_mean,
        "future_credit_std": _mean((credit - credit_mean) ** 2, valid).sqrt(),
        "future_credit_absmax": _max(credit.abs(), valid),
        "future_clip_frac": _mean((charged != credit).double(), valid),
        "is_weight_mean": _mean(weights, valid),
        "is_weight_max": _max(weights, valid),
        "is_capped_frac": _mean(capped.double(), valid),
        "log_ratio_mean": _mean(log_ratio, valid),
        "log_ratio_absmax": _max(log_ratio.abs(), valid),
    }
    loss = _with_ref_kl(loss, inp, cfg, valid, stats)
    return loss, _floats(stats)
