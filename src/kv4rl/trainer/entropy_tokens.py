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
    local = entropy.detach()[valid].double().cpu() if not dummy else torch.zeros(0, dtype=torch.float64)
    if world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, local, group=group)
        local = torch.cat(gathered)
    if local.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(local, 1.0 - rho)
    return valid & (entropy.detach().double() >= threshold.to(entropy.device))
