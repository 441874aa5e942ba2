"""The model cache's install: a complete folder wins a race, a stale one is replaced whole, and staging folders
that a killed build left are removed once they are a day old (never a live build's)."""

import os
import time

from kv4rl.models.cache_install import ABANDONED_AFTER_S, cached_build, move_into_place


def _complete(folder):
    return (folder / "done").is_file()


def _build(folder):
    (folder / "weights").write_text("w")
    (folder / "done").write_text("")


def test_a_stale_folder_another_process_moved_aside_first_is_no_error(tmp_path, monkeypatch):
    """Two processes replacing the same stale folder: the second's move found it gone (FileNotFoundError)."""
    final, staging = tmp_path / "m", tmp_path / ".m.tmp-1"
    final.mkdir()
    staging.mkdir()
    _build(staging)
    real_replace = os.replace

    def raced(src, dst):
        if str(src) == str(final) and "old" in str(dst):
            real_replace(src, tmp_path / "taken-by-the-other")  # the other process moves it aside just before
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", raced)
    move_into_place(staging, final, _complete, "m")
    assert _complete(final) and not list(tmp_path.glob(".m.old-*"))


def test_staging_folders_a_day_old_are_removed_and_fresh_ones_kept(tmp_path):
    old, fresh, other = tmp_path / ".m.tmp-old", tmp_path / ".m.tmp-live", tmp_path / ".n.tmp-old"
    for folder in (old, fresh, other):
        folder.mkdir()
        (folder / "model.safetensors").write_text("x")
    stale = time.time() - ABANDONED_AFTER_S - 60
    for folder in (old, other):
        os.utime(folder, (stale, stale))
    final = cached_build(tmp_path, "m", _build, _complete, "test model")
    assert _complete(final) and not old.exists() and fresh.is_dir() and other.is_dir()  # another tag's: kept
