/* Block-sparse attention backward for Hopper (sm_90a): the dK/dV pass (with the atomic dQ
 * contributions) on warpgroup MMA (wgmma.mma_async).
 *
 * Same contract and arithmetic as backward.cu's mma.sync dK/dV kernel, which it replaces on
 * sm_90, causal masks (P = 0 past a query's diagonal, on the steps that reach it) and packed
 * sequences (a CTA's key block and query steps inside its sequence's frame) included; backward.cu
 * runs the heavy-first launch order and, with atomic dQ, the prep (D_t, LSE·log2e, zeroed dQ
 * accumulator) and the dQ conversion; the separate (deterministic) dQ pass is dq_sm90.cu's, which
 * does the prep's work and runs first, causal masks and packed sequences included.
 *
 * Design choices:
 * - Each warpgroup (128 threads) owns 64 keys: every product is an m64 wgmma with the keys as M,
 *   so Pᵀ and dSᵀ leave the accumulators in exactly the register layout of the A operand of
 *   dV += Pᵀ·dO and dK += dSᵀ·Q (no shared-memory round trip), and dK and dV stay in registers
 *   (2 × D/2 fp32 per thread: a warpgroup cannot hold more keys).
 * - Default: one warpgroup per CTA, two CTAs per SM, so one CTA's exponentials and barriers overlap
 *   the other's MMAs without any intra-CTA scheduling; a mask with bk = 128 gets two CTAs per key
 *   block (the same transposed list; the second reads Q/dO again from L2). The cost is the dQ
 *   atomics: one 64 × D fp32 reduction per 64 keys. The "wide" variant (device option bwd_keys=128,
 *   dense or bk = 128) puts two warpgroups on 128 keys in one CTA per SM: Q/dO are loaded once for
 *   both, and dQ += dS·K contracts over all 128 keys (each warpgroup one 64-column part at D = 128)
 *   before the atomics, halving them, at the price of lock-step warpgroups. The wide variant is the
 *   default where it applies: dense 47.2 ms against 59.7 ms on the H200 (B=1 H=12 N=32760 D=128).
 * - Query steps of 64 rows (half a mask block): Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ are m64n64 with both
 *   operands K-major in shared memory; dO and Q as the B operand of the register-A products are
 *   read MN-major (transpose bit), like V in forward_sm90.cu.
 * - dQ += dS·K needs dS with the queries as M, i.e. the transpose of what the registers hold, so
 *   dSᵀ goes to shared memory [key][query] (128-byte swizzle) and is read back as an MN-major A
 *   operand; K is the MN-major B operand. The 64 × D product runs in 64-column parts so that only
 *   32 more accumulators are live, and is added with fp32 vector reductions into backward.cu's
 *   padded accumulator (the same rows and scale convention as its atomic mode).
 * - Q/dO (and their 64 LSE / D_t values) are double-buffered with cp.async; every wgmma group is
 *   waited for before the step ends, so buffer reuse needs only the barrier at the step start.
 *   Overlapping the next step's Sᵀ with this step's dK/dV products (FA3's pipelining) is not done.
 *
 * Shared-memory layout: sm90_tile.cuh's (forward_sm90.cu's) 64-row regions of 128-byte swizzled
 * panels; K-major descriptors step 32 bytes per 16 elements of k inside a panel (SBO = 1024),
 * MN-major ones step 2048 bytes per 16 rows of k (SBO = 1024, LBO = the panel stride).
 *
 * The kernel body exists only in the sm_90a image (compiled for sm_90a alone when configure's arch
 * list has 90, see m4/sparge_cuda.m4); without it the entry reports the kernel unavailable and
 * backward.cu keeps its mma.sync kernel. */
#include <math.h>

#include "backward.h"
#include "mma.cuh"

#ifdef SPARGE_CUDA_SM90A

#include "sm90_tile.cuh"
#include "wgmma.cuh"

using namespace sparge_mma;
using namespace sparge_sm90;
using namespace sparge_wgmma;

namespace {

constexpr int WG_KEYS = 64, QROWS = 64, WG_THREADS = 128;
constexpr int SUB_Q = BWD_BLOCK_Q / QROWS; /* query steps per mask block */

/* WGS warpgroups per CTA, each owning 64 keys. */
template <int D, int WGS>
struct bwd90_traits {
    static constexpr int THREADS = WGS * WG_THREADS;
    static constexpr int TILE_BYTES = 64 * D * 2;                  /* 64 rows × D */
    static constexpr int DS_BYTES = WG_KEYS * QROWS * 2;           /* a warpgroup's dSᵀ, one panel */
    static constexpr int VEC_BYTES = 2 * QROWS * (int)sizeof(float); /* LSE·log2e and D_t of a step */
    /* K, V (WGS tiles each), two buffers of (Q, dO), dSᵀ, two buffers of LSE/D_t, alignment slack */
    static constexpr int SMEM_BYTES = 2 * WGS * TILE_BYTES + 4 * TILE_BYTES + WGS * DS_BYTES + 2 * VEC_BYTES + 1024;
};

/* The steps of the warp-specialized kernel below, in helpers. They compute exactly what wgmma_dkdv_kernel's step
 * computes inline: folded into that kernel they changed its register counts by -4..+3 under ptxas, so it keeps its
 * measured code until a timing says the helpers cost nothing there.
 *
 * Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ of a warpgroup's 64 keys and a step's 64 queries; waited for. */
template <typename T, int D>
__device__ __forceinline__ void sdp_products(float (&s)[32], float (&dp)[32], uint32_t k_wg, uint32_t v_wg,
                                             uint32_t q_tile, uint32_t do_tile)
{
    wgmma_fence();
    wgmma_a_bt<T, D>(s, k_wg, q_tile);
    wgmma_a_bt<T, D>(dp, v_wg, do_tile);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 32; i++) {
        fence_operand(s[i]);
        fence_operand(dp[i]);
    }
}

