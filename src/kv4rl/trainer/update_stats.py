"""What the learner logs about an update besides the loss's own metrics: each micro-batch's entropy and,
before the batch's first update, the engine-vs-learner mismatch of the sampled tokens; and the clipped
gradient norm as a plain float on every rank."""

from __future__ import annotations

import logging

from kv4rl.algo.logprobs import k3_kl
from kv4rl.trainer.batch import TrainBatch

log = logging.getLogger("kv4rl.trainer.learner")  # the learner's warnings, under its name


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
        stats.update(mismatch_stats(logp, mb.behavior_logprobs, m))
    return stats


def mismatch_stats(logp, behavior_logprobs, mask) -> dict[str, float]:
    """The engine's μ against the learner's log-probs `logp` over the `mask`ed tokens: k3, mean and largest |gap|."""
    n = mask.sum().clamp(min=1)
    diff = (logp - behavior_logprobs) * mask
    return {"mismatch_k3": float((k3_kl(behavior_logprobs, logp) * mask).sum() / n),
            "mismatch_abs_mean": float(diff.abs().sum() / n), "mismatch_absmax": float(diff.abs().max())}


def warn_left_out(iteration: int, steps: int, nonfinite_losses: int, empty: int, skipped: int, loss: str) -> None:
    """Say what an update left out: micro-batches with a non-finite loss (logged as null, a finite gradient still
    steps), optimizer steps with no token to train, and steps whose gradient norm was not finite."""
    if nonfinite_losses:
        log.warning("iteration %d: the loss was not finite in %d micro-batch(es) (logged as null); check the "
                    "loss (algo.loss=%s)", iteration, nonfinite_losses, loss)
    if empty:
        log.warning("iteration %d: %d of %d optimizer steps had no token to train, so none was taken: every "
                    "response of their mini-batches was masked (trainer.mask_truncated masks responses cut at "
                    "rollout.max_new_tokens, trainer.mask_zero_advantage those of zero advantage; "
                    "algo.behavior_rs with algo.old_logprob=recompute the tokens sampled too far from π_old)",
                    iteration, empty, steps)
    if skipped:
        log.warning("iteration %d: skipped %d of %d optimizer steps: the gradient norm was not finite, so the "
                    "weights and the optimizer state stay as they were (lower trainer.lr?)", iteration, skipped, steps)
