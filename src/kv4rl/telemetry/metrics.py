"""JSON-lines logs (metrics per iteration, rollout trace per engine step), flushed as written.

A writer touches its file only at its first write, so a run that fails before its first iteration
completes leaves an existing file as it was. A fresh run's file is created new (never replacing
one); a resumed run first drops the rows of iterations at or after the checkpoint (they will be
produced again) with an atomic rewrite, so the file never holds an iteration twice; nothing else
before the last row kept is dropped.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

from kv4rl.durability import sync_path
from kv4rl.paths import readable

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
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:  # line by line: a long run's rollout trace (one row a step) is GBs, held whole it took ~8x that
                with tmp.open("w", errors="surrogateescape") as out:
                    for line in self._kept_on_resume():
                        out.write(line + "\n")
                sync_path(tmp)  # the kept rows on the disk before they replace the whole log
            except BaseException:
                tmp.unlink(missing_ok=True)  # the log stays as it was
                raise
            os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def _kept_on_resume(self) -> Iterator[str]:
        """The lines a resume keeps: the rows of iterations before `resume_from`, and every line that is not a
        row (damaged, edited by hand) but comes before one of them, as it is (a resume deletes nothing but the
        rows it makes again). Lines that are not rows after the last kept one, a write torn by a kill, go."""
        pending: list[tuple[int, str]] = []
        for number, line, row in _lines(self.path):
            if not isinstance(row, dict):
                pending.append((number, line))
            elif row.get("iteration", -1) < self.resume_from:
                for kept, _ in pending:
                    log.warning("%s:%d is not a JSON row; kept as it is", self.path, kept)
                yield from (bad for _, bad in pending)
                pending.clear()
                yield line
        for dropped, _ in pending:
            log.warning("%s:%d is not a JSON row (cut short by a kill?) and follows the rows kept; dropped",
                        self.path, dropped)

    def write(self, row: dict) -> None:
        self.write_many([row])

    def write_many(self, rows: list[dict]) -> None:
        if self._file is None:
            self._open()
        try:
            for row in rows:
                self._file.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
            self._file.flush()
        except OSError as exc:
            raise self._named(exc) from exc

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                raise self._named(exc) from exc

    def _named(self, exc: OSError) -> OSError:
        """A failed write or flush of an open file carries no file name ("Operation not permitted", a full
        disk): the error line must name the log."""
        return exc if exc.filename else OSError(exc.errno, exc.strerror or str(exc), str(self.path))


_NOT_JSON = object()


def _lines(path: Path) -> Iterator[tuple[int, str, object]]:
    """(line number, line, its JSON value or `_NOT_JSON`) of each line that is not blank, read as it goes (a
    rollout trace can be larger than the host's memory). Bytes that are not UTF-8 (a damaged disk) are kept
    as surrogates, so a reader skips or keeps their line rather than failing on the whole file, and a resume
    writes them back as they were; lines end at '\n' only."""
    with Path(path).open(errors="surrogateescape", newline="\n") as lines:
        for number, line in enumerate(lines, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                yield number, line, json.loads(line)
            except json.JSONDecodeError:
                yield number, line, _NOT_JSON


def _parsed(path: Path, warn: bool = True):
    """(line number, line, value) of each line that parses; a torn one (a kill mid-write) is skipped with a warning
    (`warn`)."""
    for number, line, value in _lines(path):
        if value is not _NOT_JSON:
            yield number, line, value
        elif warn:
            log.warning("%s:%d is not a JSON row (cut short?); skipped", path, number)


def iter_rows(path: Path, warn: bool = True) -> Iterator[tuple[int, str, dict]]:
    """(line number, line, row) as the file is read; a line that does not parse (torn by a kill mid-write), or is
    not a JSON object, is skipped with a warning (`warn`: a second reader of the same file leaves it to the first)."""
    for number, line, row in _parsed(path, warn):
        if isinstance(row, dict):
            yield number, line, row
        elif warn:
            log.warning("%s:%d is %s, not a JSON object row; skipped", path, number, type(row).__name__)


def iter_lines(path: Path, warn: bool = True) -> Iterator[tuple[str, dict]]:
    """(line, row) pairs of `iter_rows`."""
    for _, line, row in iter_rows(path, warn):
        yield line, row


def read_lines(path: Path, warn: bool = True) -> list[tuple[str, dict]]:
    """`iter_lines` as a list."""
    return list(iter_lines(path, warn))


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL log, a line torn by a kill skipped with a warning (see `read_lines`): the plots of a
    run that crashed mid-write draw every whole row."""
    return [row for _, row in read_lines(path)]


def read_metrics(path: Path, warn: bool = True) -> list[dict]:
    """A run's metrics.jsonl for the plots: rows in file order, each an object with an integer `iteration`
    met once (what `JsonlWriter` writes; a file edited or joined by hand that breaks this is refused, naming
    the line, rather than drawn wrong), non-finite numbers read as null as the writer stores them. A torn
    line is skipped with a warning (`warn`; a second read of the same file leaves it to the first)."""
    rows, seen = [], {}
    for number, _, row in _parsed(path, warn):
        it = row.get("iteration") if isinstance(row, dict) else None
        if not isinstance(it, int) or isinstance(it, bool):
            what = "a row without an integer 'iteration'" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
            raise ValueError(f"{path}:{number}: {what}, not a metrics row")
        if it in seen:
            raise ValueError(f"{path}:{number}: iteration {it} again (first at line {seen[it]}); kv4rl writes each "
                             "iteration once, so the file was joined or edited by hand")
        seen[it] = number
        rows.append({k: _clean(v) for k, v in row.items()})
    return rows


def distinct_runs(runs: list[Path]) -> list[Path]:
    """The run folders in the order given, a folder named twice (`runs/a`, `runs/a/.`) kept once."""
    given: dict[Path, Path] = {}
    for run in runs:
        given.setdefault(Path(run).resolve(), Path(run))
    return list(given.values())


def run_labels(runs: list[Path]) -> list[str]:
    """How plots name runs: by folder name, or by the paths as given when two folders share a name (their
    rows would otherwise merge into one curve)."""
    names = [readable(Path(r).name) for r in runs]
    return names if len(set(names)) == len(names) else [readable(str(r)) for r in runs]
