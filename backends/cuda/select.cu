/* Per-row hybrid selection on the GPU, and the fused mask prediction (pooling, logits, selection with the row
 * softmax in its prologue). Everything is queued on the context's stream; nothing here waits for the device.
 *
 * Selection follows docs/DESIGN.md ("Masks") and backends/cpu/select.c exactly: a row is sorted by descending score
 * with ties to the lower block index (a stable block radix sort of order-preserving 32-bit keys over the indices
 * in ascending order), Top-p accumulates the sorted prefix in fp64, and the kept set is the first max(n_k, n_p, 1)
 * blocks; a row holding NaN keeps all. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gpu.h"

#ifdef SPARGE_USE_HIP
#include <rocprim/rocprim.hpp>
#else
#include <cub/block/block_radix_sort.cuh>
#endif

namespace {

/* Reduction over the block with op; every thread gets the result. scratch
 * holds GPU_MAX_WARPS values. All threads must call it. */
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
    int64_t H, Nqb, Nkb;   /* Nkb: the rows' stride in dense and indices */
    int64_t topk_count;    /* n_k of a plain row (Nkb blocks), computed on the host exactly as the reference */
    double topk, topp;
    uint8_t *dense;
    int32_t *counts, *indices;
    float *row_mass;
    gpu_layout L;          /* causal or varlen rows select among their allowed blocks and keep their diagonal ones */
};

/* Row r under p's layout: its allowed blocks *n, n_k *least, and its forced blocks d0..d1; false for a row past its
 * sequence, which keeps nothing. */
__device__ __forceinline__ bool select_row_rule(const select_params &p, int64_t r, int64_t *n, int64_t *least,
                                                int64_t *d0, int64_t *d1)
{
    if (p.L.plain) {
        *n = p.Nkb, *least = p.topk_count, *d0 = 1, *d1 = 0;
        return true;
    }
    if (!gpu_layout_row(p.L, r, n, d0, d1))
        return false;
    *least = gpu_topk_count(p.topk, *n);
    return true;
}

/* A row that keeps nothing (past its sequence): dense 0, indices -1, count and mass 0. */
__device__ void empty_row(const select_params &p, int64_t row, int lane, int width)
{
    for (int64_t j = lane; j < p.Nkb; j += width) {
        p.dense[row * p.Nkb + j] = 0;
        p.indices[row * p.Nkb + j] = -1;
    }
    if (lane == 0) {
        p.counts[row] = 0;
        p.row_mass[row] = 0.0f;
    }
}

/* One thread block per row; thread t holds entries t*IPT .. t*IPT+IPT-1 (the
 * blocked arrangement of the sort). SOFTMAX: the row holds logits; the block
 * turns them into the pooled map's probabilities (written back) before
 * selecting, as map_softmax_kernel would. */
