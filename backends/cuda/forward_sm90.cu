/* Block-sparse attention forward for Hopper (sm_90a): warpgroup MMA (wgmma.mma_async).
 *
 * Same contract and arithmetic as forward.cu's mma.sync kernel (one CTA per (b, h, query
 * block of 128 rows), only the kept key blocks of the CSR mask, tiles of 64 keys, fp32 online
 * softmax in the exp2 domain, O in the input dtype, fp32 LSE), with the tensor-core work moved
 * to wgmma: two warpgroups of 128 threads each own 64 query rows;
 *   S = Q·Kᵀ   m64n64k16, Q and K read from shared memory through matrix descriptors,
 *   O += P·V   m64nDk16, P from registers (the S accumulator layout packed to 16 bits is the
 *              A-fragment layout), V from shared memory as an MN-major operand (transpose bit).
 * Two CTAs share an SM (≤ 128 registers, 2 × 97 KB of shared memory at D = 128), so one CTA's
 * softmax overlaps the other's MMAs; at D = 256 one CTA fills it (193 KB), and P·V is two m64n128k16 halves.
 *
 * Shared-memory layout: every tile is made of 64-row regions (a warpgroup's Q rows, a K or a V
 * tile); a region holds D/64 panels of 64 rows × 128 bytes (64 elements of one row), each in the
 * 128-byte swizzle (16-byte chunk c of row r at chunk position c ^ (r & 7)), 1024-byte aligned.
 * That is the canonical SWIZZLE_128B layout of the PTX ISA's matrix descriptors:
 *   K-major (Q and K for Q·Kᵀ): 8-row core groups 1024 bytes apart (SBO); a 16-wide k step is
 *     +32 bytes inside a panel, panels are k steps 4 apart;
 *   MN-major (V for P·V): 8-key groups 1024 bytes apart (SBO), 64-column panels 64·128 bytes
 *     apart (LBO).
 * Tiles are filled by cp.async (zero-filled past N); the writes reach wgmma (async proxy)
 * through fence.proxy.async before the CTA barrier.
 *
 * A second kernel, ws_fwd_kernel (fwd_kernel=wgmma-ws, D ≤ 128; auto keeps the one above), computes the same
 * in the same tiles with FlashAttention-3's overlap, one CTA of three warpgroups per SM:
 *   warp specialization: warpgroup 0 only loads (Q, then K/V tiles into a ring of 4 stages, ≈ 160 KB at D = 128,
 *     80 KB at D = 64), warpgroups 1 and 2 only compute; full/empty mbarriers per stage replace the CTA
 *     barrier, and setmaxnreg moves registers from the loader (40) to the computing warpgroups (232);
 *   intra-warpgroup overlap: a computing warpgroup issues S(t) = Q·K(t)ᵀ and O += P(t-1)·V(t-1) as two wgmma
 *     groups, waits for the first only, and runs tile t's masking and softmax while P·V runs; O is rescaled
 *     once P·V is done. The two warpgroups run unsynchronized, so one's softmax also overlaps the other's MMAs;
 *   Q in registers: S = Q·Kᵀ reads its A operand from registers loaded once, halving that MMA's shared-memory
 *     reads.
 *
 * The kernel bodies exist only in the sm_90a image (this file is compiled for sm_90a alone when
 * configure's arch list has 90, see m4/sparge_cuda.m4); without it the entry reports the
 * kernel unavailable and forward.cu keeps its mma.sync kernel. */
#include <math.h>

#include "forward.h"
#include "mma.cuh"
#include "row_tiles.cuh"
#include "sm90_tile.cuh"
#include "wgmma.cuh"

#ifdef SPARGE_CUDA_SM90A

using namespace sparge_mma;
using namespace sparge_wgmma;
using sparge_sm90::aligned_smem;
using sparge_sm90::load_tile;
using sparge_sm90::mbar_arrive;
using sparge_sm90::mbar_init;
using sparge_sm90::mbar_wait;
using sparge_sm90::panel_offset;
using sparge_sm90::set_max_regs_dec;
using sparge_sm90::set_max_regs_inc;
using sparge_sm90::store_wg_rows;
using sparge_sm90::warp_uniform;
using sparge_sm90::wgmma_a_bt;

