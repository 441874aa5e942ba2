"""Fused quantize-and-write of a step's new keys/values into the paged cache (Triton).

One launch per layer writes K and V (`write_kv_pair`; `write_kv` writes one of them): each program takes
a tile of (token, KV head) rows of K or of V, optionally rotates them by the orthonormal Hadamard matrix
(a dot with the 128×128 matrix, rounded back to the activation dtype as the reference `rotate` does;
bf16 rows go through the tensor cores against the exact ±1 matrix and are scaled by 1/sqrt(D) after,
where an IEEE float32 dot took most of the write's time at decode, bench/kernel_notes.md), quantizes
them and stores codes and scales at the token's cache slot. KV4 also writes the INT8 copy of the rows
that are protected at the step's end into the sequence's side rows. A slot of -1 (a padding row of a
CUDA-graph batch) writes nothing.

Rounding follows the reference quantizers in `kv4rl.quant` step by step (float32 statistics, correctly
rounded division, ties-to-even), so a fast-path cache holds the codes the reference would write, up to
the rotation's float32 summation order. The FP8 and INT8 row scales, amax / 448 and amax / 127, are taken
as torch takes them on the input's device: on CUDA a product with the float32 reciprocal, on the CPU a
quotient (`reciprocal`; they differ by an ulp in a few percent of rows, and KV4's CUDA INT8 item, which
stores a decode step's new rows itself, `PendingWrite`, multiplies as well).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kv4rl.kernels import interpreting
from kv4rl.kernels.decode_common import DecodeKind
from kv4rl.kernels.fused_ops import FP8_INV_MAX
from kv4rl.quant.hadamard import hadamard_matrix, hadamard_signs

# rows a program and its warps for decode-sized writes: a KV4 write of 16-256 tokens x 8 heads is one
# latency chain per program (rotation, INT4 groups, INT8 copy; 16 programs at 16 tokens), which 8 warps
# shorten: 5.30 -> 4.72 us at 16 tokens, 5.59 -> 4.60 at 128, 5.73 -> 4.93 at 256 against 4 (H200,
# 2026-12-04, bench/RESULTS.md); 16 warps and 32-row tiles were slower
BLOCK_ROWS = 16
NUM_WARPS = 8
LARGE_ROWS, LARGE_BLOCK_ROWS, LARGE_NUM_WARPS = 8192, 64, 8  # 15.2 -> 10.4 us at 1,024 tokens x 8 heads, 44 -> 36 at 4,096
# without a rotation (keys rotated by the fused RoPE) no dot shares the sign matrix among a program's rows, and
# smaller programs win: KV4 at 32,768 tokens x 8 heads 218 -> 168 us, at 4,096 27.0 -> 22.5 (bench/RESULTS.md)
LARGE_PLAIN_BLOCK_ROWS = 32
# and at decode sizes one row a program, one warp each: 16 tokens x 8 heads 3.0 -> 2.4 us (pair write), 8B B16
# short generate KV4 2,885-2,890 -> 2,899-2,904 tok/s over four alternating runs (H200, 2026-12-05); at 512 rows
# it was even and at 2,048 slower (4.8 against 3.6 us), so only writes up to 128 rows take it
SMALL_PLAIN_ROWS = 128
# torch's CUDA division by a constant: a product with `1.0f / 127` computed in float32 (as FP8_INV_MAX for 448)
INT8_INV_MAX = float(torch.tensor(1.0, dtype=torch.float32) / 127)
_FP8_INV, _INT8_INV = tl.constexpr(FP8_INV_MAX), tl.constexpr(INT8_INV_MAX)  # as the kernels read them


def default_layout(num_rows: int, rotate: bool = True) -> tuple[int, int]:
    """(rows a program, warps) for a write of `num_rows` (token, KV head) rows (`rotate`: any of them rotated)."""
    if not rotate and num_rows <= SMALL_PLAIN_ROWS:
        return 1, 1
    if num_rows < LARGE_ROWS:
        return BLOCK_ROWS, NUM_WARPS
    return (LARGE_BLOCK_ROWS if rotate else LARGE_PLAIN_BLOCK_ROWS), LARGE_NUM_WARPS


@triton.jit
def _round_half_even(y):
    """Round float32 |y| < 2^22 to the nearest integer, ties to even (as torch.round): adding and
    subtracting 1.5·2^23 leaves no fraction bits, and float32 addition rounds to nearest even."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _row_scale(amax, max_code: tl.constexpr, inv_max: tl.constexpr, RECIPROCAL: tl.constexpr):
    """amax / max_code as torch divides a float32 tensor by a number: times the float32 reciprocal on CUDA
    (RECIPROCAL), correctly rounded on the CPU."""
    if RECIPROCAL:
        return amax * inv_max
    return tl.math.div_rn(amax, max_code)


