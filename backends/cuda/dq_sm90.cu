/* Block-sparse attention backward for Hopper (sm_90a): the separate dQ pass on warpgroup MMA
 * (wgmma.mma_async).
 *
 * Same contract and arithmetic as backward.cu's mma.sync bwd_dq_kernel, which it replaces on sm_90:
 * one CTA per (b, h, query block of 128 rows) over the kept key blocks of its CSR row (every key
 * when dense) in tiles of 64 keys (two per block when bk = 128), recomputing
 *   S  = Q·Kᵀ            m64n64k16, Q and K K-major in shared memory (forward_sm90.cu's S),
 *   P  = exp2(S·scale·log2e − LSE·log2e),
 *   dP = dO·Vᵀ           m64n64k16, dO and V K-major in shared memory,
 *   dS = P∘(dP − D_t),
 *   dQ += dS·K           m64nDk16, dS from registers (the accumulator layout packed to 16 bits is
 *                        the A-fragment layout, as P in forward_sm90.cu's P·V), K MN-major,
 * and writes scale·dQ in the input dtype. It also does backward.cu's prep for its rows (it runs before
 * the dK/dV pass): D_t = rowsum(dO∘O) with the prep's arithmetic, and LSE·log2e, used here and written
 * to the padded arrays. No atomics: the result does not depend on scheduling
 * (deterministic). Two warpgroups of 128 threads each own 64 query rows (their Q, dO, LSE, D_t and
 * the 64 × D fp32 dQ accumulator stay put for the whole row); the K/V tiles are shared.
 *
 * Causal masks and packed sequences, as in the mma.sync kernel: causal (bottom-right, key u past
 * query t's diagonal when u > t + nk − nq of its sequence) gives P = 0 past the diagonal, tested per
 * token only on the tiles that reach past the diagonal of the warpgroup's first row, and a dense row
 * stops at the tile of its last query's diagonal. With packed sequences a CTA's query block and key
 * tiles lie in its sequence's frame (gpu_seq_of); a query block past its sequence computes nothing
 * but still writes its padded rows (D_t = 0, LSE·log2e = +inf) and counts itself, as the dK/dV pass
 * reads every padded row once every CTA has counted.
 *
 * Pipeline: K/V tiles are cp.async-prefetched AHEAD = 2 tiles ahead into STAGES = 4 buffers, the
 * copies issued while S and dP run. Per tile, each warpgroup commits S and dP as two wgmma groups
 * and computes P while dP runs; the dQ += dS·K product is left in flight across the next tile's
 * barrier and S/dP issue (waited for with S), which is why a stage more than the prefetch needs is
 * kept: the prefetch at tile t reuses the buffers of tile t − 2, whose dQ product every warpgroup
 * waited for during tile t − 1.
 * One CTA per SM: the two warpgroups' MMAs overlap each other's exponentials. At D = 128 the dQ
 * accumulator alone is 64 registers per thread, S and dP 32 each (182 to 191 registers by dtype,
 * causal and varlen, 193 KiB of shared memory); D = 64 needs 150 to 159 registers, so two CTAs per SM
 * (≤ 128) would make ptxas serialize the wgmma pipeline.
 *
 * Shared-memory layout: sm90_tile.cuh's 64-row regions of 128-byte swizzled panels, 1024-byte
 * aligned: Q (two regions, one per warpgroup), dO (two), then STAGES × (K, V).
 *
 * The kernel body exists only in the sm_90a image (compiled for sm_90a alone when configure's arch
 * list has 90, see m4/sparge_cuda.m4), like backward_sm90.cu's; backward.cu uses it where
 * sparge_cuda_wgmma_backward_available() says that image loads. */
#include <math.h>

#include "backward.h"
#include "mma.cuh"
#include "row_tiles.cuh"

#ifdef SPARGE_CUDA_SM90A

#include "sm90_tile.cuh"
#include "wgmma.cuh"

using namespace sparge_mma;
using namespace sparge_sm90;
using namespace sparge_wgmma;

