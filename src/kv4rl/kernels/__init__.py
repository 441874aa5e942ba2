"""Triton kernels of the GPU fast path: fused quantize-on-write, split-KV paged decode attention, the
fused sampler, the decoder's fused elementwise ops and FP8 linears' per-token input quantization.

Each kernel computes what the torch reference path (`kv4rl.engine.attention`, `kv4rl.engine.kv_formats`,
`kv4rl.engine.sampler`, `kv4rl.models.layers`, `kv4rl.quant.fp8`) computes and is tested against it. They run on CUDA, and on the CPU under `TRITON_INTERPRET=1` (how CI
checks their indexing on small shapes); the engine uses them only on CUDA and falls back to the
reference path elsewhere.
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no kernels
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (its index, or the current device's): launch grids size themselves
    to it."""
    import torch

    device = torch.device(device)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def kernels_usable(device) -> bool:
    """The fast path needs Triton and a CUDA device (or the interpreter, which runs on CPU tensors)."""
    import torch

    device = torch.device(device)
    if not triton_importable():
        return False
    return device.type == "cuda" or interpreting()

