/* Block-sparse attention forward on tensor cores (mma.sync m16n8k16, sm_80+).
 *
 * FlashAttention-2 style: one CTA per (b, h, query block of 128 rows) walks only
 * the kept key blocks of its row (CSR of the mask; all blocks when dense) in
 * compute tiles of 64 keys, with Q·Kᵀ and P·V on tensor cores, an fp32 online
 * softmax in registers and K/V tiles streamed by cp.async through a
 * multi-stage shared-memory ring. O is written in the input dtype, LSE in fp32.
 *
 * Load balance: under the hybrid mask rows keep very different numbers of
 * blocks. A stable counting sort on the device (one CTA per head, no host
 * synchronization after mask prediction) orders each head's query blocks by
 * descending block count; the grid runs them in that order, so the heaviest
 * rows start early and the last wave holds light rows (short tail), while the
 * CTAs in flight stay on about one head (K/V reuse in L2).
 *
 * Layers: kernel (templated on dtype, D, warps, stages, score split) → launcher → entry point.
 *
 * On sm_90 the wgmma kernels of forward_sm90.cu run instead when the build has them (tiles.h, fwd_use_wgmma, and
 * fwd_use_ws for which of the two); this file then only validates, orders and fills the parameters.
 *
 * Device options (backend.cu) for benchmarks: fwd_tile="warps,stages[,split]" picks another compiled tile than
 * tiles.h's; fwd_order=natural turns the heavy-first order off; fwd_kernel=mma|wgmma forces either kernel,
 * fwd_kernel=wgmma-ws forward_sm90.cu's warp-specialized one. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "mma.cuh"
#include "row_tiles.cuh"
#include "tiles.h"

using namespace sparge_mma;

namespace {

constexpr int BLOCK_Q = FWD_BLOCK_Q, TILE_K = FWD_TILE_K;

template <typename T, int D, int WARPS, int STAGES, bool SPLIT>
struct fwd_kernel_traits {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int M_TILES = BLOCK_Q / (16 * WARPS); /* m16 tiles per warp */
    static constexpr int ROWS_PER_WARP = 16 * M_TILES;
    static constexpr int ROW_CHUNKS = D / 8; /* 16-byte chunks per row */
    static constexpr int Q_BYTES = BLOCK_Q * D * 2;
    static constexpr int KV_BYTES = TILE_K * D * 2;
    static constexpr int SMEM_BYTES = Q_BYTES + STAGES * 2 * KV_BYTES;
    /* Q fragments stay in registers when they are small (≤ 32 registers). */
    static constexpr bool Q_IN_REGS = M_TILES == 1 && D <= 128;
    static constexpr int SCORE_MTILES = SPLIT ? 1 : M_TILES; /* m16 tiles whose scores are live at once */
    static_assert(BLOCK_Q % (16 * WARPS) == 0 && STAGES >= 2, "bad tile");
};

/* Copy ROWS rows of D elements starting at row0 into a swizzled tile; rows at or
 * past `limit` are zero-filled, and with PAD the chunks at or past dch (a head dim
 * padded to the tile's D). Each thread always copies the same chunk column
 * (THREADS is a multiple of the chunks per row), so its rows step by a multiple of
 * 8 and keep one swizzle. The loop is deliberately not unrolled: unrolled, the
 * compiler keeps every row's 64-bit address live across the attention loop. */
template <typename T, int D, int ROWS, int THREADS, bool PAD>
__device__ __forceinline__ void load_rows(uint32_t dst, const T *base, int64_t sn, int row0, int limit, int tid,
                                          int dch)
{
    constexpr int ROW_CHUNKS = D / 8, ROW_STEP = THREADS / ROW_CHUNKS;
    static_assert(THREADS % ROW_CHUNKS == 0 && ROW_STEP % 8 == 0 && ROWS % ROW_STEP == 0, "bad tile split");
    const int ch = tid % ROW_CHUNKS;
    if (PAD && ch >= dch)
        limit = 0; /* every row of a padded column is zeros */
    int row = row0 + tid / ROW_CHUNKS;
    dst += swizzle<ROW_CHUNKS>(tid / ROW_CHUNKS, ch);
    const T *src = base + (int64_t)row * sn + ch * 8;
#pragma unroll 1
    for (int it = 0; it < ROWS / ROW_STEP; it++) {
        const bool ok = row < limit;
        cp_async_16(dst, ok ? src : base, ok);
        row += ROW_STEP;
        src += ROW_STEP * sn;
        dst += ROW_STEP * D * 2;
    }
}

