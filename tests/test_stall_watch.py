"""Runs whose reward teaches nothing are told so once; a run's skipped optimizer steps reach its summary."""

import json
import logging

from kv4rl.telemetry.run_stats import summarize_run
from kv4rl.telemetry.stall_watch import StallWatch


def row(it, zero_var, adv_std, reward=0.0):
    return {"iteration": it, "zero_var_group_frac": zero_var, "adv_std": adv_std, "reward_mean": reward}


def test_three_iterations_without_a_reward_signal_warn_once_naming_them(caplog):
    watch = StallWatch()
    with caplog.at_level(logging.WARNING, logger="kv4rl.telemetry.stall_watch"):
        for r in [row(0, 1.0, 0.0), row(1, 0.5, 0.7), row(2, 1.0, 0.0, 1.0), row(3, 1.0, 0.0, 1.0)]:
            watch.observe(r)  # a signal at iteration 1 starts the count again
        assert caplog.records == []
        for it in range(4, 8):
            watch.observe(row(it, 1.0, 0.0))
    (record,) = caplog.records
    assert record.getMessage().startswith("iterations 2-4: every group's responses got equal rewards "
                                          "(reward_mean 0, 1), so every advantage was 0")


def test_equal_rewards_with_baseline_noise_are_not_a_stall(caplog):
    watch = StallWatch()
    with caplog.at_level(logging.WARNING, logger="kv4rl.telemetry.stall_watch"):
        for it in range(5):
            watch.observe(row(it, 1.0, 0.3))  # the noise keeps the advantages apart: a gradient, documented
    assert caplog.records == []


def test_the_summary_counts_the_runs_skipped_optimizer_steps(tmp_path):
    rows = [{"iteration": i, "accuracy": 0.5, "reward_mean": 0.5, "skipped_steps": n} for i, n in enumerate([0, 2, 1])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarize_run(tmp_path, None)["skipped_steps"] == 3
    (tmp_path / "metrics.jsonl").write_text(json.dumps(dict(rows[0])) + "\n")
    assert "skipped_steps" not in summarize_run(tmp_path, None)
