"""A rich progress bar for training that shows the latest reward, accuracy and timings."""

from __future__ import annotations

from typing import Self

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrainProgress:
    def __init__(self, total: int, start: int, enabled: bool = True):
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            disable=not enabled,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, stats="")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, row: dict) -> None:
        stats = (
            f"reward {row['reward_mean']:.3f}  acc {row['accuracy']:.3f}  len {row['response_len_mean']:.1f}  "
            f"ent {row.get('entropy', float('nan')):.3f}  gnorm {row.get('grad_norm', float('nan')):.2f}  "
            f"{row['tokens_per_s']:.0f} tok/s"
        )
        for key in (k for k in row if k.startswith("eval/mean@")):
            stats += f"  {key} {row[key]:.3f}"
        self.progress.update(self.task, advance=1, stats=stats)
