"""Result tables that never cut a number.

rich shrinks every column of a table wider than the console, numbers included: `2.258e-03` became
`2.258…` on an 80-column terminal, which made fp8 look worse than mxfp4. So the layout is decided
here, before rich sees the table: every cell keeps its full width (text longer than `FOLD_AFTER`
characters, such as a path, may fold), headers wrap at spaces, and a table that still does not fit
is split into parts that each repeat the label columns (only the first part has the title).
Output that is not a terminal (a pipe, a file) has no width to fit, so it gets one table at its
natural width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kv4rl.telemetry.console import PipeSafeConsole

FOLD_AFTER = 40  # longer cells (paths, long names) may fold; every number is far shorter
COLUMN_OVERHEAD = 3  # rich's default box: one space of padding either side and one border
EDGE = 1  # the table's closing border


def rendered_width(column_widths: list[int]) -> int:
    """Terminal cells a table with columns of these content widths takes in rich's default box."""
    return sum(column_widths) + COLUMN_OVERHEAD * len(column_widths) + EDGE


def format_value(value) -> str:
    """A float with 4 decimals, or in scientific notation where that would show under 3 digits."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value == 0 or 1e-2 <= abs(value) < 1e6:
        return f"{value:.4f}"
    return f"{value:.3e}"


@dataclass
class ResultTable:
    """Headers, string rows and how many leading columns are labels (left-aligned, repeated in parts)."""

    title: str
    headers: list[str]
    labels: int = 1
    caption: str | None = None  # under the last part
    rows: list[list[str]] = field(default_factory=list)

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"row has {len(cells)} cells for {len(self.headers)} columns")
        self.rows.append([str(c) for c in cells])

    def _column(self, index: int) -> list[str]:
        return [row[index] for row in self.rows]

    def natural_width(self, index: int) -> int:
        return max([cell_len(self.headers[index]), *map(cell_len, self._column(index))])

    def min_width(self, index: int) -> int:
        """Widest cell kept whole (up to FOLD_AFTER), and the longest header word."""
        words = self.headers[index].split() or [""]
        return max([*map(cell_len, words), *(min(cell_len(c), FOLD_AFTER) for c in self._column(index))])

    def parts(self, width: int | None) -> list[Table]:
        """rich tables no wider than `width` (None: one table at its natural width)."""
        columns = list(range(len(self.headers)))
        if width is None:
            return [self._rich(columns, [self.natural_width(i) for i in columns], self.title, self.caption)]
        groups = self._groups(width)
        return [self._rich(group, self._fit(group, width), self.title if n == 0 else None,
                           self.caption if n == len(groups) - 1 else None)
                for n, group in enumerate(groups)]

    def _groups(self, width: int) -> list[list[int]]:
        """Label columns plus runs of the other columns, in as few parts as fit, of even size."""
        labels = list(range(min(self.labels, len(self.headers))))
        rest = list(range(len(labels), len(self.headers)))
        greedy, current = [], []
        for index in rest:
            if current and not self._fits([*labels, *current, index], width):
                greedy.append(current)
                current = []
            current.append(index)
        greedy.append(current)
        size, extra = divmod(len(rest), len(greedy))
        bounds = [n * size + min(n, extra) for n in range(len(greedy) + 1)]
        even = [rest[a:b] for a, b in zip(bounds, bounds[1:])]
        chosen = even if all(self._fits([*labels, *part], width) for part in even) else greedy
        return [[*labels, *part] for part in chosen]

    def _fits(self, columns: list[int], width: int) -> bool:
        return rendered_width([self.min_width(i) for i in columns]) <= width

    def _fit(self, group: list[int], width: int) -> list[int]:
        """Natural widths, narrowed (wrapping headers) where the header is the widest part, to fit."""
        widths = [self.natural_width(i) for i in group]
        floors = [self.min_width(i) for i in group]
        excess = rendered_width(widths) - width
        while excess > 0:
            slack, pos = max((w - f, pos) for pos, (w, f) in enumerate(zip(widths, floors)))
            if slack <= 0:
                break  # a narrower terminal than the labels and one column: rich squeezes the rest
            widths[pos] -= 1
            excess -= 1
        return widths

    def _rich(self, group: list[int], widths: list[int], title: str | None, caption: str | None) -> Table:
        # titles and captions are plain text: a "[min-max]" in them is not rich markup
        table = Table(title=None if title is None else Text(title), caption=None if caption is None else Text(caption))
        for index, width in zip(group, widths):
            table.add_column(self.headers[index], width=width, overflow="fold",
                             justify="left" if index < self.labels else "right")
        for row in self.rows:
            table.add_row(*(Text(row[i], overflow="fold") for i in group))
        return table


def print_table(console: Console, table: ResultTable) -> None:
    """Print `table` to fit the terminal, or whole at its natural width when not a terminal."""
    if console.is_terminal:
        for part in table.parts(console.width):
            console.print(part)
        return
    (part,) = table.parts(None)
    natural = rendered_width([table.natural_width(i) for i in range(len(table.headers))])
    wide = PipeSafeConsole(file=console.file, width=max(console.width, natural), no_color=console.no_color,
                           color_system=None, force_terminal=False)
    wide.print(part)


def metric_table(title: str, data: dict) -> ResultTable:
    """A two-column metric/value table (run summaries, evaluation results)."""
    table = ResultTable(title, ["metric", "value"])
    for key, value in data.items():
        table.add_row(key, format_value(value))
    return table
