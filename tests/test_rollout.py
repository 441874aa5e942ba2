"""Rollout orchestration: quota-based partial rollout, sync mode, lag, refresh, max_versions."""

import io
import random

import pytest
import torch

from kv4rl.data.source import ProblemSource
from kv4rl.engine.config import EngineConfig, KVConfig
from kv4rl.engine.llm import Engine
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.config import RolloutConfig, StalenessConfig
from kv4rl.rollout.pipeline import RolloutPipeline


class IdsFormatter:
    """Problem -> a few token ids (the random checkpoints have no tokenizer)."""

    def ids(self, problem):
        return [3 + (ord(ch) % 90) for ch in problem.problem[:6]]


def make_engine(path, slots, num_blocks=None, prefix_sharing=True, async_scheduling=False):
    cfg = EngineConfig(kv=KVConfig(format="fp32", block_size=4), num_kv_blocks=num_blocks, max_model_len=96,
                       prefix_sharing=prefix_sharing, async_scheduling=async_scheduling)
    return Engine(path, cfg, max_num_seqs=slots, device="cpu", dtype="float32", seed=0)


def restored(pipe, build, version: int):
    """`pipe` saved with torch.save and loaded into a fresh pipeline (`build() -> (collector, pipeline)`) whose
    engine holds weights `version`, as a resumed run's; returns the new (collector, pipeline)."""
    saved = io.BytesIO()
    torch.save(pipe.state_dict(), saved)
    saved.seek(0)
    col, fresh = build()
    col.engine.version = version
    fresh.load_state_dict(torch.load(saved, weights_only=False))
    return col, fresh


def make_collector(path, lengths, *, mode="partial", quota=2, group=2, slots=4, carry="keep_kv", num_blocks=None,
                   prefix_sharing=True, async_scheduling=False):
    cfg = RolloutConfig(mode=mode, quota_groups=quota, group_size=group, max_slots=slots, carry=carry)
    engine = make_engine(path, slots, num_blocks, prefix_sharing, async_scheduling)
    return Collector(engine, ProblemSource(None, None, seed=0),
                     IdsFormatter(), cfg, seed=0, max_tokens_fn=lengths)


def test_b1_example_slot_timeline_and_handoff_order(tiny_qwen3):
    """Hand-worked: 4 slots, G = 2, quota T = 2; lengths A=(2,4) B=(1,1) C=(3,1) D=(2,2).

    step 1: A1 A2 B1 B2 -> B1, B2 finish (B complete); C1 C2 refill the two slots
    step 2: A1 A2 C1 C2 -> A1, C2 finish; D1 D2 refill
    step 3: A2 C1 D1 D2 -> nothing finishes
    step 4: A2 C1 D1 D2 -> all finish: A, C, D complete in that order
    The first batch is {B, A}; C and D are already complete and form the second batch at once.
    (Without prefix sharing: with it, a group's second request starts a step after the first.)
    """
    path, _ = tiny_qwen3
    table = {0: (2, 4), 1: (1, 1), 2: (3, 1), 3: (2, 2)}
    col = make_collector(path, lambda g, j: table[g][j] if g in table else 50, prefix_sharing=False)
    first = col.collect()
    assert [g.index for g in first] == [1, 0]
    assert [t["batch_size"] for t in col.trace] == [4, 4, 4, 4]
    assert [len(c.token_ids) for g in first for c in g.completions] == [1, 1, 2, 4]
    second = col.collect()
    assert [g.index for g in second] == [2, 3] and len(col.trace) == 4


def test_sync_mode_waits_for_the_longest_response(tiny_qwen3):
    path, _ = tiny_qwen3
    table = {0: (2, 4), 1: (1, 1), 2: (3, 1), 3: (2, 2)}
    col = make_collector(path, lambda g, j: table[g][j], mode="sync", quota=2, prefix_sharing=False)
    assert [g.index for g in col.collect()] == [0, 1]
    assert [t["batch_size"] for t in col.trace] == [4, 2, 1, 1]  # slots idle behind A2
    assert [g.index for g in col.collect()] == [2, 3]