@triton.jit
def _write_rows(
    block, x_ptr, stride_xn, stride_xh, num_rows,
    slot_ptr, prot_ptr, rot_ptr,
    out_ptr, stride_os, stride_oh,
    scale_ptr, zero_ptr, stride_ss, stride_sh,
    prot_codes_ptr, prot_scale_ptr, stride_ps, stride_ph, stride_qs, stride_qh,
    NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, STORE: tl.constexpr,
    ROTATE: tl.constexpr, PROTECT: tl.constexpr, BLOCK_R: tl.constexpr, SIGNS: tl.constexpr,
    RSQRT_D: tl.constexpr, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """Rows [block * BLOCK_R, +BLOCK_R) of one of K or V: rotate, quantize, store (and the INT8 copy)."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    tok = (rows // NUM_KV_HEADS).to(tl.int64)  # times stride_xn: past 2**31 at 350k tokens of a merged q|k|v row
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
        if EXACT:  # the interpreter's float32 dot is numpy's BLAS, whose summation order follows the tile's row
            # count: a sum over the channels adds each row in one order whatever the layout (as the GPU's dot does)
            x = tl.sum(x.to(tl.float32)[:, :, None] * rot[None, :, :], 1).to(in_dtype).to(tl.float32)
        else:
            x = tl.dot(x.to(tl.float32), rot, input_precision="ieee").to(in_dtype).to(tl.float32)
    else:
        x = x.to(tl.float32)

    if STORE == 0:
        tl.store(out_ptr + slot[:, None] * stride_os + head[:, None] * stride_oh + offs_d[None, :],
                 x.to(out_ptr.dtype.element_ty), mask=live[:, None])
    elif STORE == 1:
        scale = _row_scale(tl.max(tl.abs(x), 1), 448.0, _FP8_INV, RECIPROCAL)
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
        pscale = _row_scale(tl.max(tl.abs(x), 1), 127.0, _INT8_INV, RECIPROCAL)
        psafe = tl.where(pscale > 0, pscale, 1.0)
        codes = _round_half_even(tl.math.div_rn(x, psafe[:, None]))
        codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8)
        tl.store(prot_codes_ptr + prow[:, None] * stride_ps + head[:, None] * stride_ph + offs_d[None, :],
                 codes, mask=keep[:, None])
        tl.store(prot_scale_ptr + prow * stride_qs + head * stride_qh, pscale, mask=keep)


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, num_rows,
    slot_ptr, prot_ptr, rot_ptr,
    k_out_ptr, v_out_ptr, stride_os, stride_oh,
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, stride_ss, stride_sh,
    k_prot_codes_ptr, v_prot_codes_ptr, k_prot_scale_ptr, v_prot_scale_ptr,
    stride_ps, stride_ph, stride_qs, stride_qh,
    NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, STORE: tl.constexpr,
    ROTATE_K: tl.constexpr, ROTATE_V: tl.constexpr, PROTECT: tl.constexpr, BLOCK_R: tl.constexpr,
    SIGNS: tl.constexpr, RSQRT_D: tl.constexpr, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """Grid (row blocks, 1 or 2): axis 1 picks K (0) or V (1), so a layer's two writes are one launch."""
    if tl.program_id(1) == 0:
        _write_rows(tl.program_id(0), k_ptr, stride_kn, stride_kh, num_rows, slot_ptr, prot_ptr, rot_ptr,
                    k_out_ptr, stride_os, stride_oh, k_scale_ptr, k_zero_ptr, stride_ss, stride_sh,
                    k_prot_codes_ptr, k_prot_scale_ptr, stride_ps, stride_ph, stride_qs, stride_qh,
                    NUM_KV_HEADS, D, GROUP, STORE, ROTATE_K, PROTECT, BLOCK_R, SIGNS, RSQRT_D, EXACT, RECIPROCAL)
    else:
        _write_rows(tl.program_id(0), v_ptr, stride_vn, stride_vh, num_rows, slot_ptr, prot_ptr, rot_ptr,
                    v_out_ptr, stride_os, stride_oh, v_scale_ptr, v_zero_ptr, stride_ss, stride_sh,
                    v_prot_codes_ptr, v_prot_scale_ptr, stride_ps, stride_ph, stride_qs, stride_qh,
                    NUM_KV_HEADS, D, GROUP, STORE, ROTATE_V, PROTECT, BLOCK_R, SIGNS, RSQRT_D, EXACT, RECIPROCAL)


@dataclass
class KVDest:
    """Where one of K or V goes: the paged `out` [slots, Hkv, ·] with its `scale`/`zero` (FP8: per-row
    scale; INT4: per-group fp16 scale and zero), whether its rows are Hadamard-rotated first, and (KV4)
    the INT8 side rows `prot_codes`/`prot_scale` that receive the protected tokens' copies."""

    out: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    rotate: bool = False
    prot_codes: torch.Tensor | None = None
    prot_scale: torch.Tensor | None = None


@dataclass
class PendingWrite:
    """A decode step's `write_kv_pair`, not yet run: KV4's CUDA INT8 item may store the rows itself
    (`item_problem` says where it cannot), otherwise `run` launches the Triton write before the attention."""

    k: torch.Tensor  # [B, Hkv, D]
    v: torch.Tensor
    slots: torch.Tensor  # [B] long, -1: padding
    store: DecodeKind
    k_dest: KVDest
    v_dest: KVDest
    group_size: int
    protect_rows: torch.Tensor | None = None  # [B] long, -1: not protected

    def run(self) -> None:
        write_kv_pair(self.k, self.v, self.slots, store=self.store, k_dest=self.k_dest, v_dest=self.v_dest,
                      group_size=self.group_size, protect_rows=self.protect_rows)

    def item_problem(self) -> str | None:
        """Why KV4's INT8 item cannot store these rows (it writes INT4 pages and INT8 side rows of bf16 rows
        that need no rotation, 128 channels, 8-byte aligned), or None."""
        k, v, dests = self.k, self.v, (self.k_dest, self.v_dest)
        if self.store != DecodeKind.INT4 or self.protect_rows is None:
            return "not a KV4 write"
        if any(d.rotate for d in dests):
            return "rows to rotate"
        if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or k.shape != v.shape or k.shape[-1] != 128:
            return "rows not bf16 [B, Hkv, 128]"
        if any(t.stride(-1) != 1 or t.stride(0) % 4 or t.stride(1) % 4 or t.data_ptr() % 8 for t in (k, v)):
            return "rows not in 8-byte pieces"
        g = self.group_size
        if g < 4 or g > 128 or g & (g - 1):
            return f"INT4 group of {g} channels"
        if self.slots.dtype != torch.int64 or self.protect_rows.dtype != torch.int64:
            return "slots not int64"
        if any(d.prot_codes is None or d.prot_scale is None or d.scale is None or d.zero is None for d in dests):
            return "no side rows"
        if (_dest_strides(self.k_dest) != _dest_strides(self.v_dest)
                or self.k_dest.scale.stride() != self.k_dest.zero.stride()):
            return "K and V pages of different layouts"
        pages = self.k_dest.out
        if pages.dtype != torch.uint8 or pages.stride(-1) != 1 or pages.stride(1) % 2 or pages.stride(0) % 2:
            return "INT4 pages not in 2-byte pieces"
        return None


def write_kv(x: torch.Tensor, slots: torch.Tensor, *, store: DecodeKind, out: torch.Tensor,
             scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, group_size: int = 128,
             rotate: bool = False, protect_rows: torch.Tensor | None = None,
             prot_codes: torch.Tensor | None = None, prot_scale: torch.Tensor | None = None,
             block_rows: int | None = None, num_warps: int | None = None, reciprocal: bool | None = None) -> None:
    """Quantize x[N, Hkv, D] and store it at `slots[N]` (-1: skip) of the paged `out` [slots, Hkv, ·].

    store (the kernel's `STORE`, numbered like the decode kinds): BF16 (values as they are), FP8 (codes +
    per-row fp32 `scale`), INT4 (packed codes + fp16 `scale`/`zero` per group). `rotate` applies the
    Hadamard rotation first. `protect_rows[N]` (-1: none) also writes the INT8 copy to
    `prot_codes`/`prot_scale` rows. `block_rows` / `num_warps` change the work layout only (None:
    `default_layout`). `reciprocal`: the FP8/INT8 scales as torch divides on CUDA (None: where x is).
    """
    dest = KVDest(out, scale, zero, rotate, prot_codes, prot_scale)
    _launch((x,), (dest,), slots, store, group_size, protect_rows, block_rows, num_warps, reciprocal)


def write_kv_pair(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, *, store: DecodeKind, k_dest: KVDest,
                  v_dest: KVDest, group_size: int = 128, protect_rows: torch.Tensor | None = None,
                  block_rows: int | None = None, num_warps: int | None = None) -> None:
    """A layer's keys and values in one launch, each as `write_kv` would store it (at decode a write is a
    few microseconds, mostly launch and tail: two launches a layer took 1.9x one, bench/RESULTS.md). K and
    V may have their own row strides; their pages must share dtypes and strides (one format's), otherwise
    they are written one by one."""
    same = k.dtype == v.dtype and k.shape == v.shape and _dest_strides(k_dest) == _dest_strides(v_dest)
    if same:
        _launch((k, v), (k_dest, v_dest), slots, store, group_size, protect_rows, block_rows, num_warps)
    else:
        for x, dest in ((k, k_dest), (v, v_dest)):
            _launch((x,), (dest,), slots, store, group_size, protect_rows, block_rows, num_warps)


def rotate_rows(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x[N, H, D] times the orthonormal Hadamard matrix, row by row, as the write rotates keys: one pass
    over the rows (bf16: the exact ±1 products summed in float32 on the tensor cores, rounded once to
    bf16). The prefill's queries take it instead of the reference `rotate` (a float32 copy, an IEEE float32
    matmul, a copy back); with the joined INT8 pass it took a KV4 prefill layer from 4.55 to 3.24 ms at 8B
    heads, 256 x 128 (bench/RESULTS.md, the two not timed apart). `rows` is arange(N) on x's
    device (the write's slots: row i to out[i]); `out` defaults to a new tensor like x."""
    out = torch.empty_like(x) if out is None else out
    _launch((x,), (KVDest(out, rotate=True),), rows, DecodeKind.BF16, x.shape[-1], None, None, None)
    return out


def _dest_strides(dest: KVDest) -> tuple:
    return tuple(None if t is None else (t.dtype, t.stride())
                 for t in (dest.out, dest.scale, dest.zero, dest.prot_codes, dest.prot_scale))


def _launch(xs: tuple[torch.Tensor, ...], dests: tuple[KVDest, ...], slots: torch.Tensor, store: DecodeKind,
            group_size: int, protect_rows: torch.Tensor | None, block_rows: int | None, num_warps: int | None,
            reciprocal: bool | None = None) -> None:
    """One launch writing each x of `xs` (one or two tensors of one layout) to its destination."""
    num_tokens, num_kv_heads, head_dim = xs[0].shape
    if num_tokens == 0:
        return
    xs = tuple(x if x.stride(2) == 1 else x.contiguous() for x in xs)
    rotate = any(d.rotate for d in dests)
    signs = rotate and xs[0].dtype == torch.bfloat16
    rot = xs[0]
    if signs:
        rot = hadamard_signs(head_dim, torch.bfloat16, xs[0].device)
    elif rotate:
        rot = hadamard_matrix(head_dim, torch.float32, xs[0].device)
    first, second = dests[0], dests[-1]
    sc = [d.scale if d.scale is not None else d.out for d in (first, second)]
    zr = [d.zero if d.zero is not None else s for d, s in zip((first, second), sc)]
    s_strides = (sc[0].stride(0), sc[0].stride(1)) if first.scale is not None else (0, 0)
    protect = protect_rows is not None
    pc = [d.prot_codes if protect else d.out for d in (first, second)]
    ps = [d.prot_scale if protect else d.out for d in (first, second)]
    num_rows = num_tokens * num_kv_heads
    auto_rows, auto_warps = default_layout(num_rows, rotate)
    block_rows, num_warps = block_rows or auto_rows, num_warps or auto_warps
    grid = (triton.cdiv(num_rows, block_rows), len(xs))
    _kv_write_kernel[grid](
        xs[0], xs[-1], xs[0].stride(0), xs[0].stride(1), xs[-1].stride(0), xs[-1].stride(1), num_rows,
        slots, protect_rows if protect else slots, rot,
        first.out, second.out, first.out.stride(0), first.out.stride(1),
        sc[0], sc[1], zr[0], zr[1], *s_strides,
        pc[0], pc[1], ps[0], ps[1], pc[0].stride(0), pc[0].stride(1), ps[0].stride(0),
        ps[0].stride(1) if ps[0].dim() > 1 else 0,
        NUM_KV_HEADS=num_kv_heads, D=head_dim, GROUP=group_size if store == DecodeKind.INT4 else head_dim,
        STORE=int(store), ROTATE_K=first.rotate, ROTATE_V=second.rotate, PROTECT=protect, BLOCK_R=block_rows,
        SIGNS=signs, RSQRT_D=1.0 / math.sqrt(head_dim), EXACT=interpreting(),
        RECIPROCAL=xs[0].device.type == "cuda" if reciprocal is None else reciprocal, num_warps=num_warps,
    )


