"""Rich consoles that keep a command going when the reader of its output goes away.

`kv4rl eval ... | head -1` closed stdout while the command still had its results to write: rich's
default answer to the broken pipe is `SystemExit(1)` from inside the `print`, so the JSON written after
the table was lost, a training run stopped without a checkpoint, and nothing said why. Here the output
goes to /dev/null from then on (one line on stderr says so) and the command finishes its work."""

from __future__ import annotations

import os
import sys

from rich.console import Console


class PipeSafeConsole(Console):
    """A Console whose broken pipe silences it instead of ending the process."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        stream = sys.stderr if self.stderr else sys.stdout
        try:
            os.dup2(devnull, stream.fileno())  # later writes of any code to it go nowhere, without an error
        finally:
            os.close(devnull)
        if not self.stderr:
            try:
                print("warning: stdout was closed by its reader; the command goes on without printing to it",
                      file=sys.stderr, flush=True)
            except OSError:  # stderr gone too
                pass
