"""The fused per-head q/k RMSNorm + RoPE (and, for a rotating KV cache, the keys' Hadamard rotation) as one
Triton launch over a step's tokens: the eager chain of `kv4rl.models.layers`, op by op, under the rules of
`kv4rl.kernels.fused_ops` (its roundings `_round` and launch options `_EAGER_MATH`)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kv4rl.kernels import interpreting
from kv4rl.kernels.fused_ops import _EAGER_MATH, _round
from kv4rl.quant.hadamard import hadamard_signs

# (token, head) rows a program of the rotated q/k norm + RoPE (tools/rope_time.py): a prefill's, and a decode
# step's (fewer rows, more programs: 16 tokens x 40 heads make 40 programs of 16, 10 of 64)
ROTATED_ROWS, ROTATED_ROWS_SMALL, SMALL_ROWS = 64, 16, 8192


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
