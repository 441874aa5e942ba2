"""Give the files and folders kv4rl publishes the permissions a plain open() or mkdir() would.

Two writers ignore the umask: safetensors stages each file in a private temporary file (0600) that it
renames into place, and `tempfile.mkdtemp` makes a private folder (0700). A checkpoint or cached model
left so is unreadable to the others sharing the run folder or cache, unlike every file beside it.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path


@functools.cache
def process_umask() -> int:
    """The umask, read once: reading it means setting it and setting it back, which is process-wide (a
    file another thread created in between would get no umask), so it is done in this one place."""
    old = os.umask(0)
    os.umask(old)
    return old


def umask_mode(is_dir: bool) -> int:
    """The permission bits mkdir() (0o777) or open() (0o666) give a new folder or file under the umask."""
    return (0o777 if is_dir else 0o666) & ~process_umask()


def honour_umask(*paths: Path) -> None:
    """Add to each path, and to everything under a folder, the permission bits the umask allows but its
    writer withheld. Bits are only added, so a shared folder keeps its setgid bit; links are left alone."""
    for top in paths:
        top = Path(top)
        for path in [top, *top.rglob("*")] if top.is_dir() else [top]:
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode):
                path.chmod(stat.S_IMODE(mode) | umask_mode(stat.S_ISDIR(mode)))
