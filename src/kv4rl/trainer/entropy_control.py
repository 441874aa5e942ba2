"""The entropy bonus's coefficient (`algo.entropy_coeff`), fixed or adaptive (`algo.entropy_target`: Skywork-OR1's
control, TRL's use_adaptive_entropy). Adaptive, it applies only while the entropy measured at the end of the last
optimizer step was at or below the target (no step yet: not at all), and after every step moves by
`entropy_coeff_delta` toward more bonus when that step's entropy was at or below the target, toward less otherwise,
within [`entropy_coeff_min`, `entropy_coeff_max`]. The entropy is the mean per token over the step's trained tokens
(those `top_entropy_quantile` keeps), every rank's. The learner owns one and saves it with its checkpoints."""

from __future__ import annotations

import math

from kv4rl.trainer.rank_sums import global_counts


class EntropyControl:
    def __init__(self, coef: float, target: float | None = None, delta: float = 0.005, low: float = 0.0,
                 high: float = 1.0) -> None:
        self.coef, self.target, self.delta, self.low, self.high = coef, target, delta, low, high
        self.start = coef  # as configured: a resume that sets another starts the control from it
        self.last = math.inf  # the entropy of the last optimizer step (none yet)
        self._sum = self._count = 0.0

    @classmethod
    def from_algo(cls, algo) -> EntropyControl:
        return cls(algo.entropy_coeff, algo.entropy_target, algo.entropy_coeff_delta, algo.entropy_coeff_min,
                   algo.entropy_coeff_max)

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    @property
    def on(self) -> bool:
        """Whether the learner computes the bonus at all (adaptive: always, so that a coefficient moved to 0 can
        come back)."""
        return self.adaptive or self.coef != 0.0

    def applied(self) -> float:
        """The coefficient this step's passes use (each pass of a step the same)."""
        if self.adaptive and not self.last <= self.target:
            return 0.0
        return self.coef

    def observe(self, entropy_sum: float, tokens: float) -> None:
        """One pass's summed entropy over its trained tokens, and their count."""
        if self.adaptive:
            self._sum += entropy_sum
            self._count += tokens

    def step_end(self, group, world_size: int) -> dict[str, float]:
        """After an optimizer step (taken or skipped): the step's entropy over every rank, the coefficient moved
        for the next step; the metrics to log (`entropy_coeff`, and adaptive `entropy_control_entropy`)."""
        if not self.adaptive:
            return {"entropy_coeff": self.coef}
        total, count = global_counts(group, world_size, self._sum, self._count)
        self._sum = self._count = 0.0
        if count == 0:  # no token trained on any rank: nothing measured, nothing moved
            return {"entropy_coeff": self.coef}
        self.last = total / count
        if self.last <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        return {"entropy_coeff": self.coef, "entropy_control_entropy": self.last}

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last": self.last, "start": self.start}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """The coefficient goes on where it was, unless `algo.entropy_coeff` now differs from the one the run
        started with: a resume that sets it (its config.yaml records the new value) restarts the control from it."""
        self.last = float(state["last"])
        if "start" not in state or float(state["start"]) == self.start:
            self.coef = float(state["coef"])
