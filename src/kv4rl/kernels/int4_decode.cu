// Split-KV paged decode attention over an INT4 cache, written against the tensor-core fragment layout.
//
// Why CUDA and not Triton: at 4 bits a cached value must cost about 3.7 issued lane-instructions or
// the kernel stops being memory-bound on an H200 (bench/kernel_notes.md). Triton unpacks one byte
// per register and gathers V bytes through shared memory; here every 32-bit word of codes becomes
// fp16x2 MMA operands in registers: one lop3 per pair of codes (the bits 0x6400 | c are the fp16
// 1024 + c) and, for V, a prmt to pair two tokens' codes of a channel.
//
// Work: one warp per (KV head, sequence, split); a block holds the KV heads of one (sequence, split),
// so its warps read adjacent bytes of the same cache rows. Each warp streams 16-token tiles (inside
// one cache page) through a ring of shared-memory stages with cp.async. Per tile, mma.m16n8k16 with
// fp16 operands and fp32 accumulators:
//   S^T[t, h] = C_K[t, :] . Q'[h, :]          tokens on M (16), query heads on N (8, G <= 8 real)
//   x[t, h]   = ks_t * S^T + kz_t * sum(Q'[h])   (k = ks * c + kz per token and head; Q' = q sm_scale log2 e)
//   O^T[d, h] += C_V^T[d, :] . (p * vs)^T[:, h],  zacc[h] += sum_t p[t, h] vz_t
// K's codes keep their 1024 offset (the query's high-nibble channels are divided by 16 and the
// offset's dot product subtracted once); V's are made exact with one fp16x2 op per pair. P^T's
// fragment is assembled from S^T's with four shuffles. Softmax is online with a lazy rescale: the
// running max moves only when a score passes it by LAZY, so most tiles skip the cross-lane max.
// Ranges: the fp16 operands hold q * sm_scale * log2(e) and p * vs with p < 2^LAZY, so V's per-token
// range must stay below ~15,000 (vs < 1024); the INT4 format already keeps values in fp16's range.
// Dot products do not care which channel a register holds as long as q uses the same one: lane
// (g = lane/4, j = lane%4) reads K bytes [16j, 16j+16) of tokens g and g+8 and V bytes [8g, 8g+8) of
// tokens 2j, 2j+1, 2j+8, 2j+9; the query is loaded to match, and O^T's m-tile e row r is channel
// 16 (r % 8) + 8 (r / 8) + e, i.e. lane g writes channels 16g .. 16g+15 of heads 2j and 2j+1.
// The split [lo, hi) need not be page-aligned: tokens outside it are masked (never read as numbers:
// their scales may be garbage). With `rotate_q` the kernel applies KV4's Hadamard rotation to the
// query itself (a Walsh-Hadamard transform across the lane's registers and two shuffles).
// Outputs match the Triton split kernel's: o_part[(b*Hq + head)*P + split, :] (normalised) and its
// log2-sum-exp, merged by the same kernels.

#include "decode_cuda_common.cuh"

__device__ __forceinline__ u32 lop_or(u32 x, u32 mask) {  // (x & mask) | 0x64006400
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "n"(0x64006400));
    return r;
}

__device__ __forceinline__ u32 codes_lo(u32 x) {  // exact fp16x2 of the codes in bits 0-3 of each half
    u32 d;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(lop_or(x, 0x000F000Fu)), "r"(0x64006400u));
    return d;
}

__device__ __forceinline__ u32 codes_hi(u32 x) {  // bits 4-7: fp16 1024 + 16c, then * 1/16 - 64
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(lop_or(x, 0x00F000F0u)), "r"(0x2C002C00u), "r"(0xD400D400u));
    return d;
}

// x >> 8 as a multiply-high, so it runs on the FMA pipe: the integer ALU pipe is this kernel's busiest
__device__ __forceinline__ u32 shr8(u32 x) {
    u32 d;
    asm("mul.hi.u32 %0, %1, %2;" : "=r"(d) : "r"(x), "r"(1u << 24));
    return d;
}

