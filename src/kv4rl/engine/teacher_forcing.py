"""Teacher-forced scoring through an engine's own cache path (`Engine.score_tokens`).

Each sequence is prefilled with its prompt, then decodes its forced tokens one at a time from the
engine's KV cache, exactly as sampling would (a quantized cache attends over its quantized history),
so the logits are what the engine saw when it could have sampled those tokens. Sequences are batched
and may be preempted and recomputed like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kv4rl.engine.sequence import SamplingParams

if TYPE_CHECKING:
    from kv4rl.engine.llm import Engine


def score_forced(engine: Engine, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
    """Teacher forcing: for each prompt, float32 logits[T, V] of its forced tokens, row t given
    `prompt + forced[:t]`; the engine must be idle and awake."""
    if engine.has_unfinished():
        raise RuntimeError("score_tokens needs an idle engine (finish or abort pending requests first)")
    if engine.asleep:
        raise RuntimeError("the engine is asleep (its KV pool is freed); call wake() before scoring")
    if len(prompts) != len(forced):
        raise ValueError(f"score_tokens: {len(prompts)} prompts but {len(forced)} forced sequences")
    prompts = [engine.checked_ids(p, "score_tokens: a prompt") for p in prompts]
    forced = [engine.checked_ids(f, "score_tokens: a forced sequence") for f in forced]
    for prompt, tokens in zip(prompts, forced):
        if not prompt:
            raise ValueError("score_tokens: every prompt needs at least one token")
        if not tokens:
            raise ValueError("score_tokens: every forced sequence needs at least one token")
        if len(prompt) + len(tokens) > engine.max_model_len:
            raise ValueError(
                f"score_tokens: {len(prompt)} prompt + {len(tokens)} forced tokens exceed "
                f"max_model_len={engine.max_model_len}"
            )
    seqs = []
    try:
        for p, f in zip(prompts, forced):
            seqs.append(engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=len(f), ignore_eos=True),
                                           sample_seed=0))
        return _score(engine, seqs, forced)
    except BaseException:  # none is left in the engine, where the next `step` would sample it on
        for seq in seqs:
            engine.abort(seq)
        raise


def _score(engine: Engine, seqs: list, forced: list[list[int]]) -> list[torch.Tensor]:
    forced_by_id = {s.seq_id: f for s, f in zip(seqs, forced)}
    rows: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
    while engine.has_unfinished():
        batch = engine.scheduler.schedule()
        sampling = [s.samples_this_step for s in batch]
        logits = engine.runner.forward(batch)
        logprobs = logits.log_softmax(-1)
        for i, seq in enumerate(batch):
            if not sampling[i]:
                continue  # a prompt chunk: its logits score nothing
            t = len(seq.output_ids)
            assert len(rows[seq.seq_id]) == t, "a forced position was scored twice or skipped"
            rows[seq.seq_id].append(logits[i].clone())  # graph outputs are reused
            token = forced_by_id[seq.seq_id][t]
            seq.append(token, float(logprobs[i, token]), engine.version)
            if engine.scheduler.stop_reason(seq, frozenset()) is not None:
                engine.scheduler.finish(seq, "length")
    return [torch.stack(rows[s.seq_id]) for s in seqs]
