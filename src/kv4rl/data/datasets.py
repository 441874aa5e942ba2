"""Load problem sets from JSON Lines files (one object per line with `problem` and `answer`), or from Parquet
files (`data/parquet.py`: the same columns, or verl's layout), told apart by the file's first bytes.

Validation is strict and eager: a bad row fails the load with the file and 1-based line number,
because a silently skipped or mis-typed row would quietly change an evaluation set.
"""

from __future__ import annotations

import json
import math
import os
import stat
from decimal import Decimal
from pathlib import Path
from typing import Any

from kv4rl.data.types import Problem

__all__ = ["DatasetError", "load_jsonl", "load_problems", "read_problems"]


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file (and line)."""


class WrittenFloat(float):
    """A JSON number with a fraction or exponent, remembering how the file wrote it (`text`)."""

    def __new__(cls, text: str) -> WrittenFloat:
        value = super().__new__(cls, text)
        value.text = text
        return value


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json keeps the last of a repeated key silently)."""
    row = dict(pairs)
    if len(row) < len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return row


OTHER_FORMATS = (".json", ".parquet", ".csv", ".arrow", ".txt")  # what a misread file likely is, for the hint


def read_problems(path: str | os.PathLike[str] | list, name: str | None = None) -> tuple[list[Problem], str]:
    """(the problems of a dataset file, its layout: "jsonl", "parquet" or "verl"), a Parquet file known by its
    magic bytes (whatever its name), anything else read as JSON Lines. A list of files (verl's `train_files`) gives
    their rows one file after another, in the list's order, and "verl" where any of them has verl's layout."""
    if isinstance(path, list | tuple):
        if not path:
            raise DatasetError("the list of dataset files is empty")
        problems, layouts = [], []
        for one, name in zip(path, _row_id_names([Path(p) for p in path]), strict=True):
            rows, layout = read_problems(one, name)
            problems += rows
            layouts.append(layout)
        return problems, next((x for x in ("verl", "parquet") if x in layouts), "jsonl")
    path = Path(path)
    _check_rereadable(path)
    try:
        with path.open("rb") as file:
            parquet = file.read(4) == b"PAR1"
    except OSError:  # a missing or unreadable file: load_jsonl says which
        parquet = False
    if parquet:
        from kv4rl.data.parquet import load_parquet  # pyarrow only where a Parquet file is read

        return load_parquet(path, name)
    return load_jsonl(path, name), "jsonl"


def _check_rereadable(path: Path) -> None:
    """Refuse a pipe, FIFO or device as a dataset file: such a file gives its bytes once, and a dataset is read more
    than once (its first bytes for the layout, the checks before a run, the run itself, a resume), so the later
    reads would miss the rows the first took (`<(zcat f.gz)` lost its first 4 KiB) or wait for ever (a FIFO)."""
    try:
        mode = path.stat().st_mode
    except OSError:  # missing or unreadable: load_jsonl says which
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise DatasetError(f"dataset file {path} is not a regular file (a pipe or device gives its rows once, and a "
                           f"dataset is read more than once); write it to a file and give that file")


def _row_id_names(paths: list[Path]) -> list[str]:
    """What a list's rows without an id are named after: each file's name, or where two files share one (verl's
    gsm8k/train.parquet and math/train.parquet) its path from the files' common folder; a file listed again gets
    `#2`, `#3`, ..., so that every row's default id stays its own."""
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        common = Path(os.path.commonpath([str(p.resolve().parent) for p in paths]))
        names = [str(p.resolve().relative_to(common)) for p in paths]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def load_problems(path: str | os.PathLike[str] | list) -> list[Problem]:
    """The problems of a dataset file, JSON Lines or Parquet, or of a list of them (`read_problems`)."""
    return read_problems(path)[0]


