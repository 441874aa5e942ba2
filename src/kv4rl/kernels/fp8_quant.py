"""Per-row FP8 (e4m3fn) activation quantization in one launch: what `kv4rl.quant.fp8.quantize_fp8`
computes with its chain of small torch kernels (float, abs, amax, divide, where, divide, clamp, cast),
which in a CUDA-graph decode step with FP8 weights cost more than the halved weight reads save.

One program per row, looping over K in chunks: a first pass takes the row's amax, a second divides,
clamps and casts. The arithmetic is torch's, operation by operation, so codes and scales match bit for
bit on finite inputs (NaN and inf also propagate through amax and clamp as in torch):

- scale: torch on CUDA divides a tensor by a Python number as a product with the float32 reciprocal
  (`amax * fl(1/448)`, aten's div_true_kernel_cuda), which differs from the correctly rounded quotient
  in about half the rows; torch on the CPU divides. `reciprocal` picks the one of the input's device;
- codes: `clamp(x / safe, -448, 448)` with a correctly rounded division (`div_rn`: torch's CUDA kernel
  is a plain IEEE `a / b`), cast with round-to-nearest-even (`cvt.rn.satfinite` on sm_90; the clamp
  makes saturation moot).

The launch forbids FMA contraction and flush-to-zero (`_EAGER_MATH`): torch keeps subnormal scales.
In Triton's CPU interpreter the fp32 -> e4m3 cast is wrong, so tests there check `scaled_rows_fp8`,
the same kernel storing the clamped float32 values instead of casting them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv4rl.kernels.fused_ops import _EAGER_MATH, FP8_INV_MAX, _fp8_clamped, _fp8_row_scale, _max_nan, row_launch


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, K, stride_x, inv_max,
    RECIPROCAL: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    src = x_ptr + row * stride_x
    dst = out_ptr + row * K
    peak = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(src + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        peak = _max_nan(peak, tl.abs(x))
    scale = _fp8_row_scale(tl.reduce(peak, 0, _max_nan), inv_max, RECIPROCAL)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        live = k0 + cols < K
        x = tl.load(src + k0 + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(dst + k0 + cols, _fp8_clamped(x, scale).to(out_ptr.dtype.element_ty), mask=live)


def launch_shape(k: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) for rows of k: the whole row in one chunk up to 4096 elements."""
    return row_launch(k)


Quantized = tuple[torch.Tensor, torch.Tensor]


def _launch(x: torch.Tensor, out_dtype: torch.dtype, reciprocal: bool | None) -> Quantized:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.shape[1] == 0:
        raise ValueError(f"quantize_rows_fp8: needs [M, K > 0] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if reciprocal is None:
        reciprocal = x.device.type == "cuda"
    if m:
        block, warps = launch_shape(k)
        _quantize_rows_fp8_kernel[(m,)](
            x, out, scale, k, x.stride(0), FP8_INV_MAX, RECIPROCAL=reciprocal, BLOCK_K=block, num_warps=warps,
            **_EAGER_MATH,
        )
    return out, scale


def quantize_rows_fp8(x: torch.Tensor, *, reciprocal: bool | None = None) -> Quantized:
    """`quantize_fp8(x)` for x [M, K] in one launch: (codes [M, K] float8_e4m3fn, scale [M] float32).

    `reciprocal` (default: whether x is on CUDA) computes the scale as torch does on CUDA, else as on
    the CPU (see the module docstring)."""
    return _launch(x, torch.float8_e4m3fn, reciprocal)


def scaled_rows_fp8(x: torch.Tensor, *, reciprocal: bool | None = None) -> Quantized:
    """Debug twin of `quantize_rows_fp8`: the clamped float32 values the codes are cast from, and the
    scale (the same kernel, storing before the cast; for tests in the interpreter)."""
    return _launch(x, torch.float32, reciprocal)
