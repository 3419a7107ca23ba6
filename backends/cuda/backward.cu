/* Block-sparse attention backward on tensor cores (mma.sync m16n8k16, ldmatrix, cp.async).
 *
 * FlashAttention-2 backward restricted to the kept blocks (docs/DESIGN.md), in three launches:
 *   1. prep:  D_t = rowsum(dO∘O) and LSE·log2(e) per query token into padded fp32 arrays (and, for the
 *             atomic dQ variant, zeroes the fp32 dQ accumulator);
 *   2. dK/dV: one CTA per key block (b,h,j) iterating over the query blocks that keep j (the transposed
 *             mask), recomputing Pᵀ = exp(s·K Qᵀ − LSE) with keys as rows so that Pᵀ and dSᵀ go from the
 *             accumulators straight into the A operand of dV += Pᵀ dO and dK += dSᵀ Q;
 *   3. dQ:    either fp32 atomics from the dK/dV pass (dQ += dS K per tile, then one conversion kernel), or
 *             a separate pass with one CTA per query block over its CSR row (no atomics: bitwise
 *             reproducible, used when deterministic is set; the prep then leaves out the fp32 accumulator).
 * The wgmma dQ pass (sm_90) does the prep's work itself: it runs first, each CTA computing D_t and LSE·log2(e)
 * of its 128 rows (the prep's arithmetic, same bits) and writing them for the dK/dV pass after it, which is its
 * programmatic dependent: it starts on the SMs the dQ pass's last wave leaves idle and reads those rows once every
 * dQ CTA has counted them written (device option bwd_overlap=on|off, default on; off starts it after the dQ pass).
 * When deterministic is 0, atomics are the default except with the wgmma kernels on bk = 64 masks: with the
 * mma.sync kernels on the H200 (experiments/BENCHMARKS.md) they took 64.3 ms against 76.1 ms dense
 * and were within 0.7 % of the pass on bk = 64 masks at 3–10 % density; with the wgmma kernels they are 3.5 %
 * faster dense (128 keys per dK/dV CTA) but 15 % slower at 95 % on bk = 64 masks (64 keys per CTA: twice the
 * reductions per FLOP), where the wgmma pass wins. The option dq=pass|atomic overrides the choice.
 *
 * On sm_90, when the build has the sm_90a image, the dK/dV pass runs backward_sm90.cu's wgmma kernel and the
 * separate dQ pass dq_sm90.cu's (prep, launch order and conversion stay here); the option bwd_kernel=mma|wgmma
 * forces either kernel family for both passes, bwd_keys=64|128 picks the wgmma dK/dV kernel's keys per CTA
 * (default 128, which applies to dense and bk = 128 masks; bk = 64 masks take 64), and bwd_kernel=wgmma-ws runs
 * the warp-specialized variant of the 128-key kernel where that one runs (the wgmma kernels elsewhere).
 *
 * Tile shapes (all architectures, sm_80/90/120; 256 threads, one CTA per SM):
 *   dK/dV: BN = bk keys per CTA; 8 warps as (BN/16 along keys) × (8·16/BN along queries), each warp owns
 *          16 keys × 64 queries, so a step covers BM = 64·(8·16/BN) query rows (64 for bk = 128, 128 for
 *          bk = 64). Per warp: Sᵀ and dPᵀ 16×64 (32 fp32 registers each), dK and dV 16×D (D/2 each).
 *   dQ pass: 8 warps × 16 query rows = one query block of 128; keys in steps of 64 (S, dP 16×64, dQ 16×D)
 *            (the wgmma pass: two warpgroups × 64 rows, same steps).
 *   D = 256 (mma.sync only, the wgmma kernels take D ≤ 128): dK/dV 64 keys per CTA (a bk = 128 block is two CTAs)
 *            and 64 query rows per step, 8 warps as 4 along keys × 2, each with Sᵀ and dPᵀ 16×32 and dK, dV
 *            16×128 (bwd_dkdv256_kernel); the dQ pass as above in steps of 32 keys (dQ 16×256: 128 registers).
 * Shared memory at D = 128: dK/dV 145 KiB (bk = 128) or 178 KiB (bk = 64), dQ pass 128 KiB (the wgmma one
 * 193 KiB); at D = 64 about half; at D = 256 dK/dV 209 KiB, dQ pass 192 KiB. That fits sm_90 (227 KiB); sm_80
 * (163 KiB) refuses D = 128 with bk = 64 and D = 256, and sm_120 (99 KiB) refuses D ≥ 128 altogether, with
 * SPARGE_ERR_UNSUPPORTED naming the limit (neither was run here).
 * Shared-memory tiles are rows of 16-byte chunks with chunk' = chunk ^ (row mod 8), so the 8 row
 * addresses of every ldmatrix and cp.async phase fall into distinct banks. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "backward.h"
#include "mma.cuh"

namespace {

using namespace sparge_mma;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlockQ = BWD_BLOCK_Q;

/* Copy `rows` rows of D elements starting at global row row0 (rows ≥ n are zero-filled) into the swizzled
 * tile at shared address `tile`, spread over the CTA's threads. */
template <typename T, int D, int rows>
__device__ __forceinline__ void load_rows(uint32_t tile, const T *base, int64_t sn, int row0, int n)
{
    constexpr int chunks = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < rows * chunks; c += kThreads) {
        int r = c / chunks, ch = c % chunks, gr = row0 + r;
        bool ok = gr < n;
        cp_async_16(tile + swizzle<chunks>(r, ch), base + (int64_t)(ok ? gr : 0) * sn + ch * 8, ok);
    }
}

/* Store a swizzled [rows][D] tile of T to global rows row0.. (rows ≥ n skipped), 16 bytes per access. */
template <typename T, int D, int rows>
__device__ __forceinline__ void store_rows(T *base, int64_t sn, int row0, int n, const T *tile)
{
    constexpr int chunks = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < rows * chunks; c += kThreads) {
        int r = c / chunks, ch = c % chunks, gr = row0 + r;
        if (gr < n)
            *(uint4 *)(base + (int64_t)gr * sn + ch * 8) =
                *(const uint4 *)((const char *)tile + swizzle<chunks>(r, ch));
    }
}

/* Write an accumulator pair (row, col..col+1) as T into a swizzled tile with rows of `cols` elements. */
template <typename T, int cols>
__device__ __forceinline__ void put2(T *tile, int row, int col, float x, float y)
{
    *(uint32_t *)((char *)tile + swizzle<cols / 8>(row, col >> 3) + (col & 7) * sizeof(T)) = pack2<T>(x, y);
}

/* swizzle_kstep(kk, lane_xor) (mma.cuh); at D = 256 as one of 4 lane values plus an immediate (lane_xor only
 * touches bits 4–6, so the bits of kk·32 from 7 up pass through): unrolled over 16 k steps the plain XOR leaves
 * 16 lane addresses per operand, which the compiler keeps in registers that dK, dV or dQ need. */
template <int D> __device__ __forceinline__ uint32_t kstep(int kk, uint32_t lane_xor)
{
    if constexpr (D == 256)
        return ((uint32_t)((kk & 3) * 32) ^ lane_xor) + (uint32_t)(kk >> 2) * 128;
    else
        return swizzle_kstep(kk, lane_xor);
}

/* A dK/dV step's query rows q0.. (of nq) of Q and dO into buffer buf of their tiles, with their LSE and D values. */
template <typename T, int D, int BM>
__device__ __forceinline__ void load_step(uint32_t aQ, uint32_t adO, float *sLse, float *sDt, int buf, const T *q,
                                          const T *d_o, const float *lse2, const float *dt, const bwd_params &p, int q0,
                                          int nq)
{
    const int t = threadIdx.x;
    load_rows<T, D, BM>(aQ + buf * BM * D * 2, q, p.q_sn, q0, nq);
    load_rows<T, D, BM>(adO + buf * BM * D * 2, d_o, p.do_sn, q0, nq);
    if (t < BM / 4)
        cp_async_16(smem_addr(sLse + buf * BM + 4 * t), lse2 + q0 + 4 * t, true);
    else if (t < BM / 2)
        cp_async_16(smem_addr(sDt + buf * BM + 4 * (t - BM / 4)), dt + q0 + 4 * (t - BM / 4), true);
}

/* A key tile's rows key0.. (of nk) of K and V, read at the query head's K/V head. */
template <typename T, int D, int BN>
__device__ __forceinline__ void load_kv(uint32_t aK, uint32_t aV, const bwd_params &p, const gpu_seq &sq, int h,
                                        int key0, int nk)
{
    const int hk = gpu_kv_head(h, p.kv_magic);
    load_rows<T, D, BN>(aK, (const T *)p.k + sq.tb * p.k_sb + hk * p.k_sh + sq.k_off * p.k_sn, p.k_sn, key0, nk);
    load_rows<T, D, BN>(aV, (const T *)p.v + sq.tb * p.v_sb + hk * p.v_sh + sq.k_off * p.v_sn, p.v_sn, key0, nk);
}

