"""`--resume` of a split run (gloo, CPU): stopped after N updates, continued to M.

Checked against the stream itself, not the resume code: every group the learner consumes over all M
updates is consumed once, and with what the resumed engines still sent or held at the end the groups
form each engine's whole share of the stream (e, e + K, ...), so a batch sent but not consumed before
the stop is sampled again, never lost; every token keeps the staleness bound, and the first resumed
batch is sampled by the checkpoint's weights (version N); two learner ranks write and read DCP shards
and their AdamW step count ends at M, not M - N; metrics.jsonl holds rows 0..M-1. A checkpoint of
another layout is refused by name, before the folder is touched.
"""

from __future__ import annotations

import pytest
import torch

from kv4rl.config import ConfigError, load_config
from kv4rl.split.resume import Consumed, check_split_resume
from kv4rl.trainer.checkpoint import CheckpointError
from tests.gloo_ranks import run_on_gloo_ranks
from tests.test_split_placement import SMALL, _rows, _split_rank

N, M, MAX_VERSIONS = 3, 6, 1
LAYOUT = ["name=resumed", "rollout.placement=split", "rollout.engine_ranks=2", "rollout.mode=partial",
          "rollout.carry=recompute", "rollout.max_new_tokens=24", "staleness.lag=1", "staleness.max_versions=1",
          "checkpoint.save_every=100"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Two learner ranks and two engines: N updates (a checkpoint at N), then `--resume` to M."""
    out = tmp_path_factory.mktemp("split_resume")
    first, second = out / "first", out / "second"
    first.mkdir()
    second.mkdir()
    before = run_on_gloo_ranks(_split_rank, 4, first, str(out), [*LAYOUT, f"trainer.iterations={N}"])
    after = run_on_gloo_ranks(_split_rank, 4, second, str(out), [*LAYOUT, f"trainer.iterations={M}"], True)
    return out / "resumed", before, after


@pytest.mark.slow
def test_a_resumed_split_run_consumes_every_group_once_and_restores_the_optimizer(resumed):
    run_dir, before, after = resumed
    state = torch.load(run_dir / "checkpoints" / f"iter_{N:06d}" / "trainer_state.pt", weights_only=False)
    assert (state["placement"], state["world"], state["engine_ranks"], state["iteration"]) == ("split", 4, 2, N)
    assert state["learner"]["optimizer_format"] == "dcp"
    assert (run_dir / "checkpoints" / f"iter_{N:06d}" / "optimizer" / ".metadata").is_file()

    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == list(range(M))  # the resumed rows follow the first run's
    consumed = [g for r in rows for g in r["groups"]]
    assert len(consumed) == len(set(consumed)) == M * 4
    first_run = {g for batch in [r["groups"] for r in rows[:N]] for g in batch}
    assert first_run == {g for _, groups in before[0]["seen"] for g, _ in groups}
    assert {g for r in rows[N:] for g in r["groups"]}.isdisjoint(first_run)
    head = after[0]["end"]
    reports = {r["engine"]: r for r in head["engines"]}
    unconsumed = [g for batch in head["unconsumed_batches"] for g in batch]
    for e, report in reports.items():
        assert report["first_batch"] == N  # the engine started at its batch N
        for update, row in zip(range(N, M), rows[N:], strict=True):
            assert [g for g in row["groups"] if g % 2 == e] == sorted(report["sent"][update - N])
        every = [g for g in consumed if g % 2 == e] + [g for g in unconsumed if g % 2 == e] + report["held"]
        assert len(every) == len(set(every)) and set(every) == {e + 2 * n for n in range(report["next_group"])}
    # what the first run had sent or held but not consumed was sampled again
    left_before = [g for batch in before[0]["end"]["unconsumed_batches"] for g in batch] + \
        [g for r in before[0]["end"]["engines"] for g in r["held"]]
    assert left_before and set(left_before) <= set(consumed) | set(unconsumed) | {
        g for r in reports.values() for g in r["held"]}

    seen = after[0]["seen"]
    assert [u for u, _ in seen] == list(range(N, M))
    for update, groups in seen:
        for _, responses in groups:
            for versions in responses:
                assert versions == sorted(versions) and all(0 <= update - v <= MAX_VERSIONS for v in versions)
    assert {v for _, responses in seen[0][1] for vs in responses for v in vs} == {N}  # the checkpoint's weights

    # the AdamW state came back: every parameter's step count is M on both learner ranks (fresh: M - N)
    for rank in (0, 1):
        assert before[rank]["steps"] and set(before[rank]["steps"]) == {float(N)}
        assert after[rank]["steps"] and set(after[rank]["steps"]) == {float(M)}
    assert after[0]["summary"]["resumed_from"] == N


@pytest.mark.slow
def test_a_split_checkpoint_of_another_layout_is_refused_before_touching_the_run(resumed, monkeypatch):
    from typer.testing import CliRunner

    from kv4rl.cli import app
    from kv4rl.run_setup import find_restore

    run_dir, _, _ = resumed
    snapshot = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    cfg = load_config(None, [f"out_dir={run_dir.parent}", *SMALL, *LAYOUT])
    restore = find_restore(cfg)
    check_split_resume(cfg, restore.path, restore.state, 4)  # the layout that wrote it
    with pytest.raises(CheckpointError, match="split run of 4 ranks with rollout.engine_ranks=2, and this job has "
                                              "3 ranks"):
        check_split_resume(cfg, restore.path, restore.state, 3)
    other = load_config(None, [f"out_dir={run_dir.parent}", *SMALL, *LAYOUT, "rollout.engine_ranks=1"])
    with pytest.raises(CheckpointError, match="this job has 4 ranks with rollout.engine_ranks=1"):
        check_split_resume(other, restore.path, restore.state, 4)
    weights_only = {k: v for k, v in restore.state.items() if k not in ("learner", "stream")}
    with pytest.raises(ConfigError, match="holds the policy's weights only"):
        check_split_resume(cfg, restore.path, weights_only, 4)
    monkeypatch.chdir(run_dir.parent)
    colocated = CliRunner().invoke(app, ["train", "--resume", "resumed", "rollout.placement=colocated",
                                         "--no-progress"])
    assert colocated.exit_code != 0 and "written by a split run" in colocated.output
    alone = CliRunner().invoke(app, ["train", "--resume", "resumed", "--no-progress"])  # split, without torchrun
    assert alone.exit_code != 0 and "torchrun" in alone.output
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == snapshot


def test_the_stream_place_keeps_gaps_and_refuses_a_group_consumed_twice():
    consumed = Consumed(2)
    consumed.take([0, 5, 2, 9])  # engine 0: positions 0, 1; engine 1: positions 2, 4 (0, 1, 3 not yet)
    assert consumed.state() == [{"next": 2, "beyond": []}, {"next": 0, "beyond": [2, 4]}]
    again = Consumed(2, consumed.state())
    again.take([1, 3])  # engine 1's positions 0 and 1: its prefix now runs to 3
    assert again.state() == [{"next": 2, "beyond": []}, {"next": 3, "beyond": [4]}]
    with pytest.raises(RuntimeError, match="stream position 4 consumed twice"):
        again.take([9])


def _stream_rank(rank: int, out_dir: str, overrides: list[str], resume: bool) -> str:
    """One rank of a small split run (or its resume); the error it stopped with, or "ok"."""
    from kv4rl.split.run import run_split

    cfg = load_config(None, [f"out_dir={out_dir}", *overrides])
    if resume:
        cfg = load_config(cfg.run_dir / "config.yaml", overrides[1:])
    try:
        run_split(cfg, resume=resume, show_progress=False, overwrite=False)
    except ConfigError as exc:
        return str(exc)
    return "ok"


def test_a_split_resume_refuses_a_training_stream_that_changed(tmp_path):
    """As in the colocated loop: another seed (or dataset contents, or data.shuffle) at the resume moved the
    run's place in the stream onto other problems. Every rank refuses it, the engines included, before any
    model is built. Reference: the seed given by hand."""
    base = ["name=stream", "device=cpu", "rollout.quota_groups=2", "rollout.group_size=2", "rollout.max_slots=4",
            "rollout.placement=split", "rollout.engine_ranks=1", "rollout.max_new_tokens=8",
            "checkpoint.save_every=1"]
    assert run_on_gloo_ranks(_stream_rank, 2, tmp_path, str(tmp_path), [*base, "trainer.iterations=1"],
                             False) == ["ok", "ok"]
    refused = run_on_gloo_ranks(_stream_rank, 2, tmp_path, str(tmp_path), [*base, "trainer.iterations=2", "seed=3"],
                                True)
    assert all("the training stream differs from the checkpoint's (seed 0 -> 3)" in r for r in refused), refused
