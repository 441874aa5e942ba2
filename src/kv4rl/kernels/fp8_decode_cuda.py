"""The CUDA FP8 decode kernel (`fp8_decode.cu`): compiled with NVRTC on first use (`cuda_source`),
launched on torch's current stream (so CUDA graphs capture it).

It computes the same split partials as the Triton split kernel for KIND_FP8 (normalised outputs and
log2-sum-exp per split), merged by the same Triton merge. Where it cannot run (`problem` says why), the
Triton kernel serves instead. The same source compiled with -DSIDE_INT8 is KV4's INT8 work item
(`launch_int8_side`): 8-bit codes of the same row layout, merged with the CUDA INT4 body's partials.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from kv4rl.kernels import cuda_sm_count, cuda_source
from kv4rl.kernels.decode_common import LOG2E, SplitLaunch

if TYPE_CHECKING:  # kv_write loads triton.language, which the engine's plan (importing this module) must not
    from kv4rl.kernels.kv_write import PendingWrite

SOURCE = Path(__file__).with_name("fp8_decode.cu")
KERNEL_NAME = "fp8_decode_split"
STAGE_BYTES = 4224  # shared memory per pipeline stage and warp: K and V tiles, their scales (see the source)
# Compile-time settings (macros of the source): warps per block (one per KV head of a (sequence,
# split), at most this many), cp.async stages, and the warps per SM that __launch_bounds__ sizes
# registers for. Three stages of 8 warps fit twice in an SM's shared memory (2 x 101 KB).
CONFIG = MappingProxyType({"warps": 8, "stages": 3, "warps_per_sm": 16})
# KV4's INT8 item: up to `max_subs` warps per KV head, each over its own run of the protected rows, combined in
# the block (one warp over all budget / 16 tiles is a serial chain, the layer's longest at short contexts: 12.7
# of a B16 x 256 layer's ~19 us); a "subs" key fixes the count (tests, sweeps), otherwise `choose_subs`
SIDE_CONFIG = MappingProxyType({"warps": 8, "stages": 3, "warps_per_sm": 16, "max_subs": 4})
# The item's warps that `choose_subs` lets a step have per SM: more warps per head only add fixed costs (query
# load and rotation, the combine) once the item fills the GPU, and it runs beside the body that needs the SMs.
# 8B decode-attn, B16: 4 warps a head 0.0469 / 0.1014 ms (4,096 / 16,384 tokens) against 0.0708 / 0.1222 with one;
# B64: 2 warps 0.0412 / 0.1678 (1,024 / 8,192) against 0.0450 / 0.1713, 4 warps 0.0251 at 256 against 0.0174;
# 1.7B B256 generate: 4 warps 4.23 ms a step against 3.82 with one (H200, 2026-12-04, bench/RESULTS.md)
SIDE_WARPS_PER_SM = 8


def problem(device: torch.device, head_dim: int, group: int, num_kv_heads: int, block_size: int) -> str | None:
    """Why the CUDA kernel cannot serve this shape, or None when it can."""
    return device_problem(device) or shape_problem(head_dim, group, num_kv_heads, block_size)


def device_problem(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` at all (hardware, toolkit), or None."""
    return cuda_source.device_problem(device, (8, 9), "cvt.rn.f16x2.e4m3x2")


def shape_problem(head_dim: int, group: int, num_kv_heads: int, block_size: int) -> str | None:
    """Why the kernel cannot take this head shape and block size, or None (pure; float32 scales: any KV-head count)."""
    return cuda_source.tile_shape_problem(head_dim, group, block_size)


def body_kernel(device_problem: str | None, head_dim: int, group: int, num_kv_heads: int, block_size: int, *,
                enabled: bool = True, interpreter: bool = False) -> tuple[str, str | None]:
    """Which kernel runs an FP8 body, 'cuda' or 'triton', and for Triton why not CUDA (pure)."""
    why = device_problem or shape_problem(head_dim, group, num_kv_heads, block_size)
    return cuda_source.body_kernel(why, enabled, interpreter)


