// Split-KV paged decode attention over an FP8 (e4m3) cache with one float32 scale per token and head,
// written against the tensor-core fragment layout like int4_decode.cu (read that file's header first).
//
// Why CUDA and not Triton: Triton converts e4m3 to bf16 one value at a time through f32 (two
// conversions and a pack per value) and gathers V's bytes through shared memory, so its FP8 kernel
// ran no faster than cuDNN on BF16 (bench/kernel_notes.md). Here every pair of codes becomes an fp16x2
// MMA operand with one `cvt.rn.f16x2.e4m3x2` (exact: every e4m3 value is an fp16), and V's token pairs
// come from one prmt per two channels.
//
// Work: one warp per (KV head, sequence, split); a block holds the KV heads of one (sequence, split).
// Each warp streams 16-token tiles (inside one cache page) through a ring of shared-memory stages with
// cp.async. Per tile, mma.m16n8k16 with fp16 operands and fp32 accumulators:
//   S^T[t, h] = C_K[t, :] . Q'[h, :]          tokens on M (16), query heads on N (8, G <= 8 real)
//   x[t, h]   = ks_t * S^T                     (Q' = q sm_scale log2 e, so x is a log2-domain score)
//   O^T[d, h] += C_V^T[d, :] . W^T[:, h],      W[t, h] = 2^(x + log2 vs_t - mv_h)
// The P.V operand carries the V scale in its exponent: a float32 scale (amax / 448) times p would
// leave fp16's normal range for small values, so each head keeps a second running maximum mv of
// x + log2 vs (lazily, like the softmax's m) and W <= 2^LAZY; the output is acc 2^(mv - m) / l with
// l = sum 2^(x - m) kept in float32. Channels: lane (g = lane/4, j = lane%4) reads K bytes [32j, 32j+32)
// of tokens g and g+8 (four channels per 32-bit word, two words per k-step) and V bytes [16g, 16g+16)
// of tokens 2j, 2j+1, 2j+8, 2j+9; O^T's m-tile e row r is channel 16g + 4 (e / 2) + 2 (e % 2) + r / 8.
// The query enters as fp16 after its sm_scale log2(e) factor (0.1275 at head_dim 128: |q| below ~5e5).
// Codes are never NaN (the writer clamps to +-448, the pools are zero-filled); V codes of tokens
// outside the split are zeroed anyway on the first and last tile, so stray bytes cannot reach the sums.
// Outputs match the Triton split kernel's: o_part[(b*Hq + head)*P + split, :] (normalised) and its
// log2-sum-exp, merged by the same kernels.
//
// Compiled with -DSIDE_INT8 the same kernel is KV4's INT8 work item: codes are symmetric INT8 (same
// row layout and float32 scales as FP8), one split per (KV head, sequence) over the sequence's protected
// rows (its SUBS warps each over a run of whole tiles, combined through shared memory), and the epilogue
// merges its partial with the INT4 body's split partials and writes the output.
// The protected rows are contiguous: a sequence owns rows [slot * budget, (slot + 1) * budget) of the side
// buffer (sinks first, then a ring of the recent positions), and at context L the valid ones are exactly
// the first min(L, budget) (the ring has been filled in order), so attention, which does not care about
// token order, reads them as one range.

#include "decode_cuda_common.cuh"

#ifdef SIDE_INT8
// four INT8 codes -> two exact fp16x2 (bytes 0, 1 and 2, 3): the fp16 with bits 0x6400 | u is 1024 + u, and
// u = c + 128 for the signed code c, so one prmt and one subtraction of 1152 per pair
__device__ __forceinline__ void codes4_to_half2x2(u32 x, u32& lo, u32& hi) {
    const u32 u = x ^ 0x80808080u;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(prmt(u, 0x64646464u, 0x4140u)), "r"(0x64806480u));
    asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(prmt(u, 0x64646464u, 0x4342u)), "r"(0x64806480u));
}
#else
// four e4m3 codes -> two fp16x2 (bytes 0, 1 and 2, 3), the lower byte in the lower half: exact
__device__ __forceinline__ void codes4_to_half2x2(u32 x, u32& lo, u32& hi) {
    asm("{ .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n }"
        : "=r"(lo), "=r"(hi) : "r"(x));
}
#endif

