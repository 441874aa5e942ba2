"""`algo.top_entropy_quantile` (TRL's, from "Beyond the 80/20 Rule"): the loss on a micro-batch's highest-entropy
tokens only (the reference KL on every token, as TRL's), the rest still in its denominators.

The threshold is the (1 − ρ) quantile of the entropies of one learner pass's valid tokens over every rank (a rank's
dummy pass adds none), as TRL takes it over its processes' micro-batch: so unlike the rest of the loss it depends
on how a mini-batch is split into micro-batches (`trainer.micro_batch_size`, `max_tokens_per_micro_batch`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def high_entropy_tokens(group, world_size: int, entropy: torch.Tensor, mask: torch.Tensor, rho: float,
                        dummy: bool = False) -> torch.Tensor:
    """Bool `[b, T]`: the valid tokens whose entropy is at least the (1 − `rho`) quantile of this pass's valid tokens on
    every rank (torch.quantile's linear interpolation, as TRL's); none where no rank has a valid token."""
    valid = mask.bool()
    values = entropy.detach().double()
    pool = values[valid] if not dummy else values.new_zeros(0)
    if world_size > 1:  # one process keeps it on its device: no host copy in the step
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, pool.cpu(), group=group)
        pool = torch.cat(gathered).to(values.device)
    if pool.numel() == 0:
        return torch.zeros_like(valid)
    return valid & (values >= torch.quantile(pool, 1.0 - rho))
