/* The tensor-core backward's kernel parameters and the entries of its Hopper tier (CUDA only):
 * backward.cu validates the call, fills bwd_params, runs the prep / order / dQ conversion kernels,
 * and the dK/dV pass and the separate dQ pass either with its mma.sync kernels or with the wgmma
 * kernels of backward_sm90.cu and dq_sm90.cu. */
#ifndef SPARGE_CUDA_BACKWARD_H
#define SPARGE_CUDA_BACKWARD_H

#include <stdint.h>

#include "gpu.h"

constexpr int BWD_BLOCK_Q = 128; /* query block of the mask (bq) */
constexpr float BWD_LOG2E = 1.4426950408889634f;

struct bwd_params {
    const void *q, *k, *v, *o, *d_o;
    void *dq, *dk, *dv;
    int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn, do_sb, do_sh, do_sn;
    int64_t dq_sb, dq_sh, dq_sn, dk_sb, dk_sh, dk_sn, dv_sb, dv_sh, dv_sn;
    int H, Nq, Nk;
    uint32_t kv_magic; /* K/V head of query head h: gpu_kv_head(h, kv_magic); dK and dV are per query head */
    int Nqb, Nkb;      /* blocks of the kernel's tiling (the mask's when a mask is given) */
    int Nq_pad;        /* Nqb · 128: row stride of the padded per-token arrays */
    float scale, scale_log2;
    const float *lse;  /* [B·H·Nq], natural log (input) */
    float *lse2;       /* [B·H·Nq_pad], LSE·log2(e), +inf past Nq (written by the prep or the wgmma dQ pass) */
    float *dt;         /* [B·H·Nq_pad], rowsum(dO∘O), 0 past Nq (likewise) */
    float *dq_accum;   /* [B·H·Nq_pad·D] fp32, or NULL: no atomic dQ */
    const int32_t *counts, *indices;     /* CSR rows (row stride Nkb), NULL: dense */
    const int32_t *t_counts, *t_indices; /* transposed (row stride Nqb), NULL: dense */
    const int32_t *order; /* CTA → tile (heavy tiles first), NULL: identity */
    /* wgmma dQ pass → dK/dV pass, which may start before the dQ grid ends: each dQ CTA adds 1 (release) once
     * its rows' D_t and LSE·log2e are written; the dK/dV kernel reads those arrays once it sees dq_ctas
     * (acquire). NULL: the arrays were written by an earlier, completed kernel. */
    uint32_t *dq_done;
    uint32_t dq_ctas;
    int causal; /* keys past a query's diagonal (u > t + nk − nq of its sequence) are masked */
    const int32_t *seq_q, *seq_k; /* varlen: token offsets of the B sequences in the packed
                                   * [1, H, T, D] tensors; Nq, Nk are then the totals, Nqb the longest's blocks */
};

/* p.dq_done's two sides: one CTA's increment after its writes, ordered before them by a preceding barrier
 * (release at gpu scope is cumulative), and the load that orders the reads after it (acquire; a barrier after
 * it passes that on to the CTA). */
__device__ __forceinline__ void add_release(uint32_t *counter)
{
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire(const uint32_t *counter)
{
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    return v;
}

/* fp32 atomic add of two adjacent elements (one vector reduction where the ISA has it). */
__device__ __forceinline__ void red_add2(float *p, float x, float y)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(p, x);
    atomicAdd(p + 1, y);
#endif
}

/* fp32 atomic adds of an accumulator fragment's pairs at (row r, columns c, c + 1) and (row r + 8, the same
 * columns), c = 2·(lane % 4), p pointing at (r, c) and row8 elements from row r to row r + 8. On sm_90 lanes
 * l and l ^ 1 (same r, columns 4 apart) swap halves so that each adds four adjacent elements in one 16-byte
 * reduction (the even lane row r, columns c .. c + 3; the odd lane row r + 8, columns c - 2 .. c + 1): half
 * the reduction requests of red_add2. All 32 lanes must call it. */
__device__ __forceinline__ void red_add_frag(float *p, int64_t row8, float a0, float a1, float b0, float b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const bool odd = threadIdx.x & 1;
    const float r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1), r1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
    if (odd)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p + row8 - 2), "f"(r0), "f"(r1), "f"(b0),
                     "f"(b1) : "memory");
    else
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a0), "f"(a1), "f"(r0), "f"(r1)
                     : "memory");
#else
    red_add2(p, a0, a1);
    red_add2(p + row8, b0, b1);
#endif
}

/* Σ o[e]·d_o[e] over 8 elements (16 bytes each), in order, fp32: one 16-byte part of a token's D_t. The prep
 * and the wgmma dQ pass both build D_t from these parts and the same xor tree over them (parts l and l ^ m
 * added for m = D/16, ..., 2, 1), so the two give the same bits. */
template <typename T>
__device__ __forceinline__ float dt_part(const T *o, const T *d_o)
{
    const uint4 ov = *(const uint4 *)o, dv = *(const uint4 *)d_o;
    const T *oe = (const T *)&ov, *de = (const T *)&dv;
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++)
        sum = fmaf(to_f32(oe[e]), to_f32(de[e]), sum);
    return sum;
}

/* 1 when this build holds the sm_90a wgmma dK/dV kernel (configure with 90 in --with-cuda-arch)
 * and its image loads on the device of ctx. */
int sparge_cuda_wgmma_backward_available(const gpu_ctx *ctx);
/* The dK/dV pass (and, when p.dq_accum is set, the atomic dQ contributions) with wgmma, f16 or
 * bf16, D = 64 or 128: one CTA per 64 keys (wide = 0) or per 128 keys (wide = 1, two warpgroups; with ws = 1
 * their warp-specialized kernel, a third warpgroup loading); p.Nkb counts key blocks of that many keys << sub_shift
 * (the mask's bk, or the CTA's keys when dense; sub_shift 0 when wide), p.order (if set) orders those blocks.
 * dependent = 1 (p.dq_done set) launches it as a programmatic dependent of the wgmma dQ pass queued just before it,
 * so that it fills the SMs that pass's last wave leaves idle. */
sparge_status sparge_cuda_wgmma_dkdv(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, int wide, int ws,
                                     sparge_dtype dt, int D, int dependent);
/* The separate dQ pass with wgmma (dq_sm90.cu; available with the dK/dV kernel above), f16 or bf16,
 * D = 64 or 128, causal or not, fixed lengths or packed sequences: one CTA per query block (of a sequence
 * with varlen), p.Nkb counts key blocks of 64 keys << sub_shift (the mask's bk, or 64 when dense),
 * p.order (if set) orders the query blocks. No atomics. It computes D_t and
 * LSE·log2e from p.o, p.d_o and p.lse (the prep's work: it reads neither padded array) and writes
 * p.dt and p.lse2, every padded row, for a dK/dV pass after it, then counts itself in p.dq_done (required)
 * and lets that pass launch. */
sparge_status sparge_cuda_wgmma_dq(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, sparge_dtype dt,
                                   int D);

#endif