template <typename T, int D, int WARPS, int STAGES, bool SPLIT, bool CAUSAL, bool VARLEN, bool PAD>
__global__ void __launch_bounds__(WARPS * 32) fwd_kernel(const fwd_params p)
{
    using K = fwd_kernel_traits<T, D, WARPS, STAGES, SPLIT>;
    constexpr int M_TILES = K::M_TILES, ROW_CHUNKS = K::ROW_CHUNKS, N_TILES = TILE_K / 8, D_TILES = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const row_tiles<TILE_K> w(p.order, p.Nqb, p.H, p.counts, p.indices, p.Nkb, p.sub_shift);
    const int h = w.h, q0 = w.qblock * BLOCK_Q;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, w.b);
    if (VARLEN && q0 >= sq.nq) /* a row past its sequence */
        return;
    const int n_tiles = CAUSAL && !p.counts ? fwd_causal_tiles(p, sq, q0, w.n_tiles) : w.n_tiles;
    const int nq = sq.nq, nk = sq.nk, diag = nk - nq;

    const T *q = (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn;
    const T *k = (const T *)p.k + sq.tb * p.k_sb + gpu_kv_head(h, p.kv_magic) * p.k_sh + sq.k_off * p.k_sn;
    const T *v = (const T *)p.v + sq.tb * p.v_sb + gpu_kv_head(h, p.kv_magic) * p.v_sh + sq.k_off * p.v_sn;

    const uint32_t q_smem = smem_addr(smem);
    auto k_smem = [&](int stage) { return q_smem + K::Q_BYTES + stage * 2 * K::KV_BYTES; };
    auto v_smem = [&](int stage) { return k_smem(stage) + K::KV_BYTES; };
    auto issue_tile = [&](int t) { /* two groups, K then V, so S = Q·Kᵀ can start before V lands */
        if (t < n_tiles) {
            int key0 = w.key0(t);
            load_rows<T, D, TILE_K, K::THREADS, PAD>(k_smem(t % STAGES), k, p.k_sn, key0, nk, tid, p.d_chunks);
            cp_async_commit();
            load_rows<T, D, TILE_K, K::THREADS, PAD>(v_smem(t % STAGES), v, p.v_sn, key0, nk, tid, p.d_chunks);
            cp_async_commit();
        } else {
            cp_async_commit();
            cp_async_commit();
        }
    };

    /* Groups in commit order: Q, K0, V0, K1, V1, ... */
    load_rows<T, D, BLOCK_Q, K::THREADS, PAD>(q_smem, q, p.q_sn, q0, nq, tid, p.d_chunks);
    cp_async_commit();
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++)
        issue_tile(t);

    const int warp_row0 = warp * K::ROWS_PER_WARP;
    constexpr int ROW_BYTES = D * 2;
    /* Lane parts of the ldmatrix addresses (see swizzle_kstep in mma.cuh). */
    const uint32_t a_lane = lane_a_row(lane) * ROW_BYTES, a_xor = swizzle_lane_xor(lane_a_row(lane), lane_a_chunk(lane));
    const uint32_t bt_lane = lane_bt_row(lane) * ROW_BYTES,
                   bt_xor = swizzle_lane_xor(lane_bt_row(lane), lane_bt_chunk(lane));
    const uint32_t q_warp = q_smem + warp_row0 * ROW_BYTES + a_lane;
    uint32_t q_frag[K::Q_IN_REGS ? M_TILES : 1][K::Q_IN_REGS ? D / 16 : 1][4];
    if constexpr (K::Q_IN_REGS) {
        cp_async_wait<2 * (STAGES - 1)>();
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                ldmatrix_x4(q_frag[mt][kk], q_warp + mt * 16 * ROW_BYTES + swizzle_kstep(kk, a_xor));
    }

    float o_acc[M_TILES][D_TILES][4] = {};
    float row_max[M_TILES][2], row_sum[M_TILES][2] = {}; /* row_max in the exp2 domain; row_sum per lane */
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            row_max[mt][r] = -INFINITY;

    for (int t = 0; t < n_tiles; t++) {
        const int stage = t % STAGES;
        const uint32_t k_stage = k_smem(stage) + bt_lane, v_stage = v_smem(stage) + a_lane;
        /* K(t) landed; every warp is done with tile t-1, whose buffers the prefetch reuses. */
        cp_async_wait<2 * STAGES - 3>();
        __syncthreads();
        issue_tile(t + STAGES - 1);

        /* Scores of MG m16 tiles at a time: MG = M_TILES shares each K fragment between the
         * warp's m tiles; MG = 1 re-reads K per m tile but holds half the fp32 scores (registers). */
        constexpr int MG = K::SCORE_MTILES;
        const int key0 = w.key0(t);
        uint32_t pa[M_TILES][TILE_K / 16][4]; /* P as 16-bit A fragments: the fp32 scores die before P·V */
#pragma unroll
        for (int g = 0; g < M_TILES / MG; g++) {
            float s[MG][N_TILES][4] = {};
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t a[MG][4];
#pragma unroll
                for (int mi = 0; mi < MG; mi++) {
                    const int mt = g * MG + mi;
                    if constexpr (K::Q_IN_REGS) {
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            a[mi][e] = q_frag[K::Q_IN_REGS ? mt : 0][K::Q_IN_REGS ? kk : 0][e];
                    } else {
                        ldmatrix_x4(a[mi], q_warp + mt * 16 * ROW_BYTES + swizzle_kstep(kk, a_xor));
                    }
                }
#pragma unroll
                for (int np = 0; np < N_TILES / 2; np++) {
                    uint32_t bfrag[4];
                    ldmatrix_x4(bfrag, k_stage + np * 16 * ROW_BYTES + swizzle_kstep(kk, bt_xor));
#pragma unroll
                    for (int mi = 0; mi < MG; mi++) {
                        mma_16816<T>(s[mi][2 * np], a[mi], bfrag);
                        mma_16816<T>(s[mi][2 * np + 1], a[mi], bfrag + 2);
                    }
                }
            }

            /* Keys past nk do not exist (ragged last block); with causal, keys past a query's diagonal are masked. */
            if (key0 + TILE_K > nk || (CAUSAL && key0 + TILE_K - 1 > q0 + warp_row0 + diag)) {
#pragma unroll
                for (int mi = 0; mi < MG; mi++)
#pragma unroll
                    for (int nt = 0; nt < N_TILES; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int key = key0 + nt * 8 + frag_col(lane) + (e & 1);
                            const int row = q0 + warp_row0 + (g * MG + mi) * 16 + frag_row(lane) + 8 * (e >> 1);
                            if (key >= nk || (CAUSAL && key > row + diag))
                                s[mi][nt][e] = -INFINITY;
                        }
            }

            /* Online softmax: rows g (e = 0,1) and g+8 (e = 2,3) of each m16 tile. */
#pragma unroll
            for (int mi = 0; mi < MG; mi++) {
                const int mt = g * MG + mi;
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < N_TILES; nt++)
                        mx = fmaxf(mx, fmaxf(s[mi][nt][2 * r], s[mi][nt][2 * r + 1]));
                    mx = quad_max(mx) * p.scale_log2;
                    const float m_new = fmaxf(row_max[mt][r], mx);
                    const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* no (-inf) - (-inf) */
                    const float alpha = exp2f(row_max[mt][r] - m_use);
                    row_max[mt][r] = m_new;
                    float sum = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < N_TILES; nt++)
