"""Learning curves over seeds: run folders -> arms -> EMA per seed -> mean and min-max band per arm.

Pure computation (no matplotlib), so the numbers behind a figure can be checked by hand and
written as CSV/JSON beside it.

Definitions (the figure, CSV and JSON all use these):
- An *arm* is a set of runs that differ only by seed: folder names that differ only by a trailing
  `-s<seed>` (`ppo-s0`, `ppo-s1` -> arm `ppo`), or the runs named by `--arm NAME=GLOB`.
- Per seed, the metric's series keeps the iterations whose row has the key with a non-null value
  (evaluation metrics are logged every N iterations; non-finite values are written as null).
- An `eval/<x>` series starts with the starting model's evaluation where the run made one
  (`eval.before_training`, logged as `eval_start/<x>` in its first row): a point at iteration −1, before the
  first update, as `eval/<x>` at iteration i is the model after update i.
- EMA per seed over that series: s_0 = x_0, s_t = ema * s_{t-1} + (1 - ema) * x_t (`ema=0`: raw).
- Per arm and iteration, over the seeds that logged that iteration: mean, low = min, high = max.
- Final value: each seed's EMA at its last logged iteration; mean and sample std (ddof=1) over seeds.
- Worst drop of a curve: max over t of (max_{u<=t} s_u) - s_t, for metrics where higher is better;
  reported for the arm's mean curve and for its worst seed.
- Starting model of a run: the first `model_sha256` its rows record (`kv4rl.models.fingerprint`;
  "unknown" for runs written before rows carried it, or of a model too large to hash). Runs of
  different builds of one testbed are not comparable (GPU builds differ between machines), so a figure
  whose runs started from more than one known model is flagged (`model_warnings`).
"""

from __future__ import annotations

import glob
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from kv4rl.paths import SET_ASIDE, readable
from kv4rl.telemetry.metrics import read_metrics

SEED_SUFFIX = re.compile(r"-s\d+$")
BAND = "min-max over seeds"
MODEL_KEY = "model_sha256"
UNKNOWN_MODEL = "unknown"


@dataclass
class Arm:
    name: str
    runs: list[Path] = field(default_factory=list)


@dataclass
class SeedCurve:
    run: Path
    iterations: list[int]
    values: list[float]  # raw metric
    smoothed: list[float]  # EMA
    null_values: int  # rows where the metric was logged as null (non-finite, or not measured in that row)
    models: list[str] = field(default_factory=list)  # the distinct `model_sha256` of its rows, first one first


@dataclass
class ArmCurve:
    name: str
    seeds: list[SeedCurve]
    iterations: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]
    n_seeds: list[int]


def ema(values: list[float], decay: float) -> list[float]:
    out: list[float] = []
    for x in values:
        out.append(x if not out else decay * out[-1] + (1 - decay) * x)
    return out


def worst_drop(curve: list[float]) -> float:
    """Largest fall below the running maximum (0 for a non-decreasing curve)."""
    peak, drop = -math.inf, 0.0
    for v in curve:
        peak = max(peak, v)
        drop = max(drop, peak - v)
    return drop


def expand(pattern: str) -> list[Path]:
    """A run folder, or a glob over run folders (sorted); errors name what did not match. A glob leaves out
    the runs `--overwrite` set aside (`<name>.old-<time>`), which `runs/<name>-s*` would otherwise take as
    extra arms; named alone, such a folder is plotted."""
    path = Path(pattern)
    if path.is_dir():
        found = [path]
    else:
        matched = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_dir())
        found = [p for p in matched if not SET_ASIDE.search(p.name)]
        if not found:
            raise ValueError(f"{pattern}: matches no run folder" + (
                f" but {len(matched)} set aside by --overwrite (name one to plot it)" if matched else ""))
    for run in found:
        if not (run / "metrics.jsonl").is_file():
            raise ValueError(f"{run}: no metrics.jsonl (is it a run folder?)")
    return found


def arm_name(run: Path) -> str:
    """The folder's name without its `-s<seed>` suffix, as UTF-8 text (`paths.readable`)."""
    return readable(SEED_SUFFIX.sub("", run.name))


