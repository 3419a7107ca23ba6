/* Mask prediction on the GPU: pooled map, per-row hybrid selection, CSR
 * bookkeeping, and the transpose, which the core asks for separately when it is
 * first needed. Everything is queued on the context's stream; nothing here waits
 * for the device.
 *
 * Selection follows DESIGN.md §1 and backends/cpu/select.c exactly: a row is
 * sorted by descending score with ties to the lower block index (a stable
 * block radix sort of order-preserving 32-bit keys over the indices in
 * ascending order), Top-p accumulates the sorted prefix in fp64, and the kept
 * set is the first max(n_k, n_p, 1) blocks; a row holding NaN keeps all. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

#ifdef SPARGE_USE_HIP
#include <rocprim/rocprim.hpp>
#else
#include <cub/block/block_radix_sort.cuh>
#endif

namespace {

/* ---------------------------------------------------------------- block helpers */

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

constexpr int MAP_TILE = 64, MAP_DCHUNK = 16, MAP_THREADS = 128;
constexpr int TC_MAX_D = 128; /* the tensor-core logits (below): larger D takes the fp32 tiles */

struct map_params {
    const float *q, *k;
    int64_t qb, qh, qn, qd, kb, kh, kn, kd;
    float *map;
    int64_t mb, mh, mn, md;
    int64_t H, Nqb, Nkb, D;
    float scale;
};

/* Logits map = scale · qbar kbarᵀ, a (16·TQ)×64 tile per block. Thread (ty,tx)
 * of the 16×8 grid owns the TQ rows ty·4 + 64g + r and the 8 columns
 * tx·4 + 32h + s: per d it reads TQ/4 + 2 float4 (a warp's reads are
 * broadcasts or one contiguous 128 bytes) for 8·TQ FMAs. Each output is one
 * fmaf chain over d = 0, 1, ... in order, so every tile shape gives the same
 * bits. The D chunks are double-buffered: one barrier per chunk. */
