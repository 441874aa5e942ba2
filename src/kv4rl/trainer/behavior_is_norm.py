"""`algo.behavior_is_normalize` (verl's rollout_is_batch_normalize) in the learner: the behaviour weights π_old/μ
are fixed once π_old is recomputed, so their mean over the whole learner batch (every rank's share, every sampled
token, those `behavior_rs` rejects too, as verl takes it before rejecting) is taken once, before the first update,
and each micro-batch's loss divides its weights by it."""

from __future__ import annotations

import torch

from kv4rl.algo.off_policy import behavior_importance_weights, weight_sums
from kv4rl.algo.ppo_settings import PPOClipSettings
from kv4rl.trainer.batch import TrainBatch
from kv4rl.trainer.rank_sums import global_counts

SMALLEST_MEAN = 1e-8  # verl's: a batch whose mean weight is no larger is left unscaled


def batch_mean_weight(batch: TrainBatch, old_logprobs: torch.Tensor, s: PPOClipSettings, group,
                      world_size: int) -> torch.Tensor:
    """[B, T] float64, the batch's mean weight in every position (1 where it is <= 1e-8), for `LossInputs`, whose
    tensors the learner selects by rows."""
    sampled = batch.response_mask.bool()
    weights, _ = behavior_importance_weights(old_logprobs, batch.behavior_logprobs, sampled, s.behavior_is,
                                             s.behavior_is_min, s.behavior_is_max)
    total, count = global_counts(group, world_size, *weight_sums(weights, sampled, s.behavior_is))
    mean = total / count if count > 0 else 1.0
    return torch.full(old_logprobs.shape, mean if mean > SMALLEST_MEAN else 1.0, dtype=torch.float64,
                      device=old_logprobs.device)
