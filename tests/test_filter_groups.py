"""`rollout.filter_groups` (DAPO's dynamic sampling): a complete group whose responses all scored the same is
dropped and the collection goes on. Checked against an unfiltered collector of the same stream (a response's
tokens depend only on its group, index and attempt): every delivered group has unequal scores and its own
tokens, every group started is delivered, still in flight or dropped as flat, and the drops are counted."""

from __future__ import annotations

import json
import logging

import pytest

from kv4rl.config import load_config
from kv4rl.data.source import ProblemSource
from kv4rl.loop import train
from kv4rl.rewards import RewardResult, register_reward
from kv4rl.rollout.build import batch_reward
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.config import RolloutConfig
from tests.test_rollout import IdsFormatter, make_engine


def parity(group):
    """A score the random checkpoint gives: the first token's parity (about half the groups of 2 are flat)."""
    return RewardResult([float(c.token_ids[0] % 2) for c in group.completions], {"scored": 1.0})


def collector(path, mode, quota, filter_groups=True, max_batches=10, score=parity):
    cfg = RolloutConfig(mode=mode, quota_groups=quota, group_size=2, max_slots=4, filter_groups=filter_groups,
                        filter_max_batches=max_batches)
    return Collector(make_engine(path, 4), ProblemSource(None, None, seed=0), IdsFormatter(), cfg, seed=0,
                     max_tokens_fn=lambda g, j: 2 + (g + j) % 3, score_group=score)


@pytest.mark.parametrize("mode", ["sync", "partial"])
def test_flat_groups_are_dropped_and_every_other_group_is_delivered_once(tiny_qwen3, mode):
    path, _ = tiny_qwen3
    reference = {g.index: g for g in collector(path, "sync", 24, filter_groups=False).collect()}
    col = collector(path, mode, 2)
    delivered = [g for _ in range(3) for g in col.collect()]
    indices = [g.index for g in delivered]
    assert len(indices) == len(set(indices)) == 6
    for g in delivered:
        assert len(set(parity(g).scores)) == 2 and g.reward == parity(g), g.index  # scored once, handed on
        assert [c.token_ids for c in g.completions] == [c.token_ids for c in reference[g.index].completions]
    started = set(range(col.next_group))
    assert max(started) < 24  # all within the reference
    dropped = started - set(indices) - set(col.groups)
    assert dropped and all(len(set(parity(reference[i]).scores)) == 1 for i in dropped)
    assert sorted(col.take_filtered()) == sorted(dropped) and col.take_filtered() == []
    # the dropped groups' reward counts (a timeout in a dropped group was counted nowhere): one `scored` a group
    assert col.take_filtered_stats() == {"scored": float(len(dropped))} and col.take_filtered_stats() == {}


def test_past_the_cap_flat_groups_are_kept_with_a_warning(tiny_qwen3, caplog):
    """Every group flat: filter_max_batches=3 drops two batches' worth (4 groups) and delivers the next."""
    path, _ = tiny_qwen3
    col = collector(path, "sync", 2, max_batches=3, score=lambda g: RewardResult([1.0, 1.0]))
    with caplog.at_level(logging.WARNING):
        batch = col.collect()
    assert len(batch) == 2 and len(col.take_filtered()) == 4
    assert [m for m in caplog.messages if "filter_groups" in m] == [
        "rollout.filter_groups dropped 4 groups of equal scores while collecting one batch "
        "(rollout.filter_max_batches=3 batches' worth); the rest are kept as they come (said once; "
        "filtered_groups and zero_var_group_frac count them)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        col.collect()
    assert len(col.take_filtered()) == 4 and not caplog.messages  # the cap is per batch, the warning once


def test_filter_max_batches_zero_is_no_cap_and_one_drops_nothing(tiny_qwen3):
    """verl's max_num_gen_batches=0 is no limit: every flat group is dropped (here: two flat in a row, then the
    scores differ); with 1 nothing is dropped and the scorer is not called."""
    path, _ = tiny_qwen3
    calls = []

    def two_flat_then_mixed(group):
        calls.append(group.index)
        return RewardResult([1.0, 1.0] if len(calls) <= 6 else [1.0, 0.0])

    col = collector(path, "sync", 2, max_batches=0, score=two_flat_then_mixed)
    batch = col.collect()
    assert len(batch) == 2 and len(col.take_filtered()) == 6 and all(len(set(g.reward.scores)) == 2 for g in batch)
    calls.clear()
    col = collector(path, "sync", 2, max_batches=1, score=two_flat_then_mixed)
    assert len(col.collect()) == 2 and col.take_filtered() == [] and calls == []


def test_filtering_needs_a_scorer():
    with pytest.raises(ValueError, match="filter_groups needs the responses' scores"):
        Collector(None, None, None, RolloutConfig(filter_groups=True), seed=0)


def test_a_run_trains_only_groups_that_teach(tmp_path):
    cfg = load_config(None, [f"out_dir={tmp_path}", "name=f", "device=cpu", "rollout.quota_groups=4",
                             "rollout.group_size=4", "trainer.iterations=2", "rollout.filter_groups=true"])
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["zero_var_group_frac"] == 0.0 and row["adv_std"] > 0 for row in rows)
    assert sum(row["filtered_groups"] for row in rows) > 0
    assert len({g for row in rows for g in row["groups"]}) == 8
    # the dropped groups' own reward counts: exact's no_answer over their 4 responses each
    for row in rows:
        assert ("reward_filtered_no_answer" in row) == (row["filtered_groups"] > 0)
        assert 0 <= row.get("reward_filtered_no_answer", 0) <= 4 * row["filtered_groups"]


