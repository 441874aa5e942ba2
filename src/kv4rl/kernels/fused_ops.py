"""Fused Triton kernels for the decoder's elementwise work: RMSNorm (optionally with the residual add
before it), per-head q/k RMSNorm + RoPE, and SiLU(gate) * up.

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

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kv4rl.kernels import interpreting
from kv4rl.quant.fp8 import FP8_E4M3_MAX
from kv4rl.quant.hadamard import hadamard_signs

_SILU_BLOCK = 1024
# (token, head) rows a program of the rotated q/k norm + RoPE (tools/rope_time.py): a prefill's, and a decode
# step's (fewer rows, more programs: 16 tokens x 40 heads make 40 programs of 16, 10 of 64)
ROTATED_ROWS, ROTATED_ROWS_SMALL, SMALL_ROWS = 64, 16, 8192
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
def _norm_rope(x1, x2, w_ptr, c, s, cols, inv_d, eps, NORM: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr):
    """Rows of rotate-half halves (x1, x2, float32 holding DT values) after the optional per-row RMSNorm
    with weights w, then RoPE by (c, s): eager's roundings, op by op."""
    if NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * inv_d
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = _round(w1 * _round(x1 * r, DT), DT)
        x2 = _round(w2 * _round(x2 * r, DT), DT)
    out1 = _round(_round(x1 * c, DT) - _round(x2 * s, DT), DT)
    out2 = _round(_round(x2 * c, DT) + _round(x1 * s, DT), DT)
    return out1, out2


