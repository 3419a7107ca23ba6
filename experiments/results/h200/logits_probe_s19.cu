/* logits_probe_s19.cu: a standalone probe (not part of the build) for the pooled map's logits scale·Q̄K̄ᵀ at the
 * Wan2.1-1.3B shape (H heads of 256 query blocks × 512 key blocks, D = 128, fp32 pooled rows, L2-resident as after
 * the pooling). It times three kernels and checks each against an fp64 reference:
 *   main  : backends/cuda/mask.cu's map_logits_tc_kernel (3xTF32, m16n8k8, 16-d chunks fetched one ahead);
 *   tf32up: the same products, every load of the tile issued at once, the key tile split once into shared memory;
 *   f16up : as tf32up, but each row of Q̄ and each column of K̄ is scaled by a power of two (its largest magnitude
 *           into [2^14, 2^15)) and split into fp16 hi + lo: hi·hi + hi·lo + lo·hi on m16n8k16, half the tensor-core
 *           work of 3xTF32 for the same 22-bit products; the powers of two come off exactly after the sum.
 * Build and run: nvcc -O3 -std=c++17 -arch=sm_90 -o lp logits_probe_s19.cu && ./lp [H] [reps] */
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define CK(x)                                                                                                        \
    do {                                                                                                             \
        cudaError_t e_ = (x);                                                                                        \
        if (e_ != cudaSuccess) {                                                                                     \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                               \
            exit(1);                                                                                                 \
        }                                                                                                            \
    } while (0)

constexpr int NQ = 256, NK = 512, D = 128, TILE = 64, THREADS = 128, N8 = TILE / 8, NCH = D / 16;

struct P {
    const float *q, *k; /* [H][NQ][D], [H][NK][D] */
    float *map;         /* [H][NQ][NK] */
    int H;
    float scale;
};

