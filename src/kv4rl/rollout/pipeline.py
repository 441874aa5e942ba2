"""Controlled staleness on top of a collector (docs/rollout.md): the lag buffer and the refresh schedule.

Lag is emulated exactly by generating ahead: a buffer of `lag` collected batches sits between the
engine and the learner, so the batch consumed by update u was collected while the engine held
version u - lag (the first `lag` batches, collected before any update, ramp 0..lag-1). Refresh:
the engine receives the learner's weights only after every `refresh_every`-th update.
"""

from __future__ import annotations

from collections import deque

from kv4rl.rollout.collector import Collector, GroupResult
from kv4rl.rollout.config import StalenessConfig


class RolloutPipeline:
    def __init__(self, collector: Collector, cfg: StalenessConfig):
        self.collector = collector
        self.cfg = cfg
        self.buffer: deque[list[GroupResult]] = deque()
        self.primed = False

    def next_batch(self) -> list[GroupResult]:
        """The batch for the next learner update (collecting a new one to keep the lag)."""
        if not self.primed:
            while len(self.buffer) < self.cfg.lag:
                self.buffer.append(self.collector.collect())
            self.primed = True
        self.buffer.append(self.collector.collect())
        return self.buffer.popleft()

    def refresh_due(self, update: int) -> bool:
        """Whether the engine takes the weights produced by `update` (0-based)."""
        return (update + 1) % self.cfg.refresh_every == 0

    def after_update(self, update: int, refreshed: bool) -> None:
        self.collector.settle()  # what the refresh's drain read, as a checkpoint saved now would hold it
        if refreshed:
            self.collector.on_refresh()
        # the next collected batch is consumed `lag` updates after the next one
        self.collector.drop_stale(update + 1 + self.cfg.lag, self.cfg.max_versions)

    def check_restored(self, next_update: int) -> None:
        """Hold restored work to this run's `max_versions`, which `--resume` may have lowered: the check
        `after_update(next_update - 1)` made under the saved bound, so with the bound unchanged nothing moves.
        The `lag` batches already collected are delivered as they are."""
        self.collector.drop_stale(next_update + self.cfg.lag, self.cfg.max_versions)

    def state_dict(self) -> dict:
        return {"buffer": list(self.buffer), "primed": self.primed, "collector": self.collector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = deque(state["buffer"])
        self.primed = state["primed"]
        self.collector.load_state_dict(state["collector"])
