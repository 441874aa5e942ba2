"""Symmetric INT8 KV quantization with one scale per (token, head): the protected-position format.

The scale is stored in **float32**, not fp16: heads with small values (e.g. |v| ~ 1e-3 gives
``amax/127 ~ 8e-6``) would fall into fp16's subnormal range and lose precision, and the two extra
bytes only apply to the few protected positions. ``scale = amax / 127`` (float32; on CUDA torch
divides by a constant as ``amax · (1/127)``, which can differ by one ulp) and
``code = clamp(round(x / scale), -127, 127)`` (ties to even), so ``|x - x̂| <= scale/2`` up to float32
rounding. An all-zero row has ``scale == 0`` and codes 0.
"""

import torch

INT8_MAX_CODE = 127


def int8_row_bytes(head_dim: int) -> float:
    """Bytes of one token and head: a code per channel and one float32 scale."""
    return head_dim + 4.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` -> ``codes [..., D] int8``, ``scale [...] float32``."""
    values = x.float()
    scale = values.abs().amax(dim=-1) / INT8_MAX_CODE
    scale_col = scale.unsqueeze(-1)
    safe_scale = torch.where(scale_col > 0, scale_col, torch.ones_like(scale_col))
    codes = torch.round(values / safe_scale).clamp(-INT8_MAX_CODE, INT8_MAX_CODE)
    return codes.to(torch.int8), scale


def dequantize_int8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``x̂ = scale · code`` (float32 arithmetic, then ``dtype``)."""
    if codes.dtype != torch.int8:
        raise ValueError(f"INT8 codes must be int8, got {codes.dtype}")
    if scale.shape != codes.shape[:-1]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match codes {tuple(codes.shape)}")
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)
