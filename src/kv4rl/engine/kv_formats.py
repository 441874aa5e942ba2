"""KV-cache storage formats behind one registry.

A format owns the layout of one layer's cache (a dict of tensors indexed by cache slot), how new
keys/values are written into it, and how a sequence's context is read back for the reference
attention. Quantized formats plug in here with the same four methods.
"""

from __future__ import annotations

from typing import Callable

import torch

from kv4rl.engine.attention import AttnMetadata

KV_FORMATS: dict[str, Callable[..., "KVFormat"]] = {}


def register_kv_format(name: str):
    def wrap(factory):
        KV_FORMATS[name] = factory
        return factory

    return wrap


def get_kv_format(name: str, **kwargs) -> "KVFormat":
    if name not in KV_FORMATS:
        raise ValueError(f"engine.kv.format: unknown KV format '{name}' (known: {', '.join(sorted(KV_FORMATS))})")
    return KV_FORMATS[name](**kwargs)


class KVFormat:
    """Base class: a plain cache stored in `storage_dtype`."""

    name = "base"
    storage_dtype: torch.dtype

    def allocate(self, num_slots: int, num_kv_heads: int, head_dim: int, device) -> dict[str, torch.Tensor]:
        shape = (num_slots, num_kv_heads, head_dim)
        return {
            "k": torch.zeros(shape, dtype=self.storage_dtype, device=device),
            "v": torch.zeros(shape, dtype=self.storage_dtype, device=device),
        }

    def write(self, cache: dict, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        cache["k"][meta.slot_mapping] = k.to(self.storage_dtype)
        cache["v"][meta.slot_mapping] = v.to(self.storage_dtype)

    def gather(self, cache: dict, meta: AttnMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        slots = meta.context_slots()
        return cache["k"][slots].to(dtype), cache["v"][slots].to(dtype)

    def prepare_query(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def finish_output(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        """Storage per token per layer, K and V, scales included."""
        return 2 * num_kv_heads * head_dim * torch.finfo(self.storage_dtype).bits / 8


@register_kv_format("bf16")
class BF16Format(KVFormat):
    name = "bf16"
    storage_dtype = torch.bfloat16


@register_kv_format("fp32")
class FP32Format(KVFormat):
    """Exact cache for CPU runs and tests."""

    name = "fp32"
    storage_dtype = torch.float32
