"""The KV-format registry, the base class, and the plain (unquantized) formats.

A format owns one layer's cache: a dict of tensors indexed by cache slot (block * block_size +
offset). Each quantity lives in its own tensor (4-bit codes packed two per byte, scales, zero points),
so a GPU kernel can later read the paged codes and their scales directly. A format implements three
hooks for one of K or V (`allocate_part`, `store`, `load`) and its byte cost (`part_bytes`); the base
class adds the Hadamard rotation and the write/read calls the reference attention makes. A format with
GPU decode kernels names their kind (`decode_kind`) and hands them its tensors (`paged_tensors`,
`side_tensors`), so the fast path never dispatches on format names. KV4, which keeps per-sequence state, also
overrides `append_and_read`. `copy_slots` and `copy_seq_state` serve prefix sharing: a request forked
from another with the same prompt gets copies of a partly shared block and of the per-sequence state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kv4rl.engine.attention import AttnMetadata
from kv4rl.kernels.decode_common import DecodeKind
from kv4rl.quant import rotate as hadamard_rotate

KV_FORMATS: dict[str, Callable[..., KVFormat]] = {}
ROTATIONS = ("none", "k", "kv")
DEFAULT_BYTES_CONTEXT = 8192  # context at which per-sequence reserves are spread over tokens


def register_kv_format(name: str):
    def wrap(factory):
        KV_FORMATS[name] = factory
        return factory

    return wrap


def get_kv_format(name: str, **options) -> KVFormat:
    if name not in KV_FORMATS:
        raise ValueError(
            f"engine.kv.format: unknown KV format '{name}' (known: {', '.join(sorted(KV_FORMATS))})"
        )
    return KV_FORMATS[name](**options)


class KVFormat:
    """Base class. `options` names the `engine.kv` keys (besides `rotate`) the format is built with."""

    name = "base"
    options: tuple[str, ...] = ()
    default_rotate = "none"
    per_sequence_keys: tuple[str, ...] = ()  # cache tensors indexed by running slot, not by cache slot
    decode_kind: DecodeKind | None = None  # the GPU decode kernels' kind for its pages; None: reference only
    has_side_rows = False  # per-sequence rows the kernels read besides the pages (KV4's INT8 copies)
    # Set by a tensor-parallel engine: each rank stores some KV heads, so a statistic over all heads
    # (NVFP4's per-tensor scale) must be reduced over the ranks to equal the unsharded engine's.
    tensor_parallel = None

    def __init__(self, *, rotate: str = "auto"):
        rotate = self.default_rotate if rotate == "auto" else rotate
        if rotate not in ROTATIONS:
            raise ValueError(
                f"engine.kv.rotate: unknown rotation '{rotate}' (known: auto, {', '.join(ROTATIONS)})"
            )
        self.rotate = rotate

    def check(self, head_dim: int | None, max_model_len: int | None) -> None:
        """Raise ValueError naming the `engine.kv` key that cannot work with this model.

        None means not known yet (the config is checked before the model is loaded)."""
        if head_dim is not None and self.rotate != "none" and (head_dim < 1 or head_dim & (head_dim - 1)):
            raise ValueError(
                f"engine.kv.rotate={self.rotate}: the Hadamard rotation needs a power-of-two head_dim, "
                f"got {head_dim}; use engine.kv.rotate=none"
            )

    # ---- one of K or V (the hooks a format implements) ---------------------------------------
    def allocate_part(self, prefix: str, num_slots: int, num_kv_heads: int, head_dim: int, device) -> dict:
        raise NotImplementedError

    def store(self, cache: dict, prefix: str, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x[N, Hkv, D] into the cache at slots[N]."""
        raise NotImplementedError

    def load(self, cache: dict, prefix: str, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantize the cache at slots[...] -> [..., Hkv, D] in `dtype`."""
        raise NotImplementedError

    def part_bytes(self, head_dim: int) -> float:
        """Bytes per token per KV head for one of K or V, scales included."""
        raise NotImplementedError

    # ---- the GPU decode kernels -----------------------------------------------------------------
    def fast_path_problem(self, head_dim: int) -> str | None:
        """Why the decode kernels cannot serve this format at `head_dim`, or None when they can."""
        if self.decode_kind is None:
            with_kernels = sorted(name for name, f in KV_FORMATS.items() if getattr(f, "decode_kind", None) is not None)
            return f"no decode kernel for KV format '{self.name}' (kernels: {', '.join(with_kernels)})"
        return None

    def paged_tensors(self, cache: dict, prefix: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(codes or values, scale, zero point) of K or V as the decode kernels take them."""
        return cache[f"{prefix}_codes"], cache[f"{prefix}_scale"], cache.get(f"{prefix}_zero")

    def side_tensors(self, cache: dict) -> dict | None:
        """The per-sequence rows the kernels read besides the pages (see `has_side_rows`)."""
        return None

    # ---- one layer ----------------------------------------------------------------------------
    def allocate(
        self, num_slots: int, num_kv_heads: int, head_dim: int, device, num_seq_slots: int = 1
    ) -> dict[str, torch.Tensor]:
        """Zeroed cache tensors; `num_seq_slots` (running sequences) sizes per-sequence state."""
        shape = (num_slots, num_kv_heads, head_dim, device)
        return {**self.allocate_part("k", *shape), **self.allocate_part("v", *shape)}

    def calibration(self, cache: dict) -> dict[str, torch.Tensor]:
        """The tensors of one layer's cache that are calibrated once and kept for the engine's life, not
        per token (none for most formats): the engine carries them over when it frees and re-allocates
        the pool (`sleep` / `wake`), so sampling after a wake matches an engine that never slept."""
        return {}

    def copy_slots(self, cache: dict, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy-on-write of a shared block: every slot-indexed tensor's entries `src` -> `dst`."""
        for key, tensor in cache.items():
            if tensor.dim() and key not in self.per_sequence_keys:
                tensor[dst_slots] = tensor[src_slots]

    def copy_seq_state(self, cache: dict, src_seq_slots: torch.Tensor, dst_seq_slots: torch.Tensor) -> None:
        """A forked sequence inherits its parent's per-sequence state (plain pages have none)."""

    def rotate_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotate != "none":
            k = hadamard_rotate(k)
        if self.rotate == "kv":
            v = hadamard_rotate(v)
        return k, v

    def write(self, cache: dict, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize-on-append: the step's new k/v[N, Hkv, D] go to `meta.slot_mapping`."""
        k, v = self.rotate_kv(k, v)
        self.store(cache, "k", meta.slot_mapping, k)
        self.store(cache, "v", meta.slot_mapping, v)

    def gather(
        self, cache: dict, meta: AttnMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's dequantized (rotated) context: K, V [B, Lmax, Hkv, D]."""
        slots = meta.context_slots()
        return self.load(cache, "k", slots, dtype), self.load(cache, "v", slots, dtype)

    def append_and_read(
        self, cache: dict, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the new tokens, return (keys, values, mask) for the step's attention."""
        self.write(cache, meta, k, v)
        keys, values = self.gather(cache, meta, dtype)
        return keys, values, meta.mask

    def prepare_query(self, q: torch.Tensor) -> torch.Tensor:
        """Rotate queries like the keys, so q·k is unchanged."""
        return hadamard_rotate(q) if self.rotate != "none" else q

    def finish_output(self, out: torch.Tensor) -> torch.Tensor:
        """Undo the value rotation (H is its own inverse)."""
        return hadamard_rotate(out) if self.rotate == "kv" else out

    def bytes_per_token(
        self, num_kv_heads: int, head_dim: int, context_len: int = DEFAULT_BYTES_CONTEXT
    ) -> float:
        """Storage per token per layer, K and V, scales included.

        `context_len` only matters for formats with a fixed per-sequence reserve (KV4's protected
        copies), which is spread over a context of that length.
        """
        return 2 * num_kv_heads * self.part_bytes(head_dim)

    def bytes_read(self, num_kv_heads: int, head_dim: int, context_len: int) -> float:
        """K and V bytes per layer a decode step reads for one sequence of `context_len` tokens, scales
        included: a byte roofline's KV term (storage spread over a context, `bytes_per_token`, is not)."""
        return context_len * 2 * num_kv_heads * self.part_bytes(head_dim)


class PlainFormat(KVFormat):
    """Keys and values stored as they are, in `storage_dtype`."""

    storage_dtype: torch.dtype

    def allocate_part(self, prefix, num_slots, num_kv_heads, head_dim, device):
        shape = (num_slots, num_kv_heads, head_dim)
        return {prefix: torch.zeros(shape, dtype=self.storage_dtype, device=device)}

    def part_bytes(self, head_dim):
        return float(self.storage_dtype.itemsize * head_dim)

    def paged_tensors(self, cache, prefix):
        return cache[prefix], None, None

    def store(self, cache, prefix, slots, x):
        cache[prefix][slots] = x.to(self.storage_dtype)

    def load(self, cache, prefix, slots, dtype):
        return cache[prefix][slots].to(dtype)


@register_kv_format("bf16")
class BF16Format(PlainFormat):
    name = "bf16"
    storage_dtype = torch.bfloat16
    decode_kind = DecodeKind.BF16


@register_kv_format("fp32")
class FP32Format(PlainFormat):
    """Exact cache for CPU runs and tests."""

    name = "fp32"
    storage_dtype = torch.float32