@pytest.mark.parametrize("carry,async_scheduling", [("keep_kv", False), ("recompute", False), ("keep_kv", True)])
def test_partial_property_every_group_once_complete_nothing_lost(tiny_qwen3, carry, async_scheduling):
    path, _ = tiny_qwen3
    rng = random.Random(7)
    lengths = {}

    def length(g, j):
        return lengths.setdefault((g, j), 1 + min(int(rng.expovariate(1 / 5)), 40))

    col = make_collector(path, length, quota=3, group=3, slots=8, carry=carry, num_blocks=40,
                         async_scheduling=async_scheduling)
    delivered, spanning = [], 0
    for update in range(100):
        batch = col.collect()
        for g in batch:
            assert len(g.completions) == 3
            for j, c in enumerate(g.completions):
                assert len(c.token_ids) == lengths[(g.index, j)]  # no token lost or duplicated
                assert c.versions == sorted(c.versions) and c.versions[-1] <= update
                assert len(c.logprobs) == len(c.token_ids)
                spanning += len(set(c.versions)) > 1
        delivered += [g.index for g in batch]
        col.engine.load_weights(col.engine.weights_state(), version=update + 1)
        col.on_refresh()
    assert len(delivered) == len(set(delivered)) == 300
    # every group ever started is either delivered (once) or still held, complete or in flight
    assert set(delivered) | set(col.groups) == set(range(col.next_group))
    assert not set(delivered) & set(col.groups)
    assert spanning > 0  # responses really were carried across weight updates
    assert (col.engine.num_steps_ahead > 0) == async_scheduling  # steps launched before the last one's read


def test_partial_top_up_does_not_read_the_step_in_flight(tiny_qwen3):
    """Partial rollout tops the engine up before every step; counting its requests must not read the step
    launched ahead (`engine.async_scheduling`), or every step waits for the device before the next is
    launched. Nothing in `collect` reads it (counting through `unfinished`, which reads it, would), and
    every engine step returns with the next step in flight while requests remain, so the collector's
    work overlaps the device's."""
    path, _ = tiny_qwen3
    for counting in ("num_unfinished", "unfinished"):
        col = make_collector(path, lambda g, j: 4 + (5 * g + 3 * j) % 9, quota=4, group=2, slots=8,
                             async_scheduling=True)
        engine, reads, idle, drain, step = col.engine, [], [], col.engine.drain, col.engine.step

        def read_in_flight(engine=engine, reads=reads, drain=drain):
            reads.append(engine._inflight is not None)
            drain()

        def stepped(engine=engine, idle=idle, step=step):
            out = step()
            idle.append(engine._inflight is None and engine.scheduler.has_unfinished())
            return out

        engine.drain, engine.step = read_in_flight, stepped
        if counting == "unfinished":
            engine.num_unfinished = lambda engine=engine: len(engine.unfinished())
        batches = [col.collect() for _ in range(3)]
        assert [len(g.completions) for b in batches for g in b] == [2] * 12
        assert any(reads) == (counting == "unfinished")
        assert len(idle) + sum(reads) == len(col.trace) and not any(idle)  # the trace counts drained steps too


def run_pipeline(path, staleness, updates, mode="sync", lengths=lambda g, j: 3):
    col = make_collector(path, lengths, mode=mode, quota=2, group=2, slots=4)
    pipe = RolloutPipeline(col, staleness)
    out = []
    for u in range(updates):
        batch = pipe.next_batch()
        out.append([u - v for g in batch for c in g.completions for v in c.versions])
        refreshed = pipe.refresh_due(u)
        if refreshed:
            col.engine.load_weights(col.engine.weights_state(), version=u + 1)
        pipe.after_update(u, refreshed)
    return out, col


@pytest.mark.parametrize("lag", [1, 4])
def test_lag_delivers_tokens_exactly_s_versions_old(tiny_qwen3, lag):
    path, _ = tiny_qwen3
    ages, _ = run_pipeline(path, StalenessConfig(lag=lag), updates=lag + 5)
    for u, a in enumerate(ages):
        assert set(a) == {min(u, lag)}


def test_refresh_every_cycles_staleness(tiny_qwen3):
    path, _ = tiny_qwen3
    ages, _ = run_pipeline(path, StalenessConfig(refresh_every=3), updates=9)
    assert [set(a) for a in ages] == [{0}, {1}, {2}] * 3


def test_max_versions_drops_and_requeues(tiny_qwen3):
    path, _ = tiny_qwen3
    lengths = lambda g, j: 30 if j == 0 and g % 3 == 0 else 2
    ages, col = run_pipeline(path, StalenessConfig(max_versions=1), updates=12, mode="partial", lengths=lengths)
    assert col.num_dropped > 0
    assert max(max(a) for a in ages) <= 1


def async_pipeline(path, staleness, lengths):
    col = make_collector(path, lengths, mode="partial", quota=1, group=2, slots=4, prefix_sharing=False,
                         async_scheduling=True)
    return col, RolloutPipeline(col, staleness)


