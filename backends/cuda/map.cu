/* The pooled map on the GPU: the logits scale·Q̄K̄ᵀ (fp32 FMA tiles, or the tensor cores at fp32's precision)
 * and the row softmax. Everything is queued on the context's stream; nothing here waits for the device. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gpu.h"

namespace {

constexpr int MAP_TILE = 64, MAP_DCHUNK = 16, MAP_THREADS = 128;
constexpr int TC_MAX_D = 128; /* the tensor-core logits (below): larger D takes the fp32 tiles */

struct map_params {
    const float *q, *k;
    int64_t qb, qh, qn, qd, kb, kh, kn, kd;
    float *map;
    int64_t mb, mh, mn, md;
    int64_t H, Nqb, Nkb, D;
    float scale;
    int64_t group;  /* query heads per pooled K head */
    gpu_layout L;   /* the softmax of a causal or varlen row runs over its allowed blocks (L.plain: every block) */
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
    const float *k_mine = p.k + b * p.kb + h / p.group * p.kh + (j0 + r_mine) * p.kn + dd_mine * p.kd;
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
    const float *ksrc = p.k + b * p.kb + h / p.group * p.kh + (j0 + 16 * w) * p.kn + 4 * lane;
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

/* Row softmax in place, one warp per row; a row holding NaN becomes all NaN. With a layout, over each row's allowed
 * blocks, and 0 past them (every entry of a row past its sequence). */
__global__ void map_softmax_kernel(map_params p, int64_t rows)
{
    gpu_wait_for_previous_kernel();
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / SPARGE_WARP_SIZE) + threadIdx.x / SPARGE_WARP_SIZE;
    if (row >= rows)
        return;
    const int lane = threadIdx.x % SPARGE_WARP_SIZE;
    const int64_t bh = row / p.Nqb, i = row % p.Nqb, b = bh / p.H, h = bh % p.H;
    float *m = p.map + b * p.mb + h * p.mh + i * p.mn;
    int64_t n = p.Nkb, d0, d1;
    if (!p.L.plain && !gpu_layout_row(p.L, row, &n, &d0, &d1))
        n = 0;
    for (int64_t j = n + lane; j < p.Nkb; j += SPARGE_WARP_SIZE)
        m[j * p.md] = 0.0f;
    if (n == 0)
        return;
    float mx = -INFINITY;
    int nan = 0;
    for (int64_t j = lane; j < n; j += SPARGE_WARP_SIZE) {
        const float x = m[j * p.md];
        nan |= is_nan(x);
        mx = fmaxf(mx, x);
    }
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1) {
        mx = fmaxf(mx, sparge_shfl_xor(mx, o));
        nan |= sparge_shfl_xor(nan, o);
    }
    float sum = 0.0f;
    for (int64_t j = lane; j < n; j += SPARGE_WARP_SIZE)
        sum += expf(m[j * p.md] - mx);
    for (int o = SPARGE_WARP_SIZE / 2; o > 0; o >>= 1)
        sum += sparge_shfl_xor(sum, o);
    const float inv = 1.0f / sum;
    for (int64_t j = lane; j < n; j += SPARGE_WARP_SIZE)
        m[j * p.md] = nan ? NAN : expf(m[j * p.md] - mx) * inv;
    gpu_allow_next_kernel();
}

/* ---------------------------------------------------------------- launch */

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

/* The map_tile option's forced kernel can run these logits. */
sparge_status check_forced_tile(const gpu_ctx *ctx, bool tensor_cores_ok)
{
    if (ctx->opt.map_tile == GPU_MAP_F16X3 && !tensor_cores_ok)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                           "pooled map: map_tile=f16x3 needs the \"cuda\" tier on sm_80+, D a multiple of 4 up to %d "
                           "and pooled rows contiguous and 16-byte aligned; set map_tile=auto for the fp32 tiles",
                           TC_MAX_D);
    return SPARGE_OK;
}

