"""What every `kv4rl` sub-command shares: the console, the error exit, `engine.*` overrides, JSON output,
and the option checks that run before any work (a bad value found after minutes of timing, or an
output path that cannot be written once the results exist, wastes the run).

Kept apart from `cli.py` so that the sub-command modules (`cli_bench`, `cli_sim`) import it and
`cli.py` imports them, with no cycle between the command modules.
"""

from __future__ import annotations

import logging

import copy
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

import typer
from rich.markup import escape

from kv4rl.config_loader import ConfigError
from kv4rl.durability import sync_path
from kv4rl.file_modes import honour_umask
from kv4rl.paths import file_in_path
from kv4rl.telemetry.console import PipeSafeConsole

console = PipeSafeConsole()  # `| head` closing stdout does not end the command (its files still written)
# errors and warnings go to stderr, as the parser's own errors and the library's logged warnings do, so
# `kv4rl eval ... > out.txt` still shows them
err_console = PipeSafeConsole(stderr=True)


def error_line(message: str) -> None:
    """Print one error line, unwrapped (one each for a message of several lines, as a config's problems are);
    escaped, so a path or value in [brackets] is text, not rich markup."""
    for line in message.splitlines() or [""]:
        err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)


TRACEBACK_ENV = "KV4RL_TRACEBACK"  # set to 1: a failed file operation shows its traceback, not one line


def wants_traceback(verbose: bool = False) -> bool:
    """Whether a failing file operation should show its traceback: `--verbose`, or KV4RL_TRACEBACK=1."""
    return bool(verbose) or os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def os_error_text(error: OSError) -> str:
    """A failed file operation in one line: the file, then the system's reason (errno's text)."""
    where = f"{error.filename}: " if error.filename else ""
    return f"{where}{error.strerror or error}"


def fail(message: str) -> NoReturn:
    """Print one error line and exit with status 2 (bad input), the convention of every command."""
    error_line(message)
    raise typer.Exit(2)


def warn(message: str) -> None:
    """One warning line: the command goes on, but the user should know (e.g. a clamped length)."""
    err_console.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def say(message: str) -> None:
    """A plain line (paths written, counts) that may hold user text: no markup, no highlighting."""
    console.print(message, markup=False, highlight=False, soft_wrap=True)


def wrote(*paths: Path | None) -> None:
    """Name the files a command wrote, as they are on disk (None: not asked for; nothing said without any)."""
    written = [str(p) for p in paths if p is not None]
    if written:
        say("wrote " + " and ".join(written))


def engine_config(overrides: list[str] | None, options: Mapping[str, str] | None = None):
    """An EngineConfig from `engine.*` overrides (the same keys as in a run config). `options`: run-config
    keys this command takes as an option instead (key -> option), named when such a key is given."""
    from kv4rl.config_loader import apply_overrides, from_dict, parse_override
    from kv4rl.engine.config import EngineConfig

    data = apply_overrides({}, overrides or [])
    if set(data) - {"engine"}:
        keys = [".".join(parse_override(text)[0]) for text in overrides or []]
        others = [key for key in keys if key.split(".")[0] != "engine"]
        hints = [f"{options[key]} for {key}" for key in others if options and key in options]
        raise ConfigError(f"only engine.* settings apply here, got {', '.join(others)}"
                          + (f"; use {', '.join(hints)}" if hints else ""))
    cfg = from_dict(EngineConfig, data.get("engine", {}), prefix="engine")
    try:
        cfg.validate()  # the checks `train` makes (eval took engine.max_model_len=0 as "not set")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


PARTIAL_JSON: set[Path] = set()  # files whose last write held only the rows finished so far ("complete": false)


def _destination(path: Path) -> tuple[Path, bool]:
    """Where `path`'s text goes and whether by rename: a regular file (or a new one) is replaced whole; a
    symlink's target is (the link stays); a device, pipe or /dev, /proc name (`/dev/null`, `/dev/stdout`,
    `>(jq .)`) is written into, since a rename would put a plain file in its place (root turned
    /dev/stdout into one) and a pipe's reader would wait for ever."""
    if not path.is_symlink() and not (path.exists() and not path.is_file()):
        return path, True
    real = Path(os.path.realpath(path))
    # a process's own streams: written into even where they are files (`> out.txt`), never replaced
    stream = re.fullmatch(r"/dev/(stdout|stderr|fd/\d+)|/proc/[^/]+/fd/\d+", str(path.absolute())) is not None
    special = stream or (real.exists() and not real.is_file())
    return (path, False) if special else (real, True)


def writes_into(path: Path | None) -> bool:
    """Whether `path` is a device, pipe or stream that results are written into (`_destination`)."""
    return path is not None and not _destination(path)[1]