// Each warp streams its tiles through a ring of STAGES shared-memory stages with cp.async, so several
// tiles per warp are in flight without holding registers. A stage: K [16 tokens x 64 B], V likewise,
// then 32 words of K scale/zero and 32 of V scale/zero.
#ifndef STAGES
#define STAGES 5
#endif
#ifndef WARPS
#define WARPS 4  // per block: one per KV head of a (sequence, split)
#endif
#ifndef LAZY
#define LAZY 6.f  // log2 headroom of the lazy softmax rescale
#endif
// The cache's strides are compile-time constants (one compilation per model shape): bytes per cache row
// (all KV heads) and per head of the INT4 codes, fp16 elements per row and per head of the scales.
#ifndef KV_ROW
#define KV_ROW 512
#define KV_HEAD 64
#define S_ROW 8
#define S_HEAD 1
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 3  // per SM: caps the registers at 65536 / (32 * WARPS * MIN_BLOCKS)
#endif
#define STAGE_BYTES 2304
#define K_OFF 0
#define V_OFF 1024
#define SK_OFF 2048
#define SV_OFF 2176

// Byte offset of (token row, byte) inside a K or V tile. Rows pair up in 128-byte units whose halves
// swap on odd units, and bytes move by 32 on every other pair of units, so the 8-byte V reads (rows
// 2j, 2j+1, 2j+8, 2j+9 at byte 8g) and the 16-byte K reads (rows g, g+8 at byte 16j) hit distinct banks.
__device__ __forceinline__ int tile_offset(int row, int byte) {
    const int unit = row >> 1;
    return unit * 128 + (((row & 1) ^ (unit & 1)) << 6) + (byte ^ (((unit >> 1) & 1) << 5));
}

// 8 K codes of one token (a 32-bit word) -> 4 fp16x2 registers (channels +0/+4, +1/+5, +2/+6, +3/+7)
// left offset: 1024 + c for the low nibbles, 1024 + 16c for the high ones. The query's high-nibble
// channels are divided by 16 and the offset sum 1024 * (sum of the query) is removed after the dot
// product, which saves the fp16 subtractions that V's codes get.
__device__ __forceinline__ void unpack_k_word(u32 w, u32* r) {
    r[0] = lop_or(w, 0x000F000Fu);
    r[1] = lop_or(w, 0x00F000F0u);
    r[2] = lop_or(shr8(w), 0x000F000Fu);
    r[3] = lop_or(shr8(w), 0x00F000F0u);
}

