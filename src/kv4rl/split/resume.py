"""Resuming a split run: what its checkpoints record and where each rank continues.

A split run is asynchronous (how far the engines ran ahead depends on timing), so a resume cannot
repeat the run that stopped; it continues it consistently instead. The checkpoint of update u holds
the learner's weights, its AdamW state (DCP shards over the learner ranks, or the full state when the
learner is one rank), u, the job's world size and `rollout.engine_ranks`, and which groups of each
engine's share of the prompt stream the learner had consumed (or the engines dropped, `rollout.filter_groups`,
in the batches it consumed). On resume the learner continues at
update u; every engine loads the checkpoint's weights as version u, starts at its batch u and skips
the groups already consumed, so no group is lost or consumed twice. Batches sent but not consumed
before the stop, and responses in flight, are dropped and their groups sampled afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kv4rl.config import ConfigError, RunConfig
from kv4rl.trainer.checkpoint import CheckpointError


@dataclass
class Place:
    """One engine's share of the stream as the learner consumed it: every position below `next`,
    and the later positions in `beyond` (partial rollout delivers groups in completion order)."""

    next: int = 0
    beyond: set[int] = field(default_factory=set)

    def take(self, position: int) -> None:
        if position < self.next or position in self.beyond:
            raise RuntimeError(f"stream position {position} consumed twice")
        self.beyond.add(position)
        while self.next in self.beyond:
            self.beyond.discard(self.next)
            self.next += 1


class Consumed:
    """The groups the learner has consumed, by engine: engine e's position p is group p * K + e."""

    def __init__(self, engines: int, state: list[dict] | None = None):
        self.engines = engines
        self.places = [Place() for _ in range(engines)] if state is None else \
            [Place(s["next"], set(s["beyond"])) for s in state]

    def take(self, groups: list[int]) -> None:
        for g in groups:
            self.places[g % self.engines].take(g // self.engines)

    def state(self) -> list[dict]:
        return [{"next": p.next, "beyond": sorted(p.beyond)} for p in self.places]


def checkpoint_state(world: int, engines: int, learner: dict, consumed: Consumed | None) -> dict:
    """The trainer state of a split run's checkpoint (`consumed`: the head's; None on other ranks)."""
    return {"placement": "split", "world": world, "engine_ranks": engines, "learner": learner,
            "stream": consumed.state() if consumed is not None else None}


def check_split_resume(cfg: RunConfig, path: Path, state: dict, world: int) -> None:
    """Refuse, by name and before any work, a checkpoint this split job cannot continue."""
    if state.get("learner") is None or state.get("stream") is None:
        raise ConfigError(f"--resume {cfg.run_dir}: {path.name} holds the policy's weights only (written before "
                          f"split runs saved their optimizer and stream place); start a new run from it with "
                          f"model.path={path}")
    k = cfg.rollout.engine_ranks
    was_world, was_k = state["world"], state["engine_ranks"]
    if (was_world, was_k) != (world, k):
        raise CheckpointError(
            f"{path} was written by a split run of {was_world} ranks with rollout.engine_ranks={was_k}, and this "
            f"job has {world} ranks with rollout.engine_ranks={k}: each engine's place in the prompt stream "
            f"(groups e, e + K, ...) belongs to that layout. Resume it with torchrun --nproc-per-node {was_world} "
            f"and rollout.engine_ranks={was_k}, or start a new run from its policy with model.path={path}")
