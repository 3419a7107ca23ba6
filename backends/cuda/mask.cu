/* Mask prediction on the GPU: pooled map, per-row hybrid selection, CSR and
 * transpose bookkeeping. Everything is queued on the context's stream; nothing
 * here waits for the device.
 *
 * Selection follows DESIGN.md §1 and backends/cpu/select.c exactly: a row is
 * sorted by descending score with ties to the lower block index (a stable
 * block radix sort of order-preserving 32-bit keys over the indices in
 * ascending order), Top-p accumulates the sorted prefix in fp64, and the kept
 * set is the first max(n_k, n_p, 1) blocks; a row holding NaN keeps all. */
#include <math.h>
#include <stdint.h>

#include "gpu.h"

#ifdef SPARGE_USE_HIP
#include <rocprim/rocprim.hpp>
#else
#include <cub/block/block_radix_sort.cuh>
#include <mma.h>
#endif

namespace {

/* ---------------------------------------------------------------- block helpers */

constexpr int MAX_WARPS = 1024 / 32;

/* Exclusive prefix sum over the block; *total gets the block's sum. scratch
 * holds MAX_WARPS values. All threads must call it. */
template <typename T> __device__ T block_exclusive_scan(T x, T *total, T *scratch)
{
    const int lane = threadIdx.x % SPARGE_WARP_SIZE, warp = threadIdx.x / SPARGE_WARP_SIZE;
    const int warps = (blockDim.x + SPARGE_WARP_SIZE - 1) / SPARGE_WARP_SIZE;
    T incl = x;
    for (int o = 1; o < SPARGE_WARP_SIZE; o <<= 1) {
        T y = sparge_shfl_up(incl, o);
        if (lane >= o)
            incl += y;
    }
    if (lane == SPARGE_WARP_SIZE - 1)
        scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T w = lane < warps ? scratch[lane] : T(0);
        for (int o = 1; o < SPARGE_WARP_SIZE; o <<= 1) {
            T y = sparge_shfl_up(w, o);
            if (lane >= o)
                w += y;
        }
        if (lane < warps)
            scratch[lane] = w;
    }
    __syncthreads();
    T before = warp > 0 ? scratch[warp - 1] : T(0);
    *total = scratch[warps - 1];
    __syncthreads(); /* scratch may be reused right away */
    return before + incl - x;
}

/* Reduction over the block with op; every thread gets the result. scratch
 * holds MAX_WARPS values. All threads must call it. */
template <typename T, typename Op> __device__ T block_reduce(T x, Op op, T *scratch)
{
    const int lane = threadIdx.x % SPARGE_WARP_SIZE, warp = threadIdx.x / SPARGE_WARP_SIZE;
    const int warps = (blockDim.x + SPARGE_WARP_SIZE - 1) / SPARGE_WARP_SIZE;
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1)
        x = op(x, sparge_shfl_xor(x, o));
    if (lane == 0)
        scratch[warp] = x;
    __syncthreads();
    T r = scratch[0];
    for (int w = 1; w < warps; w++)
        r = op(r, scratch[w]);
    __syncthreads(); /* scratch may be reused right away */
    return r;
}

/* Writes the ascending positions j < n with flag(j) into idx[0..count) and -1
 * into idx[count..n); returns count. Any n; all threads must call it. */
template <typename Flag> __device__ int32_t write_csr_row(Flag flag, int64_t n, int32_t *idx, int32_t *scratch)
{
    int32_t count = 0;
    for (int64_t base = 0; base < n; base += blockDim.x) {
        const int64_t j = base + threadIdx.x;
        const int32_t f = j < n && flag(j) ? 1 : 0;
        int32_t total_here;
        const int32_t pos = block_exclusive_scan<int32_t>(f, &total_here, scratch);
        if (f)
            idx[count + pos] = (int32_t)j;
        count += total_here;
    }
    for (int64_t j = count + threadIdx.x; j < n; j += blockDim.x)
        idx[j] = -1;
    return count;
}

/* By the bits: the CUDA build uses fast math. */
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }

/* ---------------------------------------------------------------- pooled map */

constexpr int MAP_TILE = 64, MAP_DCHUNK = 16, MAP_THREADS = 256;

struct map_params {
    const float *q, *k;
    int64_t qb, qh, qn, qd, kb, kh, kn, kd;
    float *map;
    int64_t mb, mh, mn, md;
    int64_t H, Nqb, Nkb, D;
    float scale;
};

/* Logits map = scale · qbar kbarᵀ, a 64×64 tile per block, 4×4 per thread. */
__global__ void __launch_bounds__(MAP_THREADS) map_logits_kernel(map_params p, int64_t first_tile)
{
    __shared__ __align__(16) float qs[MAP_DCHUNK][MAP_TILE + 4];
    __shared__ __align__(16) float ks[MAP_DCHUNK][MAP_TILE + 4];
    const int64_t ktiles = (p.Nkb + MAP_TILE - 1) / MAP_TILE, qtiles = (p.Nqb + MAP_TILE - 1) / MAP_TILE;
    const int64_t tile = first_tile + blockIdx.x, bh = tile / (qtiles * ktiles), b = bh / p.H, h = bh % p.H;
    const int64_t i0 = tile / ktiles % qtiles * MAP_TILE, j0 = tile % ktiles * MAP_TILE;
    const float *q = p.q + b * p.qb + h * p.qh, *k = p.k + b * p.kb + h * p.kh;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    constexpr int LOADS = MAP_TILE * MAP_DCHUNK / MAP_THREADS, ROW_STEP = MAP_THREADS / MAP_DCHUNK;
    static_assert(LOADS * MAP_THREADS == MAP_TILE * MAP_DCHUNK, "the tile loads split evenly");
    /* Thread t loads column dd = t % 16 of rows t / 16 + 16u; the next D chunk
     * is fetched into registers while this one is multiplied. */
    const int dd_mine = threadIdx.x % MAP_DCHUNK, r_mine = threadIdx.x / MAP_DCHUNK;
    const float *q_mine = q + (i0 + r_mine) * p.qn + dd_mine * p.qd;
    const float *k_mine = k + (j0 + r_mine) * p.kn + dd_mine * p.kd;
    float q_next[LOADS], k_next[LOADS];
    auto fetch = [&](int64_t d0) {
        const bool d_ok = d0 + dd_mine < p.D;
        for (int u = 0; u < LOADS; u++) {
            const int r = r_mine + u * ROW_STEP;
            q_next[u] = d_ok && i0 + r < p.Nqb ? q_mine[u * ROW_STEP * p.qn + d0 * p.qd] : 0.0f;
            k_next[u] = d_ok && j0 + r < p.Nkb ? k_mine[u * ROW_STEP * p.kn + d0 * p.kd] : 0.0f;
        }
    };
    float acc[4][4] = {};
    fetch(0);
    for (int64_t d0 = 0; d0 < p.D; d0 += MAP_DCHUNK) {
        for (int u = 0; u < LOADS; u++) {
            qs[dd_mine][r_mine + u * ROW_STEP] = q_next[u];
            ks[dd_mine][r_mine + u * ROW_STEP] = k_next[u];
        }
        __syncthreads();
        if (d0 + MAP_DCHUNK < p.D)
            fetch(d0 + MAP_DCHUNK);
#pragma unroll
        for (int dd = 0; dd < MAP_DCHUNK; dd++) {
            const float4 a = *(const float4 *)&qs[dd][ty * 4];
            const float4 c = *(const float4 *)&ks[dd][tx * 4];
            const float av[4] = {a.x, a.y, a.z, a.w}, cv[4] = {c.x, c.y, c.z, c.w};
            for (int r = 0; r < 4; r++)
                for (int s = 0; s < 4; s++)
                    acc[r][s] += av[r] * cv[s];
        }
        __syncthreads();
    }
    float *m = p.map + b * p.mb + h * p.mh;
    for (int r = 0; r < 4; r++)
        for (int s = 0; s < 4; s++) {
            const int64_t i = i0 + ty * 4 + r, j = j0 + tx * 4 + s;
            if (i < p.Nqb && j < p.Nkb)
                m[i * p.mn + j * p.md] = acc[r][s] * p.scale;
        }
}

