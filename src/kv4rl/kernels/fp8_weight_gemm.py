"""FP8-weight products for decode-sized batches: ``y = x @ (codes * scale).T + b`` at M <= 256 tokens.

At these sizes a product is bound by reading its weight, and e4m3 codes halve those bytes; cuBLAS's FP8
GEMM (``torch._scaled_mm``) does not cash that in at M = 64-128 (0.98-1.07x cuBLAS BF16 over an 8B
step's products, twenty-first session). This kernel swaps the operands: a program multiplies a
[BLOCK_N, BLOCK_K] tile of the weight's K-contiguous rows (the tensor cores' wide side) by the
transposed [BLOCK_K, BLOCK_M] tile of the few token rows (their narrow side, down to 16).

Two activation forms:
- e4m3 codes with one float32 scale per row (``x_scale``, what the engine's ``FP8Linear`` computes, the
  function of its ``scaled_mm`` path): e4m3 x e4m3 on the tensor cores. By default (``fast_accum``) the
  products run into one FP8 MMA sum over K, which keeps fewer bits than float32 (as cuBLAS's and
  CUTLASS's "fast accumulation"): measured above bf16 rounding plus 2^-12 of the sum of |products| at
  K = 4,096 (the tests allow 2^-10 of that sum) and within a norm-relative 4e-3 of scaled_mm's float32 sum (the GPU test's bound), small
  beside the e4m3 rounding of the activations themselves (up to 2^-4 of each). Adding each block's sum
  to a float32 total instead (``fast_accum=False``) cost 2-24% a product (twenty-first session).
- bf16 activations (weight-only): the codes are widened to bf16 in registers (exact). Correct but
  slower than cuBLAS on the BF16 weights (0.55-0.83x), so nothing uses it; bf16 weights are also taken,
  to compare the kernel with cuBLAS at the BF16 bytes (`tools/gemm_decode_shapes.py --sweep`).

The accumulator is scaled per output channel (and per row), the bias added, and the sum rounded to the
output dtype once.

Operand feed: with e4m3 activations and token tiles of up to 64 rows (`pick_config`), the tiles are
brought by the copy engine (TMA descriptors, `_fp8_gemm_tma_kernel`) with 4-5 stages in flight; rows and
channels past the edge arrive as zeros. Other tiles are loaded through pointers (`_fp8_weight_gemm_kernel`).

Split-K: products with few output tiles (o_proj and down_proj have 2,048-4,096 outputs) would leave most
SMs idle. Their K range is cut into ``split_k`` slices whose float32 partials go to a workspace; the
last program to finish a tile (a per-tile arrival counter in ``counters``) sums the slices in slice
order, so the result does not depend on which program finished first, and sets the counter back to
zero for the next call. The counters belong to the caller (one small int32 tensor per linear, zero at
the start), so products of different linears never share them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kv4rl.kernels import cuda_sm_count, interpreting
from kv4rl.kernels.decode_triton import _dot_operand


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch settings of one product (`pick_config` chooses them)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fast_accum: bool = True  # e4m3 activations: one running FP8 MMA sum over K, no float32 add per block
    tma: bool = False  # e4m3 activations: tiles loaded by the copy engine (Hopper TMA descriptors)


@triton.jit
def _fp8_weight_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_om, k_per_split,
    HAS_BIAS: tl.constexpr, X_FP8: tl.constexpr, SPLIT_K: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_ACCUM: tl.constexpr,
):
    # out.T tile [BLOCK_N, BLOCK_M] = W tile [BLOCK_N, BLOCK_K] @ x.T tile [BLOCK_K, BLOCK_M]: the weight's
    # K-contiguous rows are the first operand (the MMA's 64-row side), the few token rows the second
    # operand's narrow side. The m tiles of one n tile are neighbours in launch order, so they read the
    # weight tile while it is in L2 and HBM delivers each weight byte about once
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
    w_ptrs = w_ptr + rn_load[:, None] * K + (k_lo + rk)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rm_load[None, :] * stride_xm + (k_lo + rk)[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):  # K is a multiple of BLOCK_K (checked by the launcher)
        if X_FP8 and not EXACT:  # e4m3 x e4m3 on the tensor cores
            # FAST_ACCUM: one FP8 MMA running sum over K; else each block's sum is added to the float32 total
            if FAST_ACCUM:
                acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc)
            else:
                acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc, max_num_imprecise_acc=BLOCK_K)
        else:  # bf16 activations: e4m3 -> bf16 is exact
            acc = tl.dot(_dot_operand(tl.load(w_ptrs), EXACT), _dot_operand(tl.load(x_ptrs), EXACT), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    _finish_tile(acc, xs_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, pid_m, pid_n, pid_k, rm, rn,
                 M, N, stride_om, HAS_BIAS, X_FP8, SPLIT_K, BLOCK_M, BLOCK_N)


@triton.jit
def _fp8_gemm_tma_kernel(
    x_desc, w_desc, xs_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_om, k_per_split,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_ACCUM: tl.constexpr,
):
    # the e4m3 x e4m3 product of `_fp8_weight_gemm_kernel`, its tiles brought by the copy engine (TMA): no
    # address arithmetic in the loop, and rows past the edge arrive as zeros
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_lo = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k_lo, k_lo + k_per_split, BLOCK_K):
        w = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]
        x = tl.trans(x_desc.load([off_m, k]))  # [BLOCK_K, BLOCK_M], K-major as the FP8 MMA wants it
        if EXACT:  # the interpreter's e4m3 products are not exact: widen (exact) first
            acc = tl.dot(_dot_operand(w, EXACT), _dot_operand(x, EXACT), acc)
        elif FAST_ACCUM:
            acc = tl.dot(w, x, acc)
        else:
            acc = tl.dot(w, x, acc, max_num_imprecise_acc=BLOCK_K)
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    _finish_tile(acc, xs_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, pid_m, pid_n, pid_k, rm, rn,
                 M, N, stride_om, HAS_BIAS, True, SPLIT_K, BLOCK_M, BLOCK_N)


@triton.jit
def _finish_tile(acc, xs_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, pid_m, pid_n, pid_k, rm, rn,
                 M, N, stride_om, HAS_BIAS: tl.constexpr, X_FP8: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store a finished tile, or with split-K its slice's partial; the last slice to arrive sums them."""
    out_mask = (rn < N)[:, None] & (rm < M)[None, :]
    offs = rm.to(tl.int64)[None, :] * N + rn[:, None]
    if SPLIT_K > 1:
        tile = pid_n * tl.num_programs(0) + pid_m
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # slice order: the same sum whoever came last
                acc += tl.load(part_ptr + s * M * N + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call
            _store_output_t(acc, xs_ptr, scale_ptr, bias_ptr, out_ptr, rm, rn, M, N, stride_om, out_mask,
                            HAS_BIAS, X_FP8)
    else:
        _store_output_t(acc, xs_ptr, scale_ptr, bias_ptr, out_ptr, rm, rn, M, N, stride_om, out_mask, HAS_BIAS, X_FP8)


@triton.jit
def _store_output_t(acc, xs_ptr, scale_ptr, bias_ptr, out_ptr, rm, rn, M, N, stride_om, out_mask,
                    HAS_BIAS: tl.constexpr, X_FP8: tl.constexpr):
    """Per-channel scale (and with FP8 activations their per-row scale), bias, one rounding to the output
    dtype, for the transposed [BLOCK_N, BLOCK_M] accumulator."""
    n_mask = rn < N
    y = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[:, None]
    if X_FP8:
        y *= tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty), mask=out_mask)


