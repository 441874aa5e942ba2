"""Read problem sets from Parquet files: flat `problem` / `answer` columns (a Hugging Face dataset's export), or
verl's layout (`prompt` as chat messages, `reward_model.ground_truth`), so a verl user's data loads as it is.

A verl row's problem is its one user message, instruction included (verl's preprocessing writes e.g. "Let's think
step by step and output the final answer within \\boxed{}." into it); `data.prompt_template='{problem}'` sends it as
verl does. Rows are checked as strictly as JSON Lines rows, each error naming the file and its 1-based row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kv4rl.data.datasets import DatasetError, WrittenFloat, check_row_text
from kv4rl.data.types import Problem

__all__ = ["VERL_COLUMNS", "load_parquet"]

VERL_COLUMNS = ("prompt", "reward_model")  # what makes a file verl's layout
ROWS_PER_BATCH = 4096


def load_parquet(path: Path) -> tuple[list[Problem], str]:
    """(the problems of `path`, its layout: "parquet" for `problem` / `answer` columns or "verl")."""
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
    try:  # a batch of rows at a time: the whole table as Python objects doubled a large file's memory
        for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH):
            for row in batch.to_pylist():
                number = len(problems) + 1
                problems.append(row_fn(_as_written(row), f"{path} row {number}", f"{path.name}:{number}"))
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


def _as_written(value: Any) -> Any:
    """A float as the JSON Lines reader keeps one (its shortest round-trip text, written out without an exponent
    when it is an answer), in a column or nested in one (verl's `reward_model.ground_truth`)."""
    if isinstance(value, float) and math.isfinite(value):
        return WrittenFloat(repr(value))
    if isinstance(value, dict):
        return {key: _as_written(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_written(item) for item in value]
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
                   meta={key: value for key, value in row.items() if key not in VERL_COLUMNS})
