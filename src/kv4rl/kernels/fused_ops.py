"""Fused Triton kernels for the decoder's elementwise work: RMSNorm (optionally with the residual add
before it) and SiLU(gate) * up; the per-head q/k RMSNorm + RoPE, which follows the same rules, is in
`kv4rl.kernels.rope`.

Eager, each of these is a chain of small torch kernels (a norm alone is to/pow/mean/add/rsqrt/mul/to/mul),
which dominates a CUDA-graph decode step at small batch. Each kernel here performs the eager chain of
`kv4rl.models.layers` operation by operation, in the same dtypes, so that on the GPU its results are
the eager ones bit for bit except where noted:

- a torch op on bf16/fp16 tensors computes in float32 and rounds to the tensor dtype; the kernels do the
  same by rounding (`_round`) after every op that eager runs in the activation dtype (the compiler may
  turn such a pair into one bf16 instruction, which rounds the same: float32 holds over twice bf16's
  precision). The launches forbid FMA contraction, which would skip a rounding, and libdevice's
  flush-to-zero (`_EAGER_MATH`);
- RMSNorm: float32 sum of squares times 1/C (CUDA torch's mean multiplies by that factor; the summation
  order differs, the one deviation), `rsqrt` (MUFU on both sides), the product rounded to the input
  dtype, then the weight product rounded again;
- RoPE: the float32 cos/sin rows rounded to the activation dtype first, then `x1*cos - x2*sin` and
  `x2*cos + x1*sin` over the rotate-half halves with every product and sum rounded;
- SiLU: `x / (1 + exp(-x))` in float32 with libdevice's `expf` and IEEE division (torch's CUDA kernel;
  Triton's own `exp` and `/` are approximations), rounded, then the product with `up` rounded.

They also run in the CPU interpreter (tests), whose bf16 rounding is not faithful (it truncates): test
there in float32, and in float16, which it rounds to nearest even as the GPU does.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kv4rl.kernels import interpreting
from kv4rl.quant.fp8 import FP8_E4M3_MAX

_SILU_BLOCK = 1024
_MAX_ROW_BLOCK = 4096


def row_launch(k: int) -> tuple[int, int]:
    """(block, num_warps) for kernels that walk whole rows of k in one program (amax, then codes): the
    row in one chunk up to 4,096 elements, so a row takes few dependent trips to memory."""
    block = min(triton.next_power_of_2(k), _MAX_ROW_BLOCK)
    return block, max(1, min(8, block // 256))


# torch's CUDA divide-by-scalar multiplies by `opmath_t(1.0) / b`, computed in float32 on the host
FP8_INV_MAX = float(torch.tensor(1.0, dtype=torch.float32) / FP8_E4M3_MAX)
# Launch options for eager's arithmetic (the interpreter ignores them): eager never fuses a product
# into a later sum, so neither may the compiler (with fusion on, the RoPE sums become bf16 FMAs), and
# torch's CUDA build keeps subnormals, which libdevice flushes by default.
_EAGER_MATH = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def _max_nan(a, b):
    """max that propagates NaN, as torch's amax and clamp do (PTX max.NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fp8_row_scale(amax, inv_max, RECIPROCAL: tl.constexpr):
    """`quantize_fp8`'s per-row scale, amax / 448, as torch computes it on CUDA (RECIPROCAL) or the CPU."""
    if RECIPROCAL:
        return amax * inv_max
    return tl.div_rn(amax, 448.0)


@triton.jit
def _fp8_clamped(y, scale):
    """The float32 value an e4m3 code is cast from: clamp(y / scale, -448, 448), scale 0 read as 1."""
    safe = tl.where(scale > 0, scale, 1.0)
    return _min_nan(_max_nan(tl.div_rn(y, safe), -448.0), 448.0)


@triton.jit
def _round(x, DT: tl.constexpr):
    """The float32 value `x` rounded to DT, as a torch op in DT stores its float32 result."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, stride_ro, C, inv_c, eps, inv_max,
    HAS_RESIDUAL: tl.constexpr, BLOCK_C: tl.constexpr, FP8_OUT: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    live = cols < C
    DT = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # eager: residual + x in the activation dtype, then the next norm reads that sum
        r = tl.load(res_ptr + row * stride_r + cols, mask=live, other=0.0).to(tl.float32)
        x = _round(x + r, DT)
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(DT), mask=live)
    var = tl.sum(x * x, axis=0) * inv_c
    normed = _round(x * tl.rsqrt(var + eps), DT)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    if FP8_OUT:  # the norm's output in its dtype, then quantize_fp8's row scale and codes (columns past C are 0)
        y = _round(w * normed, DT)
        scale = _fp8_row_scale(tl.reduce(tl.abs(y), 0, _max_nan), inv_max, RECIPROCAL)
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_o + cols, _fp8_clamped(y, scale).to(out_ptr.dtype.element_ty), mask=live)
    else:
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=live)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, C] with unit stride along C (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_rms_norm(x, residual, weight, eps, fp8_out: torch.dtype | None = None, reciprocal: bool = True):
    """`fp8_out`: store quantize_fp8's codes of the output in this dtype (float8_e4m3fn, or float32 for the
    clamped values before the cast) and return their per-row scales third."""
    C = x.shape[-1]
    if weight.shape != (C,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of {C}")
    if fp8_out is not None and (weight.dtype != x.dtype or x.dim() != 2):
        raise ValueError(f"rms_norm_fp8: needs [N, C] rows and a weight of their dtype, got {tuple(x.shape)} "
                         f"{x.dtype} and {weight.dtype}")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=fp8_out or torch.promote_types(weight.dtype, x.dtype), device=x.device)
    scale = torch.empty(x2.shape[0] if fp8_out is not None else 0, dtype=torch.float32, device=x.device)
    res2 = res_out = x2  # placeholders the kernel does not touch without a residual
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("add_rms_norm: x and residual need the same shape and dtype")
        res2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    weight = weight.contiguous()
    n = x2.shape[0]
    if n:
        block = triton.next_power_of_2(C)
        _rms_norm_kernel[(n,)](
            x2, res2, weight, out, res_out, scale if fp8_out is not None else x2,
            x2.stride(0), res2.stride(0), C, C, C, 1.0 / C, eps, FP8_INV_MAX,
            HAS_RESIDUAL=residual is not None, BLOCK_C=block, FP8_OUT=fp8_out is not None, RECIPROCAL=reciprocal,
            num_warps=8 if block >= 4096 else 4, **_EAGER_MATH,
        )
    return out, res_out, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` over the last dim of x ([N, C], or [N, H, D] per head) in one launch."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`RMSNorm(residual + x)`, `residual + x`) in one launch: a block's output joins the residual
    stream inside the kernel that normalises it for the next block."""
    return _launch_rms_norm(x, residual, weight, eps)[:2]


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                 reciprocal: bool | None = None, debug: bool = False):
    """(codes, scale, residual + x or None): `quantize_fp8(RMSNorm(residual + x))` in the norm's launch, for
    an FP8 linear that reads the norm (`kv4rl.kernels.fp8_quant.quantize_rows_fp8`'s codes and scales, bit
    for bit on the GPU). `reciprocal` (default: on CUDA) is torch's CUDA scale; `debug` stores the clamped
    float32 values instead of e4m3 codes (the interpreter's e4m3 cast is wrong)."""
    if reciprocal is None:
        reciprocal = x.device.type == "cuda"
    codes, res_out, scale = _launch_rms_norm(x, residual, weight, eps, torch.float32 if debug else torch.float8_e4m3fn,
                                             reciprocal)
    return codes, scale, (res_out if residual is not None else None)


