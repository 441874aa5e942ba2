"""What every `kv4rl` sub-command shares: the console, the error exit, `engine.*` overrides, JSON output.

Kept apart from `cli.py` so that the sub-command modules (`cli_bench`, `cli_sim`) import it and
`cli.py` imports them, with no cycle between the command modules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from kv4rl.config_loader import ConfigError

console = Console()


def fail(message: str) -> NoReturn:
    """Print one error line and exit with status 2 (bad input), the convention of every command."""
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def engine_config(overrides: list[str] | None):
    """An EngineConfig from `engine.*` overrides (the same keys as in a run config)."""
    from kv4rl.config_loader import apply_overrides, from_dict
    from kv4rl.engine.config import EngineConfig

    data = apply_overrides({}, overrides or [])
    unknown = set(data) - {"engine"}
    if unknown:
        raise ConfigError(f"only engine.* settings apply here, got {', '.join(sorted(unknown))}")
    return from_dict(EngineConfig, data.get("engine", {}), prefix="engine")


def write_json(res: dict, json_out: Path | None) -> None:
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2) + "\n")
