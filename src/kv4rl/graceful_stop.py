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


class GracefulStop:
    """Context manager: `requested` names the signal received (None until one arrives)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous = {s: signal.getsignal(s) for s in SIGNALS}
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