_BLOCK_K_CHOICES = (128, 64, 32, 16)


@functools.cache
def pick_config(m: int, n: int, k: int, num_sms: int, x_fp8: bool = True) -> GemmConfig:
    """Tiles for an [m, k] x [n, k]^T product, fitted to timed grids over the Qwen3-1.7B and 8B products at
    64, 128 and 256 tokens (twenty-first and twenty-second sessions): 64 output channels a program; the
    token tile that holds the rows (tensor-core minimum 16, at most 128), halved to 64 where the programs
    would fill fewer than half the SMs; 256-wide K blocks, 128-wide for products four times wider than deep
    (gate|up).

    Token tiles of up to 64 e4m3 rows are fed by TMA with 4-5 stages in flight and no K slices: 5-9% less
    time over an 8B step's block products at 64 and 128 tokens than the pointer-fed kernel, and a split
    gained at most 1% there. A 128-token tile stays pointer-fed (TMA was 8-12% slower for 8B gate|up), with
    K slices while the programs fill at most half the SMs and each slice keeps 8 K blocks. bf16
    activations (`x_fp8` false) take twice the shared memory a tile, so their K blocks stop at 128."""
    block_n = 64
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    if block_m > 64 and 2 * triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < num_sms:
        block_m = 64
    widest = 128 if n >= 4 * k or not x_fp8 else 256
    block_k = next(b for b in (256, *_BLOCK_K_CHOICES) if b <= widest and k % b == 0)
    if x_fp8 and block_m <= 64 and block_k >= 128:
        return GemmConfig(block_m, block_n, block_k, 1, num_warps=4, num_stages=5 if block_k == 256 else 4, tma=True)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    while 2 * tiles * split_k <= num_sms and k % (2 * split_k * block_k) == 0 and k // (2 * split_k) >= 8 * block_k:
        split_k *= 2
    return GemmConfig(block_m, block_n, block_k, split_k, num_warps=4, num_stages=3)