#pragma unroll
                        for (int e = 2 * r; e < 2 * r + 2; e++) {
                            s[mi][nt][e] = exp2f(fmaf(s[mi][nt][e], p.scale_log2, -m_use));
                            sum += s[mi][nt][e];
                        }
                    row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
                    for (int dt = 0; dt < D_TILES; dt++) {
                        o_acc[mt][dt][2 * r] *= alpha;
                        o_acc[mt][dt][2 * r + 1] *= alpha;
                    }
                }
#pragma unroll
                for (int kk = 0; kk < TILE_K / 16; kk++)
                    c_pair_to_a<T>(pa[mt][kk], s[mi][2 * kk], s[mi][2 * kk + 1]);
            }
        }

        cp_async_wait<2 * STAGES - 2>(); /* V(t) landed */
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; kk++) {
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                uint32_t bfrag[4];
                ldmatrix_x4_trans(bfrag, v_stage + kk * 16 * ROW_BYTES + swizzle_kstep(dp, a_xor));
#pragma unroll
                for (int mt = 0; mt < M_TILES; mt++) {
                    mma_16816<T>(o_acc[mt][2 * dp], pa[mt][kk], bfrag);
                    mma_16816<T>(o_acc[mt][2 * dp + 1], pa[mt][kk], bfrag + 2);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads(); /* every thread's copies landed (Q, when no tile ran) before O is staged over Q */

    /* Epilogue: normalize, LSE, then stage O through this warp's own Q rows (only
     * this warp ever read them) for 16-byte coalesced stores. */
    unsigned char *o_stage = smem + warp_row0 * D * 2;
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float l = quad_sum(row_sum[mt][r]);
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int row_local = mt * 16 + frag_row(lane) + 8 * r;
            const int row = q0 + warp_row0 + row_local;
            if (p.lse && (lane & 3) == 0 && row < nq)
                p.lse[fwd_lse_index<VARLEN>(p, w.bh, h, sq, row)] =
                    l > 0.0f ? (row_max[mt][r] + log2f(l)) * 0.69314718055994531f : -INFINITY;
#pragma unroll
            for (int dt = 0; dt < D_TILES; dt++)
                *reinterpret_cast<uint32_t *>(o_stage + swizzle<ROW_CHUNKS>(row_local, dt) + (lane & 3) * 4) =
                    pack2<T>(o_acc[mt][dt][2 * r] * inv, o_acc[mt][dt][2 * r + 1] * inv);
        }
    }
    __syncwarp();
    T *o = (T *)p.o + sq.tb * p.o_sb + h * p.o_sh + sq.q_off * p.o_sn;