/* The register math of a query step: from Sᵀ (s) and dPᵀ (dp) of the warpgroup's 64 keys
 * and a step's LSE·log2e (lv) and D_t, Pᵀ = exp2(Sᵀ·s·log2e − LSE·log2e) (0 for rows past Nq: LSE·log2e = +inf
 * there; 0 for keys past nk and, with CAUSAL, past a query's diagonal) and dSᵀ = Pᵀ∘(dPᵀ − D_t), both as the A
 * fragments of dV += Pᵀ·dO and dK += dSᵀ·Q. qa: the step's first query row; wg_key0: the warpgroup's first key. */
template <typename T, bool CAUSAL>
__device__ __forceinline__ void step_grads(float (&s)[32], float (&dp)[32], uint32_t (&pa)[4][4], uint32_t (&dsa)[4][4],
                                           const float *lv, const float *dv_t, float scale_log2, int row0, int c2,
                                           bool ragged, bool key_ok0, bool key_ok1, int wg_key0, int qa, int diag)
{
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const float2 l = *(const float2 *)(lv + nt * 8 + c2);
        float *x = s + nt * 4;
        x[0] = exp2f(fmaf(x[0], scale_log2, -l.x));
        x[1] = exp2f(fmaf(x[1], scale_log2, -l.y));
        x[2] = exp2f(fmaf(x[2], scale_log2, -l.x));
        x[3] = exp2f(fmaf(x[3], scale_log2, -l.y));
    }
    if (ragged) /* the warpgroup's keys run past nk: theirs get P = 0 */
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            if (!key_ok0)
                s[nt * 4] = s[nt * 4 + 1] = 0.0f;
            if (!key_ok1)
                s[nt * 4 + 2] = s[nt * 4 + 3] = 0.0f;
        }
    /* Causal: P = 0 where a key lies past a query's diagonal (steps that reach the diagonal only). */
    if (CAUSAL && wg_key0 + WG_KEYS - 1 > qa + diag) {
        const int ka = wg_key0 + row0 - diag, kb = ka + 8;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const int qt = qa + nt * 8 + c2;
            s[nt * 4] = ka > qt ? 0.0f : s[nt * 4];
            s[nt * 4 + 1] = ka > qt + 1 ? 0.0f : s[nt * 4 + 1];
            s[nt * 4 + 2] = kb > qt ? 0.0f : s[nt * 4 + 2];
            s[nt * 4 + 3] = kb > qt + 1 ? 0.0f : s[nt * 4 + 3];
        }
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const float2 d = *(const float2 *)(dv_t + nt * 8 + c2);
        const float *x = s + nt * 4;
        float *y = dp + nt * 4;
        y[0] = x[0] * (y[0] - d.x);
        y[1] = x[1] * (y[1] - d.y);
        y[2] = x[2] * (y[2] - d.x);
        y[3] = x[3] * (y[3] - d.y);
    }
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        c_pair_to_a<T>(pa[kk], s + 8 * kk, s + 8 * kk + 4);
        c_pair_to_a<T>(dsa[kk], dp + 8 * kk, dp + 8 * kk + 4);
    }
}

/* dSᵀ [key][query] of a warpgroup to its 64 × 64 panel: dsa[kk][0..3] hold (row0, 16kk + c2), (row0 + 8, 16kk + c2),
 * (row0, 16kk + 8 + c2), (row0 + 8, 16kk + 8 + c2). */
__device__ __forceinline__ void store_ds(unsigned char *ds_wg, const uint32_t (&dsa)[4][4], int row0, int c2)
{
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = row0 + 8 * (e & 1), col = 16 * kk + 8 * (e >> 1) + c2;
            *(uint32_t *)(ds_wg + panel_offset(row, col >> 3) + (col & 7) * 2) = dsa[kk][e];
        }
}

/* dV += Pᵀ·dO, dK += dSᵀ·Q: A from registers, B MN-major (16 queries = 2048 bytes per k step); waited for. */
template <typename T, int D>
__device__ __forceinline__ void dkdv_products(float (&dv)[D / 2], float (&dk)[D / 2], uint32_t (&pa)[4][4],
                                              uint32_t (&dsa)[4][4], uint32_t do_tile, uint32_t q_tile)
{
    fence_operands(dv), fence_operands(dk), fence_operands(pa), fence_operands(dsa);
    wgmma_fence();
    const uint64_t do_desc = sw128_desc(do_tile, PANEL_BYTES, CORE_GROUP_BYTES),
                   q_desc = sw128_desc(q_tile, PANEL_BYTES, CORE_GROUP_BYTES);
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        wgmma_rs_t<T, D>(dv, pa[kk], desc_advance(do_desc, kk * 2 * CORE_GROUP_BYTES));
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        wgmma_rs_t<T, D>(dk, dsa[kk], desc_advance(q_desc, kk * 2 * CORE_GROUP_BYTES));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(dv), fence_operands(dk), fence_operands(pa), fence_operands(dsa);
}

/* dQ (64 queries × D) += dS·K over a CTA's KEYS keys (the warpgroups' dSᵀ panels follow each other at ds_tiles, as
 * do the K tiles at k_smem), in 64-column parts dealt round the WGS warpgroups (this one: wg): A = dSᵀ read
 * MN-major, B = K MN-major; added with fp32 vector reductions at dst (this thread's first row and column). */
