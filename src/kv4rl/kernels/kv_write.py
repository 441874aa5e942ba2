"""Fused quantize-and-write of a step's new keys/values into the paged cache (Triton).

One launch per layer and per K or V: each program takes a tile of (token, KV head) rows, optionally
rotates them by the orthonormal Hadamard matrix (a dot with the 128×128 matrix, rounded back to the
activation dtype as the reference `rotate` does; bf16 rows go through the tensor cores against the
exact ±1 matrix and are scaled by 1/sqrt(D) after, where an IEEE float32 dot took most of the
write's time at decode, bench/kernel_notes.md), quantizes them and stores codes and scales at
the token's cache slot. KV4 also writes the INT8 copy of the rows that are protected at the step's end
into the sequence's side rows. A slot of -1 (a padding row of a CUDA-graph batch) writes nothing.

Rounding follows the reference quantizers in `kv4rl.quant` step by step (float32 statistics, correctly
rounded division, ties-to-even), so a fast-path cache holds the codes the reference would write, up to
the rotation's float32 summation order.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kv4rl.kernels import interpreting
from kv4rl.kernels.decode_common import DecodeKind
from kv4rl.quant.hadamard import hadamard_matrix

BLOCK_ROWS = 16


@triton.jit
def _round_half_even(y):
    """Round float32 |y| < 2^22 to the nearest integer, ties to even (as torch.round): adding and
    subtracting 1.5·2^23 leaves no fraction bits, and float32 addition rounds to nearest even."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _kv_write_kernel(
    x_ptr, stride_xn, stride_xh, num_rows,
    slot_ptr, prot_ptr, rot_ptr,
    out_ptr, stride_os, stride_oh,
    scale_ptr, zero_ptr, stride_ss, stride_sh,
    prot_codes_ptr, prot_scale_ptr, stride_ps, stride_ph, stride_qs, stride_qh,
    NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, STORE: tl.constexpr,
    ROTATE: tl.constexpr, PROTECT: tl.constexpr, BLOCK_R: tl.constexpr, SIGNS: tl.constexpr,
    RSQRT_D: tl.constexpr, EXACT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    tok = rows // NUM_KV_HEADS
    head = rows % NUM_KV_HEADS
    slot = tl.load(slot_ptr + tok, mask=rows < num_rows, other=-1).to(tl.int64)
    live = (rows < num_rows) & (slot >= 0)
    offs_d = tl.arange(0, D)
    x = tl.load(x_ptr + tok[:, None] * stride_xn + head[:, None] * stride_xh + offs_d[None, :],
                mask=live[:, None], other=0.0)
    in_dtype = x.dtype
    if ROTATE and SIGNS:  # bf16 rows times the ±1 Sylvester matrix (exact in bf16): exact products summed
        # in float32 on the tensor cores, then the 1/sqrt(D) normalisation
        signs = tl.load(rot_ptr + offs_d[:, None] * D + offs_d[None, :])
        if EXACT:  # the CPU interpreter's bf16 dot is not faithful; float32 gives the same exact products
            x, signs = x.to(tl.float32), signs.to(tl.float32)
        x = (tl.dot(x, signs, out_dtype=tl.float32) * RSQRT_D).to(in_dtype).to(tl.float32)
    elif ROTATE:
        rot = tl.load(rot_ptr + offs_d[:, None] * D + offs_d[None, :])
        x = tl.dot(x.to(tl.float32), rot, input_precision="ieee").to(in_dtype).to(tl.float32)
    else:
        x = x.to(tl.float32)

    if STORE == 0:
        tl.store(out_ptr + slot[:, None] * stride_os + head[:, None] * stride_oh + offs_d[None, :],
                 x.to(out_ptr.dtype.element_ty), mask=live[:, None])
    elif STORE == 1:
        scale = tl.max(tl.abs(x), 1) / 448.0
        safe = tl.where(scale > 0, scale, 1.0)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe[:, None]), -448.0), 448.0)
        tl.store(out_ptr + slot[:, None] * stride_os + head[:, None] * stride_oh + offs_d[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=live[:, None])
        tl.store(scale_ptr + slot * stride_ss + head * stride_sh, scale, mask=live)
    else:
        groups = tl.reshape(x, [BLOCK_R, D // GROUP, GROUP])
        lo = tl.min(groups, 2)
        hi = tl.max(groups, 2)
        scale = tl.math.div_rn(hi - lo, 15.0).to(tl.float16)
        zero = lo.to(tl.float16)
        scale32 = scale.to(tl.float32)
        safe = tl.where(scale32 > 0, scale32, 1.0)
        levels = _round_half_even(tl.math.div_rn(groups - zero.to(tl.float32)[:, :, None], safe[:, :, None]))
        levels = tl.minimum(tl.maximum(levels, 0.0), 15.0)
        levels = tl.where(scale32[:, :, None] > 0, levels, 0.0).to(tl.uint8)
        even, odd = tl.split(tl.reshape(levels, [BLOCK_R, D // 2, 2]))
        packed = even | (odd << 4)
        offs_b = tl.arange(0, D // 2)
        tl.store(out_ptr + slot[:, None] * stride_os + head[:, None] * stride_oh + offs_b[None, :],
                 packed, mask=live[:, None])
        offs_g = tl.arange(0, D // GROUP)
        meta = slot[:, None] * stride_ss + head[:, None] * stride_sh + offs_g[None, :]
        tl.store(scale_ptr + meta, scale, mask=live[:, None])
        tl.store(zero_ptr + meta, zero, mask=live[:, None])

    if PROTECT:
        prow = tl.load(prot_ptr + tok, mask=live, other=-1).to(tl.int64)
        keep = live & (prow >= 0)
        pscale = tl.max(tl.abs(x), 1) / 127.0
        psafe = tl.where(pscale > 0, pscale, 1.0)
        codes = _round_half_even(tl.math.div_rn(x, psafe[:, None]))
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8)
        tl.store(prot_codes_ptr + prow[:, None] * stride_ps + head[:, None] * stride_ph + offs_d[None, :],
                 codes, mask=keep[:, None])
        tl.store(prot_scale_ptr + prow * stride_qs + head * stride_qh, pscale, mask=keep)


def write_kv(x: torch.Tensor, slots: torch.Tensor, *, store: DecodeKind, out: torch.Tensor,
             scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, group_size: int = 128,
             rotate: bool = False, protect_rows: torch.Tensor | None = None,
             prot_codes: torch.Tensor | None = None, prot_scale: torch.Tensor | None = None) -> None:
    """Quantize x[N, Hkv, D] and store it at `slots[N]` (-1: skip) of the paged `out` [slots, Hkv, ·].

    store (the kernel's `STORE`, numbered like the decode kinds): BF16 (values as they are), FP8 (codes +
    per-row fp32 `scale`), INT4 (packed codes + fp16 `scale`/`zero` per group). `rotate` applies the
    Hadamard rotation first. `protect_rows[N]` (-1: none) also writes the INT8 copy to
    `prot_codes`/`prot_scale` rows.
    """
    num_tokens, num_kv_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    if x.stride(2) != 1:
        x = x.contiguous()
    signs = rotate and x.dtype == torch.bfloat16
    rot = x
    if signs:
        rot = _hadamard_signs(head_dim, x.device)
    elif rotate:
        rot = hadamard_matrix(head_dim, torch.float32, x.device)
    dummy = out
    sc = scale if scale is not None else dummy
    zr = zero if zero is not None else sc
    s_strides = (sc.stride(0), sc.stride(1)) if scale is not None else (0, 0)
    protect = protect_rows is not None
    pc = prot_codes if protect else dummy
    ps = prot_scale if protect else dummy
    num_rows = num_tokens * num_kv_heads
    grid = (triton.cdiv(num_rows, BLOCK_ROWS),)
    _kv_write_kernel[grid](
        x, x.stride(0), x.stride(1), num_rows,
        slots, protect_rows if protect else slots, rot,
        out, out.stride(0), out.stride(1),
        sc, zr, *s_strides,
        pc, ps, pc.stride(0), pc.stride(1), ps.stride(0), ps.stride(1) if ps.dim() > 1 else 0,
        NUM_KV_HEADS=num_kv_heads, D=head_dim, GROUP=group_size if store == DecodeKind.INT4 else head_dim,
        STORE=int(store), ROTATE=rotate, PROTECT=protect, BLOCK_R=BLOCK_ROWS, SIGNS=signs,
        RSQRT_D=1.0 / math.sqrt(head_dim), EXACT=interpreting(), num_warps=4,
    )


@functools.cache
def _hadamard_signs(n: int, device: torch.device) -> torch.Tensor:
    """The ±1 Sylvester matrix in bf16 (the orthonormal one times sqrt(n), every entry exact)."""
    return (hadamard_matrix(n, torch.float64) * math.sqrt(n)).round().to(torch.bfloat16).to(device)