template <int TQ>
__global__ void __launch_bounds__(MAP_THREADS, TQ > 4 ? 3 : 4) map_logits_kernel(map_params p)
{
    gpu_wait_for_previous_kernel();
    constexpr int TILE_Q = 16 * TQ, TILE_K = MAP_TILE, TK = 8;
    constexpr int ROW_STEP = MAP_THREADS / MAP_DCHUNK, LOADS_Q = TILE_Q / ROW_STEP, LOADS_K = TILE_K / ROW_STEP;
    static_assert(TQ % 4 == 0 && MAP_THREADS == 16 * 8, "the thread grid is 16 x 8, float4 per group");
    __shared__ __align__(16) float qs[2][MAP_DCHUNK][TILE_Q + 4];
    __shared__ __align__(16) float ks[2][MAP_DCHUNK][TILE_K + 4];
    const int64_t ktiles = (p.Nkb + TILE_K - 1) / TILE_K, qtiles = (p.Nqb + TILE_Q - 1) / TILE_Q;
    const int64_t tile = blockIdx.x, bh = tile / (qtiles * ktiles), b = bh / p.H, h = bh % p.H;
    const int64_t i0 = tile / ktiles % qtiles * TILE_Q, j0 = tile % ktiles * TILE_K;
    const int q_rows = (int)(p.Nqb - i0 < TILE_Q ? p.Nqb - i0 : TILE_Q);
    const int k_rows = (int)(p.Nkb - j0 < TILE_K ? p.Nkb - j0 : TILE_K);
    const int ty = threadIdx.x / 8, tx = threadIdx.x % 8;
    /* Thread t loads column dd = t % 16 of rows t / 16 + 8u; the next D chunk
     * is fetched into registers while this one is multiplied. */
    const int dd_mine = threadIdx.x % MAP_DCHUNK, r_mine = threadIdx.x / MAP_DCHUNK;
    const float *q_mine = p.q + b * p.qb + h * p.qh + (i0 + r_mine) * p.qn + dd_mine * p.qd;
    const float *k_mine = p.k + b * p.kb + h * p.kh + (j0 + r_mine) * p.kn + dd_mine * p.kd;
    const int64_t q_step = ROW_STEP * p.qn, k_step = ROW_STEP * p.kn;
    float q_next[LOADS_Q], k_next[LOADS_K];
    auto fetch = [&](int64_t d0) {
        const bool d_ok = d0 + dd_mine < p.D;
        const float *qa = q_mine + d0 * p.qd, *ka = k_mine + d0 * p.kd;
#pragma unroll
        for (int u = 0; u < LOADS_Q; u++, qa += q_step) /* a pointer step per load, not a product */
            q_next[u] = d_ok && r_mine + u * ROW_STEP < q_rows ? *qa : 0.0f;
#pragma unroll
        for (int u = 0; u < LOADS_K; u++, ka += k_step)
            k_next[u] = d_ok && r_mine + u * ROW_STEP < k_rows ? *ka : 0.0f;
    };
    float acc[TQ][TK] = {};
    fetch(0);
    int buf = 0;
    for (int64_t d0 = 0; d0 < p.D; d0 += MAP_DCHUNK, buf ^= 1) {
#pragma unroll
        for (int u = 0; u < LOADS_Q; u++)
            qs[buf][dd_mine][r_mine + u * ROW_STEP] = q_next[u];
#pragma unroll
        for (int u = 0; u < LOADS_K; u++)
            ks[buf][dd_mine][r_mine + u * ROW_STEP] = k_next[u];
        /* The other buffer was last read before this barrier's previous use. */
        __syncthreads();
        if (d0 + MAP_DCHUNK < p.D)
            fetch(d0 + MAP_DCHUNK);
        const float *qc = &qs[buf][0][ty * 4], *kc = &ks[buf][0][tx * 4];
#pragma unroll
        for (int dd = 0; dd < MAP_DCHUNK; dd++) {
            float a[TQ], c[TK];
#pragma unroll
            for (int g = 0; g < TQ / 4; g++) {
                const float4 v = *(const float4 *)&qc[dd * (TILE_Q + 4) + g * 64];
                a[4 * g] = v.x, a[4 * g + 1] = v.y, a[4 * g + 2] = v.z, a[4 * g + 3] = v.w;
            }
#pragma unroll
            for (int g = 0; g < TK / 4; g++) {
                const float4 v = *(const float4 *)&kc[dd * (TILE_K + 4) + g * 32];
                c[4 * g] = v.x, c[4 * g + 1] = v.y, c[4 * g + 2] = v.z, c[4 * g + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < TQ; r++)
#pragma unroll
                for (int s = 0; s < TK; s++)
                    acc[r][s] = fmaf(a[r], c[s], acc[r][s]);
        }
    }
    /* Four consecutive columns as one float4 where the map's rows allow it. */
    float *m = p.map + b * p.mb + h * p.mh;
    const bool vec = p.md == 1 && p.mn % 4 == 0 && ((uintptr_t)m & 15u) == 0;
#pragma unroll
    for (int r = 0; r < TQ; r++) {
        const int64_t i = i0 + r / 4 * 64 + ty * 4 + r % 4;
        if (i >= p.Nqb)
            continue;
#pragma unroll
        for (int g = 0; g < TK / 4; g++) {
            const int64_t j = j0 + g * 32 + tx * 4;
            float *out = m + i * p.mn + j * p.md;
            const float *x = &acc[r][4 * g];
            if (vec && j + 3 < p.Nkb)
                *(float4 *)out = make_float4(x[0] * p.scale, x[1] * p.scale, x[2] * p.scale, x[3] * p.scale);
            else
                for (int s = 0; s < 4; s++)
                    if (j + s < p.Nkb)
                        out[s * p.md] = x[s] * p.scale;
        }
    }
    gpu_allow_next_kernel();
}

#ifndef SPARGE_USE_HIP
/* ---------------------------------------------------------------- pooled map on the tensor cores */

/* The logits on the tensor cores (sm_80+, mma.sync m16n8k16 fp16, fp32 accumulation) at fp32's precision: each
 * pooled row of Q̄ and of K̄ is scaled by a power of two that takes its largest magnitude into [2^14, 2^15), and
 * each scaled value x splits into fp16 hi = fp16(x) and lo = fp16(x - hi), 22 significant bits together. Each
 * logit sums hi·hi + hi·lo + lo·hi (the dropped lo·lo is below 2^-22 of each product; values 2^-17 below their
 * row's largest lose lo's low bits to fp16's subnormals, which is below 2^-38 of the largest product), and the
 * powers of two come off exactly after the sum. This is the 3xTF32 scheme on fp16 operands: the same 22-bit
 * products in half the tensor-core work, since an m16n8k16 fp16 mma costs what an m16n8k8 TF32 one does. One
 * TF32 or fp16 product alone would move the scores by ~1e-3 and flip mask decisions.
 *
 * Tile 64×64, D <= 16·NCH: warp w owns rows 16w..16w+15 and all 64 columns (eight n8 tiles); lane (g, t) holds
 * d = 16c+4t..16c+4t+3 of its two rows for every 16-d chunk c, as k positions 2t, 2t+1, 2t+8, 2t+9 (the key
 * fragments use the same order: the sum over d is the same in any order). Every load of the tile is issued at
 * once, so the kernel waits on memory once, not once per chunk; the key tile is split once per block into shared
 * memory. On the H200 (ncu) it takes 11.2 µs at Wan2.1-1.3B and 164 µs at 14B, against 14.1 and 211 for the 3xTF32
 * kernel it replaced, which held L1 at 76 % of its throughput; the same fp16 scheme with a thread per key column
 * (each load 32 scattered 16-byte pieces) issued twice the L1 wavefronts and took 14.9 µs. */
constexpr int TC_TILE = 64, TC_THREADS = 128, TC_N8 = TC_TILE / 8;
static_assert(TC_TILE == MAP_TILE, "launch_logits counts the key tiles in MAP_TILE");
static_assert(TC_THREADS / 32 * 16 == TC_TILE, "each warp stages 16 key columns");

/* The exponent s for which 2^s takes the largest magnitude, bits m (sign cleared), into [2^14, 2^15); 0 for zero
 * or a non-finite largest value (fp16 then carries the infinity or the NaN into the logits). */
__device__ __forceinline__ int f16_shift(uint32_t m)
{
    if (m == 0u || m >= 0x7f800000u)
        return 0;
    return min(141 - (int)(m >> 23), 126);
}
__device__ __forceinline__ float pow2(int s) { return __int_as_float((s + 127) << 23); } /* |s| <= 126 */

__device__ __forceinline__ uint32_t abs_max_bits(uint32_t m, float4 v)
{
    return max(max(m, max(__float_as_uint(v.x) & 0x7fffffffu, __float_as_uint(v.y) & 0x7fffffffu)),
               max(__float_as_uint(v.z) & 0x7fffffffu, __float_as_uint(v.w) & 0x7fffffffu));
}

__device__ __forceinline__ float4 scaled(float4 v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }

/* hi and lo of two scaled values, as fp16 pairs. */
__device__ __forceinline__ void f16_split(float a, float b, uint32_t &hi, uint32_t &lo)
{
    const __half2 h = __floats2half2_rn(a, b);
    const float2 hf = __half22float2(h);
    const __half2 l = __floats2half2_rn(a - hf.x, b - hf.y);
    hi = *(const uint32_t *)&h;
    lo = *(const uint32_t *)&l;
}

__device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], const uint32_t b[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Needs sd = 1, 16-byte aligned rows and D <= 16·NCH (tc_map_ok). Three blocks share an SM: Wan2.1-1.3B's 384
 * tiles in one wave on the H200. */
template <int NCH> __global__ void __launch_bounds__(TC_THREADS, 3) map_logits_tc_kernel(map_params p)
{
    /* [column][chunk c ^ (column % NCH)][t]: hi and lo of d = 16c+4t..16c+4t+3 as two fp16 pairs. The swizzle
     * spreads both the staging writes (one column per warp) and the fragment reads (eight columns, one chunk) over
     * the banks: two wavefronts for each warp's 256 bytes. */
    __shared__ uint2 khi[TC_TILE][NCH][4], klo[TC_TILE][NCH][4];
    __shared__ int kshift[TC_TILE];
    gpu_wait_for_previous_kernel();
    const int64_t ktiles = (p.Nkb + TC_TILE - 1) / TC_TILE, qtiles = (p.Nqb + TC_TILE - 1) / TC_TILE;
    const int64_t tile = blockIdx.x, bh = tile / (qtiles * ktiles), b = bh / p.H, h = bh % p.H;
    const int64_t i0 = tile / ktiles % qtiles * TC_TILE, j0 = tile % ktiles * TC_TILE;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int64_t row0 = i0 + threadIdx.x / 32 * 16 + g;
    /* Staging: warp w holds key columns 16w..16w+15, a whole pooled row per load (lane l: d = 4l..4l+3, chunk
     * l/4), so that each load is one contiguous 512-byte row; per-thread columns took 8 times the L1 wavefronts. */
    const int kc = lane / 4, w = threadIdx.x / 32;
    const float *ksrc = p.k + b * p.kb + h * p.kh + (j0 + 16 * w) * p.kn + 4 * lane;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 kv[16], qv[2][NCH];
#pragma unroll
    for (int u = 0; u < 16; u++)
        kv[u] = j0 + 16 * w + u < p.Nkb && 4 * lane < p.D ? *(const float4 *)(ksrc + u * p.kn) : zero;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool ok = row0 + 8 * r < p.Nqb;
        const float *qsrc = p.q + b * p.qb + h * p.qh + (row0 + 8 * r) * p.qn + 4 * t;
#pragma unroll
        for (int c = 0; c < NCH; c++)
            qv[r][c] = ok && 16 * c + 4 * t < p.D ? *(const float4 *)(qsrc + 16 * c) : zero;
    }

#pragma unroll
    for (int u = 0; u < 16; u++) {
        const int col = 16 * w + u, ks = f16_shift(__reduce_max_sync(SPARGE_FULL_MASK, abs_max_bits(0u, kv[u])));
        const float4 x = scaled(kv[u], pow2(ks));
        uint2 hi, lo;
        f16_split(x.x, x.y, hi.x, lo.x);
        f16_split(x.z, x.w, hi.y, lo.y);
        if (kc < NCH) {
            khi[col][kc ^ (col & (NCH - 1))][t] = hi;
            klo[col][kc ^ (col & (NCH - 1))][t] = lo;
        }
        if (lane == 0)
            kshift[col] = ks;
    }
    int qs[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        uint32_t mq = 0u;
#pragma unroll
        for (int c = 0; c < NCH; c++)
            mq = abs_max_bits(mq, qv[r][c]);
        mq = max(mq, __shfl_xor_sync(SPARGE_FULL_MASK, mq, 1));
        qs[r] = f16_shift(max(mq, __shfl_xor_sync(SPARGE_FULL_MASK, mq, 2)));
    }
    const float qscale[2] = {pow2(qs[0]), pow2(qs[1])};
    __syncthreads();

    float acc[TC_N8][4] = {};
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        const float4 q0 = scaled(qv[0][c], qscale[0]), q1 = scaled(qv[1][c], qscale[1]);
        uint32_t ah[4], al[4];
        f16_split(q0.x, q0.y, ah[0], al[0]);
        f16_split(q1.x, q1.y, ah[1], al[1]);
        f16_split(q0.z, q0.w, ah[2], al[2]);
        f16_split(q1.z, q1.w, ah[3], al[3]);
#pragma unroll
        for (int n = 0; n < TC_N8; n++) {
            const uint2 bh = khi[8 * n + g][c ^ (g & (NCH - 1))][t], bl = klo[8 * n + g][c ^ (g & (NCH - 1))][t];
            const uint32_t bhi[2] = {bh.x, bh.y}, blo[2] = {bl.x, bl.y};
            mma_f16(acc[n], al, bhi);
            mma_f16(acc[n], ah, blo);
            mma_f16(acc[n], ah, bhi);
        }
    }
    /* Lane (g, t) holds columns 8n+2t and 8n+2t+1 of rows row0 (c0, c1) and row0 + 8 (c2, c3). The scale first:
     * the powers of two are then exact unless the logit itself overflows or is subnormal. */
    float *mp = p.map + b * p.mb + h * p.mh;
    const bool pair = p.md == 1 && p.mn % 2 == 0 && ((uintptr_t)mp & 7u) == 0;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t i = row0 + 8 * r;
        if (i >= p.Nqb)
            continue;
        float *out = mp + i * p.mn;
        const float qu = pow2(-qs[r]);