namespace {

constexpr int BLOCK_Q = FWD_BLOCK_Q, TILE_K = FWD_TILE_K;
constexpr int WG_ROWS = 64, THREADS = 256, STAGES = 2;
constexpr int PANEL_ROW_BYTES = 128, CORE_GROUP_BYTES = 8 * PANEL_ROW_BYTES;

template <int D>
struct wg_traits {
    static constexpr int ROW_CHUNKS = D / 8;
    static constexpr int PANEL_BYTES = WG_ROWS * PANEL_ROW_BYTES; /* 64 rows × 64 elements */
    static constexpr int REGION_BYTES = WG_ROWS * D * 2;          /* 64 rows × D */
    static constexpr int Q_BYTES = (BLOCK_Q / WG_ROWS) * REGION_BYTES;
    static constexpr int SMEM_BYTES = Q_BYTES + STAGES * 2 * REGION_BYTES + 1024; /* + alignment slack */
    static_assert(TILE_K == WG_ROWS, "a K or V tile is one 64-row region");
};

/* ---------------------------------------------------------------- per-tile steps of both kernels */

constexpr int N_TILES = TILE_K / 8; /* 8-key column tiles of a 64-key score tile */

/* Keys past nk do not exist (ragged last block); with causal, keys past a query's diagonal are masked. s: a
 * warpgroup's 64×64 scores of tile t, row_first its first query, row0 this thread's first row inside the 64 (its
 * second is 8 on). */
template <bool CAUSAL>
__device__ __forceinline__ void mask_scores(float (&s)[N_TILES][4], const row_tiles<TILE_K> &w, int t, int nk,
                                            int diag, int row_first, int row0, int lane)
{
    if (w.ragged(t, nk) || (CAUSAL && w.key0(t) + TILE_K - 1 > row_first + diag)) {
        const int key0 = w.key0(t);
#pragma unroll
        for (int nt = 0; nt < N_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = key0 + nt * 8 + frag_col(lane) + (e & 1), row = row_first + row0 + 8 * (e >> 1);
                if (key >= nk || (CAUSAL && key > row + diag))
                    s[nt][e] = -INFINITY;
            }
    }
}

/* Online softmax, rows r0 (e = 0,1) and r0 + 8 (e = 2,3): forward.cu's arithmetic. s becomes P (unnormalized);
 * alpha, the factor of row r's earlier sum and O, is applied to the sum here and handed to on_alpha(r, alpha) for O. */
template <typename F>
__device__ __forceinline__ void softmax_tile(float (&s)[N_TILES][4], float row_max[2], float row_sum[2],
                                             float scale_log2, F on_alpha)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < N_TILES; nt++)
            mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = quad_max(mx) * scale_log2;
        const float m_new = fmaxf(row_max[r], mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* no (-inf) - (-inf) */
        const float alpha = exp2f(row_max[r] - m_use);
        row_max[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < N_TILES; nt++)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s[nt][e] = exp2f(fmaf(s[nt][e], scale_log2, -m_use));
                sum += s[nt][e];
            }
        row_sum[r] = row_sum[r] * alpha + sum;
        on_alpha(r, alpha);
    }
}

/* O's row r (e = 2r, 2r + 1) times alpha. */
template <int D_TILES>
__device__ __forceinline__ void rescale_row(float (&o_acc)[D_TILES][4], int r, float alpha)
{
#pragma unroll
    for (int dt = 0; dt < D_TILES; dt++) {
        o_acc[dt][2 * r] *= alpha;
        o_acc[dt][2 * r + 1] *= alpha;
    }
}

/* P (the softmax's s) packed to 16 bits: the A fragments of P·V's four k16 steps. */
template <typename T>
__device__ __forceinline__ void scores_to_a(uint32_t (&pa)[TILE_K / 16][4], float (&s)[N_TILES][4])
{
#pragma unroll
    for (int kk = 0; kk < TILE_K / 16; kk++)
        c_pair_to_a<T>(pa[kk], s[2 * kk], s[2 * kk + 1]);
}

