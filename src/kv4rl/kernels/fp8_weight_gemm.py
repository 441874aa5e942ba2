"""Weight-only FP8 products for decode-sized batches: ``y = x @ (codes * scale).T + b`` with bf16 ``x``.

At M <= 256 tokens a decode step's products are bound by reading their weights, and FP8 codes halve
those bytes. ``torch._scaled_mm`` does not cash that in at these sizes: it needs the activations
quantized per token first (one more kernel per linear) and runs its FP8 GEMM below the weight
bandwidth at small M (FP8 weights gave 1.00-1.09x BF16 per 8B step, thirteenth session). Here the
codes are widened to bf16 in registers, which is exact (every e4m3 value is a bf16 value), and
multiplied with the bf16 activations on the tensor cores with float32 accumulation; the per-channel
scale multiplies the accumulator once, then the bias is added and the sum rounded to bf16 once. So the
product is the one of the dequantized weight, ``x @ deq(W).T + b``, up to float32 summation order; the
activation is not quantized, unlike the ``scaled_mm`` path.

Split-K: products with few output tiles (o_proj and down_proj of an 8B model have 4,096 outputs) would
leave most SMs idle. Their K range is cut into ``split_k`` slices whose float32 partials go to a
workspace; the last program to finish a tile (a per-tile arrival counter in ``counters``) sums the
slices in slice order, so the result does not depend on which program finished first, and sets the
counter back to zero for the next call. The counters belong to the caller (one small int32 tensor per
linear, zero at the start), so products of different linears never share them.

Status (fourteenth session, one H200, `tools/gemm_decode_shapes.py --fp8 --sweep`): correct, but at
0.34-0.89x the time of cuBLAS on the BF16 weights for the 8B products at M = 64-256, even with the best
of 120 tile settings, so the engine does not use it; `FP8Linear` keeps ``scaled_mm``. Kept as the
measured starting point (and its tests) for a weight-only product that does pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kv4rl.kernels import interpreting
from kv4rl.kernels.decode_triton import _dot_operand

# the largest token count the decode configs are made for (the engine's decode batches)
MAX_DECODE_ROWS = 256


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch settings of one product (`pick_config` chooses them)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_weight_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_om, k_per_split,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # the m tiles of one n tile are neighbours in launch order, so they read the weight tile while it
    # is in L2 and HBM delivers each weight byte about once
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # rows and channels past the edge load a valid row (its result is never stored): no load masks
    rm_load = tl.where(rm < M, rm, M - 1).to(tl.int64)
    rn_load = tl.where(rn < N, rn, N - 1).to(tl.int64)
    k_lo = pid_k * k_per_split
    x_ptrs = x_ptr + rm_load[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn_load[None, :] * K + (k_lo + rk)[:, None]  # [BLOCK_K, BLOCK_N] of the [N, K] codes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):  # K is a multiple of BLOCK_K (checked by the launcher)
        x = _dot_operand(tl.load(x_ptrs), EXACT)
        w = _dot_operand(tl.load(w_ptrs), EXACT)  # e4m3 -> bf16 is exact
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out_mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K > 1:
        tile = pid_n * tl.num_programs(0) + pid_m
        offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # slice order: the same sum whoever came last
                acc += tl.load(part_ptr + s * M * N + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call
            _store_output(acc, scale_ptr, bias_ptr, out_ptr, rm, rn, N, stride_om, out_mask, HAS_BIAS)
    else:
        _store_output(acc, scale_ptr, bias_ptr, out_ptr, rm, rn, N, stride_om, out_mask, HAS_BIAS)


@triton.jit
def _store_output(acc, scale_ptr, bias_ptr, out_ptr, rm, rn, N, stride_om, out_mask, HAS_BIAS: tl.constexpr):
    """Per-channel scale, bias, one rounding to the output dtype."""
    n_mask = rn < N
    y = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


_BLOCK_K_CHOICES = (128, 64, 32, 16)


def pick_config(m: int, n: int, k: int, num_sms: int) -> GemmConfig:
    """Tiles for an [m, k] x [n, k]^T product: the smallest m tile that holds the rows (tensor-core
    minimum 16), 64 output channels per program, and K slices until the programs fill the SMs."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n = 64
    block_k = next(b for b in _BLOCK_K_CHOICES if k % b == 0)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    # each slice keeps at least 4 K blocks, so the loop still pipelines
    while tiles * split_k < num_sms and k % (2 * split_k * block_k) == 0 and k // (2 * split_k) >= 4 * block_k:
        split_k *= 2
    return GemmConfig(block_m, block_n, block_k, split_k)


def gemm_problem(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> str | None:
    """Why `fp8_weight_matmul` cannot multiply these (None: it can)."""
    if x.dtype != torch.bfloat16:
        return f"activations are {x.dtype}, the kernel takes bfloat16"
    if codes.dtype != torch.float8_e4m3fn:
        return f"weight codes are {codes.dtype}, the kernel takes float8_e4m3fn"
    if x.dim() != 2 or codes.dim() != 2 or x.shape[1] != codes.shape[1]:
        return f"shapes {tuple(x.shape)} x {tuple(codes.shape)}^T do not multiply"
    if codes.shape[1] % 16:
        return f"in_features {codes.shape[1]} is not a multiple of 16"
    if not codes.is_contiguous() or x.stride(1) != 1:
        return "weight codes must be contiguous and activation rows dense"
    if scale.shape != (codes.shape[0],) or scale.dtype != torch.float32:
        return "the weight scale must be float32 with one value per output channel"
    return None


def counter_slots(out_features: int, max_rows: int = MAX_DECODE_ROWS) -> int:
    """How many arrival counters products with up to `max_rows` rows need (the smallest tiles)."""
    return triton.cdiv(out_features, 16) * triton.cdiv(max_rows, 16)


def fp8_weight_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      counters: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ (codes * scale[:, None]).T + bias`` in bf16 for bf16 ``x`` [M, K] and e4m3 ``codes`` [N, K].

    ``counters``: int32 zeros owned by the caller, at least one per output tile (`counter_slots`);
    the kernel leaves them zero."""
    problem = gemm_problem(x, codes, scale)
    if problem is not None:
        raise ValueError(f"fp8_weight_matmul: {problem}")
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    if m == 0:
        return out
    cfg = config or pick_config(m, n, k, _num_sms(x.device))
    if k % (cfg.split_k * cfg.block_k):
        raise ValueError(f"fp8_weight_matmul: K={k} is not a multiple of split_k x block_k = {cfg.split_k * cfg.block_k}")
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    if cfg.split_k > 1:
        if counters.dtype != torch.int32 or counters.numel() < grid[0] * grid[1]:
            raise ValueError(f"fp8_weight_matmul: needs {grid[0] * grid[1]} int32 counters, got "
                             f"{counters.numel()} {counters.dtype}")
        partials = torch.empty(cfg.split_k, m, n, device=x.device, dtype=torch.float32)
    else:
        partials = out  # not read
    _fp8_weight_gemm_kernel[grid](
        x, codes, scale, bias if bias is not None else scale, out, partials, counters,
        m, n, k, x.stride(0), out.stride(0), k // cfg.split_k,
        HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, EXACT=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: a few slices, so tests cover the split path
    return torch.cuda.get_device_properties(device).multi_processor_count