#pragma unroll
        for (int n = 0; n < TC_N8; n++) {
            const int jj = 8 * n + 2 * t;
            const int64_t j = j0 + jj;
            const float x0 = acc[n][2 * r] * p.scale * qu * pow2(-kshift[jj]);
            const float x1 = acc[n][2 * r + 1] * p.scale * qu * pow2(-kshift[jj + 1]);
            if (pair && j + 1 < p.Nkb)
                *(float2 *)(out + j) = make_float2(x0, x1);
            else {
                if (j < p.Nkb)
                    out[j * p.md] = x0;
                if (j + 1 < p.Nkb)
                    out[(j + 1) * p.md] = x1;
            }
        }
    }
    gpu_allow_next_kernel();
}
#endif

/* Row softmax in place, one warp per row; a row holding NaN becomes all NaN. */
__global__ void map_softmax_kernel(map_params p, int64_t rows)
{
    gpu_wait_for_previous_kernel();
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
    gpu_allow_next_kernel();
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
};

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
 * 512), so no register slot needs a bounds check. */
template <int CAP, bool FULL> __device__ void fast_select_row(const select_params &p, int64_t row, int32_t *list)
{
    constexpr int IPT = CAP / SPARGE_WARP_SIZE;
    const int lane = threadIdx.x % SPARGE_WARP_SIZE, n = FULL ? CAP : (int)p.Nkb; /* n <= FAST_MAX_ROW */
    /* 32-bit decode (check_select: rows <= INT32_MAX): a 64-bit division by a run-time value is a long software
     * sequence. */
    const uint32_t r = (uint32_t)row, bh = r / (uint32_t)p.Nqb, i = r - bh * (uint32_t)p.Nqb, b = bh / (uint32_t)p.H,
                   h = bh - b * (uint32_t)p.H;
    float *src = p.map + b * p.mb + h * p.mh + i * p.mn;
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
    uint8_t *dense = p.dense + row * n;
    int32_t *idx = p.indices + row * n;
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

    const int least = p.topk_count > 1 ? (int)p.topk_count : 1; /* <= n */
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
    if (lane == 0) {
        p.counts[row] = kept;
        p.row_mass[row] = (float)mass;
    }
    gpu_allow_next_kernel();
}

