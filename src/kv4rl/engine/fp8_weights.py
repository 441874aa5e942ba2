"""FP8 rollout weights (docs/kv-cache.md): the decoder blocks' linears become :class:`FP8Linear` modules.

Applied once after the checkpoint is loaded. Each block linear (q/k/v/o, gate/up/down) is replaced
by e4m3 codes with one float32 scale per output channel, and the full-precision weight is dropped;
weight refreshes go through the decoder's HF-name loader, which the FP8 modules answer by
quantizing on copy. Embeddings, norms and the LM head stay in the compute dtype. On Hopper the
products run as scaled FP8 matrix products, elsewhere on dequantized weights (same maths).
"""

from __future__ import annotations

import torch
from torch import nn

from kv4rl.engine.fp8_linear import SCALED_MM_PATH, FP8Linear, describe_fp8_paths


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The plain linear layers inside the decoder blocks (attention and MLP projections)."""
    return {name: m for name, m in model.model.layers.named_modules() if type(m) is nn.Linear}


@torch.no_grad()
def apply_fp8_weights(model: nn.Module) -> int:
    """Swap every block linear for an :class:`FP8Linear` quantized from it; returns the count."""
    linears = block_linears(model)
    for name, linear in linears.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.model.layers.get_submodule(parent_name)
        setattr(parent, attr, FP8Linear.from_linear(linear))
    return len(linears)


def set_fused_quant(model: nn.Module, enabled: bool = True, decode_gemm: bool = False,
                    fp8_inputs: bool = True) -> int:
    """Quantize the FP8 linears' activations with the Triton kernel (``engine.fused_ops``) or with
    torch ops, and multiply them at decode sizes with the Triton e4m3 GEMM (`decode_gemm`,
    ``engine.fp8_gemm``) or ``scaled_mm``; returns how many linears there are. With fused ops on the
    model and `fp8_inputs`, the norms and SwiGLU before the linears quantize their outputs themselves
    (`kv4rl.models.fused.enable_fp8_inputs`: the same codes, fewer launches)."""
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for m in linears:
        m.fused_quant = enabled
        m.enable_decode_gemm(decode_gemm)
    if getattr(model, "fused_ops", False):
        from kv4rl.models.fused import enable_fp8_inputs

        enable_fp8_inputs(model, enabled and fp8_inputs)
    return len(linears)


def fp8_path(model: nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """Which product the FP8 linears use for activations of ``dtype`` on ``device``, for logs."""
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    paths = [m.path(dtype, device) for m in linears]
    return describe_fp8_paths(paths.count(SCALED_MM_PATH), len(paths), any(m.decode_gemm for m in linears))