def load_jsonl(path: str | os.PathLike[str], name: str | None = None) -> list[Problem]:
    """Read every non-blank line of `path` as a `Problem`; `id` defaults to `"<name>:<line>"`, `name` the file's. The
    file is read line by line: a whole copy of it and of its lines beside the problems tripled a large file's peak
    memory."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            return _read_rows(file, path, name or path.name)
    except FileNotFoundError:
        raise DatasetError(f"dataset file {path} does not exist") from None
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc}") from None


def _read_rows(file, path: Path, name: str) -> list[Problem]:
    problems: list[Problem] = []
    first_line_of_id: dict[str, int] = {}
    opening = None  # the file's first byte that is not whitespace: `[` is a JSON array
    # lines end at LF (CRLF's CR is whitespace to JSON); a lone CR is whitespace too, not a line break
    for line_number, line_bytes in enumerate(file, start=1):
        if line_number == 1:
            line_bytes = line_bytes.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as Windows editors write
            kind = _not_text(line_bytes)
            if kind is not None:  # each line would read as "not valid UTF-8", which does not say what the file is
                raise DatasetError(f"dataset file {path} is {kind}; a dataset file is JSON Lines in UTF-8")
        if not line_bytes.strip():
            continue
        opening = line_bytes.lstrip()[:1] if opening is None else opening
        where = f"{path}:{line_number}"
        try:
            problem = _parse_row(line_bytes, where, default_id=f"{name}:{line_number}")
        except DatasetError as exc:
            likely = ("a JSON array" if opening == b"[" else
                      f"a {path.suffix} file" if path.suffix.lower() in OTHER_FORMATS else None)
            if likely is not None and "JSON Lines" not in str(exc):
                raise DatasetError(f"{exc} ({likely}? a dataset file is JSON Lines: one object per line)") from None
            raise
        if problem.id in first_line_of_id:
            raise DatasetError(
                f"{where}: duplicate id {problem.id!r} (first used on line {first_line_of_id[problem.id]})"
            )
        first_line_of_id[problem.id] = line_number
        problems.append(problem)
    if not problems:
        raise DatasetError(f"dataset file {path} contains no rows")
    return problems


_MAGIC = ((b"\x1f\x8b", "gzip-compressed (decompress it first)"), (b"PK\x03\x04", "a zip archive"),
          (b"\xff\xfe", "UTF-16 text (save it as UTF-8)"), (b"\xfe\xff", "UTF-16 text (save it as UTF-8)"),
          (b"BZh", "bzip2-compressed (decompress it first)"), (b"\xfd7zXZ", "xz-compressed (decompress it first)"),
          (b"PAR1", "a Parquet file"))


def _not_text(raw: bytes) -> str | None:
    """What a file is when its first bytes say it is not JSON Lines text (compressed, an archive, UTF-16)."""
    return next((kind for magic, kind in _MAGIC if raw.startswith(magic)), None)


def _parse_row(line_bytes: bytes, where: str, *, default_id: str) -> Problem:
    try:
        row = json.loads(line_bytes.decode("utf-8"), parse_float=WrittenFloat, object_pairs_hook=_object)
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{where}: not valid UTF-8 ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except _DuplicateKey as exc:
        raise DatasetError(f"{where}: key {exc.args[0]!r} is given twice in one object") from None
    except RecursionError:
        raise DatasetError(f"{where}: nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise DatasetError(f"{where}: not readable ({exc})") from None
    if not isinstance(row, dict):
        hint = " (a dataset file is JSON Lines: one object per line)" if isinstance(row, list) else ""
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}{hint}")
    problem = check_row_text(row, "problem", where, allow_number=False)
    answer = check_row_text(row, "answer", where, allow_number=True)
    row_id = check_row_text(row, "id", where, allow_number=True) if "id" in row else default_id
    meta = {key: value for key, value in row.items() if key not in ("problem", "answer", "id")}
    return Problem(problem=problem, answer=answer, id=row_id, meta=meta)


def check_row_text(row: dict[str, Any], key: str, where: str, *, allow_number: bool) -> str:
    if key not in row:
        raise DatasetError(f"{where}: missing field {key!r}")
    value = row[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if allow_number and is_number:
        if not math.isfinite(value):
            raise DatasetError(f"{where}: field {key!r} is not a finite number: {value!r}")
        if isinstance(value, WrittenFloat):  # as written, without an exponent: math-verify reads 1e+20 as e + 20
            return format(Decimal(value.text), "f")
        return str(value)
    if not isinstance(value, str):
        expected = "a string or a number" if allow_number else "a string"
        raise DatasetError(f"{where}: field {key!r} must be {expected}, got "
                           f"{'null' if value is None else type(value).__name__}")
    if not value.strip():
        raise DatasetError(f"{where}: field {key!r} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate escape ("\ud800"): JSON allows it, no tokenizer reads it
        raise DatasetError(f"{where}: field {key!r} holds a lone surrogate escape at character {exc.start}; "
                           "it is no text") from None
    return value
