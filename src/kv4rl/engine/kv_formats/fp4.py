"""FP4 (e2m1) caches, emulated in software: NVFP4 and MXFP4.

Both pack two e2m1 codes per byte [slots, Hkv, D/2]. MXFP4 keeps one e8m0 exponent (uint8) per 32
values. NVFP4 keeps one e4m3 scale per 16 values and a float32 scale per layer and K/V. A cache grows
token by token, so that per-tensor scale is calibrated once, on the first write into the layer holding a
non-zero value (normally the first prefill), as `amax / (6 * 448)` times `NVFP4_HEADROOM`, and then kept for the engine's life
(across weight updates, and across `sleep` / `wake`, which re-allocate the pool). The headroom lets later blocks up to 8x larger than anything in the
calibration prefill through without saturating; it costs no precision, because the e4m3 block
scale keeps 3 mantissa bits over its whole normal range and that range still reaches blocks ~3500x
smaller than the calibration maximum.
"""

from __future__ import annotations

import torch

from kv4rl.engine.kv_formats.base import KVFormat, register_kv_format
from kv4rl.quant import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    dequantize_mxfp4,
    dequantize_nvfp4,
    mxfp4_row_bytes,
    nvfp4_row_bytes,
    nvfp4_tensor_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)

NVFP4_HEADROOM = 8.0


def _check_block(name: str, block: int, head_dim: int | None) -> None:
    if head_dim is not None and head_dim % block:
        raise ValueError(
            f"engine.kv.format={name} needs head_dim divisible by its block of {block} values, got {head_dim}"
        )


def _packed_codes(num_slots, num_kv_heads, head_dim, device) -> torch.Tensor:
    return torch.zeros(num_slots, num_kv_heads, head_dim // 2, dtype=torch.uint8, device=device)


@register_kv_format("nvfp4")
class NVFP4Format(KVFormat):
    name = "nvfp4"

    def check(self, head_dim, max_model_len):
        _check_block(self.name, NVFP4_BLOCK, head_dim)
        super().check(head_dim, max_model_len)

    def part_bytes(self, head_dim):
        return nvfp4_row_bytes(head_dim)

    def allocate_part(self, prefix, num_slots, num_kv_heads, head_dim, device):
        return {
            f"{prefix}_codes": _packed_codes(num_slots, num_kv_heads, head_dim, device),
            f"{prefix}_scale": torch.zeros(
                num_slots, num_kv_heads, head_dim // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=device
            ),
            # 0 until calibrated by the first write
            f"{prefix}_tensor_scale": torch.zeros((), dtype=torch.float32, device=device),
        }

    def calibration(self, cache):
        return {key: cache[key].clone() for key in ("k_tensor_scale", "v_tensor_scale")}

    def tensor_scale(self, cache: dict, prefix: str, x: torch.Tensor | None = None) -> float:
        """The layer's per-tensor scale for K or V, calibrated from `x` on first use. A write of zeros
        calibrates nothing (it stores zeros at any scale): the first write holding a non-zero value does.
        Fixed at the all-zero fallback, later blocks up to ~0.05 were stored as zeros."""
        stored = cache[f"{prefix}_tensor_scale"]
        if x is not None and float(stored) == 0.0:
            if self.tensor_parallel is not None:  # the amax over every rank's KV heads
                import torch.distributed as dist

                x = x.detach().abs().amax().float().reshape(1)
                dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.tensor_parallel.group)
            if bool((x != 0).any()):
                stored.fill_(nvfp4_tensor_scale(x) * NVFP4_HEADROOM)
            else:
                return 1.0
        return float(stored)

    def store(self, cache, prefix, slots, x):
        codes, scale = quantize_nvfp4(x, self.tensor_scale(cache, prefix, x))
        cache[f"{prefix}_codes"][slots] = codes
        cache[f"{prefix}_scale"][slots] = scale

    def load(self, cache, prefix, slots, dtype):
        tensor_scale = float(cache[f"{prefix}_tensor_scale"])
        if tensor_scale == 0.0:  # nothing written yet: every slot still holds zeros
            tensor_scale = 1.0
        codes, block_scale = cache[f"{prefix}_codes"][slots], cache[f"{prefix}_scale"][slots]
        return dequantize_nvfp4(codes, block_scale, tensor_scale, dtype)


@register_kv_format("mxfp4")
class MXFP4Format(KVFormat):
    name = "mxfp4"

    def check(self, head_dim, max_model_len):
        _check_block(self.name, MXFP4_BLOCK, head_dim)
        super().check(head_dim, max_model_len)

    def part_bytes(self, head_dim):
        return mxfp4_row_bytes(head_dim)

    def allocate_part(self, prefix, num_slots, num_kv_heads, head_dim, device):
        return {
            f"{prefix}_codes": _packed_codes(num_slots, num_kv_heads, head_dim, device),
            f"{prefix}_scale": torch.zeros(
                num_slots, num_kv_heads, head_dim // MXFP4_BLOCK, dtype=torch.uint8, device=device
            ),
        }

    def store(self, cache, prefix, slots, x):
        codes, exponent = quantize_mxfp4(x)
        cache[f"{prefix}_codes"][slots] = codes
        cache[f"{prefix}_scale"][slots] = exponent

    def load(self, cache, prefix, slots, dtype):
        return dequantize_mxfp4(cache[f"{prefix}_codes"][slots], cache[f"{prefix}_scale"][slots], dtype)
