"""`kv4rl eval` under torchrun: each engine samples a share of the problems, rank 0 summarises all.

The ranks form `world / tensor_parallel` engines of consecutive ranks (as in `kv4rl train`); engine e
takes problems e, e + E, e + 2E, ... (E engines), all k samples of a problem on one engine. Every rank
of an engine runs the same requests; its first rank scores them and hands them on. The reward's
diagnostics are counts, so the shares' counts add up to one process's. Seeds follow the problem
(`kv4rl.eval.runner`), so the per-problem results, and the metrics, are those of one process.
"""

from __future__ import annotations

from kv4rl.distributed import Ranks, gather_objects
from kv4rl.eval.runner import ProblemResult, sample_problems, summarize_results


def engine_ranks(ranks: Ranks, tensor_parallel: int) -> Ranks:
    """This rank's engine and the number of engines (consecutive blocks of `tensor_parallel` ranks)."""
    if tensor_parallel < 1 or ranks.world % tensor_parallel:
        raise ValueError(f"engine.tensor_parallel={tensor_parallel} does not divide the {ranks.world} ranks "
                         "torchrun started")
    return Ranks(ranks.rank // tensor_parallel, ranks.world // tensor_parallel)


def share(num_problems: int, engine: Ranks) -> list[int]:
    """The problems (places in the whole list) that `engine` samples."""
    return list(range(engine.rank, num_problems, engine.world))


def evaluate_ranks(engine, formatter, problems, reward_fn, ranks: Ranks, *, k: int, temperature: float,
                   max_new_tokens: int, seed: int, progress=None) -> tuple[dict | None, list[ProblemResult] | None]:
    """Sample this engine's share and gather every share: (metrics, per-problem results in problem order)
    on rank 0, (None, None) on the others. One process: every problem, as `evaluate`."""
    tp = engine.tp.size
    mine = engine_ranks(ranks, tp)
    results, stats = sample_problems(engine, formatter, problems, share(len(problems), mine), reward_fn, k=k,
                                     temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                                     progress=progress)
    shares = gather_objects((results, stats) if engine.tp.rank == 0 else None)
    if not ranks.main:
        return None, None
    merged: list[ProblemResult] = []
    counts: dict[str, float] = {}
    for part in shares:
        if part is None:  # a tensor-parallel rank other than its engine's first
            continue
        merged.extend(part[0])
        for key, value in part[1].items():
            counts[key] = counts.get(key, 0.0) + value
    merged.sort(key=lambda r: r.index)
    if [r.index for r in merged] != list(range(len(problems))):
        raise RuntimeError(f"the engines returned {len(merged)} problem results for {len(problems)} problems")
    return summarize_results(merged, k, counts, problems), merged
