"""`save_checkpoint` over a folder of the same iteration already there: this run's own (an earlier save
at that iteration) is replaced and said so; another run's, or one whose writer cannot be read, is
kept under a new name, with a warning that says which of the two it was."""

import json
import logging

import pytest

from kv4rl.trainer.checkpoint import META_FILE, clear_stale_temps, save_checkpoint, set_aside_newer


def _save(run_dir, run_id):
    return save_checkpoint(run_dir, 3, lambda folder: (folder / "model.txt").write_text(run_id), {"x": 1},
                           run_id, keep_last=5)


def _existing(run_dir, meta: str | None):
    folder = run_dir / "checkpoints" / "iter_000003"
    folder.mkdir(parents=True)
    (folder / "model.txt").write_text("old")
    if meta is not None:
        (folder / META_FILE).write_text(meta)
    return folder


def test_this_runs_earlier_save_is_replaced_with_a_warning(tmp_path, caplog):
    _existing(tmp_path, json.dumps({"run_id": "me", "iteration": 3}))
    with caplog.at_level(logging.WARNING):
        final = _save(tmp_path, "me")
    assert (final / "model.txt").read_text() == "me"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_000003", "latest"]
    assert "replaced" in caplog.text and "an earlier save of this run" in caplog.text


def test_another_runs_save_is_kept_and_named_as_another_runs(tmp_path, caplog):
    _existing(tmp_path, json.dumps({"run_id": "other", "iteration": 3}))
    with caplog.at_level(logging.WARNING):
        _save(tmp_path, "me")
    kept = tmp_path / "checkpoints" / "iter_000003.other-run-1"
    assert (kept / "model.txt").read_text() == "old"
    assert "was written by another run; kept it as iter_000003.other-run-1" in caplog.text


def test_a_save_of_unknown_writer_is_kept_and_not_called_another_runs(tmp_path, caplog):
    _existing(tmp_path, "{not json")
    with caplog.at_level(logging.WARNING):
        _save(tmp_path, "me")
    kept = tmp_path / "checkpoints" / "iter_000003.other-run-1"
    assert (kept / "model.txt").read_text() == "old" and (kept / META_FILE).read_text() == "{not json"
    assert f"does not say which run wrote it ({META_FILE} unreadable or missing)" in caplog.text
    assert "another run" not in caplog.text


def _save_at(run_dir, iteration, keep_last=5):
    return save_checkpoint(run_dir, iteration, lambda folder: (folder / "model.txt").write_text(str(iteration)),
                           {"x": 1}, "me", keep_last=keep_last)


def test_setting_aside_a_damaged_newest_points_latest_at_the_checkpoint_resumed_from(tmp_path):
    """A resume renamed the damaged `iter_2` but left `latest` naming it until the next save: a run killed
    before that pointed `latest` (which the README says names the newest) at a folder that no longer existed.
    Reference: the folder names after the rename."""
    for i in (1, 2):
        _save_at(tmp_path, i)
    assert set_aside_newer(tmp_path, 1) == ["iter_000002.damaged"]
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "iter_000001" and (root / "iter_000001").is_dir()
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", "iter_000002.damaged", "latest"]


