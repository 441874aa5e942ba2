"""FP8 (e4m3) cache: codes [slots, Hkv, D] plus one float32 scale per token and head."""

from __future__ import annotations

import torch

from kv4rl.engine.kv_formats.base import KVFormat, register_kv_format
from kv4rl.kernels.decode_common import DecodeKind
from kv4rl.quant import dequantize_fp8, fp8_row_bytes, quantize_fp8


@register_kv_format("fp8")
class FP8Format(KVFormat):
    name = "fp8"
    decode_kind = DecodeKind.FP8

    def allocate_part(self, prefix, num_slots, num_kv_heads, head_dim, device):
        return {
            f"{prefix}_codes": torch.zeros(
                num_slots, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=device
            ),
            f"{prefix}_scale": torch.zeros(num_slots, num_kv_heads, dtype=torch.float32, device=device),
        }

    def store(self, cache, prefix, slots, x):
        codes, scale = quantize_fp8(x)
        cache[f"{prefix}_codes"][slots] = codes
        cache[f"{prefix}_scale"][slots] = scale

    def part_bytes(self, head_dim):
        return fp8_row_bytes(head_dim)

    def load(self, cache, prefix, slots, dtype):
        return dequantize_fp8(cache[f"{prefix}_codes"][slots], cache[f"{prefix}_scale"][slots], dtype)