def choose_num_splits(batch: int, num_kv_heads: int, max_splits: int, num_sms: int) -> int:
    """Splits per sequence: a whole number of waves of this kernel's blocks (`cuda_source.whole_wave_splits`)."""
    return cuda_source.whole_wave_splits(batch, num_kv_heads, max_splits, num_sms, CONFIG["warps"],
                                         CONFIG["warps_per_sm"])


def wave_pieces(num_kv_heads: int, num_sms: int) -> float:
    """(sequence, split) pieces of this kernel resident at once (`cuda_source.wave_pieces`)."""
    return cuda_source.wave_pieces(num_kv_heads, num_sms, CONFIG["warps"], CONFIG["warps_per_sm"])


def choose_subs(batch: int, num_kv_heads: int, num_sms: int, max_subs: int) -> int:
    """Warps per KV head of KV4's INT8 item: the most (a power of two up to `max_subs`) that keep the item's
    warps within `SIDE_WARPS_PER_SM` per SM."""
    subs = 1
    while subs * 2 <= max_subs and batch * num_kv_heads * subs * 2 <= SIDE_WARPS_PER_SM * num_sms:
        subs *= 2
    return subs


def shared_bytes(warps: int, stages: int) -> int:
    return warps * stages * STAGE_BYTES


def _kernel(device_index: int, warps: int, stages: int, min_blocks: int, strides: tuple[int, ...], side: bool = False,
            subs: int = 1):
    extra = ["-DSIDE_INT8", f"-DSUBS={subs}"] if side else []
    options = cuda_source.compile_options(warps, stages, min_blocks, strides, *extra)
    return cuda_source.compiled(device_index, SOURCE, KERNEL_NAME, options, shared_bytes(warps, stages))


def launch_split(work: SplitLaunch, config: Mapping[str, int] | None = None) -> None:
    """Fill work.o_part[:, :, :num_splits] / lse_part with the FP8 body's split partials over
    [work.start, L - work.end_off). `config`: the compile-time settings (default `CONFIG`; sweeps pass others)."""
    assert work.k.dtype == work.v.dtype == torch.float8_e4m3fn
    assert all(t.data_ptr() % 16 == 0 for t in (work.k, work.v))
    assert all(t.data_ptr() % 4 == 0 for t in (work.k_scale, work.v_scale))
    # the side-only arguments are unused: any int32 pointer and buffer
    _launch(work, config, side=False, num_splits=work.num_splits, start=work.start, end_off=work.end_off,
            side_args=[0, work.o_part, 0, 0, 0, 0])


def side_problem(out: torch.Tensor) -> str | None:
    """Why the INT8 item cannot write `out` [B, Hq, D] (then the Triton item serves), or None: it stores bf16
    or float32 rows of 16 channels as aligned 16-byte pieces."""
    if out.dtype not in (torch.bfloat16, torch.float32):
        return f"output dtype {out.dtype}"
    if out.stride(-1) != 1 or out.stride(0) % 8 or out.stride(1) % 8 or out.data_ptr() % 16:
        return "output rows not 16-byte aligned"
    return None


def launch_int8_side(work: SplitLaunch, config: Mapping[str, int] | None = None, *, beside_body: bool = False,
                     write: PendingWrite | None = None) -> None:
    """KV4's INT8 work item: attention of work.q (rotated already, or by the kernel with
    `work.rotate_query`) over each sequence's protected rows (work.k / v [rows, Hkv, D] int8, float32
    scales; a sequence's rows start at seq_slot x (n_sink + n_recent)), merged with the INT4 body's split
    partials in work.o_part / lse_part (over [n_sink, L - n_recent)) into work.out. The body must be the
    kernel launched just before on this stream; `beside_body` launches the item as its programmatic
    dependent (its query must then exist before the body runs: the raw one it rotates itself, or one rotated
    earlier, never the body's rotated copy, which may not exist yet when the item starts).
    `write`: the step's new K/V rows, which the item stores first (INT4 pages and the side rows it then reads;
    `write.item_problem()` must be None, its side rows work.k / v, and each new token inside its recent
    window, so that the body never reads it). `config`: compile-time settings (default `SIDE_CONFIG`)."""
    out = work.out
    assert work.k.dtype == work.v.dtype == torch.int8 and side_problem(out) is None
    _launch(work, config, side=True, num_splits=1, start=work.n_sink, end_off=work.n_recent,
            side_args=[work.n_sink + work.n_recent, out, out.stride(0), out.stride(1), int(out.dtype == torch.float32),
                       int(work.rotate_query), *_write_args(write, work)], programmatic=beside_body)


