"""Where an iteration's time goes: mean seconds per phase of the training loop, per run.

The loop times rollout, reward (with advantages), update, weight sync and the engine's sleep/wake
inside `time_total`; whatever `time_total` holds beyond those (batch hand-off, bookkeeping) is shown
as `other`, so the stacked bar's height is the mean `time_total`. Evaluation runs outside
`time_total`. Runs recorded before the loop timed sleep/wake count it as 0 (they did not sleep).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from kv4rl.telemetry.metrics import distinct_runs, read_metrics, run_labels

log = logging.getLogger(__name__)

PHASES = ("time_rollout", "time_reward", "time_update", "time_sync", "time_sleep_wake")
OPTIONAL = {"time_sleep_wake": 0.0}  # phases older metrics files lack, and their value there


def phase_means(run: Path, skip: int = 0) -> dict[str, float]:
    """Mean seconds per phase over the run's iterations from `skip` on (`skip` drops warm-up)."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run}: no metrics.jsonl (is it a run folder?)")
    rows = [r for r in read_metrics(path) if r["iteration"] >= skip]
    if not rows:
        raise ValueError(f"{run}: no iterations at or after {skip}")
    return means_of(rows, str(run))


def means_of(rows: list[dict], where: str) -> dict[str, float]:
    """Mean seconds per phase (and `other`, `time_total`, `iterations`) of metrics rows of the loop."""
    # a split run's rollout and reward happen on the engines, beside the update: the learner's iteration holds
    # its wait for them instead (they added up past time_total, a negative `other`)
    rows = [{**OPTIONAL, **r, **({"time_rollout": r["time_learner_wait"], "time_reward": 0.0}
                                 if isinstance(r.get("time_learner_wait"), int | float) else {})} for r in rows]
    for key in (*PHASES, "time_total"):
        missing = [r for r in rows if not isinstance(r.get(key), (int, float))]
        if missing:
            state = "null" if key in missing[0] else "missing"
            raise ValueError(f"{where}: '{key}' {state} at iteration {missing[0]['iteration']}")
    means = {k: math.fsum(r[k] for r in rows) / len(rows) for k in (*PHASES, "time_total")}
    timed = math.fsum(means[k] for k in PHASES)
    if timed > means["time_total"] * (1 + 1e-9) + 1e-9:  # the loop times every phase inside time_total now
        log.warning("%s: the phases' mean seconds add up to %.6g, more than the mean time_total %.6g: 'other' is "
                    "drawn as 0 (a multi-GPU run recorded before 2026-12-06 took each phase's maximum over the "
                    "ranks, or the file was edited)", where, timed, means["time_total"])
    means["other"] = max(0.0, means["time_total"] - timed)  # never a negative bar
    means["iterations"] = len(rows)
    return means


def rows_of(label: str, means: dict[str, float]) -> list[dict]:
    """The CSV rows of one run or arm: one per phase, `share` = the phase's part of the mean `time_total`."""
    total = means["time_total"]
    return [{"run": label, "phase": phase.removeprefix("time_"), "mean_s": means[phase],
             "share": means[phase] / total if total else 0.0, "iterations": means["iterations"]}
            for phase in (*PHASES, "other")]


def phase_rows(runs: list[Path], skip: int = 0) -> list[dict]:
    """The CSV rows: one per (run, phase) (see `rows_of`)."""
    runs = distinct_runs(runs)  # a folder named twice is drawn once
    return [row for label, run in zip(run_labels(runs), runs) for row in rows_of(label, phase_means(run, skip))]