#pragma unroll
    for (int it = 0; it < K::ROWS_PER_WARP * ROW_CHUNKS / 32; it++) {
        const int c = it * 32 + lane;
        const int row_local = c / ROW_CHUNKS, ch = c % ROW_CHUNKS;
        const int row = q0 + warp_row0 + row_local;
        if (row < nq && (!PAD || ch < p.d_chunks))
            *reinterpret_cast<uint4 *>(o + (int64_t)row * p.o_sn + ch * 8) =
                *reinterpret_cast<const uint4 *>(o_stage + swizzle<ROW_CHUNKS>(row_local, ch));
    }
}

/* The launch order: each (b, h)'s query blocks heaviest first (most kept blocks), equal counts in ascending
 * order, by a stable counting sort with one CTA per (b, h). The heavy rows start in the first waves and the
 * last wave holds light ones (short tail), while the CTAs in flight stay on about one head's K/V (L2 reuse);
 * under an even mask (Top-k) it is the natural order. Counts beyond ORDER_BUCKETS - 1 share the top bucket.
 * The order only schedules: every item's result is the same whichever order it runs in. */
constexpr int ORDER_BUCKETS = 8192, ORDER_THREADS = 256, ORDER_STAGED = 2048;
__global__ void __launch_bounds__(ORDER_THREADS) order_rows_kernel(const int32_t *counts, int Nqb, int Nkb,
                                                                      int32_t *order)
{
    __shared__ int32_t slot[ORDER_BUCKETS]; /* slot 0 = heaviest; then each bucket's next position */
    __shared__ int32_t staged[ORDER_STAGED]; /* the first counts, so that the placement loop reads no global memory */
    __shared__ int scan_scratch[GPU_MAX_WARPS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int buckets = min(Nkb + 1, ORDER_BUCKETS), first = blockIdx.x * Nqb;
    auto bucket = [&](int32_t c) { return buckets - 1 - min(c, buckets - 1); };
    const int32_t *c = counts + first;
    gpu_wait_for_previous_kernel();
    /* The forward's CTAs may take their SMs now: they wait for this whole grid before reading the order. */
    gpu_allow_next_kernel();
    for (int j = tid; j < buckets; j += ORDER_THREADS)
        slot[j] = 0;
    __syncthreads();
    for (int i = tid; i < Nqb; i += ORDER_THREADS) {
        const int32_t n = c[i];
        if (i < ORDER_STAGED)
            staged[i] = n;
        atomicAdd(&slot[bucket(n)], 1);
    }
    __syncthreads();
    /* Exclusive scan: each thread owns a run of consecutive buckets. */
    const int per = (buckets + ORDER_THREADS - 1) / ORDER_THREADS, lo = min(tid * per, buckets),
              hi = min(lo + per, buckets);
    int sum = 0, total;
    for (int j = lo; j < hi; j++)
        sum += slot[j];
    for (int j = lo, offset = block_exclusive_scan(sum, &total, scan_scratch); j < hi; j++) {
        const int n = slot[j];
        slot[j] = offset;
        offset += n;
    }
    __syncthreads();
    /* One warp places the items 32 at a time in ascending order: equal buckets by lane within the 32. */
    if (warp == 0) {
        for (int i0 = 0; i0 < Nqb; i0 += 32) {
            const int i = i0 + lane;
            const int bk = i < Nqb ? bucket(i < ORDER_STAGED ? staged[i] : c[i]) : -1;
            const unsigned peers = __match_any_sync(0xffffffffu, bk);
            const int rank = __popc(peers & ((1u << lane) - 1u));
            if (i < Nqb)
                order[first + slot[bk] + rank] = first + i;
            __syncwarp();
            if (i < Nqb && rank == 0)
                slot[bk] += __popc(peers);
            __syncwarp();
        }
    }
}

template <typename T, int D, int WARPS, int STAGES, bool SPLIT, bool PAD>
sparge_status launch_fwd(gpu_ctx *ctx, const fwd_params &p, int64_t n_items)
{
    using K = fwd_kernel_traits<T, D, WARPS, STAGES, SPLIT>;
    static_assert(K::SMEM_BYTES == BLOCK_Q * D * 2 + STAGES * 2 * TILE_K * D * 2, "sparge_cuda_forward_fits counts it");
    sparge_status s;
    auto kernel = p.seq_q ? (p.causal ? fwd_kernel<T, D, WARPS, STAGES, SPLIT, true, true, PAD>
                                      : fwd_kernel<T, D, WARPS, STAGES, SPLIT, false, true, PAD>)
                          : (p.causal ? fwd_kernel<T, D, WARPS, STAGES, SPLIT, true, false, PAD>
                                      : fwd_kernel<T, D, WARPS, STAGES, SPLIT, false, false, PAD>);
    if ((s = GPU_CHECK(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, K::SMEM_BYTES))))
        return s;
    kernel<<<(unsigned)n_items, K::THREADS, K::SMEM_BYTES, ctx->stream>>>(p);
    return GPU_CHECK_LAUNCH("fwd_kernel");
}