/* Pᵀ = exp2(Sᵀ·s·log2e − LSE·log2e) for a warp's 16 keys (rows g, g + 8) × NT·8 queries from column c0 of
 * lse2; keys past Nk (ok0, ok1 false) get P = 0, so they add nothing anywhere. */
template <int NT>
__device__ __forceinline__ void probs_t(float (&s)[NT][4], const float *lse2, int c0, bool ok0, bool ok1, float scale_log2)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        float2 l = *(const float2 *)(lse2 + c0 + nt * 8);
        s[nt][0] = ok0 ? exp2f(fmaf(s[nt][0], scale_log2, -l.x)) : 0.0f;
        s[nt][1] = ok0 ? exp2f(fmaf(s[nt][1], scale_log2, -l.y)) : 0.0f;
        s[nt][2] = ok1 ? exp2f(fmaf(s[nt][2], scale_log2, -l.x)) : 0.0f;
        s[nt][3] = ok1 ? exp2f(fmaf(s[nt][3], scale_log2, -l.y)) : 0.0f;
    }
}

/* Causal: P = 0 where key ka (row g; ka + 8 for row g + 8), shifted by the diagonal, lies past query q0 + nt·8. */
template <int NT> __device__ __forceinline__ void zero_past_diagonal(float (&s)[NT][4], int ka, int q0)
{
    const int kb = ka + 8;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int qt = q0 + nt * 8;
        s[nt][0] = ka > qt ? 0.0f : s[nt][0];
        s[nt][1] = ka > qt + 1 ? 0.0f : s[nt][1];
        s[nt][2] = kb > qt ? 0.0f : s[nt][2];
        s[nt][3] = kb > qt + 1 ? 0.0f : s[nt][3];
    }
}

/* dSᵀ = Pᵀ ∘ (dPᵀ − D) in place of dPᵀ, D read from column c0 of dt. */
template <int NT>
__device__ __forceinline__ void ds_t(float (&ds)[NT][4], const float (&s)[NT][4], const float *dt, int c0)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        float2 d = *(const float2 *)(dt + c0 + nt * 8);
        ds[nt][0] = s[nt][0] * (ds[nt][0] - d.x);
        ds[nt][1] = s[nt][1] * (ds[nt][1] - d.y);
        ds[nt][2] = s[nt][2] * (ds[nt][2] - d.x);
        ds[nt][3] = s[nt][3] * (ds[nt][3] - d.y);
    }
}

/* acc[16 × N] = A[16 rows from a_row0] · B[N rows from b_row0]ᵀ, contraction over D: both are swizzled
 * [rows][D] tiles at shared addresses a and b (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, S = Q Kᵀ, dP = dO Vᵀ). */
template <typename T, int D, int N>
__device__ __forceinline__ void gemm_nt_16xn(float (&acc)[N / 8][4], uint32_t a, int a_row0, uint32_t b, int b_row0,
                                             int lane)
{
    constexpr int row_bytes = D * 2;
    const uint32_t a_base = a + (a_row0 + lane_a_row(lane)) * row_bytes,
                   a_xor = swizzle_lane_xor(lane_a_row(lane), lane_a_chunk(lane));
    const uint32_t b_base = b + (b_row0 + lane_bt_row(lane)) * row_bytes,
                   b_xor = swizzle_lane_xor(lane_bt_row(lane), lane_bt_chunk(lane));
#pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[nt][e] = 0.0f;
    /* At D = 256, 4 k steps at a time: fully unrolled, the hoisted loads take registers the accumulators need. */
#pragma unroll(D == 256 ? 4 : D / 16)
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t af[4];
        ldmatrix_x4(af, a_base + kstep<D>(kk, a_xor));
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t bf[4];
            ldmatrix_x4(bf, b_base + np * 16 * row_bytes + kstep<D>(kk, b_xor));
            mma_16816<T>(acc[2 * np], af, bf);
            mma_16816<T>(acc[2 * np + 1], af, bf + 2);
        }
    }
}

/* acc[16 × D] += X[16 × K] · B[K rows from b_row0][D]: X comes from 16×K accumulator registers (rounded
 * to T), B is a swizzled [rows][D] tile read transposed (dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K). */
template <typename T, int D, int K>
__device__ __forceinline__ void gemm_rn_16xk(float (&acc)[D / 8][4], const float (&x)[K / 8][4], uint32_t b, int b_row0,
                                             int lane)
{
    constexpr int row_bytes = D * 2;
    const uint32_t b_base = b + (b_row0 + lane_a_row(lane)) * row_bytes,
                   b_xor = swizzle_lane_xor(lane_a_row(lane), lane_a_chunk(lane));
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t af[4];
        c_pair_to_a<T>(af, x[2 * kk], x[2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < D / 16; dp++) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, b_base + kk * 16 * row_bytes + kstep<D>(dp, b_xor));
            mma_16816<T>(acc[2 * dp], af, bf);
            mma_16816<T>(acc[2 * dp + 1], af, bf + 2);
        }
    }
}

/* acc[16 × C] += A[16 rows from a_row0][K] · B[K rows][columns c0 .. c0 + C − 1]: A a swizzled [rows][K] tile
 * (Pᵀ or dSᵀ written by the CTA's warps), B a swizzled [rows][D] tile read transposed (the D = 256 dK/dV pass).
 * c0 is a multiple of 64 columns (128 bytes), which the swizzle leaves in place: one base address per lane. */
template <typename T, int D, int K, int C>
__device__ __forceinline__ void gemm_sn_16xc(float (&acc)[C / 8][4], uint32_t a, int a_row0, uint32_t b, int c0,
                                             int lane)
{
    constexpr int row_bytes = D * 2;
    const uint32_t a_base = a + (a_row0 + lane_a_row(lane)) * K * 2,
                   a_xor = swizzle_lane_xor(lane_a_row(lane), lane_a_chunk(lane));
    const uint32_t b_base = b + lane_a_row(lane) * row_bytes + c0 * 2,
                   b_xor = swizzle_lane_xor(lane_a_row(lane), lane_a_chunk(lane));
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t af[4];
        ldmatrix_x4(af, a_base + kstep<D>(kk, a_xor));
#pragma unroll
        for (int dp = 0; dp < C / 16; dp++) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, b_base + kk * 16 * row_bytes + kstep<D>(dp, b_xor));
            mma_16816<T>(acc[2 * dp], af, bf);
            mma_16816<T>(acc[2 * dp + 1], af, bf + 2);
        }
    }
}

/* ------------------------------------------------------------------------------------------ prep */

template <typename T, int D, bool VARLEN>
__global__ void __launch_bounds__(kThreads) bwd_prep_kernel(bwd_params p, int64_t rows)
{
    constexpr int group = D / 8; /* threads per token, 8 elements (16 bytes) each */
    int64_t row = (int64_t)blockIdx.x * (kThreads / group) + threadIdx.x / group;
    int part = threadIdx.x % group;
    int bh = (int)(row / p.Nq_pad), t = (int)(row % p.Nq_pad), b = bh / p.H, h = bh % p.H;
    const gpu_seq sq = row < rows ? gpu_seq_of<VARLEN>(p, b) : gpu_seq{0, 0, 0, 0, 0};
    bool real = row < rows && t < sq.nq;
    float sum = 0.0f;
    if (real) {
        const int64_t tt = sq.q_off + t;
        sum = dt_part((const T *)p.o + sq.tb * p.o_sb + h * p.o_sh + tt * p.o_sn + part * 8,
                      (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + tt * p.do_sn + part * 8);
    }
#pragma unroll
    for (int m = group / 2; m > 0; m /= 2)
        sum += sparge_shfl_xor(sum, m);
    if (row >= rows)
        return;
    if (part == 0) {
        p.dt[row] = sum;
        /* The LSE is [B, H, Nq], or [H, T] for packed sequences. */
        const int64_t at = VARLEN ? (int64_t)h * p.Nq + sq.q_off + t : (int64_t)bh * p.Nq + t;
        p.lse2[row] = real ? p.lse[at] * BWD_LOG2E : INFINITY;
    }
    if (p.dq_accum) {
        float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float4 *acc = (float4 *)(p.dq_accum + row * D + part * 8);
        acc[0] = zero;
        acc[1] = zero;
    }
}

/* dq = scale · dq_accum in the output dtype, 16 bytes per thread. */
template <typename T, int D, bool VARLEN>
__global__ void __launch_bounds__(kThreads) bwd_dq_convert_kernel(bwd_params p, int64_t rows)
{
    constexpr int group = D / 8;
    int64_t row = (int64_t)blockIdx.x * (kThreads / group) + threadIdx.x / group;
    int part = threadIdx.x % group;
    int bh = (int)(row / p.Nq_pad), t = (int)(row % p.Nq_pad), b = bh / p.H, h = bh % p.H;
    if (row >= rows)
        return;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, b);
    if (t >= sq.nq)
        return;
    const float4 *acc = (const float4 *)(p.dq_accum + row * D + part * 8);
    float4 x = acc[0], y = acc[1];
    uint4 out = {pack2<T>(x.x * p.scale, x.y * p.scale), pack2<T>(x.z * p.scale, x.w * p.scale),
                 pack2<T>(y.x * p.scale, y.y * p.scale), pack2<T>(y.z * p.scale, y.w * p.scale)};
    *(uint4 *)((T *)p.dq + sq.tb * p.dq_sb + h * p.dq_sh + (int64_t)(sq.q_off + t) * p.dq_sn + part * 8) = out;
}