template <int THREADS, int IPT, bool SOFTMAX> __global__ void __launch_bounds__(THREADS) select_kernel(select_params p)
{
    gpu_wait_for_previous_kernel();
    using sorter = row_sort<THREADS, IPT>;
    __shared__ union {
        typename sorter::storage sort;
        double dscan[GPU_MAX_WARPS];
        int32_t iscan[GPU_MAX_WARPS];
    } tmp;
    __shared__ float fred[GPU_MAX_WARPS];
    __shared__ uint32_t ured[GPU_MAX_WARPS];
    __shared__ uint8_t keep[THREADS * IPT];
    __shared__ int32_t np_shared;

    const int64_t row = blockIdx.x, bh = row / p.Nqb, i = row % p.Nqb, b = bh / p.H, h = bh % p.H;
    const int64_t stride = p.Nkb, s0 = (int64_t)threadIdx.x * IPT;
    int64_t n, topk_count, d0, d1;
    float *src = p.map + b * p.mb + h * p.mh + i * p.mn;
    if (!select_row_rule(p, row, &n, &topk_count, &d0, &d1)) {
        if constexpr (SOFTMAX)
            for (int64_t j = threadIdx.x; j < stride; j += THREADS)
                src[j * p.md] = 0.0f;
        empty_row(p, row, threadIdx.x, THREADS);
        return;
    }
    uint8_t *dense = p.dense + row * stride;
    int32_t *idx = p.indices + row * stride;

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
            } else if (s0 + e < stride) {
                src[(s0 + e) * p.md] = 0.0f; /* past the row's allowed blocks */
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
        for (int64_t j = threadIdx.x; j < stride; j += THREADS) {
            dense[j] = j < n;
            idx[j] = j < n ? (int32_t)j : -1;
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
    kept = kept > topk_count ? kept : topk_count;
    kept = kept < 1 ? 1 : kept;

    /* The kept mass is the prefix through sorted position kept-1, plus the forced blocks outside it. */
    double forced_mass = 0.0;
    for (int e = 0; e < IPT; e++)
        if (s0 + e < n) {
            keep[vals[e]] = s0 + e < kept;
            if (s0 + e >= kept && vals[e] >= d0 && vals[e] <= d1)
                forced_mass += score(e);
        }
    const double extra = d0 <= d1 ? block_reduce(forced_mass, [](double u, double v) { return u + v; }, tmp.dscan) : 0.0;
    if (s0 < kept && kept <= s0 + IPT) {
        double mass = before;
        for (int e = 0; e < IPT; e++)
            mass += s0 + e < kept ? score(e) : 0.0;
        p.row_mass[row] = (float)(mass + extra);
    }
    __syncthreads();
    for (int64_t j = d0 + threadIdx.x; j <= d1; j += THREADS)
        keep[j] = 1;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < stride; j += THREADS)
        dense[j] = j < n ? keep[j] : 0;
    /* CSR: thread t owns block indices s0 .. s0+IPT-1; one scan places them. */
    int32_t mine = 0;
    for (int e = 0; e < IPT; e++)
        mine += s0 + e < n && keep[s0 + e];
    int32_t kept_total;
    int32_t at = block_exclusive_scan<int32_t>(mine, &kept_total, tmp.iscan);
    for (int e = 0; e < IPT; e++)
        if (s0 + e < n && keep[s0 + e])
            idx[at++] = (int32_t)(s0 + e);
    for (int64_t j = kept_total + threadIdx.x; j < stride; j += THREADS)
        idx[j] = -1;
    if (threadIdx.x == 0)
        p.counts[row] = kept_total;
    gpu_allow_next_kernel();
}

/* ---------------------------------------------------------------- fused softmax + selection, one warp per row */

/* For mask prediction (rows of softmax probabilities, never negative) the
 * kept set is found without sorting. kept = max(n_k, n_p, 1) is the shortest
 * prefix of the row order holding at least max(n_k, 1) blocks and mass >= p,
 * since the prefix mass only grows; T is the key of its last block. A
 * bisection over the key range [lo, hi) known to hold T finds it: if the keys
 * >= mid satisfy both bounds, T >= mid, else they are all kept before T. Each
 * pass counts from the registers (the row lives there: lane l holds blocks l,
 * l + warp, l + 2·warp, ...) and snaps the range to the nearest keys on either
 * side, so empty stretches of the key range cost nothing. Once at most a
 * warp's width of candidates is left in [lo, hi), a warp sort and a scan of
 * their mass place T at once. Ties at T are then taken by ascending index,
 * adding their mass one by one as the reference does. A pass adds the mass in
 * fp32 and only decides by it when it is clearly on one side of p; otherwise,
 * and for every mass that reaches the output, it adds in fp64. The map's rows
 * must be contiguous (md = 1). At Wan2.1-1.3B on the H200 (ncu) it takes
 * 13.4-13.7 / 13.7-14.1 µs (Top-k 95 % / hybrid) where a bitwise descent that
 * compacted the candidates into shared memory after each split took 16.2 /
 * 18.5 µs; at Wan2.1-14B, 223 µs (hybrid). */
constexpr int FAST_THREADS = 128, FAST_ROWS = 4; /* rows per CTA, whatever the warp size */
constexpr int64_t FAST_MAX_ROW = 2048;