/* The mma.sync tiles compiled below (tiles.h describes them), for head dim D: a padded D (fwd_tile_dim) has one
 * tile per width, 4 warps × 2 stages; D = 256 one of 8 warps × 2 stages. */
bool tile_compiled(int D, fwd_tile t)
{
    const int Dt = fwd_tile_dim(D);
    if (Dt == 256)
        return t.warps == 8 && t.stages == 2 && !t.split_scores;
    if (Dt != D)
        return t.warps == 4 && t.stages == 2 && !t.split_scores;
    return (D == 128 && t.warps == 4 && t.stages == 2) || (D == 128 && t.warps == 8 && t.stages == 2 && !t.split_scores) ||
           (D == 64 && t.warps == 4 && (t.stages == 2 || t.stages == 3) && !t.split_scores);
}

template <typename T>
sparge_status dispatch_tile(gpu_ctx *ctx, const fwd_params &p, int64_t n_items, int D, fwd_tile tile)
{
    const int Dt = fwd_tile_dim(D);
    if (Dt == 256)
        return launch_fwd<T, 256, 8, 2, false, false>(ctx, p, n_items);
    if (Dt != D)
        return Dt == 64 ? launch_fwd<T, 64, 4, 2, false, true>(ctx, p, n_items)
                        : launch_fwd<T, 128, 4, 2, false, true>(ctx, p, n_items);
    if (D == 128 && tile.warps == 4 && tile.stages == 2)
        return tile.split_scores ? launch_fwd<T, 128, 4, 2, true, false>(ctx, p, n_items)
                                 : launch_fwd<T, 128, 4, 2, false, false>(ctx, p, n_items);
    if (D == 128 && tile.warps == 8)
        return launch_fwd<T, 128, 8, 2, false, false>(ctx, p, n_items);
    if (D == 64 && tile.stages == 3)
        return launch_fwd<T, 64, 4, 3, false, false>(ctx, p, n_items);
    return launch_fwd<T, 64, 4, 2, false, false>(ctx, p, n_items);
}