#ifndef SPARGE_USE_HIP
/* The same logits on tensor cores (sm_80+, the fast tier only): TF32 with the operands split into
 * high and low parts, hi·hi + hi·lo + lo·hi accumulated in fp32 ("3xTF32"), about fp32's accuracy.
 * A 64×64 tile per block, D in chunks of 32 through shared memory; warp w owns rows 16·(w/2) and the
 * two 16-column fragments at 32·(w%2). */
constexpr int TC_DCHUNK = 32, TC_LD = TC_DCHUNK + 4, TC_STAGE_LD = 20;

__global__ void __launch_bounds__(MAP_THREADS) map_logits_tf32_kernel(map_params p, int64_t first_tile)
{
#if __CUDA_ARCH__ >= 800
    namespace wmma = nvcuda::wmma;
    __shared__ __align__(32) float qs[MAP_TILE][TC_LD];
    __shared__ __align__(32) float ks[MAP_TILE][TC_LD];
    __shared__ __align__(32) float stage[MAP_THREADS / 32][16][TC_STAGE_LD];
    const int64_t ktiles = (p.Nkb + MAP_TILE - 1) / MAP_TILE, qtiles = (p.Nqb + MAP_TILE - 1) / MAP_TILE;
    const int64_t tile = first_tile + blockIdx.x, bh = tile / (qtiles * ktiles), b = bh / p.H, h = bh % p.H;
    const int64_t i0 = tile / ktiles % qtiles * MAP_TILE, j0 = tile % ktiles * MAP_TILE;
    const float *q = p.q + b * p.qb + h * p.qh, *k = p.k + b * p.kb + h * p.kh;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wr = warp / 2 * 16, wc = warp % 2 * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[2];
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
    for (int64_t d0 = 0; d0 < p.D; d0 += TC_DCHUNK) {
        __syncthreads();
        const int col = threadIdx.x % TC_DCHUNK;
        const bool d_ok = d0 + col < p.D;
        for (int r = threadIdx.x / TC_DCHUNK; r < MAP_TILE; r += MAP_THREADS / TC_DCHUNK) {
            qs[r][col] = d_ok && i0 + r < p.Nqb ? q[(i0 + r) * p.qn + (d0 + col) * p.qd] : 0.0f;
            ks[r][col] = d_ok && j0 + r < p.Nkb ? k[(j0 + r) * p.kn + (d0 + col) * p.kd] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TC_DCHUNK; kk += 8) {
            wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a, a_hi, a_lo;
            wmma::load_matrix_sync(a, &qs[wr][kk], TC_LD);
            for (int t = 0; t < a.num_elements; t++) {
                a_hi.x[t] = wmma::__float_to_tf32(a.x[t]);
                a_lo.x[t] = wmma::__float_to_tf32(a.x[t] - a_hi.x[t]);
            }
#pragma unroll
            for (int f = 0; f < 2; f++) {
                /* B(d, j) = kbar[j][d]: column-major over the rows of ks. */
                wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> c, c_hi, c_lo;
                wmma::load_matrix_sync(c, &ks[wc + 16 * f][kk], TC_LD);
                for (int t = 0; t < c.num_elements; t++) {
                    c_hi.x[t] = wmma::__float_to_tf32(c.x[t]);
                    c_lo.x[t] = wmma::__float_to_tf32(c.x[t] - c_hi.x[t]);
                }
                wmma::mma_sync(acc[f], a_lo, c_hi, acc[f]);
                wmma::mma_sync(acc[f], a_hi, c_lo, acc[f]);
                wmma::mma_sync(acc[f], a_hi, c_hi, acc[f]);
            }
        }
    }
    float *m = p.map + b * p.mb + h * p.mh;
    for (int f = 0; f < 2; f++) {
        wmma::store_matrix_sync(&stage[warp][0][0], acc[f], TC_STAGE_LD, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            const int64_t i = i0 + wr + e / 16, j = j0 + wc + 16 * f + e % 16;
            if (i < p.Nqb && j < p.Nkb)
                m[i * p.mn + j * p.md] = stage[warp][e / 16][e % 16] * p.scale;
        }
        __syncwarp();
    }
#endif
}
#endif

/* Row softmax in place, one warp per row; a row holding NaN becomes all NaN. */
__global__ void map_softmax_kernel(map_params p, int64_t rows)
{
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / SPARGE_WARP_SIZE) + threadIdx.x / SPARGE_WARP_SIZE;
    if (row >= rows)
        return;
    const int lane = threadIdx.x % SPARGE_WARP_SIZE;
    const int64_t bh = row / p.Nqb, i = row % p.Nqb, b = bh / p.H, h = bh % p.H;
    float *m = p.map + b * p.mb + h * p.mh + i * p.mn;
    float mx = -INFINITY;
    int nan = 0;
    for (int64_t j = lane; j < p.Nkb; j += SPARGE_WARP_SIZE) {
        const float x = m[j * p.md];
        nan |= is_nan(x);
        mx = fmaxf(mx, x);
    }
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1) {
        mx = fmaxf(mx, sparge_shfl_xor(mx, o));
        nan |= sparge_shfl_xor(nan, o);
    }
    float sum = 0.0f;
    for (int64_t j = lane; j < p.Nkb; j += SPARGE_WARP_SIZE)
        sum += expf(m[j * p.md] - mx);
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1)
        sum += sparge_shfl_xor(sum, o);
    const float inv = 1.0f / sum;
    for (int64_t j = lane; j < p.Nkb; j += SPARGE_WARP_SIZE)
        m[j * p.md] = nan ? NAN : expf(m[j * p.md] - mx) * inv;
}

