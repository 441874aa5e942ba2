"""FP8 (e4m3fn) KV quantization with one float32 scale per (token, head).

``scale = amax / 448`` maps each row's largest magnitude onto e4m3's largest finite value (float32;
on CUDA torch divides by a number as ``amax · fl(1/448)``, one ulp off the quotient in about half
the rows, so CPU and CUDA scales differ; ``kv4rl.kernels.fp8_quant`` follows the device's); the
scaled values are clamped to ±448 (so a float32 rounding step can never produce NaN, which e4m3fn
uses for overflow) and cast with round-to-nearest-even. Normal e4m3 values carry a relative error
of at most 2^-4; scaled magnitudes below 2^-6 are subnormal with absolute error at most
``2^-10 · scale``. An all-zero row has ``scale == 0`` and codes 0.
"""

from typing import NamedTuple

import torch

FP8_E4M3_MAX = 448.0


class QuantizedRows(NamedTuple):
    """Activations already quantized as :func:`quantize_fp8` does (codes [..., D], scale [...]), standing
    for rows of ``dtype``: what a fused norm or SwiGLU hands an FP8 linear instead of the rows themselves."""

    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def fp8_row_bytes(head_dim: int) -> float:
    """Bytes of one token and head: a code per channel and one float32 scale."""
    return head_dim + 4.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` -> ``codes [..., D] float8_e4m3fn``, ``scale [...] float32``."""
    values = x.float()
    scale = values.abs().amax(dim=-1) / FP8_E4M3_MAX
    scale_col = scale.unsqueeze(-1)
    safe_scale = torch.where(scale_col > 0, scale_col, torch.ones_like(scale_col))
    scaled = (values / safe_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn), scale


def dequantize_fp8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``x̂ = scale · code`` (float32 arithmetic, then ``dtype``)."""
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 codes must be float8_e4m3fn, got {codes.dtype}")
    if scale.shape != codes.shape[:-1]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match codes {tuple(codes.shape)}")
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)
