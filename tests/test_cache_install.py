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


SIGTERM_MID_BUILD = """
import os, signal, sys, time
from pathlib import Path
{setup}
def build(staging, *args, **kwargs):
    (Path(staging) / "weights").write_bytes(b"w" * 1000)
    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's SIGTERM while the weights are written
    time.sleep(60)
{call}
"""


def test_a_sigterm_mid_build_removes_its_staging_folder(tmp_path):
    """The default action of SIGTERM ran no `finally`: a bench killed while building an 8B random model left
    16 GB in the cache for a day. Reference: the cache folder as it was before the build (empty), and the
    exit status a SIGTERM gives (143)."""
    import subprocess
    import sys

    cases = {
        "cached_build": ("from kv4rl.models.cache_install import cached_build",
                         "cached_build(Path(sys.argv[1]), 'm', build, lambda f: (f / 'weights').is_file(), 'test')"),
        "random_model_dir": ("import kv4rl.bench.random_model as rm",
                             "rm.make_random_qwen3 = build\nrm.random_model_dir('qwen3-tiny', cache_dir=Path(sys.argv[1]))"),
    }
    for name, (setup, call) in cases.items():
        cache = tmp_path / name
        cache.mkdir()
        script = SIGTERM_MID_BUILD.format(setup=setup, call=call)
        done = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 143, (name, done.returncode, done.stderr[-2000:])
        assert list(cache.iterdir()) == [], name