@triton.jit
def _silu_mul_values(g_ptr, u_ptr, row, cols, live, stride_g, stride_u, DT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """silu(gate) * up of one row's columns as float32 holding values of DT (0 past the row's end)."""
    g = tl.load(g_ptr + row * stride_g + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=live, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:  # the interpreter's libdevice may be missing
        e = tl.exp(-g)
    silu = _round(tl.div_rn(g, 1.0 + e), DT)
    return _round(silu * u, DT)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, LIBDEVICE: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_cols
    DT = o_ptr.dtype.element_ty
    y = _silu_mul_values(g_ptr, u_ptr, row, cols, live, stride_g, stride_u, DT, LIBDEVICE)
    tl.store(o_ptr + row * n_cols + cols, y.to(DT), mask=live)


@triton.jit
def _silu_mul_fp8_kernel(g_ptr, u_ptr, o_ptr, scale_ptr, n_cols, stride_g, stride_u, inv_max,
                         LIBDEVICE: tl.constexpr, RECIPROCAL: tl.constexpr, BLOCK: tl.constexpr):
    # one program a row: a first pass over the columns takes the amax of silu(gate) * up in its dtype, a
    # second recomputes the values (cheaper than keeping a row of the intermediate size) and stores codes
    row = tl.program_id(0).to(tl.int64)
    DT = g_ptr.dtype.element_ty
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        y = _silu_mul_values(g_ptr, u_ptr, row, cols, cols < n_cols, stride_g, stride_u, DT, LIBDEVICE)
        peak = _max_nan(peak, tl.abs(y))
    scale = _fp8_row_scale(tl.reduce(peak, 0, _max_nan), inv_max, RECIPROCAL)
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        live = cols < n_cols
        y = _silu_mul_values(g_ptr, u_ptr, row, cols, live, stride_g, stride_u, DT, LIBDEVICE)
        tl.store(o_ptr + row * n_cols + cols, _fp8_clamped(y, scale).to(o_ptr.dtype.element_ty), mask=live)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in one launch (SwiGLU's elementwise part), a new contiguous tensor of their
    shape. Rows are read by their stride, so the halves of a merged gate|up product need no copies."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        gate2, up2 = _rows(gate), _rows(up)
        rows, cols = gate2.shape
        _silu_mul_kernel[(rows, triton.cdiv(cols, _SILU_BLOCK))](
            gate2, up2, out, cols, gate2.stride(0), up2.stride(0), LIBDEVICE=not interpreting(),
            BLOCK=_SILU_BLOCK, num_warps=4, **_EAGER_MATH)
    return out


def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor, *, reciprocal: bool | None = None,
                 debug: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale): `quantize_fp8(silu_mul(gate, up))` in one launch for [N, I] rows, for an FP8 down
    projection (`quantize_rows_fp8`'s codes and scales, bit for bit on the GPU); `reciprocal` and `debug`
    as in `rms_norm_fp8`."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(f"silu_mul_fp8: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must be [N, I] of one dtype")
    if reciprocal is None:
        reciprocal = gate.device.type == "cuda"
    rows, cols = gate.shape
    out = torch.empty(gate.shape, dtype=torch.float32 if debug else torch.float8_e4m3fn, device=gate.device)
    scale = torch.empty(rows, dtype=torch.float32, device=gate.device)
    if gate.numel():
        gate2, up2 = _rows(gate), _rows(up)
        block, warps = row_launch(cols)
        _silu_mul_fp8_kernel[(rows,)](
            gate2, up2, out, scale, cols, gate2.stride(0), up2.stride(0), FP8_INV_MAX, LIBDEVICE=not interpreting(),
            RECIPROCAL=reciprocal, BLOCK=block, num_warps=warps, **_EAGER_MATH)
    return out, scale
