"""A reward function run in a watchdogged worker process, for checks that can take unbounded time on model output
(sympy in math-verify, a user's verl `compute_score`): a thread cannot be interrupted, a process can be killed.

The worker (spawn context, so it is safe next to CUDA) imports the function once by path (`module:function`) and
serves many batches over a pipe: the whole batch goes in one message and results stream back one per item. Each
result must arrive within `timeout_s` of the previous one; if it does not, that item counts as a timeout, the
worker is killed and restarted, and the rest of the batch is resent. The worker leaves the run's process group
and dies with its parent."""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

# One item's outcome: ("ok", value), ("error", message) or ("timeout", None).
Outcome = tuple[str, Any]
# (index, positional arguments, keyword arguments) of one call
Item = tuple[int, tuple, dict]


def resolve(target: str) -> Callable[..., Any]:
    """The object named `package.module:attribute.path`."""
    module_name, _, attribute_path = target.partition(":")
    found: Any = importlib.import_module(module_name)
    for attribute in attribute_path.split("."):
        found = getattr(found, attribute)
    return found


def _die_with_parent() -> None:
    """Out of the run's process group, a worker busy on a check that never returns would outlive a parent
    killed outright (SIGKILL, torchrun's escalation): the kernel kills it with its parent (Linux), elsewhere
    a thread watching the parent's pid does."""
    parent = os.getppid()
    try:
        import ctypes

        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) == 0:  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)
            return
    except (OSError, AttributeError):  # no prctl: not Linux
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kv4rl-reward-parent", daemon=True).start()


def _serve(conn: Connection, target: str, warmup: tuple | None) -> None:
    """Worker main loop: load the function (and call it once on `warmup`, so that imports are paid before any
    item's clock starts), report ready, then answer batches until told to stop.

    It leaves the run's process group first: a terminal's Ctrl-C and torchrun's SIGTERM go to the whole
    group, and a worker that died with the run still finishing its iteration crashed the run at the next
    reward (a reset pipe) or scored a correct answer 0. The parent stops it (`close`, or EOF on its pipe)."""
    os.setsid()
    _die_with_parent()
    try:
        fn = resolve(target)
        if warmup is not None:
            fn(*warmup)
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported to the parent
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        for index, args, kwargs in batch:
            try:
                conn.send((index, "ok", fn(*args, **kwargs)))
            except OSError:  # the parent is gone (its end of the pipe closed)
                return
            except Exception as exc:  # noqa: BLE001 - a failing check must not kill the worker
                try:
                    conn.send((index, "error", f"{type(exc).__name__}: {exc}"))
                except OSError:
                    return


class WatchdogWorker:
    """Calls `target` (`module:function`) on items in a worker process, each within `timeout_s` (see the module
    docstring). `label` names it in logs and errors, `what` the function in a load error."""

    def __init__(self, target: str, *, timeout_s: float, startup_timeout_s: float = 120.0,
                 warmup: tuple | None = None, label: str = "reward", what: str = "function") -> None:
        if not (0 < timeout_s < math.inf and 0 < startup_timeout_s < math.inf):
            raise ValueError(f"timeout_s and startup_timeout_s must be positive and finite, got {timeout_s} and "
                             f"{startup_timeout_s}")
        self.target, self.timeout_s, self.startup_timeout_s = target, timeout_s, startup_timeout_s
        self.warmup, self.label, self.what = warmup, label, what
        self._context = multiprocessing.get_context("spawn")
        self.process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def call_all(self, items: list[Item], shown: Callable[[Item], str] = lambda item: repr(item[1])[:200]
                 ) -> dict[int, Outcome]:
        """Each item's outcome by index; `shown(item)` is what a timeout's warning quotes."""
        outcomes: dict[int, Outcome] = {}
        remaining = items
        while remaining:
            conn = self._ensure_worker()
            try:
                conn.send(remaining)
            except OSError:  # died since the last batch, its pipe already reset: a new worker takes them all
                self._stop_worker(graceful=False)
                continue
            remaining = remaining[self._collect(conn, remaining, outcomes, shown):]
        return outcomes

    def _collect(self, conn: Connection, items: list[Item], outcomes: dict[int, Outcome],
                 shown: Callable[[Item], str]) -> int:
        """Receive results in order; on a hang or a dead worker settle that item, drop the worker and
        return how many items are settled so the caller resends the rest."""
        for position, item in enumerate(items):
            index = item[0]
            if not conn.poll(self.timeout_s):
                logger.warning("%s timed out after %.1f s on %s; restarting worker", self.label, self.timeout_s,
                               shown(item))
                outcomes[index] = ("timeout", None)
                self._stop_worker(graceful=False)
                return position + 1
            try:
                got_index, kind, value = conn.recv()
            except (EOFError, OSError):  # died on this item: counted as an error, the rest go to a new worker
                outcomes[index] = ("error", "worker process died")
                self._stop_worker(graceful=False)
                return position + 1
            assert got_index == index, (got_index, index)
            outcomes[index] = (kind, value)
        return len(items)

    def _ensure_worker(self) -> Connection:
        if self.process is not None and self.process.is_alive():
            assert self._conn is not None
            return self._conn
        if self.process is not None:  # died between batches
            self._stop_worker(graceful=False)
        parent_conn, child_conn = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child_conn, self.target, self.warmup),
                                        name=f"kv4rl-{self.label}", daemon=True)
        process.start()
        child_conn.close()  # so that the worker dying shows up as EOF on our end
        self.process, self._conn = process, parent_conn
        self._await_ready(parent_conn)
        return parent_conn

    def _await_ready(self, conn: Connection) -> None:
        if not conn.poll(self.startup_timeout_s):
            self._stop_worker(graceful=False)
            raise RuntimeError(f"{self.label} worker did not start within {self.startup_timeout_s} s")
        try:
            status, message = conn.recv()
        except EOFError:
            status, message = (
                "failed",
                (
                    "the worker exited during startup; with the spawn start method it re-imports the main "
                    "script, so that script's top level must be guarded by `if __name__ == '__main__':`"
                ),
            )
        if status != "ready":
            self._stop_worker(graceful=False)
            raise ValueError(f"{self.label} worker could not load {self.what} {self.target!r}: {message}")

    def _stop_worker(self, *, graceful: bool) -> None:
        process, conn = self.process, self._conn
        self.process, self._conn = None, None
        if process is None or conn is None:
            return
        if graceful and process.is_alive():
            try:
                conn.send(None)
                process.join(timeout=5.0)
            except (BrokenPipeError, OSError):
                pass
        if process.is_alive():
            process.kill()
        process.join()
        conn.close()

    def close(self) -> None:
        self._stop_worker(graceful=True)
