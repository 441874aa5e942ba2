"""Progress display: the training bar, and a stage bar for every command that runs for a while.

Both fit an 80-column terminal without losing the figures a person waits for. rich shrinks every
column of a line that is too wide, so the count and ETA used to vanish first; here the fixed parts
(label, a short bar, M/N, elapsed, ETA) never wrap, and the only flexible part is the text after
them, which keeps as many of its items as fit, most important first.

A stage bar is transient (gone when the command prints its result). When the console is not a
terminal (piped, a CI log) it draws nothing live and prints one short line per stage instead.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from typing import Self

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

from kv4rl.telemetry.console import PipeSafeConsole

BAR_WIDTH = 12
ITEM_GAP = "  "

# `report(stage, done, total)`: the callback long-running library code takes (total None: unknown).
StageReport = Callable[[str, int, int | None], None]


class FittedItems:
    """Items joined by two spaces, keeping the leading ones that fit the width rich gives the cell."""

    def __init__(self, items: Sequence[str]):
        self.items = list(items)

    def text(self, width: int) -> str:
        shown = ""
        for item in self.items:
            candidate = f"{shown}{ITEM_GAP}{item}" if shown else item
            if cell_len(candidate) > width:
                break
            shown = candidate
        return shown

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(cell_len(self.items[0]) if self.items else 0, cell_len(ITEM_GAP.join(self.items)))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(self.text(options.max_width), no_wrap=True, overflow="ellipsis")


class _FittedField(ProgressColumn):
    """A task field holding a FittedItems (or text), in the one column allowed to shrink."""

    def __init__(self, field: str):
        self.field = field
        super().__init__(table_column=Column())  # wrapable: rich shrinks it first

    def render(self, task: Task) -> FittedItems | Text:
        value = task.fields.get(self.field, "")
        return value if isinstance(value, FittedItems) else Text(value, no_wrap=True, overflow="ellipsis")


class _Count(MofNCompleteColumn):
    def render(self, task: Task) -> Text:
        return Text("") if task.total is None else super().render(task)


class _Eta(TimeRemainingColumn):
    def render(self, task: Task) -> Text:
        remaining = super().render(task)
        return Text(f"ETA {remaining.plain}", style=remaining.style) if remaining.plain else remaining


def _fixed_columns(label: str) -> list[ProgressColumn]:
    """Label, a short bar, M/N, elapsed, ETA: never wrapped, so rich cannot squeeze them away."""
    def fixed() -> Column:
        return Column(no_wrap=True)

    return [TextColumn(label, table_column=fixed()), BarColumn(bar_width=BAR_WIDTH, table_column=fixed()),
            _Count(table_column=fixed()), TimeElapsedColumn(table_column=fixed()), _Eta(table_column=fixed())]


def train_stats(row: dict) -> list[str]:
    """The latest iteration's figures, most important first (the narrowest terminal shows a prefix)."""
    items = [f"rew {row['reward_mean']:.3f}", f"acc {row['accuracy']:.3f}"]
    items += [f"eval@{key.removeprefix('eval/mean@')} {row[key]:.3f}" for key in row
              if re.fullmatch(r"eval/mean@\d+", key)]  # not a data_source's own (`eval/<source>/mean@k`)
    rate = row["tokens_per_s"]
    items += [f"len {row['response_len_mean']:.1f}", "- tok/s" if rate is None else f"{rate:.0f} tok/s"]
    if "entropy" in row:
        items.append(f"ent {_figure(row['entropy'], 3)}")
    if "grad_norm" in row:  # NaN when no step was taken (metrics.jsonl: null): shown as "-", as the rate is
        items.append(f"gn {_figure(row['grad_norm'], 2)}")
    return items


def _figure(value: float | None, digits: int) -> str:
    return f"{value:.{digits}f}" if value is not None and math.isfinite(value) else "-"


# rich estimates speed from the progress of its last 30 s by default: an iteration (or a bench stage's item)
# longer than that left one sample, and no ETA for the whole run. A day's window keeps every one of a run's.
SPEED_WINDOW_S = 24 * 3600.0


class TrainProgress:
    """The training bar on a terminal; piped (a log file, CI), one line per iteration instead, since a bar
    that draws nothing left a piped run silent until its summary."""

    def __init__(self, total: int, start: int, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self.total, self.done = total, start
        console = console or PipeSafeConsole()  # a closed stdout (`| head`) does not stop the run
        self.lines = enabled and not console.is_terminal
        self.progress = Progress(*_fixed_columns("[bold]train"), _FittedField("stats"), console=console,
                                 disable=not enabled or self.lines, speed_estimate_period=SPEED_WINDOW_S)
        self.task = self.progress.add_task("train", total=total, completed=start, stats=FittedItems([]))

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def say(self, line: str) -> None:
        """One line above the bar (or among the piped lines); nothing when the bar is off."""
        if self.enabled:
            self.progress.console.print(line, highlight=False, soft_wrap=True)

    def update(self, row: dict) -> None:
        self.done += 1
        self.progress.update(self.task, advance=1, stats=FittedItems(train_stats(row)))
        if self.lines:
            self.progress.console.print(f"train {self.done}/{self.total}{ITEM_GAP}{ITEM_GAP.join(train_stats(row))}",
                                        highlight=False, soft_wrap=True)


class StageProgress:
    """One bar for a command made of stages; call it as a `StageReport`.

    A new stage text starts the bar afresh (and prints a line when the console is not a terminal);
    the same text again only moves it. `note` prints a line that stays above the bar.
    """

    def __init__(self, console: Console, label: str):
        self.console = console
        self.label = label
        self.lines = not console.is_terminal
        self.stage: str | None = None
        self.progress = Progress(*_fixed_columns(f"[bold]{label}"), _FittedField("stage"), console=console,
                                 transient=True, disable=self.lines, speed_estimate_period=SPEED_WINDOW_S)
        self.task = self.progress.add_task(label, total=None, stage="")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, stage: str, done: int = 0, total: int | None = None) -> None:
        if stage == self.stage:
            self.progress.update(self.task, completed=done)
            return
        self._announce(stage)
        # a fresh task, not a reset: its clock and speed start again, and its total may be unknown (None)
        self.progress.remove_task(self.task)
        self.task = self.progress.add_task(self.label, total=total, completed=done, stage=stage)

    def _announce(self, stage: str) -> None:
        self.stage = stage
        if self.lines:
            self.console.print(f"[dim]{stage}[/]", highlight=False)

    def note(self, message: str) -> None:
        self.console.print(f"[dim]{message}[/]", highlight=False)

    def advance(self, note: str | None = None) -> None:
        """One more step of the current stage done, with an optional line to keep."""
        if note is not None:
            self.note(note)
        self.progress.advance(self.task)

    def counted(self, total: int) -> Callable[[str], None]:
        """A message callback for code that announces each of `total` stages with one message.

        The stages share one task, so the ETA comes from the pace of the stages so far.
        """
        started = itertools.count()

        def announce(message: str) -> None:
            done = next(started)
            if done == 0:
                self(message, 0, total)
            else:
                self._announce(message)
                self.progress.update(self.task, completed=done, stage=message)

        return announce