def group_arms(patterns: list[str], named: list[str]) -> list[Arm]:
    """Arms in order of first appearance: positional runs grouped by name, then `NAME=GLOB` arms."""
    arms: dict[str, Arm] = {}
    owner: dict[Path, str] = {}

    def add(arm: str, run: Path) -> None:
        key = run.resolve()
        if key in owner:
            if owner[key] == arm:
                return  # the same folder matched twice (overlapping globs)
            raise ValueError(f"{run} falls in two arms: {owner[key]} and {arm}")
        owner[key] = arm
        arms.setdefault(arm, Arm(arm)).runs.append(run)

    for pattern in patterns:
        for run in expand(pattern):
            add(arm_name(run), run)
    for arm in arms.values():  # one folder name twice (from two parents) is not two seeds
        names = [r.name for r in arm.runs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"arm {arm.name}: several folders named {dup[0]}; name the arms with --arm NAME=GLOB")
    for spec in named:
        name, sep, pattern = spec.partition("=")
        name = readable(name)
        if not sep or not name or not pattern:
            raise ValueError(f"--arm {spec!r} must look like NAME=GLOB")
        if name in arms:
            raise ValueError(f"--arm {name}: an arm of that name already exists")
        for run in expand(pattern):
            add(name, run)
    if not arms:
        raise ValueError("no runs given: name run folders or globs, or --arm NAME=GLOB")
    return list(arms.values())


