"""How a module stores checkpoint tensors in its own form: the slot type shared by the decoder, the FP8
linears (quantized on load) and the tensor-parallel shards (a slice on load)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class CheckpointSlot(NamedTuple):
    """A checkpoint tensor that a module stores in its own form (quantized, say): ``load`` converts
    the incoming tensor and writes it in place. Modules opt in with a ``checkpoint_slots()`` method
    returning ``{local name: CheckpointSlot | tensor}``, which then stands for all their state."""

    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]


LoadTarget = torch.Tensor | CheckpointSlot


def store(target: LoadTarget, tensor: torch.Tensor) -> None:
    """Write a checkpoint tensor into its target: an in-place cast copy, or the slot's own loader."""
    if isinstance(target, CheckpointSlot):
        target.load(tensor)
    else:
        target.copy_(tensor)
