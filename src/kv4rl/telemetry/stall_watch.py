"""A warning for a run whose reward teaches nothing: every group's rewards equal, iteration after iteration.

Then every advantage is zero and so is the policy gradient; the metrics show it (`zero_var_group_frac` 1,
`adv_std` 0) but nothing says it, and the usual causes are mechanical: a reward that never matches the
answers' format, the wrong `reward.name`, or near-greedy sampling that gives a group identical responses.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

STALL_ITERATIONS = 3  # consecutive iterations without a reward signal before the warning


class StallWatch:
    """Fed every metrics row (`observe`); warns once, after `iterations` consecutive rows whose groups all
    had equal rewards and whose advantages were all zero (baseline noise, when on, keeps them apart)."""

    def __init__(self, iterations: int = STALL_ITERATIONS):
        self.iterations = iterations
        self.stalled: list[dict] = []
        self.warned = False

    def observe(self, row: dict) -> None:
        if self.warned:
            return
        if row.get("zero_var_group_frac") != 1.0 or row.get("adv_std") != 0.0:
            self.stalled = []
            return
        self.stalled.append(row)
        if len(self.stalled) < self.iterations:
            return
        self.warned = True
        first, last = self.stalled[0]["iteration"], self.stalled[-1]["iteration"]
        rewards = sorted({round(r["reward_mean"], 4) for r in self.stalled if r.get("reward_mean") is not None})
        log.warning("iterations %d-%d: every group's responses got equal rewards (reward_mean %s), so every "
                    "advantage was 0 and the reward taught nothing. Check reward.name and the answer format it "
                    "expects, or raise rollout.temperature if a group's responses are all alike",
                    first, last, ", ".join(f"{r:g}" for r in rewards) or "n/a")
