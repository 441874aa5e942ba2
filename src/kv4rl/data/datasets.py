"""Load problem sets from JSON Lines files (one object per line with `problem` and `answer`).

Validation is strict and eager: a bad row fails the load with the file and 1-based line number,
because a silently skipped or mis-typed row would quietly change an evaluation set.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from kv4rl.data.types import Problem

__all__ = ["DatasetError", "load_jsonl"]


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file (and line)."""


def load_jsonl(path: str | os.PathLike[str]) -> list[Problem]:
    """Read every non-blank line of `path` as a `Problem`; `id` defaults to `"<file name>:<line>"`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"dataset file {path} does not exist") from None
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc}") from None
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as some editors on Windows write
    problems: list[Problem] = []
    first_line_of_id: dict[str, int] = {}
    for line_number, line_bytes in enumerate(raw.splitlines(), start=1):
        if not line_bytes.strip():
            continue
        where = f"{path}:{line_number}"
        problem = _parse_row(line_bytes, where, default_id=f"{path.name}:{line_number}")
        if problem.id in first_line_of_id:
            raise DatasetError(
                f"{where}: duplicate id {problem.id!r} (first used on line {first_line_of_id[problem.id]})"
            )
        first_line_of_id[problem.id] = line_number
        problems.append(problem)
    if not problems:
        raise DatasetError(f"dataset file {path} contains no rows")
    return problems


def _parse_row(line_bytes: bytes, where: str, *, default_id: str) -> Problem:
    try:
        row = json.loads(line_bytes.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{where}: not valid UTF-8 ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    problem = _required_text(row, "problem", where, allow_number=False)
    answer = _required_text(row, "answer", where, allow_number=True)
    row_id = _required_text(row, "id", where, allow_number=True) if "id" in row else default_id
    meta = {key: value for key, value in row.items() if key not in ("problem", "answer", "id")}
    return Problem(problem=problem, answer=answer, id=row_id, meta=meta)


def _required_text(row: dict[str, Any], key: str, where: str, *, allow_number: bool) -> str:
    if key not in row:
        raise DatasetError(f"{where}: missing field {key!r}")
    value = row[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if allow_number and is_number:
        if not math.isfinite(value):
            raise DatasetError(f"{where}: field {key!r} is not a finite number: {value!r}")
        return str(value)
    if not isinstance(value, str):
        expected = "a string or a number" if allow_number else "a string"
        raise DatasetError(f"{where}: field {key!r} must be {expected}, got {type(value).__name__}")
    if not value.strip():
        raise DatasetError(f"{where}: field {key!r} is empty")
    return value
