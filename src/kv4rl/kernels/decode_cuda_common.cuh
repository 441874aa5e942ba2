// What the CUDA decode kernels (int4_decode.cu, fp8_decode.cu) share: types, PTX wrappers, cp.async and
// the m16n8k16 MMA. The Python side pastes this file where a kernel source includes it (NVRTC compiles
// without include paths); nvcc finds it beside the source. Included once per source (no guard: NVRTC
// warns about `#pragma once` in what it sees as the main file).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define HEAD_DIM 128

// NVRTC compiles these without headers: small helpers instead of vector types and math functions.
struct U4 { u32 x, y, z, w; };
struct U2 { u32 x, y; };

__device__ __forceinline__ float bits_to_float(u32 x) {
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(x));
    return f;
}

__device__ __forceinline__ u32 float_bits(float x) {
    u32 r;
    asm("mov.b32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float round_to_bf16(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return bits_to_float((u32)h << 16);
}

__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#define NEG_INF bits_to_float(0xff800000u)

// Lane (g, j)'s part of a bf16 query row: channels 32j .. 32j+31 of row `qp` (16-byte aligned) as floats, in
// order; zeros for lanes past the group (`live` false), which still take part in the warp's shuffles.
__device__ __forceinline__ void load_query_channels(float* qf, const u16* qp, bool live) {
    if (live) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
            const U4 w = *(const U4*)((const u8*)qp + 16 * c);  // channels 8c .. 8c+7
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                qf[8 * c + 2 * e] = bits_to_float(ws[e] << 16);
                qf[8 * c + 2 * e + 1] = bits_to_float(ws[e] & 0xFFFF0000u);
            }
        }
    } else {
        #pragma unroll
        for (int e = 0; e < 32; ++e) qf[e] = 0.f;
    }
}

// A query row's 128 channels times the Sylvester Hadamard matrix (orthonormal), rounded to bf16: the cache's
// rotation. Lane j of a 4-lane group holds channels 32j .. 32j+31 in qf, in order: channel bits 0-4 are
// butterflies inside the lane, bits 5-6 shuffles across j. Both kernels that rotate a query call this, so
// the INT4 body and KV4's INT8 item see the same bits.
__device__ __forceinline__ void hadamard_rotate_bf16(float* qf, int j) {
    #pragma unroll
    for (int bit = 1; bit < 32; bit <<= 1) {
        #pragma unroll
        for (int e = 0; e < 32; ++e) {
            if (!(e & bit)) {
                const float a = qf[e], c = qf[e | bit];
                qf[e] = a + c;
                qf[e | bit] = a - c;
            }
        }
    }
    #pragma unroll
    for (int bit = 1; bit < 4; bit <<= 1) {
        #pragma unroll
        for (int e = 0; e < 32; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, qf[e], bit);
            qf[e] = (j & bit) ? other - qf[e] : qf[e] + other;
        }
    }
    #pragma unroll
    for (int e = 0; e < 32; ++e) qf[e] = round_to_bf16(qf[e] * 0.08838834764831845f);  // 1/sqrt(128)
}

// Programmatic dependent launch (sm_90+; no-ops before, and when the next kernel was launched without the
// attribute): the INT4 body lets KV4's INT8 item start on the SMs its blocks free, and the item waits for the
// body's partials (all of its blocks done, their writes visible) only where it merges them.
__device__ __forceinline__ void let_dependents_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 16 bytes from global memory where `live`, zeros (and no memory traffic) elsewhere: a predicated load, so
// a run of them can all be in flight without a branch between them. The memory clobber keeps it after the
// waits and barriers before it.
__device__ __forceinline__ U4 load16_if(const void* p, bool live) {
    U4 x;
    asm("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(p), "r"((int)live) : "memory");
    return x;
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float fmax_(float a, float b) {
    float d;
    asm("max.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float round_to_half(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return half_to_float(h);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// n = 0 reads nothing from global memory and zero-fills: a copy past the split's end costs no traffic
__device__ __forceinline__ void copy16(u32 dst, const void* src, u32 n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(n) : "memory");
}

__device__ __forceinline__ void copy4(u32 dst, const void* src, u32 n) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(n) : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// c += A(16x16) * B(16x8), fp16 operands, fp32 accumulators
__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// acc[e] (an m16n8 accumulator tile per e; columns 2j, 2j+1 of the lane) *= a0 in column 2j, a1 in 2j+1
__device__ __forceinline__ void scale_columns(float (*acc)[4], float a0, float a1) {
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
        acc[e][0] *= a0;
        acc[e][1] *= a1;
        acc[e][2] *= a0;
        acc[e][3] *= a1;
    }
}

// The P.V MMA's B operand (tokens on K, heads on N) from the score layout (tokens on M): w01 / w23 are this
// lane's fp16 weights of its heads (2j, 2j+1) at tokens g and g + 8. Token 2j (and 2j+8) comes from lane
// 8j + g/2, 2j+1 (2j+9) from 8j + 4 + g/2, and `sel` keeps head g's half.
struct PvOperand { u32 b0, b1; };

__device__ __forceinline__ PvOperand pv_operand(u32 w01, u32 w23, int lane) {
    const int g = lane >> 2, j = lane & 3;
    const int src_a = 8 * j + (g >> 1), src_b = src_a + 4;
    const u32 sel = (g & 1) ? 0x7632u : 0x5410u;
    const u32 a01 = __shfl_sync(0xffffffffu, w01, src_a), b01 = __shfl_sync(0xffffffffu, w01, src_b);
    const u32 a23 = __shfl_sync(0xffffffffu, w23, src_a), b23 = __shfl_sync(0xffffffffu, w23, src_b);
    return PvOperand{prmt(a01, b01, sel), prmt(a23, b23, sel)};
}

// The kernels' tile loop. Tiles stream through a ring of Stages shared-memory stages per warp
// (`issue(i, stage byte offset)` starts tile i's cp.async copies, a copy group per tile; tiles past the
// end copy nothing). Software pipelined: iteration i computes tile i+1's dot products (`qk(stage, s)`)
// alongside tile i's softmax and P.V (`finish(stage, first token, s)`), two independent chains the
// scheduler interleaves. Tile i+1 must have landed: each iteration waits for all but Stages - 3 copy
// groups, and issues into the stage finished in the previous one.
template <int Stages, int StageBytes, typename Issue, typename QK, typename Finish>
__device__ __forceinline__ void stream_tiles(const u8* ring, int n_tiles, int t_first, Issue& issue, QK& qk,
                                             Finish& finish) {
    #pragma unroll
    for (int i = 0; i < Stages - 1; ++i) issue(i, i * StageBytes);
    copy_wait<Stages - 2>();
    __syncwarp();
    float sc_cur[4];
    qk(ring, sc_cur);
    u32 read_off = 0, write_off = (Stages - 1) * StageBytes;  // stage byte offsets in the ring
    for (int i = 0; i < n_tiles; ++i) {
        copy_wait<Stages - 3>();
        __syncwarp();
        issue(i + Stages - 1, write_off);
        const u32 next_off = read_off == (Stages - 1) * StageBytes ? 0 : read_off + StageBytes;
        float sc_next[4];
        qk(ring + next_off, sc_next);  // past the last tile: zero-filled or stale codes, result unused
        finish(ring + read_off, t_first + 16 * i, sc_cur);
        #pragma unroll
        for (int e = 0; e < 4; ++e) sc_cur[e] = sc_next[e];
        write_off = read_off;
        read_off = next_off;
    }
    copy_wait<0>();
}
