"""Paths every command shares: checks on user-given ones (a result file, a run folder's parent) and the names
things set aside get."""

from __future__ import annotations

import os
import re
import sys
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


def text_problem(key: str, value: str, path: bool = True) -> str | None:
    """Why `value` (a name, path or template a user gave; `path`: used as a file name) cannot be written as
    UTF-8 text or used as a file name here, or None. Tokenizers, TensorBoard and JSON write UTF-8 only: a run
    folder whose path's bytes are not UTF-8 (they reach Python as lone surrogates) failed at the first
    checkpoint, after the run's first iterations. Under a locale whose encoding is not UTF-8 (`LC_ALL=C` with
    `PYTHONUTF8=0`) non-ASCII arguments arrive so too, and a non-ASCII path cannot be a file name."""
    shown = readable(value)
    locale_hint = (f"{key}='{shown}': this locale's encoding ({sys.getfilesystemencoding()}) cannot hold it; run "
                   f"under a UTF-8 locale (LANG=C.UTF-8) or with PYTHONUTF8=1")
    if not _encodes(value, "utf-8"):
        try:
            value.encode("utf-8", "surrogateescape").decode("utf-8")
        except UnicodeError:  # bytes that are no UTF-8, or a surrogate that stands for no byte at all
            return (f"{key}='{shown}' holds bytes that are not UTF-8 text (written in another encoding?); "
                    f"give it in UTF-8")
        return locale_hint  # UTF-8 bytes a non-UTF-8 locale passed on as surrogate escapes
    if path and not _encodes(value, None):
        return locale_hint
    return None


def _encodes(value: str, encoding: str | None) -> bool:
    """Whether `value` encodes to `encoding` (None: the file-system encoding, as a path)."""
    try:
        value.encode("utf-8") if encoding == "utf-8" else os.fsencode(value)
    except UnicodeEncodeError:
        return False
    return True


def readable(text: str) -> str:
    """`text` (a folder name from the file system) as valid UTF-8 text: the bytes a non-UTF-8 locale passed on
    as surrogate escapes decoded as UTF-8, bytes that are no UTF-8 shown as \\xNN (matplotlib and a UTF-8
    CSV cannot hold lone surrogates), any other lone surrogate as \\udNNN."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
