"""`kv4rl plot ...`: figures, their CSVs and tables from run folders (rollout trace, learning curves,
iteration time by phase, mismatch attribution)."""

from __future__ import annotations

from pathlib import Path

import typer

from kv4rl.cli_common import (
    check_at_least,
    check_figure_path,
    check_output_path,
    check_plot_outputs,
    console,
    fail,
    finite_float,
    option_list,
    setup_logging,
    warn,
    write_json,
    wrote,
)
from kv4rl.telemetry.tables import ResultTable, print_table

plot_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Plots from run folders.")


@plot_app.callback()
def _plot_logging() -> None:
    """Warnings of the readers (a row a crash cut short, skipped) as `warning: ...` lines, as train and bench say
    them (without it Python's last-resort handler printed the bare text, no line break)."""
    setup_logging(False)


@plot_app.command("rollout-trace")
def plot_rollout_trace_cmd(
    runs: list[Path] = typer.Argument(..., help="run folders (e.g. a sync run and a partial run)"),
    out: Path | None = typer.Option(None, "--out", "-o", help="PNG path (default: <first run>/rollout_trace.png)"),
    first: int = typer.Option(0, "--from", help="first iteration to show"),
    last: int | None = typer.Option(None, "--to", help="show iterations before this one (default: to the end)"),
) -> None:
    """Per-step rollout trace (batch size, context, resident KV, latency), runs side by side."""
    from kv4rl.telemetry.plots import plot_rollout_trace

    for run in runs:
        if not (run / "rollout_trace.jsonl").is_file():
            fail(f"{run}: no rollout_trace.jsonl (is it a run folder?)")
    try:
        check_at_least(0, ("--from", first))
        if last is not None and last <= first:
            raise ValueError(f"--to {last} must be above --from {first}")
    except ValueError as exc:
        fail(str(exc))
    out = check_figure_path(out or runs[0] / "rollout_trace.png", "--out", create=False)
    check_plot_outputs(out, runs)
    try:
        path = plot_rollout_trace(runs, out, (first, last if last is not None else float("inf")))
    except ValueError as exc:
        fail(str(exc))
    wrote(path)


def _curves_table(metric: str, ema: float, summary: dict) -> ResultTable:
    table = ResultTable(f"{metric}, EMA {ema:g}",
                        ["arm", "seeds", "last iter", "final mean ± std", "drop mean", "drop seed"],
                        caption="final: each seed's EMA at its last iteration; drop: largest fall below the "
                                "running max, of the mean curve and of the worst seed")
    for name, a in summary["arms"].items():
        final = "-" if a["final_mean"] is None else f"{a['final_mean']:.4f}"
        if a["final_std"] is not None:
            final += f" ± {a['final_std']:.4f}"
        table.add_row(name, str(a["n_seeds"]), str(a["last_iteration"]), final,
                      f"{a['worst_drop_mean_curve']:.4f}", f"{a['worst_drop_worst_seed']:.4f}")
    return table


def _one_iteration(until: str) -> int:
    """`--until N`: one iteration (a list read as one took its first value, quietly)."""
    values = option_list(until, "--until", int, minimum=0)
    if len(values) > 1:
        raise ValueError(f"--until {until!r}: one iteration, or 'common'")
    return values[0]


