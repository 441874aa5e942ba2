"""Runs that train on nothing are told so once, with the likely cause; a run's skipped optimizer steps reach
its summary."""

import json
import logging

from kv4rl.telemetry.run_stats import summarize_run
from kv4rl.telemetry.run_watch import RunWatch

LOGGER = "kv4rl.telemetry.run_watch"


def row(it, zero_var, adv_std, reward=0.0, **extra):
    return {"iteration": it, "zero_var_group_frac": zero_var, "adv_std": adv_std, "reward_mean": reward,
            "groups": [0, 1], "truncated_frac": 0.0, "reward_no_answer": 0.0, **extra}


def test_three_iterations_without_a_reward_signal_warn_once_naming_them(caplog):
    watch = RunWatch(responses_per_group=4, max_new_tokens=16)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for r in [row(0, 1.0, 0.0), row(1, 0.5, 0.7), row(2, 1.0, 0.0, 1.0), row(3, 1.0, 0.0, 1.0)]:
            watch.observe(r)  # a signal at iteration 1 starts the count again
        assert caplog.records == []
        for it in range(4, 8):
            watch.observe(row(it, 1.0, 0.0))
    (record,) = caplog.records
    assert record.getMessage().startswith("iterations 2-4: every group's responses got equal rewards "
                                          "(reward_mean 0, 1), so every advantage was 0")
    assert "Check reward.name" in record.getMessage()


def test_the_stall_names_unreadable_answers_or_the_cut_when_every_response_had_them(caplog):
    """2 groups x 4 responses: 8 without a readable answer in every row, or every response cut."""
    for extra, cause in [({"reward_no_answer": 8.0}, "No response held an answer the reward could read"),
                         ({"truncated_frac": 1.0}, "Every response was cut at rollout.max_new_tokens=16: raise it")]:
        caplog.clear()
        watch = RunWatch(responses_per_group=4, max_new_tokens=16)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for it in range(3):
                watch.observe(row(it, 1.0, 0.0, **extra))
        assert cause in caplog.records[-1].getMessage()
    caplog.clear()
    watch = RunWatch(responses_per_group=4, max_new_tokens=16)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for it, missing in enumerate([8.0, 7.0, 8.0]):  # one response had an answer once: not the cause named
            watch.observe(row(it, 1.0, 0.0, reward_no_answer=missing))
    assert "No response held" not in caplog.records[-1].getMessage()


def test_the_stall_hint_leaves_out_what_is_on_and_names_the_cut_beside_unreadable_answers(caplog):
    """A GSM8K run with data.chat_template=true and every response cut at 64 tokens was told to turn the chat
    template on, and not that every response had been cut (the answer comes after the cut)."""
    watch = RunWatch(responses_per_group=4, max_new_tokens=64, chat_template=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for it in range(3):
            watch.observe(row(it, 1.0, 0.0, reward_no_answer=8.0, truncated_frac=1.0))
    said = caplog.records[-1].getMessage()
    assert "every response was cut at rollout.max_new_tokens=64: raise it first" in said
    assert "chat_template" not in said
    caplog.clear()
    watch = RunWatch(responses_per_group=4, max_new_tokens=64)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for it in range(3):
            watch.observe(row(it, 1.0, 0.0, reward_no_answer=8.0))
    said = caplog.records[-1].getMessage()
    assert "set data.chat_template=true for an instruct model" in said and "was cut" not in said


def test_every_response_cut_is_said_once_even_with_a_reward_signal(caplog):
    watch = RunWatch(responses_per_group=4, max_new_tokens=16)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        watch.observe(row(0, 0.5, 0.6, truncated_frac=0.75))
        watch.observe(row(1, 0.5, 0.6, truncated_frac=1.0))
        watch.observe(row(2, 0.5, 0.6, truncated_frac=1.0))
    (record,) = caplog.records
    assert record.getMessage().startswith("iteration 1: every response was cut at rollout.max_new_tokens=16")


def test_equal_rewards_with_baseline_noise_are_not_a_stall(caplog):
    watch = RunWatch(responses_per_group=4, max_new_tokens=16)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for it in range(5):
            watch.observe(row(it, 1.0, 0.3))  # the noise keeps the advantages apart: a gradient, documented
    assert caplog.records == []


def test_the_summary_counts_the_runs_skipped_optimizer_steps(tmp_path):
    rows = [{"iteration": i, "accuracy": 0.5, "reward_mean": 0.5, "skipped_steps": n} for i, n in enumerate([0, 2, 1])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert summarize_run(tmp_path, None)["skipped_steps"] == 3
    (tmp_path / "metrics.jsonl").write_text(json.dumps(dict(rows[0])) + "\n")
    assert "skipped_steps" not in summarize_run(tmp_path, None)



def test_a_resume_counts_equal_rewards_across_it_and_does_not_repeat_a_warning(tmp_path, caplog):
    """Iterations 0-1 without a reward signal, then a resume at 2 (the rows from 2 on in metrics.jsonl are the
    ones the resume replaces): one more such iteration is the third. A run warned before is not warned again."""
    from types import SimpleNamespace

    from kv4rl.telemetry.run_watch import run_watch

    cfg = SimpleNamespace(rollout=SimpleNamespace(group_size=4, max_new_tokens=16),
                          data=SimpleNamespace(chat_template=False))
    rows = [row(0, 1.0, 0.0), row(1, 1.0, 0.0), row(2, 0.5, 0.6, truncated_frac=1.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{torn")
    watch = run_watch(cfg, tmp_path, start=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        watch.observe(row(2, 1.0, 0.0))
    (record,) = caplog.records
    assert record.getMessage().startswith("iterations 0-2: every group's responses got equal rewards")
    caplog.clear()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row(i, 1.0, 0.0, truncated_frac=1.0)) + "\n"
                                                    for i in range(4)))
    watch = run_watch(cfg, tmp_path, start=4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for it in range(4, 8):
            watch.observe(row(it, 1.0, 0.0, truncated_frac=1.0))
    assert caplog.records == []
    assert run_watch(cfg, None, start=3).stalled == []  # a rank without the folder starts afresh