/* Launch order of the CTAs of a masked pass: tiles whose list (mask column or row) is long go first, so a
 * heavy tile (e.g. a key block every query keeps) never starts in the last wave and stretches the tail.
 * Counts are bucketed coarsely (kOrderBuckets shares of max_count) and the order inside a bucket is the
 * natural one, which keeps the CTAs of one head together for L2 reuse of its Q/dO (or K/V). One CTA per
 * order (job0, job1: the two passes' orders in one launch); the order only schedules work, results do not
 * depend on it. */
constexpr int kOrderThreads = 1024, kOrderBuckets = 16;

struct order_job {
    const int32_t *counts; /* n list lengths, each at most max_count; NULL: no order to make */
    int n, max_count;
    int32_t *order;
};

__global__ void __launch_bounds__(kOrderThreads) bwd_order_kernel(order_job job0, order_job job1, uint32_t *zero)
{
    if (zero && blockIdx.x == 0 && threadIdx.x == 0)
        *zero = 0;
    const order_job job = blockIdx.x ? job1 : job0;
    const int32_t *counts = job.counts;
    const int n = job.n, max_count = job.max_count;
    int32_t *order = job.order;
    __shared__ int offset[kOrderBuckets];
    __shared__ int warp_offset[kOrderThreads / 32][kOrderBuckets];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    auto bucket = [&](int c) {
        return kOrderBuckets - 1 - min(c * kOrderBuckets / (max_count + 1), kOrderBuckets - 1);
    };
    if (tid < kOrderBuckets)
        offset[tid] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kOrderThreads)
        atomicAdd(&offset[bucket(counts[i])], 1);
    __syncthreads();
    if (tid == 0)
        for (int b = 0, run = 0; b < kOrderBuckets; b++) {
            int c = offset[b];
            offset[b] = run;
            run += c;
        }
    for (int base = 0; base < n; base += kOrderThreads) {
        const int i = base + tid, bk = i < n ? bucket(counts[i]) : kOrderBuckets;
        const unsigned same = __match_any_sync(0xffffffffu, bk);
        const int rank = __popc(same & ((1u << lane) - 1));
        if (tid < kOrderThreads / 32 * kOrderBuckets)
            (&warp_offset[0][0])[tid] = 0;
        __syncthreads();
        if (i < n && rank == 0)
            warp_offset[warp][bk] = __popc(same);
        __syncthreads();
        if (tid < kOrderBuckets) {
            int run = offset[tid];
            for (int w = 0; w < kOrderThreads / 32; w++) {
                int c = warp_offset[w][tid];
                warp_offset[w][tid] = run;
                run += c;
            }
            offset[tid] = run;
        }
        __syncthreads();
        if (i < n)
            order[warp_offset[warp][bk] + rank] = i;
        __syncthreads();
    }
}

/* ------------------------------------------------------------------------------------------ dK/dV */

/* dQ[BM × D] += dS K for one step of a dK/dV pass, accumulated with fp32 reductions into dst (row 0 of the step's
 * queries, rows of D): dSᵀ is a swizzled [BN][BM] tile at ds_t, K a swizzled [BN][D] one at k. 8 warps as
 * (BM/32 along queries) × (rest along D), 32 rows × COLS = D/(8·32/BM) columns each; at D = 256 in passes of 32
 * columns (all 64 at once would not fit the registers beside dK and dV). */
template <typename T, int D, int BM, int BN>
__device__ __forceinline__ void dq_accum_step(float *dst, uint32_t ds_t, uint32_t k, int warp, int lane)
{
    constexpr int WM = BM / 32, WN = kWarps / WM, COLS = D / WN, PASS = D == 256 ? 32 : COLS, NT = PASS / 8;
    constexpr int row_bytes = D * 2;
    static_assert(COLS % PASS == 0 && PASS % 16 == 0, "dQ warp tile");
    const int m0 = (warp / WN) * 32, g = frag_row(lane), c2 = frag_col(lane);
    /* A = dS [query][key] is dSᵀ [key][query] read transposed: the Bᵀ lane addressing of mma.cuh. */
    const uint32_t a_base = ds_t + lane_bt_row(lane) * BM * 2,
                   a_xor = swizzle_lane_xor(lane_bt_row(lane), lane_bt_chunk(lane));
    const uint32_t b_base = k + lane_a_row(lane) * row_bytes,
                   b_xor = swizzle_lane_xor(lane_a_row(lane), lane_a_chunk(lane));
#pragma unroll 1
    for (int pass = 0; pass < COLS / PASS; pass++) {
        const int d0 = (warp % WN) * COLS + pass * PASS;
        float acc[2][NT][4] = {};
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t af[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                ldmatrix_x4_trans(af[mt], a_base + kk * 16 * BM * 2 + swizzle_kstep(m0 / 16 + mt, a_xor));
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t bf[4];
                ldmatrix_x4_trans(bf, b_base + kk * 16 * row_bytes + swizzle_kstep(d0 / 16 + np, b_xor));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_16816<T>(acc[mt][2 * np], af[mt], bf);
                    mma_16816<T>(acc[mt][2 * np + 1], af[mt], bf + 2);
                }
            }
        }
        float *out = dst + m0 * D + d0;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                float *e = out + (mt * 16 + g) * D + nt * 8 + c2;
                red_add2(e, acc[mt][nt][0], acc[mt][nt][1]);
                red_add2(e + 8 * D, acc[mt][nt][2], acc[mt][nt][3]);
            }
    }
}

template <typename T, int D, int BN> struct dkdv_tile {
    static constexpr int WN = BN / 16;       /* warps along keys */
    static constexpr int WM = kWarps / WN;   /* warps along queries */
    static constexpr int BM = 64 * WM;       /* query rows per step */
    static constexpr int SUB = kBlockQ / BM; /* steps per query block */
    static constexpr size_t smem = sizeof(T) * (2 * BN * D + 4 * BM * D + BN * BM) + sizeof(float) * 4 * BM;
    static_assert(BN == 64 || BN == 128, "key block");
    static_assert(WM == 1 || (size_t)WN * (D / 2) * 32 * 2 * sizeof(float) <= 4 * BM * D * sizeof(T),
                  "the cross-warp dK/dV reduction reuses the Q/dO buffers");
};

