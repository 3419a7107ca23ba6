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
__global__ void __launch_bounds__(MAP_THREADS) map_logits_kernel(map_params p)
{
    __shared__ __align__(16) float qs[MAP_DCHUNK][MAP_TILE + 4];
    __shared__ __align__(16) float ks[MAP_DCHUNK][MAP_TILE + 4];
    const int64_t ktiles = (p.Nkb + MAP_TILE - 1) / MAP_TILE, qtiles = (p.Nqb + MAP_TILE - 1) / MAP_TILE;
    const int64_t tile = blockIdx.x, bh = tile / (qtiles * ktiles), b = bh / p.H, h = bh % p.H;
    const int64_t i0 = tile / ktiles % qtiles * MAP_TILE, j0 = tile % ktiles * MAP_TILE;
    const float *q = p.q + b * p.qb + h * p.qh, *k = p.k + b * p.kb + h * p.kh;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    float acc[4][4] = {};
    for (int64_t d0 = 0; d0 < p.D; d0 += MAP_DCHUNK) {
        for (int e = threadIdx.x; e < MAP_TILE * MAP_DCHUNK; e += MAP_THREADS) {
            const int r = e / MAP_DCHUNK, dd = e % MAP_DCHUNK;
            const int64_t d = d0 + dd;
            qs[dd][r] = i0 + r < p.Nqb && d < p.D ? q[(i0 + r) * p.qn + d * p.qd] : 0.0f;
            ks[dd][r] = j0 + r < p.Nkb && d < p.D ? k[(j0 + r) * p.kn + d * p.kd] : 0.0f;
        }
        __syncthreads();
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
    static __device__ void descending(uint32_t (&k)[IPT], int32_t (&v)[IPT], storage &s) { impl().sort_desc(k, v, s); }
};
#else
template <int THREADS, int IPT> struct row_sort {
    using impl = cub::BlockRadixSort<uint32_t, THREADS, IPT, int32_t>;
    using storage = typename impl::TempStorage;
    static __device__ void descending(uint32_t (&k)[IPT], int32_t (&v)[IPT], storage &s) { impl(s).SortDescending(k, v); }
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
    const float *map;
    int64_t mb, mh, mn, md;
    int64_t H, Nqb, Nkb;
    int64_t topk_count; /* n_k, computed on the host exactly as the reference */
    double topp;
    uint8_t *dense;
    int32_t *counts, *indices;
    float *row_mass;
};

template <int THREADS, int IPT> __global__ void __launch_bounds__(THREADS) select_kernel(select_params p)
{
    using sorter = row_sort<THREADS, IPT>;
    __shared__ union {
        typename sorter::storage sort;
        double dscan[MAX_WARPS];
        int32_t iscan[MAX_WARPS];
    } tmp;
    __shared__ uint8_t keep[THREADS * IPT];
    __shared__ int32_t np_shared;

    const int64_t row = blockIdx.x, bh = row / p.Nqb, i = row % p.Nqb, b = bh / p.H, h = bh % p.H;
    const int64_t n = p.Nkb;
    const float *src = p.map + b * p.mb + h * p.mh + i * p.mn;
    uint8_t *dense = p.dense + row * n;
    int32_t *idx = p.indices + row * n;

    uint32_t keys[IPT];
    int32_t vals[IPT];
    int nan = 0;
    for (int e = 0; e < IPT; e++) {
        const int64_t j = (int64_t)threadIdx.x * IPT + e;
        const float x = j < n ? src[j * p.md] : 0.0f;
        nan |= j < n && is_nan(x);
        keys[e] = j < n ? score_key(x) : 0u; /* below every real key: padding sorts last */
        vals[e] = (int32_t)j;
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
    sorter::descending(keys, vals, tmp.sort);
    __syncthreads();

    /* After the sort, thread t holds sorted positions t*IPT .. t*IPT+IPT-1. */
    const int64_t s0 = (int64_t)threadIdx.x * IPT;
    double score[IPT], local = 0.0;
    for (int e = 0; e < IPT; e++) {
        score[e] = s0 + e < n ? (double)key_score(keys[e]) : 0.0;
        local += score[e];
    }
    if (threadIdx.x == 0)
        np_shared = (int32_t)n; /* total below p after rounding: keep the whole row */
    double total;
    double cum = block_exclusive_scan<double>(local, &total, tmp.dscan);
    if (p.topp > 0.0)
        for (int e = 0; e < IPT; e++) {
            cum += score[e];
            if (s0 + e < n && cum >= p.topp) {
                atomicMin(&np_shared, (int32_t)(s0 + e + 1));
                break;
            }
        }
    __syncthreads();
    int64_t kept = p.topp > 0.0 ? np_shared : 0;
    kept = kept > p.topk_count ? kept : p.topk_count;
    kept = kept < 1 ? 1 : kept;

    double mass = 0.0;
    for (int e = 0; e < IPT; e++) {
        const bool k = s0 + e < kept;
        mass += k ? score[e] : 0.0;
        if (s0 + e < n)
            keep[vals[e]] = k;
    }
    double kept_mass;
    block_exclusive_scan<double>(mass, &kept_mass, tmp.dscan);
    for (int64_t j = threadIdx.x; j < n; j += THREADS)
        dense[j] = keep[j];
    write_csr_row([&](int64_t j) { return keep[j] != 0; }, n, idx, tmp.iscan);
    if (threadIdx.x == 0) {
        p.counts[row] = (int32_t)kept;
        p.row_mass[row] = (float)kept_mass;
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

constexpr int T_COLS = 32, T_THREADS = 256;

/* Per (b,h,j) the ascending query blocks i that keep j. A block owns 32 columns
 * and walks the rows a warp-height at a time through shared memory; each warp
 * compacts its columns with a ballot. */
__global__ void __launch_bounds__(T_THREADS) transpose_kernel(sparge_mask_view m)
{
    constexpr int W = SPARGE_WARP_SIZE, WARPS = T_THREADS / W, COLS_PER_WARP = T_COLS / WARPS;
    __shared__ uint8_t tile[W][T_COLS];
    const int64_t col_tiles = (m.Nkb + T_COLS - 1) / T_COLS, bh = blockIdx.x / col_tiles;
    const int64_t j0 = blockIdx.x % col_tiles * T_COLS;
    const uint8_t *dense = m.dense + bh * m.Nqb * m.Nkb;
    const int lane = threadIdx.x % W, warp = threadIdx.x / W;
    int32_t count[COLS_PER_WARP] = {};
    for (int64_t i0 = 0; i0 < m.Nqb; i0 += W) {
        for (int e = threadIdx.x; e < W * T_COLS; e += T_THREADS) {
            const int r = e / T_COLS, c = e % T_COLS;
            tile[r][c] = i0 + r < m.Nqb && j0 + c < m.Nkb ? dense[(i0 + r) * m.Nkb + j0 + c] : 0;
        }
        __syncthreads();
        for (int cc = 0; cc < COLS_PER_WARP; cc++) {
            const int64_t j = j0 + warp * COLS_PER_WARP + cc;
            const int f = tile[lane][warp * COLS_PER_WARP + cc] != 0;
            const unsigned long long bits = sparge_ballot(f);
            if (j < m.Nkb && f)
                m.t_indices[(bh * m.Nkb + j) * m.Nqb + count[cc] + __popcll(bits & ((1ull << lane) - 1))] =
                    (int32_t)(i0 + lane);
            count[cc] += __popcll(bits);
        }
        __syncthreads();
    }
    for (int cc = 0; cc < COLS_PER_WARP; cc++) {
        const int64_t j = j0 + warp * COLS_PER_WARP + cc;
        if (j >= m.Nkb)
            continue;
        int32_t *t = m.t_indices + (bh * m.Nkb + j) * m.Nqb;
        for (int64_t i = count[cc] + lane; i < m.Nqb; i += W)
            t[i] = -1;
        if (lane == 0)
            m.t_counts[bh * m.Nkb + j] = count[cc];
    }
}

sparge_status build_transpose(gpu_ctx *ctx, const sparge_mask_view *m)
{
    const int64_t blocks = m->B * m->H * ((m->Nkb + T_COLS - 1) / T_COLS);
    if (blocks > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask transpose: %lld column tiles exceed the grid limit %d",
                           (long long)blocks, INT32_MAX);
    transpose_kernel<<<(unsigned)blocks, T_THREADS, 0, ctx->stream>>>(*m);
    return GPU_CHECK_LAUNCH("mask transpose kernel");
}

template <int THREADS, int IPT> sparge_status launch_select(gpu_ctx *ctx, const select_params &p, int64_t rows)
{
    select_kernel<THREADS, IPT><<<(unsigned)rows, THREADS, 0, ctx->stream>>>(p);
    return GPU_CHECK_LAUNCH("mask selection kernel");
}

/* Widest row the block sort holds. */
constexpr int64_t SELECT_MAX_ROW = 512 * 16;

} // namespace

sparge_status SPARGE_GPU_FN(pooled_map)(gpu_ctx *ctx, const sparge_map_args *a)
{
    const sparge_view &q = a->qbar, &k = a->kbar, &m = a->map;
    const int64_t bh = q.B * q.H, tiles = bh * ((q.N + MAP_TILE - 1) / MAP_TILE) * ((k.N + MAP_TILE - 1) / MAP_TILE);
    if (tiles > INT32_MAX || bh * q.N > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "pooled map: %lld tiles of 64x64 exceed the grid limit %d",
                           (long long)tiles, INT32_MAX);
    map_params p = {(const float *)q.data, (const float *)k.data, q.sb, q.sh, q.sn, q.sd, k.sb, k.sh, k.sn, k.sd,
                    (float *)m.data, m.sb, m.sh, m.sn, m.sd, q.H, q.N, k.N, q.D, a->scale};
    map_logits_kernel<<<(unsigned)tiles, MAP_THREADS, 0, ctx->stream>>>(p);
    sparge_status s = GPU_CHECK_LAUNCH("pooled map kernel");
    if (s)
        return s;
    const int64_t rows = bh * q.N, per_block = 256 / SPARGE_WARP_SIZE;
    map_softmax_kernel<<<(unsigned)((rows + per_block - 1) / per_block), 256, 0, ctx->stream>>>(p, rows);
    return GPU_CHECK_LAUNCH("pooled map softmax kernel");
}

sparge_status SPARGE_GPU_FN(mask_select)(gpu_ctx *ctx, const sparge_select_args *a)
{
    const sparge_mask_view *m = &a->mask;
    const int64_t n = m->Nkb, rows = m->B * m->H * m->Nqb;
    if (n > SELECT_MAX_ROW)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                           "mask selection: rows of %lld key blocks exceed the GPU block sort's limit of %lld "
                           "(raise block_k or select on the CPU)",
                           (long long)n, (long long)SELECT_MAX_ROW);
    if (rows > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask selection: B*H*Nqb = %lld exceeds the grid limit",
                           (long long)rows);
    /* n_k exactly as backends/cpu/select.c computes it. */
    int64_t nk = 0;
    if (a->topk > 0.0) {
        nk = (int64_t)floor(a->topk * (double)n + 1e-6);
        nk = nk < 1 ? 1 : nk > n ? n : nk;
    }
    const sparge_view &mv = a->map;
    select_params p = {(const float *)mv.data, mv.sb, mv.sh, mv.sn, mv.sd, m->H, m->Nqb, n, nk, a->topp,
                       m->dense, m->counts, m->indices, m->row_mass};
    sparge_status s;
    if (n <= 256)
        s = launch_select<64, 4>(ctx, p, rows);
    else if (n <= 512)
        s = launch_select<128, 4>(ctx, p, rows);
    else if (n <= 1024)
        s = launch_select<128, 8>(ctx, p, rows);
    else if (n <= 2048)
        s = launch_select<256, 8>(ctx, p, rows);
    else if (n <= 4096)
        s = launch_select<256, 16>(ctx, p, rows);
    else
        s = launch_select<512, 16>(ctx, p, rows);
    return s ? s : build_transpose(ctx, m);
}

sparge_status SPARGE_GPU_FN(mask_from_dense)(gpu_ctx *ctx, const sparge_mask_view *m)
{
    const int64_t rows = m->B * m->H * m->Nqb;
    if (rows > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask import: B*H*Nqb = %lld exceeds the grid limit",
                           (long long)rows);
    csr_from_dense_kernel<<<(unsigned)rows, CSR_THREADS, 0, ctx->stream>>>(*m);
    sparge_status s = GPU_CHECK_LAUNCH("mask CSR kernel");
    return s ? s : build_transpose(ctx, m);
}