namespace {

constexpr int THREADS = 256, WG_ROWS = 64, TILE_K = 64;
constexpr int STAGES = 4, AHEAD = STAGES - 2;

template <int D>
struct dq90_traits {
    static constexpr int TILE_BYTES = REGION_ROWS * D * 2; /* 64 rows × D */
    /* Q and dO (two regions each), STAGES × (K, V), alignment slack */
    static constexpr int SMEM_BYTES = 4 * TILE_BYTES + STAGES * 2 * TILE_BYTES + 1024;
    static_assert(BWD_BLOCK_Q == 2 * WG_ROWS && TILE_K == REGION_ROWS, "two warpgroups, 64-key tiles");
};

template <typename T, int D, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(THREADS, 1) wgmma_dq_kernel(const bwd_params p, int sub_shift)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using W = dq90_traits<D>;
    constexpr int N_TILES = TILE_K / 8, D_TILES = D / 8;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem;
    const uint32_t smem0 = aligned_smem(smem_raw, &smem);
    const uint32_t q_smem = smem0, do_smem = q_smem + 2 * W::TILE_BYTES;
    auto k_smem = [&](int stage) { return do_smem + 2 * W::TILE_BYTES + stage * 2 * W::TILE_BYTES; };
    auto v_smem = [&](int stage) { return k_smem(stage) + W::TILE_BYTES; };

