"""Data on the disk before the name that publishes it.

A rename into place is atomic against a crash of the process, not against a power loss: without an
fsync the new name can reach the disk before the blocks of the files under it (ext4 flushes data at a
rename only over an existing file, and a checkpoint folder's name is new), leaving an `iter_N` of empty
files that `latest` points at. So a writer syncs the files and their folder, renames, and syncs the
parent folder that now holds the new name.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# what a file system that cannot sync a folder (or a read-only descriptor) answers: nothing to do there
_CANNOT_SYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})


def sync_path(path: Path) -> None:
    """fsync one file or folder (a folder's fsync makes its entries, i.e. renames into it, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in _CANNOT_SYNC:
            raise
    finally:
        os.close(fd)


def sync_tree(top: Path) -> None:
    """Every file under `top` (links left alone), then every folder from the deepest up, `top` last."""
    folders = []
    for root, _, files in os.walk(top):
        for name in files:
            path = Path(root, name)
            if not path.is_symlink():
                sync_path(path)
        folders.append(Path(root))
    for folder in reversed(folders):
        sync_path(folder)
