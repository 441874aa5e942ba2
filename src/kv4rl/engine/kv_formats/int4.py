"""INT4 cache, affine per (token, KV head, group of `group_size` channels).

Codes are packed two per byte in their own paged tensor [slots, Hkv, D/2]; the fp16 scale and zero
point of each group sit in [slots, Hkv, D/g] tensors. Without rotation and protection this is the
naive 4-bit baseline; KV4 reuses it for its history pages.
"""

from __future__ import annotations

import torch

from kv4rl.engine.kv_formats.base import KVFormat, register_kv_format
from kv4rl.kernels.decode_common import DecodeKind
from kv4rl.quant import dequantize_int4, int4_row_bytes, quantize_int4

GROUP_SIZES = (32, 64, 128)


def check_group_size(group_size: int, head_dim: int | None = None) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"engine.kv.group_size must be one of {GROUP_SIZES}, got {group_size}")
    if head_dim is not None and head_dim % group_size:
        fits = [g for g in GROUP_SIZES if head_dim % g == 0]
        hint = (f"set engine.kv.group_size to {' or '.join(map(str, fits))}"
                + (f" ({head_dim} = head_dim lets the INT4 decode kernels run)" if head_dim in fits else "")
                if fits else "no INT4 group size fits it; use another engine.kv.format")
        raise ValueError(f"engine.kv.group_size={group_size} does not divide the model's head_dim={head_dim}: "
                         f"{hint}")


@register_kv_format("int4")
class INT4Format(KVFormat):
    name = "int4"
    options = ("group_size",)
    decode_kind = DecodeKind.INT4

    def __init__(self, *, group_size: int = 128, rotate: str = "auto"):
        super().__init__(rotate=rotate)
        check_group_size(group_size)
        self.group_size = group_size

    def check(self, head_dim, max_model_len):
        check_group_size(self.group_size, head_dim)
        super().check(head_dim, max_model_len)

    def allocate_part(self, prefix, num_slots, num_kv_heads, head_dim, device):
        groups = head_dim // self.group_size
        to = {"device": device}
        return {
            f"{prefix}_codes": torch.zeros(num_slots, num_kv_heads, head_dim // 2, dtype=torch.uint8, **to),
            f"{prefix}_scale": torch.zeros(num_slots, num_kv_heads, groups, dtype=torch.float16, **to),
            f"{prefix}_zero": torch.zeros(num_slots, num_kv_heads, groups, dtype=torch.float16, **to),
        }

    def store(self, cache, prefix, slots, x):
        codes, scale, zero = quantize_int4(x, self.group_size)
        cache[f"{prefix}_codes"][slots] = codes
        cache[f"{prefix}_scale"][slots] = scale
        cache[f"{prefix}_zero"][slots] = zero

    def load(self, cache, prefix, slots, dtype):
        return dequantize_int4(
            cache[f"{prefix}_codes"][slots], cache[f"{prefix}_scale"][slots], cache[f"{prefix}_zero"][slots],
            self.group_size, dtype,
        )

    def part_bytes(self, head_dim):
        return int4_row_bytes(head_dim, self.group_size)

    def fast_path_problem(self, head_dim):
        if head_dim not in GROUP_SIZES:
            return (f"the INT4 kernels keep one scale per token and head (group_size = head_dim), and group sizes "
                    f"stop at {max(GROUP_SIZES)}: head_dim={head_dim} has no INT4 decode kernel")
        if self.group_size != head_dim:
            return (f"the INT4 kernels keep one scale per token and head: engine.kv.group_size must equal "
                    f"head_dim={head_dim}, got {self.group_size}")
        return super().fast_path_problem(head_dim)