template <typename T, int D, int BN, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(kThreads, 1) bwd_dkdv_kernel(bwd_params p)
{
    using tile = dkdv_tile<T, D, BN>;
    constexpr int BM = tile::BM, SUB = tile::SUB, row_bytes = D * 2;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sK = (T *)smem_raw, *sV = sK + BN * D, *sQ = sV + BN * D, *sdO = sQ + 2 * BM * D, *sdS = sdO + 2 * BM * D;
    float *sLse = (float *)(sdS + BN * BM), *sDt = sLse + 2 * BM;
    const uint32_t aK = smem_addr(sK), aV = smem_addr(sV), aQ = smem_addr(sQ), adO = smem_addr(sdO),
                   adS = smem_addr(sdS);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kw = warp % tile::WN, qw = warp / tile::WN;
    const int kr0 = 16 * kw, qc0 = 64 * qw; /* the warp's keys and queries inside the tile */
    const int g = frag_row(lane), c2 = frag_col(lane);

    const int tile_id = p.order ? p.order[blockIdx.x] : blockIdx.x;
    const int bh = tile_id / p.Nkb, j = tile_id % p.Nkb, b = bh / p.H, h = bh % p.H;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, b);
    const int nq = sq.nq, nk = sq.nk, key0 = j * BN, diag = nk - nq;
    const int32_t *list = p.t_counts ? p.t_indices + (int64_t)tile_id * p.Nqb : nullptr;
    /* Dense causal: the query blocks before the first whose last query may attend key0 add nothing. */
    const int i0 = CAUSAL && !list ? max(0, key0 - diag) / kBlockQ : 0;
    const int nsteps = (list ? p.t_counts[tile_id] : p.Nqb - i0) * SUB;

    const T *q = (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn;
    const T *d_o = (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + sq.q_off * p.do_sn;
    const float *lse2 = p.lse2 + (int64_t)bh * p.Nq_pad, *dt = p.dt + (int64_t)bh * p.Nq_pad;

    auto step_row0 = [&](int n) { return (list ? list[n / SUB] : i0 + n / SUB) * kBlockQ + (n % SUB) * BM; };
    auto issue = [&](int n, int buf) {
        load_step<T, D, BM>(aQ, adO, sLse, sDt, buf, q, d_o, lse2, dt, p, step_row0(n), nq);
    };

    if (nsteps > 0) {
        load_kv<T, D, BN>(aK, aV, p, sq, h, key0, nk);
        issue(0, 0);
    }
    cp_async_commit();

    /* Keys past Nk (ragged last block) get P = 0, so they add nothing anywhere. */
    const bool key_ok0 = key0 + kr0 + g < nk, key_ok1 = key0 + kr0 + g + 8 < nk;
    float dv[D / 8][4] = {}, dk[D / 8][4] = {};

    for (int n = 0; n < nsteps; n++) {
        const int buf = n & 1;
        cp_async_double_buffer_step(n, nsteps, issue);
        const uint32_t tq = aQ + buf * BM * row_bytes, tdo = adO + buf * BM * row_bytes;
        const float *tl = sLse + buf * BM, *td = sDt + buf * BM;

        /* Pᵀ = exp2(Sᵀ·s·log2e − LSE·log2e), keys as rows, queries as columns. */
        float s[8][4];
        gemm_nt_16xn<T, D, 64>(s, aK, kr0, tq, qc0, lane);
        probs_t(s, tl, qc0 + c2, key_ok0, key_ok1, p.scale_log2);
        const int qa = step_row0(n) + qc0; /* causal: only near the diagonal */
        if (CAUSAL && key0 + kr0 + 15 > qa + diag)
            zero_past_diagonal(s, key0 + kr0 + g - diag, qa + c2);
        gemm_rn_16xk<T, D, 64>(dv, s, tdo, qc0, lane);

        /* dSᵀ = Pᵀ ∘ (dPᵀ − D), dPᵀ = V dOᵀ. */
        float ds[8][4];
        gemm_nt_16xn<T, D, 64>(ds, aV, kr0, tdo, qc0, lane);
        ds_t(ds, s, td, qc0 + c2);
        gemm_rn_16xk<T, D, 64>(dk, ds, tq, qc0, lane);

        if (p.dq_accum) {
            /* dQ[BM × D] += dS K, through dSᵀ in shared memory, accumulated with fp32 reductions. */
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                put2<T, BM>(sdS, kr0 + g, qc0 + nt * 8 + c2, ds[nt][0], ds[nt][1]);
                put2<T, BM>(sdS, kr0 + g + 8, qc0 + nt * 8 + c2, ds[nt][2], ds[nt][3]);
            }
            __syncthreads();
            dq_accum_step<T, D, BM, BN>(p.dq_accum + ((int64_t)bh * p.Nq_pad + step_row0(n)) * D, adS, aK, warp, lane);
        }
        __syncthreads(); /* the next step's loads overwrite this step's buffers */
    }
    cp_async_wait<0>();
    __syncthreads();

    /* Epilogue: with two query warp rows, sum their partial dK/dV (through the free Q/dO buffers). */
    if constexpr (tile::WM > 1) {
        float *red = (float *)sQ;
        constexpr int NR = D / 2; /* registers per tensor per thread */
        if (qw == 1)
#pragma unroll
            for (int nt = 0; nt < D / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    red[((kw * NR + nt * 4 + e) * 2 + 0) * 32 + lane] = dv[nt][e];
                    red[((kw * NR + nt * 4 + e) * 2 + 1) * 32 + lane] = dk[nt][e];
                }
        __syncthreads();
        if (qw == 0)
#pragma unroll
            for (int nt = 0; nt < D / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    dv[nt][e] += red[((kw * NR + nt * 4 + e) * 2 + 0) * 32 + lane];
                    dk[nt][e] += red[((kw * NR + nt * 4 + e) * 2 + 1) * 32 + lane];
                }
    }
    if (qw == 0)
#pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            int col = nt * 8 + c2;
            put2<T, D>(sV, kr0 + g, col, dv[nt][0], dv[nt][1]);
            put2<T, D>(sV, kr0 + g + 8, col, dv[nt][2], dv[nt][3]);
            put2<T, D>(sK, kr0 + g, col, dk[nt][0] * p.scale, dk[nt][1] * p.scale);
            put2<T, D>(sK, kr0 + g + 8, col, dk[nt][2] * p.scale, dk[nt][3] * p.scale);
        }
    __syncthreads();
    store_rows<T, D, BN>((T *)p.dv + sq.tb * p.dv_sb + h * p.dv_sh + sq.k_off * p.dv_sn, p.dv_sn, key0, nk, sV);
    store_rows<T, D, BN>((T *)p.dk + sq.tb * p.dk_sb + h * p.dk_sh + sq.k_off * p.dk_sn, p.dk_sn, key0, nk, sK);
}

/* D = 256: the per-warp 16 × D dK and dV of the kernel above would take 256 registers a thread, and its Q/dO
 * buffers 256 KiB. This one takes 64 keys per CTA (a 128-key mask block is two CTAs, sub_shift = 1) and 64 query
 * rows per step (two steps per query block). 8 warps as 4 along keys × 2: for Sᵀ and dPᵀ each warp computes 16 keys
 * × 32 queries and writes Pᵀ and dSᵀ to shared memory; for dV += Pᵀ dO and dK += dSᵀ Q each owns 16 keys × 128
 * columns (64 + 64 accumulator registers), so no cross-warp reduction is left for the epilogue. */
template <typename T> struct dkdv256_tile {
    static constexpr int D = 256, BN = 64, BM = 64, SUB = kBlockQ / BM;
    static constexpr size_t smem = sizeof(T) * (2 * BN * D + 4 * BM * D + 2 * BN * BM) + sizeof(float) * 4 * BM;
    static constexpr size_t smem_static = 128; /* the kernel's `src` block, which the device's limit counts too */
};

template <typename T, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(kThreads, 1) bwd_dkdv256_kernel(bwd_params p, int sub_shift)
{
    using tile = dkdv256_tile<T>;
    constexpr int D = tile::D, BN = tile::BN, BM = tile::BM, SUB = tile::SUB, row_bytes = D * 2, DC = D / 2;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sK = (T *)smem_raw, *sV = sK + BN * D, *sQ = sV + BN * D, *sdO = sQ + 2 * BM * D, *sP = sdO + 2 * BM * D,
      *sdS = sP + BN * BM;
    float *sLse = (float *)(sdS + BN * BM), *sDt = sLse + 2 * BM;
    const uint32_t aK = smem_addr(sK), aV = smem_addr(sV), aQ = smem_addr(sQ), adO = smem_addr(sdO),
                   aP = smem_addr(sP), adS = smem_addr(sdS);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    /* The warp's keys, its queries in Sᵀ and dPᵀ, its columns of dK and dV. */
    const int kr0 = 16 * (warp % 4), qc0 = 32 * (warp / 4), d0 = DC * (warp / 4);
    const int g = frag_row(lane), c2 = frag_col(lane);

    const int work = (int)(blockIdx.x >> sub_shift), part = (int)(blockIdx.x & ((1u << sub_shift) - 1));
    const int tile_id = p.order ? p.order[work] : work;
    const int bh = tile_id / p.Nkb, j = tile_id % p.Nkb, b = bh / p.H, h = bh % p.H;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, b);
    const int nq = sq.nq, nk = sq.nk, key0 = ((j << sub_shift) + part) * BN, diag = nk - nq;
    if (key0 >= nk) /* the second half of a ragged last block, or a block past its sequence */
        return;
    const int32_t *list = p.t_counts ? p.t_indices + (int64_t)tile_id * p.Nqb : nullptr;
    /* Dense causal: the query blocks before the first whose last query may attend key0 add nothing. */
    const int i0 = CAUSAL && !list ? max(0, key0 - diag) / kBlockQ : 0;
    const int nsteps = (list ? p.t_counts[tile_id] : p.Nqb - i0) * SUB;

    /* What the steps read, kept in shared memory rather than in registers that dK and dV need. */
    __shared__ struct {
        const T *q, *d_o;
        const float *lse2, *dt;
        const int32_t *list;
        int nq, i0;
    } src;
    if (threadIdx.x == 0) {
        src.q = (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn;
        src.d_o = (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + sq.q_off * p.do_sn;
        src.lse2 = p.lse2 + (int64_t)bh * p.Nq_pad, src.dt = p.dt + (int64_t)bh * p.Nq_pad;
        src.list = list, src.nq = nq, src.i0 = i0;
    }
    __syncthreads();

    auto step_row0 = [&](int n) {
        return (src.list ? src.list[n / SUB] : src.i0 + n / SUB) * kBlockQ + (n % SUB) * BM;
    };
    auto issue = [&](int n, int buf) {
        load_step<T, D, BM>(aQ, adO, sLse, sDt, buf, src.q, src.d_o, src.lse2, src.dt, p, step_row0(n), src.nq);
    };

    if (nsteps > 0) {
        load_kv<T, D, BN>(aK, aV, p, sq, h, key0, nk);
        issue(0, 0);
    }
    cp_async_commit();

    /* Keys past Nk (ragged last block) get P = 0, so they add nothing anywhere. */
    const bool key_ok0 = key0 + kr0 + g < nk, key_ok1 = key0 + kr0 + g + 8 < nk;
    float dv[DC / 8][4] = {}, dk[DC / 8][4] = {};

    for (int n = 0; n < nsteps; n++) {
        const int buf = n & 1;
        cp_async_double_buffer_step(n, nsteps, issue);
        const uint32_t tq = aQ + buf * BM * row_bytes, tdo = adO + buf * BM * row_bytes;
        const float *tl = sLse + buf * BM, *td = sDt + buf * BM;

        /* Pᵀ = exp2(Sᵀ·s·log2e − LSE·log2e), keys as rows, queries as columns. */
        float s[4][4];
        gemm_nt_16xn<T, D, 32>(s, aK, kr0, tq, qc0, lane);
        probs_t(s, tl, qc0 + c2, key_ok0, key_ok1, p.scale_log2);
        const int qa = step_row0(n) + qc0; /* causal: only near the diagonal */
        if (CAUSAL && key0 + kr0 + 15 > qa + diag)
            zero_past_diagonal(s, key0 + kr0 + g - diag, qa + c2);

        /* dSᵀ = Pᵀ ∘ (dPᵀ − D), dPᵀ = V dOᵀ; Pᵀ and dSᵀ go to shared memory for the other half's warps. */
        float ds[4][4];
        gemm_nt_16xn<T, D, 32>(ds, aV, kr0, tdo, qc0, lane);
        ds_t(ds, s, td, qc0 + c2);
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const int col = qc0 + nt * 8 + c2;
            put2<T, BM>(sP, kr0 + g, col, s[nt][0], s[nt][1]);
            put2<T, BM>(sP, kr0 + g + 8, col, s[nt][2], s[nt][3]);
            put2<T, BM>(sdS, kr0 + g, col, ds[nt][0], ds[nt][1]);
            put2<T, BM>(sdS, kr0 + g + 8, col, ds[nt][2], ds[nt][3]);
        }
        __syncthreads();
        gemm_sn_16xc<T, D, BM, DC>(dv, aP, kr0, tdo, d0, lane);
        gemm_sn_16xc<T, D, BM, DC>(dk, adS, kr0, tq, d0, lane);
        if (p.dq_accum)
            dq_accum_step<T, D, BM, BN>(p.dq_accum + ((int64_t)bh * p.Nq_pad + step_row0(n)) * D, adS, aK, warp, lane);
        __syncthreads(); /* the next step's loads overwrite this step's buffers, its Pᵀ and dSᵀ these */
    }
    cp_async_wait<0>();
    __syncthreads();

#pragma unroll
    for (int nt = 0; nt < DC / 8; nt++) {
        int col = d0 + nt * 8 + c2;
        put2<T, D>(sV, kr0 + g, col, dv[nt][0], dv[nt][1]);
        put2<T, D>(sV, kr0 + g + 8, col, dv[nt][2], dv[nt][3]);
        put2<T, D>(sK, kr0 + g, col, dk[nt][0] * p.scale, dk[nt][1] * p.scale);
        put2<T, D>(sK, kr0 + g + 8, col, dk[nt][2] * p.scale, dk[nt][3] * p.scale);
    }
    __syncthreads();
    store_rows<T, D, BN>((T *)p.dv + sq.tb * p.dv_sb + h * p.dv_sh + sq.k_off * p.dv_sn, p.dv_sn, key0, nk, sV);
    store_rows<T, D, BN>((T *)p.dk + sq.tb * p.dk_sb + h * p.dk_sh + sq.k_off * p.dk_sn, p.dk_sn, key0, nk, sK);
}