def tma_ready(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether the copy engine can read these operands: 16-byte aligned starts and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, codes))


def gemm_problem(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 x_scale: torch.Tensor | None = None) -> str | None:
    """Why `fp8_weight_matmul` cannot multiply these (None: it can)."""
    if x_scale is None and x.dtype != torch.bfloat16:
        return f"activations are {x.dtype}, the kernel takes bfloat16 (or float8_e4m3fn codes with x_scale)"
    if x_scale is not None:
        if x.dtype != torch.float8_e4m3fn:
            return f"activations with x_scale are {x.dtype}, the kernel takes float8_e4m3fn codes"
        if x_scale.dtype != torch.float32 or x_scale.numel() != x.shape[0]:
            return "the activation scale must be float32 with one value per row"
    if codes.dtype not in (torch.float8_e4m3fn, torch.bfloat16) or (x_scale is not None and codes.dtype != torch.float8_e4m3fn):
        return f"weight codes are {codes.dtype}, the kernel takes float8_e4m3fn (or bfloat16 weights with bf16 activations)"
    if x.dim() != 2 or codes.dim() != 2 or x.shape[1] != codes.shape[1]:
        return f"shapes {tuple(x.shape)} x {tuple(codes.shape)}^T do not multiply"
    if codes.shape[1] % 16:
        return f"in_features {codes.shape[1]} is not a multiple of 16"
    if not codes.is_contiguous() or x.stride(1) != 1:
        return "weight codes must be contiguous and activation rows dense"
    if scale.shape != (codes.shape[0],) or scale.dtype != torch.float32:
        return "the weight scale must be float32 with one value per output channel"
    return None


def counter_slots(out_features: int, max_rows: int) -> int:
    """How many arrival counters products with up to `max_rows` rows need (the smallest tiles)."""
    return triton.cdiv(out_features, 16) * triton.cdiv(max_rows, 16)


def fp8_weight_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      counters: torch.Tensor, config: GemmConfig | None = None,
                      x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (codes * scale[:, None]).T + bias`` in bf16 for bf16 ``x`` [M, K] and e4m3 ``codes`` [N, K]
    (or bf16 weights as ``codes``, for the comparison with cuBLAS).

    With ``x_scale`` ([M] float32), ``x`` holds e4m3 codes of the activations, one scale per row, and the
    product runs e4m3 x e4m3 on the tensor cores (the function of the ``scaled_mm`` path).
    ``counters``: int32 zeros owned by the caller, at least one per output tile (`counter_slots`);
    the kernel leaves them zero."""
    problem = gemm_problem(x, codes, scale, x_scale)
    if problem is not None:
        raise ValueError(f"fp8_weight_matmul: {problem}")
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    if m == 0:
        return out
    cfg = config or pick_config(m, n, k, _num_sms(x.device), x_scale is not None)
    if cfg.tma and not tma_ready(x, codes):
        if config is not None:
            raise ValueError("fp8_weight_matmul: TMA tiles need 16-byte aligned operands and row strides")
        cfg = dataclasses.replace(cfg, tma=False)  # the same tiles, pointer-fed
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
    if cfg.tma:
        if x_scale is None:
            raise ValueError("fp8_weight_matmul: TMA tiles take e4m3 activations (x_scale)")
        from triton.tools.tensor_descriptor import TensorDescriptor

        _fp8_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(codes, [cfg.block_n, cfg.block_k]),
            x_scale, scale, bias if bias is not None else scale, out, partials, counters, m, n, k, out.stride(0),
            k // cfg.split_k, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, EXACT=interpreting(),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FAST_ACCUM=cfg.fast_accum,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out
    _fp8_weight_gemm_kernel[grid](
        x, x_scale if x_scale is not None else scale, codes, scale, bias if bias is not None else scale, out,
        partials, counters, m, n, k, x.stride(0), out.stride(0), k // cfg.split_k,
        HAS_BIAS=bias is not None, X_FP8=x_scale is not None, SPLIT_K=cfg.split_k, EXACT=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FAST_ACCUM=cfg.fast_accum,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: a few slices, so tests cover the split path
    return cuda_sm_count(device)
