"""Split-KV paged decode attention over BF16, FP8, INT4 and KV4 caches (Triton).

One query token per sequence. Stage 1 runs one program per (KV head, sequence, split): the G query
heads that share the KV head are packed into the M dimension of the dot products (padded to 16), so
each cached byte is read once per KV head. A split walks its token range a tile at a time through the
block table and keeps a running max / sum / accumulator (flash-decoding); stage 2 merges the splits by
log-sum-exp. Per-token scales and zero points are applied outside the dot products:

    score_t = s_t · (q · c_t) + z_t · Σq        (INT4: codes c in 0..15, scale s, zero z)
    out     = Σ_t (p_t s_t) c_t + Σ_t p_t z_t    (V likewise)

so the inner loop only unpacks and converts codes. INT4 bytes hold channel 2j in the low nibble and
2j+1 in the high one; the query is loaded as its even and odd channels and the output stored the same
way, so no interleave is needed. KV4 launches the INT4 body over positions [n_sink, L - n_recent) with
splits, plus one INT8 work item over the protected positions (the per-sequence sink rows and recent
ring, see `KV4Format`), and stage 2 merges them all.

The split grid is fixed (`max_splits` programs per sequence and head; the ones past a sequence's end
exit at once) and the tokens per split come from a device tensor, so the launch can be captured in a
CUDA graph and replayed for any context lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kv4rl.kernels import interpreting
from kv4rl.kernels.int4_decode_cuda import LOG2E

KIND_BF16, KIND_FP8, KIND_INT4, KIND_INT8_SIDE = 0, 1, 2, 3
KINDS = {"bf16": KIND_BF16, "fp8": KIND_FP8, "int4": KIND_INT4, "int8_side": KIND_INT8_SIDE}

# Tile shapes and launch settings per kind, the fastest of a sweep on an H200 at Qwen3-8B heads,
# batch 64 x 8192 (bench/RESULTS.md). `tokens_on_m` picks the kernel with the K/V tile as the left dot
# operand; `magic` its bit-trick code conversions. INT4's `cuda` runs the body in the CUDA kernel of
# `int4_decode.cu` wherever it can (`int4_decode_cuda.problem`), the Triton kernel elsewhere.
LAUNCH = {
    KIND_BF16: {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    KIND_FP8: {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    KIND_INT4: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "tokens_on_m": True, "magic": True, "cuda": True},
    KIND_INT8_SIDE: {"BLOCK_N": 32, "num_warps": 1, "num_stages": 1},
}


@triton.jit
def _dot_operand(x, EXACT: tl.constexpr):
    """bf16 operands for the tensor cores; float32 under the CPU interpreter (EXACT), whose bf16
    arithmetic is not faithful."""
    if EXACT:
        return x.to(tl.float32)
    return x.to(tl.bfloat16)


@triton.jit
def _load_paged_rows(bt_ptr, stride_bt, b, offs_n, mask_n, BLOCK_SIZE: tl.constexpr):
    page = tl.load(bt_ptr + b * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
    return (page.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE).to(tl.int64)


@triton.jit
def _work_range(L, b, s, split_ptr, slots_ptr, KIND: tl.constexpr, START: tl.constexpr, END_OFF: tl.constexpr,
                N_SINK: tl.constexpr, N_RECENT: tl.constexpr):
    """[lo, hi) of split `s`: positions of the paged body [START, L - END_OFF); for KV4's INT8 item
    (KIND 3), indices over its protected positions [0, min(L, n_sink)) then [max(n_sink, L - n_recent), L).
    Also returns what `_tile_rows` needs to map those indices to side rows."""
    if KIND == 3:
        n_s = tl.minimum(L, N_SINK)
        lo2 = tl.maximum(L - N_RECENT, N_SINK)
        lo = s * 0
        hi = n_s + tl.maximum(L - lo2, 0)
        seq_row0 = tl.load(slots_ptr + b).to(tl.int64) * (N_SINK + N_RECENT)
    else:
        split = tl.load(split_ptr)
        end = tl.maximum(L - END_OFF, START)
        lo = START + s * split
        hi = tl.minimum(lo + split, end)
        n_s = lo * 0
        lo2 = lo * 0
        seq_row0 = n_s.to(tl.int64)
    return lo, hi, n_s, lo2, seq_row0


@triton.jit
def _tile_rows(offs_n, mask_n, b, bt_ptr, stride_bt, n_s, lo2, seq_row0, KIND: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, N_SINK: tl.constexpr, N_RECENT: tl.constexpr):
    """Cache row of each token of a tile: its page slot, or (KIND 3) the sequence's side row holding the
    protected position (sinks first, then the ring of recent positions, see `KV4Format.side_rows`)."""
    if KIND == 3:
        pos = tl.where(offs_n < n_s, offs_n, lo2 + offs_n - n_s)
        if N_RECENT > 0:
            in_seq = tl.where(pos < N_SINK, pos, N_SINK + (pos - N_SINK) % N_RECENT)
        else:
            in_seq = pos
        rows = seq_row0 + in_seq.to(tl.int64)
    else:
        rows = _load_paged_rows(bt_ptr, stride_bt, b, offs_n, mask_n, BLOCK_SIZE)
    return rows


@triton.jit
def _decode_split_kernel(
    q_ptr, stride_qb, stride_qh,
    k_ptr, v_ptr, stride_ks, stride_kh,
    ks_ptr, vs_ptr, kz_ptr, vz_ptr, stride_ss, stride_sh,
    bt_ptr, stride_bt, lens_ptr, slots_ptr, split_ptr,
    o_ptr, lse_ptr, num_q_heads, num_partials, split_base,
    sm_scale_log2, out_ptr, stride_outb, stride_outh,
    KIND: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, START: tl.constexpr, END_OFF: tl.constexpr,
    N_SINK: tl.constexpr, N_RECENT: tl.constexpr, EXACT: tl.constexpr, MERGE: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    L = tl.load(lens_ptr + b)
    lo, hi, n_s, lo2, seq_row0 = _work_range(L, b, s, split_ptr, slots_ptr, KIND, START, END_OFF, N_SINK, N_RECENT)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = h * G + offs_h
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if KIND == 2:
        offs_d2 = tl.arange(0, D // 2)
        q_even = tl.load(q_rows + 2 * offs_d2[None, :], mask=mask_h[:, None], other=0.0)
        q_odd = tl.load(q_rows + 2 * offs_d2[None, :] + 1, mask=mask_h[:, None], other=0.0)
        q_sum = tl.sum(q_even.to(tl.float32), 1) + tl.sum(q_odd.to(tl.float32), 1)
        q_even = _dot_operand(q_even.to(tl.float32), EXACT)
        q_odd = _dot_operand(q_odd.to(tl.float32), EXACT)
        acc_e = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
        z_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        offs_d = tl.arange(0, D)
        q = _dot_operand(tl.load(q_rows + offs_d[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32), EXACT)
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)

    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        rows = _tile_rows(offs_n, mask_n, b, bt_ptr, stride_bt, n_s, lo2, seq_row0, KIND, BLOCK_SIZE, N_SINK,
                          N_RECENT)
        base = rows * stride_ks + h * stride_kh  # [BLOCK_N]
        if KIND == 2:
            kc = tl.load(k_ptr + base[None, :] + offs_d2[:, None], mask=mask_n[None, :], other=0)  # [D/2, N]
            k_lo = _dot_operand(kc & 0xF, EXACT)
            k_hi = _dot_operand(kc >> 4, EXACT)
            qk = tl.dot(q_even, k_lo) + tl.dot(q_odd, k_hi)
        else:
            kt = tl.load(k_ptr + base[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)  # [D, N]
            qk = tl.dot(q, _dot_operand(kt, EXACT))
        srow = rows * stride_ss + h * stride_sh
        if KIND != 0:
            k_scale = tl.load(ks_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
            qk = qk * k_scale[None, :]
        if KIND == 2:
            k_zero = tl.load(kz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
            qk += q_sum[:, None] * k_zero[None, :]
        qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KIND == 2:
            v_scale = tl.load(vs_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
            v_zero = tl.load(vz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
            vc = tl.load(v_ptr + base[:, None] + offs_d2[None, :], mask=mask_n[:, None], other=0)  # [N, D/2]
            pv = _dot_operand(p * v_scale[None, :], EXACT)
            acc_e = acc_e * alpha[:, None] + tl.dot(pv, _dot_operand(vc & 0xF, EXACT))
            acc_o = acc_o * alpha[:, None] + tl.dot(pv, _dot_operand(vc >> 4, EXACT))
            z_acc = z_acc * alpha + tl.sum(p * v_zero[None, :], 1)
        else:
            vt = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)  # [N, D]
            if KIND == 0:
                pv = _dot_operand(p, EXACT)
            else:
                v_scale = tl.load(vs_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
                pv = _dot_operand(p * v_scale[None, :], EXACT)
            acc = acc * alpha[:, None] + tl.dot(pv, _dot_operand(vt, EXACT))
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = m_i + tl.log2(l_safe)
    part = (b * num_q_heads + heads).to(tl.int64) * num_partials + split_base + s
    has_work = mask_h & ((offs_h * 0 + lo) < hi)
    if MERGE:  # KV4's INT8 item: merge with the body's splits and write the output (no merge kernel)
        _merge_with_body(acc / l_safe[:, None], tl.where(has_work, lse, float("-inf")), b, L, heads, mask_h,
                         o_ptr, lse_ptr, split_ptr, num_q_heads, num_partials, out_ptr, stride_outb, stride_outh,
                         D, N_SINK, N_RECENT)
        return
    tl.store(lse_ptr + part, lse, mask=has_work)
    o_rows = o_ptr + part[:, None] * D
    if KIND == 2:
        tl.store(o_rows + 2 * offs_d2[None, :], (acc_e + z_acc[:, None]) / l_safe[:, None],
                 mask=has_work[:, None])
        tl.store(o_rows + 2 * offs_d2[None, :] + 1, (acc_o + z_acc[:, None]) / l_safe[:, None],
                 mask=has_work[:, None])
    else:
        tl.store(o_rows + offs_d[None, :], acc / l_safe[:, None], mask=has_work[:, None])


@triton.jit
def _merge_with_body(o_side, lse_side, b, L, heads, mask_h, o_ptr, lse_ptr, split_ptr, num_q_heads, num_partials,
                     out_ptr, stride_outb, stride_outh, D: tl.constexpr, N_SINK: tl.constexpr,
                     N_RECENT: tl.constexpr):
    """out[b, heads] = log-sum-exp merge of o_side [H, D] (log2-sum-exp lse_side, -inf: none) and the
    body's split partials over [N_SINK, L - N_RECENT)."""
    split = tl.load(split_ptr)
    n_main = tl.cdiv(tl.maximum(L - N_RECENT, N_SINK) - N_SINK, split)
    rows = (b * num_q_heads + heads).to(tl.int64) * num_partials
    m = lse_side
    for sp in range(0, n_main):
        m = tl.maximum(m, tl.load(lse_ptr + rows + sp, mask=mask_h, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse_side == float("-inf"), 0.0, tl.exp2(lse_side - m))
    offs_d = tl.arange(0, D)
    num = w[:, None] * o_side
    den = w
    for sp in range(0, n_main):
        w = tl.exp2(tl.load(lse_ptr + rows + sp, mask=mask_h, other=float("-inf")) - m)
        num += w[:, None] * tl.load(o_ptr + (rows + sp)[:, None] * D + offs_d[None, :], mask=mask_h[:, None],
                                    other=0.0)
        den += w
    out = tl.where(den[:, None] > 0, num / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])


