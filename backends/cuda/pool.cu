/* Block mean-pooling of a strided [B,H,N,D] view into f32 [B,H,ceil(N/block),D].
 *
 * One thread block per (b, h, pooled row); Q and K may share one launch
 * (pool_pair), so the grid holds both tensors' rows. Threads split into L lanes along D
 * (each lane owns 16-byte column chunks when the rows are contiguous and
 * aligned) and R row groups; the R partial sums meet in shared memory. Each
 * input row is read once with full 16-byte accesses, in BHND and BNHD alike,
 * which keeps the kernel at memory bandwidth. */
#include <stdint.h>

#include "gpu.h"

namespace {

constexpr int POOL_THREADS = 256;

/* One tensor to pool. */
struct pool_job {
    const void *x;
    int64_t sb, sh, sn, sd; /* input strides (elements) */
    int64_t H, N, D, Nb;
    float *out;
    int64_t ob, oh, on, od; /* output strides (elements) */
    int block;
    int lanes; /* threads per row: L */
    int vec;   /* 16-byte loads */
    int64_t rows; /* B*H*Nb: thread blocks of this job */
};

/* Q and K in one grid: the first a.rows blocks pool a, the rest b. */
struct pool_pair_params {
    pool_job a, b;
};

template <typename T, bool VEC> __device__ __forceinline__ void pool_row(const pool_job &p, int64_t row, float *partial)
{
    constexpr int V = VEC ? vec16<T>::n : 1;
    const int64_t bh = row / p.Nb, i = row % p.Nb, b = bh / p.H, h = bh % p.H;
    const int64_t t0 = i * p.block, t1 = t0 + p.block < p.N ? t0 + p.block : p.N;
    const int L = p.lanes, R = POOL_THREADS / L;
    const int lane = threadIdx.x % L, group = threadIdx.x / L;
    const bool active = group < R;
    const T *x = (const T *)p.x + b * p.sb + h * p.sh;
    const int64_t ncols = p.D / V;
    const float inv = 1.0f / (float)(t1 - t0);
    float *o = p.out + b * p.ob + h * p.oh + i * p.on;

    for (int64_t c0 = 0; c0 < ncols; c0 += L) {
        const int64_t c = c0 + lane;
        float acc[V];
        for (int e = 0; e < V; e++)
            acc[e] = 0.0f;
        if (active && c < ncols) {
            /* Eight independent loads in flight per thread before any is consumed. */
            int64_t t = t0 + group;
            for (; t + 7 * R < t1; t += 8 * R) {
                float v[8][V];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    if constexpr (VEC)
                        load_vec16<T>(x + (t + u * R) * p.sn + c * V, v[u]);
                    else
                        v[u][0] = to_f32<T>(x[(t + u * R) * p.sn + c * p.sd]);
                }
#pragma unroll
                for (int u = 0; u < 8; u++)
                    for (int e = 0; e < V; e++)
                        acc[e] += v[u][e];
            }
            for (; t < t1; t += R) {
                if constexpr (VEC) {
                    float v[V];
                    load_vec16<T>(x + t * p.sn + c * V, v);
                    for (int e = 0; e < V; e++)
                        acc[e] += v[e];
                } else {
                    acc[0] += to_f32<T>(x[t * p.sn + c * p.sd]);
                }
            }
        }
        if (R == 1) {
            if (c < ncols)
                for (int e = 0; e < V; e++)
                    o[(c * V + e) * p.od] = acc[e] * inv;
            continue;
        }
        /* R > 1 means ncols <= L, so this is the only pass of the c0 loop. */
        if (active)
            for (int e = 0; e < V; e++)
                partial[group * L * V + lane * V + e] = acc[e];
        __syncthreads();
        for (int k = threadIdx.x; k < L * V; k += POOL_THREADS) {
            if (k >= ncols * V)
                continue;
            float s = 0.0f;
            for (int g = 0; g < R; g++)
                s += partial[g * L * V + k];
            o[k * p.od] = s * inv;
        }
    }
}

template <typename T> __device__ __forceinline__ void pool_job_row(const pool_job &p, int64_t row, float *partial)
{
    if (p.vec)
        pool_row<T, true>(p, row, partial);
    else
        pool_row<T, false>(p, row, partial);
}

/* One thread block per (tensor, b, h, pooled row). */
template <typename T> __global__ void __launch_bounds__(POOL_THREADS, 4) pool_kernel(pool_pair_params pp)
{
    __shared__ float partial[POOL_THREADS * vec16<T>::n];
    const int64_t row = blockIdx.x;
    if (row < pp.a.rows)
        pool_job_row<T>(pp.a, row, partial);
    else
        pool_job_row<T>(pp.b, row - pp.a.rows, partial);
}

/* 16-byte accesses need contiguous rows and 16-byte aligned row starts. */
bool can_vectorize(const sparge_view &x)
{
    const int64_t n = 16 / (int64_t)sparge_dtype_size(x.dtype);
    return x.sd == 1 && x.D % n == 0 && (uintptr_t)x.data % 16 == 0 && x.sb % n == 0 && x.sh % n == 0 &&
           x.sn % n == 0;
}

pool_job make_job(const sparge_pool_args *a)
{
    const sparge_view &x = a->x, &o = a->out;
    const bool vec = can_vectorize(x);
    const int64_t ncols = vec ? x.D / (16 / (int64_t)sparge_dtype_size(x.dtype)) : x.D;
    return pool_job{x.data, x.sb, x.sh, x.sn, x.sd, x.H, x.N, x.D, o.N, (float *)o.data, o.sb, o.sh, o.sn, o.sd,
                    a->block, (int)(ncols < POOL_THREADS ? ncols : POOL_THREADS), vec ? 1 : 0, x.B * x.H * o.N};
}

sparge_status launch(gpu_ctx *ctx, const sparge_pool_args *a, const sparge_pool_args *b)
{
    pool_pair_params pp = {make_job(a), {}};
    if (b)
        pp.b = make_job(b);
    const int64_t blocks = pp.a.rows + pp.b.rows;
    if (blocks > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "pool: B*H*ceil(N/block) = %lld exceeds the grid limit %d",
                           (long long)blocks, INT32_MAX);
    switch (a->x.dtype) {
    case SPARGE_F16: pool_kernel<gpu_half><<<(unsigned)blocks, POOL_THREADS, 0, ctx->stream>>>(pp); break;
    case SPARGE_BF16: pool_kernel<gpu_bf16><<<(unsigned)blocks, POOL_THREADS, 0, ctx->stream>>>(pp); break;
    default: pool_kernel<float><<<(unsigned)blocks, POOL_THREADS, 0, ctx->stream>>>(pp); break;
    }
    return GPU_CHECK_LAUNCH("pool kernel");
}

} // namespace

sparge_status SPARGE_GPU_FN(pool)(gpu_ctx *ctx, const sparge_pool_args *a) { return launch(ctx, a, nullptr); }

sparge_status SPARGE_GPU_FN(pool_pair)(gpu_ctx *ctx, const sparge_pool_args *a, const sparge_pool_args *b)
{
    if (a->x.dtype != b->x.dtype)
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "pool: the two tensors pooled together must share a dtype");
    return launch(ctx, a, b);
}