@triton.jit
def _norm_rope_heads(
    x_ptr, stride_n, stride_h, w_ptr, o_ptr, row, H, c, s, inv_d, eps,
    NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One token's heads [H, 2*HALF] of q or k: optional per-head RMSNorm, then rotate-half RoPE."""
    DT = o_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    live = (heads < H) & (cols < HALF)
    src = x_ptr + row * stride_n + heads * stride_h + cols
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    out1, out2 = _norm_rope(x1, x2, w_ptr, c, s, cols, inv_d, eps, NORM, HALF, DT)
    dst = o_ptr + row * (H * 2 * HALF) + heads * (2 * HALF) + cols
    tl.store(dst, out1.to(DT), mask=live)
    tl.store(dst + HALF, out2.to(DT), mask=live)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, stride_qn, stride_qh, k_ptr, stride_kn, stride_kh, qw_ptr, kw_ptr, qo_ptr, ko_ptr,
    cos_ptr, sin_ptr, stride_t, pos_ptr, HQ, HK, inv_d, eps,
    NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    DT = qo_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    pos = tl.load(pos_ptr + row).to(tl.int64)
    # eager: self.cos[positions].to(x.dtype), once for both tensors
    c = _round(tl.load(cos_ptr + pos * stride_t + cols, mask=cols < HALF, other=0.0), DT)
    s = _round(tl.load(sin_ptr + pos * stride_t + cols, mask=cols < HALF, other=0.0), DT)
    _norm_rope_heads(q_ptr, stride_qn, stride_qh, qw_ptr, qo_ptr, row, HQ, c, s, inv_d, eps,
                     NORM, BLOCK_HQ, HALF, BLOCK_HALF)
    _norm_rope_heads(k_ptr, stride_kn, stride_kh, kw_ptr, ko_ptr, row, HK, c, s, inv_d, eps,
                     NORM, BLOCK_HK, HALF, BLOCK_HALF)


@triton.jit
def _rotated_rows(
    x_ptr, stride_n, stride_h, w_ptr, o_ptr, cos_ptr, sin_ptr, stride_t, pos_ptr, sign_ptr, block, num_rows, H,
    inv_d, eps, NORM: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr, RSQRT_D: tl.constexpr,
    EXACT: tl.constexpr,
):
    """(token, head) rows [block * BLOCK_R, +BLOCK_R) of q or k: norm and RoPE as `_norm_rope_heads`, then
    [out1 | out2] times the ±1 Sylvester matrix [[S, S], [S, -S]] (S its top-left HALF x HALF): the exact
    products summed in float32, scaled by 1/sqrt(D) and rounded, as the KV write rotates keys
    (`kv4rl.kernels.kv_write`). The interpreter's 16-bit dot is not faithful; float32 is exact there."""
    DT = o_ptr.dtype.element_ty
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    live = (rows < num_rows)[:, None]
    tok = (rows // H).to(tl.int64)
    head = rows % H
    cols = tl.arange(0, HALF)[None, :]
    src = x_ptr + tok[:, None] * stride_n + head[:, None] * stride_h + cols
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + tok, mask=rows < num_rows, other=0).to(tl.int64)[:, None]
    c = _round(tl.load(cos_ptr + pos * stride_t + cols, mask=live, other=0.0), DT)
    s = _round(tl.load(sin_ptr + pos * stride_t + cols, mask=live, other=0.0), DT)
    out1, out2 = _norm_rope(x1, x2, w_ptr, c, s, cols, inv_d, eps, NORM, HALF, DT)
    signs = tl.load(sign_ptr + tl.arange(0, HALF)[:, None] * (2 * HALF) + cols)
    dot_t = tl.float32 if EXACT else DT
    p1 = tl.dot(out1.to(dot_t), signs.to(dot_t), out_dtype=tl.float32, input_precision="ieee")
    p2 = tl.dot(out2.to(dot_t), signs.to(dot_t), out_dtype=tl.float32, input_precision="ieee")
    dst = o_ptr + rows[:, None].to(tl.int64) * (2 * HALF) + cols
    tl.store(dst, _round((p1 + p2) * RSQRT_D, DT).to(DT), mask=live)
    tl.store(dst + HALF, _round((p1 - p2) * RSQRT_D, DT).to(DT), mask=live)


@triton.jit
def _qk_norm_rope_rows_kernel(
    q_ptr, stride_qn, stride_qh, k_ptr, stride_kn, stride_kh, qw_ptr, kw_ptr, qo_ptr, ko_ptr,
    cos_ptr, sin_ptr, stride_t, pos_ptr, sign_ptr, num_tokens, HQ, HK, q_blocks, inv_d, eps,
    NORM: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr, RSQRT_D: tl.constexpr, EXACT: tl.constexpr,
):
    """The rotated q/k norm + RoPE over row blocks: programs [0, q_blocks) take q's (token, head) rows,
    the rest k's, so every dot has BLOCK_R rows whatever the head count."""
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rotated_rows(q_ptr, stride_qn, stride_qh, qw_ptr, qo_ptr, cos_ptr, sin_ptr, stride_t, pos_ptr, sign_ptr,
                      pid, num_tokens * HQ, HQ, inv_d, eps, NORM, BLOCK_R, HALF, RSQRT_D, EXACT)
    else:
        _rotated_rows(k_ptr, stride_kn, stride_kh, kw_ptr, ko_ptr, cos_ptr, sin_ptr, stride_t, pos_ptr, sign_ptr,
                      pid - q_blocks, num_tokens * HK, HK, inv_d, eps, NORM, BLOCK_R, HALF, RSQRT_D, EXACT)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
                 rotate: bool = False, block_rows: int | None = None,
                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k), new contiguous [N, H, D] tensors, from q [N, Hq, D] and k [N, Hkv, D] in one launch.

    With weights (Qwen3), each head is first `RMSNorm`-ed with them (`eps`); with None (Qwen2, Llama)
    only RoPE is applied. `cos`/`sin` are `RotaryEmbedding`'s float32 tables [positions, D/2] (rope
    scaling lives in them), `positions` [N] the absolute position of each token.

    `rotate`: each head is then multiplied by the orthonormal Hadamard matrix (D a power of two), the
    rotation a KV4/INT4 cache stores keys in, as the KV write computes it: the engine's attention then
    neither rotates the queries nor the keys again (a prefill's query rotation was a pass over q of its
    own). That launch works over blocks of `block_rows` (token, head) rows (default `ROTATED_ROWS`, or
    `ROTATED_ROWS_SMALL` below `SMALL_ROWS` query rows) so each tensor-core dot has rows enough;
    `num_warps` is its launch's (default 4; tools/rope_time.py).
    """
    n, hq, d = q.shape
    hk = k.shape[1]
    if k.shape != (n, hk, d) or k.dtype != q.dtype or d % 2:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if cos.shape != sin.shape or cos.shape[-1] != d // 2 or cos.dtype != torch.float32:
        raise ValueError(f"qk_norm_rope: cos/sin must be float32 [positions, {d // 2}]")
    norm = q_weight is not None
    if norm != (k_weight is not None):
        raise ValueError("qk_norm_rope: pass both norm weights or neither")
    if norm and (q_weight.shape != (d,) or k_weight.shape != (d,) or q_weight.dtype != q.dtype
                 or k_weight.dtype != q.dtype):
        raise ValueError(f"qk_norm_rope: norm weights must be [{d}] in {q.dtype}")
    if rotate and (d < 32 or d & (d - 1)):
        raise ValueError(f"qk_norm_rope: the Hadamard rotation needs a power-of-two head_dim >= 32, got {d}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format)
    if not n:
        return q_out, k_out
    qw, kw = (q_weight.contiguous(), k_weight.contiguous()) if norm else (q, k)  # unread without the norm
    if rotate:
        rows = block_rows or (ROTATED_ROWS if n * hq >= SMALL_ROWS else ROTATED_ROWS_SMALL)
        q_blocks = triton.cdiv(n * hq, rows)
        _qk_norm_rope_rows_kernel[(q_blocks + triton.cdiv(n * hk, rows),)](
            q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), qw, kw, q_out, k_out,
            cos, sin, cos.stride(0), positions, hadamard_signs(d, q.dtype, q.device), n, hq, hk, q_blocks,
            1.0 / d, eps, NORM=norm, BLOCK_R=rows, HALF=d // 2, RSQRT_D=1.0 / math.sqrt(d),
            EXACT=interpreting(), num_warps=num_warps or 4, **_EAGER_MATH,
        )
        return q_out, k_out
    _qk_norm_rope_kernel[(n,)](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), qw, kw, q_out, k_out,
        cos, sin, cos.stride(0), positions, hq, hk, 1.0 / d, eps,
        NORM=norm, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk), HALF=d // 2,
        BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=num_warps or 4, **_EAGER_MATH,
    )
    return q_out, k_out


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k) without the per-head norm (Qwen2, Llama): `qk_norm_rope` with no weights."""
    return qk_norm_rope(q, k, None, None, 0.0, cos, sin, positions)


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
