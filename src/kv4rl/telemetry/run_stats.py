"""What the loop logs about a batch's collection, and the summary of a whole run from its metrics file."""

from __future__ import annotations

import re

from pathlib import Path

from kv4rl.telemetry.metrics import read_lines


def staleness_stats(update: int, completions) -> dict:
    """Per-token staleness (update - version that sampled it): mean, max and histogram."""
    ages = [update - v for c in completions for v in c.versions]
    hist: dict[str, int] = {}
    for a in ages:
        hist[str(a)] = hist.get(str(a), 0) + 1
    return {"staleness_mean": sum(ages) / max(len(ages), 1), "staleness_max": max(ages, default=0),
            "staleness_hist": dict(sorted(hist.items(), key=lambda item: int(item[0])))}


def stepped(trace: list[dict]) -> bool:
    """Whether the collection itself ran the engine: a partial run can hand over groups finished in earlier
    iterations, and with async scheduling its trace then holds only the step a refresh drained."""
    return any(not t.get("drained") for t in trace)


def collection_stats(trace: list[dict], max_slots: int) -> dict:
    """Engine steps of the collection and their mean active batch over `max_slots`; `slot_util` is None when
    the collection ran no step (`stepped`): 0.0 read as an idle engine."""
    if not stepped(trace):
        return {"decode_steps": len(trace), "slot_util": None}
    return {"decode_steps": len(trace),
            "slot_util": sum(t["batch_size"] for t in trace) / (len(trace) * max_slots)}


def sum_known(values) -> float | None:
    """The sum of the values that are not None (an engine or rank that took no step has no rate); None if none."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def mean_known(values) -> float | None:
    """The mean of the values that are not None; None if none."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def summarize_run(run_dir: Path, resumed_from: int | None, written: bool = True) -> dict:
    """The whole run as recorded in metrics.jsonl (a resumed run included from iteration 0). A resume that
    has not `written` yet (stopped before its first iteration) leaves out the rows from `resumed_from` on:
    they are of iterations after its checkpoint, which its first write replaces."""
    path = run_dir / "metrics.jsonl"
    rows = [row for _, row in read_lines(path)] if path.is_file() else []
    if resumed_from is not None and not written:
        rows = [row for row in rows if row.get("iteration", -1) < resumed_from]
    out: dict = {"iterations": len(rows)}
    if resumed_from is not None:
        out["resumed_from"] = resumed_from
    if rows:
        head, tail = rows[:5], rows[-5:]
        acc = lambda rs: sum(r["accuracy"] for r in rs) / len(rs)
        out.update({
            "seconds_in_iterations": sum(r.get("time_total") or 0.0 for r in rows),  # the total, every iteration
            "accuracy_first5": acc(head),
            "accuracy_last5": acc(tail),
            "reward_first": rows[0]["reward_mean"],
            "reward_last": rows[-1]["reward_mean"],
        })
        # the evaluation's mean@k before training (eval.before_training) and at its last evaluation
        for name, prefix, ordered in (("eval_start", "eval_start/", rows), ("eval_last", "eval/", rows[::-1])):
            found = next(((key, value) for row in ordered for key, value in row.items()
                          if re.fullmatch(re.escape(prefix) + r"mean@\d+", key) and value is not None), None)
            if found is not None:
                out[f"{name}_{found[0].removeprefix(prefix)}"] = found[1]
        skipped = sum(r.get("skipped_steps") or 0 for r in rows)
        if skipped:  # optimizer steps left out for a non-finite gradient norm (each warned about as it happened)
            out["skipped_steps"] = skipped
    out["run_dir"] = str(run_dir)
    return out
