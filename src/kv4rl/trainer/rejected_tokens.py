"""`algo.behavior_rs` (verl's rollout_rs) in the learner: the tokens whose μ strayed too far from π_old leave the
batch's response mask once, before its first update, so every pass, loss term and denominator of the batch (the
entropy bonus and the reference KL too) sees only what was kept, as verl's modified response_mask does."""

from __future__ import annotations

import dataclasses

import torch

from kv4rl.algo.rejection import RejectionRule, rejection_keep
from kv4rl.trainer.batch import TrainBatch
from kv4rl.trainer.update_stats import mismatch_stats


def without_rejected(batch: TrainBatch, old_logprobs: torch.Tensor,
                     rules: tuple[RejectionRule, ...]) -> tuple[TrainBatch, list[tuple[dict[str, float], float]]]:
    """(`batch` with the rejected tokens out of its response mask; the rejected shares as (metrics, weight) parts,
    the tokens' weighed by this rank's valid tokens and the responses' by its responses, so that they merge over
    ranks into the batch's shares; and the engine-vs-learner mismatch of every sampled token, the rejected ones
    too, which the learner's passes would measure on the kept ones only)."""
    mask = batch.response_mask
    keep, stats = rejection_keep(old_logprobs, batch.behavior_logprobs, mask.bool(), rules)
    responses = float((mask.sum(1) > 0).sum())
    parts = [({"behavior_rs_frac": float(stats["behavior_rs_frac"])}, float(mask.sum())),
             ({"behavior_rs_seq_frac": float(stats["behavior_rs_seq_frac"])}, responses),
             (mismatch_stats(old_logprobs, batch.behavior_logprobs, mask), float(mask.sum()))]
    return dataclasses.replace(batch, response_mask=mask * keep.to(mask.dtype)), parts
