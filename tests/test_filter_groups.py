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
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.config import RolloutConfig
from tests.test_rollout import IdsFormatter, make_engine


def parity(group):
    """A score the random checkpoint gives: the first token's parity (about half the groups of 2 are flat)."""
    return [float(c.token_ids[0] % 2) for c in group.completions]


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
        assert len(set(parity(g))) == 2, g.index
        assert [c.token_ids for c in g.completions] == [c.token_ids for c in reference[g.index].completions]
    started = set(range(col.next_group))
    assert max(started) < 24  # all within the reference
    dropped = started - set(indices) - set(col.groups)
    assert dropped and all(len(set(parity(reference[i]))) == 1 for i in dropped)
    assert col.take_filtered() == len(dropped) and col.take_filtered() == 0


def test_past_the_cap_flat_groups_are_kept_with_a_warning(tiny_qwen3, caplog):
    """Every group flat: filter_max_batches=3 drops two batches' worth (4 groups) and delivers the next."""
    path, _ = tiny_qwen3
    col = collector(path, "sync", 2, max_batches=3, score=lambda g: [1.0, 1.0])
    with caplog.at_level(logging.WARNING):
        batch = col.collect()
    assert len(batch) == 2 and col.take_filtered() == 4
    assert [m for m in caplog.messages if "filter_groups" in m] == [
        "rollout.filter_groups dropped 4 groups of equal scores while collecting one batch "
        "(rollout.filter_max_batches=3 batches' worth); the rest are kept as they come (said once; "
        "filtered_groups and zero_var_group_frac count them)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        col.collect()
    assert col.take_filtered() == 4 and not caplog.messages  # the cap is per batch, the warning once


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
