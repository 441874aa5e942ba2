"""Atomic install of a model folder built into a staging folder of the kv4rl cache.

Several processes may build the same cached model at once (parallel runs, tests); each builds in
its own staging folder and renames it into place. The first complete folder wins; an incomplete or
stale one (an older recipe, a manual edit) is moved aside and dropped, never half-replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def move_into_place(staging: Path, final: Path, is_complete: Callable[[Path], bool], tag: str) -> None:
    """Rename `staging` to `final` unless a complete `final` is already there (then keep that one)."""
    if final.exists():
        if is_complete(final):  # another process finished first; keep its copy
            return
        discard = Path(tempfile.mkdtemp(prefix=f".{tag}.old-", dir=final.parent))
        os.replace(final, discard / "model")
        shutil.rmtree(discard, ignore_errors=True)
    try:
        os.replace(staging, final)
    except OSError:
        if not is_complete(final):  # lost a race to a concurrent build only if that build is complete
            raise