def write_together(files: dict[Path | None, str | None]) -> None:
    """Write each file's text (None path or text: skipped) to a temporary file beside it, then rename them all
    into place: a failure while writing (a full disk) leaves every target as it was and no temporary file.
    Devices and pipes are written into after the renames (`_destination`)."""
    staged, streams = [], []
    try:
        for given, text in files.items():
            if given is None or text is None:
                continue
            path, by_rename = _destination(given)
            if not by_rename:
                streams.append((path, text))
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            # a fresh name: never another target's, nor a file the user has
            handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(handle)
            staged.append((Path(name), path))
            Path(name).write_text(text)
            honour_umask(Path(name))  # mkstemp makes it 0600; a plain open() would not
        for tmp, _ in staged:
            sync_path(tmp)  # on the disk before its name replaces the file a user had (a quota may say no here)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in staged:
        os.replace(tmp, path)
    for path, text in streams:
        with open(path, "a") as out:  # "a": /dev/stdout redirected to a file is not truncated
            out.write(text)


def write_json(res: dict, json_out: Path | None) -> None:
    """Write `res` as JSON, whole or not at all (a temporary file renamed over the target), so a kill during
    the write never leaves half a file; remembers a partial result for the interrupt message (`main`)."""
    if json_out is None:
        return
    from kv4rl.versions import stamped

    res = stamped(res)
    if res.get("complete") is False and writes_into(json_out):
        return  # a pipe's reader would take the partial result as the whole one (and the next write block)
    write_together({json_out: json.dumps(res, indent=2) + "\n"})
    if res.get("complete") is False:
        PARTIAL_JSON.add(json_out)
    else:
        PARTIAL_JSON.discard(json_out)


def finite_float(text: str) -> float:
    """A float option's parser: `inf` and `nan` parse as floats but no option means them."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def check_device(device: str, option: str = "--device") -> None:
    """Refuse a device that torch would reject only after the model has loaded, or CUDA where there is none."""
    from kv4rl.engine.placement import resolve_device

    if device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"{option}: '{device}' is not auto, cpu, cuda or cuda:N")
    try:
        resolve_device(device)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def check_output_path(path: Path | None, option: str = "--json", *, create: bool = True) -> None:
    """Make sure a result file can be written before the work that fills it: refuse a path that is a
    directory, a run's record or in its checkpoints/ (`check_spares_models_and_runs`), lies under a file or cannot
    be written, and (`create`) make its missing folders. Without
    `create` (a dry run, or checks that may still refuse) nothing is made."""
    if path is None:
        return
    if str(path) == "-":
        fail(f"{option} -: takes a file path, not '-' (for the terminal give /dev/stdout; the tables print there too)")
    if path.is_dir():
        fail(f"{option} {path}: is a directory; give a file path")
    from kv4rl.cli_outputs import check_spares_models_and_runs

    check_spares_models_and_runs({option: path}, {})  # a run's records and checkpoints, whatever the command
    if writes_into(path):  # /dev/stdout, /dev/null, a pipe: its folder is not written (/dev is root's)
        if not os.access(path, os.W_OK):
            fail(f"{option} {path}: cannot be written (no permission)")
        return
    blocking = file_in_path(path.parent)
    if blocking is not None:
        fail(f"{option} {path}: cannot create its folder {path.parent} ({blocking} is a file)")
    if not create:
        existing = next(part for part in (path.parent, *path.parent.parents) if part.exists())
        if not os.access(existing, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            fail(f"{option} {path}: cannot be written (no permission)")
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # no permission, read-only file system
        fail(f"{option} {path}: cannot create its folder {path.parent} ({exc.strerror or exc})")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"{option} {path}: cannot be written (no permission)")


def check_not_an_input(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """Refuse an output path that names an input file (or another output): writing the results would
    replace the user's data, e.g. `--samples` over the `--data` file being evaluated."""
    seen: dict[Path, str] = {path.resolve(): option for option, path in inputs.items() if path is not None}
    for option, path in outputs.items():
        if path is None:
            continue
        other = seen.get(path.resolve())
        if other is not None:
            fail(f"{option} {path} is also {other}; writing it would replace that file, give another path")
        seen[path.resolve()] = option