__device__ __forceinline__ void tf32_split(float x, uint32_t &big, uint32_t &small)
{
    big = ((uint32_t)min((int32_t)__float_as_uint(x), 0x7fffefff) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big)) + 0x1000u;
}
__device__ __forceinline__ void mma_tf32(float c[4], const uint32_t a[4], const uint32_t b[2])
{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], const uint32_t b[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* ------------------------------------------------------------------ main's kernel (contiguous strides) */
__global__ void __launch_bounds__(THREADS) main_kernel(P p)
{
    __shared__ uint4 kbig[2][TILE][4], ksmall[2][TILE][4];
    const int ktiles = NK / TILE, qtiles = NQ / TILE;
    const int tile = blockIdx.x, h = tile / (qtiles * ktiles);
    const int i0 = tile / ktiles % qtiles * TILE, j0 = tile % ktiles * TILE;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = i0 + threadIdx.x / 32 * 16 + g, row1 = row0 + 8;
    const float *qrow[2] = {p.q + ((int64_t)h * NQ + row0) * D + 4 * t, p.q + ((int64_t)h * NQ + row1) * D + 4 * t};
    const int scol = threadIdx.x / 2, spart = threadIdx.x % 2 * 2;
    const float *ksrc = p.k + ((int64_t)h * NK + j0 + scol) * D + 4 * spart;
    float4 qn[2], kn[2];
    auto fetch = [&](int d0) {
        for (int r = 0; r < 2; r++)
            qn[r] = *(const float4 *)(qrow[r] + d0);
        for (int u = 0; u < 2; u++)
            kn[u] = *(const float4 *)(ksrc + d0 + 4 * u);
    };
    auto stage = [&](int buf) {
        for (int u = 0; u < 2; u++) {
            uint4 big, small;
            tf32_split(kn[u].x, big.x, small.x);
            tf32_split(kn[u].y, big.y, small.y);
            tf32_split(kn[u].z, big.z, small.z);
            tf32_split(kn[u].w, big.w, small.w);
            kbig[buf][scol][spart + u] = big;
            ksmall[buf][scol][spart + u] = small;
        }
    };
    float acc[N8][4] = {};
    fetch(0);
    stage(0);
    __syncthreads();
    int buf = 0;
    for (int d0 = 0; d0 < D; d0 += 16, buf ^= 1) {
        const float4 q0 = qn[0], q1 = qn[1];
        const bool more = d0 + 16 < D;
        if (more)
            fetch(d0 + 16);
        uint4 kb[N8], ks[N8];
#pragma unroll
        for (int n = 0; n < N8; n++) {
            kb[n] = kbig[buf][8 * n + g][t];
            ks[n] = ksmall[buf][8 * n + g][t];
        }
#pragma unroll
        for (int step = 0; step < 2; step++) {
            uint32_t ab[4], as[4];
            tf32_split(step ? q0.z : q0.x, ab[0], as[0]);
            tf32_split(step ? q1.z : q1.x, ab[1], as[1]);
            tf32_split(step ? q0.w : q0.y, ab[2], as[2]);
            tf32_split(step ? q1.w : q1.y, ab[3], as[3]);
#pragma unroll
            for (int n = 0; n < N8; n++) {
                const uint32_t bb[2] = {step ? kb[n].z : kb[n].x, step ? kb[n].w : kb[n].y};
                const uint32_t bs[2] = {step ? ks[n].z : ks[n].x, step ? ks[n].w : ks[n].y};
                mma_tf32(acc[n], as, bb);
                mma_tf32(acc[n], ab, bs);
                mma_tf32(acc[n], ab, bb);
            }
        }
        if (more)
            stage(buf ^ 1);
        __syncthreads();
    }
    float *m = p.map + (int64_t)h * NQ * NK;
    for (int r = 0; r < 2; r++) {
        float *out = m + (int64_t)(r ? row1 : row0) * NK;
#pragma unroll
        for (int n = 0; n < N8; n++) {
            const int j = j0 + 8 * n + 2 * t;
            *(float2 *)(out + j) = make_float2(acc[n][2 * r] * p.scale, acc[n][2 * r + 1] * p.scale);
        }
    }
}

/* ------------------------------------------------------------------ every load at once */

/* The power of two 2^s that takes the largest magnitude (bits m, sign cleared) into [2^14, 2^15); 0 for a zero
 * or non-finite largest value. */
__device__ __forceinline__ int f16_shift(uint32_t m)
{
    if (m == 0u || m >= 0x7f800000u)
        return 0;
    return min(141 - (int)(m >> 23), 126);
}
__device__ __forceinline__ float pow2(int s) { return __int_as_float((s + 127) << 23); }

__device__ __forceinline__ uint32_t max_bits(float4 v)
{
    return max(max(__float_as_uint(v.x) & 0x7fffffffu, __float_as_uint(v.y) & 0x7fffffffu),
               max(__float_as_uint(v.z) & 0x7fffffffu, __float_as_uint(v.w) & 0x7fffffffu));
}

/* hi and lo (fp16 pairs) of two scaled values. */
__device__ __forceinline__ void f16_split(float a, float b, uint32_t &hi, uint32_t &lo)
{
    const __half2 h = __floats2half2_rn(a, b);
    const float2 hf = __half22float2(h);
    const __half2 l = __floats2half2_rn(a - hf.x, b - hf.y);
    hi = *(const uint32_t *)&h;
    lo = *(const uint32_t *)&l;
}

template <bool F16> struct up_smem;
template <> struct up_smem<true> {
    uint2 hi[NCH][TILE][4], lo[NCH][TILE][4]; /* [chunk][column][t]: d = 16c+4t..+3 as two fp16 pairs */
    int shift[TILE];
};
template <> struct up_smem<false> {
    uint4 hi[NCH][TILE][4], lo[NCH][TILE][4];
};

template <bool F16> __global__ void __launch_bounds__(THREADS, 3) up_kernel(P p)
{
    extern __shared__ __align__(16) unsigned char raw_smem[];
    up_smem<F16> &s = *(up_smem<F16> *)raw_smem;
    const int ktiles = NK / TILE, qtiles = NQ / TILE;
    const int tile = blockIdx.x, h = tile / (qtiles * ktiles);
    const int i0 = tile / ktiles % qtiles * TILE, j0 = tile % ktiles * TILE;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = i0 + threadIdx.x / 32 * 16 + g;
    /* Thread s stages key column s/2, chunks (s%2)·NCH/2 ..: 64 contiguous floats. */
    const int scol = threadIdx.x / 2, c0 = threadIdx.x % 2 * (NCH / 2);
    const float *ksrc = p.k + ((int64_t)h * NK + j0 + scol) * D + 16 * c0;
    const float *qsrc = p.q + ((int64_t)h * NQ + row0) * D + 4 * t;
    float4 kv[NCH / 2][4], qv[2][NCH];
#pragma unroll
    for (int c = 0; c < NCH / 2; c++)
#pragma unroll
        for (int u = 0; u < 4; u++)
            kv[c][u] = *(const float4 *)(ksrc + 16 * c + 4 * u);
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int c = 0; c < NCH; c++)
            qv[r][c] = *(const float4 *)(qsrc + r * 8 * D + 16 * c);

    int kshift = 0;
    if (F16) {
        uint32_t m = 0;
#pragma unroll
        for (int c = 0; c < NCH / 2; c++)
#pragma unroll
            for (int u = 0; u < 4; u++)
                m = max(m, max_bits(kv[c][u]));
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
        kshift = f16_shift(m);
    }
    const float kscale = pow2(kshift);
#pragma unroll
    for (int c = 0; c < NCH / 2; c++)
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const float4 x = kv[c][u];
            if constexpr (F16) {
                uint2 hi, lo;
                f16_split(x.x * kscale, x.y * kscale, hi.x, lo.x);
                f16_split(x.z * kscale, x.w * kscale, hi.y, lo.y);
                s.hi[c0 + c][scol][u] = hi;
                s.lo[c0 + c][scol][u] = lo;
            } else {
                uint4 big, small;
                tf32_split(x.x, big.x, small.x);
                tf32_split(x.y, big.y, small.y);
                tf32_split(x.z, big.z, small.z);
                tf32_split(x.w, big.w, small.w);
                s.hi[c0 + c][scol][u] = big;
                s.lo[c0 + c][scol][u] = small;
            }
        }
    if constexpr (F16)
        if (threadIdx.x % 2 == 0)
            s.shift[scol] = kshift;

    int qshift[2] = {0, 0};
    if (F16) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            uint32_t m = 0;