/* ------------------------------------------------------------------------------------------ dQ pass */

template <typename T, int D> struct dq_tile {
    static constexpr int KT = D == 256 ? 32 : 64; /* keys per step: at D = 256 two buffers of 64 keys would not fit */
    static constexpr size_t smem = sizeof(T) * (2 * kBlockQ * D + 4 * KT * D);
};

template <typename T, int D, int BN, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(kThreads, 1) bwd_dq_kernel(bwd_params p)
{
    constexpr int KT = dq_tile<T, D>::KT, SUB = BN / KT, row_bytes = D * 2;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T *sQ = (T *)smem_raw, *sdO = sQ + kBlockQ * D, *sK = sdO + kBlockQ * D, *sV = sK + 2 * KT * D;
    const uint32_t aQ = smem_addr(sQ), adO = smem_addr(sdO), aK = smem_addr(sK), aV = smem_addr(sV);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = 16 * warp, g = frag_row(lane), c2 = frag_col(lane);
    const int tile_id = p.order ? p.order[blockIdx.x] : blockIdx.x;
    const int bh = tile_id / p.Nqb, i = tile_id % p.Nqb, b = bh / p.H, h = bh % p.H;
    const gpu_seq sq = gpu_seq_of<VARLEN>(p, b);
    const int nq = sq.nq, nk = sq.nk, q0 = i * kBlockQ, diag = nk - nq;
    /* A row past its sequence stores nothing, and after an empty last sequence even its zero-filled loads would
     * address past the end of Q. */
    if (VARLEN && q0 >= nq)
        return;
    const int32_t *list = p.counts ? p.indices + (int64_t)tile_id * p.Nkb : nullptr;
    int nsteps = (list ? p.counts[tile_id] : p.Nkb) * SUB;
    if (CAUSAL && !list) /* dense causal: the KT-key steps up to the block's last diagonal */
        nsteps = min(nsteps, (min(q0 + kBlockQ, nq) - 1 + diag) / KT + 1);

    const int hk = gpu_kv_head(h, p.kv_magic);
    const T *k = (const T *)p.k + sq.tb * p.k_sb + hk * p.k_sh + sq.k_off * p.k_sn,
            *v = (const T *)p.v + sq.tb * p.v_sb + hk * p.v_sh + sq.k_off * p.v_sn;
    auto step_key0 = [&](int n) { return (list ? list[n / SUB] : n / SUB) * BN + (n % SUB) * KT; };
    auto issue = [&](int n, int buf) {
        int k0 = step_key0(n);
        load_rows<T, D, KT>(aK + buf * KT * row_bytes, k, p.k_sn, k0, nk);
        load_rows<T, D, KT>(aV + buf * KT * row_bytes, v, p.v_sn, k0, nk);
    };

    load_rows<T, D, kBlockQ>(aQ, (const T *)p.q + sq.tb * p.q_sb + h * p.q_sh + sq.q_off * p.q_sn, p.q_sn, q0, nq);
    load_rows<T, D, kBlockQ>(adO, (const T *)p.d_o + sq.tb * p.do_sb + h * p.do_sh + sq.q_off * p.do_sn, p.do_sn, q0,
                             nq);
    if (nsteps > 0)
        issue(0, 0);
    cp_async_commit();

    const int64_t row = (int64_t)bh * p.Nq_pad + q0 + r0 + g;
    const float lse_0 = p.lse2[row], lse_1 = p.lse2[row + 8], dt_0 = p.dt[row], dt_1 = p.dt[row + 8];
    float dq[D / 8][4] = {};

    for (int n = 0; n < nsteps; n++) {
        const int buf = n & 1;
        cp_async_double_buffer_step(n, nsteps, issue);
        const uint32_t tk = aK + buf * KT * row_bytes, tv = aV + buf * KT * row_bytes;
        const int k0 = step_key0(n);

        float s[KT / 8][4];
        gemm_nt_16xn<T, D, KT>(s, aQ, r0, tk, 0, lane);
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            /* Keys past Nk (ragged last block) get P = 0. */
            bool ok0 = k0 + nt * 8 + c2 < nk, ok1 = k0 + nt * 8 + c2 + 1 < nk;
            s[nt][0] = ok0 ? exp2f(fmaf(s[nt][0], p.scale_log2, -lse_0)) : 0.0f;
            s[nt][1] = ok1 ? exp2f(fmaf(s[nt][1], p.scale_log2, -lse_0)) : 0.0f;
            s[nt][2] = ok0 ? exp2f(fmaf(s[nt][2], p.scale_log2, -lse_1)) : 0.0f;
            s[nt][3] = ok1 ? exp2f(fmaf(s[nt][3], p.scale_log2, -lse_1)) : 0.0f;
        }
        /* Causal: P = 0 for keys past the warp's queries' diagonals (near the diagonal only). */
        if (CAUSAL && k0 + KT - 1 > q0 + r0 + diag) {
            const int ra = q0 + r0 + g + diag, rb = ra + 8;
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++) {
                const int kt = k0 + nt * 8 + c2;
                s[nt][0] = kt > ra ? 0.0f : s[nt][0];
                s[nt][1] = kt + 1 > ra ? 0.0f : s[nt][1];
                s[nt][2] = kt > rb ? 0.0f : s[nt][2];
                s[nt][3] = kt + 1 > rb ? 0.0f : s[nt][3];
            }
        }
        float ds[KT / 8][4];
        gemm_nt_16xn<T, D, KT>(ds, adO, r0, tv, 0, lane);
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++) {
            ds[nt][0] = s[nt][0] * (ds[nt][0] - dt_0);
            ds[nt][1] = s[nt][1] * (ds[nt][1] - dt_0);
            ds[nt][2] = s[nt][2] * (ds[nt][2] - dt_1);
            ds[nt][3] = s[nt][3] * (ds[nt][3] - dt_1);
        }
        gemm_rn_16xk<T, D, KT>(dq, ds, tk, 0, lane);
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
        put2<T, D>(sQ, r0 + g, nt * 8 + c2, dq[nt][0] * p.scale, dq[nt][1] * p.scale);
        put2<T, D>(sQ, r0 + g + 8, nt * 8 + c2, dq[nt][2] * p.scale, dq[nt][3] * p.scale);
    }
    __syncthreads();
    store_rows<T, D, kBlockQ>((T *)p.dq + sq.tb * p.dq_sb + h * p.dq_sh + sq.q_off * p.dq_sn, p.dq_sn, q0, nq, sQ);
}