/* Order-preserving key of a probability >= 0: its bits (+0 for -0); -1 marks padding. */
__device__ __forceinline__ int32_t prob_key(float x) { return (int32_t)(__float_as_uint(x) & 0x7fffffffu); }
__device__ __forceinline__ double key_prob(int32_t k) { return (double)__int_as_float(k); }

template <typename T> __device__ __forceinline__ T warp_sum(T x)
{
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1)
        x += sparge_shfl_xor(x, o);
    return x;
}

/* Integer warp sum: one redux instruction on sm_80+, the shuffles elsewhere. */
__device__ __forceinline__ int warp_count(int x)
{
#if !defined(SPARGE_USE_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return (int)__reduce_add_sync(SPARGE_FULL_MASK, (unsigned)x);
#else
    return warp_sum(x);
#endif
}

/* Warp-wide minimum (MAX false) or maximum: one redux instruction on sm_80+, the shuffles elsewhere. */
template <bool MAX> __device__ __forceinline__ int32_t warp_extreme(int32_t x)
{
#if !defined(SPARGE_USE_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return MAX ? __reduce_max_sync(SPARGE_FULL_MASK, x) : __reduce_min_sync(SPARGE_FULL_MASK, x);
#else
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1) {
        const int32_t y = sparge_shfl_xor(x, o);
        x = MAX ? max(x, y) : min(x, y);
    }
    return x;
#endif
}
__device__ __forceinline__ int32_t warp_min(int32_t x) { return warp_extreme<false>(x); }
__device__ __forceinline__ int32_t warp_max(int32_t x) { return warp_extreme<true>(x); }

/* The warp's values in descending order across the lanes (a bitonic network). */
__device__ __forceinline__ int32_t warp_sort_descending(int32_t x)
{
    const int lane = threadIdx.x % SPARGE_WARP_SIZE;
    for (int size = 2; size <= SPARGE_WARP_SIZE; size <<= 1)
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            const int32_t y = sparge_shfl_xor(x, stride);
            const bool larger = ((lane & size) == 0) == ((lane & stride) == 0);
            x = larger ? max(x, y) : min(x, y);
        }
    return x;
}

/* One bisection pass over a lane's keys: how many are >= mid and (MASS) their mass in fp32, the lowest of them
 * and the highest key below mid (padding is neither). */
struct split_count {
    int c;
    float m;
    int32_t lowest_in, highest_out;
};
template <int IPT, bool MASS> __device__ __forceinline__ split_count count_split(const int32_t (&key)[IPT], int32_t mid)
{
    split_count s = {0, 0.0f, INT32_MAX, -1};
#pragma unroll
    for (int e = 0; e < IPT; e++)
        if (key[e] >= mid) {
            s.c++;
            if (MASS)
                s.m += __int_as_float(key[e]);
            s.lowest_in = min(s.lowest_in, key[e]);
        } else
            s.highest_out = max(s.highest_out, key[e]);
    return s;
}

/* The warp's fp64 mass of the keys >= from (the lowest key of the row: all of them). */
template <int IPT> __device__ __forceinline__ double mass_from(const int32_t (&key)[IPT], int32_t from)
{
    double m = 0.0;
#pragma unroll
    for (int e = 0; e < IPT; e++)
        if (key[e] >= from)
            m += key_prob(key[e]);
    return warp_sum(m);
}

/* list: this warp's SPARGE_WARP_SIZE slots of shared memory. FULL: the row has exactly CAP blocks (Wan2.1-1.3B's
 * 512), so no register slot needs a bounds check. LAYOUT: a causal or varlen row, which selects among its allowed
 * blocks (a prefix of the row), keeps its diagonal blocks besides, and is zero past them. */
