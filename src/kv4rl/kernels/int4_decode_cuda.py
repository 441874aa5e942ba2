"""The CUDA INT4 decode kernel (`int4_decode.cu`): compiled with NVRTC on first use (`cuda_source`),
launched on torch's current stream (so CUDA graphs capture it).

It computes the same split partials as the Triton split kernel for KIND_INT4 (normalised outputs and
log2-sum-exp per split), so KV4's INT8 work item and the merge kernel stay shared. Where it cannot run
(`problem` says why), the Triton kernel serves instead.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType

import torch

from kv4rl.kernels import cuda_source
from kv4rl.kernels.decode_common import LOG2E, SplitLaunch

SOURCE = Path(__file__).with_name("int4_decode.cu")
KERNEL_NAME = "int4_decode_split"
STAGE_BYTES = 2304  # shared memory per pipeline stage and warp: K and V tiles, scale words (see the source)
# Compile-time settings (macros of the source): warps per block (one per KV head of a (sequence,
# split), at most this many), cp.async stages, and the warps per SM that __launch_bounds__ sizes
# registers for (at most 128 registers a thread at 16 warps).
CONFIG = MappingProxyType({"warps": 8, "stages": 4, "warps_per_sm": 16})


def problem(device: torch.device, head_dim: int, group: int, num_kv_heads: int, block_size: int) -> str | None:
    """Why the CUDA kernel cannot serve this shape, or None when it can."""
    return device_problem(device) or shape_problem(head_dim, group, num_kv_heads, block_size)


def device_problem(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` at all (hardware, toolkit), or None."""
    return cuda_source.device_problem(device, (8, 0), "mma.sync m16n8k16")


def shape_problem(head_dim: int, group: int, num_kv_heads: int, block_size: int) -> str | None:
    """Why the kernel cannot take this head shape and block size, or None (pure)."""
    why = cuda_source.tile_shape_problem(head_dim, group, block_size)
    if why:
        return why
    if num_kv_heads % 2:
        return f"{num_kv_heads} KV heads: the kernel copies fp16 scales as aligned pairs (needs an even count)"
    return None


def body_kernel(device_problem: str | None, head_dim: int, group: int, num_kv_heads: int, block_size: int, *,
                enabled: bool = True, interpreter: bool = False) -> tuple[str, str | None]:
    """Which kernel runs an INT4 body, 'cuda' or 'triton', and for Triton why not CUDA (pure: the engine's
    plan, `FastAttention` and each decode call decide through it). `device_problem`: `device_problem(...)`
    of the device, `enabled`: the launch settings allow the CUDA kernel."""
    why = device_problem or shape_problem(head_dim, group, num_kv_heads, block_size)
    return cuda_source.body_kernel(why, enabled, interpreter)


def choose_num_splits(batch: int, num_kv_heads: int, max_splits: int, num_sms: int) -> int:
    """Splits per sequence: a whole number of waves of this kernel's blocks (`cuda_source.whole_wave_splits`)."""
    return cuda_source.whole_wave_splits(batch, num_kv_heads, max_splits, num_sms, CONFIG["warps"],
                                         CONFIG["warps_per_sm"])


def wave_pieces(num_kv_heads: int, num_sms: int) -> float:
    """(sequence, split) pieces of this kernel resident at once (`cuda_source.wave_pieces`)."""
    return cuda_source.wave_pieces(num_kv_heads, num_sms, CONFIG["warps"], CONFIG["warps_per_sm"])


def shared_bytes(warps: int, stages: int) -> int:
    return warps * stages * STAGE_BYTES


def _kernel(device_index: int, warps: int, stages: int, min_blocks: int, strides: tuple[int, ...]):
    options = cuda_source.compile_options(warps, stages, min_blocks, strides)
    return cuda_source.compiled(device_index, SOURCE, KERNEL_NAME, options, shared_bytes(warps, stages))


def launch_split(work: SplitLaunch) -> None:
    """Fill work.o_part[:, :, :num_splits] / lse_part with the INT4 body's split partials.

    `work.rotate_query`: q is the raw query and the kernel applies the cache's Hadamard rotation itself
    (then, with `work.q_rot_out` [B, Hq, D] bf16, it also writes the rotated query there)."""
    q, k, v, batch = work.q, work.k, work.v, work.batch
    k_scale, v_scale, k_zero, v_zero = work.k_scale, work.v_scale, work.k_zero, work.v_zero
    bsz, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    q = cuda_source.kernel_query(q)
    assert v.stride() == k.stride() and v_scale.stride() == k_scale.stride() == k_zero.stride() == v_zero.stride()
    assert q.dtype == torch.bfloat16 and k.dtype == torch.uint8 and k_scale.dtype == torch.float16
    assert k.stride(-1) == 1 and k.stride(0) % 16 == 0 and k.stride(1) % 16 == 0 and k.data_ptr() % 16 == 0
    assert k_scale.stride(0) % 2 == 0 and all(t.data_ptr() % 4 == 0 for t in (k_scale, v_scale, k_zero, v_zero))
    warps, stages, min_blocks = cuda_source.block_settings(CONFIG, num_kv_heads)
    grid = (work.num_splits, bsz, math.ceil(num_kv_heads / warps))
    bt = batch.block_tables
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    strides = (k.stride(0), k.stride(1), k_scale.stride(0), k_scale.stride(1))
    q_rot_out = work.q_rot_out
    _kernel(device, warps, stages, min_blocks, strides)(
        grid=grid, block=(32 * warps, 1, 1),
        args=[q, q.stride(0), q.stride(1), k, v, k_scale, v_scale, k_zero, v_zero,
              bt, bt.stride(0), batch.context_lens, batch.split_size,
              work.o_part, work.lse_part, num_q_heads, work.o_part.shape[2], num_kv_heads, num_q_heads // num_kv_heads,
              batch.block_size.bit_length() - 1, work.start, work.end_off, float(work.sm_scale * LOG2E),
              int(work.rotate_query), q if q_rot_out is None else q_rot_out, int(q_rot_out is not None)],
        shared_mem=shared_bytes(warps, stages),
    )