/* ------------------------------------------------------------------------------------------ host */

template <typename K, typename... Args>
sparge_status launch(gpu_ctx *ctx, K kernel, unsigned grid, size_t smem, const bwd_params &p, const char *what,
                     Args... args)
{
    if (smem > ctx->smem_optin)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                           "cuda backward: %s needs %zu bytes of shared memory, the device allows %zu; use the "
                           "\"cuda-generic\" backend",
                           what, smem, ctx->smem_optin);
    sparge_status s;
    if (smem > 48 * 1024 &&
        (s = GPU_CHECK(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, (int)smem))))
        return s;
    if (grid == 0)
        return SPARGE_OK;
    kernel<<<grid, kThreads, smem, ctx->stream>>>(p, args...);
    return GPU_CHECK_LAUNCH(what);
}

template <typename K>
sparge_status launch_rows(gpu_ctx *ctx, K kernel, int64_t rows, int D, const bwd_params &p, const char *what)
{
    int64_t per_block = kThreads / (D / 8);
    unsigned grid = (unsigned)((rows + per_block - 1) / per_block);
    if (grid == 0)
        return SPARGE_OK;
    kernel<<<grid, kThreads, 0, ctx->stream>>>(p, rows);
    return GPU_CHECK_LAUNCH(what);
}

/* The launch orders of both passes (either job may be empty) in one launch, which also zeroes *zero (if set). */
sparge_status launch_orders(gpu_ctx *ctx, const order_job &kv, const order_job &q, uint32_t *zero)
{
    const order_job &job0 = kv.counts ? kv : q;
    unsigned ctas = (kv.counts != nullptr) + (q.counts != nullptr);
    if (ctas == 0 && zero)
        ctas = 1; /* empty jobs */
    if (ctas == 0)
        return SPARGE_OK;
    bwd_order_kernel<<<ctas, kOrderThreads, 0, ctx->stream>>>(job0, q, zero);
    return GPU_CHECK_LAUNCH("backward tile-order kernel");
}

/* The instantiation of a pass for the call's causal flag and varlen frames. */
template <typename T, int D, int BN> void (*dkdv_kernel_for(const bwd_params &p))(bwd_params)
{
    if (p.seq_q)
        return p.causal ? bwd_dkdv_kernel<T, D, BN, true, true> : bwd_dkdv_kernel<T, D, BN, false, true>;
    return p.causal ? bwd_dkdv_kernel<T, D, BN, true, false> : bwd_dkdv_kernel<T, D, BN, false, false>;
}
template <typename T> void (*dkdv256_kernel_for(const bwd_params &p))(bwd_params, int)
{
    if (p.seq_q)
        return p.causal ? bwd_dkdv256_kernel<T, true, true> : bwd_dkdv256_kernel<T, false, true>;
    return p.causal ? bwd_dkdv256_kernel<T, true, false> : bwd_dkdv256_kernel<T, false, false>;
}
template <typename T, int D, int BN> void (*dq_kernel_for(const bwd_params &p))(bwd_params)
{
    if (p.seq_q)
        return p.causal ? bwd_dq_kernel<T, D, BN, true, true> : bwd_dq_kernel<T, D, BN, false, true>;
    return p.causal ? bwd_dq_kernel<T, D, BN, true, false> : bwd_dq_kernel<T, D, BN, false, false>;
}

/* order_kv [BH·Nkb] and order_q [BH·Nqb]: workspace for the launch orders of the masked passes; dq_done: 4 bytes of
 * it for the wgmma passes' counter. wgmma_keys: 0 runs the mma.sync kernels, 64 or 128 the wgmma dK/dV kernel with
 * that many keys per CTA (128 only where the key tiling allows it: dense or bk = 128; 64 otherwise) and the wgmma
 * dQ pass, whose dK/dV pass is its programmatic dependent where overlap is set. */
template <typename T, int D>
sparge_status run(gpu_ctx *ctx, bwd_params &p, int64_t BH, int bk, int atomic_dq, int wgmma_keys, int ws, int overlap,
                  int32_t *order_kv, int32_t *order_q, uint32_t *dq_done)
{
    sparge_status s;
    const int64_t rows = BH * p.Nq_pad;
    const sparge_dtype dtype = std::is_same<T, gpu_bf16>::value ? SPARGE_BF16 : SPARGE_F16;
    /* The dK/dV pass tiles keys by bk; the dense path uses 128-key tiles (fewer atomics per FLOP). */
    bwd_params pk = p;
    if (!p.t_counts)
        pk.Nkb = (p.Nk + bk - 1) / bk;
    const int wide = wgmma_keys == 128 && (!p.t_counts || bk == 128);
    if ((wgmma_keys || D == 256) && !p.t_counts) /* the wgmma and D = 256 kernels' dense tiles are their CTAs */
        pk.Nkb = (p.Nk + (wide ? 127 : 63)) / (wide ? 128 : 64);
    if (!atomic_dq)
        pk.dq_accum = nullptr;
    /* Dense dQ pass: 64-key blocks, so a ragged Nk wastes at most one partial step. */
    bwd_params pq = p;
    const int bkq = p.counts ? bk : 64;
    if (!p.counts)
        pq.Nkb = (p.Nk + 63) / 64;
    order_job kv_job = {}, q_job = {};
    if (p.t_counts) {
        kv_job = {p.t_counts, (int)(BH * p.Nkb), p.Nqb, order_kv};
        pk.order = order_kv;
    }
    if (p.counts && !atomic_dq) {
        q_job = {p.counts, (int)(BH * p.Nqb), p.Nkb, order_q};
        pq.order = order_q;
    }
    /* The wgmma dQ pass (causal masks and packed sequences included) does the prep's work and runs first. */
    const int wgmma_pass = wgmma_keys && !atomic_dq;
    if (wgmma_pass) {
        pq.dq_done = pk.dq_done = dq_done;
        pq.dq_ctas = pk.dq_ctas = (uint32_t)(BH * pq.Nqb);
    }
    if ((s = launch_orders(ctx, kv_job, q_job, wgmma_pass ? dq_done : nullptr)))
        return s;
    const int kv_sub_shift = p.t_counts && bk == 128 && !wide ? 1 : 0;

    if (wgmma_pass) {
        /* Overlap safety. The dependent dK/dV grid launches only once every dQ CTA has counted itself and
         * triggered (a query block past its packed sequence too, before it leaves), so its wait for the count
         * ends at once and cannot deadlock: every dQ CTA is resident before any dK/dV CTA, however many waves the
         * dQ grid takes; where the launch is serialized (overlap off, a tool serializing kernels) the count is
         * complete before it starts. Its other inputs (Q, K, V, dO, the mask, order_kv) were complete before the
         * dQ pass, a plain launch that started after the orders kernel (which zeroed the count) had completed. It
         * writes only dk and dv, which the dQ pass does not read, and reads of the dQ pass's output only the padded
         * arrays, after the count. */
        if ((s = sparge_cuda_wgmma_dq(ctx, pq, BH, bkq == 128 ? 1 : 0, dtype, D)))
            return s;
        return sparge_cuda_wgmma_dkdv(ctx, pk, BH, kv_sub_shift, wide, ws, dtype, D, overlap);
    }

    /* The mma.sync kernels, or dQ by atomics: the prep, the dK/dV pass, then the conversion or the dQ pass. */
    if ((s = launch_rows(ctx, p.seq_q ? bwd_prep_kernel<T, D, true> : bwd_prep_kernel<T, D, false>, rows, D, p,
                         "backward prep kernel")))
        return s;
    if constexpr (D == 256) {
        /* 64 keys per CTA: halves of 128-key mask blocks (kv_sub_shift = 1). */
        s = launch(ctx, dkdv256_kernel_for<T>(p), (unsigned)((BH * pk.Nkb) << kv_sub_shift), dkdv256_tile<T>::smem,
                   pk, "backward dK/dV kernel", kv_sub_shift);
    } else {
        const unsigned grid_kv = (unsigned)(BH * pk.Nkb);
        s = wgmma_keys ? sparge_cuda_wgmma_dkdv(ctx, pk, BH, kv_sub_shift, wide, ws, dtype, D, 0)
            : bk == 64 ? launch(ctx, dkdv_kernel_for<T, D, 64>(p), grid_kv, dkdv_tile<T, D, 64>::smem, pk,
                                "backward dK/dV kernel")
                       : launch(ctx, dkdv_kernel_for<T, D, 128>(p), grid_kv, dkdv_tile<T, D, 128>::smem, pk,
                                "backward dK/dV kernel");
    }
    if (s)
        return s;
    if (atomic_dq)
        return launch_rows(ctx, p.seq_q ? bwd_dq_convert_kernel<T, D, true> : bwd_dq_convert_kernel<T, D, false>,
                           rows, D, p, "backward dQ conversion kernel");
    unsigned grid_q = (unsigned)(BH * pq.Nqb);
    return bkq == 64 ? launch(ctx, dq_kernel_for<T, D, 64>(p), grid_q, dq_tile<T, D>::smem, pq, "backward dQ kernel")
                     : launch(ctx, dq_kernel_for<T, D, 128>(p), grid_q, dq_tile<T, D>::smem, pq, "backward dQ kernel");
}