/* Up to 512 key blocks: at most 80 registers, so that 6 CTAs share an SM and Wan2.1-1.3B's 3072 rows run in
 * one wave (93 registers gave 1.16 waves: 20.1 against 24.4 µs on the H200, at an 8-byte spill). */
template <int CAP, bool FULL>
__global__ void __launch_bounds__(FAST_THREADS, CAP <= 512 ? 6 : 1) fast_select_kernel(select_params p, int64_t rows)
{
    constexpr int warps = FAST_THREADS / SPARGE_WARP_SIZE;
    __shared__ int32_t lists[warps][SPARGE_WARP_SIZE];
    gpu_wait_for_previous_kernel();
    for (int r = threadIdx.x / SPARGE_WARP_SIZE; r < FAST_ROWS; r += warps) {
        const int64_t row = (int64_t)blockIdx.x * FAST_ROWS + r;
        if (row < rows)
            fast_select_row<CAP, FULL>(p, row, lists[threadIdx.x / SPARGE_WARP_SIZE]);
    }
}

/* ---------------------------------------------------------------- CSR and transpose */

constexpr int CSR_THREADS = 128;

__global__ void __launch_bounds__(CSR_THREADS) csr_from_dense_kernel(sparge_mask_view m)
{
    __shared__ int32_t scratch[GPU_MAX_WARPS];
    const int64_t row = blockIdx.x;
    const uint8_t *dense = m.dense + row * m.Nkb;
    const int32_t c = write_csr_row([&](int64_t j) { return dense[j] != 0; }, m.Nkb, m.indices + row * m.Nkb, scratch);
    if (threadIdx.x == 0)
        m.counts[row] = c;
    gpu_allow_next_kernel();
}

