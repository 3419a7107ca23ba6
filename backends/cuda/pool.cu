/* Block mean-pooling of a strided [B,H,N,D] view into f32 [B,H,ceil(N/block),D]; with sequence offsets (varlen),
 * of each packed sequence of a [1,H,T,D] view into [S,H,Nb_max,D], rows past a sequence's blocks zero.
 *
 * One warp per unit = (tensor, b, h, pooled row, column slice); Q and K share
 * one launch (pool_pair). A warp's lanes split into L lanes along D (16-byte
 * chunks when the rows are contiguous and aligned) and G = warp/L row groups;
 * each lane issues up to POOL_UNROLL loads before consuming any, and the G
 * partial sums meet through shuffles. Small units (a 64-byte slice of a block
 * of rows) keep thousands of warps with all their loads in flight, which is
 * what holds the kernel at memory bandwidth; no shared memory, no barrier. */
#include <stdint.h>

#include "gpu.h"

namespace {

constexpr int POOL_THREADS = 256, POOL_UNROLL = 8;

/* 16 bytes of a tensor read once: not kept in L1, and the L2 fetches the whole 256-byte segment around them, which
 * the neighbouring slices' warps read next. On the H200 at Wan2.1-1.3B the pooling then takes 50.5 µs (84 % of DRAM
 * peak) instead of 52.9 (81 %), and the mask prediction 0.071-0.072 ms instead of 0.077. */
__device__ __forceinline__ uint4 load_once16(const void *p)
{
#if !defined(SPARGE_USE_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#else
    return *(const uint4 *)p;
#endif
}

/* One tensor to pool. */
struct pool_job {
    const void *x;
    int64_t sb, sh, sn, sd; /* input strides (elements) */
    int64_t H, N, D, Nb;
    float *out;
    int64_t ob, oh, on, od; /* output strides (elements) */
    int block;
    int lane_bits; /* L = 2^lane_bits lanes along D (shifts: a division by L would cost ~20 instructions) */
    int slices;   /* column slices of L chunks per pooled row */
    int vec;      /* 16-byte loads */
    int64_t units; /* B*H*Nb*slices: warps of this job (B: the output's) */
    const int32_t *seq; /* varlen: B+1 token offsets; NULL: fixed length */
};

/* Q and K in one grid: the first a.units warps pool a, the rest b. */
struct pool_pair_params {
    pool_job a, b;
};

/* 32-bit index arithmetic (the launch checks that the units fit) and shifts by log2 L: dividing 64-bit indices by
 * run-time values cost 7.8 M of the kernel's 33.3 M instructions at Wan2.1-1.3B (H200, ncu), and registers that
 * spilled on sm_80 (f32) and sm_120. The time moved little (52.8 against 54-56 µs): the kernel waits on memory. */
template <typename T, bool VEC, bool VARLEN>
__device__ __forceinline__ void pool_unit(const pool_job &p, uint32_t unit)
{
    constexpr int V = VEC ? vec16<T>::n : 1;
    const uint32_t row = unit / (uint32_t)p.slices, slice = unit - row * (uint32_t)p.slices;
    const uint32_t bh = row / (uint32_t)p.Nb, b = bh / (uint32_t)p.H, h = bh - b * (uint32_t)p.H;
    const int64_t i = row - bh * (uint32_t)p.Nb;
    int64_t t0 = i * p.block, t1 = t0 + p.block < p.N ? t0 + p.block : p.N, xb = b;
    if constexpr (VARLEN) { /* sequence b: tokens [seq[b], seq[b+1]) of batch 0 */
        const int64_t first = p.seq[b], end = p.seq[b + 1];
        t0 = first + i * p.block;
        t1 = t0 < end ? (t0 + p.block < end ? t0 + p.block : end) : t0;
        xb = 0;
    }
    const int L = 1 << p.lane_bits, G = SPARGE_WARP_SIZE >> p.lane_bits, lane = threadIdx.x % SPARGE_WARP_SIZE;
    const int64_t c = ((int64_t)slice << p.lane_bits) + (lane & (L - 1));
    const bool col_ok = c < p.D / V;
    const T *x = (const T *)p.x + xb * p.sb + h * p.sh + (VEC ? c * V : c * p.sd);
    float acc[V];
    for (int e = 0; e < V; e++)
        acc[e] = 0.0f;
    for (int64_t t = t0 + (lane >> p.lane_bits); t < t1; t += POOL_UNROLL * G) {
        if constexpr (VEC) {
            uint4 raw[POOL_UNROLL];
#pragma unroll
            for (int u = 0; u < POOL_UNROLL; u++)
                raw[u] = col_ok && t + u * G < t1 ? load_once16(x + (t + u * G) * p.sn) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < POOL_UNROLL; u++) {
                float v[V];
                load_vec16<T>((const T *)&raw[u], v);
                for (int e = 0; e < V; e++)
                    acc[e] += v[e];
            }
        } else {
            float v[POOL_UNROLL];
#pragma unroll
            for (int u = 0; u < POOL_UNROLL; u++)
                v[u] = col_ok && t + u * G < t1 ? to_f32<T>(x[(t + u * G) * p.sn]) : 0.0f;
#pragma unroll
            for (int u = 0; u < POOL_UNROLL; u++)
                acc[0] += v[u];
        }
    }
    for (int o = L; o < SPARGE_WARP_SIZE; o <<= 1)
        for (int e = 0; e < V; e++)
            acc[e] += sparge_shfl_xor(acc[e], o);
    if (lane < L && col_ok) {
        const float inv = t1 > t0 ? 1.0f / (float)(t1 - t0) : 0.0f; /* a row past its sequence: zero */
        float *o = p.out + b * p.ob + h * p.oh + i * p.on + c * V * p.od;
        for (int e = 0; e < V; e++)
            o[e * p.od] = acc[e] * inv;
    }
}