template <int CAP, bool FULL, bool LAYOUT>
__device__ void fast_select_row(const select_params &p, int64_t row, int32_t *list)
{
    constexpr int IPT = CAP / SPARGE_WARP_SIZE;
    const int lane = threadIdx.x % SPARGE_WARP_SIZE, stride = FULL ? CAP : (int)p.Nkb; /* <= FAST_MAX_ROW */
    /* 32-bit decode (check_select: rows <= INT32_MAX): a 64-bit division by a run-time value is a long software
     * sequence. */
    const uint32_t r = (uint32_t)row, bh = r / (uint32_t)p.Nqb, i = r - bh * (uint32_t)p.Nqb, b = bh / (uint32_t)p.H,
                   h = bh - b * (uint32_t)p.H;
    float *src = p.map + b * p.mb + h * p.mh + i * p.mn;
    int n = stride, d0 = 1, d1 = 0;
    int64_t least_k = p.topk_count;
    if constexpr (LAYOUT) {
        int64_t allowed, f0, f1;
        if (!select_row_rule(p, row, &allowed, &least_k, &f0, &f1)) {
            for (int j = lane; j < stride; j += SPARGE_WARP_SIZE)
                src[j] = 0.0f;
            empty_row(p, row, lane, SPARGE_WARP_SIZE);
            return;
        }
        n = (int)allowed, d0 = (int)f0, d1 = (int)f1;
        for (int j = n + lane; j < stride; j += SPARGE_WARP_SIZE) { /* past the allowed blocks: nothing */
            src[j] = 0.0f;
            p.dense[row * stride + j] = 0;
            p.indices[row * stride + j] = -1;
        }
    }
    auto in_row = [&](int e) { return FULL || e * SPARGE_WARP_SIZE + lane < n; };

    /* Softmax as map_softmax_kernel: a row holding a NaN logit becomes all NaN. So does a row holding +inf or only
     * -inf: each leaves a NaN in the sum (inf - inf), so 1/sum tells for the whole warp. */
    float x[IPT];
    float mx = -INFINITY;
#pragma unroll
    for (int e = 0; e < IPT; e++) {
        x[e] = in_row(e) ? src[e * SPARGE_WARP_SIZE + lane] : -INFINITY;
        mx = fmaxf(mx, x[e]); /* ignores NaN */
    }
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1)
        mx = fmaxf(mx, sparge_shfl_xor(mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < IPT; e++)
        if (in_row(e)) {
            x[e] = expf(x[e] - mx);
            sum += x[e];
        }
    const float inv = 1.0f / warp_sum(sum);
    const bool nan = is_nan(inv);
    int32_t key[IPT];
    int32_t kmin = INT32_MAX, kmax = -1;
#pragma unroll
    for (int e = 0; e < IPT; e++) {
        key[e] = -1;
        if (in_row(e)) {
            const float v = x[e] * inv;
            src[e * SPARGE_WARP_SIZE + lane] = v;
            key[e] = prob_key(v);
            kmin = min(kmin, key[e]);
            kmax = max(kmax, key[e]);
        }
    }
    uint8_t *dense = p.dense + row * stride;
    int32_t *idx = p.indices + row * stride;
    if (nan) {
        for (int j = lane; j < n; j += SPARGE_WARP_SIZE) {
            dense[j] = 1;
            idx[j] = j;
        }
        if (lane == 0) {
            p.counts[row] = n;
            p.row_mass[row] = NAN;
        }
        return;
    }

    const int least = least_k > 1 ? (int)least_k : 1; /* <= n */
    const bool use_p = p.topp > 0.0;
    int32_t lo = warp_min(kmin), hi = warp_max(kmax) + 1; /* T lies in [lo, hi) */
    /* Rounding may leave the total below p: keep the whole row. The total of a softmax row is within n·2^-23 of 1,
     * so only p near 1 needs it. */
    const double total = use_p && p.topp > 0.999 ? mass_from(key, lo) : 1.0;
    const bool whole = use_p && total < p.topp;

    int32_t T = 0;
    uint32_t ties_taken = 0u;
    bool all_ties = true; /* every block with key T is kept */
    double mass = total;
    if (!whole) {
        /* ge_lo keys are >= lo and `above` keys are >= hi. The fp32 mass of a pass is within IPT·2^-24 of its
         * exact value, relatively (sequential sums over a lane, ftz'd terms below 2^-126 aside). */
        const double slack = IPT * 0x1p-22;
        int ge_lo = n, above = 0;
        while (hi - lo > 1 && ge_lo - above > SPARGE_WARP_SIZE) {
            const int32_t mid = lo + (hi - lo) / 2;
            const split_count s = use_p ? count_split<IPT, true>(key, mid) : count_split<IPT, false>(key, mid);
            const int c = warp_count(s.c);
            bool take = c >= least; /* the keys >= mid suffice: T >= mid */
            if (take && use_p) {
                const double m = warp_sum((double)s.m);
                take = fabs(m - p.topp) > slack * m + 0x1p-100 ? m >= p.topp : mass_from(key, mid) >= p.topp;
            }
            if (take) {
                lo = warp_min(s.lowest_in);
                ge_lo = c;
            } else { /* they are all kept before T */
                hi = warp_max(s.highest_out) + 1;
                above = c;
            }
        }
        int nc = ge_lo - above; /* the candidates: the keys in [lo, hi) */
        double above_mass = use_p && above ? mass_from(key, hi) : 0.0;
        T = lo;
        if (hi - lo > 1) { /* at most a warp's width of them, not all equal: sorted, they give T at once */
            const sparge_lanes below = ((sparge_lanes)1 << lane) - 1;
            int placed = 0;
#pragma unroll
            for (int e = 0; e < IPT; e++) {
                const bool cand = key[e] >= lo && key[e] < hi;
                const sparge_lanes cb = sparge_ballot(cand);
                if (cand)
                    list[placed + sparge_popc(cb & below)] = key[e];
                placed += sparge_popc(cb);
            }
            sparge_syncwarp();
            const int32_t k = warp_sort_descending(lane < nc ? list[lane] : -1);
            sparge_syncwarp(); /* every lane has read the list before this warp's next row writes it */
            const double kv = k >= 0 ? key_prob(k) : 0.0;
            const double incl = use_p ? warp_inclusive_scan(kv) : 0.0;
            const double up = sparge_shfl_up(incl, 1); /* every lane shuffles: lane 0 then drops it */
            const double excl = lane ? up : 0.0;
            const sparge_lanes ok =
                sparge_ballot(k >= 0 && above + lane + 1 >= least && (!use_p || above_mass + incl >= p.topp));
            /* The passes left T among the candidates; a rounding difference in the scan's sum can only move it
             * to the last one. */
            const int at = ok ? sparge_ffs(ok) - 1 : nc - 1;
            T = sparge_shfl(k, at);
            const sparge_lanes ties = sparge_ballot(k == T);
            const int first = sparge_ffs(ties) - 1;
            above += first;
            above_mass += sparge_shfl(excl, first);
            nc = sparge_popc(ties);
        }
        /* The nc candidates left all equal T; above / above_mass cover exactly the keys > T. Without Top-p the
         * mass only feeds row_mass. */
        if (!use_p)
            above_mass = mass_from(key, T + 1);
        /* Ties at T by ascending index, their mass added one by one as the reference does. */
        const double tv = key_prob(T);
        mass = above_mass;
        do {
            ties_taken++;
            mass += tv;
        } while ((int)ties_taken < nc && !(above + (int)ties_taken >= least && (!use_p || mass >= p.topp)));
        all_ties = (int)ties_taken == nc;
    }

    /* Dense row and ascending CSR indices, a ballot per register slot; the ties at T are ranked only when
     * some of them drop out. */
    const sparge_lanes below = ((sparge_lanes)1 << lane) - 1;
    int32_t kept = 0, dropped = 0;
    uint32_t ties_seen = 0;
    double forced_mass = 0.0; /* the diagonal blocks the selection left out */
#pragma unroll
    for (int e = 0; e < IPT; e++) {
        const int j = e * SPARGE_WARP_SIZE + lane;
        bool keep = key[e] >= T; /* whole: T = 0, and padding is -1 */
        if (!all_ties) {
            const sparge_lanes tie = sparge_ballot(key[e] == T);
            const uint32_t rank = ties_seen + (uint32_t)sparge_popc(tie & below);
            ties_seen += (uint32_t)sparge_popc(tie);
            keep = key[e] > T || (key[e] == T && rank < ties_taken);
        }
        if (LAYOUT && !keep && j >= d0 && j <= d1) {
            keep = true;
            forced_mass += key_prob(key[e]);
        }
        const sparge_lanes kb = sparge_ballot(keep), db = FULL ? ~kb : sparge_ballot(!keep && in_row(e));
        /* Kept blocks fill the CSR row from the front, the others its -1 tail from the back: each slot is written
         * once, and no lane branches around a store. */
        if (in_row(e)) {
            idx[keep ? kept + sparge_popc(kb & below) : n - 1 - dropped - sparge_popc(db & below)] = keep ? j : -1;
            dense[j] = keep;
        }
        kept += sparge_popc(kb);
        dropped += sparge_popc(db);
    }
    if (LAYOUT)
        mass += warp_sum(forced_mass);
    if (lane == 0) {
        p.counts[row] = kept;
        p.row_mass[row] = (float)mass;
    }
    gpu_allow_next_kernel();
}

