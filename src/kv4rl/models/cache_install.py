"""Atomic install of a model folder, built in a staging folder of the kv4rl cache, into place.

Several processes may build the same cached model at once (parallel runs, tests); each builds in
its own staging folder and renames it into place. The first complete folder wins; an incomplete or
stale one (files missing, an older recipe or version, weights that no longer hash to the build record's
fingerprint) is moved aside and dropped, never half-replaced.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from kv4rl.file_modes import honour_umask
from kv4rl.graceful_stop import cleanup_on_sigterm
from kv4rl.paths import file_in_path

log = logging.getLogger(__name__)


def move_into_place(staging: Path, final: Path, is_complete: Callable[[Path], bool], tag: str) -> None:
    """Rename `staging` to `final` unless a complete `final` is already there (then keep that one)."""
    if final.exists():
        if is_complete(final):  # another process finished first; keep its copy
            return
        discard = Path(tempfile.mkdtemp(prefix=f".{tag}.old-", dir=final.parent))
        try:
            os.replace(final, discard / "model")
        except FileNotFoundError:
            pass  # another process moved the stale folder aside first
        shutil.rmtree(discard, ignore_errors=True)
    try:
        os.replace(staging, final)
    except OSError:
        if not is_complete(final):  # lost a race to a concurrent build only if that build is complete
            raise


ABANDONED_AFTER_S = 24 * 3600  # no build takes a day: an older staging folder's process is gone


def clear_abandoned(parent: Path, tag: str) -> None:
    """Remove staging (`.tag.tmp-*`) and discarded (`.tag.old-*`) folders older than a day: a build killed
    with SIGKILL leaves its staging folder, weights and all, and nothing else ever removes it."""
    now = time.time()
    for pattern in (f".{tag}.tmp-*", f".{tag}.old-*"):
        for folder in parent.glob(pattern):
            try:
                if now - folder.stat().st_mtime > ABANDONED_AFTER_S:
                    shutil.rmtree(folder, ignore_errors=True)
            except OSError:
                pass  # removed meanwhile


def cached_build(parent: Path, tag: str, build: Callable[[Path], None], is_complete: Callable[[Path], bool],
                 what: str) -> Path:
    """`parent/tag`, first built by `build(staging_folder)` and moved into place when not complete."""
    final = parent / tag
    if is_complete(final):
        return final
    blocking = file_in_path(parent)
    if blocking is not None:
        raise ValueError(f"the kv4rl cache {parent} cannot be created: {blocking} is a file (point $KV4RL_CACHE, "
                         f"or build-model's --cache-dir, at a folder)")
    if final.exists():  # it was rebuilt without a word: say that the cached copy is not taken, and why
        log.warning("%s: the cached %s is not its build (another version or recipe, or a file cut short, edited or removed since); "
                    "building it again", what, final)
    parent.mkdir(parents=True, exist_ok=True)
    clear_abandoned(parent, tag)
    with cleanup_on_sigterm():  # a SIGTERM mid-build removes the staging folder too
        staging = Path(tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=parent))
        try:
            try:
                build(staging)
            except (OSError, SafetensorError) as exc:  # a full disk: one line naming it, not a traceback
                raise ValueError(f"{what} in {parent} failed: {exc} (nothing was installed)") from exc
            honour_umask(staging)  # mkdtemp made it private, safetensors its weights; others read the cache
            move_into_place(staging, final, is_complete, tag)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not is_complete(final):
        raise RuntimeError(f"{what} did not leave a complete folder at {final}")
    return final
