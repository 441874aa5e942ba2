"""Split-KV paged decode attention over BF16, FP8, INT4 and KV4 caches: the dispatch around the kernels.

The bodies are the Triton kernels of `decode_triton` (every kind) and, for INT4 and FP8 bodies where
they can run, the CUDA kernels of `int4_decode_cuda` and `fp8_decode_cuda`; each takes one `SplitLaunch`
and fills the same split partials, which the Triton merge (or KV4's INT8 item) combines. Launch settings live in a
`DecodeKernels` object that its owner (the engine's `FastAttention`, a benchmark case) holds, so
tuning one never changes another's kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import triton

from kv4rl.kernels import cuda_source, fp8_decode_cuda, int4_decode_cuda, interpreting
from kv4rl.kernels.decode_common import LOG2E, DecodeBatch, DecodeKind, SplitLaunch
from kv4rl.kernels.decode_triton import _decode_split_kernel, _decode_split_kernel_t, _merge_kernel
from kv4rl.kernels.kv_write import PendingWrite

__all__ = ["DEFAULT_LAUNCH", "DecodeBatch", "DecodeKernels", "DecodeKind", "choose_num_splits",
           "paged_decode_attention"]

# Tile shapes and launch settings per kind, the fastest of a sweep on an H200 at Qwen3-8B heads,
# batch 64 x 8192 (bench/RESULTS.md). `tokens_on_m` picks the kernel with the K/V tile as the left dot
# operand; `magic` its bit-trick code conversions.
DEFAULT_LAUNCH: Mapping[DecodeKind, Mapping[str, Any]] = MappingProxyType({
    DecodeKind.BF16: MappingProxyType({"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}),
    DecodeKind.FP8: MappingProxyType({"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}),
    DecodeKind.INT4: MappingProxyType({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "tokens_on_m": True,
                                       "magic": True}),
    DecodeKind.INT8_SIDE: MappingProxyType({"BLOCK_N": 32, "num_warps": 1, "num_stages": 1}),
})
MERGE_WARPS = 2  # a little faster than 4 on an H200 (bench/kernel_notes.md)
CUDA_BODIES = MappingProxyType({DecodeKind.INT4: int4_decode_cuda, DecodeKind.FP8: fp8_decode_cuda})
# What `DecodeKernels` takes for `int8_item_beside_body` and `write_in_item` when not told: diagnosis tools switch
# them for a process
INT8_ITEM_BESIDE_BODY = True
WRITE_IN_ITEM = True


class DecodeKernels:
    """The decode kernels' settings for one owner: `launch` per kind (default `DEFAULT_LAUNCH`), whether
    INT4 and FP8 bodies may run in their CUDA kernels (`int4_cuda`, `fp8_cuda`, wherever the kernel's
    `problem` allows), whether KV4's CUDA INT8 item starts beside the CUDA INT4 body (`int8_item_beside_body`:
    launched as its programmatic dependent, it streams the protected rows on the SMs the body's last blocks
    free and waits for the body only to merge; sm_90 and newer; off, or before sm_90, it runs after the
    body), whether that item stores a decode step's new K/V itself (`write_in_item`: KV4 with a recent window,
    where only the item reads the new token this step; no write kernel then runs before the attention), and the
    latest Triton split kernel it compiled (registers, spills: for tuning notes)."""

    def __init__(self, launch: Mapping[DecodeKind, Mapping[str, Any]] | None = None, int4_cuda: bool = True,
                 fp8_cuda: bool = True, int8_item_beside_body: bool | None = None, write_in_item: bool | None = None):
        self.launch = {kind: dict(cfg) for kind, cfg in (DEFAULT_LAUNCH if launch is None else launch).items()}
        self.int4_cuda = int4_cuda
        self.fp8_cuda = fp8_cuda
        self.int8_item_beside_body = INT8_ITEM_BESIDE_BODY if int8_item_beside_body is None else int8_item_beside_body
        self.write_in_item = WRITE_IN_ITEM if write_in_item is None else write_in_item
        self.last_compiled = None

    def with_launch(self, kind: DecodeKind, **settings) -> DecodeKernels:
        """A copy whose `kind` launches with `settings` overriding the current ones (tuning sweeps)."""
        return DecodeKernels({**self.launch, kind: {**self.launch[kind], **settings}}, self.int4_cuda, self.fp8_cuda,
                             self.int8_item_beside_body, self.write_in_item)

    @property
    def max_block_n(self) -> int:
        """The largest token tile of any kind: split sizes are multiples of it."""
        return max(cfg["BLOCK_N"] for cfg in self.launch.values())

    def body_kernel(self, kind: DecodeKind, device: torch.device, head_dim: int, group: int, num_kv_heads: int,
                    block_size: int) -> tuple[str, str | None]:
        """Which kernel runs a body of `kind` ('cuda' or 'triton') and, for Triton, why not CUDA."""
        module = CUDA_BODIES.get(kind)
        if module is None:
            return "triton", f"no CUDA kernel for {kind.name}"
        enabled = self.int4_cuda if kind == DecodeKind.INT4 else self.fp8_cuda
        return module.body_kernel(module.device_problem(device), head_dim, group, num_kv_heads, block_size,
                                  enabled=enabled, interpreter=interpreting())


def choose_num_splits(batch: int, num_kv_heads: int, max_splits: int, num_sms: int,
                      target_programs_per_sm: int = 4) -> int:
    """Splits per sequence so that B·Hkv·splits fills the SMs a few times over; programs past a
    sequence's end still cost a launch slot, so the grid is never larger than that."""
    return max(1, min(max_splits, math.ceil(target_programs_per_sm * num_sms / max(1, batch * num_kv_heads))))


