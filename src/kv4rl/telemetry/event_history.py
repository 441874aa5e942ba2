"""A resumed run's TensorBoard history, rewritten so that every reader shows each iteration once.

A resumed run logs again the iterations after its checkpoint that the interrupted process may already have
logged. Its event file starts with a `SessionLog.START` at its first step, which TensorBoard's Python reader
takes as "drop every earlier point at or after it". The Rust data server that `tensorboard` serves with by
default (`--load_fast=auto`) ignores that record: it drops a tag's older points only when a new point of the
same tag arrives at the same or a lower step, so a tag the resumed process does not log again (eval turned
off, a metric that became null) kept the killed process's values for iterations metrics.jsonl had dropped.

So before the resumed writer opens, the folder's event files are read as a reader that honours both rules
would read them; when any point lies at or after the resumed step, the points before it go into one new
event file named to sort first, and the old files are renamed so that no reader takes them for event files
(`tfevents` becomes `superseded` in their name; their bytes stay, nothing a run wrote is deleted).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

EVENT_GLOB = "events.out.tfevents.*"
SUPERSEDED = "superseded"  # replaces "tfevents" in a renamed file's name: readers match "tfevents"


def _points(files: list[Path], before: int) -> tuple[list, bool]:
    """(the scalar points a reader keeps, in file order, whose step is below `before`; whether any point at
    or after `before` was there to drop)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    by_tag: dict[str, list] = {}  # tag -> [(step, wall_time, value proto)]
    for path in files:  # raw records: the values as written (the other loader migrates them to tensors)
        for record in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for tag, series in by_tag.items():  # the Python reader's purge
                    by_tag[tag] = [p for p in series if p[0] < event.step]
            elif event.HasField("summary"):
                for value in event.summary.value:
                    series = by_tag.setdefault(value.tag, [])
                    series[:] = [p for p in series if p[0] < event.step]  # the Rust server's preemption
                    series.append((event.step, event.wall_time, value))
    kept = [p for series in by_tag.values() for p in series if p[0] < before]
    stale = any(p[0] >= before for series in by_tag.values() for p in series)
    return kept, stale


def rewrite_before_resume(run_dir: str | Path, first_step: int) -> bool:
    """Keep only the points before `first_step` in the folder's event history (see the module); returns
    whether anything was rewritten. A folder with no point at or after `first_step` is left as it is."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    from kv4rl.durability import sync_path

    run_dir = Path(run_dir)
    files = sorted(p for p in run_dir.glob(EVENT_GLOB) if p.is_file())
    if not files:
        return False
    try:
        kept, stale = _points(files, first_step)
    except Exception as exc:  # a damaged event file: the mirror goes on as before, metrics.jsonl is the record
        log.warning("tensorboard: the event files in %s do not read (%s); the resumed run's points are written "
                    "beside them (TensorBoard's default reader may show the killed process's values past "
                    "iteration %d)", run_dir, exc, first_step)
        return False
    if not stale:
        return False
    stamp = min((int(p.name.split(".")[3]) for p in files if p.name.split(".")[3].isdigit()), default=1)
    history = run_dir / f"events.out.tfevents.{max(stamp - 1, 0):010d}.kv4rl-history-before-{first_step}"
    partial = run_dir / f".{history.name.replace('tfevents', SUPERSEDED)}.partial"
    with open(partial, "wb") as f:
        writer = RecordWriter(f)
        writer.write(Event(wall_time=kept[0][1] if kept else 0.0, file_version="brain.Event:2").SerializeToString())
        for step, wall_time, value in sorted(kept, key=lambda p: (p[0], p[1])):
            writer.write(Event(wall_time=wall_time, step=step, summary=Summary(value=[value])).SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    # the history first: a stop before the old files are renamed leaves them read beside it as before this
    # rewrite (each reader's own rules drop the repeated points), and the next resume rewrites them all again
    partial.rename(history)
    for path in files:
        _rename_keeping(path, path.with_name(path.name.replace("tfevents", SUPERSEDED)))
    sync_path(run_dir)
    return True


def _rename_keeping(path: Path, target: Path) -> None:
    """Rename `path` to `target`, or to `target.1`, `.2`, ... where that name is taken (a rename replaces)."""
    candidate, n = target, 0
    while candidate.exists():
        n += 1
        candidate = target.with_name(f"{target.name}.{n}")
    path.rename(candidate)