template <typename T, int D, int KEYS, int WGS>
__device__ __forceinline__ void dq_products(float *dst, uint32_t ds_tiles, uint32_t k_smem, int wg)
{
    constexpr int TILE_BYTES = 64 * D * 2;
#pragma unroll
    for (int dh = wg; dh < D / 64; dh += WGS) {
        float dq[32];
        wgmma_fence();
        const uint64_t ds_desc = sw128_desc(ds_tiles, PANEL_BYTES, CORE_GROUP_BYTES),
                       k_desc = sw128_desc(k_smem + dh * PANEL_BYTES, PANEL_BYTES, CORE_GROUP_BYTES);
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; kk++) /* the first k step does not read dq (scale-d 0) */
            wgmma_ss_n64<T, 1, 1>(dq, desc_advance(ds_desc, kk * 2 * CORE_GROUP_BYTES),
                                  desc_advance(k_desc, (kk >> 2) * TILE_BYTES + (kk & 3) * 2 * CORE_GROUP_BYTES),
                                  kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(dq);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            red_add_frag(dst + dh * 64 + nt * 8, 8 * D, dq[nt * 4], dq[nt * 4 + 1], dq[nt * 4 + 2], dq[nt * 4 + 3]);
    }
}

/* dV and dK (times the softmax scale) of KEYS rows from their accumulators, staged over the V and K tiles (this
 * warpgroup's own 64 rows at wg) once nothing reads those, then stored by the CTA's THREADS computing threads (tid
 * among them) with `sync` between staging and stores. */
template <typename T, int D, int KEYS, int THREADS, typename Sync>
__device__ __forceinline__ void store_dkdv(const bwd_params &p, const gpu_seq &sq, int h, int key0, int nk,
                                           const float (&dv)[D / 2], const float (&dk)[D / 2], unsigned char *v_stage,
                                           unsigned char *k_stage, int wg, int row0, int c2, int tid, Sync sync)
{
    const uint32_t wg_off = wg * 64 * D * 2;
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = row0 + 8 * r, col = nt * 8 + c2;
            const uint32_t off = wg_off + panel_offset(row, col >> 3) + (col & 7) * 2;
            *(uint32_t *)(v_stage + off) = pack2<T>(dv[nt * 4 + 2 * r], dv[nt * 4 + 2 * r + 1]);
            *(uint32_t *)(k_stage + off) = pack2<T>(dk[nt * 4 + 2 * r] * p.scale, dk[nt * 4 + 2 * r + 1] * p.scale);
        }
    sync();
    T *dv_out = (T *)p.dv + sq.tb * p.dv_sb + h * p.dv_sh + sq.k_off * p.dv_sn,
      *dk_out = (T *)p.dk + sq.tb * p.dk_sb + h * p.dk_sh + sq.k_off * p.dk_sn;
#pragma unroll
    for (int c = tid; c < KEYS * (D / 8); c += THREADS) {
        const int r = c / (D / 8), ch = c % (D / 8), key = key0 + r;
        const uint32_t off = tile_offset<D>(r, ch);
        if (key < nk) {
            *(uint4 *)(dv_out + (int64_t)key * p.dv_sn + ch * 8) = *(const uint4 *)(v_stage + off);
            *(uint4 *)(dk_out + (int64_t)key * p.dk_sn + ch * 8) = *(const uint4 *)(k_stage + off);
        }
    }
}

