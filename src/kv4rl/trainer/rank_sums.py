"""What the learner's ranks agree on in an update: each rank holds its own rows of the learner batch, so
the loss normalisers, the number of FSDP passes and the logged metrics are taken over all of them.
Every function is the identity at world size 1 (no collective)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_counts(group, world_size: int, num_tokens: float, num_seqs: float) -> tuple[float, float]:
    """Tokens and sequences over every rank's share: the loss's normalisers (the padded mini-batch's
    own counts at world size 1)."""
    if world_size == 1:
        return num_tokens, num_seqs
    counts = torch.tensor([num_tokens, num_seqs], dtype=torch.float64)
    dist.all_reduce(counts, group=group)
    return float(counts[0]), float(counts[1])


def most_on_any_rank(group, world_size: int, count: int) -> int:
    """The most micro-batches any rank has (FSDP2's collectives need every rank in every pass)."""
    if world_size == 1:
        return count
    most = torch.tensor([count], dtype=torch.long)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most)


def rank_passes(group, world_size: int, micro: list[torch.Tensor], rows: torch.Tensor):
    """(rows, dummy) of each pass over the micro-batches `micro` of `rows`: FSDP2's weight gathers need every rank
    in every pass, so a rank with fewer micro-batches (packing cuts equal shares differently) runs its first row
    again as discarded passes, or the gathers stop pairing up and the ranks wait on each other."""
    for i in range(most_on_any_rank(group, world_size, len(micro))):
        yield (rows[:1], True) if i >= len(micro) else (micro[i], False)


def every_rank(group, world_size: int, parts: list) -> list:
    """Every rank's (metrics, weight) parts, so the logged metrics describe the whole batch."""
    if world_size == 1:
        return parts
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, parts, group=group)
    return [part for rank_parts in gathered for part in rank_parts]
