"""`ppo_clip`'s per-token objectives to maximise (`algo.surrogate`; docs/objectives.md): PPO's clip, CISPO's, SAPO's,
the plain policy gradient, prime-rl's DPPO and IPO, and VESPO. Each reads the ratio ρ = π_θ/π_old (π_old: μ, or the recomputed
log-probs), the advantage and, where it needs them, the log-probs; `ppo_clip_loss` aggregates the result."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kv4rl.algo.ppo_settings import PPOClipSettings

Surrogate = Literal["clip", "cispo", "sapo", "pg", "dppo", "ipo", "vespo"]
VESPO_MIN_LOG_WEIGHT = math.log(1e-8)  # TRL's (and VESPO's) floor of the sequence log-weight


def surrogate_objective(s: PPOClipSettings, ratio: Tensor, log_ratio: Tensor, adv: Tensor, logprobs: Tensor,
                        old_logprobs: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """(the per-token objective, the masks or weights it computed on the way, for the loss's metrics: DPPO's
    `dppo_high` / `dppo_low`, VESPO's `vespo_weights`). PPO's clipped `min(ρA, clip(ρ)A)` (with the dual clip for A < 0), CISPO's `sg(min(ρ, cispo_max)) · A · log π`
    (a capped, gradient-free weight on REINFORCE), SAPO's soft gate `σ(τ(ρ − 1)) · 4/τ · A`, τ = `sapo_tau_pos` for
    A > 0 and `sapo_tau_neg` otherwise, the plain policy gradient `A · log π` (`pg`: no ratio and no clip, verl's
    gpg loss), prime-rl's DPPO `A · ρ` on the tokens its trust region keeps (`dppo_dropped`) less
    `dppo_kl_coef · (log ρ)²` on every token (its default loss, whose kl_tau is that coefficient), prime-rl's IPO, the
    same with a trust region that drops a token whose probability moved by more than `ipo_threshold` either way,
    whatever its advantage's sign, and `ipo_kl_coef` (its ipo loss, `ipo_dropped`), or VESPO's
    `sg(φ(w)) · A · log π` with the response's Gamma weight φ (`vespo_weights`; TRL's loss_type vespo)."""
    if s.surrogate == "cispo":
        return ratio.clamp(max=s.cispo_max).detach() * adv * logprobs, {}
    if s.surrogate == "sapo":
        tau = torch.where(adv > 0, s.sapo_tau_pos, s.sapo_tau_neg).to(ratio.dtype)
        return torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv, {}
    if s.surrogate == "pg":
        return adv * logprobs, {}
    if s.surrogate == "vespo":
        weights = vespo_weights(s, log_ratio, adv)
        return weights * adv * logprobs, {"vespo_weights": weights}
    if s.surrogate == "dppo":
        high, low = dppo_dropped(s, logprobs, old_logprobs, adv)
        return _inside_trust_region(ratio, log_ratio, adv, high | low, s.dppo_kl_coef), {"dppo_high": high, "dppo_low": low}
    if s.surrogate == "ipo":
        dropped = ipo_dropped(s, logprobs, old_logprobs)
        return _inside_trust_region(ratio, log_ratio, adv, dropped, s.ipo_kl_coef), {"ipo_dropped": dropped}
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - s.eps_low, 1.0 + s.eps_high) * adv)
    if s.dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, s.dual_clip * adv), surrogate)
    return surrogate, {}


def dppo_dropped(s: PPOClipSettings, logprobs: Tensor, old_logprobs: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """([B, T] bool, no gradient: the tokens of A > 0 whose probability rose by more than `dppo_mask_high` since
    π_old, p_θ − p_old > high; those of A < 0 whose probability fell by more than `dppo_mask_low`), prime-rl's
    DPPO-Binary TV trust region on the probabilities themselves, not their ratio."""
    gap = torch.exp(logprobs.detach()) - torch.exp(old_logprobs.detach())
    return (adv > 0) & (gap > s.dppo_mask_high), (adv < 0) & (gap < -s.dppo_mask_low)


def ipo_dropped(s: PPOClipSettings, logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """[B, T] bool, no gradient: the tokens whose probability moved by more than `ipo_threshold` since π_old,
    |p_θ − p_old| > threshold, up or down and whatever the advantage (prime-rl's ipo loss's symmetric trust region)."""
    return (torch.exp(logprobs.detach()) - torch.exp(old_logprobs.detach())).abs() > s.ipo_threshold


def _inside_trust_region(ratio: Tensor, log_ratio: Tensor, adv: Tensor, dropped: Tensor, kl_coef: float) -> Tensor:
    """prime-rl's DPPO and IPO objective: A·ρ where the trust region keeps the token, less kl_coef·(log ρ)² on all."""
    kept = torch.where(dropped, torch.zeros((), dtype=ratio.dtype, device=ratio.device), ratio * adv)
    return kept - kl_coef * log_ratio ** 2


def vespo_weights(s: PPOClipSettings, log_ratio: Tensor, adv: Tensor) -> Tensor:
    """[B, T], no gradient: VESPO's φ(w) = e^λ · w^k · e^{−λw} (φ(1) = 1) of each response's ratio w = Π_t ρ_t (its
    tokens' log-ratios held to ±20, then their sum to [log 1e-8, 20]), with k, λ = `vespo_k_pos`, `vespo_lambda_pos`
    where A ≥ 0, else the `_neg` pair (λ at least 1e-4), as TRL's get_gamma_weights computes it; `log_ratio` is 0
    off the mask."""
    log_w = log_ratio.detach().clamp(-20.0, 20.0).sum(-1, keepdim=True).clamp(VESPO_MIN_LOG_WEIGHT, 20.0)
    k = torch.where(adv >= 0, s.vespo_k_pos, s.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(adv >= 0, s.vespo_lambda_pos, s.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
