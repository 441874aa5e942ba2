"""Evaluate a policy: k samples per problem through the engine, scored by a reward, summarised."""

from __future__ import annotations

from kv4rl.data.prompts import PromptFormatter
from kv4rl.data.types import Problem
from kv4rl.engine.llm import Engine
from kv4rl.engine.sequence import SamplingParams
from kv4rl.eval.metrics import summarize
from kv4rl.telemetry.progress import StageReport


def evaluate(engine: Engine, formatter: PromptFormatter, problems: list[Problem], reward_fn, *, k: int,
             temperature: float, max_new_tokens: int, seed: int, progress: StageReport | None = None) -> dict:
    """Returns mean@k, pass@j for j in 1,2,4..k, mean response length and reward diagnostics.

    `progress(stage, done, total)` hears of every finished response, then of the scoring.
    """
    report = progress or (lambda stage, done=0, total=None: None)
    prompts = [formatter.ids(p) for p in problems for _ in range(k)]
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed)
    sampling = f"sampling {len(prompts)} responses"
    report(sampling, 0, len(prompts))
    completions = engine.generate(prompts, params, progress=lambda done: report(sampling, done, len(prompts)))
    texts = [formatter.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    report(f"scoring {len(texts)} responses", 0, None)
    result = reward_fn(texts, [p.answer for p in problems for _ in range(k)])
    correct = [[s > 0.5 for s in result.scores[i * k:(i + 1) * k]] for i in range(len(problems))]
    ks = sorted({1, k} | {2**j for j in range(1, k.bit_length()) if 2**j <= k})
    out = summarize(correct, ks)
    out["num_problems"] = len(problems)
    out["k"] = k
    out["response_len_mean"] = sum(len(c.token_ids) for c in completions) / max(len(completions), 1)
    out.update({f"reward_{key}": v for key, v in result.stats.items()})
    return out