@triton.jit
def _codes_operand(c, MAGIC: tl.constexpr, EXACT: tl.constexpr):
    """INT4/INT8 codes as dot operands. MAGIC: the bf16 with bits 0x4300 | c is exactly 128 + c, so
    two bit operations replace an int-to-float conversion (the 128 is folded into the zero point)."""
    if MAGIC:
        return (c.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
    return _dot_operand(c, EXACT)


@triton.jit
def _fp8_operand(x, MAGIC: tl.constexpr, EXACT: tl.constexpr):
    """e4m3 codes as bf16 dot operands. MAGIC moves the sign, exponent and mantissa bits into place: the
    bf16 equals the code times 2^-120 exactly (subnormals included); the 2^120 goes into the scales."""
    if MAGIC:
        bits = x.to(tl.uint8, bitcast=True).to(tl.int16)
        return (((bits & 0x7F) << 4) | ((bits & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
    return _dot_operand(x, EXACT)


@triton.jit
def _decode_split_kernel_t(
    q_ptr, stride_qb, stride_qh,
    k_ptr, v_ptr, stride_ks, stride_kh,
    ks_ptr, vs_ptr, kz_ptr, vz_ptr, stride_ss, stride_sh,
    bt_ptr, stride_bt, lens_ptr, slots_ptr, split_ptr,
    o_ptr, lse_ptr, num_q_heads, num_partials, split_base,
    sm_scale_log2, out_ptr, stride_outb, stride_outh,
    KIND: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, START: tl.constexpr, END_OFF: tl.constexpr,
    N_SINK: tl.constexpr, N_RECENT: tl.constexpr, EXACT: tl.constexpr, MAGIC: tl.constexpr,
    MERGE: tl.constexpr,
):
    """Same maths as `_decode_split_kernel` with tokens on the M side of the dot products: the
    dequantized K and V tiles are the left operands (they can stay in registers) and the packed query
    heads / probabilities the right ones."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    L = tl.load(lens_ptr + b)
    lo, hi, n_s, lo2, seq_row0 = _work_range(L, b, s, split_ptr, slots_ptr, KIND, START, END_OFF, N_SINK, N_RECENT)
    if MAGIC and KIND == 1:
        unit = 1.329227995784916e36  # 2^120: FP8 codes are read as code * 2^-120
    else:
        unit = 1.0

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = h * G + offs_h
    q_cols = q_ptr + b * stride_qb + heads[None, :] * stride_qh
    if KIND == 2:
        offs_d2 = tl.arange(0, D // 2)
        q_even = tl.load(q_cols + 2 * offs_d2[:, None], mask=mask_h[None, :], other=0.0).to(tl.float32)
        q_odd = tl.load(q_cols + 2 * offs_d2[:, None] + 1, mask=mask_h[None, :], other=0.0).to(tl.float32)
        q_sum = tl.sum(q_even, 0) + tl.sum(q_odd, 0)
        q_even = _dot_operand(q_even, EXACT)
        q_odd = _dot_operand(q_odd, EXACT)
        acc_e = tl.zeros([D // 2, BLOCK_H], dtype=tl.float32)
        acc_o = tl.zeros([D // 2, BLOCK_H], dtype=tl.float32)
        z_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        offs_d = tl.arange(0, D)
        q = _dot_operand(tl.load(q_cols + offs_d[:, None], mask=mask_h[None, :], other=0.0).to(tl.float32), EXACT)
        acc = tl.zeros([D, BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)

    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        rows = _tile_rows(offs_n, mask_n, b, bt_ptr, stride_bt, n_s, lo2, seq_row0, KIND, BLOCK_SIZE, N_SINK,
                          N_RECENT)
        base = rows * stride_ks + h * stride_kh
        srow = rows * stride_ss + h * stride_sh
        if KIND == 2:
            kc = tl.load(k_ptr + base[:, None] + offs_d2[None, :], mask=mask_n[:, None], other=0)  # [N, D/2]
            qk = tl.dot(_codes_operand(kc & 0xF, MAGIC, EXACT), q_even)
            qk += tl.dot(_codes_operand(kc >> 4, MAGIC, EXACT), q_odd)  # [N, H]
        elif KIND == 1:
            kt = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            qk = tl.dot(_fp8_operand(kt, MAGIC, EXACT), q)
        elif KIND == 3:
            kt = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0)
            qk = tl.dot(_dot_operand(kt, EXACT), q)
        else:
            kt = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            qk = tl.dot(_dot_operand(kt, EXACT), q)
        if KIND != 0:
            k_scale = tl.load(ks_ptr + srow, mask=mask_n, other=0.0).to(tl.float32) * unit
            qk = qk * k_scale[:, None]
        if KIND == 2:
            k_zero = tl.load(kz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
            if MAGIC:
                k_zero -= 128.0 * k_scale
            qk += k_zero[:, None] * q_sum[None, :]
        qk = tl.where(mask_n[:, None], qk * sm_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        if KIND != 0:
            v_scale = tl.load(vs_ptr + srow, mask=mask_n, other=0.0).to(tl.float32) * unit
            pv = _dot_operand(p * v_scale[:, None], EXACT)
        else:
            pv = _dot_operand(p, EXACT)
        if KIND == 2:
            v_zero = tl.load(vz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
            vc = tl.load(v_ptr + base[None, :] + offs_d2[:, None], mask=mask_n[None, :], other=0)  # [D/2, N]
            acc_e = acc_e * alpha[None, :] + tl.dot(_codes_operand(vc & 0xF, MAGIC, EXACT), pv)
            acc_o = acc_o * alpha[None, :] + tl.dot(_codes_operand(vc >> 4, MAGIC, EXACT), pv)
            z_add = tl.sum(p * v_zero[:, None], 0)
            if MAGIC:  # the codes read 128 too high: remove 128·Σ pv with the very (rounded) pv the dot used
                z_add -= 128.0 * tl.sum(pv.to(tl.float32), 0)
            z_acc = z_acc * alpha + z_add
        else:
            vt = tl.load(v_ptr + base[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)  # [D, N]
            if KIND == 1:
                vt = _fp8_operand(vt, MAGIC, EXACT)
            else:
                vt = _dot_operand(vt, EXACT)
            acc = acc * alpha[None, :] + tl.dot(vt, pv)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = m_i + tl.log2(l_safe)
    part = (b * num_q_heads + heads).to(tl.int64) * num_partials + split_base + s
    has_work = mask_h & ((offs_h * 0 + lo) < hi)
    tl.store(lse_ptr + part, lse, mask=has_work)
    o_cols = o_ptr + part[None, :] * D
    if KIND == 2:
        tl.store(o_cols + 2 * offs_d2[:, None], (acc_e + z_acc[None, :]) / l_safe[None, :], mask=has_work[None, :])
        tl.store(o_cols + 2 * offs_d2[:, None] + 1, (acc_o + z_acc[None, :]) / l_safe[None, :],
                 mask=has_work[None, :])
    else:
        tl.store(o_cols + offs_d[:, None], acc / l_safe[None, :], mask=has_work[None, :])


@triton.jit
def _merge_kernel(
    o_ptr, lse_ptr, out_ptr, stride_outb, stride_outh, lens_ptr, split_ptr, num_q_heads, num_partials,
    D: tl.constexpr, SPLITS_P2: tl.constexpr, START: tl.constexpr, END_OFF: tl.constexpr,
):
    """Log-sum-exp merge of one (sequence, query head)'s split partials (KV4 merges in its INT8 item)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    L = tl.load(lens_ptr + b)
    split = tl.load(split_ptr)
    n_main = tl.cdiv(tl.maximum(L - END_OFF, START) - START, split)
    offs_s = tl.arange(0, SPLITS_P2)
    valid = offs_s < n_main
    row0 = (b * num_q_heads + hq).to(tl.int64) * num_partials
    lse = tl.load(lse_ptr + row0 + offs_s, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(valid, tl.exp2(lse - m), 0.0)
    offs_d = tl.arange(0, D)
    o = tl.load(o_ptr + (row0 + offs_s[:, None]) * D + offs_d[None, :], mask=valid[:, None], other=0.0)
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w, 0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + b * stride_outb + hq * stride_outh + offs_d, out.to(out_ptr.dtype.element_ty))


@dataclass
class DecodeBatch:
    """Per-step inputs shared by every layer (static buffers when replayed in a CUDA graph).

    block_tables[B, max_blocks] int32, context_lens[B] int32 (0 = padding row), seq_slots[B] int32
    (KV4's protected rows), split_size[1] int32 (tokens per split), max_splits (grid size).
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    seq_slots: torch.Tensor
    split_size: torch.Tensor
    max_splits: int
    block_size: int


MERGE_WARPS = 2  # a little faster than 4 on an H200 (bench/kernel_notes.md)
last_compiled = None  # the main split kernel of the latest call (registers, spills: for tuning notes)


def choose_num_splits(batch: int, num_kv_heads: int, max_splits: int, num_sms: int,
                      target_programs_per_sm: int = 4) -> int:
    """Splits per sequence so that B·Hkv·splits fills the SMs a few times over; programs past a
    sequence's end still cost a launch slot, so the grid is never larger than that."""
    return max(1, min(max_splits, math.ceil(target_programs_per_sm * num_sms / max(1, batch * num_kv_heads))))


def int4_backend(q: torch.Tensor, k: torch.Tensor, block_size: int) -> tuple[str, str | None]:
    """Which kernel runs the INT4 body ('cuda' or 'triton') and, for Triton, why not CUDA."""
    return int4_backend_for(q.device, q.shape[-1], q.shape[1] // k.shape[1], k.shape[1], block_size)


def int4_backend_for(device: torch.device, head_dim: int, group: int, num_kv_heads: int, block_size: int
                     ) -> tuple[str, str | None]:
    if not LAUNCH[KIND_INT4].get("cuda", False):
        return "triton", "disabled"
    if interpreting():
        return "triton", "Triton interpreter"
    from kv4rl.kernels import int4_decode_cuda

    why = int4_decode_cuda.problem(device, head_dim, group, num_kv_heads, block_size)
    return ("triton", why) if why else ("cuda", None)


def _launch_split(q, kind, k, v, ks, vs, kz, vz, batch: DecodeBatch, o_part, lse_part, split_base, num_splits,
                  sm_scale, start, end_off, n_sink, n_recent, use_cuda=False, rotate_query=False, q_rot_out=None,
                  out=None):
    """One split kernel launch; `use_cuda` (INT4 bodies only) runs it in `int4_decode.cu`."""
    bsz, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    launch = LAUNCH[kind]
    if use_cuda:
        from kv4rl.kernels import int4_decode_cuda

        int4_decode_cuda.launch_split(q, k, v, ks, vs, kz, vz, batch, o_part, lse_part, num_splits, sm_scale,
                                      start, end_off, rotate_query, q_rot_out)
        return None
    dummy = k if ks is None else ks
    scale_strides = (0, 0) if ks is None else (ks.stride(0), ks.stride(1))
    grid = (num_kv_heads, bsz, num_splits)
    merge = out is not None  # KV4's INT8 item also merges and writes `out`: heads-on-M kernel only
    transposed = launch.get("tokens_on_m", False) and not merge
    kernel = _decode_split_kernel_t if transposed else _decode_split_kernel
    extra = {"MAGIC": launch.get("magic", False) and not interpreting()} if transposed else {}
    return kernel[grid](
        q, q.stride(0), q.stride(1),
        k, v, k.stride(0), k.stride(1),
        dummy if ks is None else ks, dummy if vs is None else vs,
        dummy if kz is None else kz, dummy if vz is None else vz, *scale_strides,
        batch.block_tables, batch.block_tables.stride(0), batch.context_lens, batch.seq_slots, batch.split_size,
        o_part, lse_part, num_q_heads, o_part.shape[2], split_base,
        sm_scale * LOG2E, o_part if out is None else out,
        0 if out is None else out.stride(0), 0 if out is None else out.stride(1),
        KIND=kind, G=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=head_dim,
        BLOCK_N=launch["BLOCK_N"], BLOCK_SIZE=batch.block_size, START=start, END_OFF=end_off,
        N_SINK=n_sink, N_RECENT=n_recent, EXACT=interpreting(), MERGE=merge, num_warps=launch["num_warps"],
        num_stages=launch["num_stages"], **extra,
    )


def paged_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DecodeBatch, *, kind: str,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None, v_zero: torch.Tensor | None = None,
    side: dict | None = None, sm_scale: float | None = None, out: torch.Tensor | None = None,
    rotate_query: bool = False,
) -> torch.Tensor:
    """Attention of q[B, Hq, D] (one decode query per sequence) over each sequence's cached context.

    `k`/`v` are the paged tensors [slots, Hkv, D] (bf16 or fp8 codes) or [slots, Hkv, D/2] (INT4 codes)
    with `k_scale`… [slots, Hkv(, 1)] alongside. `side` (KV4) holds the INT8 protected rows
    {k, v, k_scale, v_scale, n_sink, n_recent}; the paged body then covers [n_sink, L - n_recent).
    `rotate_query`: the keys are Hadamard-rotated and q is not yet (the CUDA INT4 kernel rotates it
    in registers; elsewhere it is rotated first). Returns [B, Hq, D] in q's dtype.
    """
    code = KINDS[kind]
    bsz, num_q_heads, head_dim = q.shape
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    num_partials = batch.max_splits
    o_part = torch.empty(bsz, num_q_heads, num_partials, head_dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(bsz, num_q_heads, num_partials, dtype=torch.float32, device=q.device)
    start = end_off = n_sink = n_recent = 0
    if side is not None:
        n_sink, n_recent = side["n_sink"], side["n_recent"]
        start, end_off = n_sink, n_recent
    use_cuda = code == KIND_INT4 and int4_backend(q, k, batch.block_size)[0] == "cuda"
    in_kernel = rotate_query and use_cuda
    q_in = q
    if rotate_query and not in_kernel:
        from kv4rl.quant.hadamard import rotate

        q_in = q = rotate(q)
    q_rot = torch.empty_like(q) if in_kernel and side is not None else None
    if out is None:
        out = torch.empty_like(q)
    global last_compiled
    # the body first: with an in-kernel rotation it also hands KV4's INT8 kernel the rotated query
    last_compiled = _launch_split(q_in, code, k, v, k_scale, v_scale, k_zero, v_zero, batch, o_part, lse_part, 0,
                                  batch.max_splits, sm_scale, start, end_off, n_sink, n_recent, use_cuda, in_kernel,
                                  q_rot)
    if side is not None:  # the protected INT8 rows, merged with the body's splits into `out`
        _launch_split(q if q_rot is None else q_rot, KIND_INT8_SIDE, side["k"], side["v"], side["k_scale"],
                      side["v_scale"], None, None, batch, o_part, lse_part, 0, 1, sm_scale, 0, 0,
                      n_sink, n_recent, out=out)
        return out
    _merge_kernel[(bsz, num_q_heads)](
        o_part, lse_part, out, out.stride(0), out.stride(1), batch.context_lens, batch.split_size, num_q_heads,
        num_partials, D=head_dim, SPLITS_P2=triton.next_power_of_2(batch.max_splits), START=start, END_OFF=end_off,
        num_warps=MERGE_WARPS,
    )
    return out
