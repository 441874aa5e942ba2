"""Software-emulated FP4 (e2m1) KV formats: NVFP4 and MXFP4.

Hopper has no FP4 arithmetic, so these are storage formats: values are encoded here in plain torch
and decoded back to float32 for attention. Both share the e2m1 element:

* 4-bit code = ``sign << 3 | magnitude index``; the index selects from ``{0, .5, 1, 1.5, 2, 3, 4, 6}``
  (this is the e2m1 bit pattern itself). Encoding rounds to nearest with ties to the even index (the
  IEEE rule hardware converters use, e.g. 0.25 -> 0, 0.75 -> 1, 5 -> 4) and clamps magnitudes above
  6 to 6. Codes are packed two per byte, even channel in the low nibble (as for INT4).

**NVFP4**: blocks of 16 channels, each with an e4m3 block scale ``e4m3(block_amax / (6 · tensor_scale))``
(clamped to 448), and one float32 ``tensor_scale``; ``x̂ = e2m1 · block_scale · tensor_scale``. A cache
grows token by token, so the tensor scale cannot be taken from data not yet seen: callers pass it in
(typically calibrated once per layer and K/V on a prefill with :func:`nvfp4_tensor_scale`, which gives
``amax / (6 · 448)``) and keep it as a float next to the cache. Blocks larger than the calibration
saturate at ``6 · 448 · tensor_scale``; blocks whose ratio underflows e4m3 (<= 2^-10) store zeros.

**MXFP4**: blocks of 32 channels with a power-of-two (e8m0) scale ``2^(floor(log2 block_amax) - 2)``,
stored as its biased exponent in a uint8 (bias 127, clamped to [0, 254]; an all-zero block stores 0).
Scaled magnitudes then lie in [4, 8), and the part above 6 clamps (the OCP MX rule). Scaling by a power
of two is exact, so the round trip depends only on the e2m1 rounding.
"""

import torch

from kv4rl.quant.fp8 import FP8_E4M3_MAX
from kv4rl.quant.int4 import pack_nibbles, unpack_nibbles

E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check_block(head_dim: int, block: int, format_name: str) -> None:
    if head_dim % block != 0:
        raise ValueError(f"{format_name} needs head_dim divisible by its block size {block}, got {head_dim}")


