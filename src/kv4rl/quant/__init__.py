"""Pure-torch KV-cache quantization: the reference path that GPU kernels are tested against.

Every format turns ``x [..., D]`` (float32/bf16, any leading shape, any device) into separate code and
scale tensors, so a paged cache can keep each in its own buffer. :func:`storage_bytes` gives the cost
of one of K or V per token per KV head, scales included; the float32 per-tensor scale of NVFP4 is
shared by the whole cache and counted as zero.

Every quantizer computes its codes from the scale it stores, so a round trip is self-consistent. Scales
are float32 arithmetic that may differ by an ulp between devices (CUDA divides by constants through a
reciprocal), so a kernel compared with this path should accept the neighbouring code where a value
sits within float32 rounding of a rounding midpoint.
"""

from kv4rl.quant.fp4 import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    decode_e2m1,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e8m0_to_float,
    encode_e2m1,
    mxfp4_row_bytes,
    nvfp4_row_bytes,
    nvfp4_tensor_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)
from kv4rl.quant.fp8 import dequantize_fp8, fp8_row_bytes, quantize_fp8
from kv4rl.quant.hadamard import hadamard_matrix, rotate
from kv4rl.quant.int4 import dequantize_int4, int4_row_bytes, pack_nibbles, quantize_int4, unpack_nibbles
from kv4rl.quant.int8 import dequantize_int8, int8_row_bytes, quantize_int8

# bytes of one token and head for one of K or V, by name (each quantizer module owns its formula)
ROW_BYTES = {
    "bf16": lambda head_dim, group_size: 2.0 * head_dim,
    "fp32": lambda head_dim, group_size: 4.0 * head_dim,
    "fp8": lambda head_dim, group_size: fp8_row_bytes(head_dim),
    "int8": lambda head_dim, group_size: int8_row_bytes(head_dim),
    "int4": int4_row_bytes,
    "nvfp4": lambda head_dim, group_size: nvfp4_row_bytes(head_dim),
    "mxfp4": lambda head_dim, group_size: mxfp4_row_bytes(head_dim),
}
KV_FORMATS = tuple(ROW_BYTES)


def storage_bytes(format_name: str, head_dim: int, group_size: int = 128) -> float:
    """Bytes per token per KV head for one of K or V, including per-token scales and zero points.

    ``group_size`` only matters for ``int4`` (one fp16 scale and one fp16 zero per group).
    """
    if format_name not in KV_FORMATS:
        raise ValueError(f"unknown KV format {format_name!r}; expected one of {KV_FORMATS}")
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    per_format_block = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK, "int4": group_size}
    block = per_format_block.get(format_name)
    if block is not None and (block <= 0 or head_dim % block != 0):
        raise ValueError(f"{format_name}: group_size/block {block} must divide head_dim={head_dim}")
    if format_name in ("int4", "nvfp4", "mxfp4") and head_dim % 2 != 0:
        raise ValueError(
            f"{format_name} packs two values per byte and needs an even head_dim, got {head_dim}"
        )
    return ROW_BYTES[format_name](head_dim, group_size)


__all__ = [
    "KV_FORMATS",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "decode_e2m1",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int8",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e8m0_to_float",
    "encode_e2m1",
    "fp8_row_bytes",
    "hadamard_matrix",
    "int4_row_bytes",
    "int8_row_bytes",
    "mxfp4_row_bytes",
    "nvfp4_row_bytes",
    "nvfp4_tensor_scale",
    "pack_nibbles",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "rotate",
    "storage_bytes",
    "unpack_nibbles",
]
