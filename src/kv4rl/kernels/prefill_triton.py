"""Varlen paged prefill attention over BF16, FP8, INT4 and KV4 caches (Triton).

The step's new tokens of every row are packed (`query_start`, cu_seqlens style) and each query attends
over its sequence's cache as stored, causally (key position <= query position), so a prefill computes
what token-by-token decoding would. One program takes a tile of `BLOCK_M` rows for one KV head: the G
query heads sharing that head for `BLOCK_M // G` consecutive queries of one sequence, so each cached
tile is read once per KV head and used by all of them. It walks the keys a `BLOCK_N` tile at a time
through the block table with an online softmax; scales and zero points are applied outside the dot
products as in the decode kernels (`decode_triton`):

    score = s · (q · c) + z · Σq     out = Σ (p s) c + Σ p z     (INT4: codes c, scale s, zero z)

INT4 bytes hold channel 2j in the low nibble and 2j+1 in the high one, so plain INT4 programs keep the
query, the accumulator and the output as even and odd channels. KV4 programs keep channel order: their
INT4 pass interleaves each tile's nibbles back (a join), so the INT8 passes, which see most of a short
prompt's keys, run one dot each way as BF16's do.

KV4 (`KV4Format`): a query at q reads key p from its INT8 copy when p < n_sink or q - p < n_recent,
else from the INT4 page. The INT8 copy of a token written this step comes from `fresh` (every new
token's INT8 codes, one row per packed token, written by the fused writer before the launch); older
positions come from the sequence's side rows, which still hold the previous step's window because the
caller stores this step's protected rows only after the launch. So a program runs the INT4 pass over
[n_sink, last - n_recent] and the INT8 passes over the sinks and the recent window of its queries (one pass
where they touch), all into one softmax, each masked by the per-query rule. An INT8 range is split at the
step's first token, so each pass reads one source (fresh rows or side rows) at a fixed stride. When no
row's ring has wrapped (every row ends within n_sink + n_recent tokens), the caller writes the step's copies
straight into the side rows and the INT8 passes read only those (`fresh_in_side`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv4rl.kernels import interpreting
from kv4rl.kernels.decode_common import LOG2E, DecodeKind
from kv4rl.kernels.decode_triton import _dot_operand, _load_paged_rows
from kv4rl.kernels.prefill_plan import DEFAULT_PREFILL_LAUNCH, PrefillBatch


@triton.jit
def _online_softmax(qk, m_i, l_i):
    """One tile of log2-domain scores (-inf: masked) into the running max and sum; rows with nothing
    seen yet keep -inf without producing NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _plain_range(acc, m_i, l_i, q, qpos, lo, hi, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr, stride_ks, stride_kh,
                 stride_ss, stride_sh, bt_ptr, stride_bt, sm_scale_log2,
                 KIND: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 EXACT: tl.constexpr):
    """BF16 / FP8 pages over key positions [lo, hi), causal."""
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        rows = _load_paged_rows(bt_ptr, stride_bt, b, offs_n, mask_n, BLOCK_SIZE)
        base = rows * stride_ks + h * stride_kh
        kt = tl.load(k_ptr + base[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0.0)  # [D, N]
        qk = tl.dot(q, _dot_operand(kt, EXACT))
        if KIND == 1:
            srow = rows * stride_ss + h * stride_sh
            qk = qk * tl.load(ks_ptr + srow, mask=mask_n, other=0.0)[None, :]
        valid = mask_n[None, :] & (offs_n[None, :] <= qpos[:, None])
        qk = tl.where(valid, qk * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
        if KIND == 1:
            p = p * tl.load(vs_ptr + srow, mask=mask_n, other=0.0)[None, :]
        vt = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(_dot_operand(p, EXACT), _dot_operand(vt, EXACT))
    return acc, m_i, l_i


@triton.jit
def _int4_range(acc_e, acc_o, z_acc, m_i, l_i, q_e, q_o, q_sum, qpos, lo, hi, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr,
                kz_ptr, vz_ptr, stride_ks, stride_kh, stride_ss, stride_sh, bt_ptr, stride_bt, sm_scale_log2,
                BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, EXACT: tl.constexpr):
    """Plain INT4 pages over [lo, hi), causal, with the query and accumulator as even and odd channels (KV4
    takes `_int4_range_whole`)."""
    offs_d2 = tl.arange(0, D // 2)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        rows = _load_paged_rows(bt_ptr, stride_bt, b, offs_n, mask_n, BLOCK_SIZE)
        base = rows * stride_ks + h * stride_kh
        srow = rows * stride_ss + h * stride_sh
        kc = tl.load(k_ptr + base[None, :] + offs_d2[:, None], mask=mask_n[None, :], other=0)  # [D/2, N]
        qk = tl.dot(q_e, _dot_operand(kc & 0xF, EXACT)) + tl.dot(q_o, _dot_operand(kc >> 4, EXACT))
        k_scale = tl.load(ks_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        k_zero = tl.load(kz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        qk = qk * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]
        valid = mask_n[None, :] & (offs_n[None, :] <= qpos[:, None])
        qk = tl.where(valid, qk * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
        v_scale = tl.load(vs_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        v_zero = tl.load(vz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + base[:, None] + offs_d2[None, :], mask=mask_n[:, None], other=0)  # [N, D/2]
        pv = _dot_operand(p * v_scale[None, :], EXACT)
        acc_e = acc_e * alpha[:, None] + tl.dot(pv, _dot_operand(vc & 0xF, EXACT))
        acc_o = acc_o * alpha[:, None] + tl.dot(pv, _dot_operand(vc >> 4, EXACT))
        z_acc = z_acc * alpha + tl.sum(p * v_zero[None, :], 1)
    return acc_e, acc_o, z_acc, m_i, l_i


@triton.jit
def _int4_range_whole(acc, z_acc, m_i, l_i, q, q_sum, qpos, lo, hi, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr,
                      stride_ks, stride_kh, stride_ss, stride_sh, bt_ptr, stride_bt, sm_scale_log2,
                      N_SINK: tl.constexpr, N_RECENT: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, EXACT: tl.constexpr):
    """KV4's INT4 pages over [lo, hi) in the whole layout: each tile's nibbles interleaved back into channel
    order ([N, D]), so the query and the accumulator stay whole and one dot serves each product."""
    offs_d2 = tl.arange(0, D // 2)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        rows = _load_paged_rows(bt_ptr, stride_bt, b, offs_n, mask_n, BLOCK_SIZE)
        base = rows * stride_ks + h * stride_kh
        srow = rows * stride_ss + h * stride_sh
        kc = tl.load(k_ptr + base[:, None] + offs_d2[None, :], mask=mask_n[:, None], other=0)  # [N, D/2]
        k = tl.reshape(tl.join(kc & 0xF, kc >> 4), [BLOCK_N, D])  # channel 2j low nibble, 2j+1 high
        qk = tl.dot(q, _dot_operand(tl.trans(k), EXACT))
        k_scale = tl.load(ks_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        k_zero = tl.load(kz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        qk = qk * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]
        valid = mask_n[None, :] & (offs_n[None, :] >= N_SINK) & (qpos[:, None] - offs_n[None, :] >= N_RECENT)
        qk = tl.where(valid, qk * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
        v_scale = tl.load(vs_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        v_zero = tl.load(vz_ptr + srow, mask=mask_n, other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + base[:, None] + offs_d2[None, :], mask=mask_n[:, None], other=0)  # [N, D/2]
        v = tl.reshape(tl.join(vc & 0xF, vc >> 4), [BLOCK_N, D])
        acc = acc * alpha[:, None] + tl.dot(_dot_operand(p * v_scale[None, :], EXACT), _dot_operand(v, EXACT))
        z_acc = z_acc * alpha + tl.sum(p * v_zero[None, :], 1)
    return acc, z_acc, m_i, l_i


@triton.jit
def _int8_range_whole(acc, z_acc, m_i, l_i, q, qpos, lo, hi, h, first, qs, seq_row0,
                      pk_ptr, pv_ptr, pks_ptr, pvs_ptr, stride_ps, stride_ph, stride_pss, stride_psh,
                      fk_ptr, fv_ptr, fks_ptr, fvs_ptr, stride_fs, stride_fh, stride_fss, stride_fsh, sm_scale_log2,
                      FRESH: tl.constexpr, N_SINK: tl.constexpr, N_RECENT: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr, EXACT: tl.constexpr):
    """KV4's INT8 copies over [lo, hi) in the whole layout, from one source: FRESH, this step's tokens
    (packed row qs + p - first, a fixed stride per key), else the sequence's side rows. BF16's loop on int8
    rows, one dot each way."""
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        if FRESH:
            row = (qs + offs_n - first).to(tl.int64)
            k_base = fk_ptr + row * stride_fs + h * stride_fh
            v_base = fv_ptr + row * stride_fs + h * stride_fh
            k_scale = tl.load(fks_ptr + row * stride_fss + h * stride_fsh, mask=mask_n, other=0.0)
            v_scale = tl.load(fvs_ptr + row * stride_fss + h * stride_fsh, mask=mask_n, other=0.0)
        else:
            if N_RECENT > 0:
                in_seq = tl.where(offs_n < N_SINK, offs_n, N_SINK + (offs_n - N_SINK) % N_RECENT)
            else:
                in_seq = offs_n
            row = seq_row0 + in_seq.to(tl.int64)
            k_base = pk_ptr + row * stride_ps + h * stride_ph
            v_base = pv_ptr + row * stride_ps + h * stride_ph
            k_scale = tl.load(pks_ptr + row * stride_pss + h * stride_psh, mask=mask_n, other=0.0)
            v_scale = tl.load(pvs_ptr + row * stride_pss + h * stride_psh, mask=mask_n, other=0.0)
        kt = tl.load(k_base[None, :] + offs_d[:, None], mask=mask_n[None, :], other=0)  # [D, N]
        qk = tl.dot(q, _dot_operand(kt, EXACT)) * k_scale[None, :]
        d = qpos[:, None] - offs_n[None, :]
        valid = mask_n[None, :] & (d >= 0) & ((offs_n[None, :] < N_SINK) | (d < N_RECENT))
        qk = tl.where(valid, qk * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
        vt = tl.load(v_base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(_dot_operand(p * v_scale[None, :], EXACT), _dot_operand(vt, EXACT))
        z_acc = z_acc * alpha  # the INT4 pass's zero-point sum shares the running max
    return acc, z_acc, m_i, l_i


@triton.jit
def _int8_passes_whole(acc, z_acc, m_i, l_i, q, qpos, lo, hi, h, first, qs, seq_row0,
                       pk_ptr, pv_ptr, pks_ptr, pvs_ptr, stride_ps, stride_ph, stride_pss, stride_psh,
                       fk_ptr, fv_ptr, fks_ptr, fvs_ptr, stride_fs, stride_fh, stride_fss, stride_fsh, sm_scale_log2,
                       N_SINK: tl.constexpr, N_RECENT: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                       EXACT: tl.constexpr, FRESH_IN_SIDE: tl.constexpr):
    """An INT8 range [lo, hi) in two passes split at the step's first token: older keys from the side
    rows, this step's from the fresh rows (a new prompt's range is all fresh). FRESH_IN_SIDE: the step's
    copies are in the side rows already, one pass there."""
    if FRESH_IN_SIDE:
        mid = hi
    else:
        mid = tl.minimum(tl.maximum(first, lo), hi)
    acc, z_acc, m_i, l_i = _int8_range_whole(
        acc, z_acc, m_i, l_i, q, qpos, lo, mid, h, first, qs, seq_row0,
        pk_ptr, pv_ptr, pks_ptr, pvs_ptr, stride_ps, stride_ph, stride_pss, stride_psh,
        fk_ptr, fv_ptr, fks_ptr, fvs_ptr, stride_fs, stride_fh, stride_fss, stride_fsh, sm_scale_log2,
        False, N_SINK, N_RECENT, BLOCK_N, D, EXACT)
    return _int8_range_whole(
        acc, z_acc, m_i, l_i, q, qpos, mid, hi, h, first, qs, seq_row0,
        pk_ptr, pv_ptr, pks_ptr, pvs_ptr, stride_ps, stride_ph, stride_pss, stride_psh,
        fk_ptr, fv_ptr, fks_ptr, fvs_ptr, stride_fs, stride_fh, stride_fss, stride_fsh, sm_scale_log2,
        True, N_SINK, N_RECENT, BLOCK_N, D, EXACT)


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qn, stride_qh,
    k_ptr, v_ptr, stride_ks, stride_kh,
    ks_ptr, vs_ptr, kz_ptr, vz_ptr, stride_ss, stride_sh,
    pk_ptr, pv_ptr, pks_ptr, pvs_ptr, stride_ps, stride_ph, stride_pss, stride_psh,
    fk_ptr, fv_ptr, fks_ptr, fvs_ptr, stride_fs, stride_fh, stride_fss, stride_fsh,
    bt_ptr, stride_bt, lens_ptr, qstart_ptr, slots_ptr, tile_seq_ptr, tile_q_ptr,
    o_ptr, stride_on, stride_oh, sm_scale_log2,
    KIND: tl.constexpr, G: tl.constexpr, QM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_SIZE: tl.constexpr, SIDE: tl.constexpr, N_SINK: tl.constexpr, N_RECENT: tl.constexpr,
    EXACT: tl.constexpr, FRESH_IN_SIDE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_seq_ptr + t)
    q0 = tl.load(tile_q_ptr + t)
    L = tl.load(lens_ptr + b)
    qs = tl.load(qstart_ptr + b)
    qlen = tl.load(qstart_ptr + b + 1) - qs
    first = L - qlen  # position of the row's first new token
    offs_m = tl.arange(0, BLOCK_M)
    qi = q0 + offs_m // G
    heads = h * G + offs_m % G
    mask_m = (offs_m < QM * G) & (qi < qlen)
    qpos = first + qi
    lo_q = first + q0
    last = first + tl.minimum(q0 + QM, qlen) - 1  # the tile's last query position
    tok = (qs + qi).to(tl.int64)
    q_rows = q_ptr + tok[:, None] * stride_qn + heads[:, None] * stride_qh
    o_rows = o_ptr + tok[:, None] * stride_on + heads[:, None] * stride_oh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if KIND == 2 and SIDE:  # KV4, whole layout: query and accumulator in channel order
        offs_d = tl.arange(0, D)
        q_f = tl.load(q_rows + offs_d[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
        q_sum = tl.sum(q_f, 1)
        q = _dot_operand(q_f, EXACT)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        z_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, z_acc, m_i, l_i = _int4_range_whole(
            acc, z_acc, m_i, l_i, q, q_sum, qpos, N_SINK, last - N_RECENT + 1, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr,
            kz_ptr, vz_ptr, stride_ks, stride_kh, stride_ss, stride_sh, bt_ptr, stride_bt, sm_scale_log2,
            N_SINK, N_RECENT, BLOCK_N, D, BLOCK_SIZE, EXACT)
        seq_row0 = tl.load(slots_ptr + b).to(tl.int64) * (N_SINK + N_RECENT)
        # where the tile's recent window reaches down to the sinks (every query of a short row), the two
        # INT8 ranges touch: one pass over [0, last] instead of a key tile for the sinks alone
        recent_lo = tl.maximum(lo_q - N_RECENT + 1, N_SINK)
        joined = recent_lo <= N_SINK
        sink_hi = tl.where(joined, last + 1, tl.minimum(last + 1, N_SINK))
        recent_lo = tl.where(joined, last + 1, recent_lo)
        acc, z_acc, m_i, l_i = _int8_passes_whole(  # the sinks (and the window when joined)
            acc, z_acc, m_i, l_i, q, qpos, 0, sink_hi, h, first, qs, seq_row0,
            pk_ptr, pv_ptr, pks_ptr, pvs_ptr, stride_ps, stride_ph, stride_pss, stride_psh,
            fk_ptr, fv_ptr, fks_ptr, fvs_ptr, stride_fs, stride_fh, stride_fss, stride_fsh, sm_scale_log2,
            N_SINK, N_RECENT, BLOCK_N, D, EXACT, FRESH_IN_SIDE)
        acc, z_acc, m_i, l_i = _int8_passes_whole(  # the recent window of the tile's queries
            acc, z_acc, m_i, l_i, q, qpos, recent_lo, last + 1, h, first, qs, seq_row0,
            pk_ptr, pv_ptr, pks_ptr, pvs_ptr, stride_ps, stride_ph, stride_pss, stride_psh,
            fk_ptr, fv_ptr, fks_ptr, fvs_ptr, stride_fs, stride_fh, stride_fss, stride_fsh, sm_scale_log2,
            N_SINK, N_RECENT, BLOCK_N, D, EXACT, FRESH_IN_SIDE)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(o_rows + offs_d[None, :], ((acc + z_acc[:, None]) / l_safe[:, None]).to(o_ptr.dtype.element_ty),
                 mask=mask_m[:, None])
    elif KIND == 2:
        offs_d2 = tl.arange(0, D // 2)
        q_e = tl.load(q_rows + 2 * offs_d2[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
        q_o = tl.load(q_rows + 2 * offs_d2[None, :] + 1, mask=mask_m[:, None], other=0.0).to(tl.float32)
        q_sum = tl.sum(q_e, 1) + tl.sum(q_o, 1)
        q_e = _dot_operand(q_e, EXACT)
        q_o = _dot_operand(q_o, EXACT)
        acc_e = tl.zeros([BLOCK_M, D // 2], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_M, D // 2], dtype=tl.float32)
        z_acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_e, acc_o, z_acc, m_i, l_i = _int4_range(
            acc_e, acc_o, z_acc, m_i, l_i, q_e, q_o, q_sum, qpos, 0, last + 1, b, h,
            k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, stride_ks, stride_kh, stride_ss, stride_sh,
            bt_ptr, stride_bt, sm_scale_log2, BLOCK_N, D, BLOCK_SIZE, EXACT)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(o_rows + 2 * offs_d2[None, :], ((acc_e + z_acc[:, None]) / l_safe[:, None]).to(o_ptr.dtype.element_ty),
                 mask=mask_m[:, None])
        tl.store(o_rows + 2 * offs_d2[None, :] + 1,
                 ((acc_o + z_acc[:, None]) / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=mask_m[:, None])
    else:
        offs_d = tl.arange(0, D)
        q = _dot_operand(tl.load(q_rows + offs_d[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32), EXACT)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        acc, m_i, l_i = _plain_range(acc, m_i, l_i, q, qpos, 0, last + 1, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr,
                                     stride_ks, stride_kh, stride_ss, stride_sh, bt_ptr, stride_bt, sm_scale_log2,
                                     KIND, BLOCK_N, D, BLOCK_SIZE, EXACT)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(o_rows + offs_d[None, :], (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=mask_m[:, None])


def paged_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PrefillBatch, *, kind: DecodeKind,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k_zero: torch.Tensor | None = None, v_zero: torch.Tensor | None = None,
    side: dict | None = None, fresh: dict | None = None, sm_scale: float | None = None,
    out: torch.Tensor | None = None, launch: dict | None = None, fresh_in_side: bool = False,
) -> torch.Tensor:
    """Causal attention of the packed queries q[N, Hq, D] (already rotated like the keys) over each row's
    paged cache, which already holds the step's tokens. `k`/`v` and scales as in `paged_decode_attention`.
    KV4: `side` is `KVFormat.side_tensors` and `fresh` = {"k": (codes [N, Hkv, D] int8, scale [N, Hkv]),
    "v": ...}, the INT8 copies of the step's tokens, or `fresh_in_side` when the write stored them in the side
    rows already (no row's ring wraps in the step: `PrefillInputs.direct`). Returns [N, Hq, D] in q's dtype
    (or into `out`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if (side is None) != (fresh is None and not fresh_in_side) or (fresh is not None and fresh_in_side):
        raise ValueError("KV4 prefill needs the side rows and the step's INT8 rows: `fresh`, or `fresh_in_side`")
    if side is not None and kind != DecodeKind.INT4:
        raise ValueError("side rows go with INT4 pages (KV4)")
    cfg = launch or batch.launch or DEFAULT_PREFILL_LAUNCH[(kind, side is not None)]
    group = num_q_heads // num_kv_heads
    per_tile = batch.queries_per_tile
    if per_tile * group > cfg["BLOCK_M"]:
        raise ValueError(f"prefill tiles of {per_tile} queries x {group} heads exceed BLOCK_M={cfg['BLOCK_M']}")
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if out is None:
        out = torch.empty_like(q)
    num_tiles = batch.tile_seq.shape[0]
    if num_tokens == 0 or num_tiles == 0:
        return out
    dummy = k if k_scale is None else k_scale
    s_strides = (0, 0) if k_scale is None else (k_scale.stride(0), k_scale.stride(1))
    if side is not None:
        pk, pv, pks, pvs = side["k"], side["v"], side["k_scale"], side["v_scale"]
        (fk, fks), (fv, fvs) = ((pk, pks), (pv, pvs)) if fresh_in_side else (fresh["k"], fresh["v"])
        n_sink, n_recent = side["n_sink"], side["n_recent"]
        side_args = (pk, pv, pks, pvs, pk.stride(0), pk.stride(1), pks.stride(0), pks.stride(1),
                     fk, fv, fks, fvs, fk.stride(0), fk.stride(1), fks.stride(0), fks.stride(1))
    else:
        n_sink = n_recent = 0
        side_args = (k, v, dummy, dummy, 0, 0, 0, 0, k, v, dummy, dummy, 0, 0, 0, 0)
    grid = (num_tiles, num_kv_heads)
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1),
        k, v, k.stride(0), k.stride(1),
        *(dummy if t is None else t for t in (k_scale, v_scale, k_zero, v_zero)), *s_strides,
        *side_args,
        batch.block_tables, batch.block_tables.stride(0), batch.context_lens, batch.query_start, batch.seq_slots,
        batch.tile_seq, batch.tile_query,
        out, out.stride(0), out.stride(1), sm_scale * LOG2E,
        KIND=int(kind), G=group, QM=per_tile, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], D=head_dim,
        BLOCK_SIZE=batch.block_size, SIDE=side is not None, N_SINK=n_sink, N_RECENT=n_recent,
        EXACT=interpreting(), FRESH_IN_SIDE=fresh_in_side, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
