"""Several rewards as one (`reward.extra`, `reward.weights`): the weighted sum trains, the verifier's own score
counts for accuracy and evaluation, each reward's mean is logged; checked by hand and in short runs."""

from __future__ import annotations

import json

import pytest

from kv4rl.config import ConfigError, load_config
from kv4rl.data.source import ProblemSource
from kv4rl.loop import train
from kv4rl.rewards import (
    RewardResult,
    WeightedRewards,
    get_reward,
    register_reward,
    reward_metrics,
    with_overlong_penalty,
)
from kv4rl.rollout.build import build_reward

RESPONSES = ["so \\boxed{4}", "4", "\\boxed{5}", "no idea", "\\boxed{4"]
GOLDS = ["4"] * 5


def test_the_weighted_sum_by_hand_and_accuracy_from_the_verifier_alone():
    """exact: 1, 0, 0, 0, 0 (three without a readable box); boxed_format: 1, 0, 1, 0, 0 (the last box is not
    closed). With weights 1 and 0.6 the sum is 1.6, 0, 0.6, 0, 0: a wrong answer in a box scores 0.6, so
    accuracy from the sum (> 0.5) would count it; from the verifier it is 1 in 5."""
    with WeightedRewards([("exact", get_reward("exact"), 1.0), ("boxed_format", get_reward("boxed_format"), 0.6)]) as rw:
        result = rw(RESPONSES, GOLDS)
        assert result.scores == pytest.approx([1.6, 0.0, 0.6, 0.0, 0.0], abs=1e-15)
        assert result.components == {"exact": [1.0, 0.0, 0.0, 0.0, 0.0], "boxed_format": [1.0, 0.0, 1.0, 0.0, 0.0]}
        assert result.stats == {"no_answer": 3.0}  # the verifier's counts keep their names
        metrics = reward_metrics(result, rw.verifier_name)
    assert metrics == {"reward_mean": pytest.approx(2.2 / 5, abs=1e-15), "accuracy": pytest.approx(0.2),
                       "rewards/exact/mean": 0.2, "rewards/boxed_format/mean": 0.4}
    assert reward_metrics(result)["accuracy"] == pytest.approx(0.4)  # what the sum alone would have said
    assert reward_metrics(RewardResult([1.0, 0.0, 0.75])) == {"reward_mean": pytest.approx(1.75 / 3),
                                                             "accuracy": pytest.approx(2 / 3)}


def test_an_extra_rewards_counts_are_logged_under_its_name_and_every_part_is_closed():
    closed = []

    class Counting:
        def __init__(self, name, fail_close=False, score=0.5):
            self.name, self.fail_close, self.score = name, fail_close, score

        def __call__(self, responses, golds):
            return RewardResult([self.score] * len(responses), {"calls": 1.0})

        def close(self):
            closed.append(self.name)
            if self.fail_close:
                raise RuntimeError(f"{self.name} failed to close")

    rw = WeightedRewards([("a", Counting("a", fail_close=True), 2.0), ("b", Counting("b"), -1.0)])
    result = rw(["x", "y"], ["1", "2"])
    assert result.scores == [0.5, 0.5] and result.stats == {"calls": 1.0, "b_calls": 1.0}
    with pytest.raises(RuntimeError, match="a failed to close"):
        rw.close()
    assert closed == ["a", "b"]  # b closed although a failed first
    with pytest.raises(ValueError, match="named once"):
        WeightedRewards([("a", Counting("a"), 1.0), ("a", Counting("a"), 1.0)])
    # finite scores times finite weights overflowed to inf: every advantage became 0 and the run trained nothing
    huge = WeightedRewards([("a", Counting("a", score=1.0), 1e308), ("b", Counting("b", score=1.0), 1e308)])
    with pytest.raises(ValueError, match=r"weighted sum of rewards \['a', 'b'\] .* is inf for response 0 of 2"):
        huge(["x", "y"], ["1", "2"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward.extra=[nope]"], "reward.extra: unknown reward 'nope'"),
    (["reward.name=exact", "reward.extra=[exact]"], "each reward may be named once"),
    (["reward.extra=[boxed_format]", "reward.weights=[1.0]"], "2 rewards"),
    (["reward.weights=[1.0,2.0]"], "2 weights for 1 rewards"),
    (["reward.extra=[boxed_format]", "reward.weights=[1.0,.nan]"], "finite"),
])
def test_bad_reward_lists_are_refused_by_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_auto_verifier_named_again_is_refused_before_the_run_folder(tmp_path):
    cfg = load_config(None, ["reward.extra=[exact]", f"out_dir={tmp_path}", "device=cpu"])
    with pytest.raises(ConfigError, match="'exact' is already the verifier"):
        build_reward(cfg, ProblemSource(None, None, 0))
    with pytest.raises(ConfigError, match="'exact' is already the verifier"):
        train(cfg, show_progress=False)
    assert list(tmp_path.iterdir()) == []
    plain = build_reward(load_config(None, ["device=cpu"]), ProblemSource(None, None, 0))
    assert not isinstance(plain, WeightedRewards)  # one reward, no weights: as before


