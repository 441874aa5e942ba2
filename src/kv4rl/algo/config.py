"""Settings of the learner's maths (the run config composes them under `algo` and `advantage`).

They live beside the functions that read them so each knob has one owner; `validate()` catches
values the type annotations cannot (ranges, cross-field rules) and names the offending key.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

import kv4rl.algo.losses  # noqa: F401  (registers the built-in losses before any config is read)
from kv4rl.algo.aggregation import AggMode
from kv4rl.algo.logprobs import KL_TYPES, KLType
from kv4rl.algo.registry import COMMON_KEYS, LOSSES, get_loss, import_plugins, key_owner, require_choice

# the estimators that whiten their advantages over the batch's tokens (REINFORCE++), weighing responses by length
TOKEN_WEIGHTED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


class AlgoConfig:
    """The policy loss (docs/objectives.md): the keys every loss shares plus each registered loss's settings.

    `loss` names a registered loss; `loss_agg` reduces its per-token terms, and `loss_norm_tokens` is
    `token_sum_norm`'s constant length (null: the run's `rollout.max_new_tokens`); `kl_ref_coef > 0` adds the reference
    KL penalty `kl_ref_type` to it (k3, or verl's k1, k2, abs; each token's capped at `kl_ref_clamp` where set, as
    verl's low_var_kl caps k3 at 10); `entropy_coeff` (0: off) subtracts that many times
    the policy's entropy, aggregated as the loss (verl's entropy_coeff; the learner adds it to any loss), a starting
    value that `entropy_target` turns adaptive (Skywork-OR1's control, TRL's use_adaptive_entropy: applied only while
    the last step's entropy was at or below the target, and moved by `entropy_coeff_delta` within
    [`entropy_coeff_min`, `entropy_coeff_max`] after every optimizer step; `kv4rl.trainer.entropy_control`);
    `top_entropy_quantile` < 1 keeps each micro-batch's highest-entropy tokens in the loss (TRL's); `plugins`
    lists modules to import first, which register more losses. Every other `algo.*` key belongs to
    one loss's settings dataclass (see `registry`) and reads back as an attribute (`cfg.eps_low`)
    or through the whole section (`cfg.section("ppo_clip")`). The keys are not a fixed list, so
    this is not a dataclass: the config loader asks `config_schema()` and `config_values()`.
    """

    __slots__ = ("_sections", "entropy_coeff", "entropy_coeff_delta", "entropy_coeff_max", "entropy_coeff_min",
                 "entropy_target", "kl_ref_clamp", "kl_ref_coef", "kl_ref_type", "loss", "loss_agg", "loss_norm_tokens",
                 "plugins", "top_entropy_quantile")

    def __init__(self, *, loss: str = "ppo_clip", loss_agg: AggMode = "token_mean", loss_norm_tokens: int | None = None,
                 kl_ref_coef: float = 0.0, kl_ref_type: KLType = "k3", kl_ref_clamp: float | None = None,
                 entropy_coeff: float = 0.0, entropy_target: float | None = None, entropy_coeff_delta: float = 0.005,
                 entropy_coeff_min: float = 0.0, entropy_coeff_max: float = 1.0,
                 top_entropy_quantile: float = 1.0, plugins: list[str] | None = None, **loss_keys: Any):
        self.plugins = list(plugins or [])
        import_plugins(self.plugins)  # before the keys below: a plugin's loss owns some of them
        self.loss, self.loss_agg, self.kl_ref_coef, self.kl_ref_clamp = loss, loss_agg, kl_ref_coef, kl_ref_clamp
        self.loss_norm_tokens, self.entropy_coeff, self.kl_ref_type = loss_norm_tokens, entropy_coeff, kl_ref_type
        self.top_entropy_quantile = top_entropy_quantile
        self.entropy_target, self.entropy_coeff_delta = entropy_target, entropy_coeff_delta
        self.entropy_coeff_min, self.entropy_coeff_max = entropy_coeff_min, entropy_coeff_max
        self._sections: dict[str, Any] = {}
        for key, value in loss_keys.items():
            try:
                setattr(self, key, value)
            except AttributeError as exc:
                raise TypeError(f"AlgoConfig: {exc}") from None

    def section(self, loss: str) -> Any:
        """Loss `loss`'s settings (an instance of its settings dataclass; None if it has none)."""
        if loss not in self._sections:
            settings = get_loss(loss).settings
            self._sections[loss] = None if settings is None else settings()
        return self._sections[loss]

    def _owner(self, name: str) -> str:
        owner = key_owner(name)
        if owner is None:  # a read-only property of a settings class, e.g. horizon_tokens
            owner = next((n for n, spec in LOSSES.items()
                          if isinstance(getattr(spec.settings, name, None), property)), None)
        if owner is None:
            raise AttributeError(f"'algo.{name}' is not a key of any registered loss "
                                 f"(registered: {', '.join(sorted(LOSSES))})")
        return owner

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not slots
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.section(self._owner(name)), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in AlgoConfig.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.section(self._owner(name)), name, value)

    @classmethod
    def config_schema(cls) -> dict[str, Any]:
        """Every `algo.*` key with its type annotation: the shared keys, then each loss's."""
        hints = typing.get_type_hints(cls.__init__)
        schema = {key: hints[key] for key in COMMON_KEYS}
        schema["plugins"] = list[str]  # null is the constructor's convenience, not a config value
        for spec in LOSSES.values():
            if spec.settings is not None:
                hints = typing.get_type_hints(spec.settings)
                schema.update({key: hints[key] for key in spec.keys()})
        return schema

    def config_values(self) -> dict[str, Any]:
        values = {key: getattr(self, key) for key in COMMON_KEYS}
        for name, spec in LOSSES.items():
            values.update({key: getattr(self.section(name), key) for key in spec.keys()})
        return values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AlgoConfig) and self.config_values() == other.config_values()

    def __repr__(self) -> str:
        return f"AlgoConfig({', '.join(f'{k}={v!r}' for k, v in self.config_values().items())})"

    def validate(self) -> None:
        """Values of every loss's keys (a typo in an unused section is still a typo)."""
        if self.loss not in LOSSES:
            raise ValueError(f"algo.loss: unknown loss {self.loss!r} (registered: {', '.join(sorted(LOSSES))}; "
                             "a loss of your own needs algo.plugins=[its module])")
        require_choice("algo.loss_agg", self.loss_agg, typing.get_args(AggMode))
        if self.loss_norm_tokens is not None and not self.loss_norm_tokens >= 1:
            raise ValueError(f"algo.loss_norm_tokens must be >= 1 (or null: rollout.max_new_tokens), "
                             f"got {self.loss_norm_tokens}")
        require_choice("algo.kl_ref_type", self.kl_ref_type, KL_TYPES)
        if not self.kl_ref_coef >= 0.0:
            raise ValueError(f"algo.kl_ref_coef must be >= 0, got {self.kl_ref_coef}")
        if not math.isfinite(self.entropy_coeff):
            raise ValueError(f"algo.entropy_coeff must be a finite number (0: no entropy bonus; < 0 minimises the "
                             f"entropy), got {self.entropy_coeff}")
        if self.entropy_target is not None and not 0.0 < self.entropy_target < math.inf:
            raise ValueError(f"algo.entropy_target must be > 0 (the mean entropy per token, in nats, below which the "
                             f"bonus applies; null: a fixed algo.entropy_coeff), got {self.entropy_target}")
        low, high, delta = self.entropy_coeff_min, self.entropy_coeff_max, self.entropy_coeff_delta
        if not (math.isfinite(low) and math.isfinite(high) and low <= high and 0.0 <= delta < math.inf):
            raise ValueError(f"algo.entropy_coeff_min <= algo.entropy_coeff_max (finite) and algo.entropy_coeff_delta "
                             f">= 0 are needed, got {low}, {high} and {delta}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"algo.top_entropy_quantile must be in [0, 1] (the share of each learner pass's tokens "
                             f"kept in the loss, by entropy; 1: all), got {self.top_entropy_quantile}")
        if self.kl_ref_clamp is not None and not self.kl_ref_clamp > 0.0:
            raise ValueError(f"algo.kl_ref_clamp must be > 0 (or null: no cap), got {self.kl_ref_clamp}")
        if self.kl_ref_coef > 0 and "ref_logprobs" not in get_loss(self.loss).inputs(self):
            raise ValueError(f"algo.kl_ref_coef: algo.loss={self.loss} does not read reference log-probs, "
                             "so it cannot add the reference KL; set algo.kl_ref_coef=0")
        for name in LOSSES:
            validate = getattr(self.section(name), "validate", None)
            if validate is not None:
                validate()
        check_in_use = getattr(self.section(self.loss), "check_in_use", None)
        if check_in_use is not None:
            check_in_use()

    def norm_tokens(self, max_new_tokens: int | None) -> int | None:
        """`token_sum_norm`'s constant length: `loss_norm_tokens`, else the run's `max_new_tokens`."""
        length = self.loss_norm_tokens or max_new_tokens
        if self.loss_agg == "token_sum_norm" and length is None:
            raise ValueError("algo.loss_agg=token_sum_norm divides by a constant length: set algo.loss_norm_tokens "
                             "(a run passes its rollout.max_new_tokens)")
        return length

    def ignored_keys(self) -> list[str]:
        """One line per key set away from its default in the section of a loss this run does not
        use, or that another key leaves without effect or turns from what it says. Not an error: a config written for
        one loss stays loadable with `algo.loss` switched."""
        lines = []
        if self.kl_ref_type != "k3" and not self.kl_ref_coef > 0:
            lines.append(f"algo.kl_ref_type={self.kl_ref_type} is the penalty algo.kl_ref_coef weighs; with "
                         f"algo.kl_ref_coef={self.kl_ref_coef} no penalty is added and it changes nothing")
        if self.entropy_target is None and (self.entropy_coeff_delta, self.entropy_coeff_min,
                                            self.entropy_coeff_max) != (0.005, 0.0, 1.0):
            lines.append("algo.entropy_coeff_delta, _min and _max move the coefficient of algo.entropy_target's "
                         "adaptive control, which is null (off): algo.entropy_coeff stays as set")
        if self.loss_norm_tokens is not None and self.loss_agg != "token_sum_norm":
            lines.append(f"algo.loss_norm_tokens={self.loss_norm_tokens} is read by algo.loss_agg=token_sum_norm "
                         f"only; algo.loss_agg={self.loss_agg} ignores it")
        if getattr(self.section(self.loss), "kl_ref_unbiased", False) and not self.kl_ref_coef > 0:
            lines.append(f"algo.kl_ref_unbiased weighs the penalty algo.kl_ref_coef adds; with algo.kl_ref_coef="
                         f"{self.kl_ref_coef} no penalty is added and it changes nothing")
        if (getattr(self.section(self.loss), "ratio_level", "token") == "sequence" and self.loss_agg != "seq_mean"
                and getattr(self.section(self.loss), "surrogate", "clip") != "pg"):  # pg takes no ratio: said there
            lines.append(f"algo.ratio_level=sequence gives every token of a response its one ratio, and "
                         f"algo.loss_agg={self.loss_agg} sums over tokens, so a response weighs by its length instead "
                         "of GSPO's per-response objective; algo.loss_agg=seq_mean is GSPO's (TRL warns alike)")
        in_use = getattr(self.section(self.loss), "ignored_in_use", None)
        if in_use is not None:
            lines += in_use()
        for name, spec in LOSSES.items():
            if name == self.loss or spec.settings is None:
                continue
            current, default = self.section(name), spec.settings()
            lines += [f"algo.{key}={getattr(current, key)!r} belongs to algo.loss={name}; "
                      f"algo.loss={self.loss} ignores it{_BETA_HINT if key == 'beta' else ''}"
                      for key in spec.keys() if getattr(current, key) != getattr(default, key)]
        return lines


_BETA_HINT = " (TRL's beta, the reference-KL coefficient, is algo.kl_ref_coef)"


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """The advantage estimator (docs/objectives.md): `grpo`, `rloo` (the leave-one-out baseline, no std), or
    REINFORCE++'s `reinforce_plus_plus_baseline` (the group mean, then whitened over the batch's tokens) and
    `reinforce_plus_plus` (the rewards whitened so), and verl's `opo` (the length-weighted group mean), `grpo_passk`
    (only the best response, by its lead), `gpg` (the group mean, scaled up by the rewarded share), `remax` (the
    score of a greedy response to the prompt, sampled beside each group and not trained on) and `optimal_token_baseline`
    (a baseline per token from the group's returns weighed by each path's accumulated variance); or `raw`, the reward
    itself (AReaL's without reward_norm).
    `normalize_std` divides GRPO's (and `grpo_passk`'s) by the std of each group's rewards, or with
    `std_scope: batch` GRPO's by the std of the whole learner batch's (TRL's `scale_rewards: batch`).
    `baseline_noise` is σ of the ±σ baseline perturbation. `kl_reward_coef` > 0 takes that many times each response's
    summed KL to the reference (`kl_reward_type`, k1 by default as verl's) off its score first (`algo.kl_reward`),
    fixed or, with `kl_reward_control: adaptive`, moved toward a mean KL of `kl_reward_target` per token over
    `kl_reward_horizon` responses (verl's kl_ctrl). `whiten` then whitens the advantages over the batch's response
    tokens (AReaL's adv_norm at batch level, `whiten_over_tokens`)."""

    estimator: Literal["grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "opo", "grpo_passk",
                       "gpg", "remax", "raw", "optimal_token_baseline"] = "grpo"
    normalize_std: bool = True
    std_scope: Literal["group", "batch"] = "group"
    baseline_noise: float = 0.0
    kl_reward_coef: float = 0.0
    kl_reward_type: KLType = "k1"
    kl_reward_control: Literal["fixed", "adaptive"] = "fixed"
    kl_reward_target: float = 0.1
    kl_reward_horizon: float = 10000.0
    whiten: bool = False

    def zero_advantage_mover(self) -> str | None:
        """The setting that moves a flat group's advantage away from exactly 0 (so `trainer.mask_zero_advantage`
        would find none), or None."""
        if self.whiten:
            return "advantage.whiten"
        if self.estimator in TOKEN_WEIGHTED:
            return f"advantage.estimator={self.estimator} (whitened over the batch's tokens)"
        if self.estimator == "optimal_token_baseline":
            return "advantage.estimator=optimal_token_baseline (an advantage per token)"
        if self.baseline_noise > 0:
            return "advantage.baseline_noise"
        return None

    def validate(self) -> None:
        require_choice("advantage.estimator", self.estimator,
                       typing.get_args(typing.get_type_hints(AdvantageConfig)["estimator"]))
        require_choice("advantage.std_scope", self.std_scope, ("group", "batch"))
        require_choice("advantage.kl_reward_type", self.kl_reward_type, KL_TYPES)
        if not self.kl_reward_coef >= 0.0:
            raise ValueError(f"advantage.kl_reward_coef must be >= 0 (0: no KL in the reward), got {self.kl_reward_coef}")
        require_choice("advantage.kl_reward_control", self.kl_reward_control, ("fixed", "adaptive"))
        if self.kl_reward_control == "adaptive" and not self.kl_reward_coef > 0:
            raise ValueError("advantage.kl_reward_control=adaptive starts from advantage.kl_reward_coef, which "
                             f"is {self.kl_reward_coef}: set it > 0 (verl's kl_ctrl.kl_coef, 0.001 there)")
        if not (self.kl_reward_target > 0 and math.isfinite(self.kl_reward_target)):
            raise ValueError(f"advantage.kl_reward_target must be > 0 (the mean KL per token the adaptive "
                             f"controller aims at), got {self.kl_reward_target}")
        if not (self.kl_reward_horizon > 0 and math.isfinite(self.kl_reward_horizon)):
            raise ValueError(f"advantage.kl_reward_horizon must be > 0 (responses over which β moves), got "
                             f"{self.kl_reward_horizon}")
        if not self.baseline_noise >= 0.0:
            raise ValueError(f"advantage.baseline_noise must be >= 0, got {self.baseline_noise}")
        if self.whiten and self.estimator in TOKEN_WEIGHTED:
            raise ValueError(f"advantage.whiten: advantage.estimator={self.estimator} whitens its advantages over the "
                             "batch's tokens already; set advantage.whiten=false")
        if self.estimator == "optimal_token_baseline":
            for on, key in ((self.kl_reward_coef > 0, "advantage.kl_reward_coef"), (self.whiten, "advantage.whiten"),
                            (self.baseline_noise > 0, "advantage.baseline_noise")):
                if on:
                    raise ValueError(f"advantage.estimator=optimal_token_baseline gives each token its own advantage "
                                     f"from the scores alone; {key} is not built for it: set it off")
        if self.estimator == "remax" and self.kl_reward_coef > 0:
            raise ValueError("advantage.estimator=remax with advantage.kl_reward_coef > 0: verl then gives each token "
                             "its own return less the greedy baseline, which is not built here; set "
                             "advantage.kl_reward_coef=0 (a reference KL in the loss, algo.kl_ref_coef, works)")
        if self.kl_reward_coef > 0 and self.estimator == "reinforce_plus_plus" and self.baseline_noise > 0:
            raise ValueError("advantage.baseline_noise perturbs a response's one advantage; with "
                             "advantage.estimator=reinforce_plus_plus and advantage.kl_reward_coef > 0 each token has "
                             "its own (its return): set advantage.baseline_noise=0")
