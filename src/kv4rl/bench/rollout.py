"""`kv4rl bench rollout`: collection time per learner batch, sync vs quota-based partial rollout.

Both modes see the same prompts and the same long-tailed response lengths: prompt `g` is a fixed
random token sequence and response (g, j) stops after a length drawn from a log-normal
distribution seeded by (g, j) (EOS is ignored), so the comparison isolates scheduling.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass

from kv4rl.data.types import Problem
from kv4rl.engine.config import EngineConfig
from kv4rl.engine.llm import Engine
from kv4rl.rollout.collector import Collector
from kv4rl.rollout.config import RolloutConfig


@dataclass(frozen=True)
class Workload:
    prompt_len: int = 16
    median_len: int = 8
    sigma: float = 1.0  # log-normal shape: larger = longer tail
    max_len: int = 40
    seed: int = 0

    def length(self, group: int, j: int) -> int:
        rng = random.Random(self.seed * 1_000_003 + group * 1_009 + j)
        return max(1, min(self.max_len, round(self.median_len * math.exp(rng.gauss(0.0, self.sigma)))))


class _Prompts:
    """Stands in for both the problem source and the formatter: problem g -> fixed random ids."""

    def __init__(self, vocab: int, prompt_len: int, seed: int):
        self.vocab, self.prompt_len, self.seed = vocab, prompt_len, seed

    def problem_at(self, index: int) -> Problem:
        return Problem(problem=str(index), answer="", id=f"bench-{index}")

    def ids(self, problem: Problem) -> list[int]:
        rng = random.Random(self.seed * 7_919 + int(problem.problem))
        return [rng.randrange(1, self.vocab - 1) for _ in range(self.prompt_len)]


def bench_rollout(model_dir, *, modes: list[str], kv_format: str = "auto", quota: int = 8, group: int = 4,
                  slots: int = 16, batches: int = 4, workload: Workload = Workload(), device: str = "auto",
                  num_kv_blocks: int | None = None, engine_config: EngineConfig | None = None,
                  progress=None) -> dict:
    """`engine_config` supplies any other engine settings (KV group size, protection, FP8 weights)."""
    results = []
    for mode in modes:
        if mode not in ("sync", "partial"):
            raise ValueError(f"--modes: unknown rollout mode '{mode}' (known: sync, partial)")
        cfg = copy.deepcopy(engine_config) if engine_config is not None else EngineConfig()
        if kv_format != "auto":
            cfg.kv.format = kv_format
        cfg.num_kv_blocks = num_kv_blocks or cfg.num_kv_blocks
        cfg.max_model_len = workload.prompt_len + workload.max_len + 1
        engine = Engine(model_dir, cfg, max_num_seqs=slots, device=device, seed=workload.seed)
        prompts = _Prompts(engine.args.vocab_size, workload.prompt_len, workload.seed)
        rcfg = RolloutConfig(mode=mode, quota_groups=quota, group_size=group, max_slots=slots)
        collector = Collector(engine, prompts, prompts, rcfg, seed=workload.seed, max_tokens_fn=workload.length)
        collector.collect()  # warm-up batch (partial: fills the pipeline), not timed
        collector.trace = []
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(batches):
            for g in collector.collect():
                tokens += sum(len(c.token_ids) for c in g.completions)
            if progress is not None:
                progress()
        seconds = time.perf_counter() - t0
        trace = collector.trace
        results.append({
            "mode": mode,
            "rollout_s": seconds / batches,
            "slot_util": sum(t["batch_size"] for t in trace) / (len(trace) * slots),
            "tokens_per_s": tokens / seconds,
            "steps_per_batch": len(trace) / batches,
            "step_ms": 1e3 * sum(t["latency_s"] for t in trace) / len(trace),
            "kv_format": engine.kv_format.name,
        })
    by_mode = {r["mode"]: r for r in results}
    speedup = by_mode["sync"]["rollout_s"] / by_mode["partial"]["rollout_s"] if len(by_mode) == 2 else None
    return {"results": results, "speedup": speedup, "quota_groups": quota, "group_size": group,
            "max_slots": slots, "batches": batches, "workload": workload.__dict__, "device": str(engine.device)}