/* 32 columns per block whatever the warp size: HIP's host pass sees a warp of
 * 64 also when the device runs wave32. */
constexpr int T_THREADS = 256, T_COLS = 32;

/* Per (b,h,j) the ascending query blocks i that keep j. A block owns T_COLS
 * columns and walks the rows a block-width at a time, a warp's width of rows
 * per warp: lane c reads column c of each of its warp's rows (one coalesced
 * load per row, all in flight) into a bit per row; the per-column counts are
 * scanned across warps and carried across chunks; then lane c stores its
 * column's kept rows itself, one store per set bit: a short loop at the
 * usual sparsities, with no shuffle or shared-memory read per column. */
__global__ void __launch_bounds__(T_THREADS) transpose_kernel(sparge_mask_view m)
{
    gpu_wait_for_previous_kernel();
    constexpr int W = SPARGE_WARP_SIZE, WARPS = T_THREADS / W;
    __shared__ int32_t offset[WARPS][T_COLS]; /* this chunk: kept rows of column c in the earlier warps, plus running */
    __shared__ int32_t running[T_COLS];       /* kept rows of column c in the earlier chunks */
    const int lane = threadIdx.x % W, warp = threadIdx.x / W;
    const int64_t col_tiles = (m.Nkb + T_COLS - 1) / T_COLS, bh = blockIdx.x / col_tiles;
    const int64_t j0 = blockIdx.x % col_tiles * T_COLS;
    const int cols = m.Nkb - j0 < T_COLS ? (int)(m.Nkb - j0) : T_COLS;
    const bool real = lane < cols;
    const uint8_t *column = m.dense + bh * m.Nqb * m.Nkb + j0 + lane;
    int32_t *t = m.t_indices + (bh * m.Nkb + j0) * m.Nqb;
    if (threadIdx.x < T_COLS)
        running[threadIdx.x] = 0;
    __syncthreads();
    for (int64_t r0 = 0; r0 < m.Nqb; r0 += (int64_t)WARPS * W) {
        const int64_t rw = r0 + (int64_t)warp * W; /* this warp's first row */
        uint8_t flag[W];
#pragma unroll
        for (int k = 0; k < W; k++)
            flag[k] = real && rw + k < m.Nqb ? column[(rw + k) * m.Nkb] : 0;
        unsigned long long rows = 0; /* bit k: row rw + k keeps column j0 + lane */
#pragma unroll
        for (int k = 0; k < W; k++)
            rows |= (unsigned long long)(flag[k] != 0) << k;
        if (lane < T_COLS)
            offset[warp][lane] = __popcll(rows);
        __syncthreads();
        if (threadIdx.x < T_COLS) {
            int32_t run = running[threadIdx.x];
            for (int v = 0; v < WARPS; v++) {
                const int32_t c = offset[v][threadIdx.x];
                offset[v][threadIdx.x] = run;
                run += c;
            }
            running[threadIdx.x] = run;
        }
        __syncthreads();
        if (rows) { /* only real lanes < T_COLS have bits */
            int32_t *dst = t + lane * m.Nqb + offset[warp][lane];
            for (; rows; rows &= rows - 1ull) /* lowest set bit k = popcount of the bits below it */
                *dst++ = (int32_t)(rw + __popcll((rows & (0ull - rows)) - 1ull));
        }
        __syncthreads(); /* offset and running are rewritten by the next chunk */
    }
    /* -1 past each column's count, a warp per column so the stores coalesce. */
    for (int c = warp; c < cols; c += WARPS) {
        const int32_t total = running[c];
        for (int64_t i = total + lane; i < m.Nqb; i += W)
            t[c * m.Nqb + i] = -1;
        if (lane == 0)
            m.t_counts[bh * m.Nkb + j0 + c] = total;
    }
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
                         m->dense, m->counts, m->indices, m->row_mass};
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

