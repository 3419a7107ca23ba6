/* Block mean-pooling of a strided [B,H,N,D] view into f32 [B,H,ceil(N/block),D].
 *
 * One thread block per (b, h, pooled row). Threads split into L lanes along D
 * (each lane owns 16-byte column chunks when the rows are contiguous and
 * aligned) and R row groups; the R partial sums meet in shared memory. Each
 * input row is read once with full 16-byte accesses, in BHND and BNHD alike,
 * which keeps the kernel at memory bandwidth. */
#include <stdint.h>

#include "gpu.h"

namespace {

constexpr int POOL_THREADS = 256;

struct pool_params {
    const void *x;
    int64_t sb, sh, sn, sd; /* input strides (elements) */
    int64_t H, N, D, Nb;
    float *out;
    int64_t ob, oh, on, od; /* output strides (elements) */
    int block;
    int lanes; /* threads per row: L */
};

template <typename T, bool VEC>
__global__ void __launch_bounds__(POOL_THREADS) pool_kernel(pool_params p)
{
    constexpr int V = VEC ? vec16<T>::n : 1;
    __shared__ float partial[POOL_THREADS * V];
    const int64_t row = blockIdx.x, bh = row / p.Nb, i = row % p.Nb, b = bh / p.H, h = bh % p.H;
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
#pragma unroll 4
            for (int64_t t = t0 + group; t < t1; t += R) {
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

template <typename T> sparge_status launch(gpu_ctx *ctx, const sparge_pool_args *a, bool vec)
{
    const sparge_view &x = a->x, &o = a->out;
    pool_params p = {x.data, x.sb, x.sh, x.sn, x.sd, x.H, x.N, x.D, o.N, (float *)o.data, o.sb, o.sh, o.sn, o.sd,
                     a->block, 0};
    const int64_t ncols = vec ? x.D / vec16<T>::n : x.D;
    p.lanes = (int)(ncols < POOL_THREADS ? ncols : POOL_THREADS);
    const int64_t blocks = x.B * x.H * o.N;
    if (vec)
        pool_kernel<T, true><<<(unsigned)blocks, POOL_THREADS, 0, ctx->stream>>>(p);
    else
        pool_kernel<T, false><<<(unsigned)blocks, POOL_THREADS, 0, ctx->stream>>>(p);
    return GPU_CHECK_LAUNCH("pool kernel");
}

/* 16-byte accesses need contiguous rows and 16-byte aligned row starts. */
bool can_vectorize(const sparge_view &x)
{
    const int64_t n = 16 / (int64_t)sparge_dtype_size(x.dtype);
    return x.sd == 1 && x.D % n == 0 && (uintptr_t)x.data % 16 == 0 && x.sb % n == 0 && x.sh % n == 0 &&
           x.sn % n == 0;
}

} // namespace

sparge_status SPARGE_GPU_FN(pool)(gpu_ctx *ctx, const sparge_pool_args *a)
{
    const int64_t blocks = a->x.B * a->x.H * a->out.N;
    if (blocks > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "pool: B*H*ceil(N/block) = %lld exceeds the grid limit %d",
                           (long long)blocks, INT32_MAX);
    const bool vec = can_vectorize(a->x);
    switch (a->x.dtype) {
    case SPARGE_F16: return launch<gpu_half>(ctx, a, vec);
    case SPARGE_BF16: return launch<gpu_bf16>(ctx, a, vec);
    default: return launch<float>(ctx, a, vec);
    }
}