@pytest.fixture
def always_one(monkeypatch):
    """A reward of 1.0 for every response, registered for one test only (other tests list the registry)."""
    from kv4rl.rewards import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_reward("always_one_for_tests")(lambda: lambda responses, golds: RewardResult([1.0] * len(responses)))


def test_a_run_trains_on_the_sum_and_evaluates_the_verifier(tmp_path, always_one):
    """A constant extra reward of 0.6: reward_mean is the verifier's mean + 0.6 in every row (the advantages do
    not change), accuracy is the verifier's (from the sum every response would count), and the evaluation scores
    by the verifier alone (from the sum its mean would be at least 0.6)."""
    cfg = load_config(None, [f"out_dir={tmp_path}", "name=w", "device=cpu", "rollout.quota_groups=4",
                             "rollout.group_size=2", "trainer.iterations=2", "eval.every=1", "data.eval_size=16",
                             "reward.extra=[always_one_for_tests]", "reward.weights=[1.0,0.6]"])
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward_mean" in r]
    assert train_rows
    for row in train_rows:
        assert row["rewards/always_one_for_tests/mean"] == 1.0
        assert row["reward_mean"] == pytest.approx(row["rewards/exact/mean"] + 0.6, abs=1e-12)
        assert row["accuracy"] == pytest.approx(row["rewards/exact/mean"], abs=1e-7) and row["accuracy"] < 1.0
    evals = [r for r in rows if "eval/mean@1" in r]
    assert evals and all(r["eval/mean@1"] < 0.6 for r in evals)


def test_each_rewards_mean_is_averaged_over_data_parallel_ranks_and_its_counts_added():
    """torchrun ranks hold equal shares of the groups: a reward's mean over all responses is the ranks' mean,
    while `reward_<name>_<stat>` counts add up like the verifier's."""
    from kv4rl.distributed import merge_rank_rows

    rows = [{"rewards/exact/mean": 0.25, "reward_boxed_format_calls": 1.0, "accuracy": 0.25},
            {"rewards/exact/mean": 0.5, "reward_boxed_format_calls": 1.0, "accuracy": 0.5}]
    assert merge_rank_rows(rows) == {"rewards/exact/mean": 0.375, "reward_boxed_format_calls": 2.0, "accuracy": 0.375}


def test_dapos_overlong_penalty_by_hand():
    """max_new_tokens 16, buffer 4: no penalty up to 12 tokens, then -(n - 12) / 4 x factor, -factor at 16."""
    from kv4rl.rewards.combined import overlong_penalties

    assert overlong_penalties([3, 12, 13, 14, 16, 20], 16, 4, 0.5) == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    result = with_overlong_penalty(RewardResult([1.0, 1.0, 0.0], {"no_answer": 1.0}), [12, 16, 14], "exact", 16, 4, 1.0)
    assert result.scores == [1.0, 0.0, -0.5] and result.stats == {"no_answer": 1.0}
    assert result.components == {"exact": [1.0, 1.0, 0.0], "overlong": [0.0, -1.0, -0.5]}
    # a right answer at the cap scores 0 in all: accuracy still counts it, by the verifier's own score
    assert reward_metrics(result, "exact")["accuracy"] == pytest.approx(2 / 3)
    assert reward_metrics(result, "exact")["rewards/overlong/mean"] == pytest.approx(-0.5)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.max_new_tokens=16", "reward.overlong_buffer=16"], r"reward.overlong_buffer must be in \[0, "),
    (["reward.overlong_buffer=-1"], "reward.overlong_buffer"),
    (["reward.overlong_buffer=4", "reward.overlong_penalty=-1"], "reward.overlong_penalty must be"),
])
def test_bad_overlong_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_run_with_the_overlong_penalty_logs_it_apart_from_the_verifier(tmp_path):
    cfg = load_config(None, [f"out_dir={tmp_path}", "name=o", "device=cpu", "rollout.quota_groups=4",
                             "rollout.group_size=4", "trainer.iterations=2", "rollout.max_new_tokens=6",
                             "reward.overlong_buffer=3", "reward.overlong_penalty=0.5"])
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert any(row["rewards/overlong/mean"] < 0 for row in rows)
    for row in rows:
        assert -0.5 <= row["rewards/overlong/mean"] <= 0
        assert row["reward_mean"] == pytest.approx(row["rewards/exact/mean"] + row["rewards/overlong/mean"], abs=1e-12)
        assert row["accuracy"] == pytest.approx(row["rewards/exact/mean"], abs=1e-7)
