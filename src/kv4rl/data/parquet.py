"""Read problem sets from Parquet files: flat `problem` / `answer` columns (a Hugging Face dataset's export), or
verl's layout (`prompt` as chat messages, `reward_model.ground_truth`), so a verl user's data loads as it is.

A verl row's problem is its one user message, instruction included (verl's preprocessing writes e.g. "Let's think
step by step and output the final answer within \\boxed{}." into it); `data.prompt_template='{problem}'` sends it as
verl does. Rows are checked as strictly as JSON Lines rows, each error naming the file and its 1-based row.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

from kv4rl.data.datasets import DatasetError, WrittenFloat, check_row_text
from kv4rl.data.types import Problem

__all__ = ["VERL_COLUMNS", "load_parquet"]

VERL_COLUMNS = ("prompt", "reward_model")  # what makes a file verl's layout
ROWS_PER_BATCH = 4096


def load_parquet(path: Path, name: str | None = None) -> tuple[list[Problem], str]:
    """(the problems of `path`, its layout: "parquet" for `problem` / `answer` columns or "verl"); a row without an
    id is `<name>:<row>`, `name` the file's (`read_problems` gives a list's files longer ones where names repeat)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"dataset file {path} is a Parquet file, and reading one needs pyarrow: pip install "
                           "pyarrow (or pip install 'kv4rl[parquet]')") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError on a damaged file
        raise DatasetError(f"cannot read Parquet file {path}: {exc}") from None
    columns = parquet.schema_arrow.names
    if all(name in columns for name in VERL_COLUMNS):
        layout, row_fn = "verl", _verl_row
    elif "problem" in columns and "answer" in columns:
        layout, row_fn = "parquet", _flat_row
    else:
        raise DatasetError(f"{path}: its columns are {', '.join(columns) or 'none'}; a dataset file has `problem` "
                           "and `answer` columns, or verl's `prompt` (chat messages) and `reward_model` "
                           "(with `ground_truth`)")
    problems = []
    narrow = _narrow_paths(parquet.schema_arrow)
    try:  # a batch of rows at a time: the whole table as Python objects doubled a large file's memory
        for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH):
            for row in batch.to_pylist():
                number = len(problems) + 1
                problems.append(row_fn(_as_written(row, narrow), f"{path} row {number}", f"{name or path.name}:{number}"))
    except DatasetError:
        raise
    except Exception as exc:  # a damaged page past the footer
        raise DatasetError(f"cannot read Parquet file {path} past row {len(problems)}: {exc}") from None
    if not problems:
        raise DatasetError(f"dataset file {path} contains no rows")
    first_row_of_id: dict[str, int] = {}
    for number, problem in enumerate(problems, start=1):
        if first_row_of_id.setdefault(problem.id, number) != number:
            raise DatasetError(f"{path} row {number}: duplicate id {problem.id!r} (first used in row "
                               f"{first_row_of_id[problem.id]})")
    return problems, layout


def _narrow_paths(schema) -> frozenset[tuple[str, ...]]:
    """The paths (field names; "[]" for a list's items) of the schema's float32 and float16 values: a Python float
    holds them widened, whose repr (0.10000000149011612) is not the number the file's writer wrote (0.1)."""
    import pyarrow as pa

    paths = set()

    def walk(tp, path):
        if pa.types.is_float32(tp) or pa.types.is_float16(tp):
            paths.add(path)
        elif pa.types.is_struct(tp):
            for field in tp:
                walk(field.type, (*path, field.name))
        elif pa.types.is_list(tp) or pa.types.is_large_list(tp) or pa.types.is_fixed_size_list(tp):
            walk(tp.value_type, (*path, "[]"))

    for field in schema:
        walk(field.type, (field.name,))
    return frozenset(paths)


def _shortest_float32(value: float) -> str:
    """The shortest decimal text that reads back as the float32 `value` (at most 9 significant digits do)."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == value:
            return text
    return repr(value)


def _as_written(value: Any, narrow: frozenset[tuple[str, ...]] = frozenset(), path: tuple[str, ...] = ()) -> Any:
    """A float as the JSON Lines reader keeps one (its shortest round-trip text, for a float32 value its own type's,
    written out without an exponent when it is an answer), in a column or nested in one (verl's
    `reward_model.ground_truth`); `narrow`: the float32 paths (`_narrow_paths`), `path` this value's."""
    if isinstance(value, float) and math.isfinite(value):
        return WrittenFloat(_shortest_float32(value) if path in narrow else repr(value))
    if isinstance(value, dict):
        return {key: _as_written(item, narrow, (*path, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_written(item, narrow, (*path, "[]")) for item in value]
    return value


def _flat_row(row: dict[str, Any], where: str, default_id: str) -> Problem:
    problem = check_row_text(row, "problem", where, allow_number=False)
    answer = check_row_text(row, "answer", where, allow_number=True)
    row_id = check_row_text(row, "id", where, allow_number=True) if row.get("id") is not None else default_id
    return Problem(problem=problem, answer=answer, id=row_id,
                   meta={key: value for key, value in row.items() if key not in ("problem", "answer", "id")})


def _verl_row(row: dict[str, Any], where: str, default_id: str) -> Problem:
    messages = row["prompt"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DatasetError(f"{where}: `prompt` must be a list of chat messages ({{role, content}}), got "
                           f"{type(messages).__name__}")
    roles = [m.get("role") for m in messages]
    if roles != ["user"]:
        raise DatasetError(f"{where}: `prompt` holds the messages {roles}; kv4rl prompts with one user message, the "
                           "problem (a system message's text can go into data.prompt_template)")
    problem = check_row_text(messages[0], "content", f"{where}, prompt[0]", allow_number=False)
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DatasetError(f"{where}: `reward_model` has no `ground_truth`, the answer a response is graded against")
    answer = check_row_text(reward_model, "ground_truth", f"{where}, reward_model", allow_number=True)
    return Problem(problem=problem, answer=answer, id=default_id,
                   meta={key: value for key, value in row.items() if key != "prompt"})  # reward_model kept as written
