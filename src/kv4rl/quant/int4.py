"""Affine INT4 KV quantization with one fp16 (scale, zero) pair per group of channels.

This is the reference ("truth") implementation a fused GPU writer/reader is checked against, so every
rounding step is pinned down:

* Statistics are taken in float32: ``scale = fp16((max - min) / 15)`` and ``zero = fp16(min)``
  (float32 arithmetic, then round-to-nearest-even into fp16).
* Codes are computed **from the stored fp16 scale and zero**, ``code = clamp(round((x - zero) / scale),
  0, 15)`` (float32 division, ties to even), so each code is the nearest point of the grid that
  dequantization actually uses. Per element ``|x - x̂| <= scale/2`` plus the fp16 rounding of ``zero``
  and ``15·scale`` at the two clamped ends.
* A constant group has ``scale == 0``: every code is 0 and the group dequantizes to ``zero`` exactly
  (the input value itself whenever it is fp16-representable, which holds for every bf16 value in
  fp16's normal range). Inputs must lie inside fp16's range (|x| < 65504), as post-norm keys do.
* Nibble order: channel ``2j`` goes in the low nibble of byte ``j`` and channel ``2j+1`` in the high
  nibble.
"""

import torch

INT4_MAX_CODE = 15


def _check_group_size(head_dim: int, group_size: int) -> None:
    if group_size <= 0 or head_dim % group_size != 0:
        raise ValueError(f"group_size={group_size} must be a positive divisor of head_dim={head_dim}")


def int4_row_bytes(head_dim: int, group_size: int) -> float:
    """Bytes of one token and head: two codes per byte, an fp16 scale and an fp16 zero per group."""
    _check_group_size(head_dim, group_size)
    return head_dim / 2 + 4.0 * (head_dim // group_size)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., D]`` (values 0..15, D even) into bytes ``[..., D//2]`` (even channel low)."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"cannot pack an odd number of 4-bit codes along the last dim ({codes.shape[-1]})")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: bytes ``[..., D//2]`` -> uint8 codes ``[..., D]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed 4-bit codes must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def quantize_int4(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` to packed INT4.

    Returns ``codes [..., D//2] uint8``, ``scale [..., D//g] float16``, ``zero [..., D//g] float16``.
    """
    head_dim = x.shape[-1]
    _check_group_size(head_dim, group_size)
    groups = x.float().unflatten(-1, (head_dim // group_size, group_size))
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    scale = ((hi - lo) / INT4_MAX_CODE).to(torch.float16)
    zero = lo.to(torch.float16)
    scale32 = scale.float().unsqueeze(-1)
    safe_scale = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    levels = torch.round((groups - zero.float().unsqueeze(-1)) / safe_scale)
    levels = torch.where(scale32 > 0, levels.clamp(0, INT4_MAX_CODE), torch.zeros_like(levels))
    return pack_nibbles(levels.flatten(-2)), scale, zero


def dequantize_int4(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int = 128,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: ``x̂ = zero + scale · code`` (float32 arithmetic, then ``dtype``)."""
    head_dim = 2 * codes.shape[-1]
    _check_group_size(head_dim, group_size)
    if scale.shape[-1] != head_dim // group_size or zero.shape != scale.shape:
        raise ValueError(
            f"scale/zero shapes {tuple(scale.shape)}/{tuple(zero.shape)} do not match "
            f"head_dim={head_dim} with group_size={group_size}"
        )
    levels = unpack_nibbles(codes).float().unflatten(-1, (head_dim // group_size, group_size))
    values = zero.float().unsqueeze(-1) + scale.float().unsqueeze(-1) * levels
    return values.flatten(-2).to(dtype)
