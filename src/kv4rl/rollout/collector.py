"""Collect learner batches from the engine: synchronous or quota-based partial rollout (docs/rollout.md).

Prompt groups are numbered in the order they are drawn from the problem stream; response j of group
g on attempt a samples with a seed derived from (run seed, g, j, a), so its tokens do not depend on
scheduling. In `partial` mode the engine's slots are topped up with new groups before every step;
as soon as `quota_groups` groups are complete, exactly those leave in completion order, and every
unfinished response stays resident (its tokens, behaviour log-probs and versions kept) to continue
after the weight update. `max_versions` drops responses that would be too stale when consumed and
re-samples them; nothing is lost or delivered twice. With `filter_groups` a complete group whose responses
all scored the same (`score_group`) is dropped instead of delivered (`take_filtered` lists them).

With several data-parallel ranks (`kv4rl.distributed`) each rank's collector takes every
`world`-th group of the stream (group g goes to rank g mod world) and `quota_groups / world` of
each learner batch, so the ranks' groups never overlap and their union is the single-process stream.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kv4rl.data.prompts import PromptFormatter
from kv4rl.data.source import ProblemSource
from kv4rl.data.types import Problem
from kv4rl.distributed import Ranks
from kv4rl.engine.llm import Engine
from kv4rl.engine.sampler import request_seed
from kv4rl.engine.sequence import Completion, SamplingParams, Sequence
from kv4rl.rewards.base import RewardResult
from kv4rl.rollout.config import RolloutConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GroupResult:
    """One complete prompt group, as handed to the learner; `reward`: its responses' scores where the collector
    scored it (`filter_groups`), so the run does not score it again (read with getattr: older checkpoints' groups
    have no such slot); `baseline`: with `greedy_baseline`, the group's greedy response (ReMax's baseline)."""

    index: int
    problem: Problem
    prompt_ids: list[int]
    completions: list[Completion]
    reward: RewardResult | None = None
    baseline: Completion | None = None  # ReMax's greedy response to the prompt (not trained on)


@dataclass(slots=True)
class _Group:
    index: int
    problem: Problem
    prompt_ids: list[int]
    done: list[Completion | None]
    attempts: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.done)


class Collector:
    def __init__(self, engine: Engine, source: ProblemSource, formatter: PromptFormatter, cfg: RolloutConfig,
                 seed: int, max_tokens_fn: Callable[[int, int], int] | None = None, ranks: Ranks = Ranks(),
                 score_group: Callable[[GroupResult], RewardResult] | None = None, greedy_baseline: bool = False):
        """`max_tokens_fn(group, j)` overrides the response length limit (benchmarks script lengths).
        `ranks`: this data-parallel rank's place (its share of the groups). `score_group`: the run's score of
        each response of a complete group, which `cfg.filter_groups` needs. `greedy_baseline`: each group also
        samples one greedy response (temperature 0, the last of its `done`), handed over as its `baseline` and
        completing with it (`advantage.estimator=remax`)."""
        if cfg.filter_groups and score_group is None:
            raise ValueError("rollout.filter_groups needs the responses' scores (score_group)")
        if cfg.quota_groups % ranks.world:
            raise ValueError(f"rollout.quota_groups={cfg.quota_groups} must split evenly over {ranks.world} ranks "
                             "(a prompt group is never split across engines)")
        self.engine, self.source, self.formatter, self.cfg, self.seed = engine, source, formatter, cfg, seed
        self.ranks = ranks
        self.quota = cfg.quota_groups // ranks.world
        self.max_tokens_fn = max_tokens_fn
        self.greedy_baseline = greedy_baseline
        self.per_group = cfg.group_size + (1 if greedy_baseline else 0)  # requests a group submits
        self.next_group = 0
        self.groups: dict[int, _Group] = {}
        self.ready: deque[int] = deque()  # complete groups not yet delivered, completion order
        self.trace: list[dict] = []
        self.num_dropped = 0
        self.skip: set[int] = set()  # positions of this rank's share already consumed before a resume
        self.score_group = score_group
        self.filtered: list[int] = []  # groups dropped for equal scores since the last `take_filtered`
        self.filtered_stats: dict[str, float] = {}  # ... their reward counts (timeouts, no_answer), summed
        self.filtered_now = 0  # ... in the collection under way (capped at filter_max_batches - 1 batches)
        self.scored: dict[int, RewardResult] = {}  # complete groups' scores (filter_groups), handed on with them
        self.said_capped = False
        # called before every engine step: a split run's engine takes new weights here (`kv4rl.split`)
        self.before_step: Callable[[], None] | None = None

    # ---- collection -------------------------------------------------------------------------
    def collect(self) -> list[GroupResult]:
        """Run the engine until a learner batch of `quota_groups` complete groups is ready."""
        quota = self.quota
        for index in [i for i in self.ready if self.cfg.filter_groups]:  # kept past the last batch's cap: this
            if self._dropped(self.groups[index]):  # batch's cap may drop them
                self.ready.remove(index)
        if self.cfg.mode == "sync":
            while len(self.ready) < quota:
                while len(self.groups) < quota:  # a dropped group's place is taken by the next one
                    self._start_group()
                self._step()
        else:
            while len(self.ready) < quota:
                self._top_up()
                self._step()
        out = []
        for _ in range(quota):
            g = self.groups.pop(self.ready.popleft())
            n = self.cfg.group_size
            out.append(GroupResult(g.index, g.problem, g.prompt_ids, list(g.done[:n]),  # type: ignore[arg-type]
                                   self.scored.pop(g.index, None), g.done[n] if self.greedy_baseline else None))
        if self.cfg.mode == "sync":
            out.sort(key=lambda g: g.index)  # the whole batch ends together: keep prompt order
        self.filtered_now = 0  # groups that complete from here on (a drain after the update) count for the next
        return out

    def _top_up(self) -> None:
        while self.engine.num_unfinished() < self.cfg.max_slots:  # no read of the step in flight
            self._start_group()

    def start_at(self, next_group: int, consumed: list[int]) -> None:
        """Continue this rank's share of the stream at position `next_group`, passing over the later
        positions in `consumed` (a resumed split run: groups the learner already took, `kv4rl.split`)."""
        self.next_group, self.skip = next_group, set(consumed)

    def _start_group(self) -> None:
        while self.next_group in self.skip:
            self.skip.discard(self.next_group)
            self.next_group += 1
        index = self.next_group * self.ranks.world + self.ranks.rank
        self.next_group += 1
        problem = self.source.problem_at(index)
        group = _Group(index, problem, self.formatter.ids(problem), [None] * self.per_group, [0] * self.per_group)
        self.groups[index] = group
        for j in range(self.per_group):
            self._submit(group, j)

    def _params(self, group: int, j: int) -> SamplingParams:
        c = self.cfg
        max_tokens = c.max_new_tokens if self.max_tokens_fn is None else self.max_tokens_fn(group, j)
        if j == c.group_size:  # the greedy baseline: the argmax at every step, so no truncation applies
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=self.max_tokens_fn is not None)
        return SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, min_p=c.min_p,
                              max_tokens=max_tokens,
                              ignore_eos=self.max_tokens_fn is not None)

    def _submit(self, group: _Group, j: int, resume_from: Completion | None = None) -> Sequence:
        seed = request_seed(self.seed, (group.index * self.cfg.group_size + j) * 1_009 + group.attempts[j])
        return self.engine.add_request(group.prompt_ids, self._params(group.index, j), tag=(group.index, j),
                                       sample_seed=seed, resume_from=resume_from)

    def _step(self) -> None:
        if self.before_step is not None:
            self.before_step()
        if not self.engine.has_unfinished():  # an idle engine's step returns nothing: this loop would spin
            raise RuntimeError(f"the engine is idle with {len(self.ready)} of {self.quota} groups ready: "
                               "requests of this batch were lost")
        finished = self.engine.step()
        self.trace += [dict(step) for step in self.engine.take_drained_steps()]  # read by a refresh's drain
        if self.engine.step_was_read:  # else it only handed over what a drain read: that step is traced above
            self.trace.append(dict(self.engine.last_step))
        self._record(finished)

    def _record(self, finished: list[Sequence]) -> None:
        for seq in sorted(finished, key=lambda s: s.tag):
            index, j = seq.tag
            group = self.groups[index]
            group.done[j] = Completion.from_sequence(seq)
            if group.complete and not self._dropped(group):
                self.ready.append(index)

    def _dropped(self, group: _Group) -> bool:
        """Drop a complete group whose responses all scored the same (`filter_groups`), within the cap."""
        cap = (self.cfg.filter_max_batches - 1) * self.quota if self.cfg.filter_max_batches else None
        if not self.cfg.filter_groups or (cap is not None and self.filtered_now >= cap):
            return False
        if group.index not in self.scored:  # scored once (a resumed run scores its held groups again)
            self.scored[group.index] = self.score_group(
                GroupResult(group.index, group.problem, group.prompt_ids, list(group.done[:self.cfg.group_size])))
        scores = self.scored[group.index].scores
        if max(scores) != min(scores):
            return False
        for key, value in self.scored.pop(group.index).stats.items():
            self.filtered_stats[key] = self.filtered_stats.get(key, 0.0) + float(value)
        del self.groups[group.index]
        self.filtered.append(group.index)
        self.filtered_now += 1
        if self.filtered_now == cap and not self.said_capped:
            self.said_capped = True  # once a run: a policy that gets most groups all right or all wrong hits it often
            log.warning("rollout.filter_groups dropped %d groups of equal scores while collecting one batch "
                        "(rollout.filter_max_batches=%d batches' worth); the rest are kept as they come (said once; "
                        "filtered_groups and zero_var_group_frac count them)", self.filtered_now,
                        self.cfg.filter_max_batches)
        return True

    def take_filtered(self) -> list[int]:
        """The groups dropped for equal scores since the last call (a split run's head marks them used)."""
        dropped, self.filtered = self.filtered, []
        return dropped

    def take_filtered_stats(self) -> dict[str, float]:
        """The reward counts of the groups dropped since the last call (logged `reward_filtered_<count>`: a check
        that timed out in a dropped group counts too)."""
        stats, self.filtered_stats = self.filtered_stats, {}
        return stats

    # ---- weight updates ---------------------------------------------------------------------
    def on_refresh(self) -> None:
        """The engine received new weights: with `carry: recompute`, re-prefill every resident response."""
        if self.cfg.carry == "recompute":
            self.engine.recompute_all()

    def settle(self) -> None:
        """Take over what a drain (a weight refresh, sleep, `unfinished`; async scheduling) left in the engine
        for its next `step`: the responses that stopped in the step it read, into their groups, and that
        step's trace row. Called after every learner update, so a checkpoint taken then changes nothing: the
        run that saves goes on exactly as one that does not, and as one resumed from the save. (It reads
        the step launched ahead, long finished by then, a few ms before the next collection would have.)"""
        self._record(self.engine.take_stopped())
        self.trace += [dict(step) for step in self.engine.take_drained_steps()]

    def drop_stale(self, next_consumer: int, max_versions: int | None) -> None:
        """Re-sample held responses whose oldest token would be more than `max_versions` versions
        old at learner update `next_consumer` (in the engine, or finished in an incomplete group)."""
        if max_versions is None:
            return
        # responses that stopped in the step a refresh drained (async scheduling) are held too: record them
        # first, or they would pass this check and reach the learner older than allowed
        self.settle()
        too_old = lambda versions: bool(versions) and next_consumer - min(versions) > max_versions
        for seq in self.engine.unfinished():
            if too_old(seq.output_versions):
                self.engine.abort(seq)
                self._redo(*seq.tag)
        for index, group in self.groups.items():
            for j, c in enumerate(group.done):
                if c is not None and too_old(c.versions):
                    if index in self.ready:
                        self.ready.remove(index)
                    self.scored.pop(index, None)  # its scores change with the re-sampled response
                    group.done[j] = None
                    self._redo(index, j)

    def _redo(self, index: int, j: int) -> None:
        group = self.groups[index]
        group.attempts[j] += 1
        self.num_dropped += 1
        self._submit(group, j)

    def take_trace(self) -> list[dict]:
        """The engine steps recorded since the last call (one dict per step), handed over once."""
        trace, self.trace = self.trace, []
        return trace

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything in flight: groups, finished and partial responses in engine queue order. Responses
        that stopped in a drained step are recorded in their groups first (neither running nor in a group,
        they were saved nowhere, and their group never completed after a resume). So are the trace rows not
        yet handed over, the drained step's among them (it waited in the engine for the next `step`)."""
        self.settle()
        in_engine = [(seq.tag, Completion.from_sequence(seq)) for seq in self.engine.unfinished()]
        return {
            "next_group": self.next_group,
            "ready": list(self.ready),
            "num_dropped": self.num_dropped,
            "groups": [(g.index, g.problem, g.prompt_ids, g.done, g.attempts) for g in self.groups.values()],
            "in_engine": in_engine,
            "trace": [dict(step) for step in self.trace],
            "filtered": (self.filtered, self.filtered_now, self.said_capped),
            "filtered_stats": dict(self.filtered_stats),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore in-flight work into an empty engine; partial responses are re-prefilled."""
        assert not self.engine.unfinished(), "restore needs an empty engine"
        self.next_group = state["next_group"]
        self.ready = deque(state["ready"])
        self.num_dropped = state["num_dropped"]
        self.trace = [dict(step) for step in state.get("trace", [])]  # checkpoints before it was saved: none
        self.filtered, self.filtered_now, self.said_capped = state.get("filtered", ([], 0, False))
        self.filtered_stats = dict(state.get("filtered_stats", {}))
        self.groups = {i: _Group(i, p, ids, list(done), list(att)) for i, p, ids, done, att in state["groups"]}
        for (index, j), partial in state["in_engine"]:
            self._submit(self.groups[index], j, resume_from=partial if partial.token_ids else None)
