"""What the learner logs about an update besides the loss's own metrics: each micro-batch's entropy and,
before the batch's first update, the engine-vs-learner mismatch of the sampled tokens; and the clipped
gradient norm as a plain float on every rank."""

from __future__ import annotations

from kv4rl.algo.logprobs import k3_kl
from kv4rl.trainer.batch import TrainBatch


def global_scalar(value) -> float:
    """A float of a scalar that may be a DTensor (FSDP2's clipped gradient norm, the same on every rank)."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full is not None else value)


def token_stats(logp, ent, mb: TrainBatch, first: bool) -> dict[str, float]:
    """Entropy of this micro-batch under the weights it is trained at (after the batch's earlier updates when
    there are several), and, on the first mini-batch only (`first`: before any update of this batch), the
    engine-vs-learner mismatch."""
    m = mb.response_mask
    n = m.sum().clamp(min=1)
    stats = {"entropy": float((ent * m).sum() / n)}
    if first:
        diff = (logp - mb.behavior_logprobs) * m
        stats["mismatch_k3"] = float((k3_kl(mb.behavior_logprobs, logp) * m).sum() / n)
        stats["mismatch_abs_mean"] = float(diff.abs().sum() / n)
        stats["mismatch_absmax"] = float(diff.abs().max())
    return stats
