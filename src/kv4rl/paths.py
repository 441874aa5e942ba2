"""Paths every command shares: checks on user-given ones (a result file, a run folder's parent) and the names
things set aside get."""

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


def free_sibling(path: Path, suffix: str) -> Path:
    """`path` renamed with `suffix`, or with `suffix-k` (k = 2, 3, ...) when that exists: where something
    moved aside goes without touching what an earlier move left there."""
    target, k = path.with_name(f"{path.name}{suffix}"), 1
    while target.exists():
        k += 1
        target = path.with_name(f"{path.name}{suffix}-{k}")
    return target