    const int tid = threadIdx.x, lane = tid & 31, wg = warp_uniform(tid >> 7), wg_tid = tid & 127;
    const row_tiles<TILE_K> w(p.order, p.Nqb, p.H, p.counts, p.indices, p.Nkb, sub_shift);
    const int bh = w.bh, h = w.h, q0 = w.qblock * BWD_BLOCK_Q;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, w.b); /* with varlen, w.b is the sequence */
    const int nq = sq.nq, nk = sq.nk, diag = nk - nq;
    /* A query block past its sequence (varlen) has no row to compute: it only writes its rows of the padded arrays
     * and counts itself (the dK/dV pass reads those rows and waits for every CTA). It loads nothing: after an empty
     * last sequence even zero-filled loads would address past the end of Q. */
    const bool rows_here = !VARLEN || q0 < nq;
    /* Dense causal: the tiles up to the block's last diagonal, none when every key lies past it (the mask's rows
     * hold no block wholly past it). */
    const int last_diag = min(q0 + BWD_BLOCK_Q, nq) - 1 + diag;
    const int causal_tiles = last_diag < 0 ? 0 : min(w.n_tiles, last_diag / TILE_K + 1);
    const int n_tiles = warp_uniform(!rows_here ? 0 : CAUSAL && !p.counts ? causal_tiles : w.n_tiles);

    const int hk = gpu_kv_head(h, p.kv_magic);
    const T *k = (const T *)p.k + sq.tb * p.k_sb + hk * p.k_sh + sq.k_off * p.k_sn;
    const T *v = (const T *)p.v + sq.tb * p.v_sb + hk * p.v_sh + sq.k_off * p.v_sn;
    auto issue_tile = [&](int t) { /* one commit group per tile, empty past the last */
        if (t < n_tiles) {
            const int key0 = w.key0(t), stage = t % STAGES;
            load_tile<T, D, TILE_K, THREADS>(k_smem(stage), k, p.k_sn, key0, nk, tid);
            load_tile<T, D, TILE_K, THREADS>(v_smem(stage), v, p.v_sn, key0, nk, tid);
        }
        cp_async_commit();
    };

    /* Groups in commit order: Q, dO and tile 0; tile 1; ... */
    if (rows_here) {
        load_tile<T, D, BWD_BLOCK_Q, THREADS>(q_smem, (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn,
                                              p.q_sn, q0, nq, tid);
        load_tile<T, D, BWD_BLOCK_Q, THREADS>(
            do_smem, (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + sq.q_off * p.do_sn, p.do_sn, q0, nq, tid);
#pragma unroll
        for (int t = 0; t < AHEAD; t++)
            issue_tile(t);
    }

    /* This thread's accumulator rows inside the warpgroup's 64: row0 (e = 0, 1) and row0 + 8 (e = 2, 3),
     * columns nt·8 + c2 (+1). */
    const int row0 = (wg_tid >> 5) * 16 + frag_row(lane), c2 = frag_col(lane);
    const int row_first = q0 + wg * WG_ROWS, tok0 = row_first + row0; /* the warpgroup's first row, this thread's */
    /* The prep's work for these rows (the pass runs before the dK/dV pass, which reads what it writes): D_t
     * from 16-byte parts q, q + 4, ... of O and dO (q = lane % 4, the quad of the row's four threads) and the
     * prep's xor tree, its levels ≥ 4 in registers, 2 and 1 across the quad; LSE·log2e. Rows past the sequence's
     * nq (past Nq, or with varlen past the sequence, up to the padded end) get D_t = 0 and LSE·log2e = +inf (P = 0),
     * as in the prep. */
    float dt_r[2], lse_r[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        constexpr int PARTS = D / 8 / 4;
        const int tok = tok0 + 8 * r;
        float part[PARTS];
#pragma unroll
        for (int j = 0; j < PARTS; j++)
            part[j] = 0.0f;
        if (tok < nq) {
            const int64_t tt = sq.q_off + tok;
            const T *o = (const T *)p.o + sq.tb * p.o_sb + h * p.o_sh + tt * p.o_sn;
            const T *d_o = (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + tt * p.do_sn;
#pragma unroll
            for (int j = 0; j < PARTS; j++)
                part[j] = dt_part(o + ((lane & 3) + 4 * j) * 8, d_o + ((lane & 3) + 4 * j) * 8);
        }
#pragma unroll
        for (int m = PARTS / 2; m > 0; m /= 2)
#pragma unroll
            for (int j = 0; j < m; j++)
                part[j] += part[j + m];
        part[0] += __shfl_xor_sync(0xffffffffu, part[0], 2);
        part[0] += __shfl_xor_sync(0xffffffffu, part[0], 1);
        dt_r[r] = part[0];
        /* The LSE is [B, H, Nq], or [H, T] for packed sequences. */
        const int64_t at = VARLEN ? (int64_t)h * p.Nq + sq.q_off + tok : (int64_t)bh * p.Nq + tok;
        lse_r[r] = tok < nq ? p.lse[at] * BWD_LOG2E : INFINITY;
    }
    { /* the quad's four values to the padded arrays, one each */
        const int r = (lane >> 1) & 1;
        const int64_t row = (int64_t)bh * p.Nq_pad + tok0 + 8 * r;
        if (lane & 1)
            p.lse2[row] = r ? lse_r[1] : lse_r[0];
        else
            p.dt[row] = r ? dt_r[1] : dt_r[0];
    }
    /* Counted, then the dK/dV grid may launch (once every CTA of this grid has triggered): it reads these
     * rows after seeing the count complete, without waiting for this grid to end. The second barrier keeps
     * any thread's trigger after the count. */
    __syncthreads();
    if (tid == 0)
        add_release(p.dq_done);
    __syncthreads();
    gpu_allow_next_kernel();
    if (!rows_here)
        return;
    const float lse_0 = lse_r[0], lse_1 = lse_r[1], dt_0 = dt_r[0], dt_1 = dt_r[1];
    const uint32_t q_wg = q_smem + wg * W::TILE_BYTES, do_wg = do_smem + wg * W::TILE_BYTES;

    float dq[D_TILES * 4] = {};
    uint32_t dsa[TILE_K / 16][4]; /* dS as the A operand; read by the dQ product until the next tile's S wait */
#pragma unroll
    for (int kk = 0; kk < TILE_K / 16; kk++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dsa[kk][e] = 0u;
    /* The registers the dQ product reads and writes, pinned where it is issued and where it is known done. */
    auto fence_dq_operands = [&]() {
        fence_operands(dq);
        fence_operands(dsa);
    };

    for (int t = 0; t < n_tiles; t++) {
        const int stage = t % STAGES;
        /* K/V(t) landed; every warpgroup finished tile t − 2's dQ product (it waited for it with tile t − 1's
         * S), so the prefetch may overwrite that stage. */
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async();
        __syncthreads();
        const uint32_t k_tile = k_smem(stage), v_tile = v_smem(stage);

        /* Causal: the tile's first key for the diagonal test, its list entry loaded under the MMAs. */
        const int causal_key0 = CAUSAL ? w.key0(t) : 0;
        float s[N_TILES][4], dp[N_TILES][4];
        wgmma_fence();
        wgmma_a_bt<T, D>(&s[0][0], q_wg, k_tile);
        wgmma_commit();
        wgmma_a_bt<T, D>(&dp[0][0], do_wg, v_tile);
        wgmma_commit();
        issue_tile(t + AHEAD); /* under the MMAs (its list entry may miss in cache) */
        wgmma_wait<1>(); /* S and the previous tile's dQ product are done; dP may still run */
        fence_dq_operands();
        fence_operands(s);

        /* P; keys past nk (ragged last block, zero-filled K and V) and with causal keys past a query's diagonal
         * (key > row + nk − nq) get P = 0, in a branch of their own so that tiles away from both pay no per-element
         * test. The mask selects (a row that attends no key has LSE = −inf, so its P is +inf before it). */
#pragma unroll
        for (int nt = 0; nt < N_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[nt][e] = exp2f(fmaf(s[nt][e], p.scale_log2, -(e < 2 ? lse_0 : lse_1)));
        if (w.ragged(t, nk) || (CAUSAL && causal_key0 + TILE_K - 1 > row_first + diag)) {
            const int key0 = CAUSAL ? causal_key0 : w.key0(t);
#pragma unroll
            for (int nt = 0; nt < N_TILES; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = key0 + nt * 8 + c2 + (e & 1);
                    if (key >= nk || (CAUSAL && key > tok0 + 8 * (e >> 1) + diag))
                        s[nt][e] = 0.0f;
                }
        }

        wgmma_wait<0>();
#pragma unroll
        for (int nt = 0; nt < N_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                fence_operand(dp[nt][e]);
                dp[nt][e] = s[nt][e] * (dp[nt][e] - (e < 2 ? dt_0 : dt_1));
            }
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; kk++)
            c_pair_to_a<T>(dsa[kk], dp[2 * kk], dp[2 * kk + 1]);

        /* dQ += dS·K: K as the MN-major B operand (16 keys = 2048 bytes per k step), left in flight. */
        fence_dq_operands();
        wgmma_fence();
        const uint64_t k_desc = sw128_desc(k_tile, PANEL_BYTES, CORE_GROUP_BYTES);
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; kk++)
            wgmma_rs_t<T, D>(dq, dsa[kk], desc_advance(k_desc, kk * 2 * CORE_GROUP_BYTES));
        wgmma_commit();
    }
    wgmma_wait<0>();
    fence_dq_operands();
    cp_async_wait<0>();
    __syncthreads(); /* every copy landed (Q, when no tile ran) and no wgmma reads Q before dQ is staged over it */

    /* Epilogue: stage scale·dQ (row-major rows of D, mma.cuh's swizzle) through this warpgroup's own Q
     * region, which only its own wgmma read, for 16-byte coalesced stores. */
    unsigned char *dq_stage = smem + wg * W::TILE_BYTES;
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int dt = 0; dt < D_TILES; dt++)
            *reinterpret_cast<uint32_t *>(dq_stage + swizzle<D / 8>(row0 + 8 * r, dt) + (lane & 3) * 4) =
                pack2<T>(dq[dt * 4 + 2 * r] * p.scale, dq[dt * 4 + 2 * r + 1] * p.scale);
    __syncthreads();
    store_wg_rows<T, D>((T *)p.dq + sq.tb * p.dq_sb + h * p.dq_sh + sq.q_off * p.dq_sn, p.dq_sn, row_first, nq,
                        dq_stage, wg_tid);
#endif
}

template <typename T, int D>
sparge_status launch(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift)
{
    constexpr int SMEM = dq90_traits<D>::SMEM_BYTES;
    if ((size_t)SMEM > ctx->smem_optin)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda backward: the wgmma dQ kernel (D=%d) needs %d bytes of "
                           "shared memory, the device allows %zu", D, SMEM, ctx->smem_optin);
    sparge_status s;
    auto kernel = p.seq_q ? (p.causal ? wgmma_dq_kernel<T, D, true, true> : wgmma_dq_kernel<T, D, false, true>)
                          : (p.causal ? wgmma_dq_kernel<T, D, true, false> : wgmma_dq_kernel<T, D, false, false>);
    if ((s = GPU_CHECK(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, SMEM))))
        return s;
    const int64_t grid = BH * p.Nqb;
    if (grid == 0)
        return SPARGE_OK;
    kernel<<<(unsigned)grid, THREADS, SMEM, ctx->stream>>>(p, sub_shift);
    return GPU_CHECK_LAUNCH("wgmma backward dQ kernel");
}

} // namespace

sparge_status sparge_cuda_wgmma_dq(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, sparge_dtype dt,
                                   int D)
{
    if (dt == SPARGE_BF16)
        return D == 128 ? launch<gpu_bf16, 128>(ctx, p, BH, sub_shift) : launch<gpu_bf16, 64>(ctx, p, BH, sub_shift);
    return D == 128 ? launch<gpu_half, 128>(ctx, p, BH, sub_shift) : launch<gpu_half, 64>(ctx, p, BH, sub_shift);
}

#else /* no sm_90a image in this build */

sparge_status sparge_cuda_wgmma_dq(gpu_ctx *ctx, const bwd_params &p, int64_t BH, int sub_shift, sparge_dtype dt,
                                   int D)
{
    (void)ctx, (void)p, (void)BH, (void)sub_shift, (void)dt, (void)D;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: this build has no sm_90a wgmma backward (configure "
                       "--with-cuda-arch with 90)");
}

#endif
