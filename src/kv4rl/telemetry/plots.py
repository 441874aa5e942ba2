"""Offline plots from run folders (never imported by hot paths)."""

from __future__ import annotations

import csv
import math
from array import array
from pathlib import Path

from kv4rl.telemetry.metrics import distinct_runs, iter_rows, run_labels


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_png: Path) -> Path:
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    _pyplot().close(fig)
    return out_png


def write_csv(rows: list[dict], path: Path) -> Path:
    """The numbers behind a figure, one row per plotted point (columns from the first row)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:  # run names are UTF-8 text (`paths.readable`)
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot_curves(curves, metric: str, decay: float, band: str, out_png: Path) -> Path:
    """Per arm: the mean over seeds of the EMA curves, and a shaded band (see `curves.BAND`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in curves:
        n = max(c.n_seeds, default=0)
        (line,) = ax.plot(c.iterations, c.mean, label=f"{c.name} (n={n})")
        ax.fill_between(c.iterations, c.low, c.high, color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel("iteration")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric}: mean over seeds of EMA({decay:g}); band: {band}")
    ax.grid(alpha=0.3)
    ax.legend(title=f"arm (band: {band})", fontsize="small")
    return _save(fig, out_png)


def plot_iteration_time(rows: list[dict], out_png: Path, title: str = "time per iteration by phase") -> Path:
    """Stacked bars: mean seconds per phase, one bar per run or arm (rows from `phases.rows_of`)."""
    plt = _pyplot()
    runs = list(dict.fromkeys(r["run"] for r in rows))
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    value = {(r["run"], r["phase"]): r["mean_s"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(runs) + 3), 5))
    bottom = [0.0] * len(runs)
    for phase in phases:
        heights = [value[(run, phase)] for run in runs]
        ax.bar(runs, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.3g} s", (x, total), ha="center", va="bottom", fontsize="small")
    ax.set_ylim(0, 1.1 * max(bottom, default=0.0) or 1.0)  # room for the totals above the bars
    ax.set_ylabel("mean seconds per iteration")
    ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small")
    ax.tick_params(axis="x", labelrotation=20)
    return _save(fig, out_png)


TRACE_COLUMNS = ("iteration", "batch_size", "context_mean", "kv_bytes", "latency_s")


def trace_columns(path: Path, iterations: tuple[int, float] | None = None) -> dict[str, array]:
    """The plotted fields of a rollout trace's steps in [first, last) iterations, read line by line into
    arrays of doubles: a long run's trace has a row per engine step (millions), and its rows as dicts
    took ~1 KB each."""
    columns = {key: array("d") for key in TRACE_COLUMNS}
    for number, _, row in iter_rows(path):
        for key in TRACE_COLUMNS:  # a row edited or damaged by hand was a TypeError or KeyError traceback
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{path}:{number}: {key} is {'missing' if key not in row else repr(value)}, not a "
                                 f"finite number (the engine writes every step's {', '.join(TRACE_COLUMNS)}; "
                                 f"was the line edited?)")
        if iterations is not None and not iterations[0] <= row["iteration"] < iterations[1]:
            continue
        for key, column in columns.items():
            column.append(row[key])
    return columns


