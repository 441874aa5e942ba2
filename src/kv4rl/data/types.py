"""Plain records shared across packages; kept free of torch so `algo/` and the data layer stay light."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt with its gold final answer; `meta` holds the source's other fields (solution, level, ...)."""

    problem: str
    answer: str
    id: str
    meta: dict[str, Any] = field(default_factory=dict)