def nvfp4_row_bytes(head_dim: int) -> float:
    """Bytes of one token and head: two codes per byte and one e4m3 scale per 16 values (the layer's
    float32 scale is shared by the whole cache and counted as zero)."""
    _check_block(head_dim, NVFP4_BLOCK, "nvfp4")
    return head_dim / 2 + 1.0 * (head_dim // NVFP4_BLOCK)


def mxfp4_row_bytes(head_dim: int) -> float:
    """Bytes of one token and head: two codes per byte and one e8m0 exponent per 32 values."""
    _check_block(head_dim, MXFP4_BLOCK, "mxfp4")
    return head_dim / 2 + 1.0 * (head_dim // MXFP4_BLOCK)


def encode_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to 4-bit e2m1 codes (uint8, unpacked)."""
    magnitude = scaled.float().abs()
    # Each comparison crosses one midpoint of the grid; `>` sends a tie down, `>=` up, so that ties
    # always land on the even magnitude index.
    index = (
        (magnitude > 0.25).to(torch.uint8)
        + (magnitude >= 0.75)
        + (magnitude > 1.25)
        + (magnitude >= 1.75)
        + (magnitude > 2.5)
        + (magnitude >= 3.5)
        + (magnitude > 5.0)
    )
    sign = (scaled < 0).to(torch.uint8) << 3
    return sign | index


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked 4-bit e2m1 codes -> float32 values."""
    magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    table = torch.cat((magnitudes, -magnitudes))
    return table[codes.long()]


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def _encode_blocks(blocks: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """Divide each block by its float32 scale (zero scale -> zero codes), encode and pack."""
    scale_col = block_scale.unsqueeze(-1)
    safe_scale = torch.where(scale_col > 0, scale_col, torch.ones_like(scale_col))
    scaled = torch.where(scale_col > 0, blocks / safe_scale, torch.zeros_like(blocks))
    return pack_nibbles(encode_e2m1(scaled).flatten(-2))


def _decode_blocks(codes: torch.Tensor, block_scale: torch.Tensor, block: int) -> torch.Tensor:
    values = decode_e2m1(unpack_nibbles(codes)).unflatten(-1, (-1, block))
    return (values * block_scale.unsqueeze(-1)).flatten(-2)


def nvfp4_tensor_scale(x: torch.Tensor) -> float:
    """Per-tensor NVFP4 scale ``amax(x) / (6 · 448)``, rounded to float32 (1.0 for an all-zero tensor)."""
    amax = x.detach().abs().amax().float().item()
    if not torch.isfinite(torch.tensor(amax)):
        raise ValueError(f"nvfp4_tensor_scale: tensor has a non-finite amax ({amax})")
    if amax == 0.0:
        return 1.0
    return torch.tensor(amax / (E2M1_MAX * FP8_E4M3_MAX), dtype=torch.float32).item()


def _tensor_scale_f32(tensor_scale: float, device: torch.device) -> torch.Tensor:
    if not (tensor_scale > 0.0 and tensor_scale < float("inf")):
        raise ValueError(f"tensor_scale must be a positive finite float, got {tensor_scale}")
    return torch.tensor(tensor_scale, dtype=torch.float32, device=device)


def quantize_nvfp4(x: torch.Tensor, tensor_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` -> ``codes [..., D//2] uint8``, ``block_scale [..., D//16] float8_e4m3fn``."""
    _check_block(x.shape[-1], NVFP4_BLOCK, "nvfp4")
    global_scale = _tensor_scale_f32(tensor_scale, x.device)
    blocks = _blocks(x, NVFP4_BLOCK)
    ratio = blocks.abs().amax(dim=-1) / (E2M1_MAX * global_scale)
    block_scale = ratio.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    codes = _encode_blocks(blocks, block_scale.float() * global_scale)
    return codes, block_scale


def dequantize_nvfp4(
    codes: torch.Tensor, block_scale: torch.Tensor, tensor_scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`: ``x̂ = e2m1 · (block_scale · tensor_scale)`` in float32."""
    _check_block(2 * codes.shape[-1], NVFP4_BLOCK, "nvfp4")
    if block_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"nvfp4 block_scale must be float8_e4m3fn, got {block_scale.dtype}")
    global_scale = _tensor_scale_f32(tensor_scale, codes.device)
    return _decode_blocks(codes, block_scale.float() * global_scale, NVFP4_BLOCK).to(dtype)


def e8m0_to_float(exponent: torch.Tensor) -> torch.Tensor:
    """Biased e8m0 exponents (uint8, 0..254) -> exact float32 powers of two ``2^(e - 127)``."""
    biased = exponent.to(torch.int32)
    # 2^-127 is below float32's normal range: build it as the subnormal with only mantissa bit 22 set.
    bits = torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22))
    return bits.view(torch.float32)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` -> ``codes [..., D//2] uint8``, ``scale_exponent [..., D//32] uint8``."""
    _check_block(x.shape[-1], MXFP4_BLOCK, "mxfp4")
    blocks = _blocks(x, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    floor_log2 = torch.frexp(amax).exponent - 1  # exact: amax = m · 2^e with m in [0.5, 1)
    biased = (floor_log2 - 2 + E8M0_BIAS).clamp(0, 2 * E8M0_BIAS)
    scale_exponent = torch.where(amax > 0, biased, torch.zeros_like(biased)).to(torch.uint8)
    codes = _encode_blocks(blocks, e8m0_to_float(scale_exponent))
    return codes, scale_exponent


def dequantize_mxfp4(
    codes: torch.Tensor, scale_exponent: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: ``x̂ = e2m1 · 2^(scale_exponent - 127)`` (exact in float32)."""
    _check_block(2 * codes.shape[-1], MXFP4_BLOCK, "mxfp4")
    if scale_exponent.dtype != torch.uint8:
        raise ValueError(f"mxfp4 scale_exponent must be uint8, got {scale_exponent.dtype}")
    return _decode_blocks(codes, e8m0_to_float(scale_exponent), MXFP4_BLOCK).to(dtype)