def test_max_versions_checks_responses_that_stopped_in_the_drained_step(tiny_qwen3):
    """With async scheduling a refresh reads the step in flight; the responses that stopped in it waited for
    the next `step` outside the engine's queues and the collector's groups, so `max_versions` never saw them
    and they reached the learner too old (seeds showed 'dropped 14, expected 15'). Reference: the ages of
    every delivered token, and a count of the held responses over the bound at each update."""
    path, _ = tiny_qwen3
    col, pipe = async_pipeline(path, StalenessConfig(max_versions=0), lambda g, j: 1 + (3 * g + 5 * j) % 7)
    stopped_at_refresh = 0
    for u in range(10):
        batch = pipe.next_batch()
        assert all(u - v <= 0 for g in batch for c in g.completions for v in c.versions), u
        col.engine.load_weights(col.engine.weights_state(), version=u + 1)
        stopped_at_refresh += len(col.engine._backlog)
        pipe.after_update(u, True)
    assert stopped_at_refresh > 0  # the case really arose
    assert col.engine.num_steps_ahead > 0


def test_a_checkpoint_keeps_responses_that_stopped_in_the_drained_step(tiny_qwen3):
    """`state_dict` saved the engine's queues and the groups, but a response that stopped in the step a refresh
    drained was in neither: after a resume its group never completed. Reference: every group started is
    delivered once, as in an uninterrupted run."""
    path, _ = tiny_qwen3
    lengths = lambda g, j: 1 + (3 * g + 5 * j) % 7
    col, pipe = async_pipeline(path, StalenessConfig(), lengths)
    delivered = []
    for u in range(2):
        delivered += [g.index for g in pipe.next_batch()]
        col.engine.load_weights(col.engine.weights_state(), version=u + 1)  # as the loop's refresh: a drain
        backlog = [s.tag for s in col.engine._backlog]
        pipe.after_update(u, True)
    assert backlog == [(2, 1)]  # stopped in the drained step: the case itself
    saved = io.BytesIO()
    torch.save(pipe.state_dict(), saved)
    saved.seek(0)
    col, pipe = async_pipeline(path, StalenessConfig(), lengths)
    col.engine.version = 2
    pipe.load_state_dict(torch.load(saved, weights_only=False))
    for _ in range(20):
        delivered += [g.index for g in pipe.next_batch()]
    assert len(delivered) == len(set(delivered))
    assert set(delivered) | set(col.groups) == set(range(col.next_group))
    live = {seq.tag for seq in col.engine.unfinished()} | {seq.tag for seq in col.engine._backlog}
    for index, group in col.groups.items():  # every response of a held group is finished or being sampled
        assert all(c is not None or (index, j) in live for j, c in enumerate(group.done)), (index, group.done)
    assert 2 in delivered


def test_the_trace_counts_the_steps_a_refresh_read(tiny_qwen3, monkeypatch):
    """A refresh reads the step in flight (async scheduling); its record was overwritten before the collector
    appended it, so the trace held ~one step fewer per refresh (70 of 78 over 8 updates), and `decode_steps`
    and `slot_util` undercounted. Reference: every step the engine read, counted at `Engine._complete`."""
    read = []
    real = Engine._complete

    def counting(self, launched, finished):
        read.append(1)
        return real(self, launched, finished)

    monkeypatch.setattr(Engine, "_complete", counting)
    path, _ = tiny_qwen3
    col, pipe = async_pipeline(path, StalenessConfig(), lambda g, j: 1 + (3 * g + 5 * j) % 7)
    traced = 0
    for u in range(8):
        pipe.next_batch()
        traced += len(col.take_trace())
        col.engine.load_weights(col.engine.weights_state(), version=u + 1)
        pipe.after_update(u, True)
    last = col.take_trace()  # the last refresh's, taken over by `after_update`, not yet handed over
    traced += len(last)
    assert traced == len(read)
    assert last and all(step["drained"] and step["latency_s"] == step["wait_s"] for step in last)


def test_a_checkpoint_keeps_the_trace_of_the_step_a_refresh_read(tiny_qwen3):
    """The record of the step a refresh drained (async scheduling) waited in the engine for the next `step`;
    `state_dict` did not save it, so a resumed run's next batch traced one step fewer than an uninterrupted
    run's (`decode_steps` 3 for 4, `slot_util` off). Reference: the same pipeline run without a checkpoint."""
    path, _ = tiny_qwen3
    lengths = lambda g, j: 1 + (3 * g + 5 * j) % 7

    def run(save_after: int | None, updates: int = 5) -> list[list[bool]]:
        col, pipe = async_pipeline(path, StalenessConfig(), lengths)
        traces = []
        for u in range(updates):
            pipe.next_batch()
            traces.append([bool(step.get("drained")) for step in col.take_trace()])
            col.engine.load_weights(col.engine.weights_state(), version=u + 1)
            pipe.after_update(u, True)
            if u == save_after:
                col, pipe = restored(pipe, lambda: async_pipeline(path, StalenessConfig(), lengths), u + 1)
        return traces

    whole = run(None)
    assert any(any(t) for t in whole[1:])  # refreshes did read steps in flight
    for k in range(4):
        assert run(k) == whole, k