def test_a_prune_killed_half_way_leaves_nothing_that_retention_can_no_longer_delete(tmp_path, monkeypatch):
    """Retention deleted an old checkpoint in place. Killed part way (its `checkpoint.json` gone first), the
    folder no longer said which run wrote it, so no later prune touched it: kept for ever. Reference: a run
    with `keep_last=1` that is resumed holds only its newest checkpoint."""
    import shutil

    from kv4rl.trainer import checkpoint

    real = shutil.rmtree

    def killed(path, ignore_errors=False):
        if "iter_000001" not in path.name:  # the save's own temporary folder
            return real(path, ignore_errors=ignore_errors)
        (path / META_FILE).unlink(missing_ok=True)  # the first file rmtree happened to delete
        raise KeyboardInterrupt

    _save_at(tmp_path, 1, keep_last=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    try:
        _save_at(tmp_path, 2, keep_last=1)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    clear_stale_temps(tmp_path)  # what a resume does first
    _save_at(tmp_path, 3, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_000003", "latest"]


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_lagging_tp_checkpoint_missing_a_ranks_engine_slice_is_passed_over(tmp_path, damage, caplog, tiny_qwen3):
    """A tensor-parallel engine behind the learner saves one weights file per rank. One of them gone or cut
    short stopped the resume with "does not load" although an older checkpoint was intact (a missing optimizer
    shard is passed over). Reference: the files written, and which of them was damaged by hand."""
    import torch

    from kv4rl.trainer.checkpoint import PER_RANK, engine_slice_file, find_resume_checkpoint

    import shutil

    model_dir, _ = tiny_qwen3
    def copy_model(folder):  # the weights of a tiny model, and a tokenizer file for the folder check
        for f in model_dir.iterdir():
            shutil.copy(f, folder)
        (folder / "tokenizer.json").write_text("{}")

    for i in (1, 2):
        final = save_checkpoint(tmp_path, i, copy_model,
                                {"engine_weights": PER_RANK, "world": 2}, "me", keep_last=5)
        for rank in (0, 1):
            torch.save({"w": torch.full((64,), float(rank))}, final / engine_slice_file(rank))
    assert find_resume_checkpoint(tmp_path)[0].name == "iter_000002"
    bad = tmp_path / "checkpoints" / "iter_000002" / engine_slice_file(1)
    if damage == "missing":
        bad.unlink()
    else:
        bad.write_bytes(bad.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        path, state = find_resume_checkpoint(tmp_path)
    assert path.name == "iter_000001" and state["iteration"] == 1
    assert f"checkpoint iter_000002 is damaged: {bad} does not load" in caplog.text


def test_every_file_reaches_the_disk_before_the_rename_that_publishes_it(tmp_path, monkeypatch):
    """A power loss right after a rename must not leave an `iter_N` (or a `latest`) whose data never reached
    the disk: every file and folder of the checkpoint is fsynced before the folder is renamed into place, the
    pointer before its rename, and the checkpoints folder after each rename (which makes the new name durable)."""
    import os

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), replace(a, b))[1])

    def write_files(folder):
        (folder / "model.txt").write_text("weights")
        (folder / "sub").mkdir()
        (folder / "sub" / "shard.bin").write_bytes(b"\0" * 10)

    final = save_checkpoint(tmp_path, 3, write_files, {"x": 1}, "me", keep_last=5)
    root = str(final.parent)
    tmp = str(final.with_name(".tmp_" + final.name))
    publish = events.index(("replace", tmp, str(final)))
    pointer = events.index(("replace", root + "/latest.tmp", root + "/latest"))
    synced_before = {e[1] for e in events[:publish] if e[0] == "fsync"}
    written = {str(p.relative_to(final)) for p in final.rglob("*")}
    assert written == {"model.txt", "sub", "sub/shard.bin", META_FILE, "trainer_state.pt"}
    assert {tmp + "/" + rel for rel in written} | {tmp} <= synced_before
    assert ("fsync", root) in events[publish:pointer]
    assert ("fsync", root + "/latest.tmp") in events[publish:pointer]
    assert events[-1] == ("fsync", root)


def test_a_checkpoint_names_the_software_that_wrote_it(tmp_path):
    """checkpoint.json held the run and iteration only: a checkpoint taken to another machine did not say which
    kv4rl, torch or transformers trained it. Reference: the installed distributions' metadata."""
    import json
    from importlib import metadata

    import kv4rl

    meta = json.loads((_save_at(tmp_path, 1) / META_FILE).read_text())
    assert meta["run_id"] == "me" and meta["iteration"] == 1
    assert meta["versions"]["kv4rl"] == kv4rl.__version__
    assert meta["versions"]["torch"] == metadata.version("torch")
    assert meta["versions"]["transformers"] == metadata.version("transformers")


def test_keep_last_null_keeps_every_checkpoint_and_two_keeps_the_newest_two(tmp_path):
    """verl's max_actor_ckpt_to_keep: null keeps all: `checkpoint.keep_last=null` was refused (expected int), so a
    verl user's run deleted all but two."""
    from kv4rl.config import ConfigError, load_config

    for i in (1, 2, 3, 4):
        _save_at(tmp_path / "all", i, keep_last=None)
        _save_at(tmp_path / "two", i, keep_last=2)
    names = lambda run: sorted(p.name for p in (tmp_path / run / "checkpoints").glob("iter_*"))  # noqa: E731
    assert names("all") == ["iter_000001", "iter_000002", "iter_000003", "iter_000004"]
    assert names("two") == ["iter_000003", "iter_000004"]
    assert load_config(None, ["checkpoint.keep_last=null"]).checkpoint.keep_last is None
    with pytest.raises(ConfigError, match=r"checkpoint.keep_last must be >= 1 \(or null: keep every checkpoint\)"):
        load_config(None, ["checkpoint.keep_last=0"])
