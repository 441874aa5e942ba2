"""Warnings for runs that train on nothing for a mechanical reason, said once each as the rows come in.

- Every response cut at `rollout.max_new_tokens`: its default, 16, fits the embedded task's few-token
  answers; a real dataset's reasoning needs hundreds to thousands of tokens, and a cut response rarely
  holds an answer.
- Every group's rewards equal, iteration after iteration: then every advantage is zero and so is the
  policy gradient. The metrics show it (`zero_var_group_frac` 1, `adv_std` 0) but nothing said it; the
  usual causes are answers the reward cannot read (no `\\boxed{}`, an instruct model prompted without its
  chat template), the cut above, the wrong `reward.name`, or near-greedy sampling.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kv4rl.telemetry.metrics import read_lines

log = logging.getLogger(__name__)

STALL_ITERATIONS = 3  # consecutive iterations without a reward signal before the warning


def _no_signal(row: dict) -> bool:
    """Every group's rewards equal and every advantage 0 (baseline noise, when on, keeps them apart)."""
    return row.get("zero_var_group_frac") == 1.0 and row.get("adv_std") == 0.0


class RunWatch:
    """Fed every metrics row (`observe`); `responses_per_group` and `max_new_tokens` name the causes."""

    def __init__(self, responses_per_group: int, max_new_tokens: int, iterations: int = STALL_ITERATIONS,
                 chat_template: bool = False):
        self.group_size = responses_per_group
        self.max_new_tokens = max_new_tokens
        self.chat_template = chat_template  # on: the hint to turn it on is not given
        self.iterations = iterations
        self.stalled: list[dict] = []
        self.warned_stall = self.warned_cut = False

    def resume_from(self, rows: list[dict]) -> None:
        """Take over from a resumed run's earlier rows, without warning again: a run of equal-reward
        iterations across the resume still counts as one, and what was said before is not said twice."""
        for row in rows:
            self.warned_cut = self.warned_cut or row.get("truncated_frac") == 1.0
            if not _no_signal(row):
                self.stalled = []
            elif not self.warned_stall:  # appended in place: a copy a row was quadratic in a long stall
                self.stalled.append(row)
            self.warned_stall = self.warned_stall or len(self.stalled) >= self.iterations
        if self.warned_stall:
            self.stalled = []

    def observe(self, row: dict) -> None:
        if not self.warned_cut and row.get("truncated_frac") == 1.0:
            self.warned_cut = True
            log.warning("iteration %d: every response was cut at rollout.max_new_tokens=%d before it ended; "
                        "raise it to what the task's answers need (kv4rl eval uses 1024 for a data file, a "
                        "testbed's recipe what its build measured)",
                        row["iteration"], self.max_new_tokens)
        if self.warned_stall:
            return
        if not _no_signal(row):
            self.stalled = []
            return
        self.stalled.append(row)
        if len(self.stalled) < self.iterations:
            return
        self.warned_stall = True
        first, last = self.stalled[0]["iteration"], self.stalled[-1]["iteration"]
        rewards = sorted({round(r["reward_mean"], 4) for r in self.stalled if r.get("reward_mean") is not None})
        log.warning("iterations %d-%d: every group's responses got equal rewards (reward_mean %s), so every "
                    "advantage was 0 and the reward taught nothing. %s", first, last,
                    ", ".join(f"{r:g}" for r in rewards) or "n/a", self._cause())

    def _cause(self) -> str:
        rows = self.stalled
        responses = [len(r.get("groups") or []) * self.group_size for r in rows]
        cut = all(r.get("truncated_frac") == 1.0 for r in rows)
        if all(n and r.get("reward_no_answer") == n for r, n in zip(rows, responses)):
            # the cut first where every response was cut: its answer, if any, came after the limit
            return ("No response held an answer the reward could read (reward_no_answer)" + (
                f", and every response was cut at rollout.max_new_tokens={self.max_new_tokens}: raise it first"
                if cut else "") + ": check that the prompt asks for the answer's format (\\boxed{} for math_verify "
                "and exact)" + ("" if self.chat_template else ", and set data.chat_template=true for an instruct "
                                                                "model"))
        if cut:
            return f"Every response was cut at rollout.max_new_tokens={self.max_new_tokens}: raise it"
        return ("Check reward.name and the answer format it expects, or raise rollout.temperature if a group's "
                "responses are all alike")


def run_watch(cfg, run_dir: Path | None, start: int) -> RunWatch:
    """The watch of a run starting at iteration `start`, primed with the rows before it in `run_dir`'s
    metrics.jsonl (a resume; the log's writer names a torn line, this reader passes it over)."""
    watch = RunWatch(cfg.rollout.group_size, cfg.rollout.max_new_tokens, chat_template=bool(cfg.data.chat_template))
    path = None if run_dir is None else Path(run_dir) / "metrics.jsonl"
    if start and path is not None and path.is_file():
        watch.resume_from([row for _, row in read_lines(path, warn=False) if row.get("iteration", start) < start])
    return watch
