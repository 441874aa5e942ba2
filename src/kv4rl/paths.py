"""Checks on user-given paths that every command shares (a result file, a run folder's parent)."""

from __future__ import annotations

from pathlib import Path


def file_in_path(folder: Path) -> Path | None:
    """The first existing part of `folder` (itself or a parent) that is not a directory, which makes the
    folder impossible to create; None when there is none."""
    for part in (folder, *folder.parents):
        if part.exists():
            return None if part.is_dir() else part
    return None