def _numeric_keys(rows: list[dict]) -> list[str]:
    return sorted({k for r in rows for k, v in r.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"})


def load_seed(run: Path, metric: str, decay: float, until: int | None = None) -> SeedCurve:
    every = read_metrics(run / "metrics.jsonl")
    rows = [r for r in every if until is None or r["iteration"] <= until]
    logged = [r for r in rows if metric in r]
    if not logged:
        later = [r["iteration"] for r in every if metric in r]
        if later:  # an evaluation every N iterations is first logged after a small --until
            raise ValueError(f"{run}: metric '{metric}' is first logged at iteration {min(later)}, after --until "
                             f"{until}")
        raise ValueError(f"{run}: metric '{metric}' not in metrics.jsonl; numeric keys there: "
                         f"{', '.join(_numeric_keys(rows)) or 'none'}")
    present = [r for r in logged if r[metric] is not None]
    if not present:
        raise ValueError(f"{run}: metric '{metric}' is null in every row that has it (not finite, or not measured "
                         "there, as a rate in an iteration that ran no engine step)")
    for r in present:
        v = r[metric]
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"{run}: metric '{metric}' is not a number (iteration {r['iteration']}: "
                             f"{type(v).__name__})")
    present.sort(key=lambda r: r["iteration"])
    iterations, values = [r["iteration"] for r in present], [float(r[metric]) for r in present]
    start = _start_eval(rows, metric)
    if start is not None:
        iterations, values = [start[0], *iterations], [start[1], *values]
    models = [r[MODEL_KEY] for r in sorted(rows, key=lambda r: r["iteration"]) if r.get(MODEL_KEY) is not None]
    return SeedCurve(run, iterations, values, ema(values, decay), len(logged) - len(present),
                     list(dict.fromkeys(models)))


def _start_eval(rows: list[dict], metric: str) -> tuple[int, float] | None:
    """(iteration − 1 of the run's first row, the value) of `eval_start/<x>` for metric `eval/<x>`, where the first
    row has a finite number there (`eval.before_training`); else None."""
    if not metric.startswith("eval/") or not rows:
        return None
    first = min(rows, key=lambda r: r["iteration"])
    value = first.get("eval_start/" + metric.removeprefix("eval/"))
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return first["iteration"] - 1, float(value)


def arm_curve(arm: Arm, metric: str, decay: float, until: int | None = None) -> ArmCurve:
    seeds = [load_seed(run, metric, decay, until) for run in arm.runs]
    by_iter: dict[int, list[float]] = {}
    for s in seeds:
        for it, v in zip(s.iterations, s.smoothed):
            by_iter.setdefault(it, []).append(v)
    its = sorted(by_iter)
    return ArmCurve(arm.name, seeds, its, [math.fsum(by_iter[i]) / len(by_iter[i]) for i in its],
                    [min(by_iter[i]) for i in its], [max(by_iter[i]) for i in its],
                    [len(by_iter[i]) for i in its])


def summarize(curve: ArmCurve) -> dict:
    """Per arm: final EMA value (mean, sample std over seeds) and worst drops."""
    finals = [s.smoothed[-1] for s in curve.seeds]
    n = len(finals)
    mean = math.fsum(finals) / n
    std = math.sqrt(sum((f - mean) ** 2 for f in finals) / (n - 1)) if n > 1 else None
    return {
        "runs": [str(s.run) for s in curve.seeds],
        "n_seeds": len(curve.seeds),
        "last_iteration": curve.iterations[-1] if curve.iterations else None,
        "last_iteration_per_seed": [s.iterations[-1] for s in curve.seeds],
        "final_mean": mean,
        "final_std": std,
        "final_per_seed": finals,
        "worst_drop_mean_curve": worst_drop(curve.mean),
        "worst_drop_worst_seed": max(worst_drop(s.smoothed) for s in curve.seeds),
        "null_values": sum(s.null_values for s in curve.seeds),
    }


def starting_models(curves: list[ArmCurve]) -> dict[str, list[str]]:
    """Starting model fingerprint (or "unknown") -> the runs that started from it, in figure order."""
    out: dict[str, list[str]] = {}
    for s in (s for c in curves for s in c.seeds):
        out.setdefault(s.models[0] if s.models else UNKNOWN_MODEL, []).append(str(s.run))
    return out


def model_warnings(summary: dict) -> list[str]:
    """What makes a figure's runs not comparable: runs started from different known models, or a run
    whose rows carry several (resumed onto another build). Empty when the figure is consistent."""
    out = []
    known = {m: runs for m, runs in summary["starting_models"].items() if m != UNKNOWN_MODEL}
    if len(known) > 1:
        groups = "; ".join(f"{m} -> {', '.join(runs)}" for m, runs in summary["starting_models"].items())
        out.append(f"the runs started from {len(known)} different models (different builds are not comparable; "
                   f"train every arm from one build): {groups}")
    for run, models in summary["model_changes"].items():
        out.append(f"{run}: its rows record {len(models)} starting models ({' then '.join(models)}): resumed "
                   f"onto another build of the model")
    return out


def coverage_warnings(summary: dict) -> list[str]:
    """Arms whose seeds end at different iterations: past the first end the mean is over fewer seeds (a seed
    that stops can make a drop no seed had) and the final value mixes iterations. And arms whose rows logged
    the metric as null, which the curve passes over."""
    out = []
    for name, arm in summary["arms"].items():
        ends = arm["last_iteration_per_seed"]
        if len(set(ends)) > 1:
            out.append(f"arm {name}: its seeds' last logged iterations differ ({min(ends)} to {max(ends)}); past "
                       f"{min(ends)} the mean is over fewer seeds and the final values mix iterations "
                       "(--until common cuts every run at the last iteration all have)")
        if arm["null_values"]:  # a null grad_norm is a step without a finite gradient: not to pass unseen
            out.append(f"arm {name}: {arm['null_values']} row(s) logged {summary['metric']} as null (not finite, or "
                       f"not measured there); the curve passes over them")
    return out


def curve_rows(curves: list[ArmCurve]) -> list[dict]:
    """The CSV rows: one per (arm, iteration)."""
    return [{"iteration": it, "arm": c.name, "mean": m, "low": lo, "high": hi, "n_seeds": n}
            for c in curves for it, m, lo, hi, n in zip(c.iterations, c.mean, c.low, c.high, c.n_seeds)]


def last_common_iteration(arms: list[Arm]) -> int:
    """The last iteration that every run of every arm has logged; ValueError naming a run with no rows."""
    last = []
    for a in arms:
        for run in a.runs:
            # the curves read each file again after this: their reading warns of a torn line, once
            logged = [r["iteration"] for r in read_metrics(run / "metrics.jsonl", warn=False)]
            if not logged:
                raise ValueError(f"--until common: {run / 'metrics.jsonl'} has no rows to compare (a run killed "
                                 "before its first iteration was written?); leave that run out")
            last.append(max(logged))
    return min(last)


def learning_curves(patterns: list[str], named: list[str], metric: str,
                    decay: float, until: int | str | None = None) -> tuple[list[ArmCurve], dict]:
    """Everything the `plot curves` command shows: the arm curves and the summary (JSON-ready).
    `until` leaves out the iterations after it, so runs stopped at different points (a deadline, a
    preemption) are compared at the same iteration; `"common"` means the last one every run has."""
    if not 0 <= decay < 1:
        raise ValueError(f"--ema {decay}: must be in [0, 1)")
    arms = group_arms(patterns, named)
    if until == "common":
        until = last_common_iteration(arms)
    if until is not None and (not isinstance(until, int) or until < 0):
        raise ValueError(f"--until {until}: must be an iteration >= 0 or 'common'")
    curves = [arm_curve(a, metric, decay, until) for a in arms]
    summary = {"metric": metric, "ema": decay, "band": BAND, "until": until,
               "arms": {c.name: summarize(c) for c in curves}, "starting_models": starting_models(curves),
               "model_changes": {str(s.run): s.models for c in curves for s in c.seeds if len(s.models) > 1}}
    return curves, summary