/* Grid limits, checked before anything is queued. */
sparge_status check_grid(const sparge_map_args *a)
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
    gpu_layout L = {};
    L.plain = 1;
    if (a->layout)
        L = gpu_layout_of(a->layout);
    return map_params{(const float *)q.data, (const float *)k.data, q.sb, q.sh, q.sn, q.sd, k.sb, k.sh, k.sn, k.sd,
                      (float *)m.data, m.sb, m.sh, m.sn, m.sd, q.H, q.N, k.N, q.D, a->scale, q.H / k.H, L};
}

/* The logits scale·qbar kbarᵀ into a->map : on the tensor cores where tc_map_ok (at Wan2.1-1.3B
 * on the H200 the fp32 tiles below took 16.4-17.1 µs, issue-bound with 9.3 M instructions); otherwise in fp32 FMAs, each
 * output one fmaf chain over d in order whatever the tile: 128×64 tiles (8×8 outputs per thread: twice the FMAs
 * per shared-memory read) once they fill the device several times over, as at Wan2.1-14B (3800 tiles); 64×64
 * tiles (4×8 per thread) otherwise (on the H200 fewer outputs per thread in 64×32 tiles, twice the blocks, took
 * 19.7 against 17 µs, and 8×8 per thread in 64×64 tiles of 64 threads 20.4 µs). The map_tile option forces one. */
sparge_status launch_logits(gpu_ctx *ctx, const sparge_map_args *a)
{
    const sparge_view &q = a->qbar, &k = a->kbar;
    auto tiles = [&](int64_t tq) { return q.B * q.H * ((q.N + tq - 1) / tq) * ((k.N + MAP_TILE - 1) / MAP_TILE); };
    const int forced = ctx->opt.map_tile;
#ifndef SPARGE_USE_HIP
    if (forced == GPU_MAP_F16X3 || (forced == GPU_MAP_AUTO && tc_map_ok(ctx, a)))
        return gpu_launch_after(ctx, q.D <= 64 ? map_logits_tc_kernel<4> : map_logits_tc_kernel<TC_MAX_D / 16>,
                                (unsigned)tiles(TC_TILE), TC_THREADS, 0, "pooled map kernel", make_map_params(a));
#endif
    if (forced == GPU_MAP_128X64 || (forced == GPU_MAP_AUTO && tiles(128) >= 1024))
        return gpu_launch_after(ctx, map_logits_kernel<8>, (unsigned)tiles(128), MAP_THREADS, 0, "pooled map kernel",
                                make_map_params(a));
    return gpu_launch_after(ctx, map_logits_kernel<4>, (unsigned)tiles(64), MAP_THREADS, 0, "pooled map kernel",
                            make_map_params(a));
}

} // namespace

sparge_status SPARGE_GPU_FN(map_fits)(const gpu_ctx *ctx, const sparge_op_desc *d, bool tensor_tier)
{
#ifdef SPARGE_USE_HIP
    (void)d, (void)tensor_tier;
    return check_forced_tile(ctx, false);
#else
    return check_forced_tile(ctx, tensor_tier && !ctx->generic && ctx->cc_major >= 8 && d->head_dim % 4 == 0 &&
                                      d->head_dim <= TC_MAX_D && (d->op != SPARGE_OP_POOLED_MAP || d->rows_aligned));
#endif
}

sparge_status SPARGE_GPU_FN(map_logits)(gpu_ctx *ctx, const sparge_map_args *a)
{
    sparge_status s = check_grid(a);
    return s ? s : launch_logits(ctx, a);
}

sparge_status SPARGE_GPU_FN(map_softmax)(gpu_ctx *ctx, const sparge_map_args *a)
{
    const int64_t rows = a->qbar.B * a->qbar.H * a->qbar.N, per_block = 256 / SPARGE_WARP_SIZE;
    return gpu_launch_after(ctx, map_softmax_kernel, (unsigned)((rows + per_block - 1) / per_block), 256, 0,
                            "pooled map softmax kernel", make_map_params(a), rows);
}

sparge_status SPARGE_GPU_FN(pooled_map)(gpu_ctx *ctx, const sparge_map_args *a)
{
    sparge_status s;
    if ((s = check_grid(a)) || (s = launch_logits(ctx, a)))
        return s;
    return SPARGE_GPU_FN(map_softmax)(ctx, a);
}
