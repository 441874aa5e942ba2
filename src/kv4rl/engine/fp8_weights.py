"""FP8 rollout weights (SPEC §7): e4m3 with one scale per output channel for the decoder's linears.

Applied as a transform after weights are loaded, and again at every weight refresh, so the model
file stays plain. This is the reference path: each linear's weight is replaced by its FP8-rounded
value (codes x scale) in the compute dtype, so every product sees exactly the FP8 weights the
behaviour policy uses. Embeddings, norms and the LM head stay in the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from kv4rl.quant.fp8 import dequantize_fp8, quantize_fp8


def fp8_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers inside the decoder blocks (attention and MLP projections)."""
    return {name: m for name, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def apply_fp8_weights(model: nn.Module) -> int:
    """Round every block linear's weight to e4m3 with a per-output-channel scale; returns the count."""
    linears = fp8_linears(model)
    for linear in linears.values():
        codes, scale = quantize_fp8(linear.weight.float())  # one scale per row = per output channel
        linear.weight.copy_(dequantize_fp8(codes, scale, torch.float32))
    return len(linears)