/* O += P·V over one 64-key tile: issued, not committed (the caller fences before and commits after). */
template <typename T, int D>
__device__ __forceinline__ void wgmma_pv(float (&o_acc)[D / 8][4], const uint32_t (&pa)[TILE_K / 16][4],
                                         uint32_t v_tile)
{
    const uint64_t v_desc = sw128_desc(v_tile, wg_traits<D>::PANEL_BYTES, CORE_GROUP_BYTES);
#pragma unroll
    for (int kk = 0; kk < TILE_K / 16; kk++) {
        const uint64_t v_kk = desc_advance(v_desc, kk * 2 * CORE_GROUP_BYTES);
        if constexpr (D <= 128) {
            wgmma_rs_t<T, D>(&o_acc[0][0], pa[kk], v_kk);
        } else { /* n128 halves: columns 128·half.., two 64-column panels further each */
#pragma unroll
            for (int half = 0; half < D / 128; half++)
                wgmma_rs_t<T, 128>(&o_acc[16 * half][0], pa[kk],
                                   desc_advance(v_kk, half * 2 * wg_traits<D>::PANEL_BYTES));
        }
    }
}

/* Epilogue, first half: normalize, write the LSE, and stage O (row-major, forward.cu's swizzle) at o_stage, a
 * 64-row region that only this warpgroup reads, for store_wg_rows' 16-byte coalesced stores after a barrier.
 * wg_q0: the warpgroup's first query row. */
template <typename T, int D, bool VARLEN>
__device__ __forceinline__ void finish_rows(const fwd_params &p, const row_tiles<TILE_K> &w, const gpu_seq &sq,
                                            int wg_q0, int row0, int lane, float (&o_acc)[D / 8][4],
                                            const float row_max[2], const float row_sum[2], unsigned char *o_stage)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float l = quad_sum(row_sum[r]);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const int row_local = row0 + 8 * r;
        const int row = wg_q0 + row_local;
        if (p.lse && (lane & 3) == 0 && row < sq.nq)
            p.lse[fwd_lse_index<VARLEN>(p, w.bh, w.h, sq, row)] =
                l > 0.0f ? (row_max[r] + log2f(l)) * 0.69314718055994531f : -INFINITY;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
            *reinterpret_cast<uint32_t *>(o_stage + swizzle<wg_traits<D>::ROW_CHUNKS>(row_local, dt) + (lane & 3) * 4) =
                pack2<T>(o_acc[dt][2 * r] * inv, o_acc[dt][2 * r + 1] * inv);
    }
}

/* ---------------------------------------------------------------- kernel */

/* D = 256: 193 KB of shared memory and a 64×256 f32 accumulator (128 registers) a thread, one CTA per SM. */
template <int D>
constexpr int ctas_per_sm() { return D > 128 ? 1 : 2; }