/* Benchmark and test hook: SPARGE_CUDA_MAP_TILE forces the logits kernel (below); -1: unset, MAP_INVALID: invalid. */
const char *const map_tile_names[] = {"128x64", "64x64", "f16x3"};
constexpr int MAP_TENSOR = 2, MAP_INVALID = sizeof map_tile_names / sizeof *map_tile_names;
int map_tile_choice(void)
{
    const char *env = getenv("SPARGE_CUDA_MAP_TILE");
    for (int i = 0; env && i < MAP_INVALID; i++)
        if (!strcmp(env, map_tile_names[i]))
            return i;
    return env ? MAP_INVALID : -1;
}

/* The tensor-core logits need the mma tier (not cuda-generic, not HIP, sm_80+), float4 rows and D <= 128 (each lane
 * holds its rows whole). */
bool tc_map_ok(const gpu_ctx *ctx, const sparge_map_args *a)
{
#ifdef SPARGE_USE_HIP
    (void)ctx, (void)a;
    return false;
#else
    auto rows16 = [](const sparge_view &v) {
        return v.sd == 1 && v.sn % 4 == 0 && v.sh % 4 == 0 && v.sb % 4 == 0 && ((uintptr_t)v.data & 15u) == 0;
    };
    return !ctx->generic && ctx->cc_major >= 8 && a->qbar.D % 4 == 0 && a->qbar.D <= TC_MAX_D && rows16(a->qbar) &&
           rows16(a->kbar);
#endif
}

