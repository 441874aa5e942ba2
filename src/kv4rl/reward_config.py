"""The run's `reward` section: the verifier, the rewards added to it, and DAPO's overlong shaping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from kv4rl.config_loader import ConfigError


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """`name: auto` is `exact` for the embedded task and `math_verify` for dataset files. `extra` rewards are added
    to it, each times its `weights` entry (one per reward, `name` first; null: 1 each); `name` stays the verifier,
    whose own score counts for `accuracy` and the evaluation (`rewards.combined`)."""

    name: str = "auto"
    timeout_s: float = 5.0
    extra: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    # DAPO's overlong reward shaping: a response longer than rollout.max_new_tokens - overlong_buffer tokens
    # loses up to overlong_penalty, linearly to the cap (0: off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # AReaL's reward_bias, reward_scaling and reward_clip: each trained score becomes clip((r + bias) x scale, ±clip)
    bias: float = 0.0
    scale: float = 1.0
    clip: float | None = None
    # TRL's multi_objective_aggregation: `sum` (its sum_then_normalize) trains the weighted sum; `normalize_then_sum`
    # (GDPO) normalises each reward within its group before the weighted sum (the overlong penalty one of them,
    # weighted by overlong_penalty)
    aggregation: Literal["sum", "normalize_then_sum"] = "sum"

    def validate(self, max_new_tokens: int, estimator: str = "grpo") -> None:
        """Names registered (plug-ins imported first), each once; weights one per reward and finite; the overlong
        buffer inside `rollout.max_new_tokens`; GDPO's aggregation without a rescaling it would undo, and with an
        estimator that has groups to normalise in (`estimator`: advantage.estimator)."""
        from kv4rl.rewards import registered_rewards

        known = registered_rewards()
        if self.name != "auto" and self.name not in known:
            raise ConfigError(f"reward.name: unknown reward {self.name!r}; known: auto, {', '.join(known)}")
        for name in self.extra:
            if name not in known:
                raise ConfigError(f"reward.extra: unknown reward {name!r}; known: {', '.join(known)} (a reward of "
                                  "your own needs algo.plugins=[its module])")
        named = [n for n in (self.name, *self.extra) if n != "auto"]
        if len(set(named)) != len(named):
            raise ConfigError(f"reward.extra: each reward may be named once (reward.name={self.name}, "
                              f"reward.extra={self.extra})")
        if not 0 <= self.overlong_buffer < max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer must be in [0, rollout.max_new_tokens) (0: off), got "
                              f"{self.overlong_buffer} with rollout.max_new_tokens={max_new_tokens}")
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
            raise ConfigError(f"reward.overlong_penalty must be a finite number >= 0, got {self.overlong_penalty}")
        if not (math.isfinite(self.bias) and math.isfinite(self.scale) and self.scale != 0):
            raise ConfigError(f"reward.bias must be a finite number and reward.scale a finite one other than 0 (every "
                              f"score would be 0), got {self.bias} and {self.scale}")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"reward.clip must be a finite number > 0 (or null: no clip), got {self.clip}")
        weights = self.weights
        if weights is not None:
            if len(weights) != 1 + len(self.extra):
                raise ConfigError(f"reward.weights: {len(weights)} weights for {1 + len(self.extra)} rewards "
                                  "(one for reward.name, then one per reward.extra)")
            if not all(math.isfinite(w) for w in weights):
                raise ConfigError(f"reward.weights must be finite numbers, got {weights}")
        if self.aggregation == "normalize_then_sum":
            rescaling = [f"reward.{key}={value}" for key, value, default in (
                ("bias", self.bias, 0.0), ("scale", self.scale, 1.0), ("clip", self.clip, None)) if value != default]
            if rescaling:
                raise ConfigError(f"reward.aggregation=normalize_then_sum normalises each reward within its group, "
                                  f"which undoes {', '.join(rescaling)}; leave them at their defaults")
            if estimator == "remax":
                raise ConfigError("reward.aggregation=normalize_then_sum with advantage.estimator=remax: ReMax's "
                                  "baseline is the score of one greedy response, and a group of one normalises to 0; "
                                  "use reward.aggregation=sum")
