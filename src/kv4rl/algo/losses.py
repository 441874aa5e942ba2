"""Policy losses (SPEC §3) as registered pure functions with one signature.

`loss_fn(inp: LossInputs, cfg: AlgoConfig) -> (loss, metrics)`; pick one with `get_loss(cfg.loss)`.
Tensors are `[B, T]` (B responses, T response positions); `mask` is nonzero at valid tokens.
Padding never reaches a loss or a gradient, even when it holds NaN or ±inf.

- `ppo_clip` (§3.1): `−agg(min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A))` with `ρ = π_θ/π_old`; `π_old` is
  the engine's μ (`old_logprob: behavior`) or the learner's own start-of-iteration log-probs
  (`recompute`). Dual clip (c > 1): for A < 0 the surrogate is `max(min(…), c·A)`, so a ratio
  above c stops pushing that token down.
- `future_kl` (§3.2): `−agg(sg(g_t) · log π_θ(y_t))`, `g_t = w_t (A_t − β clipF(F_t^H))`, with the
  future-KL credit `F_t^H` of `c_k = log π_θ − log μ` (detached, taken from the current π_θ; μ is
  always the behaviour policy, `old_logprob` does not apply). No ratio clipping.
- Both add `kl_ref_coef · agg(k3)` when `kl_ref_coef > 0` and `ref_logprobs` is given, and log
  `kl_ref` (token mean of k3) whenever `ref_logprobs` is given.

Metrics are Python floats describing this call's valid tokens. To combine micro-batches
(`combine_metrics`), names ending in `_max` or `absmax` take the max (all of them describe
non-negative quantities, so an empty micro-batch reports 0); every other name is a mean weighted
by the micro-batch's valid-token count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kv4rl.algo.aggregation import aggregate
from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.logprobs import k3_kl


@dataclass(kw_only=True)
class LossInputs:
    """One (micro-)batch. `num_tokens`/`num_seqs`: full-batch denominators (see aggregation)."""

    logprobs: Tensor  # [B, T] learner log π_θ at temperature τ, with grad
    behavior_logprobs: Tensor  # [B, T] engine's log μ
    advantages: Tensor  # [B, T]
    mask: Tensor  # [B, T] float or bool
    old_logprobs: Tensor | None = None  # [B, T] for old_logprob=recompute
    ref_logprobs: Tensor | None = None  # [B, T] log π_ref
    num_tokens: float | None = None
    num_seqs: float | None = None

    def valid_mask(self) -> Tensor:
        """Check shapes; return the bool mask."""
        shape = self.logprobs.shape
        if len(shape) != 2:
            raise ValueError(f"logprobs must be [B, T], got {tuple(shape)}")
        named = {
            "behavior_logprobs": self.behavior_logprobs,
            "advantages": self.advantages,
            "mask": self.mask,
            "old_logprobs": self.old_logprobs,
            "ref_logprobs": self.ref_logprobs,
        }
        for name, tensor in named.items():
            if tensor is not None and tensor.shape != shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(shape)}")
        return self.mask.bool()


LossFn = Callable[[LossInputs, AlgoConfig], tuple[Tensor, dict[str, float]]]
LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss '{name}' is already registered")
        LOSSES[name] = fn
        return fn

    return wrap


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"unknown loss '{name}' (known: {', '.join(sorted(LOSSES))})")
    return LOSSES[name]


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
        if key.endswith(("_max", "absmax")):
            merged[key] = max(value for value, _ in present)
        else:
            weight = sum(w for _, w in present)
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
    loss: Tensor, inp: LossInputs, cfg: AlgoConfig, valid: Tensor, stats: dict[str, Tensor]
) -> Tensor:
    if inp.ref_logprobs is None:
        return loss
    logp = torch.where(valid, inp.logprobs, 0)
    ref_logp = torch.where(valid, inp.ref_logprobs.detach(), 0)
    k3 = k3_kl(logp, ref_logp)
    stats["kl_ref"] = _mean(k3.detach(), valid)
    if cfg.kl_ref_coef > 0:
        loss = loss + cfg.kl_ref_coef * aggregate(k3, valid, cfg.loss_agg, inp.num_tokens, inp.num_seqs)
    return loss


@register_loss("ppo_clip")
def ppo_clip_loss(inp: LossInputs, cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    valid = inp.valid_mask()
    if cfg.old_logprob == "recompute":
        if inp.old_logprobs is None:
            raise ValueError("algo.old_logprob=recompute needs LossInputs.old_logprobs")
        old_logprobs = inp.old_logprobs
    else:
        old_logprobs = inp.behavior_logprobs
    log_ratio = torch.where(valid, inp.logprobs - old_logprobs.detach(), 0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, inp.advantages.detach(), 0)
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    if cfg.dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.dual_clip * adv), surrogate)
    loss = -aggregate(surrogate, valid, cfg.loss_agg, inp.num_tokens, inp.num_seqs)

    ratio = ratio.detach()
    clipped_high = valid & (adv > 0) & (ratio > 1.0 + cfg.eps_high)
    clipped_low = valid & (adv < 0) & (ratio < 1.0 - cfg.eps_low)
    stats = {
        "clip_frac": _mean((clipped_high | clipped_low).double(), valid),
        "clip_frac_low": _mean(clipped_low.double(), valid),
        "clip_frac_high": _mean(clipped_high.double(), valid),
        "ratio_mean": _mean(ratio, valid),
        "ratio_max": _max(ratio, valid),
    }
    if cfg.dual_clip is not None:
        stats["dual_clip_frac"] = _mean(((adv < 0) & (ratio > cfg.dual_clip)).double(), valid)
    loss = _with_ref_kl(loss, inp, cfg, valid, stats)
    return loss, _floats(stats)


def _importance_weights(log_ratio: Tensor, valid: Tensor, cfg: AlgoConfig) -> tuple[Tensor, Tensor]:
    """(w [B, T], capped [B, T] bool) for `cfg.is_mode`; `log_ratio` is 0 at padding."""
    if cfg.is_mode == "none":
        return torch.ones_like(log_ratio), torch.zeros_like(valid)
    if cfg.is_mode == "token":
        raw = torch.exp(log_ratio)
    elif cfg.is_mode == "sequence":
        lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1)
        raw = torch.exp(log_ratio.sum(dim=-1, keepdim=True) / lengths).expand_as(log_ratio)
    else:
        raise ValueError(f"algo.is_mode: unknown importance weighting '{cfg.is_mode}'")
    return raw.clamp(max=cfg.is_cap), raw > cfg.is_cap


@register_loss("future_kl")
def future_kl_loss(inp: LossInputs, cfg: AlgoConfig) -> tuple[Tensor, dict[str, float]]:
    valid = inp.valid_mask()
    log_ratio = torch.where(valid, inp.logprobs.detach() - inp.behavior_logprobs.detach(), 0)
    credit = future_kl_credit(log_ratio, valid, cfg.horizon_tokens)
    charged = credit
    if cfg.future_cost_clip is not None:
        charged = credit.clamp(-cfg.future_cost_clip, cfg.future_cost_clip)
    weights, capped = _importance_weights(log_ratio, valid, cfg)
    adv = torch.where(valid, inp.advantages.detach(), 0)
    coef = torch.where(valid, weights * (adv - cfg.beta * charged), 0)
    loss = -aggregate(coef * inp.logprobs, valid, cfg.loss_agg, inp.num_tokens, inp.num_seqs)

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
