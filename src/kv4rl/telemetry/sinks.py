"""Live viewers of a run's metrics: TensorBoard event files and a Weights & Biases run (both optional).

`metrics.jsonl` stays the record; a sink mirrors each row's numeric scalars under their keys at
step = iteration (nested values such as the staleness histogram are left out). Which sinks run is the
config's `logging` section; a sink asked for (`true`) whose package is missing is an error at
start-up, before the run folder is touched. `tensorboard: auto` writes event files when the package
is installed.

Resume: a resumed run logs again the iterations after its checkpoint that the interrupted process
may already have logged. The TensorBoard writer is opened at the first row it receives, with
`purge_step` = that row's iteration: it starts a new event file whose first record is a
`SessionLog.START` at that step, and TensorBoard's Python reader drops every earlier event at or after it;
its default Rust data server does not, so the older files' points from that step on are first rewritten
out of them (`event_history`). Each iteration appears once (metrics.jsonl does the same by dropping those
rows). W&B only
accepts increasing steps: the run is resumed by its id (kept in `wandb_id.txt`) and the iterations
it already holds keep their first values, which a deterministic resume reproduces.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import shlex
import sys
import threading
import time
from pathlib import Path

from kv4rl.closing import close_all
from kv4rl.config import RunConfig
from kv4rl.config_loader import ConfigError, to_dict
from kv4rl.telemetry.curves import SEED_SUFFIX

log = logging.getLogger(__name__)


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def scalars(row: dict) -> dict[str, float]:
    """The row's numeric scalars (bools and nested dicts/lists left out), without the step itself; a non-finite
    value is left out too, as metrics.jsonl stores it as null."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration" and math.isfinite(v)}


class MetricsSink:
    """Mirrors each metrics row into the viewers the config asks for; `log` once per row, then `close`."""

    def __init__(self, cfg: RunConfig, announce=lambda line: print(line, file=sys.stderr)):
        log_cfg = cfg.logging
        if log_cfg.tensorboard is True and not installed("tensorboard"):
            raise ConfigError("logging.tensorboard=true but the 'tensorboard' package is not installed "
                              "(pip install 'kv4rl[tb]', or set logging.tensorboard=auto)")
        if log_cfg.wandb and not installed("wandb"):
            raise ConfigError("logging.wandb=true but the 'wandb' package is not installed "
                              "(pip install wandb, or set logging.wandb=false)")
        self.cfg = cfg
        self.tensorboard = log_cfg.tensorboard is True or (log_cfg.tensorboard == "auto" and installed("tensorboard"))
        self.wandb = log_cfg.wandb
        self._tb = None
        self._wandb_run = None
        self._announce = announce  # at the first row: a run refused at start-up says nothing about viewers

    def log(self, row: dict) -> None:
        values, step = scalars(row), row["iteration"]
        if self.tensorboard:
            try:
                if self._tb is None:
                    self._tb = self._open_tensorboard(step)
                    self._announce(f"tensorboard: event files in {self.cfg.run_dir} "
                                   f"(view: tensorboard --logdir {shlex.quote(str(self.cfg.run_dir.parent))})")
                for key, value in values.items():
                    self._tb.add_scalar(key, value, global_step=step)
                self._tb.flush()  # one row per iteration: keep the viewer current, lose nothing on a crash
            except OSError as error:  # a mirror: metrics.jsonl, already written, is the record
                self._stop_tensorboard(error)
        if self.wandb:
            if self._wandb_run is None:
                self._wandb_run = self._open_wandb()
                log_cfg = self.cfg.logging
                self._announce(f"wandb: project {log_cfg.wandb_project}, run {log_cfg.wandb_name or self.cfg.name}")
            self._wandb_run.log(values, step=step)

    def _stop_tensorboard(self, error: OSError) -> None:
        """A failed event-file write (a full disk) stops the mirror, not the run: training goes on with
        every row in metrics.jsonl."""
        log.warning("tensorboard: writing the event files in %s failed (%s); mirroring stops for this run, "
                    "metrics.jsonl keeps every row", self.cfg.run_dir, error)
        self.tensorboard = False
        tb, self._tb = self._tb, None
        close_all({"tensorboard writer": None if tb is None else tb.close}, failing=True)

    def _open_tensorboard(self, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        from kv4rl.telemetry.event_history import rewrite_before_resume

        rewrite_before_resume(self.cfg.run_dir, first_step)  # for readers that ignore the purge below
        _wait_past_existing_event_files(self.cfg.run_dir)
        _quiet_event_writer_threads()
        return SummaryWriter(log_dir=str(self.cfg.run_dir), purge_step=first_step)

    def _open_wandb(self):
        import wandb

        log_cfg, run_dir = self.cfg.logging, Path(self.cfg.run_dir)
        id_file = run_dir / "wandb_id.txt"
        # the id, then the folder that took it: a copied folder (a run branched with `cp -r` and resumed
        # with other settings) took the original's id, and its rows went into the original's W&B run
        run_id, folder = ((id_file.read_text().splitlines() if id_file.is_file() else []) + [None, None])[:2]
        here = str(run_dir.resolve())
        if run_id and folder and folder != here and _holds_wandb_id(Path(folder), run_id):
            self._announce(f"wandb: {run_dir} is a copy of {folder}, whose W&B run it does not continue: a new one")
            run_id = None
        run_id = run_id or wandb.util.generate_id()
        id_file.write_text(f"{run_id}\n{here}\n")
        return wandb.init(project=log_cfg.wandb_project, name=log_cfg.wandb_name or self.cfg.name,
                          group=log_cfg.wandb_group or SEED_SUFFIX.sub("", self.cfg.name),
                          config=to_dict(self.cfg), dir=str(run_dir), id=run_id, resume="allow")

    def close(self, failing: bool = False) -> None:
        tb, run, self._tb, self._wandb_run = self._tb, self._wandb_run, None, None
        close_all({"tensorboard writer": None if tb is None else tb.close,
                   "wandb run": None if run is None else run.finish}, failing)


def _holds_wandb_id(folder: Path, run_id: str) -> bool:
    """Whether `folder` is still the run that took `run_id` (the original of a copy); a folder made at a moved
    run's old path is another run, and the moved one keeps its id."""
    try:
        return (folder / "wandb_id.txt").read_text().split("\n", 1)[0].strip() == run_id
    except OSError:
        return False


def _quiet_event_writer_threads() -> None:
    """TensorBoard writes event files from a thread of its own, whose failure (a full disk) printed its
    traceback; the writer raises the same error at its next call from `log`, which stops the mirror with one
    warning line. So the thread's own report is left out (threading's hook, chained; other threads as before)."""
    previous = threading.excepthook
    if getattr(previous, "quiets_event_writers", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook.quiets_event_writers = True
    threading.excepthook = hook


def _wait_past_existing_event_files(run_dir) -> None:
    """TensorBoard reads a folder's event files in name order, and a name starts with the second it
    was created in (then host, pid and a per-process counter, which do not sort by time). A resumed
    run's file purges the steps it logs again only if it is read after the older files, so it must
    not be created in the same second as the newest of them: wait for the next second (at most 1 s,
    only when a run is resumed right after its last file was made, as in tests)."""
    newest = -1
    for path in Path(run_dir).glob("events.out.tfevents.*"):
        stamp = path.name.split(".")[3]
        if stamp.isdigit():
            newest = max(newest, int(stamp))
    while int(time.time()) <= newest:
        time.sleep(0.05)
