"""Checks on user-given paths that every command shares (a result file, a run folder's parent)."""

from __future__ import annotations

import re
from pathlib import Path

# what `kv4rl train --overwrite` appends to the run folder it moves aside (`run_folder.set_aside`)
SET_ASIDE = re.compile(r"\.old-\d{8}-\d{6}(-\d+)?$")


def file_in_path(folder: Path) -> Path | None:
    """The first existing part of `folder` (itself or a parent) that is not a directory, which makes the
    folder impossible to create; None when there is none."""
    for part in (folder, *folder.parents):
        if part.exists():
            return None if part.is_dir() else part
    return None