def plot_rollout_trace(run_dirs: list[Path], out_png: Path, iterations: tuple[int, float] | None = None) -> Path:
    """Figure B-2 style: per decode step, active batch size and mean context length, nominal resident
    KV bytes, and step latency; one column per run (e.g. sync and partial side by side)."""
    plt = _pyplot()
    run_dirs = distinct_runs(run_dirs)  # `runs/a` and `runs/a/.` drew the same run twice
    labels = run_labels(run_dirs)  # two folders of one name were both titled by it
    fig, axes = plt.subplots(3, len(run_dirs), figsize=(6 * len(run_dirs), 9), squeeze=False, sharey="row")
    for col, run in enumerate(run_dirs):
        trace = trace_columns(Path(run) / "rollout_trace.jsonl", iterations)
        if not trace["iteration"]:
            raise ValueError(f"{run}: rollout_trace.jsonl holds no steps in the chosen iterations")
        steps = range(len(trace["iteration"]))
        ax = axes[0][col]
        ax.plot(steps, trace["batch_size"], label="active batch size")
        ax2 = ax.twinx()
        ax2.plot(steps, trace["context_mean"], color="tab:orange", label="mean context length")
        ax.set_title(labels[col])
        ax.set_ylabel("active sequences")
        ax2.set_ylabel("mean context (tokens)")
        axes[1][col].plot(steps, [b / 2**20 for b in trace["kv_bytes"]], color="tab:green")
        axes[1][col].set_ylabel("resident KV (MiB, nominal)")
        axes[2][col].plot(steps, [1e3 * t for t in trace["latency_s"]], color="tab:red")
        axes[2][col].set_ylabel("step latency (ms)")
        axes[2][col].set_xlabel("engine step")
        its = trace["iteration"]
        bounds = [i for i in range(1, len(its)) if its[i] != its[i - 1]]
        for row in axes:
            for b in bounds:
                row[col].axvline(b, color="grey", lw=0.5, ls=":")
    return _save(fig, out_png)


def plot_rollout_corners(traces: dict[str, list[dict]], pool_bytes: dict[str, int], out_png: Path) -> Path:
    """`kv4rl bench rollout --png`: per KV format (columns), active sequences and KV bytes in use over
    engine time for each rollout mode, with the format's pool as a dashed line; rows share their y axis,
    so the formats' budgets and how full each mode keeps them compare at a glance.

    `traces` maps "format mode" to steps of {"t": engine seconds, "active", "kv_bytes"}; `pool_bytes`
    maps each format to its pool's bytes."""
    plt = _pyplot()
    formats = list(dict.fromkeys(label.split()[0] for label in traces))
    unit, scale = ("GiB", 2**30) if max(pool_bytes.values()) >= 2**30 else ("MiB", 2**20)
    fig, axes = plt.subplots(2, len(formats), figsize=(5 * len(formats), 6), squeeze=False, sharey="row")
    for col, fmt in enumerate(formats):
        top, bottom = axes[0][col], axes[1][col]
        for label, trace in traces.items():
            name, mode = label.split()
            if name != fmt:
                continue
            t = [s["t"] for s in trace]
            top.plot(t, [s["active"] for s in trace], label=mode)
            bottom.plot(t, [s["kv_bytes"] / scale for s in trace], label=mode)
        bottom.axhline(pool_bytes[fmt] / scale, color="grey", ls="--", lw=1, label="pool")
        bottom.set_ylim(bottom=0)
        top.set_title(f"KV {fmt}")
        top.set_ylabel("active sequences")
        bottom.set_ylabel(f"KV in use ({unit})")
        bottom.set_xlabel("engine time in one timed repeat (s)")
        bottom.legend(loc="lower right")
    return _save(fig, out_png)


def plot_mismatch(rows: list[dict], out_png: Path) -> Path:
    """`kv4rl plot mismatch`: per run (columns), each source's mean |Δ log p| over the iterations that
    logged attribution, and the total dashed; log scale, so a term that is exactly 0 leaves no line
    (rows from `mismatch_curves.mismatch_rows`)."""
    plt = _pyplot()
    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False, sharey=True)
    for ax, run in zip(axes[0], runs):
        mine = [r for r in rows if r["run"] == run]
        drawn = 0
        for source in dict.fromkeys(r["source"] for r in mine):
            points = [(r["iteration"], r["abs_mean"]) for r in mine  # null (a non-finite value logged): no point
                      if r["source"] == source and r["abs_mean"] is not None and r["abs_mean"] > 0]
            if points:
                style = {"color": "black", "ls": "--"} if source == "total" else {"marker": "."}
                ax.plot(*zip(*points), label=source, **style)
                drawn += 1
        ax.set_yscale("log")
        ax.set_title(run)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "every term exactly 0", ha="center", transform=ax.transAxes)
    axes[0][0].set_ylabel("mean |Δ log p| per token")
    return _save(fig, out_png)