/* Up to 512 key blocks: at most 80 registers, so that 6 CTAs share an SM and Wan2.1-1.3B's 3072 rows run in
 * one wave (93 registers gave 1.16 waves: 20.1 against 24.4 µs on the H200, at an 8-byte spill). */
template <int CAP, bool FULL, bool LAYOUT>
__global__ void __launch_bounds__(FAST_THREADS, CAP <= 512 ? 6 : 1) fast_select_kernel(select_params p, int64_t rows)
{
    constexpr int warps = FAST_THREADS / SPARGE_WARP_SIZE;
    __shared__ int32_t lists[warps][SPARGE_WARP_SIZE];
    gpu_wait_for_previous_kernel();
    for (int r = threadIdx.x / SPARGE_WARP_SIZE; r < FAST_ROWS; r += warps) {
        const int64_t row = (int64_t)blockIdx.x * FAST_ROWS + r;
        if (row < rows)
            fast_select_row<CAP, FULL, LAYOUT>(p, row, lists[threadIdx.x / SPARGE_WARP_SIZE]);
    }
}
/* ---------------------------------------------------------------- launch */

static_assert(GPU_SELECT_MAX_ROW == 512 * 16, "the widest block sort: 512 threads of 16 items");

/* Grid limit, checked before anything is queued (the row width is the tier's limit, backend.cu). */
sparge_status check_select(const sparge_mask_view *m)
{
    const int64_t rows = m->B * m->H * m->Nqb;
    if (rows > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask selection: B*H*Nqb = %lld exceeds the grid limit",
                           (long long)rows);
    return SPARGE_OK;
}