#ifndef STAGES
#define STAGES 3
#endif
#ifndef WARPS
#define WARPS 8  // per block: SUBS per KV head of a (sequence, split)
#endif
#ifndef SUBS
#define SUBS 1  // warps per KV head: the INT8 item's protected rows cut into SUBS runs of whole tiles
#endif
#ifndef LAZY
#define LAZY 6.f  // log2 headroom of the lazy rescales
#endif
// The cache's strides are compile-time constants (one compilation per model shape): bytes per cache row
// (all KV heads) and per head of the codes, float32 elements per row and per head of the scales.
#ifndef KV_ROW
#define KV_ROW 1024
#define KV_HEAD 128
#define S_ROW 8
#define S_HEAD 1
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // per SM: caps the registers at 65536 / (32 * WARPS * MIN_BLOCKS)
#endif
// A stage: K [16 tokens x 128 B], V likewise, then 16 K scales and 16 V scales (float32).
#define STAGE_BYTES 4224
#define K_OFF 0
#define V_OFF 2048
#define SK_OFF 4096
#define SV_OFF 4160
#define MIN_SCALE 1e-30f  // log2 of a zero scale (an all-zero row, codes 0) stays finite

// Byte offset of (token row, 16-byte chunk) inside a K or V tile: chunks XOR the row's low three bits,
// so the 16-byte reads of rows (g, g+1) and of rows (2j, 2j+2, ...) hit distinct banks.
__device__ __forceinline__ int tile_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// o[0..16) += w * p[0..16) (float32, read where `live`: see load16_if)
__device__ __forceinline__ void add_weighted16(float (&o)[16], const float* p, bool live, float w) {
    #pragma unroll
    for (int e = 0; e < 16; e += 4) {
        const U4 x = load16_if(p + e, live);
        o[e] += w * bits_to_float(x.x);
        o[e + 1] += w * bits_to_float(x.y);
        o[e + 2] += w * bits_to_float(x.z);
        o[e + 3] += w * bits_to_float(x.w);
    }
}

#ifdef SIDE_INT8
// The decode step's new token, which the item stores itself (KV4 with a recent window: the INT4 body never
// reads it this step, only the item does, through its INT8 side row): no write kernel runs before the
// attention. `write` 0 leaves the cache as it is (the Triton write ran). The arithmetic is the Triton write's
// (kv_write.py) operation by operation, so the bytes are the same: INT4 scale fp16(div_rn(hi - lo, 15)), zero
// fp16(lo), code clamp(rint(div_rn(x - zero, scale)), 0, 15); INT8 scale amax * inv127 (torch's CUDA division
// by a constant), code clamp(rint(div_rn(x, scale)), -127, 127). The kernel's nw_* arguments (the launcher
// passes ints, doubles and pointers only).
struct NewRows {
    const u16* k; const u16* v;               // bf16 [B, Hkv, 128] rows (K rotated already where the cache is)
    int stride_kn, stride_kh, stride_vn, stride_vh;  // elements
    const long long* slots;                   // [B] cache slot of the new token (-1: padding, nothing written)
    const long long* rows;                    // [B] its side row (-1: none)
    u8* k4; u8* v4;                           // INT4 pages [slots, Hkv, 64]
    int stride_4s, stride_4h;                 // bytes
    u16* k_scale; u16* k_zero; u16* v_scale; u16* v_zero;  // fp16 [slots, Hkv, 128 / group]
    int stride_ms, stride_mh;                 // elements
    int group;                                // channels per INT4 group: a power of two, 4 .. 128
    float inv127;                             // fl32(1 / 127)
    int write;
};

__device__ __forceinline__ float fmin_(float a, float b) {
    float d;
    asm("min.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ float fabs_(float a) {
    float d;
    asm("abs.f32 %0, %1;" : "=f"(d) : "f"(a));
    return d;
}

__device__ __forceinline__ float rint_(float a) {  // ties to even
    float d;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(d) : "f"(a));
    return d;
}

