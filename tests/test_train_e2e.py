"""End to end on the embedded default: the RL loop learns, checkpoints load in transformers, resume continues."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kv4rl.config import load_config
from kv4rl.loop import train

pytestmark = pytest.mark.slow


def small_run(tmp_path, name, *extra):
    return load_config(overrides=[f"name={name}", f"out_dir={tmp_path}", "device=cpu", *extra])


def test_short_training_run_raises_accuracy(tmp_path):
    cfg = small_run(tmp_path, "learn", "trainer.iterations=40", "checkpoint.save_every=40")
    summary = train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and [r["iteration"] for r in rows] == list(range(40))
    first = sum(r["accuracy"] for r in rows[:8]) / 8
    last = sum(r["accuracy"] for r in rows[-8:]) / 8
    assert last > first + 0.05, (first, last)
    assert summary["iterations"] == 40
    for r in rows:  # engine and learner see the same policy before the update
        assert r["mismatch_absmax"] < 1e-3
    # the final checkpoint is an HF folder that transformers loads
    from transformers import AutoModelForCausalLM

    ckpt = cfg.run_dir / "checkpoints" / "iter_000040"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (cfg.run_dir / "config.yaml").is_file()


def test_resume_continues_exactly(tmp_path):
    full = small_run(tmp_path, "full", "trainer.iterations=4", "checkpoint.save_every=2")
    train(full, show_progress=False)
    part = small_run(tmp_path, "part", "trainer.iterations=2", "checkpoint.save_every=2")
    train(part, show_progress=False)
    resumed = load_config(part.run_dir / "config.yaml", ["trainer.iterations=4"])
    train(resumed, resume=True, show_progress=False)

    rows = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    ref_rows = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in ref_rows]
    a = load_file(full.run_dir / "checkpoints" / "iter_000004" / "model.safetensors")
    b = load_file(part.run_dir / "checkpoints" / "iter_000004" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_with_partial_rollouts_in_flight_equals_uninterrupted(tmp_path):
    """Partial mode with lag: the checkpoint holds in-flight responses and buffered batches.

    A resume re-prefills in-flight responses under the current weights, which is exactly what
    `carry: recompute` does at every update, so that mode resumes bit-for-bit. (With `keep_kv` the
    uninterrupted run keeps KV computed by older weights, which a checkpoint does not store.)
    """
    common = ["rollout.mode=partial", "rollout.max_slots=24", "rollout.quota_groups=4", "rollout.group_size=4",
              "rollout.carry=recompute", "staleness.lag=1", "checkpoint.save_every=3"]
    full = small_run(tmp_path, "pfull", "trainer.iterations=6", *common)
    train(full, show_progress=False)
    part = small_run(tmp_path, "ppart", "trainer.iterations=3", *common)
    train(part, show_progress=False)
    state = torch.load(part.run_dir / "checkpoints" / "iter_000003" / "trainer_state.pt", weights_only=False)
    assert state["pipeline"]["collector"]["in_engine"], "nothing was in flight: the test would prove nothing"
    train(load_config(part.run_dir / "config.yaml", ["trainer.iterations=6"]), resume=True, show_progress=False)

    rows = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert ref[-1]["preemptions"] > ref[2]["preemptions"] > 0  # running totals: a resume continues them
    for key in ("iteration", "groups", "reward_mean", "staleness_hist", "response_len_mean", "preemptions",
                "dropped_stale"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    a = load_file(full.run_dir / "checkpoints" / "iter_000006" / "model.safetensors")
    b = load_file(part.run_dir / "checkpoints" / "iter_000006" / "model.safetensors")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_an_nvfp4_run_resumes_with_its_calibrated_scales(tmp_path):
    """NVFP4 calibrates one scale per layer and K/V on the engine's first write. A resumed engine calibrated
    again on other prompts, so its cache (and every later row's mismatch, and the weights) differed."""
    common = ["engine.kv.format=nvfp4", "rollout.quota_groups=4", "rollout.group_size=8", "trainer.lr=1e-3",
              "trainer.warmup_iters=0", "checkpoint.save_every=2"]
    full = small_run(tmp_path, "full", "trainer.iterations=4", *common)
    train(full, show_progress=False)
    part = small_run(tmp_path, "part", "trainer.iterations=2", *common)
    train(part, show_progress=False)
    state = torch.load(part.run_dir / "checkpoints" / "iter_000002" / "trainer_state.pt", weights_only=False)
    (scales,) = state["engine_kv_calibration"]  # one rank
    assert all(float(layer["k_tensor_scale"]) > 0 and float(layer["v_tensor_scale"]) > 0 for layer in scales)
    train(load_config(part.run_dir / "config.yaml", ["trainer.iterations=4"]), resume=True, show_progress=False)

    rows = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward_mean", "mismatch_abs_mean", "ratio_max"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    a = load_file(full.run_dir / "checkpoints" / "iter_000004" / "model.safetensors")
    b = load_file(part.run_dir / "checkpoints" / "iter_000004" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_periodic_eval_leaves_a_partial_runs_training_stream_unchanged(tmp_path):
    """The eval's `generate` stepped the engine until every request finished, the collector's partial responses
    too, and dropped their completions: groups 4, 5, 10, 11 were never delivered and nothing counted them. Now
    those requests wait through the eval (preempted, recomputed after), so the rollout goes on as without it."""
    common = ["trainer.iterations=3", "data.eval_size=8", "rollout.mode=partial", "rollout.max_slots=8",
              "rollout.quota_groups=4", "rollout.group_size=4", "rollout.carry=recompute"]
    plain = small_run(tmp_path, "plain", *common)
    train(plain, show_progress=False)
    evaluated = small_run(tmp_path, "evaluated", *common, "eval.every=1", "eval.k=2")
    train(evaluated, show_progress=False)
    rows = [json.loads(line) for line in (evaluated.run_dir / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (plain.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(r["groups"]) for r in ref] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [r["eval/policy_version"] for r in rows] == [1, 2, 3]  # after each update's refresh
    for key in ("groups", "reward_mean", "response_len_mean", "staleness_hist", "dropped_stale"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key


def test_a_periodic_evals_seconds_are_recorded_outside_time_total(tmp_path, monkeypatch):
    """The eval ran after time_total closed and no field timed it: a run's wall time could not be accounted
    for from its rows. Reference: an eval made 0.3 s slower by a sleep inside it."""
    import time

    import kv4rl.loop as loop

    real = loop.run_eval
    monkeypatch.setattr(loop, "run_eval", lambda s, it: (time.sleep(0.3), real(s, it))[1])
    cfg = small_run(tmp_path, "timed", "trainer.iterations=2", "data.eval_size=4", "eval.every=1", "eval.k=1")
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert 0.3 <= row["eval/time_s"] < 30, row["eval/time_s"]
        phases = sum(row[k] for k in ("time_rollout", "time_reward", "time_update", "time_sync", "time_sleep_wake"))
        assert phases <= row["time_total"] < phases + 0.25  # the sleep is in no phase and not in time_total


def test_an_evals_preemptions_are_in_its_own_row_and_the_last_one_reaches_the_log(tmp_path):
    """The row was built before the eval, so an eval's preemptions (the partial responses it parks) showed in
    the next row, and the last eval's in none: the log's final `preemptions` fell short of the run's total,
    which the checkpoint held (a resume's first row then jumped). Reference: the saved engine counter."""
    run = small_run(tmp_path, "evaluated", "trainer.iterations=2", "data.eval_size=4", "rollout.mode=partial",
                    "rollout.max_slots=8", "rollout.quota_groups=4", "rollout.group_size=4", "eval.every=1",
                    "eval.k=2", "checkpoint.save_every=1")
    train(run, show_progress=False)
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [torch.load(run.run_dir / "checkpoints" / f"iter_{n:06d}" / "trainer_state.pt",
                        weights_only=False)["engine_preemptions"] for n in (1, 2)]
    assert [r["preemptions"] for r in rows] == [counts[0] for counts in saved]
    assert rows[-1]["preemptions"] > 0  # the last eval parked responses in flight


def test_a_max_versions_lowered_at_resume_holds_for_the_restored_responses(tmp_path):
    """`--resume ... staleness.max_versions=1` restored responses checked only against the saved (absent)
    bound: the first batch collected after the resume delivered tokens 4 versions old. Reference: the bound
    itself, on every batch collected after the resume (the `lag` batch already collected is delivered as is)."""
    common = ["rollout.mode=partial", "rollout.max_slots=40", "rollout.quota_groups=4", "rollout.group_size=4",
              "staleness.lag=1", "checkpoint.save_every=3"]
    part = small_run(tmp_path, "mv", "trainer.iterations=3", *common)
    train(part, show_progress=False)
    train(load_config(part.run_dir / "config.yaml", ["trainer.iterations=6", "staleness.max_versions=1"]),
          resume=True, show_progress=False)
    rows = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(6))
    assert max(r["staleness_max"] for r in rows[:4]) > 1  # the case arose: older tokens were in flight
    assert [r["staleness_max"] <= 1 for r in rows[4:]] == [True, True], [r["staleness_max"] for r in rows]
    assert rows[-1]["dropped_stale"] > 0


def test_a_refresh_every_lowered_at_resume_refreshes_the_lagging_engine_first(tmp_path):
    """A partial run at refresh_every=3 checkpointed with its engine two versions behind; resumed with
    refresh_every=1 and max_versions=1, its first batch was sampled by those weights: 14 tokens 2 versions old
    (helper). Reference: the new bound on every batch after the resume."""
    common = ["rollout.mode=partial", "rollout.quota_groups=2", "rollout.group_size=2", "rollout.max_slots=4",
              "staleness.refresh_every=3", "checkpoint.save_every=2"]
    part = small_run(tmp_path, "rf", "trainer.iterations=2", *common)
    train(part, show_progress=False)
    state = torch.load(part.run_dir / "checkpoints" / "iter_000002" / "trainer_state.pt", weights_only=False)
    assert state["iteration"] - state["engine_version"] == 2  # the case arose: the engine lags by two
    train(load_config(part.run_dir / "config.yaml", ["trainer.iterations=4", "staleness.refresh_every=1",
                                                     "staleness.max_versions=1"]), resume=True, show_progress=False)
    rows = [json.loads(line) for line in (part.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(4))
    assert [r["staleness_max"] <= 1 for r in rows[2:]] == [True, True], [r["staleness_hist"] for r in rows]



def test_a_run_reads_its_tokenizer_once(tmp_path, monkeypatch):
    """The loop loads the policy's tokenizer to check it before the learner's build and hands it to the
    rollout side: a second load was seconds at 8B for nothing."""
    from transformers import AutoTokenizer

    loads = []
    real = AutoTokenizer.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):
        loads.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    train(small_run(tmp_path, "once", "trainer.iterations=1", "eval.every=0"), show_progress=False)
    assert len(loads) == 1, loads
