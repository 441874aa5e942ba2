"""Stop training on SIGTERM or SIGINT without losing work.

Schedulers (SLURM preemption, Kubernetes, `timeout`) send SIGTERM and wait a grace period before
SIGKILL. The first SIGTERM or SIGINT asks the loop to finish the current iteration, write a
checkpoint and return, so `--resume` continues exactly; the process then exits with status 0,
as a run that ends itself does. The first signal also restores the default action, so a second
one ends the process at once (its files stay consistent: logs are flushed per row and checkpoints
are renamed into place only when complete).

Outside training, `cleanup_on_sigterm` lets a SIGTERM run the `finally` blocks of a model build.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_early: str | None = None  # a signal `catch_early` caught before any GracefulStop was entered
_before: dict | None = None  # the handlers `catch_early` replaced, put back by `release_early`


def catch_early() -> None:
    """Hold a signal that arrives while the command starts (config, checkpoint search), before the run's
    GracefulStop is entered: it then stops the run before its first iteration, exit 0, instead of the
    default action killing the process (exit 143). A second signal still ends the process at once."""
    global _early, _before
    _early = None
    if threading.current_thread() is not threading.main_thread():
        return
    if _before is None:
        _before = {s: signal.getsignal(s) for s in SIGNALS}

    def held(signum: int, frame) -> None:
        global _early
        _early = signal.Signals(signum).name
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)

    for s in SIGNALS:
        signal.signal(s, held)


def release_early() -> None:
    """Put back the handlers `catch_early` replaced, once the command is over: `kv4rl train` called in a
    process that goes on (a test session, a notebook, a program embedding the CLI) left its own handler
    installed, so that process's next Ctrl-C or SIGTERM was held, not acted on."""
    global _early, _before
    if _before is not None and threading.current_thread() is threading.main_thread():
        for s, handler in _before.items():
            signal.signal(s, handler)
    _early, _before = None, None


def take_early() -> str | None:
    """The signal `catch_early` held, if any, now handled by the caller (a sweep that has not started its seeds)."""
    global _early
    held, _early = _early, None
    return held


class GracefulStop:
    """Context manager: `requested` names the signal received (None until one arrives)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self.iterating = False  # the loop sets it as an iteration starts: before it, a stop writes nothing
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        global _early
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = {s: signal.getsignal(s) for s in SIGNALS}
            if _early is not None:  # caught while the command started: as if it came now, once
                self.requested, _early = _early, None
                log.warning("%s: stopping before the first iteration (send it again to stop at once)",
                            self.requested)
                return self  # the handlers stay the default: a second signal ends the process
            for s in SIGNALS:
                signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.requested = signal.Signals(signum).name
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        when = ("after this iteration with a checkpoint" if self.iterating
                else "before the first iteration (nothing is written)")  # a signal while the model builds
        log.warning("%s: stopping %s (send it again to stop at once)", self.requested, when)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@contextmanager
def cleanup_on_sigterm() -> Iterator[None]:
    """Within it, a SIGTERM that would end the process at once (its default action) raises SystemExit(143)
    instead, so the `finally` blocks run: a model build staged in the cache removes its folder (an 8B
    random model's is 16 GB) rather than leave it for a day. A handler already installed (`kv4rl train`'s)
    is left alone, and a second SIGTERM still ends the process at once."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_exit(signum: int, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