template <typename T, int D, bool CAUSAL, bool VARLEN, bool PAD>
__global__ void __launch_bounds__(THREADS, ctas_per_sm<D>()) wgmma_fwd_kernel(const fwd_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using W = wg_traits<D>;
    constexpr int D_TILES = D / 8;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem;
    const uint32_t smem0 = aligned_smem(smem_raw, &smem);

    const int tid = threadIdx.x, lane = tid & 31, wg = warp_uniform(tid >> 7), wg_tid = tid & 127;
    gpu_wait_for_previous_kernel();
    const row_tiles<TILE_K> w(p.order, p.Nqb, p.H, p.counts, p.indices, p.Nkb, p.sub_shift);
    const int h = w.h, q0 = w.qblock * BLOCK_Q;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, w.b);
    if (VARLEN && q0 >= sq.nq) /* a row past its sequence */
        return;
    const int n_tiles = warp_uniform(CAUSAL && !p.counts ? fwd_causal_tiles(p, sq, q0, w.n_tiles) : w.n_tiles);
    const int nq = sq.nq, nk = sq.nk, diag = nk - nq;

    const T *q = (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn;
    const T *k = (const T *)p.k + sq.tb * p.k_sb + gpu_kv_head(h, p.kv_magic) * p.k_sh + sq.k_off * p.k_sn;
    const T *v = (const T *)p.v + sq.tb * p.v_sb + gpu_kv_head(h, p.kv_magic) * p.v_sh + sq.k_off * p.v_sn;

    const uint32_t q_smem = smem0;
    auto k_smem = [&](int stage) { return q_smem + W::Q_BYTES + stage * 2 * W::REGION_BYTES; };
    auto v_smem = [&](int stage) { return k_smem(stage) + W::REGION_BYTES; };
    auto issue_tile = [&](int t) { /* one group per tile, empty past the last */
        if (t < n_tiles) {
            int key0 = w.key0(t);
            load_tile<T, D, TILE_K, THREADS, PAD>(k_smem(t % STAGES), k, p.k_sn, key0, nk, tid, p.d_chunks);
            load_tile<T, D, TILE_K, THREADS, PAD>(v_smem(t % STAGES), v, p.v_sn, key0, nk, tid, p.d_chunks);
        }
        cp_async_commit();
    };

    /* Groups in commit order: Q, tile 0, tile 1, ... */
    load_tile<T, D, BLOCK_Q, THREADS, PAD>(q_smem, q, p.q_sn, q0, nq, tid, p.d_chunks);
    cp_async_commit();
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++)
        issue_tile(t);

    /* This thread's accumulator rows inside the warpgroup's 64: r0 and r0 + 8 (e = 0,1 and 2,3). */
    const int row0 = (wg_tid >> 5) * 16 + frag_row(lane);
    const uint32_t q_wg = q_smem + wg * W::REGION_BYTES;

    float o_acc[D_TILES][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}; /* row_max in the exp2 domain */

    for (int t = 0; t < n_tiles; t++) {
        const int stage = t % STAGES;
        /* Tile t (K and V) landed; every warpgroup is done with tile t-1, whose buffers the prefetch reuses. One
         * barrier per tile: V(t) was issued with K(t), a tile ago, so waiting for it here costs little, and a second
         * barrier before P·V made the warpgroups meet twice per tile (ncu: barrier stalls led, 2.1 cycles per issued
         * instruction). */
        cp_async_wait<STAGES - 2>();
        fence_proxy_async();
        __syncthreads();
        issue_tile(t + STAGES - 1);

        float s[N_TILES][4];
        const uint32_t k_tile = k_smem(stage);
        wgmma_fence();
        wgmma_a_bt<T, D>(&s[0][0], q_wg, k_tile);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(s);

        const int row_first = q0 + wg * WG_ROWS; /* this warpgroup's first query */
        mask_scores<CAUSAL>(s, w, t, nk, diag, row_first, row0, lane);
        softmax_tile(s, row_max, row_sum, p.scale_log2, [&](int r, float alpha) { rescale_row(o_acc, r, alpha); });
        uint32_t pa[TILE_K / 16][4];
        scores_to_a<T>(pa, s);

        fence_operands(o_acc);
        fence_operands(pa);
        wgmma_fence();
        wgmma_pv<T, D>(o_acc, pa, v_smem(stage));
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(o_acc);
    }
    cp_async_wait<0>();
    __syncthreads(); /* every thread's copies landed (Q, when no tile ran) before O is staged over Q */

    /* Epilogue: normalize, LSE, then stage O (row-major, forward.cu's swizzle) through this
     * warpgroup's own Q region, which only its own wgmma ever read, for 16-byte coalesced stores. */
    unsigned char *o_stage = smem + wg * W::REGION_BYTES;
    finish_rows<T, D, VARLEN>(p, w, sq, q0 + wg * WG_ROWS, row0, lane, o_acc, row_max, row_sum, o_stage);
    __syncthreads();
    store_wg_rows<T, D, PAD>((T *)p.o + sq.tb * p.o_sb + h * p.o_sh + sq.q_off * p.o_sn, p.o_sn, q0 + wg * WG_ROWS,
                             nq, o_stage, wg_tid, p.d_chunks);
#endif
}