def _write_args(write: PendingWrite | None, work: SplitLaunch) -> list:
    """The item's nw_* arguments (fp8_decode.cu's `NewRows`); without a write, placeholders and nw_write 0."""
    from kv4rl.kernels.kv_write import INT8_INV_MAX
    if write is None:
        dummy = work.batch.context_lens
        return [work.q, work.q, 0, 0, 0, 0, dummy, dummy, dummy, dummy, 0, 0, dummy, dummy, dummy, dummy, 0, 0, 4,
                0.0, 0]
    # the caller checked `write.item_problem()` (decode_attention.item_stores); a second call would cost a step's
    # host ~6 us a layer where it runs eagerly
    assert write.k_dest.prot_codes is work.k and write.v_dest.prot_codes is work.v
    assert write.k_dest.prot_scale is work.k_scale and write.v_dest.prot_scale is work.v_scale
    k, v, kd, vd = write.k, write.v, write.k_dest, write.v_dest
    return [k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), write.slots, write.protect_rows, kd.out, vd.out,
            kd.out.stride(0), kd.out.stride(1), kd.scale, kd.zero, vd.scale, vd.zero, kd.scale.stride(0),
            kd.scale.stride(1), write.group_size, INT8_INV_MAX, 1]


def _launch(work: SplitLaunch, config: Mapping[str, int] | None, *, side: bool, num_splits: int, start: int,
            end_off: int, side_args: list, programmatic: bool = False) -> None:
    """One launch of the kernel (the FP8 body, or with `side` the INT8 item): the arguments both share."""
    config = (SIDE_CONFIG if side else CONFIG) if config is None else config
    q, k, v, batch = cuda_source.kernel_query(work.q), work.k, work.v, work.batch
    k_scale, v_scale = work.k_scale, work.v_scale
    bsz, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    assert q.dtype == torch.bfloat16 and k_scale.dtype == v_scale.dtype == torch.float32
    assert v.stride() == k.stride() and v_scale.stride() == k_scale.stride()
    assert k.stride(-1) == 1 and k.stride(0) % 16 == 0 and k.stride(1) % 16 == 0
    subs = 1
    if side:
        subs = config.get("subs") or choose_subs(bsz, num_kv_heads, cuda_sm_count(q.device), config["max_subs"])
    heads, stages, _ = cuda_source.block_settings({**config, "warps": max(1, config["warps"] // subs)}, num_kv_heads)
    warps = heads * subs  # a block: `heads` KV heads of one (sequence, split), `subs` warps each
    min_blocks = max(1, config["warps_per_sm"] // warps)
    bt = batch.block_tables
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    strides = (k.stride(0), k.stride(1), k_scale.stride(0), k_scale.stride(1))
    kernel = _kernel(device, warps, stages, min_blocks, strides, side=side, subs=subs)
    args = [q, q.stride(0), q.stride(1), k.view(torch.uint8), v.view(torch.uint8), k_scale, v_scale,
            bt, bt.stride(0), batch.context_lens, batch.split_size,
            work.o_part, work.lse_part, num_q_heads, work.o_part.shape[2], num_kv_heads, num_q_heads // num_kv_heads,
            batch.block_size.bit_length() - 1, start, end_off, float(work.sm_scale * LOG2E), batch.seq_slots, *side_args]
    launch = {"grid": (num_splits, bsz, math.ceil(num_kv_heads / heads)), "block": (32 * warps, 1, 1), "args": args,
              "shared_mem": shared_bytes(warps, stages)}
    if programmatic:
        cuda_source.launch_after_previous(kernel, **launch)
    else:
        kernel(**launch)