// the same 8 channels of two tokens -> 8 fp16x2 registers (token a low, token b high), channel +0..+7
__device__ __forceinline__ void unpack_v_word(u32 wa, u32 wb, u32* r) {
    const u32 lo = prmt(wa, wb, 0x5410), hi = prmt(wa, wb, 0x7632);
    r[0] = codes_lo(lo);
    r[1] = codes_hi(lo);
    r[2] = codes_lo(shr8(lo));
    r[3] = codes_hi(shr8(lo));
    r[4] = codes_lo(hi);
    r[5] = codes_hi(hi);
    r[6] = codes_lo(shr8(hi));
    r[7] = codes_hi(shr8(hi));
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS) int4_decode_split(
    const u16* q, int stride_qb, int stride_qh,
    const u8* k, const u8* v, const u16* ks, const u16* vs, const u16* kz, const u16* vz,
    const int* block_tables, int stride_bt, const int* context_lens, const int* split_ptr,
    float* o_part, float* lse_part, int num_q_heads, int num_partials, int num_kv_heads, int group,
    int block_shift, int start, int end_off, double sm_scale_log2, int rotate_q, u16* q_rot_out, int write_q_rot) {
    extern __shared__ __align__(16) u8 smem[];
    let_dependents_launch();  // KV4's INT8 item may start as this grid's blocks finish
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.z * WARPS + (threadIdx.x >> 5);
    if (h >= num_kv_heads) return;
    const int s = blockIdx.x, b = blockIdx.y;
    const int L = context_lens[b];
    const int split = *split_ptr;
    const int end = L - end_off > start ? L - end_off : start;
    const int lo = start + s * split;
    const int hi = lo + split < end ? lo + split : end;
    const bool q_writer = write_q_rot && s == 0;  // hands the rotated query to KV4's INT8 kernel
    if (lo >= hi && !q_writer) return;
    const int g = lane >> 2, j = lane & 3;
    const int* bt = block_tables + (long long)b * stride_bt;

    // Query fragments: lane (g, j) holds head g's channels 32j .. 32j+31 in the order its K codes come.
    u32 qa[8], qb[8];
    float qsum = 0.f, qoff = 0.f;  // sum of q'; what the codes' offsets add to the dot product
    {
        float qf[32];
        load_query_channels(qf, q + (long long)b * stride_qb + (long long)(h * group + g) * stride_qh + 32 * j, g < group);
        if (rotate_q) {  // q @ H (Sylvester, orthonormal) as a fast Walsh-Hadamard transform, rounded to bf16
            hadamard_rotate_bf16(qf, j);
            if (q_writer && g < group) {
                u16* out = q_rot_out + ((long long)b * num_q_heads + h * group + g) * HEAD_DIM + 32 * j;
                #pragma unroll
                for (int e = 0; e < 32; e += 2)
                    *(u32*)(out + e) = (float_bits(qf[e]) >> 16) | (float_bits(qf[e + 1]) & 0xFFFF0000u);
            }
        }
        if (lo >= hi) return;
        #pragma unroll
        for (int e = 0; e < 32; ++e) qf[e] = round_to_half(qf[e] * (float)sm_scale_log2);
        #pragma unroll
        for (int e = 0; e < 32; ++e) {
            qsum += qf[e];
            qoff += (e & 1) ? 64.f * qf[e] : 1024.f * qf[e];  // odd channels: high nibbles, q/16 * (1024 + 16c)
        }
        #pragma unroll
        for (int st = 0; st < 8; ++st) {
            const int m = st >> 1, r = 2 * (st & 1);
            qa[st] = pack_half2(qf[8 * m + r], qf[8 * m + r + 4]);
            qb[st] = pack_half2(qf[8 * m + r + 1] * 0.0625f, qf[8 * m + r + 5] * 0.0625f);
        }
    }
    qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
    qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);
    qoff += __shfl_xor_sync(0xffffffffu, qoff, 1);
    qoff += __shfl_xor_sync(0xffffffffu, qoff, 2);

    // ---- the copy side: lane copies 16 bytes of rows lane/4 and lane/4 + 8 of K and V, and one
    // scale word (K's scale for lanes 0-15, its zero for 16-31; V's likewise) of token lane % 16.
    // Everything but the page's first row is a per-lane constant. (Sharing one copy of the scales
    // between the block's warps needs a block barrier per tile, which measured slower.)
    u8* ring = smem + (threadIdx.x >> 5) * (STAGES * STAGE_BYTES);
    const int crow = lane >> 2, cbyte = 16 * (lane & 3);
    // tile_offset(crow + 8, .) = tile_offset(crow, .) + 512: one destination per lane, rows +8 at +512
    const u32 c_dst = smem_addr(ring) + tile_offset(crow, cbyte), s_dst = smem_addr(ring) + SK_OFF + 4 * lane;
    const long long lane_codes = (long long)crow * KV_ROW + (long long)h * KV_HEAD + cbyte;
    const u8* k_lane = k + lane_codes;
    const u8* v_lane = v + lane_codes;
    // fp16 scales are copied as the aligned 32-bit word holding them (S_ROW is even, see problem())
    const int scale_half = (h * S_HEAD) & 1;
    const long long lane_scale = (long long)(lane & 15) * S_ROW + h * S_HEAD - scale_half;
    const u16* sk_lane = (lane < 16 ? ks : kz) + lane_scale;
    const u16* sv_lane = (lane < 16 ? vs : vz) + lane_scale;
    const int t_first = lo & ~15;
    const int n_tiles = ((hi - 1 - t_first) >> 4) + 1;
    const int page_mask = (1 << block_shift) - 1;

    auto issue = [&](int i, u32 st) {  // branch-free: tiles past the end copy nothing
        const bool live = i < n_tiles;
        const int t0 = t_first + 16 * (live ? i : n_tiles - 1);
        const int row0 = (bt[t0 >> block_shift] << block_shift) + (t0 & page_mask);
        const u8* kr = k_lane + (long long)row0 * KV_ROW;
        const u8* vr = v_lane + (long long)row0 * KV_ROW;
        const u32 n16 = live ? 16 : 0, n4 = live ? 4 : 0;
        copy16(c_dst + st + K_OFF, kr, n16);
        copy16(c_dst + st + K_OFF + 512, kr + 8 * KV_ROW, n16);
        copy16(c_dst + st + V_OFF, vr, n16);
        copy16(c_dst + st + V_OFF + 512, vr + 8 * KV_ROW, n16);
        copy4(s_dst + st, sk_lane + (long long)row0 * S_ROW, n4);
        copy4(s_dst + st + (SV_OFF - SK_OFF), sv_lane + (long long)row0 * S_ROW, n4);
        copy_commit();
    };

    // ---- the compute side: per-lane offsets of what it reads from a stage
    // (rows + 8 sit 512 bytes on, scale words of token + 8 32 bytes on)
    const int r_k = K_OFF + tile_offset(g, 16 * j);
    const int r_v0 = V_OFF + tile_offset(2 * j, 8 * g), r_v1 = V_OFF + tile_offset(2 * j + 1, 8 * g);
    const int r_s = 4 * g + 2 * scale_half;  // token g
    // this lane's scores are heads 2j, 2j+1 (tokens g, g+8); the sums of their query channels:
    const float qsum0 = __shfl_sync(0xffffffffu, qsum, 8 * j), qsum1 = __shfl_sync(0xffffffffu, qsum, 8 * j + 4);
    const float qoff0 = __shfl_sync(0xffffffffu, qoff, 8 * j), qoff1 = __shfl_sync(0xffffffffu, qoff, 8 * j + 4);

    float acc[8][4];  // O^T m-tile i: rows = channels 16g + i (c0, c1) and 16g + 8 + i (c2, c3); cols = heads 2j, 2j+1
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f, z0 = 0.f, z1 = 0.f;

    // S^T = C_K . Q'^T of one tile: rows tokens (g, g+8), columns heads (2j, 2j+1); two accumulator
    // chains of 4 MMAs instead of one of 8
    auto qk = [&](const u8* st, float* sc) {
        float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
        const U4 k0 = *(const U4*)(st + r_k), k1 = *(const U4*)(st + r_k + 512);
        const u32 w0[4] = {k0.x, k0.y, k0.z, k0.w};
        const u32 w1[4] = {k1.x, k1.y, k1.z, k1.w};
        #pragma unroll
        for (int m = 0; m < 4; ++m) {
            u32 r0[4], r1[4];
            unpack_k_word(w0[m], r0);
            unpack_k_word(w1[m], r1);
            mma16816(sa, r0[0], r1[0], r0[1], r1[1], qa[2 * m], qb[2 * m]);
            mma16816(sb, r0[2], r1[2], r0[3], r1[3], qa[2 * m + 1], qb[2 * m + 1]);
        }
        #pragma unroll
        for (int e = 0; e < 4; ++e) sc[e] = sa[e] + sb[e];
    };

    // the rest of a tile: scores, online softmax, O^T += C_V^T . P^T
    auto finish = [&](const u8* st, const int t0, const float* sc) {
        const u8* sp = st + r_s;
        const float ks0 = half_to_float(*(const u16*)(sp + SK_OFF));
        const float kz0 = half_to_float(*(const u16*)(sp + SK_OFF + 64));
        const float ks1 = half_to_float(*(const u16*)(sp + SK_OFF + 32));
        const float kz1 = half_to_float(*(const u16*)(sp + SK_OFF + 96));
        float vs0 = half_to_float(*(const u16*)(sp + SV_OFF));
        float vz0 = half_to_float(*(const u16*)(sp + SV_OFF + 64));
        float vs1 = half_to_float(*(const u16*)(sp + SV_OFF + 32));
        float vz1 = half_to_float(*(const u16*)(sp + SV_OFF + 96));
        float x[4];
        x[0] = ks0 * (sc[0] - qoff0) + kz0 * qsum0;
        x[1] = ks0 * (sc[1] - qoff1) + kz0 * qsum1;
        x[2] = ks1 * (sc[2] - qoff0) + kz1 * qsum0;
        x[3] = ks1 * (sc[3] - qoff1) + kz1 * qsum1;
        if (t0 < lo || t0 + 16 > hi) {  // tokens outside [lo, hi): never read as numbers (garbage scales)
            const bool ok0 = (u32)(t0 + g - lo) < (u32)(hi - lo), ok1 = (u32)(t0 + g + 8 - lo) < (u32)(hi - lo);
            x[0] = ok0 ? x[0] : NEG_INF;
            x[1] = ok0 ? x[1] : NEG_INF;
            x[2] = ok1 ? x[2] : NEG_INF;
            x[3] = ok1 ? x[3] : NEG_INF;
            vs0 = ok0 ? vs0 : 0.f;
            vz0 = ok0 ? vz0 : 0.f;
            vs1 = ok1 ? vs1 : 0.f;
            vz1 = ok1 ? vz1 : 0.f;
        }
        // Lazy rescaling: the running max per head moves only when a score passes it by more than LAZY
        // (log2 units), so probabilities stay below 2^LAZY (fine in fp16) and most tiles skip the
        // cross-lane max and the accumulator rescale.
        const float lm0 = fmax_(x[0], x[2]), lm1 = fmax_(x[1], x[3]);
        if (__any_sync(0xffffffffu, lm0 > m0 + LAZY || lm1 > m1 + LAZY)) {
            float mt0 = lm0, mt1 = lm1;
            #pragma unroll
            for (int d = 4; d < 32; d <<= 1) {
                mt0 = fmax_(mt0, __shfl_xor_sync(0xffffffffu, mt0, d));
                mt1 = fmax_(mt1, __shfl_xor_sync(0xffffffffu, mt1, d));
            }
            const float mn0 = fmax_(m0, mt0), mn1 = fmax_(m1, mt1);  // finite: every tile has a valid token
            const float al0 = fast_exp2(m0 - mn0), al1 = fast_exp2(m1 - mn1);  // 0 on the first tile
            m0 = mn0;
            m1 = mn1;
            l0 *= al0;
            l1 *= al1;
            z0 *= al0;
            z1 *= al1;
            scale_columns(acc, al0, al1);
        }
        const float p0 = fast_exp2(x[0] - m0), p1 = fast_exp2(x[1] - m1);
        const float p2 = fast_exp2(x[2] - m0), p3 = fast_exp2(x[3] - m1);
        l0 += p0 + p2;
        l1 += p1 + p3;
        z0 += p0 * vz0 + p2 * vz1;
        z1 += p1 * vz0 + p3 * vz1;
        // P^T as the B operand: (p * v_scale) of head g at tokens (2j, 2j+1) and (2j+8, 2j+9)
        const u32 w01 = pack_half2(p0 * vs0, p1 * vs0), w23 = pack_half2(p2 * vs1, p3 * vs1);
        const PvOperand pb = pv_operand(w01, w23, lane);
        // O^T += C_V^T . P^T: m-tile e holds channels 16g + e (rows g) and 16g + 8 + e (rows g + 8)
        const U2 va = *(const U2*)(st + r_v0), vb = *(const U2*)(st + r_v1);
        const U2 vc = *(const U2*)(st + r_v0 + 512), vd = *(const U2*)(st + r_v1 + 512);
        u32 lo01[8], hi01[8], lo89[8], hi89[8];
        unpack_v_word(va.x, vb.x, lo01);
        unpack_v_word(va.y, vb.y, hi01);
        unpack_v_word(vc.x, vd.x, lo89);
        unpack_v_word(vc.y, vd.y, hi89);
        #pragma unroll
        for (int e = 0; e < 8; ++e) mma16816(acc[e], lo01[e], hi01[e], lo89[e], hi89[e], pb.b0, pb.b1);
    };

    stream_tiles<STAGES, STAGE_BYTES>(ring, n_tiles, t_first, issue, qk, finish);  // the header says how

    #pragma unroll
    for (int d = 4; d < 32; d <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, d);
        l1 += __shfl_xor_sync(0xffffffffu, l1, d);
        z0 += __shfl_xor_sync(0xffffffffu, z0, d);
        z1 += __shfl_xor_sync(0xffffffffu, z1, d);
    }
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int head = 2 * j + c;
        if (head >= group) break;
        const float l = c ? l1 : l0, z = c ? z1 : z0, m = c ? m1 : m0;
        const float inv_l = l > 0.f ? 1.f / l : 1.f;
        const long long part = ((long long)b * num_q_heads + h * group + head) * num_partials + s;
        float* o = o_part + part * HEAD_DIM + 16 * g;
        store4(o, (acc[0][c] + z) * inv_l, (acc[1][c] + z) * inv_l, (acc[2][c] + z) * inv_l, (acc[3][c] + z) * inv_l);
        store4(o + 4, (acc[4][c] + z) * inv_l, (acc[5][c] + z) * inv_l, (acc[6][c] + z) * inv_l,
               (acc[7][c] + z) * inv_l);
        store4(o + 8, (acc[0][2 + c] + z) * inv_l, (acc[1][2 + c] + z) * inv_l, (acc[2][2 + c] + z) * inv_l,
               (acc[3][2 + c] + z) * inv_l);
        store4(o + 12, (acc[4][2 + c] + z) * inv_l, (acc[5][2 + c] + z) * inv_l, (acc[6][2 + c] + z) * inv_l,
               (acc[7][2 + c] + z) * inv_l);
        if (g == 0) lse_part[part] = m + fast_log2(l > 0.f ? l : 1.f);
    }
}