/* One of this file's kernels over n_items query blocks with smem bytes of shared memory, refused past the device's
 * limit; desc names the kernel in that refusal, what in launch errors. sm_90a code only: the kernels hold the wait,
 * so their CTAs may be set up while the launch order drains. */
sparge_status launch_fwd(gpu_ctx *ctx, void (*kernel)(fwd_params), int smem, int threads, const char *desc,
                         const char *what, int D, const fwd_params &p, int64_t n_items)
{
    if ((size_t)smem > ctx->smem_optin)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: the %s (D=%d) needs %d bytes of shared memory, the device "
                           "allows %zu", desc, D, smem, ctx->smem_optin);
    sparge_status s;
    if ((s = GPU_CHECK(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, smem))))
        return s;
    return gpu_launch_dependent(ctx, kernel, (unsigned)n_items, threads, (size_t)smem, what, p);
}

template <typename T, int D, bool PAD>
sparge_status launch(gpu_ctx *ctx, const fwd_params &p, int64_t n_items)
{
    auto kernel = p.seq_q ? (p.causal ? wgmma_fwd_kernel<T, D, true, true, PAD>
                                      : wgmma_fwd_kernel<T, D, false, true, PAD>)
                          : (p.causal ? wgmma_fwd_kernel<T, D, true, false, PAD>
                                      : wgmma_fwd_kernel<T, D, false, false, PAD>);
    return launch_fwd(ctx, kernel, wg_traits<D>::SMEM_BYTES, THREADS, "wgmma forward", "wgmma_fwd_kernel", D, p,
                      n_items);
}

/* ---------------------------------------------------------------- warp-specialized kernel (fwd_kernel=wgmma-ws) */

/* Three warpgroups: the producer (warpgroup 0) only loads, the two consumers (1, 2) only compute, through a ring of
 * WS_STAGES K/V stages. The producer's copies are cp.async (16 bytes a thread, the same swizzled tiles and
 * zero-fill as above); a thread learns its own copies landed only by waiting for their group. Before it blocks on
 * a free stage for tile t it waits for tile t - 2, fences it into the async proxy and arrives on its full barrier,
 * so the consumers never wait on the producer's stage wait; tiles t - 1 and t stay in flight. A consumer frees tile
 * t's stage only after P·V(t), which it issues with S(t + 1): the stage for tile t needs full(t - WS_STAGES + 1),
 * which the producer signals at its step t - WS_STAGES + 3, before its wait at step t when WS_STAGES ≥ 3. */
constexpr int WS_THREADS = 384, WS_STAGES = 4, WS_CONSUMER_WARPS = 8;
static_assert(WS_STAGES >= 3, "the producer's stage wait needs a tile it has already signalled");
/* setmaxnreg: the producer gives back what the consumers take, within the 168 registers a thread of
 * __launch_bounds__(384, 1) (65536 / 384, rounded down to 8): more and setmaxnreg.inc would wait forever. */
constexpr int WS_PRODUCER_REGS = 40, WS_CONSUMER_REGS = 232;
static_assert(WS_PRODUCER_REGS + 2 * WS_CONSUMER_REGS <= 3 * 168, "the register file of 384 threads");

template <int D>
struct ws_traits {
    using W = wg_traits<D>;
    /* mbarriers after the tiles: q_full, full[WS_STAGES], empty[WS_STAGES] */
    static constexpr int BAR_OFFSET = W::Q_BYTES + WS_STAGES * 2 * W::REGION_BYTES;
    static constexpr int SMEM_BYTES = BAR_OFFSET + (1 + 2 * WS_STAGES) * 8 + 1024; /* + alignment slack */
};

/* S = Q·Kᵀ with Q from registers (A fragments qa, loaded once) and the K tile from shared memory: only K is read
 * from shared memory per k step (m64n64k16 with both operands there reads 4 KB, at the tensor cores' peak about
 * all the bandwidth shared memory has while it runs). One group, like wgmma_a_bt. */
