"""Evaluate a policy: k samples per problem through the engine, scored by a reward, summarised.

Sampling and summarising are apart so that several engines can each sample a share of the problems
(`kv4rl.eval.data_parallel`) and one process summarise the union. Request j of problem i is seeded
with `request_seed(seed, i * k + j)`, i its place in the whole problem list: a problem's samples do
not depend on which engine draws them or what else is in its batch (the sampler's noise is
counter-based per request), and one engine drawing every problem samples what it always did.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv4rl.data.prompts import PromptFormatter
from kv4rl.data.types import Problem
from kv4rl.engine.llm import Engine
from kv4rl.engine.sampler import request_seed
from kv4rl.engine.sequence import SamplingParams
from kv4rl.eval.metrics import summarize
from kv4rl.rewards.base import call_reward
from kv4rl.telemetry.progress import StageReport


@dataclass(frozen=True)
class ProblemResult:
    """One problem's k samples: its place in the whole list, their scores, token counts and texts."""

    index: int
    scores: tuple[float, ...]
    lengths: tuple[int, ...]
    texts: tuple[str, ...]


def sample_problems(engine: Engine, formatter: PromptFormatter, problems: list[Problem], indices: list[int],
                    reward_fn, *, k: int, temperature: float, max_new_tokens: int, seed: int,
                    progress: StageReport | None = None, max_in_engine: int | None = None,
                    ) -> tuple[list[ProblemResult], dict[str, float]]:
    """Sample and score `problems[i]` for every i in `indices`; returns their results and the reward's
    diagnostic counts over them (counts, so shares add up).

    Responses are decoded as they finish and only their texts kept, with at most `max_in_engine` requests
    in the engine at once (default `in_engine_window`), so the host's memory follows the texts, not every
    response's token and log-prob lists. They are scored together at the end, in one reward call.
    `progress(stage, done, total)` hears of every finished response, then of the scoring.
    """
    report = progress or (lambda stage, done=0, total=None: None)
    if not indices:
        return [], {}
    prompt_of = {i: formatter.ids(problems[i]) for i in indices}  # templated and encoded once, not k times
    prompts = [prompt_of[i] for i in indices for _ in range(k)]
    seeds = [request_seed(seed, i * k + j) for i in indices for j in range(k)]
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens)
    sampling = f"sampling {len(prompts)} responses"
    report(sampling, 0, len(prompts))
    texts: list[str] = [""] * len(prompts)
    lengths = [0] * len(prompts)

    engine_decodes = engine.tokenizer is formatter.tokenizer  # a training run's engine decodes

    def keep(place: int, completion) -> None:
        texts[place] = (completion.text if engine_decodes and completion.text is not None
                        else formatter.tokenizer.decode(completion.token_ids, skip_special_tokens=True))
        lengths[place] = len(completion.token_ids)

    engine.generate_each(prompts, params, keep, progress=lambda done: report(sampling, done, len(prompts)),
                         sample_seeds=seeds, group=k,
                         max_in_engine=max_in_engine or in_engine_window(engine.scheduler.max_num_seqs, k))
    report(f"scoring {len(texts)} responses", 0, None)
    result = call_reward(reward_fn, texts, [problems[i].answer for i in indices for _ in range(k)],
                         [problems[i] for i in indices for _ in range(k)])
    out = []
    for n, i in enumerate(indices):
        rows = slice(n * k, (n + 1) * k)
        out.append(ProblemResult(i, tuple(float(s) for s in result.scores[rows]), tuple(lengths[rows]),
                                 tuple(texts[rows])))
    return out, dict(result.stats)


def in_engine_window(max_num_seqs: int, k: int) -> int:
    """Requests an eval keeps in the engine, in whole problems (a problem's k samples fork one prompt
    prefill): room for the next problem whenever no more than twice the running slots are left, so a slot
    that frees always finds a queued request. (A window of one problem emptied the engine between problems
    when k >= 2 x slots: each problem's slowest samples ran alone, +29-48% steps in a review's probe.)"""
    return (-(-2 * max_num_seqs // k) + 1) * k


def summarize_results(results: list[ProblemResult], k: int, reward_stats: dict[str, float],
                      problems: list[Problem] | None = None) -> dict:
    """mean@k, pass@j for j in 1,2,4..k, mean response length and the reward's counts, over `results`
    taken in problem order (a sample is correct when its score exceeds 0.5), and `score_mean`, the raw scores'
    mean (verl's `reward/mean@N`: partial credit or ±1 scores read otherwise than mean@k). Where `problems`
    (indexed by the results) name two or more `data_source`s (verl's column; a row without one counts as
    `unknown`, as in verl), each one's mean@k, pass@j, score_mean and num_problems again as `<data_source>/...`,
    as verl's validation reports them."""
    results = sorted(results, key=lambda r: r.index)
    correct = [[s > 0.5 for s in r.scores] for r in results]
    ks = sorted({1, k} | {2**j for j in range(1, k.bit_length()) if 2**j <= k})
    out = summarize(correct, ks)
    out["score_mean"] = _score_mean(results)
    out["num_problems"] = len(results)
    out["k"] = k
    lengths = [n for r in results for n in r.lengths]
    out["response_len_mean"] = sum(lengths) / max(len(lengths), 1)
    out.update({f"reward_{key}": v for key, v in reward_stats.items()})
    sources = [data_source(problems[r.index]) for r in results] if problems is not None else []
    if any(x is not None for x in sources):  # rows without one are verl's `unknown`
        sources = [UNKNOWN_SOURCE if x is None else x for x in sources]
    named = sorted({x for x in sources if x is not None})
    for name in named if len(named) > 1 else ():
        mine = [c for c, x in zip(correct, sources) if x == name]
        out.update({f"{name}/{key}": v for key, v in summarize(mine, ks).items()})
        out[f"{name}/score_mean"] = _score_mean([r for r, x in zip(results, sources) if x == name])
        out[f"{name}/num_problems"] = len(mine)
    return out


def _score_mean(results: list[ProblemResult]) -> float:
    scores = [float(s) for r in results for s in r.scores]
    return sum(scores) / max(len(scores), 1)


UNKNOWN_SOURCE = "unknown"  # verl's name for the rows without a data_source


def data_source(problem: Problem) -> str | None:
    """The row's `data_source` (a verl file's column, kept in `meta`) as text; None where it has none."""
    value = (problem.meta or {}).get("data_source")
    return None if value is None or value == "" else str(value)


def evaluate(engine: Engine, formatter: PromptFormatter, problems: list[Problem], reward_fn, *, k: int,
             temperature: float, max_new_tokens: int, seed: int, progress: StageReport | None = None) -> dict:
    """Every problem on this one engine: `summarize_results` of `sample_problems` over all of them."""
    results, stats = sample_problems(engine, formatter, problems, list(range(len(problems))), reward_fn, k=k,
                                     temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                                     progress=progress)
    return summarize_results(results, k, stats, problems)