class _LogLines(logging.Formatter):
    """A warning reads as the CLI's own (`warning: ...`, as `warn` prints); with -v the INFO lines keep the
    module that said them."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            return f"error: {message}"
        if record.levelno >= logging.WARNING:
            return f"warning: {message}"
        return f"{record.name}: {message}"


def setup_logging(verbose: bool) -> None:
    """Library log records on stderr: warnings always, the INFO lines (engine plan, learner setup) with -v."""
    handler = logging.StreamHandler()
    handler.setFormatter(_LogLines())
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


def check_plot_outputs(figure: Path, runs: list[Path], json_out: Path | None = None) -> None:
    """A plot's figure, the CSV beside it and its JSON must be three files, none of them a record of the runs
    it reads (`RUN_FILES`: `--json runs/a-s0/metrics.jsonl` replaced the training log)."""
    from kv4rl.run_folder import RUN_FILES

    inputs = {f"{name} of run {run}": Path(run) / name for run in runs for name in RUN_FILES}
    outputs = {"--out": figure, "the CSV beside --out": figure.with_suffix(".csv"), "--json": json_out}
    check_not_an_input(outputs, inputs)  # any run's records and checkpoints: check_output_path


def image_formats() -> list[str]:
    """File suffixes matplotlib can write a figure as (png, pdf, svg, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def check_figure_path(path: Path | None, option: str, *, csv_beside: bool = False,
                      create: bool = True) -> Path | None:
    """The figure file a command will write, checked before its work: without a suffix it is a PNG (as
    matplotlib would make it, so the name printed is the file's), and a suffix matplotlib cannot write is
    refused. The file, and with `csv_beside` the CSV of its numbers next to it, must be writable
    (`check_output_path`; `create`: make the missing folders)."""
    if path is None:
        return None
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:  # a declared dependency, but an install can lack it
        fail(f"{option} {path}: figures need matplotlib, which is not installed (pip install matplotlib)")
    if path.is_dir():
        fail(f"{option} {path}: is a directory; give a file path")
    if not path.suffix:
        path = path.with_suffix(".png")
    elif path.suffix[1:].lower() not in image_formats():
        fail(f"{option} {path}: matplotlib cannot write a '{path.suffix}' figure "
             f"(use one of: {', '.join(image_formats())})")
    check_output_path(path, option, create=create)
    if csv_beside:
        check_output_path(path.with_suffix(".csv"), f"{option} (its CSV beside it)", create=create)
    return path


def check_at_least(minimum: float, *options: tuple[str, float | None]) -> None:
    """Refuse the first `(option, value)` whose value is below `minimum` (None: not given, no check)."""
    for option, value in options:
        if value is not None and value < minimum:
            raise ValueError(f"{option} must be >= {minimum}, got {value}")


def check_temperature(option: str, value: float) -> None:
    """Refuse a sampling temperature the engine cannot sample at (see `temperature_problem`)."""
    from kv4rl.engine.sequence import temperature_problem

    problem = temperature_problem(option, value)
    if problem:
        raise ValueError(problem)


def option_list(text: str, option: str, cast: Callable = str, *, minimum: float | None = None,
                known: tuple[str, ...] | list[str] | None = None) -> list:
    """A comma-separated option as a list, refused when empty, unparsable, below `minimum`, unknown, or
    with an empty item or a repeated value (each value is one row of work; a repeat would be timed twice)."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ValueError(f"{option} is empty")
    if not all(items):
        raise ValueError(f"{option} {text!r}: an empty item between commas")
    values = []
    for item in items:
        try:
            value = cast(item)
        except ValueError:
            kind = {int: "an integer", float: "a number", finite_float: "a finite number"}.get(cast, "a valid value")
            raise ValueError(f"{option}: {item!r} is not {kind}") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"{option}: every value must be >= {minimum}, got {item}")
        if known is not None and value not in known:
            raise ValueError(f"{option}: unknown value '{item}' (known: {', '.join(known)})")
        if value in values:
            raise ValueError(f"{option} {text!r}: {item!r} is given twice")
        values.append(value)
    return values


def check_kv_formats(names: list[str], option: str, engine=None, *, head_dim: int | None = None,
                     max_model_len: int | None = None, allow_auto: bool = False) -> None:
    """Refuse, naming `option`, a KV format the engine does not know or that cannot run with the other
    settings of `engine` (an EngineConfig; default: the defaults) on a model of `head_dim` with
    `max_model_len` positions (None: not known yet)."""
    from kv4rl.engine.config import EngineConfig
    from kv4rl.engine.kv_formats import KV_FORMATS, kv_format_from_config

    known = (["auto"] if allow_auto else []) + sorted(KV_FORMATS)
    for name in names:
        if name not in known:
            raise ValueError(f"{option}: unknown KV format '{name}' (known: {', '.join(known)})")
        cfg = copy.deepcopy(engine) if engine is not None else EngineConfig()
        cfg.kv.format = name
        cfg.max_model_len = max_model_len or cfg.max_model_len
        try:
            cfg.validate()
            if name != "auto":
                kv_format_from_config(cfg.kv).check(head_dim, cfg.max_model_len)
        except ValueError as exc:
            raise ValueError(f"{option} {name}: {exc}") from None


def shape_args(shape: str, args_of):
    """`args_of(shape)`, with an unknown shape named as the --shape option's fault."""
    try:
        return args_of(shape)
    except ValueError as exc:
        raise ValueError(f"--shape: {exc}") from None


def warn_real_shape_off_cuda(shape: str | None, device: str) -> None:
    """A benchmark of a real model's shape started on the CPU runs for hours and may fill the host's memory
    (`bench rollout --shape qwen3-1.7b` sizes every slot at full length there): say so before it starts."""
    from kv4rl.engine.placement import resolve_device

    if shape is not None and shape != "qwen3-tiny" and resolve_device(device).type != "cuda":
        warn(f"--shape {shape} is a real model's size: on the CPU its random weights take GBs and the benchmark "
             "takes hours; --shape qwen3-tiny runs in seconds")