template <typename T, int D, int WGS, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(WGS *WG_THREADS, 2 / WGS) wgmma_dkdv_kernel(const bwd_params p, int sub_shift)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using W = bwd90_traits<D, WGS>;
    constexpr int THREADS = W::THREADS, KEYS = WGS * WG_KEYS;
    constexpr int ACC = D / 2; /* fp32 accumulators per thread of a 64 × D product */
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem;
    const uint32_t smem0 = aligned_smem(smem_raw, &smem);
    const uint32_t k_smem = smem0, v_smem = k_smem + WGS * W::TILE_BYTES, ds_smem = v_smem + (WGS + 4) * W::TILE_BYTES;
    const uint32_t vec_off = (2 * WGS + 4) * W::TILE_BYTES + WGS * W::DS_BYTES;
    auto q_smem = [&](int buf) { return v_smem + WGS * W::TILE_BYTES + buf * 2 * W::TILE_BYTES; };
    auto do_smem = [&](int buf) { return q_smem(buf) + W::TILE_BYTES; };
    auto lse_vec = [&](int buf) { return (float *)(smem + vec_off + buf * W::VEC_BYTES); };
    auto dt_vec = [&](int buf) { return lse_vec(buf) + QROWS; };

    const int tid = threadIdx.x, lane = tid & 31, wg = warp_uniform(tid / WG_THREADS), warp = (tid % WG_THREADS) >> 5;
    const int work = (int)(blockIdx.x >> sub_shift), part = (int)(blockIdx.x & ((1u << sub_shift) - 1));
    const int tile_id = p.order ? p.order[work] : work;
    const int bh = tile_id / p.Nkb, j = tile_id - bh * p.Nkb, b = bh / p.H, h = bh - b * p.H;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, b); /* with varlen, b is the sequence */
    const int nq = sq.nq, nk = sq.nk, diag = nk - nq, key0 = ((j << sub_shift) + part) * KEYS;
    if (key0 >= nk) /* the second half of a ragged last block, or a block past its sequence */
        return;
    const int32_t *list = p.t_counts ? p.t_indices + (int64_t)tile_id * p.Nqb : nullptr;
    /* Dense causal: the query blocks before the first whose last query may attend key0 add nothing. */
    const int i0 = CAUSAL && !list ? max(0, key0 - diag) / BWD_BLOCK_Q : 0;
    const int nsteps = warp_uniform((list ? p.t_counts[tile_id] : p.Nqb - i0) * SUB_Q);

    const T *q = (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn;
    const T *d_o = (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + sq.q_off * p.do_sn;
    const float *lse2 = p.lse2 + (int64_t)bh * p.Nq_pad, *dt = p.dt + (int64_t)bh * p.Nq_pad;
    auto step_row0 = [&](int n) {
        return (list ? list[n / SUB_Q] : i0 + n / SUB_Q) * BWD_BLOCK_Q + (n % SUB_Q) * QROWS;
    };
    auto issue = [&](int n) { /* one commit group per step, empty past the end */
        if (n < nsteps) {
            const int buf = n & 1, r0 = step_row0(n);
            load_tile<T, D, QROWS, THREADS>(q_smem(buf), q, p.q_sn, r0, nq, tid);
            load_tile<T, D, QROWS, THREADS>(do_smem(buf), d_o, p.do_sn, r0, nq, tid);
            if (tid < QROWS / 4) /* the padded per-token arrays cover every row of a block */
                cp_async_16(smem_addr(lse_vec(buf)) + 16 * tid, lse2 + r0 + 4 * tid, true);
            else if (tid < QROWS / 2)
                cp_async_16(smem_addr(dt_vec(buf)) + 16 * (tid - QROWS / 4), dt + r0 + 4 * (tid - QROWS / 4), true);
        }
        cp_async_commit();
    };

    /* Group 0: K, V and step 0. */
    const int hk = gpu_kv_head(h, p.kv_magic); /* dK and dV are per query head h (backward.cu sums a group's) */
    load_tile<T, D, KEYS, THREADS>(k_smem, (const T *)p.k + sq.tb * p.k_sb + hk * p.k_sh + sq.k_off * p.k_sn, p.k_sn,
                                   key0, nk, tid);
    load_tile<T, D, KEYS, THREADS>(v_smem, (const T *)p.v + sq.tb * p.v_sb + hk * p.v_sh + sq.k_off * p.v_sn, p.v_sn,
                                   key0, nk, tid);
    if (p.dq_done) { /* D_t and LSE·log2e of every row are written once all dQ CTAs have counted themselves */
        if (tid == 0)
            while (load_acquire(p.dq_done) < p.dq_ctas)
                __nanosleep(64);
        __syncthreads();
    }
    issue(0);

    /* This thread's accumulator rows (keys of Sᵀ, dV, dK inside its warpgroup's 64) row0 and row0 + 8,
     * columns nt·8 + c2 (+1). */
    const int row0 = warp * 16 + frag_row(lane), c2 = frag_col(lane);
    const uint32_t k_wg = k_smem + wg * W::TILE_BYTES, v_wg = v_smem + wg * W::TILE_BYTES;
    unsigned char *ds_wg = smem + (ds_smem - smem0) + wg * W::DS_BYTES; /* this warpgroup's dSᵀ */
    /* Keys past nk (ragged last block) get P = 0, so they add nothing anywhere. */
    const int wg_key0 = key0 + wg * WG_KEYS;
    const bool key_ok0 = wg_key0 + row0 < nk, key_ok1 = wg_key0 + row0 + 8 < nk, ragged = wg_key0 + WG_KEYS > nk;

    float dv[ACC], dk[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) {
        dv[i] = 0.0f;
        dk[i] = 0.0f;
    }

    for (int n = 0; n < nsteps; n++) {
        const int buf = n & 1;
        /* Step n landed; every wgmma of step n-1 completed, so its buffers and dSᵀ are free. */
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();
        issue(n + 1);
        const uint32_t q_tile = q_smem(buf), do_tile = do_smem(buf);

        /* Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (64 keys × 64 queries). */
        float s[32], dp[32];
        wgmma_fence();
        wgmma_a_bt<T, D>(s, k_wg, q_tile);
        wgmma_a_bt<T, D>(dp, v_wg, do_tile);
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < 32; i++) {
            fence_operand(s[i]);
            fence_operand(dp[i]);
        }

        /* Pᵀ = exp2(Sᵀ·s·log2e − LSE·log2e) (0 for rows past Nq: LSE·log2e = +inf there),
         * dSᵀ = Pᵀ∘(dPᵀ − D_t). */
        const float *lv = lse_vec(buf), *dv_t = dt_vec(buf);
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const float2 l = *(const float2 *)(lv + nt * 8 + c2);
            float *x = s + nt * 4;
            x[0] = exp2f(fmaf(x[0], p.scale_log2, -l.x));
            x[1] = exp2f(fmaf(x[1], p.scale_log2, -l.y));
            x[2] = exp2f(fmaf(x[2], p.scale_log2, -l.x));
            x[3] = exp2f(fmaf(x[3], p.scale_log2, -l.y));
        }
        if (ragged) /* the warpgroup's keys run past nk: theirs get P = 0 */
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                if (!key_ok0)
                    s[nt * 4] = s[nt * 4 + 1] = 0.0f;
                if (!key_ok1)
                    s[nt * 4 + 2] = s[nt * 4 + 3] = 0.0f;
            }
        /* Causal: P = 0 where a key lies past a query's diagonal (steps that reach the diagonal only). */
        const int qa = step_row0(n);
        if (CAUSAL && wg_key0 + WG_KEYS - 1 > qa + diag) {
            const int ka = wg_key0 + row0 - diag, kb = ka + 8;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const int qt = qa + nt * 8 + c2;
                s[nt * 4] = ka > qt ? 0.0f : s[nt * 4];
                s[nt * 4 + 1] = ka > qt + 1 ? 0.0f : s[nt * 4 + 1];
                s[nt * 4 + 2] = kb > qt ? 0.0f : s[nt * 4 + 2];
                s[nt * 4 + 3] = kb > qt + 1 ? 0.0f : s[nt * 4 + 3];
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const float2 d = *(const float2 *)(dv_t + nt * 8 + c2);
            const float *x = s + nt * 4;
            float *y = dp + nt * 4;
            y[0] = x[0] * (y[0] - d.x);
            y[1] = x[1] * (y[1] - d.y);
            y[2] = x[2] * (y[2] - d.x);
            y[3] = x[3] * (y[3] - d.y);
        }
        uint32_t pa[4][4], dsa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            c_pair_to_a<T>(pa[kk], s + 8 * kk, s + 8 * kk + 4);
            c_pair_to_a<T>(dsa[kk], dp + 8 * kk, dp + 8 * kk + 4);
        }
        /* The operands of the dV/dK products, pinned on both sides of them. */
        auto fence_dkdv_operands = [&]() {
#pragma unroll
            for (int i = 0; i < ACC; i++) {
                fence_operand(dv[i]);
                fence_operand(dk[i]);
            }
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    fence_operand(pa[kk][e]);
                    fence_operand(dsa[kk][e]);
                }
        };

        if (p.dq_accum) {
            /* dSᵀ [key][query] to shared memory, before the products below (registers that a wgmma in
             * flight reads must not be accessed): dsa[kk][0..3] hold (row0, 16kk + c2), (row0 + 8, 16kk + c2),
             * (row0, 16kk + 8 + c2), (row0 + 8, 16kk + 8 + c2). */
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int row = row0 + 8 * (e & 1), col = 16 * kk + 8 * (e >> 1) + c2;
                    *(uint32_t *)(ds_wg + panel_offset(row, col >> 3) + (col & 7) * 2) = dsa[kk][e];
                }
        }
        /* dV += Pᵀ·dO, dK += dSᵀ·Q: A from registers, B MN-major (16 queries = 2048 bytes per k step). */
        fence_dkdv_operands();
        wgmma_fence();
        const uint64_t do_desc = sw128_desc(do_tile, PANEL_BYTES, CORE_GROUP_BYTES),
                       q_desc = sw128_desc(q_tile, PANEL_BYTES, CORE_GROUP_BYTES);
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_rs_t<T, D>(dv, pa[kk], desc_advance(do_desc, kk * 2 * CORE_GROUP_BYTES));
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_rs_t<T, D>(dk, dsa[kk], desc_advance(q_desc, kk * 2 * CORE_GROUP_BYTES));
        wgmma_commit();
        wgmma_wait<0>();
        fence_dkdv_operands();

        if (p.dq_accum) {
            /* dQ (64 queries × D) += dS·K over the CTA's keys (the warpgroups' dSᵀ tiles follow each other, as
             * do the K tiles), in 64-column parts dealt round the warpgroups: A = dSᵀ read MN-major, B = K
             * MN-major. */
            fence_proxy_async();
            __syncthreads();
            float *dst = p.dq_accum + ((int64_t)bh * p.Nq_pad + step_row0(n) + row0) * D + c2;
#pragma unroll
            for (int dh = wg; dh < D / 64; dh += WGS) {
                float dq[32];
                wgmma_fence();
                const uint64_t ds_desc = sw128_desc(ds_smem, PANEL_BYTES, CORE_GROUP_BYTES),
                               k_desc = sw128_desc(k_smem + dh * PANEL_BYTES, PANEL_BYTES, CORE_GROUP_BYTES);
#pragma unroll
                for (int kk = 0; kk < KEYS / 16; kk++) /* the first k step does not read dq (scale-d 0) */
                    wgmma_ss_n64<T, 1, 1>(dq, desc_advance(ds_desc, kk * 2 * CORE_GROUP_BYTES),
                                          desc_advance(k_desc, (kk >> 2) * W::TILE_BYTES + (kk & 3) * 2 * CORE_GROUP_BYTES),
                                          kk > 0);
                wgmma_commit();
                wgmma_wait<0>();
                fence_operands(dq);
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
                    red_add_frag(dst + dh * 64 + nt * 8, 8 * D, dq[nt * 4], dq[nt * 4 + 1], dq[nt * 4 + 2],
                                 dq[nt * 4 + 3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads(); /* no wgmma reads K or V any more (and no copy is in flight): stage dV over V, dK over K */

    unsigned char *v_stage = smem + (v_smem - smem0), *k_stage = smem + (k_smem - smem0);
    const uint32_t wg_off = wg * W::TILE_BYTES;
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = row0 + 8 * r, col = nt * 8 + c2;
            const uint32_t off = wg_off + panel_offset(row, col >> 3) + (col & 7) * 2;
            *(uint32_t *)(v_stage + off) = pack2<T>(dv[nt * 4 + 2 * r], dv[nt * 4 + 2 * r + 1]);
            *(uint32_t *)(k_stage + off) = pack2<T>(dk[nt * 4 + 2 * r] * p.scale, dk[nt * 4 + 2 * r + 1] * p.scale);
        }
    __syncthreads();
    T *dv_out = (T *)p.dv + sq.tb * p.dv_sb + h * p.dv_sh + sq.k_off * p.dv_sn,
      *dk_out = (T *)p.dk + sq.tb * p.dk_sb + h * p.dk_sh + sq.k_off * p.dk_sn;
#pragma unroll
    for (int c = tid; c < KEYS * (D / 8); c += THREADS) {
        const int r = c / (D / 8), ch = c % (D / 8), key = key0 + r;
        const uint32_t off = tile_offset<D>(r, ch);
        if (key < nk) {
            *(uint4 *)(dv_out + (int64_t)key * p.dv_sn + ch * 8) = *(const uint4 *)(v_stage + off);
            *(uint4 *)(dk_out + (int64_t)key * p.dk_sn + ch * 8) = *(const uint4 *)(k_stage + off);
        }
    }
    /* Ends after the dQ grid (a no-op unless launched as its dependent), so that work queued after the backward
     * is ordered after both passes whatever the stream makes of a dependent grid that never waits. */
    gpu_wait_for_previous_kernel();
#endif
}

/* ---------------------------------------------------------------- warp-specialized kernel (bwd_kernel=wgmma-ws) */

/* The wide variant's work (128 keys a CTA: dense, or bk = 128) on three warpgroups: the producer (warpgroup 0) only
 * loads, K and V once, then each query step's Q, dO, LSE·log2e and D_t into a ring of WSB_STAGES stages; the
 * consumers (1, 2) own 64 keys each and compute as above, with no CTA-wide barrier. A stage's full barrier counts
 * the producer's 128 threads, each arriving once its own copies of the stage landed (cp.async: a thread sees only
 * its own groups complete); its empty barrier counts the consumers' 256 threads, each arriving after its last read
 * of the stage (the wgmma reads of Q and dO, and its own loads of LSE and D_t). With atomic dQ the consumers meet at
 * one named barrier a step, before dQ += dS·K reads both warpgroups' dSᵀ; dSᵀ is double-buffered, so a warpgroup's
 * store of step n + 1's dSᵀ cannot meet its partner's reads of step n - 1's, which ended before the partner reached
 * step n's barrier. */
constexpr int WSB_THREADS = 3 * WG_THREADS, WSB_STAGES = 3;
/* setmaxnreg: the producer gives back what the consumers take, within 168 registers a thread on average
 * (__launch_bounds__(384, 1)); the consumers hold dK and dV (D fp32) besides a step's 64 + 32 values. */
constexpr int WSB_PRODUCER_REGS = 24, WSB_CONSUMER_REGS = 240;
static_assert(WSB_PRODUCER_REGS + 2 * WSB_CONSUMER_REGS <= 3 * 168, "the register file of 384 threads");

template <int D>
struct ws_bwd_traits {
    using W = bwd90_traits<D, 2>;
    static constexpr int KEYS = 2 * WG_KEYS;
    /* K and V (two tiles each), the stages' Q and dO, two buffers of both warpgroups' dSᵀ, the stages' LSE/D_t, then
     * the mbarriers kv_full, full[WSB_STAGES], empty[WSB_STAGES] */
    static constexpr int STAGE_OFFSET = 4 * W::TILE_BYTES;
    static constexpr int DS_OFFSET = STAGE_OFFSET + WSB_STAGES * 2 * W::TILE_BYTES;
    static constexpr int VEC_OFFSET = DS_OFFSET + 2 * 2 * W::DS_BYTES;
    static constexpr int BAR_OFFSET = VEC_OFFSET + WSB_STAGES * W::VEC_BYTES;
    static constexpr int SMEM_BYTES = BAR_OFFSET + (1 + 2 * WSB_STAGES) * 8 + 1024; /* + alignment slack */
};

template <typename T, int D, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(WSB_THREADS, 1) ws_dkdv_kernel(const bwd_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using W = bwd90_traits<D, 2>;
    using WS = ws_bwd_traits<D>;
    constexpr int KEYS = WS::KEYS, ACC = D / 2;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem;
    const uint32_t smem0 = aligned_smem(smem_raw, &smem);
    const uint32_t k_smem = smem0, v_smem = smem0 + 2 * W::TILE_BYTES;
    auto q_smem = [&](int stage) { return smem0 + WS::STAGE_OFFSET + stage * 2 * W::TILE_BYTES; };
    auto do_smem = [&](int stage) { return q_smem(stage) + W::TILE_BYTES; };
    auto ds_tiles = [&](int buf) { return smem0 + WS::DS_OFFSET + buf * 2 * W::DS_BYTES; };
    auto lse_vec = [&](int stage) { return (float *)(smem + WS::VEC_OFFSET + stage * W::VEC_BYTES); };
    auto dt_vec = [&](int stage) { return lse_vec(stage) + QROWS; };
    const uint32_t kv_full = smem0 + WS::BAR_OFFSET;
    auto full = [&](int stage) { return kv_full + 8 * (1 + stage); };
    auto empty = [&](int stage) { return kv_full + 8 * (1 + WSB_STAGES + stage); };

    const int tid = threadIdx.x, lane = tid & 31, wg = warp_uniform(tid / WG_THREADS), wg_tid = tid % WG_THREADS;
    const int tile_id = p.order ? p.order[blockIdx.x] : (int)blockIdx.x;
    const int bh = tile_id / p.Nkb, j = tile_id - bh * p.Nkb, b = bh / p.H, h = bh - b * p.H;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, b); /* with varlen, b is the sequence */
    const int nq = sq.nq, nk = sq.nk, diag = nk - nq, key0 = j * KEYS;
    if (key0 >= nk) /* a block past its sequence: the whole CTA leaves */
        return;
    const int32_t *list = p.t_counts ? p.t_indices + (int64_t)tile_id * p.Nqb : nullptr;
    /* Dense causal: the query blocks before the first whose last query may attend key0 add nothing. */
    const int i0 = CAUSAL && !list ? max(0, key0 - diag) / BWD_BLOCK_Q : 0;
    const int nsteps = warp_uniform((list ? p.t_counts[tile_id] : p.Nqb - i0) * SUB_Q);
    auto step_row0 = [&](int n) {
        return (list ? list[n / SUB_Q] : i0 + n / SUB_Q) * BWD_BLOCK_Q + (n % SUB_Q) * QROWS;
    };
    if (tid == 0) {
        mbar_init(kv_full, WG_THREADS);
        for (int i = 0; i < WSB_STAGES; i++) {
            mbar_init(full(i), WG_THREADS);     /* every producer thread, for its own copies */
            mbar_init(empty(i), 2 * WG_THREADS); /* every consumer thread, after its own reads */
        }
        if (p.dq_done) /* D_t and LSE·log2e of every row are written once all dQ CTAs have counted themselves */
            while (load_acquire(p.dq_done) < p.dq_ctas)
                __nanosleep(64);
    }
    __syncthreads(); /* the barriers are initialized (and the dQ pass's rows written) */

    if (wg == 0) {
        /* Producer. Groups in commit order: K and V (group 0), step n (group n + 1). Before it blocks on a free stage
         * for step n it signals group n - 1, so the consumers never wait on the producer's stage wait. */
        set_max_regs_dec<WSB_PRODUCER_REGS>();
        const T *q = (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn;
        const T *d_o = (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + sq.q_off * p.do_sn;
        const float *lse2 = p.lse2 + (int64_t)bh * p.Nq_pad, *dt = p.dt + (int64_t)bh * p.Nq_pad;
        const int hk = gpu_kv_head(h, p.kv_magic); /* dK and dV are per query head h (backward.cu sums a group's) */
        auto landed = [&](int group) { mbar_arrive(group == 0 ? kv_full : full((group - 1) % WSB_STAGES)); };
        load_tile<T, D, KEYS, WG_THREADS>(k_smem, (const T *)p.k + sq.tb * p.k_sb + hk * p.k_sh + sq.k_off * p.k_sn,
                                          p.k_sn, key0, nk, wg_tid);
        load_tile<T, D, KEYS, WG_THREADS>(v_smem, (const T *)p.v + sq.tb * p.v_sb + hk * p.v_sh + sq.k_off * p.v_sn,
                                          p.v_sn, key0, nk, wg_tid);
        cp_async_commit();
        for (int n = 0; n < nsteps; n++) {
            const int stage = n % WSB_STAGES, r0 = step_row0(n);
            if (n >= 1) { /* group n - 1 (K and V, or step n - 2) landed */
                cp_async_wait<1>();
                fence_proxy_async();
                landed(n - 1);
            }
            if (n >= WSB_STAGES) /* the consumers freed step n - WSB_STAGES */
                mbar_wait(empty(stage), (n / WSB_STAGES + 1) & 1);
            load_tile<T, D, QROWS, WG_THREADS>(q_smem(stage), q, p.q_sn, r0, nq, wg_tid);
            load_tile<T, D, QROWS, WG_THREADS>(do_smem(stage), d_o, p.do_sn, r0, nq, wg_tid);
            if (wg_tid < QROWS / 4) /* the padded per-token arrays cover every row of a block */
                cp_async_16(smem_addr(lse_vec(stage)) + 16 * wg_tid, lse2 + r0 + 4 * wg_tid, true);
            else if (wg_tid < QROWS / 2)
                cp_async_16(smem_addr(dt_vec(stage)) + 16 * (wg_tid - QROWS / 4), dt + r0 + 4 * (wg_tid - QROWS / 4),
                            true);
            cp_async_commit();
        }
        cp_async_wait<0>();
        fence_proxy_async();
        for (int g = max(0, nsteps - 1); g <= nsteps; g++)
            landed(g);
        gpu_wait_for_previous_kernel();
        return;
    }

    /* Consumers: warpgroup wg - 1 owns keys key0 + 64·(wg - 1)..; this thread's accumulator rows (keys of Sᵀ, dV, dK
     * inside them) row0 and row0 + 8, columns nt·8 + c2 (+1). */
    set_max_regs_inc<WSB_CONSUMER_REGS>();
    const int cw = wg - 1, ctid = tid - WG_THREADS;
    const int row0 = ((wg_tid >> 5) * 16) + frag_row(lane), c2 = frag_col(lane);
    const uint32_t k_wg = k_smem + cw * W::TILE_BYTES, v_wg = v_smem + cw * W::TILE_BYTES;
    const int wg_key0 = key0 + cw * WG_KEYS;
    const bool key_ok0 = wg_key0 + row0 < nk, key_ok1 = wg_key0 + row0 + 8 < nk, ragged = wg_key0 + WG_KEYS > nk;
    auto consumers_sync = [] { asm volatile("bar.sync 1, 256;\n" ::: "memory"); };

    float dv[ACC], dk[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) {
        dv[i] = 0.0f;
        dk[i] = 0.0f;
    }
    mbar_wait(kv_full, 0); /* also before the staging below overwrites K and V, where there is no step */
    for (int n = 0; n < nsteps; n++) {
        const int stage = n % WSB_STAGES;
        mbar_wait(full(stage), (n / WSB_STAGES) & 1);
        const uint32_t q_tile = q_smem(stage), do_tile = do_smem(stage);

        float s[32], dp[32];
        sdp_products<T, D>(s, dp, k_wg, v_wg, q_tile, do_tile);

        uint32_t pa[4][4], dsa[4][4];
        step_grads<T, CAUSAL>(s, dp, pa, dsa, lse_vec(stage), dt_vec(stage), p.scale_log2, row0, c2, ragged, key_ok0,
                              key_ok1, wg_key0, step_row0(n), diag);
        unsigned char *ds_wg = smem + (ds_tiles(n & 1) - smem0) + cw * W::DS_BYTES;
        if (p.dq_accum)
            store_ds(ds_wg, dsa, row0, c2);
        dkdv_products<T, D>(dv, dk, pa, dsa, do_tile, q_tile);
        mbar_arrive(empty(stage)); /* this thread read the stage for the last time */
        if (p.dq_accum) {
            fence_proxy_async();
            consumers_sync();
            dq_products<T, D, KEYS, 2>(p.dq_accum + ((int64_t)bh * p.Nq_pad + step_row0(n) + row0) * D + c2,
                                       ds_tiles(n & 1), k_smem, cw);
        }
    }
    consumers_sync(); /* neither warpgroup's dQ product reads K any more: stage dV over V, dK over K */
    store_dkdv<T, D, KEYS, 2 * WG_THREADS>(p, sq, h, key0, nk, dv, dk, smem + (v_smem - smem0),
                                           smem + (k_smem - smem0), cw, row0, c2, ctid, consumers_sync);
    /* Ends after the dQ grid (a no-op unless launched as its dependent), as the kernel above. */
    gpu_wait_for_previous_kernel();
#endif
}

/* Queues a dK/dV kernel of SMEM bytes of shared memory on one CTA per key block (p.Nkb << sub_shift of each head). */
template <int SMEM, typename... Params, typename... Args>
sparge_status queue(gpu_ctx *ctx, void (*kernel)(Params...), int threads, const bwd_params &p, int64_t BH,
                    int sub_shift, int dependent, const char *what, Args... args)
{
    if ((size_t)SMEM > ctx->smem_optin)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda backward: the %s needs %d bytes of shared memory, the device "
                           "allows %zu", what, SMEM, ctx->smem_optin);
    sparge_status s;
    if ((s = GPU_CHECK(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, SMEM))))
        return s;
    const int64_t grid = (BH * p.Nkb) << sub_shift;
    if (grid == 0)
        return SPARGE_OK;
    if (dependent)
        return gpu_launch_dependent(ctx, kernel, (unsigned)grid, threads, SMEM, what, args...);
    kernel<<<(unsigned)grid, threads, SMEM, ctx->stream>>>(args...);
    return GPU_CHECK_LAUNCH(what);
}

template <typename T, int D, int WGS>
sparge_status launch(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, int dependent)
{
    auto kernel = p.seq_q ? (p.causal ? wgmma_dkdv_kernel<T, D, WGS, true, true>
                                      : wgmma_dkdv_kernel<T, D, WGS, false, true>)
                          : (p.causal ? wgmma_dkdv_kernel<T, D, WGS, true, false>
                                      : wgmma_dkdv_kernel<T, D, WGS, false, false>);
    return queue<bwd90_traits<D, WGS>::SMEM_BYTES>(ctx, kernel, bwd90_traits<D, WGS>::THREADS, p, BH, sub_shift,
                                                   dependent, "wgmma backward dK/dV kernel", p, sub_shift);
}

template <typename T, int D>
sparge_status launch_ws(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int dependent)
{
    auto kernel = p.seq_q ? (p.causal ? ws_dkdv_kernel<T, D, true, true> : ws_dkdv_kernel<T, D, false, true>)
                          : (p.causal ? ws_dkdv_kernel<T, D, true, false> : ws_dkdv_kernel<T, D, false, false>);
    return queue<ws_bwd_traits<D>::SMEM_BYTES>(ctx, kernel, WSB_THREADS, p, BH, 0, dependent,
                                               "warp-specialized wgmma backward dK/dV kernel", p);
}

/* variant 0: 64 keys a CTA; 1: 128 keys on two warpgroups; 2: the same work warp-specialized. */
template <typename T, int D>
sparge_status launch_variant(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, int variant, int dependent)
{
    return variant == 2 ? launch_ws<T, D>(ctx, p, BH, dependent)
         : variant == 1 ? launch<T, D, 2>(ctx, p, BH, sub_shift, dependent)
                        : launch<T, D, 1>(ctx, p, BH, sub_shift, dependent);
}

} // namespace