sparge_status check_map(const gpu_ctx *ctx, const sparge_map_args *a)
{
    const int forced = map_tile_choice();
    if (forced == MAP_INVALID)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "pooled map: SPARGE_CUDA_MAP_TILE must be %s, %s or %s, got \"%s\"",
                           map_tile_names[0], map_tile_names[1], map_tile_names[2], getenv("SPARGE_CUDA_MAP_TILE"));
    if (forced == MAP_TENSOR && !tc_map_ok(ctx, a))
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                           "pooled map: SPARGE_CUDA_MAP_TILE=f16x3 needs the \"cuda\" backend on sm_80+, D a multiple "
                           "of 4 up to %d and pooled rows contiguous and 16-byte aligned; unset it for the fp32 tiles",
                           TC_MAX_D);
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

/* The logits scale·qbar kbarᵀ into a->map (after check_map): on the tensor cores where tc_map_ok (at Wan2.1-1.3B
 * on the H200 the fp32 tiles below took 16.4-17.1 µs, issue-bound with 9.3 M instructions); otherwise in fp32 FMAs, each
 * output one fmaf chain over d in order whatever the tile: 128×64 tiles (8×8 outputs per thread: twice the FMAs
 * per shared-memory read) once they fill the device several times over, as at Wan2.1-14B (3800 tiles); 64×64
 * tiles (4×8 per thread) otherwise (on the H200 fewer outputs per thread in 64×32 tiles, twice the blocks, took
 * 19.7 against 17 µs, and 8×8 per thread in 64×64 tiles of 64 threads 20.4 µs). SPARGE_CUDA_MAP_TILE forces one. */