/* ---------------------------------------------------------------- selection */

/* One vendor difference: the library block radix sort (CUB / rocPRIM). Both
 * sort key-value pairs held in blocked arrangement, stably. */
#ifdef SPARGE_USE_HIP
template <int THREADS, int IPT> struct row_sort {
    using impl = rocprim::block_radix_sort<uint32_t, THREADS, IPT, int32_t>;
    using storage = typename impl::storage_type;
    static __device__ void descending(uint32_t (&k)[IPT], int32_t (&v)[IPT], storage &s, int begin_bit, int end_bit)
    {
        impl().sort_desc(k, v, s, (unsigned)begin_bit, (unsigned)end_bit);
    }
};
#else
template <int THREADS, int IPT> struct row_sort {
    using impl = cub::BlockRadixSort<uint32_t, THREADS, IPT, int32_t>;
    using storage = typename impl::TempStorage;
    static __device__ void descending(uint32_t (&k)[IPT], int32_t (&v)[IPT], storage &s, int begin_bit, int end_bit)
    {
        impl(s).SortDescending(k, v, begin_bit, end_bit);
    }
};
#endif

/* Order-preserving float → uint32 (larger float, larger key); -0 counts as +0
 * so that equal scores tie like `x != y` in the reference. */
__device__ __forceinline__ uint32_t score_key(float x)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) == 0)
        u = 0;
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ float key_score(uint32_t k) { return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k); }

struct select_params {
    float *map; /* probabilities, or logits when the kernel applies the softmax (then overwritten) */
    int64_t mb, mh, mn, md;
    int64_t H, Nqb, Nkb;
    int64_t topk_count; /* n_k, computed on the host exactly as the reference */
    double topp;
    uint8_t *dense;
    int32_t *counts, *indices;
    float *row_mass;
    uint32_t *bits; /* fast path: kept bits per row, ceil(Nkb/32) words (for the transpose) */
};

/* One thread block per row; thread t holds entries t*IPT .. t*IPT+IPT-1 (the
 * blocked arrangement of the sort). SOFTMAX: the row holds logits; the block
 * turns them into the pooled map's probabilities (written back) before
 * selecting, as map_softmax_kernel would. */
template <int THREADS, int IPT, bool SOFTMAX> __global__ void __launch_bounds__(THREADS) select_kernel(select_params p)
{
    using sorter = row_sort<THREADS, IPT>;
    __shared__ union {
        typename sorter::storage sort;
        double dscan[MAX_WARPS];
        int32_t iscan[MAX_WARPS];
    } tmp;
    __shared__ float fred[MAX_WARPS];
    __shared__ uint32_t ured[MAX_WARPS];
    __shared__ uint8_t keep[THREADS * IPT];
    __shared__ int32_t np_shared;

    const int64_t row = blockIdx.x, bh = row / p.Nqb, i = row % p.Nqb, b = bh / p.H, h = bh % p.H;
    const int64_t n = p.Nkb, s0 = (int64_t)threadIdx.x * IPT;
    float *src = p.map + b * p.mb + h * p.mh + i * p.mn;
    uint8_t *dense = p.dense + row * n;
    int32_t *idx = p.indices + row * n;

    float x[IPT];
    for (int e = 0; e < IPT; e++)
        x[e] = s0 + e < n ? src[(s0 + e) * p.md] : 0.0f;
    if constexpr (SOFTMAX) {
        int logit_nan = 0;
        float mx = -INFINITY;
        for (int e = 0; e < IPT; e++)
            if (s0 + e < n) {
                logit_nan |= is_nan(x[e]);
                mx = fmaxf(mx, x[e]);
            }
        logit_nan = __syncthreads_or(logit_nan);
        mx = block_reduce(mx, [](float u, float v) { return fmaxf(u, v); }, fred);
        float sum = 0.0f;
        for (int e = 0; e < IPT; e++)
            if (s0 + e < n) {
                x[e] = expf(x[e] - mx);
                sum += x[e];
            }
        const float inv = 1.0f / block_reduce(sum, [](float u, float v) { return u + v; }, fred);
        for (int e = 0; e < IPT; e++)
            if (s0 + e < n) {
                x[e] = logit_nan ? NAN : x[e] * inv;
                src[(s0 + e) * p.md] = x[e];
            }
    }

    uint32_t keys[IPT], key_or = 0u, key_and = ~0u;
    int32_t vals[IPT];
    int nan = 0;
    for (int e = 0; e < IPT; e++) {
        const bool real = s0 + e < n;
        nan |= real && is_nan(x[e]);
        keys[e] = real ? score_key(x[e]) : 0u; /* below every real key: padding sorts last */
        vals[e] = (int32_t)(s0 + e);
        if (real) {
            key_or |= keys[e];
            key_and &= keys[e];
        }
    }
    if (__syncthreads_or(nan)) {
        for (int64_t j = threadIdx.x; j < n; j += THREADS) {
            dense[j] = 1;
            idx[j] = (int32_t)j;
        }
        if (threadIdx.x == 0) {
            p.counts[row] = (int32_t)n;
            p.row_mass[row] = NAN;
        }
        return;
    }
    /* Bits on which all real keys agree cannot order them: sort only the span
     * that differs (stable, so ties keep ascending indices; padding's 0 bits
     * still sort last). One probability row typically shares its top bits. */
    key_or = block_reduce(key_or, [](uint32_t u, uint32_t v) { return u | v; }, ured);
    key_and = block_reduce(key_and, [](uint32_t u, uint32_t v) { return u & v; }, ured);
    const uint32_t differ = key_or ^ key_and;
    if (differ) {
        sorter::descending(keys, vals, tmp.sort, __ffs((int)differ) - 1, 32 - __clz((int)differ));
        __syncthreads();
    }

    /* Thread t now holds sorted positions s0 .. s0+IPT-1. Scores are decoded
     * from the keys where needed (fewer live registers than an array). */
    auto score = [&](int e) { return s0 + e < n ? (double)key_score(keys[e]) : 0.0; };
    double local = 0.0;
    for (int e = 0; e < IPT; e++)
        local += score(e);
    if (threadIdx.x == 0)
        np_shared = (int32_t)n; /* total below p after rounding: keep the whole row */
    double total;
    const double before = block_exclusive_scan<double>(local, &total, tmp.dscan);
    if (p.topp > 0.0) {
        double cum = before;
        for (int e = 0; e < IPT; e++) {
            cum += score(e);
            if (s0 + e < n && cum >= p.topp) {
                atomicMin(&np_shared, (int32_t)(s0 + e + 1));
                break;
            }
        }
    }
    __syncthreads();
    int64_t kept = p.topp > 0.0 ? np_shared : 0;
    kept = kept > p.topk_count ? kept : p.topk_count;
    kept = kept < 1 ? 1 : kept;

    /* The kept mass is the prefix through sorted position kept-1. */
    if (s0 < kept && kept <= s0 + IPT) {
        double mass = before;
        for (int e = 0; e < IPT; e++)
            mass += s0 + e < kept ? score(e) : 0.0;
        p.row_mass[row] = (float)mass;
        p.counts[row] = (int32_t)kept;
    }
    for (int e = 0; e < IPT; e++)
        if (s0 + e < n)
            keep[vals[e]] = s0 + e < kept;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n; j += THREADS)
        dense[j] = keep[j];
    /* CSR: thread t owns block indices s0 .. s0+IPT-1; one scan places them. */
    int32_t mine = 0;
    for (int e = 0; e < IPT; e++)
        mine += s0 + e < n && keep[s0 + e];
    int32_t kept_total;
    int32_t at = block_exclusive_scan<int32_t>(mine, &kept_total, tmp.iscan);
    for (int e = 0; e < IPT; e++)
        if (s0 + e < n && keep[s0 + e])
            idx[at++] = (int32_t)(s0 + e);
    for (int64_t j = kept + threadIdx.x; j < n; j += THREADS)
        idx[j] = -1;
}

