"""Device memory a learner's update will allocate beyond what the learner holds at start.

Why: an engine that stays awake through the update (partial rollout with `rollout.carry: keep_kv`)
keeps its KV pool while the learner updates, so it must size that pool leaving room for the update.
At start the learner holds only its weights: the gradients appear in the first backward pass, AdamW's
moments at the first optimizer step, and the activations of the largest micro-batch come and go in
each. A pool sized from the memory free at start took that room: at the Qwen3-4B shape with 192 slots
the update then ran out of device memory (bench/RESULTS.md, eighth session).

`update_memory_bytes` measures the first and third terms (two forward and backward passes over the
largest micro-batch the learner will run, the second beside the first's gradients as in a real update;
dummy tokens, no optimizer step, gradients dropped after), counts the second from the parameters and
allows for the kernel benchmarks of the first real shapes: it is what the engine's `reserve_bytes` takes.
"""

from __future__ import annotations

import torch

from kv4rl.engine.memory import measure_step_peak
from kv4rl.trainer.batch import TrainBatch, build_batch
from kv4rl.trainer.offloaded_adamw import OffloadedAdamW


# The real update's shapes differ from the dummy batch's: compiled regions (fused elementwise, compiled
# layers, FlexAttention) compile again and benchmark their kernels, with a buffer that flushes the L2
# cache (58-59 MiB above the measured update on an H200, 2026-12-02; Triton's autotuner takes 256 MB).
BENCHMARK_ALLOWANCE = 256 * 2**20


def largest_micro_batch(max_len: int, max_tokens_per_micro_batch: int | None, micro_batch_size: int) -> TrainBatch:
    """A dummy batch the size of the learner's largest micro-batch for sequences of at most `max_len`
    tokens: padded, `micro_batch_size` rows of `max_len`; packed, rows of `max_len` (the last one
    shorter) adding up to `max_tokens_per_micro_batch` tokens, or one row of `max_len` when that is
    longer (the planner lets a row over the budget run alone)."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (a prompt token and a response token), got {max_len}")
    if max_tokens_per_micro_batch is None:
        lengths = [max_len] * micro_batch_size
    else:
        full, rest = divmod(max(max_tokens_per_micro_batch, max_len), max_len)
        lengths = [max_len] * full + ([rest] if rest >= 2 else [])
    responses = [[0] * (n - 1) for n in lengths]
    return build_batch([[0]] * len(lengths), responses, [[0.0] * len(r) for r in responses],
                       [[0] * len(r) for r in responses], [0.0] * len(lengths), pad_id=0)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` name one device, an unset index matching any (`cuda` is the learner's
    `cuda:0` when one GPU is visible). Plain `==` says no, and AdamW's moments at the Qwen3-4B shape
    (~30 GiB) went uncounted: the update ran out of memory (bench/RESULTS.md, ninth session)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def optimizer_bytes_to_come(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes on `device` the optimizer will allocate at its steps beyond what it holds now: AdamW's two
    moments (shaped like each local parameter shard on `device`) when it has no state yet, nothing once
    it has (a resume loads the state after the engine starts: it counts, as at start); for
    `OffloadedAdamW`, whose moments stay on the host, its two staging slots of both moments of one
    bucket (at most all the elements), allocated for every step."""
    shards = [p.to_local() if hasattr(p, "to_local") else p
              for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    shards = [t for t in shards if same_device(t.device, device)]
    if not shards:
        return 0
    itemsize = shards[0].element_size()
    if isinstance(optimizer, OffloadedAdamW):
        per_moment = max(1, optimizer.bucket_bytes // (2 * itemsize))
        return 2 * 2 * min(per_moment, sum(t.numel() for t in shards)) * itemsize
    return 0 if optimizer.state else sum(2 * t.numel() * t.element_size() for t in shards)


def measure_update_memory(forward, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """The bytes two forward and backward passes (`forward()` returns the differentiable per-token
    log-probs of the largest micro-batch) allocate at their peak on CUDA `device`, gradients included and
    dropped after, plus `optimizer_bytes_to_come`. Two passes: every micro-batch after an update's first
    runs its activations beside the gradients the earlier ones left (one pass under-counted by the
    activations: the Qwen3-4B update ran out of memory, bench/RESULTS.md, ninth session). No optimizer
    step: the weights do not change."""

    def two_micro_batches():
        for _ in range(2):
            (forward().float().sum() * 0.0).backward()

    optimizer.zero_grad(set_to_none=True)
    peak = measure_step_peak(two_micro_batches, device)
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return peak + optimizer_bytes_to_come(optimizer, device) + BENCHMARK_ALLOWANCE
