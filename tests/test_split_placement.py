"""`rollout.placement: split` on the CPU (gloo): engines on some ranks, the learner on the others.

Checked against references that do not come from the split code: the groups each engine started
(its stream share: e, e + K, ...) are each consumed once, sent but left unconsumed, or still held at
the end, never two of these and never lost; every consumed response's token versions, recorded as
the learner received them, never go down and are never older than `staleness.max_versions` nor newer
than the update; with lag 0 and refresh every update (the engine waits for each refresh) the split
run's updates equal a single-process run's; bad settings are refused by name before any work.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kv4rl.config import ConfigError, load_config
from kv4rl.split.learner_side import StalenessViolation, check_versions
from kv4rl.split.run import check_split
from tests.gloo_ranks import run_on_gloo_ranks
from tests.small_runs import tiny_weights_sha256

SMALL = ["device=cpu", "rollout.quota_groups=4", "rollout.group_size=2", "rollout.max_slots=4"]
ASYNC = ["rollout.placement=split", "rollout.engine_ranks=2", "rollout.mode=partial", "rollout.carry=recompute",
         "rollout.max_new_tokens=24", "staleness.lag=1", "staleness.max_versions=1", "trainer.iterations=8",
         "checkpoint.save_every=8"]
MAX_VERSIONS = 1


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _split_rank(rank: int, out_dir: str, overrides: list[str], resume: bool = False) -> dict:
    """One rank of a split run; rank 0 also records every batch exactly as the learner received it, and
    every learner rank the AdamW step count of each parameter at the end."""
    from kv4rl.split import learner_side, run
    from kv4rl.split.run import run_split

    seen, steps = [], []
    check, learn = learner_side.check_versions, run.run_learner

    def recording(update, groups, max_versions):
        seen.append((update, [(g.index, [list(c.versions) for c in g.completions]) for g in groups]))
        check(update, groups, max_versions)

    def counting(side, *args):
        out = learn(side, *args)
        steps.extend(float(state["step"]) for state in side.learner.optimizer.state.values())
        return out

    learner_side.check_versions, run.run_learner = recording, counting
    cfg = load_config(None, [f"out_dir={out_dir}", *SMALL, *overrides])
    summary, end = run_split(cfg, resume=resume, show_progress=False, overwrite=False)
    return {"summary": summary, "end": end, "seen": seen, "steps": steps}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """One learner rank and two engines, partial rollout running one update ahead, max_versions 1."""
    out = tmp_path_factory.mktemp("split")
    (out / "ranks").mkdir()
    ranks = run_on_gloo_ranks(_split_rank, 3, out / "ranks", str(out), ["name=async", *ASYNC])
    return out / "async", ranks


@pytest.mark.slow
def test_split_run_never_loses_or_repeats_a_group_and_keeps_the_staleness_bound(async_run):
    run_dir, ranks = async_run
    head = ranks[0]
    reports = {r["engine"]: r for r in head["end"]["engines"]}
    assert reports == {e: ranks[1 + e]["end"] for e in (0, 1)}  # what each engine reported is what the head got
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == list(range(8))
    consumed = [g for r in rows for g in r["groups"]]
    unconsumed = [g for batch in head["end"]["unconsumed_batches"] for g in batch]
    for update, row in enumerate(rows):  # update u consumes each engine's u-th batch
        assert row["groups"] == sorted(g for r in reports.values() for g in r["sent"][update])
    for e, report in reports.items():
        started = {e + 2 * n for n in range(report["next_group"])}  # engine e's share of the prompt stream
        mine = [g for g in consumed if g % 2 == e]
        left = [g for g in unconsumed if g % 2 == e]
        assert len(mine) == 8 * 2 and sorted(left) == sorted(g for batch in report["sent"][8:] for g in batch)
        every = mine + left + report["held"]
        assert len(every) == len(set(every)) and set(every) == started
    assert len(consumed) == len(set(consumed)) == 32
    assert head["summary"]["groups_sent_unconsumed"] == len(unconsumed)

    # every token as the learner received it: versions never down, never newer than the update, at
    # most max_versions old; and the engines really ran ahead of the learner (some tokens 1+ old)
    assert [u for u, _ in head["seen"]] == list(range(8))
    ages = []
    for update, groups in head["seen"]:
        for _, responses in groups:
            for versions in responses:
                assert versions == sorted(versions)
                assert all(0 <= update - v <= MAX_VERSIONS for v in versions)
                ages += [update - v for v in versions]
    assert max(ages) == 1
    assert sorted(g for _, groups in head["seen"] for g, _ in groups) == sorted(consumed)
    for row, (update, groups) in zip(rows, head["seen"], strict=True):
        hist = {str(a): n for a in range(2) if (n := sum(update - v == a for _, rs in groups for vs in rs for v in vs))}
        assert row["staleness_hist"] == hist and row["staleness_max"] <= MAX_VERSIONS
        assert row["num_tokens"] == sum(hist.values())
        assert {"time_learner_wait", "time_engine_wait", "time_engine_sync", "time_update", "time_sync"} <= row.keys()
    assert rows[-1]["dropped_stale"] > 0  # responses carried past the bound were re-sampled, not consumed
    assert {r["model_sha256"] for r in rows} == {tiny_weights_sha256()[:16]}  # the rows name the starting model
    assert (run_dir / "checkpoints" / "iter_000008" / "model.safetensors").is_file()


def _train_rank(rank: int, out_dir: str, overrides: list[str]) -> None:
    from kv4rl.loop import train

    train(load_config(None, [f"out_dir={out_dir}", *SMALL, *overrides]), show_progress=False)


@pytest.mark.slow
@pytest.mark.parametrize(("engines", "updates", "rewards"), [
    (1, 1, []), (1, 2, []),
    (2, 2, ["reward.extra=[boxed_format]", "reward.weights=[1.0,0.6]", "trainer.mask_truncated=true",
            "rollout.max_new_tokens=4", "reward.overlong_buffer=2", "trainer.mask_zero_advantage=true"]),
    (2, 1, ["advantage.estimator=remax"]),
    (2, 1, ["reward.extra=[boxed_format]", "reward.weights=[1.0,0.6]", "rollout.max_new_tokens=4",
            "reward.overlong_buffer=2", "reward.aggregation=normalize_then_sum", "advantage.std_scope=batch"])])
def test_split_run_waiting_for_every_refresh_equals_one_process(tmp_path, engines, updates, rewards):
    """lag 0, refresh every update: the engine starts batch b only with the weights of update b - 1, so
    the learner sees what one process samples; two learner ranks (FSDP2) equal one process's step. With two
    optimizer steps a batch, each mini-batch holds one process's groups: two engines' groups came in engine
    order (0, 2, 1, 3) and two learner ranks took contiguous shares, so mini-batch 0 trained groups 0 and 2. A
    weighted sum of rewards: its accuracy (the verifier's) and each reward's mean, which two engines' messages
    carry to the head, equal one process's; so do the trained tokens where cut responses and those of zero
    advantage are masked. ReMax's greedy scores, which the engines' messages carry, give one process's advantages.
    Under GDPO's aggregation the messages also carry the plain sum, which reward_mean reports."""
    from kv4rl.loop import train

    common = ["trainer.iterations=2", "rollout.mode=sync", "staleness.lag=0", "staleness.refresh_every=1",
              f"trainer.updates_per_batch={updates}", *rewards]
    run_on_gloo_ranks(_train_rank, 3, tmp_path, str(tmp_path),
                      ["name=split", "rollout.placement=split", f"rollout.engine_ranks={engines}", *common])
    train(load_config(None, [f"out_dir={tmp_path}", "name=one", *SMALL, *common]), show_progress=False)
    split, one = _rows(tmp_path / "split"), _rows(tmp_path / "one")
    weighted, remax = "reward.extra=[boxed_format]" in rewards, "advantage.estimator=remax" in rewards
    if "trainer.mask_truncated=true" in rewards:
        assert any(row["truncated_frac"] > 0 for row in one)  # some responses were masked
    for a, b in zip(split, one, strict=True):
        assert a["groups"] == b["groups"]
        assert a["time_sleep_wake"] == b["time_sleep_wake"] == 0.0  # every row has it (the split's lacked it)
        # every response token was sampled by the update's own weights (trained or masked: 4 groups of 2)
        assert a["staleness_hist"] == b["staleness_hist"] == {"0": round(8 * b["response_len_mean"])}
        for key in ("num_tokens", "reward_mean", "reward_std", "accuracy", "response_len_mean", "adv_std"):
            assert a[key] == b[key], key
        reward_means = sorted(key for key in b if key.startswith("rewards/"))
        assert reward_means == (["rewards/boxed_format/mean", "rewards/exact/mean", "rewards/overlong/mean"]
                                if weighted else [])
        assert all(a[key] == b[key] for key in reward_means)
        if remax:
            assert a["remax/baseline_reward_mean"] == b["remax/baseline_reward_mean"]
            assert a["reward_baseline_no_answer"] == b["reward_baseline_no_answer"]  # both engines' greedy counts
            assert a["adv_mean"] == pytest.approx(b["adv_mean"]) and b["adv_mean"] != 0
        if weighted:
            assert any(row["zero_var_group_frac"] > 0 for row in one)
            # a wrong answer in a box scores 0.6: counted as correct by the sum, not by the verifier
            assert a["reward_mean"] == pytest.approx(b["rewards/exact/mean"] + 0.6 * b["rewards/boxed_format/mean"]
                                                     + b["rewards/overlong/mean"])
            assert a["accuracy"] == pytest.approx(b["rewards/exact/mean"], abs=1e-7)
        if "trainer.mask_zero_advantage=true" in rewards:  # flat groups' responses (zero advantage) are masked too
            assert b["num_tokens"] <= 8 * (b["response_len_mean"] - 4 * b["truncated_frac"]) + 1e-9
        for key in ("loss", "grad_norm", "entropy", "mismatch_abs_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def _cfg(*overrides: str):
    return load_config(None, [*SMALL, "rollout.placement=split", *overrides])


@pytest.mark.parametrize(("overrides", "world", "message"), [
    ([], 1, "under torchrun with at least 2 processes"),
    (["rollout.engine_ranks=2"], 2, "1 <= rollout.engine_ranks <= 1"),
    (["rollout.engine_ranks=3"], 4, "over the 3 engine ranks"),
    (["rollout.engine_ranks=1"], 4, "over the 3 learner ranks"),
    (["engine.tensor_parallel=2", "rollout.engine_ranks=2"], 4, "engine.tensor_parallel"),
    (["eval.every=2"], 2, "kv4rl eval --model"),
    (["engine.sleep_between_rollouts=true", "rollout.carry=recompute"], 2, "engine.sleep_between_rollouts"),
    # 2 groups x 2 responses over 2 learner ranks: 2 rows each, fewer than 3 optimizer steps (the config's own
    # check, against the whole batch of 4, lets it through)
    (["rollout.engine_ranks=1", "rollout.quota_groups=2", "rollout.group_size=2", "trainer.updates_per_batch=3"], 3,
     "on each learner rank, which trains on 2"),
])
def test_split_settings_that_cannot_work_are_refused_by_name(overrides, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_split(_cfg(*overrides), world)


def test_split_without_torchrun_and_zero_engine_ranks_are_refused(tmp_path):
    from kv4rl.loop import train

    with pytest.raises(ConfigError, match="rollout.engine_ranks must be >= 1"):
        _cfg("rollout.engine_ranks=0")
    with pytest.raises(ConfigError, match="torchrun"):
        train(_cfg(f"out_dir={tmp_path}"), show_progress=False)
    assert not any(tmp_path.iterdir())


def _group(index: int, *versions: list[int]):
    return SimpleNamespace(index=index, completions=[SimpleNamespace(versions=v) for v in versions])


def test_the_learner_refuses_tokens_outside_the_staleness_bound():
    check_versions(5, [_group(0, [3, 4, 5], [5]), _group(1, [], [4])], max_versions=2)  # all within 5 - 2 .. 5
    check_versions(9, [_group(0, [0, 9])], max_versions=None)  # no bound set
    with pytest.raises(StalenessViolation, match="group 1, response 0: a token of version 2 is 3 versions old"):
        check_versions(5, [_group(0, [4]), _group(1, [2, 5])], max_versions=2)
    with pytest.raises(StalenessViolation, match="versions go down"):
        check_versions(5, [_group(3, [5, 4])], max_versions=2)
    with pytest.raises(StalenessViolation, match="a token of version 6"):
        check_versions(5, [_group(3, [6])], max_versions=None)


@pytest.mark.slow
def test_a_failing_engine_ends_the_split_job_with_its_error(tmp_path):
    """The engine (rank 1) raises while scoring its third batch, with the learner waiting for it:
    torchrun ends the whole job, non-zero, with the engine's error (no hang)."""
    from tests.test_train_data_parallel import torchrun

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('LOCAL_RANK') == '1':\n"
        "    import kv4rl.split.engine_side as side\n"
        "    score, calls = side.score, []\n"
        "    def failing(s, groups):\n"
        "        calls.append(1)\n"
        "        if len(calls) == 3:\n"
        "            raise RuntimeError('the engine fails on purpose in its third batch')\n"
        "        return score(s, groups)\n"
        "    side.score = failing\n")
    failed = torchrun(tmp_path, "name=fail", "trainer.iterations=4", "rollout.placement=split", *SMALL,
                      "--no-progress", pythonpath=str(hook))
    assert failed.returncode != 0
    assert "the engine fails on purpose in its third batch" in failed.stderr + failed.stdout
    assert [r["iteration"] for r in _rows(tmp_path / "runs" / "fail")] == [0, 1]


def _signalled_rank(rank: int, out_dir: str, name: str, iterations: int, at: int) -> dict:
    """One rank of an `iterations`-update split run whose head sees a stop signal during update `at`."""
    from kv4rl.split import learner_side
    from kv4rl.split.run import run_split

    real = learner_side.update

    def signalled(s, it, stop):
        if s.head and it == at:
            stop.requested = "SIGINT"  # as GracefulStop sets it: the update in progress finishes
        return real(s, it, stop)

    learner_side.update = signalled
    cfg = load_config(None, [f"out_dir={out_dir}", f"name={name}", *SMALL, "rollout.placement=split",
                             "rollout.engine_ranks=1", f"trainer.iterations={iterations}", "checkpoint.save_every=10",
                             "rollout.max_new_tokens=8"])
    summary, _ = run_split(cfg, resume=False, show_progress=False, overwrite=False)
    return summary


def test_a_signal_during_the_last_update_reports_a_finished_split_run(tmp_path):
    """The head's summary said 'stopped by SIGINT after iteration 2' of a 2-update run that had done every
    update and written its last checkpoint, and the CLI told the user to resume it. Reference: the updates
    asked for, all in metrics.jsonl."""
    summaries = run_on_gloo_ranks(_signalled_rank, 2, tmp_path, str(tmp_path), "last", 2, 1)
    head = summaries[0]
    assert [r["iteration"] for r in _rows(tmp_path / "last")] == [0, 1]
    assert "stopped_by" not in head, head["stopped_by"]


def test_a_stopped_split_run_names_its_last_iteration_as_its_rows_do(tmp_path):
    """The split summary said 'after iteration 1' of a run whose rows end at iteration 0 (it counted the updates
    done; the colocated summary and the rows number iterations from 0)."""
    head = run_on_gloo_ranks(_signalled_rank, 2, tmp_path, str(tmp_path), "first", 3, 0)[0]
    assert [r["iteration"] for r in _rows(tmp_path / "first")] == [0]
    assert head["stopped_by"] == "SIGINT after iteration 0"


def test_updates_per_batch_is_checked_against_each_learner_ranks_share():
    """Each of W learner ranks trains on quota_groups x group_size / W responses: more optimizer steps than that
    is refused by name before any model is built (colocated data parallel and split alike); one rank, or steps
    within the share, pass."""
    from kv4rl.run_setup import check_updates_per_rank

    cfg = load_config(None, [*SMALL, "rollout.quota_groups=4", "rollout.group_size=2", "trainer.updates_per_batch=3"])
    check_updates_per_rank(cfg, 1)
    check_updates_per_rank(cfg, 2)  # 4 rows a rank
    with pytest.raises(ConfigError, match=r"which trains on 2 \(rollout.quota_groups x rollout.group_size = 8 over 4"):
        check_updates_per_rank(cfg, 4)

