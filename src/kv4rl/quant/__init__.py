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
    nvfp4_tensor_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)
from kv4rl.quant.fp8 import dequantize_fp8, quantize_fp8
from kv4rl.quant.hadamard import hadamard_matrix, rotate
from kv4rl.quant.int4 import dequantize_int4, pack_nibbles, quantize_int4, unpack_nibbles
from kv4rl.quant.int8 import dequantize_int8, quantize_int8

KV_FORMATS = ("bf16", "fp32", "fp8", "int8", "int4", "nvfp4", "mxfp4")


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
    match format_name:
        case "bf16":
            return 2.0 * head_dim
        case "fp32":
            return 4.0 * head_dim
        case "fp8" | "int8":
            return head_dim + 4.0  # one float32 scale per token and head
        case "int4":
            return head_dim / 2 + 4.0 * (head_dim // group_size)  # fp16 scale + fp16 zero per group
        case "nvfp4":
            return head_dim / 2 + 1.0 * (head_dim // NVFP4_BLOCK)  # one e4m3 scale per 16 values
        case "mxfp4":
            return head_dim / 2 + 1.0 * (head_dim // MXFP4_BLOCK)  # one e8m0 exponent per 32 values
    raise AssertionError(f"unhandled KV format {format_name}")


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
    "hadamard_matrix",
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