def _split_rank_recording_drops(rank: int, out_dir: str, overrides: list[str], resume: bool = False) -> dict:
    """One rank of a split run; an engine rank also returns every group its collector dropped."""
    from kv4rl.rollout import collector as collector_module
    from kv4rl.split.run import run_split

    dropped: list[int] = []
    take = collector_module.Collector.take_filtered

    def recording(self):
        out = take(self)
        dropped.extend(out)
        return out

    collector_module.Collector.take_filtered = recording
    cfg = load_config(None, [f"out_dir={out_dir}", *overrides])
    run_split(cfg, resume=resume, show_progress=False, overwrite=False)
    return {"dropped": dropped}


@pytest.mark.slow
def test_a_resumed_split_run_does_not_sample_its_dropped_groups_again(tmp_path):
    """The head records the groups each consumed batch's engine dropped: without them the checkpoint's place in
    each engine's stream stayed at the first drop, and the resumed engines sampled every dropped group again
    (and trained some: the cap filled at once)."""
    from tests.gloo_ranks import run_on_gloo_ranks

    layout = ["name=fs", "device=cpu", "rollout.quota_groups=4", "rollout.group_size=2", "rollout.max_slots=4",
              "rollout.placement=split", "rollout.engine_ranks=2", "rollout.filter_groups=true",
              "checkpoint.save_every=100", "staleness.lag=0"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = run_on_gloo_ranks(_split_rank_recording_drops, 3, tmp_path / "a", str(tmp_path),
                               [*layout, "trainer.iterations=2"])
    run_on_gloo_ranks(_split_rank_recording_drops, 3, tmp_path / "b", str(tmp_path), [*layout, "trainer.iterations=4"],
                      True)
    rows = [json.loads(line) for line in (tmp_path / "fs" / "metrics.jsonl").read_text().splitlines()]
    dropped_before = {g for r in before for g in r["dropped"]}
    assert dropped_before and sum(r["filtered_groups"] for r in rows[:2]) == len(dropped_before)
    after = {g for r in rows[2:] for g in r["groups"]}
    assert after and after.isdisjoint(dropped_before)
    assert all(r["zero_var_group_frac"] == 0.0 for r in rows)


def test_a_batch_scores_only_the_groups_the_collector_did_not():
    """Two groups scored by the collector (their counts add up), one left to a single call, in batch order."""
    from kv4rl.rollout.collector import GroupResult

    def group(index, reward=None):
        return GroupResult(index, None, [1], [None, None], reward)

    calls = []

    def score(groups):
        calls.append([g.index for g in groups])
        return RewardResult([0.5, 0.25], {"no_answer": 2.0}, {"v": [0.5, 0.25], "overlong": [0.0, 0.0]})

    cached = [RewardResult([1.0, 0.0], {"no_answer": 1.0}, {"v": [1.0, 0.0], "overlong": [0.0, -0.5]}),
              RewardResult([0.0, 1.0], {"no_answer": 0.0}, {"v": [0.0, 1.0], "overlong": [0.0, 0.0]})]
    merged = batch_reward([group(0, cached[0]), group(1), group(2, cached[1])], score)
    assert calls == [[1]]
    assert merged.scores == [1.0, 0.0, 0.5, 0.25, 0.0, 1.0] and merged.stats == {"no_answer": 3.0}
    assert merged.components == {"v": [1.0, 0.0, 0.5, 0.25, 0.0, 1.0], "overlong": [0.0, -0.5, 0.0, 0.0, 0.0, 0.0]}
    assert batch_reward([group(3, cached[0])], score) == cached[0] and calls == [[1]]


@pytest.fixture
def counting_reward(monkeypatch):
    """A reward that counts the responses it scores (the first token's parity of the response text)."""
    from kv4rl.rewards import base

    scored = []
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_reward("counting_for_tests")(
        lambda: lambda responses, golds: (scored.extend(responses), RewardResult([float(len(r) % 2) for r in responses]))[1])
    return scored


def test_each_group_is_scored_once(tmp_path, counting_reward):
    """The collector scores a group as it completes; the loop reuses those scores instead of scoring again."""
    cfg = load_config(None, [f"out_dir={tmp_path}", "name=once", "device=cpu", "rollout.quota_groups=4",
                             "rollout.group_size=2", "trainer.iterations=3", "rollout.filter_groups=true",
                             "reward.name=counting_for_tests"])
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "once" / "metrics.jsonl").read_text().splitlines()]
    delivered, dropped = sum(len(r["groups"]) for r in rows), sum(r["filtered_groups"] for r in rows)
    assert dropped > 0 and len(counting_reward) == 2 * (delivered + dropped)