template <int THREADS, int IPT, bool SOFTMAX>
sparge_status launch_select_kernel(gpu_ctx *ctx, const select_params &p, int64_t rows)
{
    return gpu_launch_after(ctx, select_kernel<THREADS, IPT, SOFTMAX>, (unsigned)rows, THREADS, 0,
                            "mask selection kernel", p);
}

/* Rows wider than this take the softmax as a separate kernel. */
constexpr int64_t FUSED_SOFTMAX_MAX_ROW = 4096;

/* n_k of a plain row exactly as backends/cpu/select.c computes it. */
select_params make_select_params(const sparge_view &mv, double topk, double topp, const sparge_mask_view *m)
{
    const int64_t n = m->Nkb;
    int64_t nk = 0;
    if (topk > 0.0) {
        nk = (int64_t)floor(topk * (double)n + 1e-6);
        nk = nk < 1 ? 1 : nk > n ? n : nk;
    }
    return select_params{(float *)mv.data, mv.sb, mv.sh, mv.sn, mv.sd, m->H, m->Nqb, n, nk, topk, topp,
                         m->dense, m->counts, m->indices, m->row_mass, gpu_layout_of(m)};
}

/* Selection of every row (after check_select). */
template <bool SOFTMAX>
sparge_status launch_select(gpu_ctx *ctx, const sparge_view &mv, double topk, double topp, const sparge_mask_view *m)
{
    const int64_t n = m->Nkb, rows = m->B * m->H * m->Nqb;
    const select_params p = make_select_params(mv, topk, topp, m);
    if (n <= 256)
        return launch_select_kernel<64, 4, SOFTMAX>(ctx, p, rows);
    if (n <= 512)
        return launch_select_kernel<128, 4, SOFTMAX>(ctx, p, rows);
    if (n <= 1024)
        return launch_select_kernel<128, 8, SOFTMAX>(ctx, p, rows);
    if (n <= 2048)
        return launch_select_kernel<256, 8, SOFTMAX>(ctx, p, rows);
    if (n <= 4096)
        return launch_select_kernel<256, 16, SOFTMAX>(ctx, p, rows);
    /* the caller ran map_softmax_kernel first: the fused prologue would spill here */
    return launch_select_kernel<512, 16, false>(ctx, p, rows);
}