#pragma unroll
            for (int c = 0; c < NCH; c++)
                m = max(m, max_bits(qv[r][c]));
            m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
            qshift[r] = f16_shift(m);
            const float qs = pow2(qshift[r]);
#pragma unroll
            for (int c = 0; c < NCH; c++)
                qv[r][c] = make_float4(qv[r][c].x * qs, qv[r][c].y * qs, qv[r][c].z * qs, qv[r][c].w * qs);
        }
    }
    __syncthreads();

    float acc[N8][4] = {};
#pragma unroll
    for (int c = 0; c < NCH; c++) {
        const float4 q0 = qv[0][c], q1 = qv[1][c];
        if constexpr (F16) {
            /* k positions 2t, 2t+1, 2t+8, 2t+9 hold d = 16c+4t .. +3 in both operands. */
            uint32_t ah[4], al[4];
            f16_split(q0.x, q0.y, ah[0], al[0]);
            f16_split(q1.x, q1.y, ah[1], al[1]);
            f16_split(q0.z, q0.w, ah[2], al[2]);
            f16_split(q1.z, q1.w, ah[3], al[3]);
#pragma unroll
            for (int n = 0; n < N8; n++) {
                const uint2 bh = s.hi[c][8 * n + g][t], bl = s.lo[c][8 * n + g][t];
                const uint32_t bhi[2] = {bh.x, bh.y}, blo[2] = {bl.x, bl.y};
                mma_f16(acc[n], al, bhi);
                mma_f16(acc[n], ah, blo);
                mma_f16(acc[n], ah, bhi);
            }
        } else {
            uint4 kb[N8], ks[N8];
#pragma unroll
            for (int n = 0; n < N8; n++) {
                kb[n] = s.hi[c][8 * n + g][t];
                ks[n] = s.lo[c][8 * n + g][t];
            }
#pragma unroll
            for (int step = 0; step < 2; step++) {
                uint32_t ab[4], as[4];
                tf32_split(step ? q0.z : q0.x, ab[0], as[0]);
                tf32_split(step ? q1.z : q1.x, ab[1], as[1]);
                tf32_split(step ? q0.w : q0.y, ab[2], as[2]);
                tf32_split(step ? q1.w : q1.y, ab[3], as[3]);
#pragma unroll
                for (int n = 0; n < N8; n++) {
                    const uint32_t bb[2] = {step ? kb[n].z : kb[n].x, step ? kb[n].w : kb[n].y};
                    const uint32_t bs[2] = {step ? ks[n].z : ks[n].x, step ? ks[n].w : ks[n].y};
                    mma_tf32(acc[n], as, bb);
                    mma_tf32(acc[n], ab, bs);
                    mma_tf32(acc[n], ab, bb);
                }
            }
        }
    }
    float *m = p.map + (int64_t)h * NQ * NK;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float *out = m + (int64_t)(row0 + 8 * r) * NK;
        const float qu = pow2(-qshift[r]);
#pragma unroll
        for (int n = 0; n < N8; n++) {
            const int j = 8 * n + 2 * t;
            float x0 = acc[n][2 * r], x1 = acc[n][2 * r + 1];
            if constexpr (F16) {
                x0 = x0 * qu * pow2(-s.shift[j]);
                x1 = x1 * qu * pow2(-s.shift[j + 1]);
            }
            *(float2 *)(out + j0 + j) = make_float2(x0 * p.scale, x1 * p.scale);
        }
    }
}

/* ------------------------------------------------------------------ host */
static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double unif()
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return ((rng >> 11) + 0.5) * 0x1p-53;
}
static double normal() { return sqrt(-2.0 * log(unif())) * cos(6.283185307179586 * unif()); }

