"""Module-level verl-style scorers for `tests/test_verl_score.py`: a watchdogged `VerlScore` imports its
compute_score by name in a worker process, so these cannot live inside a test."""

import time


def hangs_or_fails(solution_str, ground_truth):
    """Exact match, as a dict with verl's `acc`; "hang" never returns, "boom" raises."""
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "boom":
        raise ValueError("cannot score boom")
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}