/* The mma.sync tile of this device and D, or the one the fwd_tile option forces. */
fwd_tile tile_for(const gpu_ctx *ctx, int D)
{
    if (ctx->opt.fwd_warps)
        return fwd_tile{ctx->opt.fwd_warps, ctx->opt.fwd_stages, ctx->opt.fwd_split};
    const int Dt = fwd_tile_dim(D);
    if (Dt != D && Dt != 256)
        return fwd_tile{4, 2, 0};
    return fwd_tile_for(ctx->cc_major, ctx->cc_minor, Dt);
}

/* The wgmma kernel runs where the build has it for this device, unless fwd_kernel says otherwise. */
bool use_wgmma(const gpu_ctx *ctx, int D)
{
    if (ctx->opt.fwd_kernel != GPU_KERNEL_AUTO)
        return ctx->opt.fwd_kernel != GPU_KERNEL_MMA;
    return fwd_use_wgmma(ctx->cc_major, ctx->cc_minor, fwd_tile_dim(D)) && sparge_cuda_wgmma_forward_available(ctx);
}

} // namespace

sparge_status sparge_cuda_forward_fits(const gpu_ctx *ctx, int D)
{
    if (use_wgmma(ctx, D)) {
        if (!sparge_cuda_wgmma_forward_available(ctx))
            return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: fwd_kernel=%s needs an sm_90 device and a build with "
                               "90 in --with-cuda-arch (device is sm_%d%d)",
                               ctx->opt.fwd_kernel == GPU_KERNEL_WGMMA_WS ? "wgmma-ws" : "wgmma", ctx->cc_major, ctx->cc_minor);
        return SPARGE_OK;
    }
    const fwd_tile t = tile_for(ctx, D);
    if (!tile_compiled(D, t))
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: no forward tile of %d warps, %d stages%s is compiled for D=%d "
                           "(tiles.h lists them)", t.warps, t.stages, t.split_scores ? ", split scores" : "", D);
    const int Dt = fwd_tile_dim(D);
    const size_t smem = (size_t)BLOCK_Q * Dt * 2 + (size_t)t.stages * 2 * TILE_K * Dt * 2;
    if (smem > ctx->smem_optin)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: the forward tile (D=%d, %d warps, %d stages) needs %zu bytes "
                           "of shared memory, the device allows %zu", D, t.warps, t.stages, smem, ctx->smem_optin);
    return SPARGE_OK;
}

