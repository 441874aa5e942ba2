"""Where and in what precision the engine (and the learner beside it) runs: `device` and `model.dtype`."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when present, else the CPU. Plain `cuda` under torchrun is this process's GPU
    (`LOCAL_RANK`), so every rank of a job says the same `device: cuda`."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        name = "cuda"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available")
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"model.dtype: unknown dtype '{name}' (known: auto, {', '.join(table)})")
    return table[name]