template <typename T, int D>
__device__ __forceinline__ void wgmma_qreg_kt(float acc[32], const uint32_t (&qa)[D / 16][4], uint32_t k_tile)
{
    const uint64_t b0 = sw128_desc(k_tile, 16, CORE_GROUP_BYTES);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        wgmma_rs_n64<T>(acc, qa[kk], desc_advance(b0, (kk >> 2) * wg_traits<D>::PANEL_BYTES + (kk & 3) * 32), kk > 0);
}

template <typename T, int D, bool CAUSAL, bool VARLEN, bool PAD>
__global__ void __launch_bounds__(WS_THREADS, 1) ws_fwd_kernel(const fwd_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using W = wg_traits<D>;
    using WS = ws_traits<D>;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem;
    const uint32_t smem0 = aligned_smem(smem_raw, &smem);

    const int tid = threadIdx.x, lane = tid & 31, wg = warp_uniform(tid >> 7), wg_tid = tid & 127;
    const uint32_t q_full = smem0 + WS::BAR_OFFSET;
    auto full = [&](int stage) { return q_full + 8 * (1 + stage); };
    auto empty = [&](int stage) { return q_full + 8 * (1 + WS_STAGES + stage); };
    if (tid == 0) {
        mbar_init(q_full, 128);
        for (int i = 0; i < WS_STAGES; i++) {
            mbar_init(full(i), 128);                /* every producer thread, for its own copies */
            mbar_init(empty(i), WS_CONSUMER_WARPS); /* one lane of each consumer warp */
        }
    }
    gpu_wait_for_previous_kernel();
    const row_tiles<TILE_K> w(p.order, p.Nqb, p.H, p.counts, p.indices, p.Nkb, p.sub_shift);
    const int h = w.h, q0 = w.qblock * BLOCK_Q;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, w.b);
    if (VARLEN && q0 >= sq.nq) /* a row past its sequence: the whole CTA leaves */
        return;
    /* At least 0 (defensive: masks refuse causal with Nq > Nk): the producer must signal Q whatever the count. */
    const int n_tiles =
        warp_uniform(max(0, CAUSAL && !p.counts ? fwd_causal_tiles(p, sq, q0, w.n_tiles) : w.n_tiles));
    const int nq = sq.nq, nk = sq.nk, diag = nk - nq;
    __syncthreads(); /* the barriers are initialized */

    const uint32_t q_smem = smem0;
    auto k_smem = [&](int stage) { return q_smem + W::Q_BYTES + stage * 2 * W::REGION_BYTES; };
    auto v_smem = [&](int stage) { return k_smem(stage) + W::REGION_BYTES; };

    if (wg == 0) {
        /* Producer. Groups in commit order: Q (group 0), tile t (group t + 1). */
        set_max_regs_dec<WS_PRODUCER_REGS>();
        const T *q = (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn;
        const T *k = (const T *)p.k + sq.tb * p.k_sb + gpu_kv_head(h, p.kv_magic) * p.k_sh + sq.k_off * p.k_sn;
        const T *v = (const T *)p.v + sq.tb * p.v_sb + gpu_kv_head(h, p.kv_magic) * p.v_sh + sq.k_off * p.v_sn;
        auto landed = [&](int group) { mbar_arrive(group == 0 ? q_full : full((group - 1) % WS_STAGES)); };
        load_tile<T, D, BLOCK_Q, 128, PAD>(q_smem, q, p.q_sn, q0, nq, wg_tid, p.d_chunks);
        cp_async_commit();
        for (int t = 0; t < n_tiles; t++) {
            const int stage = t % WS_STAGES, key0 = w.key0(t);
            if (t >= 1) { /* group t - 1 (Q, or tile t - 2) landed: signalled before blocking on a stage */
                cp_async_wait<1>();
                fence_proxy_async();
                landed(t - 1);
            }
            if (t >= WS_STAGES) /* the consumers freed tile t - WS_STAGES */
                mbar_wait(empty(stage), (t / WS_STAGES + 1) & 1);
            load_tile<T, D, TILE_K, 128, PAD>(k_smem(stage), k, p.k_sn, key0, nk, wg_tid, p.d_chunks);
            load_tile<T, D, TILE_K, 128, PAD>(v_smem(stage), v, p.v_sn, key0, nk, wg_tid, p.d_chunks);
            cp_async_commit();
        }
        cp_async_wait<0>();
        fence_proxy_async();
        for (int g = max(0, n_tiles - 1); g <= n_tiles; g++)
            landed(g);
        return;
    }

    /* Consumers: warpgroup wg - 1 owns query rows 64·(wg - 1).. of the block. */
    set_max_regs_inc<WS_CONSUMER_REGS>();
    const int cw = wg - 1;
    const int row0 = (wg_tid >> 5) * 16 + frag_row(lane); /* this thread's rows r0, r0 + 8 among the 64 */
    const int row_first = q0 + cw * WG_ROWS;

    float o_acc[D / 8][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}; /* row_max in the exp2 domain */
    float s[N_TILES][4];
    uint32_t pa[TILE_K / 16][4];
    uint32_t qa[D / 16][4]; /* Q's A fragments, k step kk: rows r0, r0 + 8, columns 16·kk.. */
    auto scores = [&](int t) { /* S(t), issued, not committed */
        wgmma_qreg_kt<T, D>(&s[0][0], qa, k_smem(t % WS_STAGES));
    };
    auto free_stage = [&](int t) { /* this warp's wgmma reads of tile t are done (after a wait) */
        __syncwarp();
        if (lane == 0)
            mbar_arrive(empty(t % WS_STAGES));
    };
    mbar_wait(q_full, 0);
    /* The fragment layout of P (c_pair_to_a): register j of k step kk holds row r0 + 8·(j & 1), columns
     * 16·kk + 8·(j >> 1) + frag_col(lane) and the next: 16-byte chunk 2·kk + (j >> 1), bytes 4·(lane & 3).. */
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            qa[kk][j] = *reinterpret_cast<const uint32_t *>(
                smem + cw * W::REGION_BYTES + panel_offset(row0 + 8 * (j & 1), 2 * kk + (j >> 1)) + 4 * (lane & 3));
    if (n_tiles > 0) {
        mbar_wait(full(0), 0);
        wgmma_fence();
        scores(0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(s);
        mask_scores<CAUSAL>(s, w, 0, nk, diag, row_first, row0, lane);
        softmax_tile(s, row_max, row_sum, p.scale_log2, [](int, float) {}); /* O is still zero */
        scores_to_a<T>(pa, s);
    }
    for (int t = 1; t < n_tiles; t++) {
        /* S(t) = Q·K(t)ᵀ and O += P(t-1)·V(t-1) in flight together; the softmax of S(t) runs while P·V does. */
        mbar_wait(full(t % WS_STAGES), (t / WS_STAGES) & 1);
        fence_operands(o_acc);
        fence_operands(pa);
        wgmma_fence();
        scores(t);
        wgmma_commit();
        wgmma_pv<T, D>(o_acc, pa, v_smem((t - 1) % WS_STAGES));
        wgmma_commit();
        wgmma_wait<1>(); /* S(t) */
        fence_operands(s);
        mask_scores<CAUSAL>(s, w, t, nk, diag, row_first, row0, lane);
        float alpha[2]; /* for O once P·V(t-1) is done */
        softmax_tile(s, row_max, row_sum, p.scale_log2, [&](int r, float a) { alpha[r] = a; });
        wgmma_wait<0>(); /* P(t-1)·V(t-1): O and the P fragments are this thread's again */
        fence_operands(o_acc);
        fence_operands(pa);
        free_stage(t - 1);
        rescale_row(o_acc, 0, alpha[0]);
        rescale_row(o_acc, 1, alpha[1]);
        scores_to_a<T>(pa, s);
    }
    if (n_tiles > 0) {
        fence_operands(o_acc);
        fence_operands(pa);
        wgmma_fence();
        wgmma_pv<T, D>(o_acc, pa, v_smem((n_tiles - 1) % WS_STAGES));
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(o_acc);
    }

    /* Epilogue through this warpgroup's own Q region, which only this warpgroup read: its named barrier (1 + cw, 128
     * threads) orders every warp's Q loads above before the staging (a row without tiles has no wgmma between them),
     * and the staging before the stores. */
    unsigned char *o_stage = smem + cw * W::REGION_BYTES;
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    finish_rows<T, D, VARLEN>(p, w, sq, row_first, row0, lane, o_acc, row_max, row_sum, o_stage);
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    store_wg_rows<T, D, PAD>((T *)p.o + sq.tb * p.o_sb + h * p.o_sh + sq.q_off * p.o_sn, p.o_sn, row_first, nq,
                             o_stage, wg_tid, p.d_chunks);
#endif
}

template <typename T, int D, bool PAD>
sparge_status launch_ws(gpu_ctx *ctx, const fwd_params &p, int64_t n_items)
{
    auto kernel = p.seq_q ? (p.causal ? ws_fwd_kernel<T, D, true, true, PAD> : ws_fwd_kernel<T, D, false, true, PAD>)
                          : (p.causal ? ws_fwd_kernel<T, D, true, false, PAD> : ws_fwd_kernel<T, D, false, false, PAD>);
    return launch_fwd(ctx, kernel, ws_traits<D>::SMEM_BYTES, WS_THREADS, "warp-specialized wgmma forward",
                      "ws_fwd_kernel", D, p, n_items);
}

/* The warp-specialized kernel where ws is set and D ≤ 128, else the first. */
template <typename T, int D, bool PAD>
sparge_status launch_sm90(gpu_ctx *ctx, const fwd_params &p, int64_t n_items, bool ws)
{
    if constexpr (D <= 128)
        if (ws)
            return launch_ws<T, D, PAD>(ctx, p, n_items);
    return launch<T, D, PAD>(ctx, p, n_items);
}

} // namespace