/* ---------------------------------------------------------------- fused softmax + selection, one warp per row */

/* For mask prediction (rows of softmax probabilities, never negative) the
 * kept set is found without sorting. kept = max(n_k, n_p, 1) is the shortest
 * prefix of the row order holding at least max(n_k, 1) blocks and mass >= p,
 * since the prefix mass only grows. A radix descent finds the key T of its
 * last block, 8 key bits per pass: a histogram of the candidates' digits
 * (count and mass per bin, shared-memory atomics), a scan from the highest
 * bin to the first whose cumulative count and mass meet both bounds, then the
 * candidates are narrowed to that bin. Masses are summed in fixed point (units
 * of 2^-48, exact and order-free; the reference's fp64 sum differs by < 1e-11,
 * far inside the 1e-5 rounding margin the tests allow). Ties at T are taken by
 * ascending index. The row lives in registers: lane l holds blocks l,
 * l + warp, l + 2·warp, ...; the map's rows must be contiguous (md = 1). */
constexpr int FAST_THREADS = 128, FAST_ROWS = 4, FAST_WARPS_MAX = FAST_THREADS / 32;
constexpr int64_t FAST_MAX_ROW = 2048;

/* Order-preserving key of a probability >= 0 (or +0 for -0); 0 marks padding. */
__device__ __forceinline__ uint32_t prob_key(float x) { return (__float_as_uint(x) & 0x7fffffffu) + 1u; }

/* Histogram entries pack a count (bits 52..63) and a mass in units of 2^-48
 * (bits 0..51: a row's mass stays below 2^52 units, its count below 4096). */
typedef unsigned long long packed_t;
constexpr int COUNT_SHIFT = 52;
constexpr packed_t ONE_BLOCK = 1ull << COUNT_SHIFT, MASS_BITS = ONE_BLOCK - 1ull;

/* The probability of key k >= 1 in units of 2^-48, truncated. */
__device__ __forceinline__ packed_t key_fixed(uint32_t k)
{
    const uint32_t bits = k - 1u, e = bits >> 23;
    if (e == 0)
        return 0; /* subnormal */
    const packed_t m = (bits & 0x7fffffu) | 0x800000u; /* value = m · 2^(e-150) */
    return e >= 102 ? m << (e - 102) : 102 - e < 64 ? m >> (102 - e) : 0;
}

template <typename T> __device__ __forceinline__ T warp_sum(T x)
{
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1)
        x += sparge_shfl_xor(x, o);
    return x;
}

template <int CAP> struct fast_scratch {
    packed_t hist[FAST_WARPS_MAX][256];
    uint32_t list[FAST_WARPS_MAX][CAP]; /* the candidates' keys after the first pass */
};

template <int CAP> __device__ void fast_select_row(const select_params &p, int64_t row, packed_t *hist, uint32_t *list)
{
    constexpr int W = SPARGE_WARP_SIZE, IPT = CAP / W;
    const int lane = threadIdx.x % W;
    const int64_t bh = row / p.Nqb, i = row % p.Nqb, b = bh / p.H, h = bh % p.H;
    const int n = (int)p.Nkb; /* <= FAST_MAX_ROW */
    float *src = p.map + b * p.mb + h * p.mh + i * p.mn;
    uint8_t *dense = p.dense + row * n;
    int32_t *idx = p.indices + row * n;

    /* Softmax as map_softmax_kernel: a row holding a NaN logit becomes all NaN. */
    float x[IPT];
    float mx = -INFINITY;
    int logit_nan = 0;
#pragma unroll
    for (int e = 0; e < IPT; e++) {
        const int j = e * W + lane;
        x[e] = j < n ? src[j] : -INFINITY;
        logit_nan |= is_nan(x[e]);
        mx = fmaxf(mx, x[e]);
    }
    for (int o = W / 2; o > 0; o >>= 1) {
        mx = fmaxf(mx, sparge_shfl_xor(mx, o));
        logit_nan |= sparge_shfl_xor(logit_nan, o);
    }
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < IPT; e++)
        if (e * W + lane < n) {
            x[e] = expf(x[e] - mx);
            sum += x[e];
        }
    const float inv = 1.0f / warp_sum(sum);
    uint32_t key[IPT], key_or = 0u, key_and = ~0u;
    int nan = 0;
    packed_t total = 0;
