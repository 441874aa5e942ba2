"""`ppo_clip`'s `algo.*` keys (docs/objectives.md) and the rules among them, apart from the loss that reads them
(`kv4rl.algo.losses.ppo_clip_loss`) so that each can grow without the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from kv4rl.algo.off_policy import BEHAVIOR_IS_MODES, BehaviorIS
from kv4rl.algo.registry import require_choice
from kv4rl.algo.rejection import rejection_rules
from kv4rl.algo.surrogates import Surrogate


@dataclass(kw_only=True)
class PPOClipSettings:
    """`ppo_clip`'s keys: the clip range, the dual-clip constant c > 1 (null: off), π_old, and whether each token
    has its own ratio or every token of a response the response's (`sequence`: GSPO, TRL's
    importance_sampling_level=sequence: exp of the mean of its tokens' log-ratios, with its gradient).
    `behavior_is` weighs each token's surrogate by π_old/μ, the recomputed π_old over the engine's μ, truncated to
    or masked outside [`behavior_is_min`, `behavior_is_max`] (TRL's vllm_importance_sampling_*, AReaL's decoupled
    PPO; `behavior_importance_weights`), then divided by their mean over the learner batch with `behavior_is_normalize`
    (verl's rollout_is_batch_normalize). `behavior_rs` rejects the tokens or responses whose μ strayed too far from
    π_old (verl's rollout_rs, with `behavior_rs_threshold`; `kv4rl.algo.rejection`): with `recompute` the learner
    drops them from the batch before the update; with `behavior` (verl's bypass mode) each pass here drops from the
    surrogate the tokens whose π_θ strayed from μ, its denominators unchanged. `surrogate` swaps the clipped
    objective for CISPO's or SAPO's (TRL's loss_type cispo / sapo), which share π_old, the ratio level and the
    weights, for the plain policy gradient (`pg`, verl's gpg loss), which reads no ratio, for prime-rl's DPPO
    (`dppo`: A·ρ inside a trust region on p_θ − p_old, less `dppo_kl_coef`·(log ρ)²), for its IPO (`ipo`: the same
    inside |p_θ − p_old| <= `ipo_threshold`, less `ipo_kl_coef`·(log ρ)²) or TRL's VESPO (`vespo`: A·log π
    weighed by a Gamma function of the response's ratio; `kv4rl.algo.surrogates`). `off_policy_mask` = δ drops a
    response with A < 0 whose mean log μ − log π_θ is above δ (DeepSeek-V3.2, TRL's off_policy_mask_threshold;
    `off_policy_keep`). `kl_ref_unbiased` weighs each token's reference-KL term by the
    ratio, so that over π_old's samples it estimates the KL of π_θ (DeepSeek-V3.2, TRL's use_bias_correction_kl)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    old_logprob: Literal["behavior", "recompute"] = "behavior"
    ratio_level: Literal["token", "sequence"] = "token"
    behavior_is: BehaviorIS = "none"
    behavior_is_max: float | None = 3.0
    behavior_is_min: float | None = None
    behavior_is_normalize: bool = False
    behavior_rs: str | None = None
    behavior_rs_threshold: str | float | None = None
    off_policy_mask: float | None = None
    surrogate: Surrogate = "clip"
    cispo_max: float = 5.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    dppo_kl_coef: float = 1e-3
    ipo_threshold: float = 0.1
    ipo_kl_coef: float = 1e-3
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_ref_unbiased: bool = False

    def validate(self) -> None:
        require_choice("algo.old_logprob", self.old_logprob, ("behavior", "recompute"))
        require_choice("algo.ratio_level", self.ratio_level, ("token", "sequence"))
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"algo.eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"algo.eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"algo.dual_clip must be > 1 (or null), got {self.dual_clip}")
        require_choice("algo.behavior_is", self.behavior_is, BEHAVIOR_IS_MODES)
        require_choice("algo.surrogate", self.surrogate, get_args(Surrogate))
        if self.off_policy_mask is not None and not self.off_policy_mask >= 0.0:
            raise ValueError(f"algo.off_policy_mask must be >= 0 (the largest mean log μ − log π_θ a response of "
                             f"negative advantage may have; null: off), got {self.off_policy_mask}")
        for key in ("cispo_max", "sapo_tau_pos", "sapo_tau_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            if not getattr(self, key) > 0.0:
                raise ValueError(f"algo.{key} must be > 0, got {getattr(self, key)}")
        for key in ("dppo_mask_low", "dppo_mask_high", "dppo_kl_coef", "ipo_threshold", "ipo_kl_coef", "vespo_k_pos",
                    "vespo_k_neg"):
            if not getattr(self, key) >= 0.0:
                raise ValueError(f"algo.{key} must be >= 0, got {getattr(self, key)}")
        low, high = self.behavior_is_min, self.behavior_is_max
        if (low is not None and not low >= 0.0) or (high is not None and not high > 0.0):
            raise ValueError(f"algo.behavior_is_min must be >= 0 and algo.behavior_is_max > 0 (or null: no bound), "
                             f"got {low} and {high}")
        if low is not None and high is not None and not low < high:
            raise ValueError(f"algo.behavior_is_min ({low}) must be below algo.behavior_is_max ({high})")
        rejection_rules(self.behavior_rs, self.behavior_rs_threshold)  # names the option or threshold at fault

    def ignored_in_use(self) -> list[str]:
        """One line per key set away from its default that this surrogate does not read."""
        default, lines = PPOClipSettings(), []
        readers = {"eps_low": "clip", "eps_high": "clip", "cispo_max": "cispo", "sapo_tau_pos": "sapo",
                   "sapo_tau_neg": "sapo", "dppo_mask_low": "dppo", "dppo_mask_high": "dppo", "dppo_kl_coef": "dppo",
                   "ipo_threshold": "ipo", "ipo_kl_coef": "ipo",
                   **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), "vespo")}
        for key, reader in readers.items():
            if reader != self.surrogate and getattr(self, key) != getattr(default, key):
                cap = " (its cap is algo.cispo_max)" if key == "eps_high" and self.surrogate == "cispo" else ""
                lines.append(f"algo.{key}={getattr(self, key)!r} is read by algo.surrogate={reader} only; "
                             f"algo.surrogate={self.surrogate} ignores it{cap}")
        if self.behavior_rs is None and self.behavior_rs_threshold is not None:
            lines.append(f"algo.behavior_rs_threshold={self.behavior_rs_threshold!r} is read with algo.behavior_rs "
                         "only, which is null (no rejection)")
        if self.surrogate == "pg" and self.ratio_level != default.ratio_level:
            lines.append(f"algo.ratio_level={self.ratio_level} is read by the ratio, which algo.surrogate=pg does not "
                         "take (−A · log π)")
        return lines

    def check_in_use(self) -> None:
        """The rules that hold only when `ppo_clip` is the run's loss (another loss ignores these keys)."""
        if self.surrogate in ("dppo", "ipo") and self.ratio_level != "token":
            raise ValueError(f"algo.surrogate={self.surrogate} masks each token by its own probability's change and "
                             "weighs it by its own ratio: set algo.ratio_level=token")
        if self.surrogate == "vespo" and self.ratio_level != "token":
            raise ValueError("algo.surrogate=vespo weighs a response by the product of its tokens' ratios (TRL's "
                             "vespo needs importance_sampling_level=token too): set algo.ratio_level=token")
        if self.surrogate == "vespo" and self.behavior_is != "none":
            raise ValueError("algo.surrogate=vespo with algo.behavior_is: TRL folds its IS ratio into VESPO's sequence "
                             "weight, which does not exist here; set algo.behavior_is=none")
        if self.dual_clip is not None and self.surrogate != "clip":
            raise ValueError(f"algo.dual_clip bounds the clipped surrogate; algo.surrogate={self.surrogate} has no "
                             "clip to bound: set algo.dual_clip=null")
        if self.behavior_is_normalize and self.behavior_is == "none":
            raise ValueError("algo.behavior_is_normalize divides the behaviour weights by their batch mean, and "
                             "algo.behavior_is=none weighs nothing: set algo.behavior_is (verl's rollout_is) too")
        if self.behavior_is != "none" and self.old_logprob != "recompute":
            raise ValueError(f"algo.behavior_is={self.behavior_is} weighs by π_old/μ, the learner's recomputed "
                             "log-probs over the engine's; with algo.old_logprob=behavior π_old is μ and every weight "
                             "is 1: set algo.old_logprob=recompute")