int sparge_cuda_wgmma_forward_available(const gpu_ctx *ctx)
{
    if (ctx->cc_major != 9 || ctx->cc_minor != 0)
        return 0;
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, wgmma_fwd_kernel<gpu_bf16, 128, false, false, false>) != cudaSuccess) {
        (void)cudaGetLastError(); /* no loadable sm_90a image: not sticky, clear it */
        return 0;
    }
    return 1;
}

sparge_status sparge_cuda_wgmma_forward(gpu_ctx *ctx, const fwd_params &p, int64_t n_items, sparge_dtype dt, int D,
                                        bool ws)
{
    /* A head dim below the tile's width (fwd_tile_dim) runs the PAD kernels. */
    const bool bf = dt == SPARGE_BF16, pad = D != fwd_tile_dim(D);
    if (fwd_tile_dim(D) == 256)
        return bf ? launch_sm90<gpu_bf16, 256, false>(ctx, p, n_items, ws)
                  : launch_sm90<gpu_half, 256, false>(ctx, p, n_items, ws);
    if (fwd_tile_dim(D) == 128)
        return bf ? (pad ? launch_sm90<gpu_bf16, 128, true>(ctx, p, n_items, ws)
                         : launch_sm90<gpu_bf16, 128, false>(ctx, p, n_items, ws))
                  : (pad ? launch_sm90<gpu_half, 128, true>(ctx, p, n_items, ws)
                         : launch_sm90<gpu_half, 128, false>(ctx, p, n_items, ws));
    return bf ? (pad ? launch_sm90<gpu_bf16, 64, true>(ctx, p, n_items, ws)
                     : launch_sm90<gpu_bf16, 64, false>(ctx, p, n_items, ws))
              : (pad ? launch_sm90<gpu_half, 64, true>(ctx, p, n_items, ws)
                     : launch_sm90<gpu_half, 64, false>(ctx, p, n_items, ws));
}

#else /* no sm_90a image in this build */

int sparge_cuda_wgmma_forward_available(const gpu_ctx *ctx)
{
    (void)ctx;
    return 0;
}

sparge_status sparge_cuda_wgmma_forward(gpu_ctx *ctx, const fwd_params &p, int64_t n_items, sparge_dtype dt, int D,
                                        bool ws)
{
    (void)ctx, (void)p, (void)n_items, (void)dt, (void)D, (void)ws;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: this build has no sm_90a wgmma forward (configure "
                       "--with-cuda-arch with 90)");
}

#endif