@plot_app.command("curves")
def plot_curves_cmd(
    runs: list[str] | None = typer.Argument(
        None, help="run folders or globs; folders named NAME-s<seed> form arm NAME"),
    metric: str = typer.Option("accuracy", "--metric", "-m", help="metrics.jsonl key, e.g. reward_mean, eval/mean@1"),
    ema: float = typer.Option(0.9, "--ema", parser=finite_float,
        help="EMA decay per seed: s_t = ema*s_(t-1) + (1-ema)*x_t; 0: raw"),
    arm: list[str] | None = typer.Option(None, "--arm", help="NAME=GLOB: the runs of one arm, named (repeatable)"),
    out: Path = typer.Option(Path("curves.png"), "--out", "-o", help="PNG path; the CSV goes beside it"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the per-arm summary here"),
    until: str | None = typer.Option(
        None, "--until", help="leave out iterations after this one ('common': the last one every run has)"),
    require_same_model: bool = typer.Option(
        False, "--require-same-model", help="fail (writing nothing) when the runs did not all start from the "
                                            "same model weights (their metrics rows' model_sha256)"),
) -> None:
    """Learning curves: per arm, the mean over seeds of each seed's EMA curve, with a min-max band."""
    from kv4rl.telemetry.curves import coverage_warnings, curve_rows, learning_curves, model_warnings
    from kv4rl.telemetry.plots import plot_curves, write_csv

    out = check_figure_path(out, "--out", csv_beside=True, create=False)  # made below, once nothing refuses
    check_output_path(json_out, create=False)
    try:
        last = until if until in (None, "common") else _one_iteration(until)
        curves, summary = learning_curves(runs or [], arm or [], metric, ema, last)
    except ValueError as exc:
        fail(str(exc))
    check_plot_outputs(out, [s.run for c in curves for s in c.seeds], json_out)
    mixed = model_warnings(summary)
    if mixed and require_same_model:
        fail(f"--require-same-model: {' | '.join(mixed)}")
    mixed += coverage_warnings(summary)
    check_figure_path(out, "--out", csv_beside=True)
    check_output_path(json_out)
    png = plot_curves(curves, metric, ema, summary["band"], out)
    csv_path = write_csv(curve_rows(curves), out.with_suffix(".csv"))
    print_table(console, _curves_table(metric, ema, summary))
    for line in mixed:  # under the table, where it is read
        warn(line)
    write_json(summary, json_out)
    wrote(png, csv_path, json_out)


@plot_app.command("iteration-time")
def plot_iteration_time_cmd(
    runs: list[Path] = typer.Argument(..., help="run folders"),
    out: Path = typer.Option(Path("iteration_time.png"), "--out", "-o", help="PNG path; the CSV goes beside it"),
    skip: int = typer.Option(0, "--skip", help="leave out the iterations before this one (warm-up)"),
) -> None:
    """Stacked bars of the mean time per phase (rollout, reward, update, sync, sleep/wake, other) per run."""
    from kv4rl.telemetry.phases import phase_rows
    from kv4rl.telemetry.plots import plot_iteration_time, write_csv

    out = check_figure_path(out, "--out", csv_beside=True, create=False)  # made below, once nothing refuses
    try:
        check_at_least(0, ("--skip", skip))
        rows = phase_rows(runs, skip)
    except ValueError as exc:
        fail(str(exc))
    check_plot_outputs(out, runs)
    check_figure_path(out, "--out", csv_beside=True)
    png = plot_iteration_time(rows, out)
    csv_path = write_csv(rows, out.with_suffix(".csv"))
    wrote(png, csv_path)


@plot_app.command("mismatch")
def plot_mismatch_cmd(
    runs: list[Path] = typer.Argument(..., help="run folders trained with telemetry.attribution_every=N"),
    out: Path = typer.Option(Path("mismatch.png"), "--out", "-o", help="PNG path; the CSV goes beside it"),
) -> None:
    """Mismatch by source: each source's mean |Δ log p| per token over iterations, one panel per run."""
    from kv4rl.telemetry.mismatch_curves import mismatch_rows
    from kv4rl.telemetry.plots import plot_mismatch, write_csv

    out = check_figure_path(out, "--out", csv_beside=True, create=False)  # made below, once nothing refuses
    try:
        rows = mismatch_rows(runs)
    except ValueError as exc:
        fail(str(exc))
    check_plot_outputs(out, runs)
    check_figure_path(out, "--out", csv_beside=True)
    png = plot_mismatch(rows, out)
    csv_path = write_csv(rows, out.with_suffix(".csv"))
    wrote(png, csv_path)
