"""The numbers behind `kv4rl plot mismatch`: per run and logged iteration, each source's share of the
learner-vs-engine log-ratio (see `kv4rl.telemetry.attribution` and docs/method.md).

Pure computation over metrics.jsonl (no torch, no matplotlib), so the CSV can be checked by hand.
"""

from __future__ import annotations

from pathlib import Path

from kv4rl.telemetry.metrics import distinct_runs, read_metrics, run_labels

# The chain's terms in order, from the learner's side to the engine's recorded log-prob.
SOURCES = ("learner", "staleness", "kv_cache", "weights", "truncation", "kernels")
STATS = ("abs_mean", "k3", "mean")  # per source: mean |d|, mean (e^d - 1 - d), mean d over tokens
TOKENS_KEY = "mismatch/attributed_tokens"


def metric_key(source: str, stat: str) -> str:
    return f"mismatch/{source}_{stat}"


def mismatch_rows(runs: list[Path]) -> list[dict]:
    """One row per (run, iteration with attributed tokens, source or `total`): abs_mean, k3, mean, tokens.
    A run folder without metrics.jsonl or without any attribution raises ValueError naming it."""
    if not runs:
        raise ValueError("no runs given: name one or more run folders")
    out = []
    runs = distinct_runs(runs)  # a folder named twice is drawn once
    labels = run_labels(runs)
    for label, run in zip(labels, runs):
        path = run / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"{run}: no metrics.jsonl (is it a run folder?)")
        rows = sorted(read_metrics(path), key=lambda r: r["iteration"])
        logged = [r for r in rows if r.get(TOKENS_KEY)]
        if not logged:
            ran = [r for r in rows if TOKENS_KEY in r]
            if ran:
                skipped = sum(r.get("mismatch/skipped_responses") or 0 for r in ran)
                raise ValueError(f"{run}: attribution ran at {len(ran)} iteration(s) (first {ran[0]['iteration']}) but "
                                 f"attributed no tokens; {skipped} responses were skipped (a response that spans two "
                                 "weight versions is skipped, docs/method.md)")
            raise ValueError(f"{run}: no mismatch attribution in metrics.jsonl "
                             "(train with telemetry.attribution_every=N to log it)")
        for row in logged:
            missing = [metric_key(source, stat) for source in (*SOURCES, "total") for stat in STATS
                       if metric_key(source, stat) not in row]
            if missing:  # a hand-edited or foreign file: kv4rl writes every source's row with the token count
                raise ValueError(f"{run}: iteration {row['iteration']} logs {TOKENS_KEY} but not {missing[0]}"
                                 f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
            for source in (*SOURCES, "total"):
                out.append({"run": label, "iteration": row["iteration"], "source": source,
                            **{stat: row[metric_key(source, stat)] for stat in STATS},
                            "tokens": row[TOKENS_KEY]})
    return out