int sparge_cuda_wgmma_backward_available(const gpu_ctx *ctx)
{
    if (ctx->cc_major != 9 || ctx->cc_minor != 0)
        return 0;
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, wgmma_dkdv_kernel<gpu_bf16, 128, 1, false, false>) != cudaSuccess) {
        (void)cudaGetLastError(); /* no loadable sm_90a image: not sticky, clear it */
        return 0;
    }
    return 1;
}

sparge_status sparge_cuda_wgmma_dkdv(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, int wide, int ws,
                                     sparge_dtype dt, int D, int dependent)
{
    const int variant = wide ? (ws ? 2 : 1) : 0;
    if (dt == SPARGE_BF16)
        return D == 128 ? launch_variant<gpu_bf16, 128>(ctx, p, BH, sub_shift, variant, dependent)
                        : launch_variant<gpu_bf16, 64>(ctx, p, BH, sub_shift, variant, dependent);
    return D == 128 ? launch_variant<gpu_half, 128>(ctx, p, BH, sub_shift, variant, dependent)
                    : launch_variant<gpu_half, 64>(ctx, p, BH, sub_shift, variant, dependent);
}

#else /* no sm_90a image in this build */

int sparge_cuda_wgmma_backward_available(const gpu_ctx *ctx)
{
    (void)ctx;
    return 0;
}

sparge_status sparge_cuda_wgmma_dkdv(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, int wide, int ws,
                                     sparge_dtype dt, int D, int dependent)
{
    (void)ctx, (void)p, (void)BH, (void)sub_shift, (void)wide, (void)ws, (void)dt, (void)D, (void)dependent;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: this build has no sm_90a wgmma backward (configure "
                       "--with-cuda-arch with 90)");
}

#endif