#pragma unroll
    for (int e = 0; e < IPT; e++) {
        const int j = e * W + lane;
        key[e] = 0u;
        if (j < n) {
            const float v = logit_nan ? NAN : x[e] * inv;
            src[j] = v;
            nan |= is_nan(v);
            key[e] = prob_key(v);
            key_or |= key[e];
            key_and &= key[e];
            total += key_fixed(key[e]);
        }
    }
    for (int o = W / 2; o > 0; o >>= 1) {
        nan |= sparge_shfl_xor(nan, o);
        key_or |= sparge_shfl_xor(key_or, o);
        key_and &= sparge_shfl_xor(key_and, o);
    }
    const int words = (n + 31) / 32;
    uint32_t *bits = p.bits + row * words;
    if (nan) {
        for (int j = lane; j < n; j += W) {
            dense[j] = 1;
            idx[j] = (int32_t)j;
        }
        for (int w = lane; w < words; w += W)
            bits[w] = w == words - 1 && n % 32 ? (1u << (n % 32)) - 1u : ~0u;
        if (lane == 0) {
            p.counts[row] = n;
            p.row_mass[row] = NAN;
        }
        return;
    }
    total = warp_sum(total);

    const int64_t least = p.topk_count > 1 ? p.topk_count : 1;
    const packed_t need_mass = p.topp > 0.0 ? (packed_t)ceil(p.topp * 281474976710656.0) : 0; /* p · 2^48 */
    /* Rounding may leave the total below p: keep the whole row. */
    const bool whole = total < need_mass;
    auto enough = [&](packed_t v) { return (int64_t)(v >> COUNT_SHIFT) >= least && (v & MASS_BITS) >= need_mass; };

    uint32_t T = key_and; /* the boundary key; with no differing bits every key ties */
    packed_t above = 0;   /* count and mass of the keys ordered before the candidates */
    int tied = n;         /* candidates: the keys that agree with T on the bits fixed so far */
    const uint32_t differ = key_or ^ key_and;
    if (!whole && differ) {
        int top = 32 - __clz((int)differ); /* bits >= top are fixed */
        T &= ~((1u << top) - 1u);
        bool in_list = false;
        while (top > 0) {
            const int shift = top > 8 ? top - 8 : 0, bins = 1 << (top - shift);
            const uint32_t digit_mask = (uint32_t)bins - 1u;
            sparge_syncwarp();
            for (int d = lane; d < bins; d += W)
                hist[d] = 0;
            sparge_syncwarp();
            if (!in_list) {
#pragma unroll
                for (int e = 0; e < IPT; e++)
                    if (key[e])
                        atomicAdd(&hist[(key[e] >> shift) & digit_mask], ONE_BLOCK + key_fixed(key[e]));
            } else {
                for (int k = lane; k < tied; k += W)
                    atomicAdd(&hist[(list[k] >> shift) & digit_mask], ONE_BLOCK + key_fixed(list[k]));
            }
            sparge_syncwarp();
            /* Lane l scans bins[bins-1-l·per ...] downwards; the first bin meeting both bounds holds T. */
            const int per = (bins + W - 1) / W;
            packed_t mine = 0;
            for (int t = 0; t < per; t++) {
                const int q = lane * per + t;
                if (q < bins)
                    mine += hist[bins - 1 - q];
            }
            packed_t incl = mine;
            for (int o = 1; o < W; o <<= 1) {
                const packed_t y = sparge_shfl_up(incl, o);
                if (lane >= o)
                    incl += y;
            }
            packed_t cum = above + incl - mine, before = 0;
            int found = -1;
            for (int t = 0; t < per; t++) {
                const int q = lane * per + t;
                if (q < bins && found < 0) {
                    const packed_t next = cum + hist[bins - 1 - q];
                    if (enough(next)) {
                        found = bins - 1 - q;
                        before = cum;
                    }
                    cum = next;
                }
            }
            const int first = __ffsll((long long)sparge_ballot(found >= 0)) - 1; /* exists: the candidates meet both */
            const int d = sparge_shfl(found, first);
            above = sparge_shfl(before, first);
            T |= (uint32_t)d << shift;
            /* Narrow the candidates to bin d, in ascending list order. */
            int kept_c = 0;
            const unsigned long long lower = (1ull << lane) - 1ull;
            if (!in_list) {
#pragma unroll
                for (int e = 0; e < IPT; e++) {
                    const bool c = key[e] && key[e] >> shift == T >> shift;
                    const unsigned long long bal = sparge_ballot(c);
                    if (c)
                        list[kept_c + __popcll(bal & lower)] = key[e];
                    kept_c += __popcll(bal);
                }
            } else {
                for (int k0 = 0; k0 < tied; k0 += W) {
                    const uint32_t kk = k0 + lane < tied ? list[k0 + lane] : 0u;
                    const bool c = k0 + lane < tied && kk >> shift == T >> shift;
                    const unsigned long long bal = sparge_ballot(c);
                    sparge_syncwarp(); /* every lane has read its entry before any is overwritten */
                    if (c)
                        list[kept_c + __popcll(bal & lower)] = kk;
                    kept_c += __popcll(bal);
                }
            }
            tied = kept_c;
            in_list = true;
            top = shift;
        }
    }
    /* Take ties by ascending index until both bounds hold (the whole tie run does). */
    int64_t take = 0;
    packed_t mass = total;
    if (!whole) {
        const packed_t unit = key_fixed(T), above_mass = above & MASS_BITS;
        const int64_t above_count = (int64_t)(above >> COUNT_SHIFT);
        take = least - above_count > 1 ? least - above_count : 1;
        if (above_mass + (packed_t)take * unit < need_mass) /* then unit > 0: the run's mass closes the gap */
            take = (int64_t)((need_mass - above_mass + unit - 1) / unit);
        take = take < tied ? take : (int64_t)tied;
        mass = above_mass + (packed_t)take * unit;
    }

    /* Dense row, ascending CSR indices and the kept bits, a ballot per register slot. */
    const unsigned long long lower = (1ull << lane) - 1ull;
    int32_t kept = 0;
    int ties_seen = 0;
#pragma unroll
    for (int e = 0; e < IPT; e++) {
        const int j = e * W + lane;
        const unsigned long long tie = sparge_ballot(key[e] != 0u && key[e] == T);
        const int rank = ties_seen + __popcll(tie & lower);
        ties_seen += __popcll(tie);
        const bool keep = key[e] != 0u && (whole || key[e] > T || (key[e] == T && rank < take));
        const unsigned long long kb = sparge_ballot(keep);
        if (keep)
            idx[kept + __popcll(kb & lower)] = (int32_t)j;
        if (j < n)
            dense[j] = keep;
        for (int w = 0; w < W / 32; w++)
            if (lane == w && e * (W / 32) + w < words)
                bits[e * (W / 32) + w] = (uint32_t)(kb >> (32 * w));
        kept += __popcll(kb);
    }
    for (int j = kept + lane; j < n; j += W)
        idx[j] = -1;
    if (lane == 0) {
        p.counts[row] = kept;
        p.row_mass[row] = (float)((double)mass * (1.0 / 281474976710656.0));
    }
}

