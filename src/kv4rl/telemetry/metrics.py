"""JSON-lines logs (metrics per iteration, rollout trace per engine step), flushed as written.

On resume, rows whose `iteration` is at or after the checkpoint are dropped first: they will be
produced again, so the file never holds an iteration twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlWriter:
    def __init__(self, path: Path, resume_from: int | None = None):
        """Start a new file, or (resume) keep the rows of iterations before `resume_from`."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("iteration", -1) < resume_from]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        elif resume_from is None and path.exists():
            path.unlink()
        self._file = path.open("a")

    def write(self, row: dict) -> None:
        self.write_many([row])

    def write_many(self, rows: list[dict]) -> None:
        for row in rows:
            self._file.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