sparge_status launch_logits(gpu_ctx *ctx, const sparge_map_args *a)
{
    const sparge_view &q = a->qbar, &k = a->kbar;
    auto tiles = [&](int64_t tq) { return q.B * q.H * ((q.N + tq - 1) / tq) * ((k.N + MAP_TILE - 1) / MAP_TILE); };
    const int forced = map_tile_choice();
#ifndef SPARGE_USE_HIP
    if (forced == MAP_TENSOR || (forced < 0 && tc_map_ok(ctx, a)))
        return gpu_launch_after(ctx, q.D <= 64 ? map_logits_tc_kernel<4> : map_logits_tc_kernel<TC_MAX_D / 16>,
                                (unsigned)tiles(TC_TILE), TC_THREADS, 0, "pooled map kernel", make_map_params(a));
#endif
    if (forced == 0 || (forced < 0 && tiles(128) >= 1024))
        return gpu_launch_after(ctx, map_logits_kernel<8>, (unsigned)tiles(128), MAP_THREADS, 0, "pooled map kernel",
                                make_map_params(a));
    return gpu_launch_after(ctx, map_logits_kernel<4>, (unsigned)tiles(64), MAP_THREADS, 0, "pooled map kernel",
                            make_map_params(a));
}

sparge_status launch_softmax(gpu_ctx *ctx, const sparge_map_args *a)
{
    const int64_t rows = a->qbar.B * a->qbar.H * a->qbar.N, per_block = 256 / SPARGE_WARP_SIZE;
    return gpu_launch_after(ctx, map_softmax_kernel, (unsigned)((rows + per_block - 1) / per_block), 256, 0,
                            "pooled map softmax kernel", make_map_params(a), rows);
}

/* The selection kernel for rows of n <= CAP key blocks: the copy without bounds checks when n == CAP. */
template <int CAP> auto fast_select_for(int64_t n) -> void (*)(select_params, int64_t)
{
    return n == CAP ? fast_select_kernel<CAP, true> : fast_select_kernel<CAP, false>;
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
        return launch(fast_select_for<256>(n));
    if (n <= 512)
        return launch(fast_select_for<512>(n));
    if (n <= 1024)
        return launch(fast_select_for<1024>(n));
    if (n <= 1280) /* Wan2.1-14B 720p: 1182 */
        return launch(fast_select_for<1280>(n));
    if (n <= 1536)
        return launch(fast_select_for<1536>(n));
    return launch(fast_select_for<2048>(n));
}

} // namespace

sparge_status SPARGE_GPU_FN(pooled_map)(gpu_ctx *ctx, const sparge_map_args *a)
{
    sparge_status s;
    if ((s = check_map(ctx, a)) || (s = launch_logits(ctx, a)))
        return s;
    return launch_softmax(ctx, a);
}

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
    if ((s = check_map(ctx, &a->map)) || (s = check_select(&a->mask)) || (s = SPARGE_GPU_FN(pool_pair)(ctx, &a->q, &a->k)) ||
        (s = launch_logits(ctx, &a->map)))
        return s;
    if (a->mask.Nkb <= FAST_MAX_ROW && a->map.map.sd == 1)
        return launch_fast_select(ctx, a);
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
    csr_from_dense_kernel<<<(unsigned)rows, CSR_THREADS, 0, ctx->stream>>>(*m);
    return GPU_CHECK_LAUNCH("mask CSR kernel");
}

/* The grid limit is checked before anything is queued, so a refusal writes nothing. */
sparge_status SPARGE_GPU_FN(mask_transpose)(gpu_ctx *ctx, const sparge_mask_view *m)
{
    const int64_t blocks = m->B * m->H * ((m->Nkb + T_COLS - 1) / T_COLS);
    if (blocks > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask transpose: %lld column tiles exceed the grid limit %d",
                           (long long)blocks, INT32_MAX);
    return gpu_launch_after(ctx, transpose_kernel, (unsigned)blocks, T_THREADS, 0, "mask transpose kernel", *m);
}