/* Narrow rows: 6 blocks per SM hold the 3072 rows of the Wan2.1-1.3B shape (12 heads × 256) in one wave. */
template <int CAP>
__global__ void __launch_bounds__(FAST_THREADS, CAP <= 512 ? 6 : 1)
    fast_select_kernel(select_params p, int64_t first_row, int64_t end_row)
{
    __shared__ fast_scratch<CAP> scratch;
    const int warps = FAST_THREADS / SPARGE_WARP_SIZE, warp = threadIdx.x / SPARGE_WARP_SIZE;
    for (int r = warp; r < FAST_ROWS; r += warps) {
        const int64_t row = first_row + (int64_t)blockIdx.x * FAST_ROWS + r;
        if (row < end_row)
            fast_select_row<CAP>(p, row, scratch.hist[warp], scratch.list[warp]);
    }
}

/* ---------------------------------------------------------------- CSR and transpose */

constexpr int CSR_THREADS = 128;

__global__ void __launch_bounds__(CSR_THREADS) csr_from_dense_kernel(sparge_mask_view m)
{
    __shared__ int32_t scratch[MAX_WARPS];
    const int64_t row = blockIdx.x;
    const uint8_t *dense = m.dense + row * m.Nkb;
    const int32_t c = write_csr_row([&](int64_t j) { return dense[j] != 0; }, m.Nkb, m.indices + row * m.Nkb, scratch);
    if (threadIdx.x == 0)
        m.counts[row] = c;
}

constexpr int T_THREADS = 256, T_WARPS = T_THREADS / SPARGE_WARP_SIZE, T_COLS = SPARGE_WARP_SIZE;

/* Per (b,h,j) the ascending query blocks i that keep j. A block owns a warp's
 * width of columns (one per lane) and splits the rows into one consecutive
 * chunk per warp: each warp counts its chunk, the counts are scanned across
 * warps, and each warp writes its chunk's entries at its offset. */
__global__ void __launch_bounds__(T_THREADS) transpose_kernel(sparge_mask_view m)
{
    __shared__ int32_t offset[T_WARPS][T_COLS]; /* kept rows of column c in the earlier warps' chunks */
    __shared__ int32_t total[T_COLS];
    const int64_t col_tiles = (m.Nkb + T_COLS - 1) / T_COLS, bh = blockIdx.x / col_tiles;
    const int64_t j0 = blockIdx.x % col_tiles * T_COLS;
    const int lane = threadIdx.x % SPARGE_WARP_SIZE, warp = threadIdx.x / SPARGE_WARP_SIZE;
    const int64_t j = j0 + lane, chunk = (m.Nqb + T_WARPS - 1) / T_WARPS;
    const int64_t r0 = warp * chunk, r1 = r0 + chunk < m.Nqb ? r0 + chunk : m.Nqb;
    const bool real = j < m.Nkb;
    const uint8_t *column = m.dense + bh * m.Nqb * m.Nkb + j;
    int32_t count = 0;
    if (real) {
#pragma unroll 8
        for (int64_t i = r0; i < r1; i++)
            count += column[i * m.Nkb] != 0;
    }
    offset[warp][lane] = count;
    __syncthreads();
    if (threadIdx.x < T_COLS) {
        int32_t run = 0;
        for (int w = 0; w < T_WARPS; w++) {
            const int32_t c = offset[w][threadIdx.x];
            offset[w][threadIdx.x] = run;
            run += c;
        }
        total[threadIdx.x] = run;
    }
    __syncthreads();
    if (real) {
        int32_t *t = m.t_indices + (bh * m.Nkb + j) * m.Nqb;
        int32_t at = offset[warp][lane];
        for (int64_t i = r0; i < r1; i++)
            if (column[i * m.Nkb])
                t[at++] = (int32_t)i;
    }
    /* -1 past each column's count, a warp per column so the stores coalesce. */
    for (int c = warp; c < T_COLS && j0 + c < m.Nkb; c += T_WARPS) {
        int32_t *t = m.t_indices + (bh * m.Nkb + j0 + c) * m.Nqb;
        for (int64_t i = total[c] + lane; i < m.Nqb; i += SPARGE_WARP_SIZE)
            t[i] = -1;
        if (lane == 0)
            m.t_counts[bh * m.Nkb + j0 + c] = total[c];
    }
}

/* The transpose from the fast selection's kept bits: a block per (b, h, word of 32 key blocks) walks the
 * query rows a block-width at a time (one row per thread); a ballot per column gives each warp's rows
 * that keep it, and per-column offsets carried across the chunks place them in ascending order. */
constexpr int TB_THREADS = 256;

__global__ void __launch_bounds__(TB_THREADS) transpose_bits_kernel(sparge_mask_view m, const uint32_t *bits,
                                                                     int64_t first_tile)
{
    constexpr int W = SPARGE_WARP_SIZE, WARPS = TB_THREADS / W;
    __shared__ int32_t offset[WARPS][32]; /* this chunk: kept rows of column c in the earlier warps, then the base */
    __shared__ int32_t running[32];       /* kept rows of column c in the earlier chunks */
    const int lane = threadIdx.x % W, warp = threadIdx.x / W;
    const int64_t words = (m.Nkb + 31) / 32, tile = first_tile + blockIdx.x, bh = tile / words, word = tile % words;
    const int64_t j0 = word * 32;
    const int cols = m.Nkb - j0 < 32 ? (int)(m.Nkb - j0) : 32;
    const unsigned long long lower = (1ull << lane) - 1ull;
    int32_t *t = m.t_indices + (bh * m.Nkb + j0) * m.Nqb;
    if (threadIdx.x < 32)
        running[threadIdx.x] = 0;
    for (int64_t r0 = 0; r0 < m.Nqb; r0 += TB_THREADS) {
        const int64_t r = r0 + threadIdx.x;
        const uint32_t w = r < m.Nqb ? bits[(bh * m.Nqb + r) * words + word] : 0u;
        int32_t count = 0;
        for (int c = 0; c < cols; c++) {
            const int32_t k = __popcll(sparge_ballot((w >> c) & 1u));
            if (lane == c)
                count = k;
        }
        if (lane < 32)
            offset[warp][lane] = count;
        __syncthreads();
        if (threadIdx.x < 32) {
            int32_t run = running[threadIdx.x];
            for (int v = 0; v < WARPS; v++) {
                const int32_t k = offset[v][threadIdx.x];
                offset[v][threadIdx.x] = run;
                run += k;
            }
            running[threadIdx.x] = run;
        }
        __syncthreads();
        for (int c = 0; c < cols; c++) {
            const unsigned long long bal = sparge_ballot((w >> c) & 1u);
            if ((w >> c) & 1u)
                t[c * m.Nqb + offset[warp][c] + __popcll(bal & lower)] = (int32_t)r;
        }
        __syncthreads(); /* offset is rewritten by the next chunk */
    }
    for (int c = warp; c < cols; c += WARPS) {
        const int32_t total = running[c];
        for (int64_t i = total + lane; i < m.Nqb; i += W)
            t[c * m.Nqb + i] = -1;
        if (lane == 0)
            m.t_counts[bh * m.Nkb + j0 + c] = total;
    }
}

