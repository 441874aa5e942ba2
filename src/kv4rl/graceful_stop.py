"""Stop training on SIGTERM or SIGINT without losing work.

Schedulers (SLURM preemption, Kubernetes, `timeout`) send SIGTERM and wait a grace period before
SIGKILL. The first SIGTERM or SIGINT asks the loop to finish the current iteration, write a
checkpoint and return, so `--resume` continues exactly; the process then exits with status 0,
as a run that ends itself does. The first signal also restores the default action, so a second
one ends the process at once (its files stay consistent: logs are flushed per row and checkpoints
are renamed into place only when complete).
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_early: str | None = None  # a signal `catch_early` caught before any GracefulStop was entered


def catch_early() -> None:
    """Hold a signal that arrives while the command starts (config, checkpoint search), before the run's
    GracefulStop is entered: it then stops the run before its first iteration, exit 0, instead of the
    default action killing the process (exit 143). A second signal still ends the process at once."""
    global _early
    _early = None
    if threading.current_thread() is not threading.main_thread():
        return

    def held(signum: int, frame) -> None:
        global _early
        _early = signal.Signals(signum).name
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)

    for s in SIGNALS:
        signal.signal(s, held)


class GracefulStop:
    """Context manager: `requested` names the signal received (None until one arrives)."""

    def __init__(self) -> None:
        self.requested: str | None = None
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
        log.warning("%s: stopping after this iteration with a checkpoint (send it again to stop at once)",
                    self.requested)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