/* A call the "cuda" tier's supports() accepted (backend.cu): f16/bf16, D a multiple of 8 up to 128 or 256,
 * 16-byte rows, masks of 128-row query blocks and 64- or 128-key blocks. */
sparge_status sparge_cuda_mma_forward(gpu_ctx *ctx, const sparge_fwd_args *a)
{
    const sparge_dtype dt = a->q.dtype;
    const sparge_mask_view *m = a->mask;
    const int64_t D = a->q.D, B = m ? m->B : a->q.B, H = a->q.H, Nq = a->q.N, Nk = a->k.N;
    sparge_status s;
    const int64_t Nqb = m ? m->Nqb : (Nq + BLOCK_Q - 1) / BLOCK_Q;
    const int64_t n_items = B * H * Nqb;
    if (n_items == 0)
        return SPARGE_OK;

    fwd_params p = {};
    p.q = a->q.data, p.k = a->k.data, p.v = a->v.data, p.o = a->o.data;
    p.q_sb = a->q.sb, p.q_sh = a->q.sh, p.q_sn = a->q.sn;
    p.k_sb = a->k.sb, p.k_sh = a->k.sh, p.k_sn = a->k.sn;
    p.v_sb = a->v.sb, p.v_sh = a->v.sh, p.v_sn = a->v.sn;
    p.o_sb = a->o.sb, p.o_sh = a->o.sh, p.o_sn = a->o.sn;
    p.H = (int)H, p.Nq = (int)Nq, p.Nk = (int)Nk, p.Nqb = (int)Nqb;
    p.kv_magic = gpu_kv_magic(H / a->k.H);
    p.causal = a->causal;
    p.seq_q = m ? m->seq_q : nullptr;
    p.seq_k = m ? m->seq_k : nullptr;
    p.lse = a->lse;
    p.d_chunks = (int)(D / 8);
    p.scale_log2 = a->scale * 1.4426950408889634f;
    if (m) {
        p.Nkb = (int)m->Nkb;
        p.sub_shift = m->bk == 128 ? 1 : 0;
        p.counts = m->counts;
        p.indices = m->indices;
        if (!ctx->opt.fwd_natural_order) {
            void *ws;
            if ((s = gpu_workspace(ctx, (size_t)n_items * sizeof(int32_t), &ws)))
                return s;
            p.order = (const int32_t *)ws;
            if ((s = gpu_launch_after(ctx, order_rows_kernel, (unsigned)(B * H), ORDER_THREADS, 0, "order_rows_kernel",
                                      m->counts, (int)Nqb, (int)m->Nkb, (int32_t *)ws)))
                return s;
        }
    } else {
        p.Nkb = (int)((Nk + TILE_K - 1) / TILE_K);
    }
    if (use_wgmma(ctx, (int)D)) {
        const bool ws = ctx->opt.fwd_kernel == GPU_KERNEL_AUTO ? fwd_use_ws((int)D, m != nullptr)
                                                               : ctx->opt.fwd_kernel == GPU_KERNEL_WGMMA_WS;
        return sparge_cuda_wgmma_forward(ctx, p, n_items, dt, (int)D, ws);
    }
    const fwd_tile tile = tile_for(ctx, (int)D);
    return dt == SPARGE_BF16 ? dispatch_tile<gpu_bf16>(ctx, p, n_items, (int)D, tile)
                             : dispatch_tile<gpu_half>(ctx, p, n_items, (int)D, tile);
}
