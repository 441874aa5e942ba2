"""How many KV blocks fit in device memory, counted from the bytes each KV format really allocates.

A format's cache is affine in its size: pages cost the same for every block, KV4 adds a fixed set of
INT8 rows per running sequence, NVFP4 a per-tensor scale per layer. `kv_footprint` measures the three
terms by calling the format's own `allocate` on the `meta` device (real shapes and dtypes, no memory),
so the engine's pool sizing and `kv4rl bench pool` count exactly what the runner will allocate.

On CUDA the engine gives the pool what is left of `gpu_memory_fraction` of the device after the
weights, the CUDA context (and anything else already on the device), the activation peak of the
largest step, which it measures by running that step (`profile_batch`) through a one-block cache, and
the logits the CUDA graphs keep (`graph_output_bytes`).
An engine that stays awake beside a learner's update also leaves the bytes that update will allocate
(`reserve_bytes`, measured by the learner: `Learner.update_memory_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv4rl.engine.block_manager import blocks_needed
from kv4rl.engine.sequence import SamplingParams, Sequence

GIB = 2**30


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True, slots=True)
class KVFootprint:
    """Cache bytes over all layers: per block of `block_size` slots, per running sequence, and fixed."""

    block_size: int
    block_bytes: int
    seq_bytes: int
    const_bytes: int

    def total_bytes(self, num_blocks: int, num_seqs: int) -> int:
        return self.const_bytes + num_blocks * self.block_bytes + num_seqs * self.seq_bytes

    def blocks_in(self, pool_bytes: int, num_seqs: int) -> int:
        """Whole blocks that fit in `pool_bytes` once `num_seqs` sequences' rows are reserved (may be < 0)."""
        return (pool_bytes - self.const_bytes - num_seqs * self.seq_bytes) // self.block_bytes

    def bytes_per_token(self, context_len: int) -> float:
        """Page bytes per token plus one sequence's reserve spread over `context_len` tokens."""
        return self.block_bytes / self.block_size + self.seq_bytes / context_len


