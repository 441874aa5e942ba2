"""Why not ratio clipping (docs/simulations.md, figure A-2): a Monte-Carlo of the PPO-clip gradient coefficient.

Setting: one token at a fixed importance ratio ρ, true advantage 0, observed advantage A = ±σ with
probability ½ each (pure baseline noise). The coefficient of ∇log π in the surrogate is
`∂/∂log π [min(ρA, clip(ρ)A)]`: `ρA` when the unclipped branch is active and 0 when the clipped one
is. Without clipping it is always `ρA`. The clipped coefficients are taken from autograd through the
project's own `ppo_clip` loss, so the simulation also exercises the loss code.

Closed forms (X the coefficient, ε the symmetric clip width):

- ρ > 1+ε: A = +σ is clipped (X = 0), A = −σ is not (X = −ρσ).
  E[X] = −ρσ/2 (a shift of −σ/2 per unit ratio), Var[X] = ρ²σ²/4.
- 1−ε ≤ ρ ≤ 1+ε: nothing is clipped, X = ±ρσ: E[X] = 0, Var[X] = ρ²σ².
- ρ < 1−ε: A = −σ is clipped, A = +σ is not: E[X] = +ρσ/2, Var[X] = ρ²σ²/4.
- No clipping, any ρ: E[X] = 0, Var[X] = ρ²σ².

So outside the trust region clipping turns zero-mean noise into a systematic push (towards ratio 1)
and hides three quarters of the noise (variance ρ²σ²/4 instead of ρ²σ²). At exactly ρ = 1±ε the closed form
counts the token as unclipped; autograd's tie-breaking there may differ.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from kv4rl.algo.config import AlgoConfig
from kv4rl.algo.logprobs import LOG_RATIO_LIMIT
from kv4rl.algo.losses import LossInputs, ppo_clip_loss


def closed_form(rho: float, eps: float, sigma: float) -> dict:
    """Exact mean and variance of the coefficient with and without clipping (module docstring)."""
    noclip = {"mean": 0.0, "var": (rho * sigma) ** 2}
    if rho > 1.0 + eps:
        clip, regime = {"mean": -rho * sigma / 2 + 0.0, "var": (rho * sigma) ** 2 / 4}, "above"  # + 0.0: no -0.0
    elif rho < 1.0 - eps:
        clip, regime = {"mean": rho * sigma / 2, "var": (rho * sigma) ** 2 / 4}, "below"
    else:
        clip, regime = dict(noclip), "inside"
    return {"regime": regime, "clip": clip, "noclip": noclip, "clip_mean_per_unit_ratio": clip["mean"] / rho}


def clip_coefficients(rho: float, eps: float, advantages: torch.Tensor) -> torch.Tensor:
    """Coefficient of ∇log π in the PPO-clip surrogate at ratio ρ, one per advantage sample."""
    num = advantages.numel()
    logprobs = torch.full((1, num), math.log(rho), dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(
        logprobs=logprobs,
        behavior_logprobs=torch.zeros(1, num, dtype=torch.float64),
        advantages=advantages.reshape(1, num).double(),
        mask=torch.ones(1, num, dtype=torch.bool),
        num_tokens=1.0,  # a plain sum, so each token's gradient is its own coefficient
    )
    loss, _ = ppo_clip_loss(inputs, AlgoConfig(loss="ppo_clip", eps_low=eps, eps_high=eps))
    (grad,) = torch.autograd.grad(loss, logprobs)
    return -grad.reshape(num)  # the loss is the negated surrogate


def _moments(samples: torch.Tensor) -> tuple[dict, dict]:
    num = samples.numel()
    mean = samples.mean()
    sq_dev = (samples - mean) ** 2
    var = sq_dev.mean()
    stats = {"mean": float(mean), "var": float(var)}
    stderr = {"mean": math.sqrt(float(var) / num), "var": math.sqrt(float(sq_dev.var(correction=0)) / num)}
    return stats, stderr


def check_log_ratio(rho: float, name: str) -> None:
    """The loss holds log ρ within ±LOG_RATIO_LIMIT and passes no gradient past it: a ρ out there gave a
    clipped coefficient of 0 beside the exact ∓σ/2 per unit ratio, without a word."""
    if abs(math.log(rho)) >= LOG_RATIO_LIMIT:
        raise ValueError(f"{name}: |log ρ| must be below {LOG_RATIO_LIMIT:g} (the loss holds the log-ratio there and "
                         f"passes no gradient past it), got ρ = {rho:g}")


def clip_bias(rho: float, eps: float, sigma: float, n_samples: int = 200_000, seed: int = 0) -> dict:
    """Monte-Carlo mean and variance of the coefficient with and without clipping.

    Returns `{"rho", "eps", "sigma", "n_samples", "seed", "clip": {"mean", "var"}, "noclip": {...},
    "stderr": {"clip": {...}, "noclip": {...}}, "closed_form": closed_form(rho, eps, sigma)}`.
    """
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    check_log_ratio(rho, "rho")
    if not 0 <= eps < 1:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if n_samples < 2:
        raise ValueError(f"n_samples must be >= 2, got {n_samples}")
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n_samples,), generator=generator, dtype=torch.float64) * 2 - 1
    advantages = sigma * signs
    clip_stats, clip_err = _moments(clip_coefficients(rho, eps, advantages))
    noclip_stats, noclip_err = _moments(rho * advantages)
    return {
        "rho": rho,
        "eps": eps,
        "sigma": sigma,
        "n_samples": n_samples,
        "seed": seed,
        "clip": clip_stats,
        "noclip": noclip_stats,
        "stderr": {"clip": clip_err, "noclip": noclip_err},
        "closed_form": closed_form(rho, eps, sigma),
    }


def _as_list(values: float | Iterable[float]) -> list[float]:
    return [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]


def sweep(
    rhos: Iterable[float],
    eps: float | Iterable[float] = 0.2,
    sigma: float | Iterable[float] = 1.0,
    n_samples: int = 200_000,
    seed: int = 0,
) -> list[dict]:
    """`clip_bias` over the product of ρ, ε and σ values (each may be a scalar or a sequence)."""
    grid = itertools.product(_as_list(eps), _as_list(sigma), _as_list(rhos))
    return [clip_bias(r, e, s, n_samples, seed + i) for i, (e, s, r) in enumerate(grid)]


def plot(results: list[dict], path_png: str | Path) -> Path:
    """Mean and variance of the coefficient against ρ, Monte-Carlo points on closed-form lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_mean, ax_var = fig.subplots(1, 2)
    curves = sorted({(r["eps"], r["sigma"]) for r in results})
    for eps, sigma in curves:
        rows = sorted((r for r in results if (r["eps"], r["sigma"]) == (eps, sigma)), key=lambda r: r["rho"])
        rhos = [r["rho"] for r in rows]
        dense = [rhos[0] + (rhos[-1] - rhos[0]) * i / 499 for i in range(500)]
        exact = [closed_form(rho, eps, sigma) for rho in dense]
        tag = f"ε={eps:g}, σ={sigma:g}"
        for ax, stat in ((ax_mean, "mean"), (ax_var, "var")):
            for branch, style in (("clip", "-"), ("noclip", "--")):
                line = ax.plot(dense, [e[branch][stat] for e in exact], style, label=f"{branch} {tag}")
                ax.plot(rhos, [r[branch][stat] for r in rows], "o", color=line[0].get_color(), markersize=3)
    for ax, title in ((ax_mean, "mean of ∇log π coefficient"), (ax_var, "variance of ∇log π coefficient")):
        ax.set_xlabel("importance ratio ρ")
        ax.set_title(title)
        ax.axhline(0.0, color="grey", linewidth=0.5)
        ax.legend(fontsize=7)
    fig.suptitle("PPO-clip under ±σ advantage noise (true advantage 0): lines exact, dots Monte-Carlo")
    fig.tight_layout()
    path = Path(path_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
