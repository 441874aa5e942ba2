"""Host lists to device tensors without making the host wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory with a blocking copy, and a blocking
copy first waits for every kernel already queued on the stream. Built after the step's forward is
launched (the sampler's parameters, the prefill rows' ids in a step whose decode rows replay a CUDA
graph, a row reorder), such a copy stalls the host until the forward ends, so the host's next work
cannot overlap the device's; and the step's recorded wait for the device (`Engine.last_step["wait_s"]`)
missed that stall (bench/RESULTS.md, sixth session). A non-blocking copy from pageable memory is staged
by the driver before the call returns, so the list's memory may go at once.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a possibly nested list of numbers) as a `dtype` tensor on `device`, queued behind the
    stream's work instead of waiting for it."""
    t = torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)