def wave_pieces(num_kv_heads: int, num_sms: int, target_programs_per_sm: int = 4) -> float:
    """(sequence, split) pieces of the Triton split kernel in the programs `choose_num_splits` aims at."""
    return target_programs_per_sm * num_sms / max(1, num_kv_heads)


def _launch_triton(work: SplitLaunch, kernels: DecodeKernels):
    """One Triton split launch; returns the compiled kernel."""
    bsz, num_q_heads, head_dim = work.q.shape
    k, ks, out, batch = work.k, work.k_scale, work.out, work.batch
    launch = kernels.launch[work.kind]
    dummy = k if ks is None else ks
    scale_strides = (0, 0) if ks is None else (ks.stride(0), ks.stride(1))
    grid = (k.shape[1], bsz, work.num_splits)
    merge = out is not None  # KV4's INT8 item also merges and writes `out`: heads-on-M kernel only
    transposed = launch.get("tokens_on_m", False) and not merge
    kernel = _decode_split_kernel_t if transposed else _decode_split_kernel
    extra = {"MAGIC": launch.get("magic", False) and not interpreting()} if transposed else {}
    return kernel[grid](
        work.q, work.q.stride(0), work.q.stride(1),
        k, work.v, k.stride(0), k.stride(1),
        *(dummy if t is None else t for t in (ks, work.v_scale, work.k_zero, work.v_zero)), *scale_strides,
        batch.block_tables, batch.block_tables.stride(0), batch.context_lens, batch.seq_slots, batch.split_size,
        work.o_part, work.lse_part, num_q_heads, work.o_part.shape[2], work.split_base,
        work.sm_scale * LOG2E, work.o_part if out is None else out,
        0 if out is None else out.stride(0), 0 if out is None else out.stride(1),
        KIND=int(work.kind), G=work.group, BLOCK_H=max(16, triton.next_power_of_2(work.group)), D=head_dim,
        BLOCK_N=launch["BLOCK_N"], BLOCK_SIZE=batch.block_size, START=work.start, END_OFF=work.end_off,
        N_SINK=work.n_sink, N_RECENT=work.n_recent, EXACT=interpreting(), MERGE=merge,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **extra,
    )


def item_stores(pending: PendingWrite | None, side: dict | None, kernels: DecodeKernels) -> bool:
    """Whether KV4's CUDA INT8 item may store `pending` (given that item runs): only with a recent window, where
    each decode token is the item's to read this step (the INT4 body covers [n_sink, L - n_recent), which ends
    before it), into the side rows the item reads, and where `PendingWrite.item_problem` finds nothing."""
    return (pending is not None and side is not None and kernels.write_in_item and side["n_recent"] >= 1
            and pending.k_dest.prot_codes is side["k"] and pending.v_dest.prot_codes is side["v"]
            and pending.k_dest.prot_scale is side["k_scale"] and pending.v_dest.prot_scale is side["v_scale"]
            and pending.item_problem() is None)


