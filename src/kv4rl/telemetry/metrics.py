"""JSON-lines logs (metrics per iteration, rollout trace per engine step), flushed as written.

A writer touches its file only at its first write, so a run that fails before its first iteration
completes leaves an existing file as it was. A fresh run's file is created new (never replacing
one); a resumed run first drops the rows of iterations at or after the checkpoint (they will be
produced again) with an atomic rewrite, so the file never holds an iteration twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlWriter:
    def __init__(self, path: Path, resume_from: int | None = None):
        """A new file, or (resume) the existing rows of iterations before `resume_from` kept."""
        self.path = path
        self.resume_from = resume_from
        self._file = None

    def _open(self) -> None:
        if self.resume_from is None:
            self._file = self.path.open("x")  # a fresh run's log is a new file, never a replaced one
            return
        if self.path.exists():
            kept = [line for line, row in read_lines(self.path) if row.get("iteration", -1) < self.resume_from]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def write(self, row: dict) -> None:
        self.write_many([row])

    def write_many(self, rows: list[dict]) -> None:
        if self._file is None:
            self._open()
        for row in rows:
            self._file.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, row) pairs; a line that does not parse (torn by a kill mid-write) is skipped with a warning."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            log.warning("%s:%d is not a JSON row (cut short?); skipped", path, number)
    return out


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL log, a line torn by a kill skipped with a warning (see `read_lines`): the plots of a
    run that crashed mid-write draw every whole row."""
    return [row for _, row in read_lines(path)]
