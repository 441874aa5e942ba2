"""Settings of the learner's maths (the run config composes them under `algo` and `advantage`).

They live beside the functions that read them so each knob has one owner; `validate()` catches
values the type annotations cannot (ranges, cross-field rules) and names the offending key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

LossName = Literal["ppo_clip", "future_kl"]
LossAgg = Literal["token_mean", "seq_mean"]
OldLogprob = Literal["behavior", "recompute"]
ISMode = Literal["none", "token", "sequence"]


def _require_choice(key: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    """The policy loss (SPEC §3).

    PPO-clip reads `eps_low`, `eps_high`, `dual_clip` and `old_logprob`; future-KL credit reads
    `beta`, `horizon`, `is_mode`, `is_cap` and `future_cost_clip`. `kl_ref_coef > 0` adds the k3
    reference KL to either loss. `dual_clip` is the usual dual-clip constant c > 1: for negative
    advantages the surrogate is bounded below by c·A.
    """

    loss: LossName = "ppo_clip"
    loss_agg: LossAgg = "token_mean"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    old_logprob: OldLogprob = "behavior"
    beta: float = 0.3
    horizon: int | Literal["full"] = "full"
    is_mode: ISMode = "token"
    is_cap: float = 2.0
    future_cost_clip: float | None = None
    kl_ref_coef: float = 0.0

    @property
    def horizon_tokens(self) -> int | None:
        """The credit window in tokens, or None for the full tail."""
        return None if self.horizon == "full" else self.horizon

    def validate(self) -> None:
        _require_choice("algo.loss", self.loss, get_args(LossName))
        _require_choice("algo.loss_agg", self.loss_agg, get_args(LossAgg))
        _require_choice("algo.old_logprob", self.old_logprob, get_args(OldLogprob))
        _require_choice("algo.is_mode", self.is_mode, get_args(ISMode))
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"algo.eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"algo.eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"algo.dual_clip must be > 1 (or null), got {self.dual_clip}")
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
        if not self.kl_ref_coef >= 0.0:
            raise ValueError(f"algo.kl_ref_coef must be >= 0, got {self.kl_ref_coef}")


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """The advantage estimator (SPEC §2). `baseline_noise` is σ of the ±σ baseline perturbation."""

    estimator: Literal["grpo"] = "grpo"
    normalize_std: bool = True
    baseline_noise: float = 0.0

    def validate(self) -> None:
        _require_choice("advantage.estimator", self.estimator, ("grpo",))
        if not self.baseline_noise >= 0.0:
            raise ValueError(f"advantage.baseline_noise must be >= 0, got {self.baseline_noise}")