/* Which kernels a backward runs: wgmma_keys 0 for the mma.sync kernels, else the wgmma dK/dV kernel's keys per CTA
 * (with the wgmma dQ pass), ws its warp-specialized variant at 128 keys; atomic_dq: dQ as fp32 atomics from the
 * dK/dV pass instead of a separate pass. */
struct bwd_plan {
    int wgmma_keys, ws, atomic_dq, overlap;
};

/* bk: the mask's key block, 0 for dense. Variant of dQ: the separate pass is deterministic. Otherwise atomics,
 * except where the wgmma dK/dV kernel takes 64 keys per CTA (bk = 64 masks): there its 64 × D reductions per step
 * cost more than the wgmma pass (H200, 1.3B shape, 95 %: 3.241 against 2.771 ms; dense, 128 keys per CTA: 46.98
 * against 48.66 ms). The dq option overrides the choice where deterministic is 0. The wgmma kernels take D up to
 * 128: D = 256 runs the mma.sync ones (sparge_cuda_backward_fits refuses bwd_kernel=wgmma there). */
bwd_plan plan_for(const gpu_ctx *ctx, int D, int bk, int deterministic)
{
    const gpu_options &o = ctx->opt;
    const int wgmma = D > 128                           ? 0
                      : o.bwd_kernel != GPU_KERNEL_AUTO ? o.bwd_kernel != GPU_KERNEL_MMA
                                                        : sparge_cuda_wgmma_backward_available(ctx);
    /* 128 keys per CTA where the mask allows it (dense, bk = 128): 47.2 against 59.7 ms dense on the H200. */
    const int keys = !wgmma ? 0 : o.bwd_keys ? o.bwd_keys : 128;
    const int narrow = keys == 64 || (keys && bk && bk != 128);
    const int atomic = !deterministic && (o.dq != GPU_DQ_AUTO ? o.dq == GPU_DQ_ATOMIC : !narrow);
    /* Its warp-specialized variant where it takes 128 keys per CTA: 0.95× the time dense, 0.93× at bk = 128 90 %
     * (H200, 1.3B shape, D = 128). Not timed on the 64-wide tile (D ≤ 64), where auto keeps the wgmma kernel. */
    const int ws = wgmma && (o.bwd_kernel == GPU_KERNEL_WGMMA_WS || (o.bwd_kernel == GPU_KERNEL_AUTO && D > 64));
    return bwd_plan{keys, ws, atomic, !o.bwd_no_overlap};
}

/* Shared memory of the mma.sync kernels of a plan. */
template <typename T, int D> size_t mma_smem(int bk, const bwd_plan &pl)
{
    size_t kv;
    if constexpr (D == 256)
        kv = dkdv256_tile<T>::smem + dkdv256_tile<T>::smem_static;
    else
        kv = bk == 64 ? dkdv_tile<T, D, 64>::smem : dkdv_tile<T, D, 128>::smem;
    const size_t q = pl.atomic_dq ? 0 : dq_tile<T, D>::smem;
    return kv > q ? kv : q;
}

/* ------------------------------------------------------------------------------------------ staging */

/* Head dims below a kernel width run the kernels of width 64 or 128 on staged copies: Q, K, V, O and dO gathered
 * into contiguous [B, heads, N, Dt] tensors (columns past D zero), the backward run on them, then dQ, dK and dV
 * copied out. Grouped K/V heads are read in place by every kernel (query head h reads K/V head h / group); their dK
 * and dV are written per query head to staged [B, H, Nk, Dt] tensors and summed over each group in head order. */
constexpr int kStageThreads = 256;

/* dst [B, H, N, dtch chunks] (contiguous) ← src row (b, h, n), chunks past dch zero. */
template <typename T>
__global__ void __launch_bounds__(kStageThreads) bwd_stage_in_kernel(T *dst, const T *src, int64_t sb, int64_t sh,
                                                                     int64_t sn, int H, int N, int dch, int dtch,
                                                                     int64_t chunks)
{
    for (int64_t c = blockIdx.x * (int64_t)kStageThreads + threadIdx.x; c < chunks;
         c += (int64_t)gridDim.x * kStageThreads) {
        const int ch = (int)(c % dtch);
        const int64_t row = c / dtch, bh = row / N;
        const int n = (int)(row % N), h = (int)(bh % H), b = (int)(bh / H);
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (ch < dch)
            v = *(const uint4 *)(src + b * sb + h * sh + n * sn + ch * 8);
        ((uint4 *)dst)[c] = v;
    }
}

/* dst row (b, h, n) ← the sum over g < group of staged rows (b, h·group + g, n) of [B, H·group, N, dtch chunks],
 * in fp32 in head order, first dch chunks. */
template <typename T>
__global__ void __launch_bounds__(kStageThreads) bwd_stage_out_kernel(T *dst, int64_t sb, int64_t sh, int64_t sn,
                                                                      const T *src, int H, int N, int group, int dch,
                                                                      int dtch, int64_t chunks)
{
    for (int64_t c = blockIdx.x * (int64_t)kStageThreads + threadIdx.x; c < chunks;
         c += (int64_t)gridDim.x * kStageThreads) {
        const int ch = (int)(c % dch);
        const int64_t row = c / dch, bh = row / N;
        const int n = (int)(row % N), h = (int)(bh % H), b = (int)(bh / H);
        float sum[8];
        for (int e = 0; e < 8; e++)
            sum[e] = 0.0f;
        for (int g = 0; g < group; g++) {
            const int64_t at = ((((int64_t)b * H + h) * group + g) * N + n) * dtch + ch;
            const uint4 v = ((const uint4 *)src)[at];
            const T *x = (const T *)&v;
            for (int e = 0; e < 8; e++)
                sum[e] += to_f32(x[e]);
        }
        uint4 out;
        T *y = (T *)&out;
        for (int e = 0; e < 8; e++)
            y[e] = from_f32<T>(sum[e]);
        *(uint4 *)(dst + b * sb + h * sh + n * sn + ch * 8) = out;
    }
}

template <typename K, typename... Args>
sparge_status launch_stage(gpu_ctx *ctx, K kernel, int64_t chunks, const char *what, Args... args)
{
    if (chunks == 0)
        return SPARGE_OK;
    const int64_t blocks = (chunks + kStageThreads - 1) / kStageThreads;
    kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), kStageThreads, 0, ctx->stream>>>(args..., chunks);
    return GPU_CHECK_LAUNCH(what);
}

/* The staged tensors' view: contiguous [B, H, N, Dt] at data. */
sparge_view staged_view(const sparge_view &v, void *data, int64_t H, int64_t Dt)
{
    sparge_view s = v;
    s.data = data, s.H = H, s.D = Dt;
    s.sn = Dt, s.sh = v.N * Dt, s.sb = H * v.N * Dt, s.sd = 1;
    return s;
}

} // namespace

sparge_status sparge_cuda_backward_fits(const gpu_ctx *ctx, int D, int bk, int deterministic)
{
    const int forced = ctx->opt.bwd_kernel == GPU_KERNEL_WGMMA || ctx->opt.bwd_kernel == GPU_KERNEL_WGMMA_WS;
    const char *name = ctx->opt.bwd_kernel == GPU_KERNEL_WGMMA_WS ? "wgmma-ws" : "wgmma";
    if (D > 128 && forced)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda backward: bwd_kernel=%s takes head dims up to 128 (D=%d "
                           "runs the mma.sync kernels)", name, D);
    const bwd_plan pl = plan_for(ctx, D, bk, deterministic);
    if (pl.wgmma_keys) {
        if (!sparge_cuda_wgmma_backward_available(ctx))
            return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda backward: bwd_kernel=%s needs an sm_90 device and a "
                               "build with 90 in --with-cuda-arch", forced ? name : "wgmma");
        return SPARGE_OK;
    }
    /* f16 and bf16 tiles have the same size; head dims below 64 or 128 run those widths on staged copies. */
    const size_t smem = D <= 64    ? mma_smem<gpu_half, 64>(bk, pl)
                        : D <= 128 ? mma_smem<gpu_half, 128>(bk, pl)
                                   : mma_smem<gpu_half, 256>(bk, pl);
    if (smem > ctx->smem_optin)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda backward: the mma.sync kernels for D=%d and %d-key blocks need "
                           "%zu bytes of shared memory, the device allows %zu", D, bk ? bk : 128, smem,
                           ctx->smem_optin);
    return SPARGE_OK;
}

/* A call the "cuda" tier's supports() accepted (backend.cu): f16/bf16, D a multiple of 8 up to 128 or 256, K/V heads
 * dividing H, causal or not, fixed lengths or packed sequences, 16-byte rows, masks of 128-row query blocks and
 * 64- or 128-key blocks. */
