"""`save_checkpoint` over a folder of the same iteration already there: this run's own (an earlier save
at that iteration) is replaced and said so; another run's, or one whose writer cannot be read, is
kept under a new name, with a warning that says which of the two it was."""

import json
import logging

from kv4rl.trainer.checkpoint import META_FILE, save_checkpoint


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