def paged_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DecodeBatch, *, kind: DecodeKind,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None, v_zero: torch.Tensor | None = None,
    side: dict | None = None, sm_scale: float | None = None, out: torch.Tensor | None = None,
    rotate_query: bool = False, query_rotated: bool = False, kernels: DecodeKernels | None = None,
    pending: PendingWrite | None = None,
) -> torch.Tensor:
    """Attention of q[B, Hq, D] (one decode query per sequence) over each sequence's cached context.

    `k`/`v` are the paged tensors [slots, Hkv, D] (bf16 or fp8 codes) or [slots, Hkv, D/2] (INT4 codes)
    with `k_scale`… [slots, Hkv(, 1)] alongside. `side` (KV4) holds the INT8 protected rows
    {k, v, k_scale, v_scale, n_sink, n_recent}; the paged body then covers [n_sink, L - n_recent).
    `rotate_query`: the keys are Hadamard-rotated and q is not yet (the CUDA INT4 kernel rotates it
    in registers; elsewhere it is rotated first). `query_rotated`: the keys are rotated and so is q
    already (with KV4's CUDA kernels the INT8 item then starts beside the body without rotating anything).
    `pending`: the step's new K/V, not yet in the cache: KV4's CUDA INT8 item stores them where it can
    (`item_stores`), otherwise they are written here before any attention kernel runs.
    Returns [B, Hq, D] in q's dtype.
    """
    kernels = DecodeKernels() if kernels is None else kernels
    bsz, num_q_heads, head_dim = q.shape
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    num_partials = batch.max_splits
    o_part = torch.empty(bsz, num_q_heads, num_partials, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(bsz, num_q_heads, num_partials, dtype=torch.float32, device=q.device)
    n_sink, n_recent = (side["n_sink"], side["n_recent"]) if side is not None else (0, 0)
    use_cuda = kind in CUDA_BODIES and kernels.body_kernel(
        kind, q.device, head_dim, num_q_heads // k.shape[1], k.shape[1], batch.block_size)[0] == "cuda"
    in_kernel = rotate_query and use_cuda and kind == DecodeKind.INT4
    q_in = q
    if rotate_query and not in_kernel:
        from kv4rl.quant.hadamard import rotate

        q_in = q = rotate(q)
    if out is None:
        out = torch.empty_like(q)
    # KV4 with the CUDA INT4 body: its INT8 twin rotates the raw query itself (or takes the one rotated
    # before) and starts beside the body; otherwise the body hands the rotated query over (q_rot) and the
    # item runs after it
    side_cuda = side is not None and use_cuda and fp8_decode_cuda.side_problem(out) is None
    beside = (side_cuda and (in_kernel or (query_rotated and kind == DecodeKind.INT4))
              and kernels.int8_item_beside_body and cuda_source.programmatic_launch_problem(q.device) is None)
    q_rot = torch.empty_like(q) if in_kernel and side is not None and not beside else None
    write = pending if side_cuda and item_stores(pending, side, kernels) else None
    if pending is not None and write is None:
        pending.run()
    # the body first: with an in-kernel rotation and q_rot it also hands the INT8 item the rotated query
    body = SplitLaunch(q_in, kind, k, v, k_scale, v_scale, k_zero, v_zero, batch, o_part, lse_part,
                       num_splits=batch.max_splits, sm_scale=sm_scale, start=n_sink, end_off=n_recent,
                       n_sink=n_sink, n_recent=n_recent, rotate_query=in_kernel, q_rot_out=q_rot)
    if use_cuda:
        CUDA_BODIES[kind].launch_split(body)
        kernels.last_compiled = None
    else:
        kernels.last_compiled = _launch_triton(body, kernels)
    if side is not None:  # the protected INT8 rows, merged with the body's splits into `out`
        item = SplitLaunch(q if q_rot is None else q_rot, DecodeKind.INT8_SIDE, side["k"], side["v"],
                           side["k_scale"], side["v_scale"], None, None, batch, o_part, lse_part, num_splits=1,
                           sm_scale=sm_scale, n_sink=n_sink, n_recent=n_recent, out=out,
                           rotate_query=beside and in_kernel)
        if side_cuda:  # with the CUDA INT4 body: its 8-bit twin
            fp8_decode_cuda.launch_int8_side(item, beside_body=beside, write=write)
        else:
            _launch_triton(item, kernels)
        return out
    _merge_kernel[(bsz, num_q_heads)](
        o_part, lse_part, out, out.stride(0), out.stride(1), batch.context_lens, batch.split_size, num_q_heads,
        num_partials, D=head_dim, SPLITS_P2=triton.next_power_of_2(batch.max_splits), START=n_sink,
        END_OFF=n_recent, num_warps=MERGE_WARPS,
    )
    return out