sparge_status sparge_cuda_mma_backward(gpu_ctx *ctx, const sparge_bwd_args *args)
{
    const sparge_mask_view *m = args->mask;
    const int64_t D = args->q.D, H = args->q.H, Nq = args->q.N, Nk = args->k.N;
    const int64_t BHt = args->q.B * H, BH = (m ? m->B : args->q.B) * H; /* the tensors', the sequences' (varlen) */
    const int64_t Dt = D <= 64 ? 64 : D <= 128 ? 128 : 256, Hk = args->k.H, group = H / Hk;
    /* A head dim below the kernels' width runs on staged copies of every tensor; grouped K/V heads are read in
     * place (kv_magic), with dK and dV written per query head to staged buffers and summed over each group. */
    const bool pad = Dt != D, staged_kv_out = pad || group > 1, varlen = m && m->seq_q;
    sparge_status s;
    const int bk = m ? args->bk : 128;
    const int causal = m ? m->causal : args->causal;
    const bwd_plan pl = plan_for(ctx, (int)D, m ? args->bk : 0, args->deterministic);
    const int atomic_dq = pl.atomic_dq, wgmma_keys = pl.wgmma_keys, kv_ws = pl.ws, overlap = pl.overlap;

    const int Nqb = varlen ? (int)m->Nqb : (int)((Nq + kBlockQ - 1) / kBlockQ), Nkb = m ? (int)m->Nkb : 0;
    const size_t padded = (size_t)BH * Nqb * kBlockQ;
    const size_t accum = atomic_dq ? padded * Dt : 0, nkv = m ? (size_t)BH * Nkb : 0, nq = m ? (size_t)BH * Nqb : 0;
    /* Staged Q, O, dO, dQ ([B,H,Nq,Dt]), K, V ([B,Hk,Nk,Dt]) and dK, dV ([B,H,Nk,Dt]) first: multiples of 128 bytes. */
    const int64_t B = args->q.B;
    const size_t q_elems = pad ? (size_t)BHt * Nq * Dt : 0, kin_elems = pad ? (size_t)B * Hk * Nk * Dt : 0;
    const size_t kout_elems = staged_kv_out ? (size_t)BHt * Nk * Dt : 0;
    const size_t stage_bytes = (4 * q_elems + 2 * kin_elems + 2 * kout_elems) * 2;
    void *ws;
    if ((s = gpu_workspace(ctx, stage_bytes + (2 * padded + accum) * sizeof(float) + (nkv + nq + 1) * sizeof(int32_t),
                           &ws)))
        return s;
    sparge_bwd_args st = *args;
    const sparge_bwd_args *a = &st;
    char *at = (char *)ws;
    auto take = [&](size_t elems) { void *x = at; at += elems * 2; return x; };
    if (staged_kv_out)
        st.dk = staged_view(args->dk, take(kout_elems), H, Dt), st.dv = staged_view(args->dv, take(kout_elems), H, Dt);
    if (pad) {
        st.q = staged_view(args->q, take(q_elems), H, Dt), st.o = staged_view(args->o, take(q_elems), H, Dt);
        st.d_o = staged_view(args->d_o, take(q_elems), H, Dt), st.dq = staged_view(args->dq, take(q_elems), H, Dt);
        st.k = staged_view(args->k, take(kin_elems), Hk, Dt), st.v = staged_view(args->v, take(kin_elems), Hk, Dt);
        const int dch = (int)(D / 8), dtch = (int)(Dt / 8);
        const sparge_view *in_src[5] = {&args->q, &args->o, &args->d_o, &args->k, &args->v};
        const sparge_view *in_dst[5] = {&st.q, &st.o, &st.d_o, &st.k, &st.v};
        for (int i = 0; i < 5; i++) {
            const sparge_view &x = *in_src[i];
            const int64_t chunks = x.B * x.H * x.N * dtch;
            s = args->q.dtype == SPARGE_BF16
                    ? launch_stage(ctx, bwd_stage_in_kernel<gpu_bf16>, chunks, "backward staging kernel",
                                   (gpu_bf16 *)in_dst[i]->data, (const gpu_bf16 *)x.data, x.sb, x.sh, x.sn, (int)x.H,
                                   (int)x.N, dch, dtch)
                    : launch_stage(ctx, bwd_stage_in_kernel<gpu_half>, chunks, "backward staging kernel",
                                   (gpu_half *)in_dst[i]->data, (const gpu_half *)x.data, x.sb, x.sh, x.sn, (int)x.H,
                                   (int)x.N, dch, dtch);
            if (s)
                return s;
        }
    }
    ws = at;

    bwd_params p;
    memset(&p, 0, sizeof p);
    p.q = a->q.data, p.k = a->k.data, p.v = a->v.data, p.o = a->o.data, p.d_o = a->d_o.data;
    p.dq = a->dq.data, p.dk = a->dk.data, p.dv = a->dv.data;
    p.q_sb = a->q.sb, p.q_sh = a->q.sh, p.q_sn = a->q.sn, p.k_sb = a->k.sb, p.k_sh = a->k.sh, p.k_sn = a->k.sn;
    p.v_sb = a->v.sb, p.v_sh = a->v.sh, p.v_sn = a->v.sn, p.o_sb = a->o.sb, p.o_sh = a->o.sh, p.o_sn = a->o.sn;
    p.do_sb = a->d_o.sb, p.do_sh = a->d_o.sh, p.do_sn = a->d_o.sn;
    p.dq_sb = a->dq.sb, p.dq_sh = a->dq.sh, p.dq_sn = a->dq.sn, p.dk_sb = a->dk.sb, p.dk_sh = a->dk.sh,
    p.dk_sn = a->dk.sn, p.dv_sb = a->dv.sb, p.dv_sh = a->dv.sh, p.dv_sn = a->dv.sn;
    p.H = (int)H, p.Nq = (int)Nq, p.Nk = (int)Nk;
    p.kv_magic = gpu_kv_magic(group);
    p.Nqb = Nqb;
    p.Nq_pad = p.Nqb * kBlockQ;
    p.scale = a->scale, p.scale_log2 = a->scale * BWD_LOG2E;
    p.lse = a->lse;
    p.causal = causal;
    if (m) {
        p.Nkb = Nkb;
        p.counts = m->counts, p.indices = m->indices;
        p.t_counts = m->t_counts, p.t_indices = m->t_indices;
        p.seq_q = m->seq_q, p.seq_k = m->seq_k;
    }
    p.dt = (float *)ws;
    p.lse2 = p.dt + padded;
    p.dq_accum = atomic_dq ? p.lse2 + padded : nullptr;
    int32_t *order_kv = (int32_t *)(p.lse2 + padded + accum), *order_q = order_kv + nkv;
    uint32_t *dq_done = (uint32_t *)(order_q + nq);

    const bool bf = a->q.dtype == SPARGE_BF16;
    if (Dt == 64)
        s = bf ? run<gpu_bf16, 64>(ctx, p, BH, bk, atomic_dq, wgmma_keys, kv_ws, overlap, order_kv, order_q, dq_done)
               : run<gpu_half, 64>(ctx, p, BH, bk, atomic_dq, wgmma_keys, kv_ws, overlap, order_kv, order_q, dq_done);
    else if (Dt == 128)
        s = bf ? run<gpu_bf16, 128>(ctx, p, BH, bk, atomic_dq, wgmma_keys, kv_ws, overlap, order_kv, order_q, dq_done)
               : run<gpu_half, 128>(ctx, p, BH, bk, atomic_dq, wgmma_keys, kv_ws, overlap, order_kv, order_q, dq_done);
    else
        s = bf ? run<gpu_bf16, 256>(ctx, p, BH, bk, atomic_dq, wgmma_keys, kv_ws, overlap, order_kv, order_q, dq_done)
               : run<gpu_half, 256>(ctx, p, BH, bk, atomic_dq, wgmma_keys, kv_ws, overlap, order_kv, order_q, dq_done);
    if (s || !staged_kv_out)
        return s;
    const int dch = (int)(D / 8), dtch = (int)(Dt / 8);
    const sparge_view *out_dst[3] = {&args->dq, &args->dk, &args->dv};
    const sparge_view *out_src[3] = {&st.dq, &st.dk, &st.dv};
    for (int i = pad ? 0 : 1; i < 3 && !s; i++) { /* dQ only when padded: otherwise written in place */
        const sparge_view &x = *out_dst[i];
        const int grp = i == 0 ? 1 : (int)group;
        const int64_t chunks = x.B * x.H * x.N * dch;
        s = bf ? launch_stage(ctx, bwd_stage_out_kernel<gpu_bf16>, chunks, "backward staging kernel", (gpu_bf16 *)x.data,
                              x.sb, x.sh, x.sn, (const gpu_bf16 *)out_src[i]->data, (int)x.H, (int)x.N, grp, dch, dtch)
               : launch_stage(ctx, bwd_stage_out_kernel<gpu_half>, chunks, "backward staging kernel", (gpu_half *)x.data,
                              x.sb, x.sh, x.sn, (const gpu_half *)out_src[i]->data, (int)x.H, (int)x.N, grp, dch, dtch);
    }
    return s;
}