/* The selection kernel for rows of n <= CAP key blocks: the copy without bounds checks when every row has CAP, the
 * layout-aware one for causal or varlen rows. */
template <int CAP> auto fast_select_for(int64_t n, bool plain) -> void (*)(select_params, int64_t)
{
    if (!plain)
        return fast_select_kernel<CAP, false, true>;
    return n == CAP ? fast_select_kernel<CAP, true, false> : fast_select_kernel<CAP, false, false>;
}

/* Softmax and selection of predicted rows up to FAST_MAX_ROW wide. */
sparge_status launch_fast_select(gpu_ctx *ctx, const sparge_predict_args *a)
{
    const sparge_mask_view *m = &a->mask;
    const int64_t n = m->Nkb, rows = m->B * m->H * m->Nqb, blocks = (rows + FAST_ROWS - 1) / FAST_ROWS;
    const select_params p = make_select_params(a->map.map, a->topk, a->topp, m);
    auto launch = [&](void (*kernel)(select_params, int64_t)) {
        return gpu_launch_after(ctx, kernel, (unsigned)blocks, FAST_THREADS, 0, "mask selection kernel", p, rows);
    };
    if (n <= 256)
        return launch(fast_select_for<256>(n, p.L.plain));
    if (n <= 512)
        return launch(fast_select_for<512>(n, p.L.plain));
    if (n <= 1024)
        return launch(fast_select_for<1024>(n, p.L.plain));
    if (n <= 1280) /* Wan2.1-14B 720p: 1182 */
        return launch(fast_select_for<1280>(n, p.L.plain));
    if (n <= 1536)
        return launch(fast_select_for<1536>(n, p.L.plain));
    return launch(fast_select_for<2048>(n, p.L.plain));
}
} // namespace

sparge_status SPARGE_GPU_FN(mask_select)(gpu_ctx *ctx, const sparge_select_args *a)
{
    sparge_status s = check_select(&a->mask);
    return s ? s : launch_select<false>(ctx, a->map, a->topk, a->topp, &a->mask);
}

/* One pooling launch for Q and K, the logits, then selection with the row
 * softmax in its prologue: the map is written once, as probabilities. */
sparge_status SPARGE_GPU_FN(mask_predict)(gpu_ctx *ctx, const sparge_predict_args *a)
{
    sparge_status s;
    if ((s = check_select(&a->mask)) || (s = SPARGE_GPU_FN(pool_pair)(ctx, &a->q, &a->k)) ||
        (s = SPARGE_GPU_FN(map_logits)(ctx, &a->map)))
        return s;
    if (a->mask.Nkb <= FAST_MAX_ROW && a->map.map.sd == 1)
        return launch_fast_select(ctx, a);
    if (a->mask.Nkb > FUSED_SOFTMAX_MAX_ROW && (s = SPARGE_GPU_FN(map_softmax)(ctx, &a->map)))
        return s;
    return launch_select<true>(ctx, a->map.map, a->topk, a->topp, &a->mask);
}

