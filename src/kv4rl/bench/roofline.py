"""The byte roofline of a decode step: the least time it can take, reading every weight it uses once and
each sequence's resident KV once at the GPU's copy bandwidth. Issue 11 asks for decode steps at >= 70% of
it; `bench generate` and `bench decode-forward` report the fraction reached.

A decode step reads the layers' weights and the LM head whole, but only its batch's rows of the
embedding table and of the rotary tables; activations (M <= 256 rows) are small beside these. The
bandwidth is the copy rate measured on the project's H200 (4.2 TB/s, not the 4.8 TB/s of the data
sheet); on other devices there is no measured rate and no roofline is reported.
"""

from __future__ import annotations

from itertools import chain

import torch

COPY_BYTES_PER_S = {"H200": 4.2e12}  # device-name substring -> measured copy bandwidth (device to device)
ROW_TABLES = ("model.embed_tokens.", "rotary.")  # a step reads only its batch's rows of these


def copy_bandwidth(device: torch.device) -> float | None:
    """The measured copy bandwidth of `device` in bytes/s, or None where none was measured (and on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((rate for key, rate in COPY_BYTES_PER_S.items() if key in name), None)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers one decode step reads: each tensor once (tied ones once), the
    row tables left out unless the LM head is one of them (tied embeddings are read whole as the head)."""
    head = model.lm_head.weight
    seen: set[int] = set()
    total = 0
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if name.startswith(ROW_TABLES) and tensor is not head:
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def roofline_ms(weight_bytes: float, kv_bytes: float, bandwidth: float) -> float:
    """Milliseconds to read `weight_bytes + kv_bytes` at `bandwidth` bytes/s."""
    return 1e3 * (weight_bytes + kv_bytes) / bandwidth