def kv_footprint(kv_format, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> KVFootprint:
    """Measure a format's cache bytes from its own `allocate` on the meta device."""

    def layer_bytes(num_slots: int, num_seqs: int) -> int:
        cache = kv_format.allocate(num_slots, num_kv_heads, head_dim, torch.device("meta"), num_seq_slots=num_seqs)
        return sum(t.numel() * t.element_size() for t in cache.values())

    const = layer_bytes(0, 0)
    return KVFootprint(
        block_size=block_size,
        block_bytes=(layer_bytes(block_size, 0) - const) * num_layers,
        seq_bytes=(layer_bytes(0, 1) - const) * num_layers,
        const_bytes=const * num_layers,
    )


def pool_blocks(*, total_bytes: int, fraction: float, used_bytes: int, activation_bytes: int,
                footprint: KVFootprint, max_num_seqs: int, max_model_len: int, reserve_bytes: int = 0) -> int:
    """Blocks for the pool in `fraction` of the device after `used_bytes`, the step's activations and
    `reserve_bytes` that another user of the device will allocate later (a learner's update beside an
    engine that stays awake through it).

    Capped at what `max_num_seqs` sequences of `max_model_len` tokens can ever hold at once, so memory
    the scheduler could never use stays free (e.g. for a learner on the same device). Raises ValueError
    naming `engine.gpu_memory_fraction` when not even one longest sequence fits.
    """
    pool = int(fraction * total_bytes) - used_bytes - activation_bytes - reserve_bytes
    longest = blocks_needed(max_model_len, footprint.block_size)
    blocks = footprint.blocks_in(pool, max_num_seqs)
    if blocks < longest:
        need = footprint.total_bytes(longest, max_num_seqs)
        raise ValueError(
            f"engine.gpu_memory_fraction={fraction}: {fraction} x {total_bytes / GIB:.2f} GiB leaves "
            f"{max(pool, 0) / GIB:.2f} GiB for the KV pool after {used_bytes / GIB:.2f} GiB in use"
            + (f", {reserve_bytes / GIB:.2f} GiB reserved for the learner's update" if reserve_bytes else "")
            + f" and {activation_bytes / GIB:.2f} GiB for the largest step's activations (and any CUDA graphs' "
            f"outputs), but one sequence of max_model_len="
            f"{max_model_len} tokens (with rows for {max_num_seqs} sequences) needs {need / GIB:.2f} GiB; "
            "raise engine.gpu_memory_fraction, or lower engine.max_model_len, "
            "engine.max_num_batched_tokens or the number of sequences (rollout.max_slots; max_num_seqs of an "
            "Engine built in code)"
            + ("; or let the engine sleep through the update (engine.sleep_between_rollouts=true, with "
               "rollout.carry=recompute) or shrink the update (trainer.max_tokens_per_micro_batch, "
               "trainer.grad_checkpointing, trainer.offload_optimizer)" if reserve_bytes else "")
        )
    return min(blocks, max_num_seqs * longest)


def profile_batch(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                  block_size: int, chunked: bool = False) -> list[Sequence]:
    """Dummy running sequences forming the largest step the scheduler can schedule.

    That is `max_num_batched_tokens` prompt tokens, or one prompt of `max_model_len - 1` tokens when
    longer (the scheduler runs an over-budget prompt alone), in sequences as long as allowed (the
    padded attention costs most for long ones). `chunked`: prompts are split at the budget, so the step
    has at most `max_num_batched_tokens` new tokens, each row the last chunk of a `max_model_len - 1`
    token prompt (the rest cached). Every block-table entry is block 0 and every sequence
    uses running slot 0, so a one-block cache of one sequence slot serves them: the writes overlap, the
    shapes and memory traffic are the real step's.
    """
    longest = max_model_len - 1
    cap = max_num_batched_tokens if chunked else max(max_num_batched_tokens, longest)
    remaining = min(cap, max_num_seqs * longest)
    seqs = []
    while remaining > 0:
        n = min(remaining, longest)
        length = longest if chunked else n
        seq = Sequence([0] * length, SamplingParams(max_tokens=1))
        seq.num_cached_tokens = length - n
        seq.block_table = [0] * blocks_needed(length, block_size)
        seq.seq_slot = 0
        seqs.append(seq)
        remaining -= n
    return seqs


def graph_output_bytes(decode_batch: int, prefill_tokens: int, vocab: int) -> int:
    """Bytes the CUDA graphs keep beyond the largest step's peak: the float32 logits their buckets share,
    [decode_batch, V] for the decode graphs and [MAX_ROWS, V] for the prefill graphs. 0 for either kind
    not captured (0 given). The graphs' intermediates share their pool and are bounded by the measured
    peak; they are not added again."""
    from kv4rl.engine.prefill_graphs import MAX_ROWS

    return (decode_batch + (MAX_ROWS if prefill_tokens else 0)) * vocab * 4


def measure_step_peak(run_step, device: torch.device) -> int:
    """Bytes `run_step()` allocates at its peak beyond what is allocated before it (CUDA only)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# What one process holds beyond torch's allocator: its CUDA context, cuBLAS/cuDNN workspaces and Triton
# modules (about 0.5-0.8 GiB on an H200 with torch 2.11); counted whole so a shared device is not overfilled.
CONTEXT_ALLOWANCE = GIB


def in_use_bytes(device: torch.device, scope: str = "device") -> tuple[int, int]:
    """(total, in use) device bytes, cached blocks not counted. `device`: everything on the device, the
    CUDA context and other processes included; `process`: this process's torch memory plus
    `CONTEXT_ALLOWANCE` (see `EngineConfig.gpu_memory_scope`)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    if scope == "process":
        return total, torch.cuda.memory_reserved(device) + CONTEXT_ALLOWANCE
    return total, total - free