/* Limits are checked before anything is queued, so a refusal writes nothing. */
sparge_status check_transpose(const sparge_mask_view *m)
{
    const int64_t blocks = m->B * m->H * ((m->Nkb + T_COLS - 1) / T_COLS);
    if (blocks > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask transpose: %lld column tiles exceed the grid limit %d",
                           (long long)blocks, INT32_MAX);
    return SPARGE_OK;
}

sparge_status launch_transpose(gpu_ctx *ctx, const sparge_mask_view *m)
{
    const int64_t blocks = m->B * m->H * ((m->Nkb + T_COLS - 1) / T_COLS);
    transpose_kernel<<<(unsigned)blocks, T_THREADS, 0, ctx->stream>>>(*m);
    return GPU_CHECK_LAUNCH("mask transpose kernel");
}

/* Widest row the block sort holds. */
constexpr int64_t SELECT_MAX_ROW = 512 * 16;

sparge_status check_select(const sparge_mask_view *m)
{
    const int64_t n = m->Nkb, rows = m->B * m->H * m->Nqb;
    if (n > SELECT_MAX_ROW)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                           "mask selection: rows of %lld key blocks exceed the GPU block sort's limit of %lld "
                           "(raise block_k or select on the CPU)",
                           (long long)n, (long long)SELECT_MAX_ROW);
    if (rows > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask selection: B*H*Nqb = %lld exceeds the grid limit",
                           (long long)rows);
    return check_transpose(m);
}

template <int THREADS, int IPT, bool SOFTMAX>
sparge_status launch_select_kernel(gpu_ctx *ctx, const select_params &p, int64_t rows)
{
    select_kernel<THREADS, IPT, SOFTMAX><<<(unsigned)rows, THREADS, 0, ctx->stream>>>(p);
    return GPU_CHECK_LAUNCH("mask selection kernel");
}

/* Rows wider than this take the softmax as a separate kernel. */
constexpr int64_t FUSED_SOFTMAX_MAX_ROW = 4096;

/* n_k exactly as backends/cpu/select.c computes it. */
select_params make_select_params(const sparge_view &mv, double topk, double topp, const sparge_mask_view *m)
{
    const int64_t n = m->Nkb;
    int64_t nk = 0;
    if (topk > 0.0) {
        nk = (int64_t)floor(topk * (double)n + 1e-6);
        nk = nk < 1 ? 1 : nk > n ? n : nk;
    }
    return select_params{(float *)mv.data, mv.sb, mv.sh, mv.sn, mv.sd, m->H, m->Nqb, n, nk, topp,
                         m->dense, m->counts, m->indices, m->row_mass, nullptr};
}

/* Selection of every row (after check_select), then the transpose. */
template <bool SOFTMAX>
sparge_status launch_select(gpu_ctx *ctx, const sparge_view &mv, double topk, double topp, const sparge_mask_view *m)
{
    const int64_t n = m->Nkb, rows = m->B * m->H * m->Nqb;
    const select_params p = make_select_params(mv, topk, topp, m);
    sparge_status s;
    if (n <= 256)
        s = launch_select_kernel<64, 4, SOFTMAX>(ctx, p, rows);
    else if (n <= 512)
        s = launch_select_kernel<128, 4, SOFTMAX>(ctx, p, rows);
    else if (n <= 1024)
        s = launch_select_kernel<128, 8, SOFTMAX>(ctx, p, rows);
    else if (n <= 2048)
        s = launch_select_kernel<256, 8, SOFTMAX>(ctx, p, rows);
    else if (n <= 4096)
        s = launch_select_kernel<256, 16, SOFTMAX>(ctx, p, rows);
    else /* the caller ran map_softmax_kernel first: the fused prologue would spill here */
        s = launch_select_kernel<512, 16, false>(ctx, p, rows);
    return s ? s : launch_transpose(ctx, m);
}

sparge_status check_map(const sparge_map_args *a)
{
    const sparge_view &q = a->qbar, &k = a->kbar;
    const int64_t bh = q.B * q.H, tiles = bh * ((q.N + MAP_TILE - 1) / MAP_TILE) * ((k.N + MAP_TILE - 1) / MAP_TILE);
    if (tiles > INT32_MAX || bh * q.N > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "pooled map: %lld tiles of 64x64 exceed the grid limit %d",
                           (long long)tiles, INT32_MAX);
    return SPARGE_OK;
}

map_params make_map_params(const sparge_map_args *a)
{
    const sparge_view &q = a->qbar, &k = a->kbar, &m = a->map;
    return map_params{(const float *)q.data, (const float *)k.data, q.sb, q.sh, q.sn, q.sd, k.sb, k.sh, k.sn, k.sd,
                      (float *)m.data, m.sb, m.sh, m.sn, m.sd, q.H, q.N, k.N, q.D, a->scale};
}

/* The logits scale·qbar kbarᵀ into a->map for the (b,h) pairs bh0 <= b·H + h < bh1 (after check_map);
 * on tensor cores where the fast tier runs on sm_80+. */
sparge_status launch_logits(const gpu_ctx *ctx, const sparge_map_args *a, gpuStream_t stream, int64_t bh0,
                            int64_t bh1)
{
    const sparge_view &q = a->qbar, &k = a->kbar;
    const int64_t per_head = ((q.N + MAP_TILE - 1) / MAP_TILE) * ((k.N + MAP_TILE - 1) / MAP_TILE);
    const unsigned blocks = (unsigned)((bh1 - bh0) * per_head);
#ifndef SPARGE_USE_HIP
    if (!ctx->generic && ctx->cc_major >= 8) {
        map_logits_tf32_kernel<<<blocks, MAP_THREADS, 0, stream>>>(make_map_params(a), bh0 * per_head);
        return GPU_CHECK_LAUNCH("pooled map kernel (tensor cores)");
    }
#else
    (void)ctx;
#endif
    map_logits_kernel<<<blocks, MAP_THREADS, 0, stream>>>(make_map_params(a), bh0 * per_head);
    return GPU_CHECK_LAUNCH("pooled map kernel");
}

