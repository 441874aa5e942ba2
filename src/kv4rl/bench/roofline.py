"""The byte roofline of a decode step: the least time it can take, reading every weight it uses once and
each sequence's resident KV once at the GPU's copy bandwidth. Issue 11 asks for decode steps at >= 70% of
it; `bench generate` and `bench decode-forward` report the fraction reached.

A decode step reads the layers' weights and the LM head whole, but only its batch's rows of the
embedding table and of the rotary tables, left out here (~1 MB a step); activations (M <= 256 rows) are
small beside these. The KV is counted two ways: `bench decode-forward` takes each sequence's K and V as
the attention kernel reads them (`decode_attn.kv_bytes_read`: KV4's protected positions in INT8, the rest
in INT4), `bench generate` each step's tokens as the engine's trace counts them (the token being sampled
included) at the engine's mean bytes per token (KV4's INT8 rows spread over `max_model_len`); for BF16 the
two agree, for KV4 the second is up to ~6% more bytes at short contexts (1.7B, 256 x 256), ~1% at 8B. The
bandwidth is a device-to-device copy's rate (bytes read plus bytes written), not the data sheet's: 4.2 TB/s
on the project's H200 (not 4.8), kept as measured there so results compare across sessions; any other GPU
has its copy timed once per process when a benchmark first asks.
"""

from __future__ import annotations

import functools
from itertools import chain

import torch

COPY_BYTES_PER_S = {"H200": 4.2e12}  # device-name substring -> copy bandwidth measured before (device to device)
COPY_PROBE_BYTES = 1 << 30  # each of the probe's two buffers, at most (an eighth of free memory where less)
ROW_TABLES = ("model.embed_tokens.", "rotary.")  # a step reads only its batch's rows of these


def copy_bandwidth(device: torch.device) -> float | None:
    """The copy bandwidth of CUDA `device` in bytes/s: the table's where it names the device, else timed
    here (`measure_copy_bandwidth`); None on the CPU, which has no byte roofline here."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    known = next((rate for key, rate in COPY_BYTES_PER_S.items() if key in name), None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return known if known is not None else measure_copy_bandwidth(index)


@functools.cache
def measure_copy_bandwidth(device_index: int, repeats: int = 10) -> float:
    """Bytes read plus bytes written per second by `repeats` device-to-device copies of one buffer (up to
    1 GiB, big enough that L2 plays no part), after three warm-up copies; timed with CUDA events."""
    device = torch.device("cuda", device_index)
    with torch.cuda.device(device):  # the events and the copies on that device's stream, whichever is current
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = min(COPY_PROBE_BYTES, free // 8) // 4096 * 4096
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        del src, dst
        torch.cuda.empty_cache()  # an engine built next sizes its pool from free memory
    return 2 * nbytes * repeats / seconds


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
