"""Where and in what precision the engine (and the learner beside it) runs: `device` and `model.dtype`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kv4rl.models.decoder import Decoder
    from kv4rl.models.tensor_parallel import TensorParallel


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


def place_model(model_dir, model: Decoder | None, device, dtype,
                tp: TensorParallel) -> tuple[Decoder, torch.device, torch.dtype]:
    """The engine's model with its device and dtype: loaded from `model_dir` (this rank's shard) or taken
    as it is placed."""
    if (model is None) == (model_dir is None):
        raise ValueError("Engine needs exactly one of a model folder and an in-memory model")
    if model is not None:  # it is already placed: its device and dtype are the engine's
        if (device, dtype) != ("auto", "auto"):
            raise ValueError("an in-memory model fixes the engine's device and dtype; leave them 'auto'")
        built = 1 if model.tp is None else model.tp.size
        if built != tp.size:
            raise ValueError(f"the in-memory model is sharded over {built} ranks, engine.tensor_parallel={tp.size}")
        param = next(model.parameters())
        return model, param.device, param.dtype
    from kv4rl.models.hf_weights import load_model

    device = device if isinstance(device, torch.device) else resolve_device(device)
    dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device)
    return load_model(model_dir, device, dtype, tp=tp)[0], device, dtype