sparge_status launch_softmax(gpu_ctx *ctx, const sparge_map_args *a)
{
    const int64_t rows = a->qbar.B * a->qbar.H * a->qbar.N, per_block = 256 / SPARGE_WARP_SIZE;
    map_softmax_kernel<<<(unsigned)((rows + per_block - 1) / per_block), 256, 0, ctx->stream>>>(make_map_params(a),
                                                                                                  rows);
    return GPU_CHECK_LAUNCH("pooled map softmax kernel");
}

/* Softmax and selection of the predicted rows of (b,h) pairs bh0 <= b·H + h < bh1, up to FAST_MAX_ROW
 * wide, then their transpose from the kept bits (p.bits: a workspace of B·H·Nqb·ceil(Nkb/32) words). */
sparge_status launch_fast_select(const select_params &p, const sparge_mask_view *m, gpuStream_t stream, int64_t bh0,
                                 int64_t bh1)
{
    const int64_t n = m->Nkb, first = bh0 * m->Nqb, end = bh1 * m->Nqb;
    const unsigned blocks = (unsigned)((end - first + FAST_ROWS - 1) / FAST_ROWS);
    if (n <= 256)
        fast_select_kernel<256><<<blocks, FAST_THREADS, 0, stream>>>(p, first, end);
    else if (n <= 512)
        fast_select_kernel<512><<<blocks, FAST_THREADS, 0, stream>>>(p, first, end);
    else if (n <= 1024)
        fast_select_kernel<1024><<<blocks, FAST_THREADS, 0, stream>>>(p, first, end);
    else if (n <= 1536) /* Wan2.1-14B 720p: 1182 */
        fast_select_kernel<1536><<<blocks, FAST_THREADS, 0, stream>>>(p, first, end);
    else
        fast_select_kernel<2048><<<blocks, FAST_THREADS, 0, stream>>>(p, first, end);
    sparge_status s = GPU_CHECK_LAUNCH("mask selection kernel");
    if (s)
        return s;
    const int64_t words = (n + 31) / 32;
    transpose_bits_kernel<<<(unsigned)((bh1 - bh0) * words), TB_THREADS, 0, stream>>>(*m, p.bits, bh0 * words);
    return GPU_CHECK_LAUNCH("mask transpose kernel");
}

/* The overlapped prediction (rows up to FAST_MAX_ROW, contiguous map rows): Q and K pooled on ctx->stream
 * in chunks of heads; each chunk's logits, selection and transpose run on the high-priority ctx->side as
 * soon as its pooling is done, under the next chunk's pooling. ctx->stream waits for the last chunk. */
sparge_status predict_overlapped(gpu_ctx *ctx, const sparge_predict_args *a)
{
    const sparge_mask_view *m = &a->mask;
    const int64_t bh = m->B * m->H, words = (m->Nkb + 31) / 32;
    const int64_t chunks = bh < GPU_SIDE_FORKS ? bh : GPU_SIDE_FORKS, per_chunk = (bh + chunks - 1) / chunks;
    select_params p = make_select_params(a->map.map, a->topk, a->topp, m);
    sparge_status s;
    if ((s = gpu_side_stream(ctx)) ||
        (s = gpu_workspace(ctx, (size_t)(bh * m->Nqb * words) * sizeof(uint32_t), (void **)&p.bits)))
        return s;
    for (int64_t c = 0; c * per_chunk < bh; c++) {
        const int64_t bh0 = c * per_chunk, bh1 = bh0 + per_chunk < bh ? bh0 + per_chunk : bh;
        if ((s = SPARGE_GPU_FN(pool_pair)(ctx, &a->q, &a->k, bh0, bh1)) ||
            (s = GPU_CHECK(gpuEventRecord(ctx->side_fork[c], ctx->stream))) ||
            (s = GPU_CHECK(gpuStreamWaitEvent(ctx->side, ctx->side_fork[c], 0))) ||
            (s = launch_logits(ctx, &a->map, ctx->side, bh0, bh1)) || (s = launch_fast_select(p, m, ctx->side, bh0, bh1)))
            return s;
    }
    if ((s = GPU_CHECK(gpuEventRecord(ctx->side_join, ctx->side))))
        return s;
    return GPU_CHECK(gpuStreamWaitEvent(ctx->stream, ctx->side_join, 0));
}

} // namespace

sparge_status SPARGE_GPU_FN(pooled_map)(gpu_ctx *ctx, const sparge_map_args *a)
{
    sparge_status s;
    if ((s = check_map(a)) || (s = launch_logits(ctx, a, ctx->stream, 0, a->qbar.B * a->qbar.H)))
        return s;
    return launch_softmax(ctx, a);
}

sparge_status SPARGE_GPU_FN(mask_select)(gpu_ctx *ctx, const sparge_select_args *a)
{
    sparge_status s = check_select(&a->mask);
    return s ? s : launch_select<false>(ctx, a->map, a->topk, a->topp, &a->mask);
}

/* Pooling, logits, then selection with the row softmax in its prologue: the map is written once, as
 * probabilities. Rows up to FAST_MAX_ROW take the overlapped path, wider ones one launch per stage. */
sparge_status SPARGE_GPU_FN(mask_predict)(gpu_ctx *ctx, const sparge_predict_args *a)
{
    sparge_status s;
    const int64_t bh = a->mask.B * a->mask.H;
    if ((s = check_map(&a->map)) || (s = check_select(&a->mask)))
        return s;
    if (a->mask.Nkb <= FAST_MAX_ROW && a->map.map.sd == 1)
        return predict_overlapped(ctx, a);
    if ((s = SPARGE_GPU_FN(pool_pair)(ctx, &a->q, &a->k, 0, bh)) || (s = launch_logits(ctx, &a->map, ctx->stream, 0, bh)))
        return s;
    if (a->mask.Nkb > FUSED_SOFTMAX_MAX_ROW && (s = launch_softmax(ctx, &a->map)))
        return s;
    return launch_select<true>(ctx, a->map.map, a->topk, a->topp, &a->mask);
}

sparge_status SPARGE_GPU_FN(mask_from_dense)(gpu_ctx *ctx, const sparge_mask_view *m)
{
    const int64_t rows = m->B * m->H * m->Nqb;
    if (rows > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask import: B*H*Nqb = %lld exceeds the grid limit",
                           (long long)rows);
    sparge_status s = check_transpose(m);
    if (s)
        return s;
    csr_from_dense_kernel<<<(unsigned)rows, CSR_THREADS, 0, ctx->stream>>>(*m);
    s = GPU_CHECK_LAUNCH("mask CSR kernel");
    return s ? s : launch_transpose(ctx, m);
}
