"""Letting go of everything a run holds even when one part fails to close: on a full disk a buffered
file's close raises the write error again, and the run folder's lock, the viewers and the reward
workers must still be released after it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def close_all(closers: Mapping[str, Callable[[], object] | None], failing: bool = False) -> None:
    """Call every closer (None: nothing to close), in order. While `failing` (the run is already stopping
    on the error the user must see) a closer's error is logged as a warning naming it; otherwise the first
    error is raised once every closer has run, and any later one is logged."""
    first = None
    for name, close in closers.items():
        if close is None:
            continue
        try:
            close()
        except Exception as error:  # noqa: BLE001 - the rest must still be closed
            if failing or first is not None:
                log.warning("closing the %s also failed: %s", name, error)
            else:
                first = error
    if first is not None:
        raise first