template <typename T, bool VARLEN> __device__ __forceinline__ void pool_job_unit(const pool_job &p, uint32_t unit)
{
    if (p.vec)
        pool_unit<T, true, VARLEN>(p, unit);
    else
        pool_unit<T, false, VARLEN>(p, unit);
}

/* One warp per unit of either tensor (both varlen or neither). */
template <typename T, bool VARLEN>
__global__ void __launch_bounds__(POOL_THREADS, 4) pool_kernel(pool_pair_params pp)
{
    const uint32_t unit = blockIdx.x * (POOL_THREADS / SPARGE_WARP_SIZE) + threadIdx.x / SPARGE_WARP_SIZE;
    if (unit < pp.a.units)
        pool_job_unit<T, VARLEN>(pp.a, unit);
    else if (unit < pp.a.units + pp.b.units)
        pool_job_unit<T, VARLEN>(pp.b, unit - (uint32_t)pp.a.units);
    gpu_allow_next_kernel(); /* the mask's logits kernel may be scheduled as the last blocks drain */
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
    /* 4 lanes of 16 bytes: 64-byte row segments and 8 (or 16) row groups per warp. */
    int lane_bits = 0;
    while ((1 << lane_bits) < (vec ? 4 : 32) && (1 << lane_bits) < ncols)
        lane_bits++;
    const int64_t slices = (ncols + (1 << lane_bits) - 1) >> lane_bits;
    return pool_job{x.data, x.sb, x.sh, x.sn, x.sd, x.H, x.N, x.D, o.N, (float *)o.data, o.sb, o.sh, o.sn, o.sd,
                    a->block, lane_bits, (int)slices, vec ? 1 : 0, o.B * x.H * o.N * slices, a->seq};
}

sparge_status launch(gpu_ctx *ctx, const sparge_pool_args *a, const sparge_pool_args *b)
{
    pool_pair_params pp = {make_job(a), {}};
    if (b)
        pp.b = make_job(b);
    /* HIP's host pass sees a warp of 64; on wave32 devices the surplus warps exit at once. */
    const int64_t units = pp.a.units + pp.b.units, per_block = POOL_THREADS / SPARGE_WARP_SIZE;
    const int64_t blocks = (units + per_block - 1) / per_block;
    if (blocks * (POOL_THREADS / 32) > UINT32_MAX) /* unit numbers as a wave32 device counts them */
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "pool: %lld pooling units exceed 2^32; pool fewer heads per call",
                           (long long)units);
    auto run = [&](auto kernel) { kernel<<<(unsigned)blocks, POOL_THREADS, 0, ctx->stream>>>(pp); };
    const bool varlen = a->seq != nullptr;
    switch (a->x.dtype) {
    case SPARGE_F16: varlen ? run(pool_kernel<gpu_half, true>) : run(pool_kernel<gpu_half, false>); break;
    case SPARGE_BF16: varlen ? run(pool_kernel<gpu_bf16, true>) : run(pool_kernel<gpu_bf16, false>); break;
    default: varlen ? run(pool_kernel<float, true>) : run(pool_kernel<float, false>); break;
    }
    return GPU_CHECK_LAUNCH("pool kernel");
}

} // namespace

sparge_status SPARGE_GPU_FN(pool)(gpu_ctx *ctx, const sparge_pool_args *a) { return launch(ctx, a, nullptr); }

sparge_status SPARGE_GPU_FN(pool_pair)(gpu_ctx *ctx, const sparge_pool_args *a, const sparge_pool_args *b)
{
    if (a->x.dtype != b->x.dtype || !a->seq != !b->seq)
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "pool: the two tensors pooled together must share a dtype and a layout");
    return launch(ctx, a, b);
}