__device__ __forceinline__ float div_rn(float a, float b) {  // correctly rounded, as Triton's div_rn
    float d;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ float mul_rn(float a, float b) {  // never contracted into an FMA
    float d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ float sub_rn(float a, float b) {
    float d;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ u16 half_bits(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// lane holds channels 4 lane .. 4 lane + 3 of one row (x): the INT4 page row at (slot, head) and, with
// `side_row` >= 0, the INT8 side row
__device__ __forceinline__ void store_new_row(const float (&x)[4], int lane, const NewRows& nw, bool value,
                                              long long slot, int head, u8* side_codes, float* side_scales,
                                              long long side_row) {
    float lo = fmin_(fmin_(x[0], x[1]), fmin_(x[2], x[3])), hi = fmax_(fmax_(x[0], x[1]), fmax_(x[2], x[3]));
    float amax = fmax_(fmax_(fabs_(x[0]), fabs_(x[1])), fmax_(fabs_(x[2]), fabs_(x[3])));
    for (int d = 1; d < nw.group / 4; d <<= 1) {
        lo = fmin_(lo, __shfl_xor_sync(0xffffffffu, lo, d));
        hi = fmax_(hi, __shfl_xor_sync(0xffffffffu, hi, d));
    }
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) amax = fmax_(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    const u16 scale16 = half_bits(div_rn(sub_rn(hi, lo), 15.f)), zero16 = half_bits(lo);
    const float scale = half_to_float(scale16), zero = half_to_float(zero16);
    const float safe = scale > 0.f ? scale : 1.f;
    u32 levels[4];
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float y = fmin_(fmax_(rint_(div_rn(sub_rn(x[e], zero), safe)), 0.f), 15.f);
        levels[e] = scale > 0.f ? (u32)y : 0u;
    }
    const long long page = slot * nw.stride_4s + head * nw.stride_4h + 2 * lane;
    *(u16*)((value ? nw.v4 : nw.k4) + page) = (u16)(levels[0] | levels[1] << 4 | levels[2] << 8 | levels[3] << 12);
    if ((4 * lane) % nw.group == 0) {
        const long long meta = slot * nw.stride_ms + head * nw.stride_mh + 4 * lane / nw.group;
        (value ? nw.v_scale : nw.k_scale)[meta] = scale16;
        (value ? nw.v_zero : nw.k_zero)[meta] = zero16;
    }
    if (side_row < 0) return;
    const float s8 = mul_rn(amax, nw.inv127), safe8 = s8 > 0.f ? s8 : 1.f;
    u32 codes = 0;
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int c = (int)fmin_(fmax_(rint_(div_rn(x[e], safe8)), -127.f), 127.f);
        codes |= (u32)(c & 0xff) << (8 * e);
    }
    *(u32*)(side_codes + side_row * KV_ROW + (long long)head * KV_HEAD + 4 * lane) = codes;
    if (lane == 0) side_scales[side_row * S_ROW + (long long)head * S_HEAD] = s8;
}
#endif

extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) fp8_decode_split(
    const u16* q, int stride_qb, int stride_qh, const u8* k, const u8* v, const float* ks, const float* vs,
    const int* block_tables, int stride_bt, const int* context_lens, const int* split_ptr,
    float* o_part, float* lse_part, int num_q_heads, int num_partials, int num_kv_heads, int group,
    int block_shift, int start, int end_off, double sm_scale_log2,
    const int* seq_slots, int budget, void* out, int stride_outb, int stride_outh, int out_f32, int rotate_q
#ifdef SIDE_INT8
    , const u16* nw_k, const u16* nw_v, int nw_stride_kn, int nw_stride_kh, int nw_stride_vn, int nw_stride_vh,
    const long long* nw_slots, const long long* nw_rows, u8* nw_k4, u8* nw_v4, int nw_stride_4s, int nw_stride_4h,
    u16* nw_k_scale, u16* nw_k_zero, u16* nw_v_scale, u16* nw_v_zero, int nw_stride_ms, int nw_stride_mh,
    int nw_group, double nw_inv127, int nw_write
#endif
    ) {
    extern __shared__ __align__(16) u8 smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5, sub = warp % SUBS;
    const int h = blockIdx.z * (WARPS / SUBS) + warp / SUBS;
    if (h >= num_kv_heads) return;  // all SUBS warps of the head alike
    const int s = blockIdx.x, b = blockIdx.y;
    const int L = context_lens[b];
    const int split = *split_ptr;
#ifdef SIDE_INT8  // the protected rows [0, min(L, budget)); the INT4 body covers [start, L - end_off)
    // warp `sub` of the head takes the sub-th run of whole tiles (a short context is a serial chain of up to
    // budget / 16 tiles for one warp otherwise: 9 tiles, ~13 us at 16 + 128 rows); runs past the end are empty
    const int all_hi = L < budget ? L : budget;
    const int run = 16 * ((((all_hi + 15) >> 4) + SUBS - 1) / SUBS);
    const int lo = min(all_hi, sub * run), hi = min(all_hi, lo + run);
    const long long side_row0 = (long long)seq_slots[b] * budget;
    const NewRows nw = {nw_k, nw_v, nw_stride_kn, nw_stride_kh, nw_stride_vn, nw_stride_vh, nw_slots, nw_rows, nw_k4,
                        nw_v4, nw_stride_4s, nw_stride_4h, nw_k_scale, nw_k_zero, nw_v_scale, nw_v_zero, nw_stride_ms,
                        nw_stride_mh, nw_group, (float)nw_inv127, nw_write};
    // the step's new token first (K by the head's first warp, V by its second; both by one with SUBS 1), visible
    // to the head's warps before any copies its side row
    if (nw.write) {
        const long long slot = nw.slots[b], row = nw.rows[b];
        for (int part = sub; part < 2 && slot >= 0; part += SUBS) {
            const long long bb = b, hh = h;
            const u16* src = part ? nw.v + bb * nw.stride_vn + hh * nw.stride_vh : nw.k + bb * nw.stride_kn + hh * nw.stride_kh;
            const U2 w = *(const U2*)(src + 4 * lane);
            const float x[4] = {bits_to_float(w.x << 16), bits_to_float(w.x & 0xFFFF0000u), bits_to_float(w.y << 16),
                                bits_to_float(w.y & 0xFFFF0000u)};
            store_new_row(x, lane, nw, part == 1, slot, h, (u8*)(part ? v : k), (float*)(part ? vs : ks), row);
        }
        __threadfence_block();
#if SUBS > 1
        asm volatile("bar.sync %0, %1;" :: "r"(1 + warp / SUBS), "r"(32 * SUBS) : "memory");
#else
        __syncwarp();
#endif
    }
#else
    (void)sub;
    const int end = L - end_off > start ? L - end_off : start;
    const int lo = start + s * split;
    const int hi = lo + split < end ? lo + split : end;
    if (lo >= hi) return;
#endif
    const int g = lane >> 2, j = lane & 3;
#ifndef SIDE_INT8
    const int* bt = block_tables + (long long)b * stride_bt;
#endif

    // Query fragments: lane (g, j) holds head g's channels 32j + 4m + {0, 1} (qa[m]) and {2, 3} (qb[m])
    u32 qa[8], qb[8];
    {
        float qf[32];  // channels 32j .. 32j+31 in order
        load_query_channels(qf, q + (long long)b * stride_qb + (long long)(h * group + g) * stride_qh + 32 * j, g < group);
#ifdef SIDE_INT8
        // the raw query, rotated here as the INT4 body rotates it (same bits), so this kernel needs
        // nothing from the body until its merge and can run beside it
        if (rotate_q) hadamard_rotate_bf16(qf, j);
#endif
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
            float f[8];
            #pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = qf[8 * c + e] * (float)sm_scale_log2;
            qa[2 * c] = pack_half2(f[0], f[1]);
            qb[2 * c] = pack_half2(f[2], f[3]);
            qa[2 * c + 1] = pack_half2(f[4], f[5]);
            qb[2 * c + 1] = pack_half2(f[6], f[7]);
        }
    }

    // ---- the copy side: lane copies 16-byte chunk lane % 8 of rows lane / 8 + {0, 4, 8, 12} of K and V
    // (four whole 128-byte rows per instruction), and one scale (K's for lanes 0-15, V's for 16-31) of
    // token lane % 16. Everything but the page's first row is a per-lane constant.
    u8* ring = smem + (threadIdx.x >> 5) * (STAGES * STAGE_BYTES);
    const int crow = lane >> 3, cchunk = lane & 7;
    // rows crow and crow + 8 share a swizzle, as do crow + 4 and crow + 12
    const u32 c_dst0 = smem_addr(ring) + tile_offset(crow, cchunk), c_dst1 = smem_addr(ring) + tile_offset(crow + 4, cchunk);
    const u32 s_dst = smem_addr(ring) + SK_OFF + 4 * lane;
    const long long lane_codes = (long long)crow * KV_ROW + (long long)h * KV_HEAD + 16 * cchunk;
    const u8* k_lane = k + lane_codes;
    const u8* v_lane = v + lane_codes;
    const float* s_lane = (lane < 16 ? ks : vs) + (long long)(lane & 15) * S_ROW + h * S_HEAD;
    const int t_first = lo & ~15;
    const int n_tiles = hi > lo ? ((hi - 1 - t_first) >> 4) + 1 : 0;
    const int page_mask = (1 << block_shift) - 1;
#ifdef SIDE_INT8
    (void)s, (void)page_mask;  // one split, no pages
#endif

    auto issue = [&](int i, u32 st) {  // branch-free: tiles past the end copy nothing
        const bool live = i < n_tiles;
        const int t0 = t_first + 16 * (live ? i : n_tiles - 1);
#ifdef SIDE_INT8
        // one contiguous range; a row past its end (or any row of an empty range, t0 < 0) is not read and its
        // address is the buffer's first row, never one past the buffer's ends
        const long long row0 = side_row0 + t0;
        const u32 n0 = live && t0 + crow < hi ? 16 : 0, n1 = live && t0 + crow + 4 < hi ? 16 : 0;
        const u32 n2 = live && t0 + crow + 8 < hi ? 16 : 0, n3 = live && t0 + crow + 12 < hi ? 16 : 0;
        const u32 n4 = live && t0 + (lane & 15) < hi ? 4 : 0;
        const long long r0 = n0 ? row0 : 0, r1 = n1 ? row0 + 4 : 0, r2 = n2 ? row0 + 8 : 0, r3 = n3 ? row0 + 12 : 0;
        const long long rs = n4 ? row0 : 0;
#else
        const long long row0 = (bt[t0 >> block_shift] << block_shift) + (t0 & page_mask);
        const u32 n0 = live ? 16 : 0, n1 = n0, n2 = n0, n3 = n0, n4 = live ? 4 : 0;
        const long long r0 = row0, r1 = row0 + 4, r2 = row0 + 8, r3 = row0 + 12, rs = row0;
#endif
        copy16(c_dst0 + st + K_OFF, k_lane + r0 * KV_ROW, n0);
        copy16(c_dst1 + st + K_OFF, k_lane + r1 * KV_ROW, n1);
        copy16(c_dst0 + st + K_OFF + 1024, k_lane + r2 * KV_ROW, n2);
        copy16(c_dst1 + st + K_OFF + 1024, k_lane + r3 * KV_ROW, n3);
        copy16(c_dst0 + st + V_OFF, v_lane + r0 * KV_ROW, n0);
        copy16(c_dst1 + st + V_OFF, v_lane + r1 * KV_ROW, n1);
        copy16(c_dst0 + st + V_OFF + 1024, v_lane + r2 * KV_ROW, n2);
        copy16(c_dst1 + st + V_OFF + 1024, v_lane + r3 * KV_ROW, n3);
        copy4(s_dst + st, s_lane + rs * S_ROW, n4);
        copy_commit();
    };

    // ---- the compute side: per-lane offsets of what it reads from a stage (rows + 8 sit 1024 bytes on)
    const int r_k0 = K_OFF + tile_offset(g, 2 * j), r_k1 = K_OFF + tile_offset(g, 2 * j + 1);
    const int r_v0 = V_OFF + tile_offset(2 * j, g), r_v1 = V_OFF + tile_offset(2 * j + 1, g);

    float acc[8][4];  // O^T m-tile e: (c0, c1) channel 16g + 4(e/2) + 2(e%2), (c2, c3) the next; cols heads 2j, 2j+1
    #pragma unroll
    for (int e = 0; e < 8; ++e) acc[e][0] = acc[e][1] = acc[e][2] = acc[e][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, mv0 = NEG_INF, mv1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    // S^T = C_K . Q'^T of one tile: rows tokens (g, g+8), columns heads (2j, 2j+1); two accumulator chains
    auto qk = [&](const u8* st, float* sc) {
        float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
        const U4 ka0 = *(const U4*)(st + r_k0), ka1 = *(const U4*)(st + r_k1);  // token g
        const U4 kb0 = *(const U4*)(st + r_k0 + 1024), kb1 = *(const U4*)(st + r_k1 + 1024);  // token g + 8
        const u32 wa[8] = {ka0.x, ka0.y, ka0.z, ka0.w, ka1.x, ka1.y, ka1.z, ka1.w};
        const u32 wb[8] = {kb0.x, kb0.y, kb0.z, kb0.w, kb1.x, kb1.y, kb1.z, kb1.w};
        #pragma unroll
        for (int m = 0; m < 8; ++m) {
            u32 a_lo, a_hi, b_lo, b_hi;
            codes4_to_half2x2(wa[m], a_lo, a_hi);
            codes4_to_half2x2(wb[m], b_lo, b_hi);
            mma16816((m & 1) ? sb : sa, a_lo, b_lo, a_hi, b_hi, qa[m], qb[m]);
        }
        #pragma unroll
        for (int e = 0; e < 4; ++e) sc[e] = sa[e] + sb[e];
    };

    // the rest of a tile: scores, online softmax, O^T += C_V^T . W^T
    auto finish = [&](const u8* st, const int t0, const float* sc) {
        const float ks0 = *(const float*)(st + SK_OFF + 4 * g), ks1 = *(const float*)(st + SK_OFF + 4 * g + 32);
        float lv0 = fast_log2(fmax_(*(const float*)(st + SV_OFF + 4 * g), MIN_SCALE));
        float lv1 = fast_log2(fmax_(*(const float*)(st + SV_OFF + 4 * g + 32), MIN_SCALE));
        float x[4], y[4];
        x[0] = ks0 * sc[0];
        x[1] = ks0 * sc[1];
        x[2] = ks1 * sc[2];
        x[3] = ks1 * sc[3];
        U4 va = *(const U4*)(st + r_v0), vb = *(const U4*)(st + r_v1);  // tokens 2j, 2j+1
        U4 vc = *(const U4*)(st + r_v0 + 1024), vd = *(const U4*)(st + r_v1 + 1024);  // 2j+8, 2j+9
        if (t0 < lo || t0 + 16 > hi) {  // tokens outside [lo, hi): never read as numbers
            const u32 n = hi - lo;
            const bool ok0 = (u32)(t0 + g - lo) < n, ok1 = (u32)(t0 + g + 8 - lo) < n;
            x[0] = ok0 ? x[0] : NEG_INF;
            x[1] = ok0 ? x[1] : NEG_INF;
            x[2] = ok1 ? x[2] : NEG_INF;
            x[3] = ok1 ? x[3] : NEG_INF;
            lv0 = ok0 ? lv0 : 0.f;
            lv1 = ok1 ? lv1 : 0.f;
            const U4 zero = {0u, 0u, 0u, 0u};
            va = (u32)(t0 + 2 * j - lo) < n ? va : zero;
            vb = (u32)(t0 + 2 * j + 1 - lo) < n ? vb : zero;
            vc = (u32)(t0 + 2 * j + 8 - lo) < n ? vc : zero;
            vd = (u32)(t0 + 2 * j + 9 - lo) < n ? vd : zero;
        }
        y[0] = x[0] + lv0;
        y[1] = x[1] + lv0;
        y[2] = x[2] + lv1;
        y[3] = x[3] + lv1;
        // Lazy rescaling: the running maxima per head move only when a value passes them by more than
        // LAZY (log2 units), so most tiles skip the cross-lane maxima and the accumulator rescale.
        const float lm0 = fmax_(x[0], x[2]), lm1 = fmax_(x[1], x[3]);
        const float ly0 = fmax_(y[0], y[2]), ly1 = fmax_(y[1], y[3]);
        if (__any_sync(0xffffffffu, lm0 > m0 + LAZY || lm1 > m1 + LAZY || ly0 > mv0 + LAZY || ly1 > mv1 + LAZY)) {
            float mt0 = lm0, mt1 = lm1, yt0 = ly0, yt1 = ly1;
            #pragma unroll
            for (int d = 4; d < 32; d <<= 1) {
                mt0 = fmax_(mt0, __shfl_xor_sync(0xffffffffu, mt0, d));
                mt1 = fmax_(mt1, __shfl_xor_sync(0xffffffffu, mt1, d));
                yt0 = fmax_(yt0, __shfl_xor_sync(0xffffffffu, yt0, d));
                yt1 = fmax_(yt1, __shfl_xor_sync(0xffffffffu, yt1, d));
            }
            // finite: every tile has a valid token, and log2 of its scale is finite (MIN_SCALE)
            const float mn0 = fmax_(m0, mt0), mn1 = fmax_(m1, mt1), vn0 = fmax_(mv0, yt0), vn1 = fmax_(mv1, yt1);
            const float al0 = fast_exp2(m0 - mn0), al1 = fast_exp2(m1 - mn1);  // 0 on the first tile
            const float av0 = fast_exp2(mv0 - vn0), av1 = fast_exp2(mv1 - vn1);
            m0 = mn0;
            m1 = mn1;
            mv0 = vn0;
            mv1 = vn1;
            l0 *= al0;
            l1 *= al1;
            scale_columns(acc, av0, av1);
        }
        l0 += fast_exp2(x[0] - m0) + fast_exp2(x[2] - m0);
        l1 += fast_exp2(x[1] - m1) + fast_exp2(x[3] - m1);
        // W^T as the B operand: W of head g at tokens (2j, 2j+1) and (2j+8, 2j+9)
        const u32 w01 = pack_half2(fast_exp2(y[0] - mv0), fast_exp2(y[1] - mv1));  // token g: heads 2j, 2j+1
        const u32 w23 = pack_half2(fast_exp2(y[2] - mv0), fast_exp2(y[3] - mv1));  // token g + 8
        const PvOperand pb = pv_operand(w01, w23, lane);
        // O^T += C_V^T . W^T: word w of each token holds channels 16g + 4w .. 16g + 4w + 3
        const u32 wva[4] = {va.x, va.y, va.z, va.w}, wvb[4] = {vb.x, vb.y, vb.z, vb.w};
        const u32 wvc[4] = {vc.x, vc.y, vc.z, vc.w}, wvd[4] = {vd.x, vd.y, vd.z, vd.w};
        #pragma unroll
        for (int w = 0; w < 4; ++w) {
            u32 c0, c1, c2, c3, d0, d1, d2, d3;  // channel 4w + r of tokens (2j, 2j+1) and (2j+8, 2j+9)
            codes4_to_half2x2(prmt(wva[w], wvb[w], 0x5140u), c0, c1);
            codes4_to_half2x2(prmt(wva[w], wvb[w], 0x7362u), c2, c3);
            codes4_to_half2x2(prmt(wvc[w], wvd[w], 0x5140u), d0, d1);
            codes4_to_half2x2(prmt(wvc[w], wvd[w], 0x7362u), d2, d3);
            mma16816(acc[2 * w], c0, c1, d0, d1, pb.b0, pb.b1);
            mma16816(acc[2 * w + 1], c2, c3, d2, d3, pb.b0, pb.b1);
        }
    };

    stream_tiles<STAGES, STAGE_BYTES>(ring, n_tiles, t_first, issue, qk, finish);  // the header says how

    #pragma unroll
    for (int d = 4; d < 32; d <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, d);
        l1 += __shfl_xor_sync(0xffffffffu, l1, d);
    }
#ifdef SIDE_INT8
#if SUBS > 1
    // the head's runs combined: each warp leaves its state in its own (drained) ring, the first adds the others
    {
        float* mine = (float*)ring;
        __syncwarp();  // the last tile's shared reads are done before the ring is overwritten
        if (sub) {
            #pragma unroll
            for (int e = 0; e < 8; ++e)
                #pragma unroll
                for (int c = 0; c < 4; ++c) mine[(4 * e + c) * 32 + lane] = acc[e][c];
            const float st[6] = {m0, m1, mv0, mv1, l0, l1};
            #pragma unroll
            for (int k = 0; k < 6; ++k) mine[(32 + k) * 32 + lane] = st[k];
        }
        asm volatile("bar.sync %0, %1;" :: "r"(1 + warp / SUBS), "r"(32 * SUBS) : "memory");
        if (sub) return;
        for (int o = 1; o < SUBS; ++o) {
            const float* other = (const float*)(smem + (warp + o) * (STAGES * STAGE_BYTES));
            float mo[2] = {other[32 * 32 + lane], other[33 * 32 + lane]};
            float vo[2] = {other[34 * 32 + lane], other[35 * 32 + lane]};
            float lo_[2] = {other[36 * 32 + lane], other[37 * 32 + lane]};
            float* m_[2] = {&m0, &m1};
            float* mv_[2] = {&mv0, &mv1};
            float* l_[2] = {&l0, &l1};
            float ga[2], gb[2];
            #pragma unroll
            for (int c = 0; c < 2; ++c) {  // a run without tokens has m = mv = -inf, l = 0, acc = 0
                const float M = fmax_(*m_[c], mo[c]), MV = fmax_(*mv_[c], vo[c]);
                const float fa = *m_[c] == NEG_INF ? 0.f : fast_exp2(*m_[c] - M);
                const float fb = mo[c] == NEG_INF ? 0.f : fast_exp2(mo[c] - M);
                ga[c] = *mv_[c] == NEG_INF ? 0.f : fast_exp2(*mv_[c] - MV);
                gb[c] = vo[c] == NEG_INF ? 0.f : fast_exp2(vo[c] - MV);
                *l_[c] = *l_[c] * fa + lo_[c] * fb;
                *m_[c] = M;
                *mv_[c] = MV;
            }
            #pragma unroll
            for (int e = 0; e < 8; ++e)
                #pragma unroll
                for (int c = 0; c < 4; ++c) acc[e][c] = acc[e][c] * ga[c & 1] + other[(4 * e + c) * 32 + lane] * gb[c & 1];
        }
    }
#endif
    // merge with the INT4 body's splits over [start, L - end_off): out = sum_s w_s o_s / sum_s w_s, once the
    // body's grid is done (launched as its programmatic dependent, this kernel may have started before)
    wait_for_prerequisite_grid();
    const int body_end = L - end_off > start ? L - end_off : start;
    const int n_main = (body_end - start + split - 1) / split;
#endif
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int head = 2 * j + c;
        if (head >= group) break;
        const float l = c ? l1 : l0, m = c ? m1 : m0, mv = c ? mv1 : mv0;
        // W's units back to the softmax's (no tokens, l = 0: nothing, not 2^(-inf + inf))
        const float f = l > 0.f ? fast_exp2(mv - m) / l : 0.f;
        float o[16];
        #pragma unroll
        for (int w = 0; w < 4; ++w) {
            o[4 * w] = acc[2 * w][c] * f;
            o[4 * w + 1] = acc[2 * w][2 + c] * f;
            o[4 * w + 2] = acc[2 * w + 1][c] * f;
            o[4 * w + 3] = acc[2 * w + 1][2 + c] * f;
        }
        const float lse = l > 0.f ? m + fast_log2(l) : NEG_INF;
        const long long row = (long long)b * num_q_heads + h * group + head;
#ifdef SIDE_INT8
        // out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - mx). One split (large batches, short contexts)
        // is read directly; more are spread over the 8 lanes of these heads (g), their weights shared by
        // shuffles and their partials read with predicated loads, so no load waits for another (a serial walk
        // over the splits cost a load latency each: B16 x 4,096 took 0.047 ms against 0.042)
        const long long part0 = row * num_partials;
        const float* op0 = o_part + part0 * HEAD_DIM + 16 * g;
        const unsigned peers = 0x11111111u << j;
        float mx = lse;
        if (n_main == 1) {
            mx = fmax_(mx, lse_part[part0]);
        } else if (n_main > 1) {
            for (int sp = g; sp < n_main; sp += 8) mx = fmax_(mx, lse_part[part0 + sp]);
            #pragma unroll
            for (int d = 4; d < 32; d <<= 1) mx = fmax_(mx, __shfl_xor_sync(peers, mx, d));
        }
        mx = mx == NEG_INF ? 0.f : mx;
        float den = l > 0.f ? fast_exp2(lse - mx) : 0.f;
        #pragma unroll
        for (int e = 0; e < 16; ++e) o[e] *= den;
        if (n_main == 1) {
            const float w = fast_exp2(lse_part[part0] - mx);
            add_weighted16(o, op0, true, w);
            den += w;
        }
        for (int sp0 = 0; n_main > 1 && sp0 < n_main; sp0 += 8) {
            const float mine = sp0 + g < n_main ? fast_exp2(lse_part[part0 + sp0 + g] - mx) : 0.f;
            #pragma unroll
            for (int t = 0; t < 8; ++t) {  // past the last split: weight 0, nothing read
                const float w = __shfl_sync(peers, mine, 4 * t + j);
                const bool live = sp0 + t < n_main;
                add_weighted16(o, op0 + (sp0 + t) * HEAD_DIM, live, w);
                den += w;
            }
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
        const long long at = (long long)b * stride_outb + (long long)(h * group + head) * stride_outh + 16 * g;
        if (out_f32) {
            float* op = (float*)out + at;
            #pragma unroll
            for (int e = 0; e < 16; e += 4) store4(op + e, o[e] * inv, o[e + 1] * inv, o[e + 2] * inv, o[e + 3] * inv);
        } else {
            u32 packed[8];
            #pragma unroll
            for (int e = 0; e < 8; ++e)
                packed[e] = (float_bits(round_to_bf16(o[2 * e] * inv)) >> 16) |
                            (float_bits(round_to_bf16(o[2 * e + 1] * inv)) & 0xFFFF0000u);
            U4* op = (U4*)((u16*)out + at);
            op[0] = U4{packed[0], packed[1], packed[2], packed[3]};
            op[1] = U4{packed[4], packed[5], packed[6], packed[7]};
        }
#else
        const long long part = row * num_partials + s;
        float* op = o_part + part * HEAD_DIM + 16 * g;
        #pragma unroll
        for (int e = 0; e < 16; e += 4) store4(op + e, o[e], o[e + 1], o[e + 2], o[e + 3]);
        if (g == 0) lse_part[part] = lse;
#endif
    }
}
