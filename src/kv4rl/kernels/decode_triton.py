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

import triton
import triton.language as tl


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
