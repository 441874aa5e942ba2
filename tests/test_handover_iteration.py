"""A partial run can hand over groups that earlier iterations finished, without the engine taking a step:
that iteration's `slot_util` read 0.0 (an idle engine, where none ran) and `tokens_per_s` ~1.5e6 (the time of
the hand-over). Both are null there now, and every rate that merges ranks or engines skips them."""

from __future__ import annotations

import json

import pytest
from kv4rl.distributed import merge_rank_rows
from kv4rl.telemetry.progress import train_stats
from kv4rl.telemetry.run_stats import collection_stats
from tests.small_runs import train_cli


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_iteration_without_engine_steps_reports_no_rate_and_no_slot_use(tmp_path, async_scheduling):
    """With async scheduling the step a refresh drained lands in the next iteration's trace: that iteration
    still ran no step of its own (a review found ~2e6 tokens/s there after the first fix)."""
    res = train_cli(f"out_dir={tmp_path}", "name=p", "device=cpu", "--no-progress", "rollout.mode=partial",
                    "rollout.quota_groups=2", "rollout.group_size=4", "rollout.max_slots=24",
                    "rollout.max_new_tokens=24", "rollout.temperature=1.5", "trainer.iterations=5",
                    f"engine.async_scheduling={str(async_scheduling).lower()}")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    trace = [json.loads(line) for line in (tmp_path / "p" / "rollout_trace.jsonl").read_text().splitlines()]
    own_steps = {r["iteration"]: sum(1 for t in trace if t["iteration"] == r["iteration"] and not t.get("drained"))
                 for r in rows}
    handed_over = [r for r in rows if own_steps[r["iteration"]] == 0]
    assert handed_over, "this configuration hands a batch over without a step (iteration 2 on the CPU)"
    for row in rows:
        stepped = own_steps[row["iteration"]] > 0
        assert (row["slot_util"] is not None) == stepped and (row["tokens_per_s"] is not None) == stepped
        if stepped:
            assert 0 < row["slot_util"] <= 1 and 0 < row["tokens_per_s"] < 1e6
    assert "- tok/s" in train_stats(handed_over[0])


def test_rates_merge_over_the_ranks_or_engines_that_stepped():
    assert collection_stats([], 8) == {"decode_steps": 0, "slot_util": None}
    assert collection_stats([{"batch_size": 2}, {"batch_size": 6}], 8)["slot_util"] == 0.5
    rows = [{"iteration": 3, "tokens_per_s": 100.0, "slot_util": 0.5},
            {"iteration": 3, "tokens_per_s": None, "slot_util": None},
            {"iteration": 3, "tokens_per_s": 50.0, "slot_util": 0.25}]
    assert merge_rank_rows(rows) == {"iteration": 3, "tokens_per_s": 150.0, "slot_util": 0.375}
    assert merge_rank_rows([rows[1], rows[1]]) == rows[1]


def test_known_means_and_sums_leave_out_the_iterations_without_a_step():
    from kv4rl.telemetry.run_stats import mean_known, sum_known

    assert mean_known([2.0, None, 4.0]) == 3.0 and sum_known([2.0, None, 4.0]) == 6.0
    assert mean_known([None, None]) is None and sum_known([]) is None


def test_a_step_not_taken_shows_as_a_dash_in_the_progress_line():
    """An iteration whose optimizer steps were all skipped or empty has grad_norm NaN (null in metrics.jsonl): the
    progress line said `gn nan`."""
    row = {"reward_mean": 0.5, "accuracy": 0.25, "tokens_per_s": 10.0, "response_len_mean": 3.0,
           "entropy": 0.1234, "grad_norm": float("nan")}
    assert train_stats(row)[-2:] == ["ent 0.123", "gn -"]
    assert train_stats(dict(row, grad_norm=1.0))[-1] == "gn 1.00"