int main(int argc, char **argv)
{
    const int H = argc > 1 ? atoi(argv[1]) : 12, reps = argc > 2 ? atoi(argv[2]) : 200;
    const size_t nq = (size_t)H * NQ * D, nk = (size_t)H * NK * D, nm = (size_t)H * NQ * NK;
    std::vector<float> q(nq), k(nk);
    /* Pooled rows: a shared channel profile (sinks) plus noise, magnitudes spread over 2^-8 .. 2^4 by row. */
    std::vector<double> prof(D);
    for (int d = 0; d < D; d++)
        prof[d] = normal();
    for (size_t r = 0; r < (size_t)H * NQ; r++) {
        const double mag = ldexp(1.0, (int)(unif() * 12) - 8);
        for (int d = 0; d < D; d++)
            q[r * D + d] = (float)(mag * (0.5 * prof[d] + normal()));
    }
    for (size_t r = 0; r < (size_t)H * NK; r++) {
        const double mag = ldexp(1.0, (int)(unif() * 12) - 8);
        for (int d = 0; d < D; d++)
            k[r * D + d] = (float)(mag * (0.3 * prof[d] + normal()));
    }
    const float scale = 1.0f / sqrtf((float)D);
    std::vector<double> ref(nm), absdot(nm);
    for (int h = 0; h < H; h++)
        for (int i = 0; i < NQ; i++)
            for (int j = 0; j < NK; j++) {
                const float *a = &q[((size_t)h * NQ + i) * D], *b = &k[((size_t)h * NK + j) * D];
                double s = 0, sa = 0;
                for (int d = 0; d < D; d++) {
                    s += (double)a[d] * b[d];
                    sa += fabs((double)a[d] * b[d]);
                }
                ref[((size_t)h * NQ + i) * NK + j] = s * scale;
                absdot[((size_t)h * NQ + i) * NK + j] = sa * scale;
            }
    float *dq, *dk, *dm;
    CK(cudaMalloc(&dq, nq * 4));
    CK(cudaMalloc(&dk, nk * 4));
    CK(cudaMalloc(&dm, nm * 4));
    CK(cudaMemcpy(dq, q.data(), nq * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, k.data(), nk * 4, cudaMemcpyHostToDevice));
    const P p = {dq, dk, dm, H, scale};
    const unsigned blocks = H * (NQ / TILE) * (NK / TILE);
    const size_t sm16 = sizeof(up_smem<true>), sm32 = sizeof(up_smem<false>);
    CK(cudaFuncSetAttribute(up_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm16));
    CK(cudaFuncSetAttribute(up_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm32));
    struct V {
        const char *name;
        void (*launch)(const P &, unsigned, size_t, size_t);
    } vs[] = {
        {"main", [](const P &p, unsigned b, size_t, size_t) { main_kernel<<<b, THREADS>>>(p); }},
        {"tf32up", [](const P &p, unsigned b, size_t, size_t s32) { up_kernel<false><<<b, THREADS, s32>>>(p); }},
        {"f16up", [](const P &p, unsigned b, size_t s16, size_t) { up_kernel<true><<<b, THREADS, s16>>>(p); }},
    };
    std::vector<float> out(nm), first(nm);
    printf("H=%d, %u blocks of %d threads, smem tf32up %zu B, f16up %zu B, %d reps\n", H, blocks, THREADS, sm32, sm16,
           reps);
    printf("%-8s %10s %14s %14s %12s\n", "kernel", "us/launch", "max err/|.|", "max abs err", "bits!=main");
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int v = 0; v < 3; v++) {
        CK(cudaMemset(dm, 0xff, nm * 4)); /* NaN poison */
        vs[v].launch(p, blocks, sm16, sm32);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(out.data(), dm, nm * 4, cudaMemcpyDeviceToHost));
        if (v == 0)
            first = out;
        double rel = 0, ab = 0;
        size_t diff = 0;
        for (size_t x = 0; x < nm; x++) {
            const double e = fabs((double)out[x] - ref[x]);
            if (!(e <= 1e30)) {
                rel = INFINITY;
                continue;
            }
            rel = fmax(rel, e / absdot[x]);
            ab = fmax(ab, e);
            diff += memcmp(&out[x], &first[x], 4) != 0;
        }
        for (int w = 0; w < 3; w++)
            vs[v].launch(p, blocks, sm16, sm32);
        CK(cudaEventRecord(e0));
        for (int r = 0; r < reps; r++)
            vs[v].launch(p, blocks, sm16, sm32);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("%-8s %10.2f %14.3e %14.3e %12zu\n", vs[v].name, 1000.0 * ms / reps, rel, ab, diff);
    }
    return 0;
}
