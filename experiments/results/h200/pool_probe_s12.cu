// Session 12 probe (standalone, not part of the build): can the pooling stream Q and K at the staged kernel's rate
// with few registers per SM, so that logits and selection blocks could run beside it? Pools a bf16 [24, 32760, 128]
// tensor (201 MB, the bytes of Wan2.1-1.3B's Q and K) by blocks of 128 rows into f32, three ways:
//   warp:  one warp per (pooled row, 64-byte slice), registers hold the loads in flight (like pool.cu, UNROLL 8);
//   async: persistent blocks of 128 threads stream whole pooled rows (32 KiB) through a ring of shared-memory stages
//          with cp.async (sm_80+), so the bytes in flight cost shared memory, not registers.
// Checks every variant against the warp kernel's output. Build: nvcc -O3 -arch=sm_90 -o probe pool_probe_s12.cu
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cuda_bf16.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr int D = 128, BLOCK = 128, ROW_BYTES = D * 2, UNIT_BYTES = BLOCK * ROW_BYTES; // 32 KiB per pooled row

__device__ __forceinline__ void add8(float *acc, uint4 r)
{
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
    for (int e = 0; e < 4; e++) {
        acc[2 * e] += __uint_as_float(w[e] << 16);
        acc[2 * e + 1] += __uint_as_float(w[e] & 0xffff0000u);
    }
}

// One warp per (pooled row, 64-byte slice): 4 lanes along D, 8 row groups, UNROLL loads in flight per lane.
template <int UNROLL> __global__ void __launch_bounds__(256, 4) warp_pool(const uint4 *x, float *out, int rows_out)
{
    const int unit = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (unit >= rows_out * 4) return;
    const int row = unit / 4, slice = unit % 4, c = slice * 4 + lane % 4; // 16-byte chunk of the row
    const uint4 *p = x + (size_t)row * BLOCK * (ROW_BYTES / 16) + c;
    float acc[8] = {};
    for (int t = lane / 4; t < BLOCK; t += UNROLL * 8) {
        uint4 r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) r[u] = p[(size_t)(t + u * 8) * (ROW_BYTES / 16)];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) add8(acc, r[u]);
    }
    for (int o = 4; o < 32; o <<= 1)
        for (int e = 0; e < 8; e++) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
    if (lane < 4)
        for (int e = 0; e < 8; e++) out[(size_t)row * D + c * 8 + e] = acc[e] * (1.0f / BLOCK);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Persistent: block b pools rows b, b + grid, ...; STAGES rows in flight per block through shared memory.
template <int STAGES> __global__ void __launch_bounds__(128) async_pool(const uint4 *x, float *out, int rows_out)
{
    extern __shared__ __align__(16) uint4 ring[]; // STAGES x 2048 chunks of 16 bytes
    __shared__ float part[8][D];
    const int t = threadIdx.x;
    auto issue = [&](int row, int stage) {
        if (row < rows_out) {
            const uint4 *src = x + (size_t)row * (UNIT_BYTES / 16);
            uint4 *dst = ring + stage * (UNIT_BYTES / 16);
#pragma unroll
            for (int i = 0; i < UNIT_BYTES / 16 / 128; i++) cp_async16(dst + i * 128 + t, src + i * 128 + t);
        }
        cp_commit();
    };
    int row = blockIdx.x;
    for (int s = 0; s < STAGES - 1; s++) issue(row + s * gridDim.x, s);
    for (int k = 0; row < rows_out; k++, row += gridDim.x) {
        issue(row + (STAGES - 1) * gridDim.x, (k + STAGES - 1) % STAGES);
        cp_wait<STAGES - 1>();
        __syncthreads();
        const uint4 *buf = ring + (k % STAGES) * (UNIT_BYTES / 16);
        const int c = t % 16, g = t / 16; // chunk c of rows g, g + 8, ...
        float acc[8] = {};
#pragma unroll
        for (int r = g; r < BLOCK; r += 8) add8(acc, buf[r * 16 + c]);
        for (int e = 0; e < 8; e++) part[g][c * 8 + e] = acc[e];
        __syncthreads();
        float s = 0.0f;
        for (int q = 0; q < 8; q++) s += part[q][t];
        out[(size_t)row * D + t] = s * (1.0f / BLOCK);
        // the stage just read is refilled by the next iteration's issue, after this barrier
        __syncthreads();
    }
}

int main()
{
    const int H = 24, N = 32760, rows_out = H * (N / BLOCK); // N/BLOCK = 255 whole blocks per head (ragged tail dropped)
    const size_t in_bytes = (size_t)rows_out * UNIT_BYTES;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint4 *x;
    float *ref, *out;
    CK(cudaMalloc(&x, in_bytes));
    CK(cudaMalloc(&ref, (size_t)rows_out * D * 4));
    CK(cudaMalloc(&out, (size_t)rows_out * D * 4));
    {
        uint16_t *h = (uint16_t *)malloc(in_bytes);
        uint32_t s = 1;
        for (size_t i = 0; i < in_bytes / 2; i++) { s = s * 1664525u + 1013904223u; h[i] = (uint16_t)(0x3c00 + (s >> 24)); }
        CK(cudaMemcpy(x, h, in_bytes, cudaMemcpyHostToDevice));
        free(h);
    }
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    auto time = [&](const char *name, auto launch, float *dst) {
        for (int w = 0; w < 3; w++) launch();
        CK(cudaEventRecord(a));
        const int reps = 20;
        for (int r = 0; r < reps; r++) launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        double us = ms * 1000.0 / reps, err = 0.0;
        if (dst != ref) {
            float *h1 = (float *)malloc((size_t)rows_out * D * 4), *h2 = (float *)malloc((size_t)rows_out * D * 4);
            CK(cudaMemcpy(h1, ref, (size_t)rows_out * D * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h2, dst, (size_t)rows_out * D * 4, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < (size_t)rows_out * D; i++) err = fmax(err, fabs(h1[i] - h2[i]) / fabs(h1[i]));
            free(h1);
            free(h2);
        }
        printf("%-34s %8.2f us  %6.2f TB/s  max rel diff vs warp/8 %.2e\n", name, us, in_bytes / us / 1e6, err);
    };
    const int warp_blocks = (rows_out * 4 + 7) / 8;
    time("warp, unroll 8 (pool.cu)", [&] { warp_pool<8><<<warp_blocks, 256>>>(x, ref, rows_out); }, ref);
    time("warp, unroll 16", [&] { warp_pool<16><<<warp_blocks, 256>>>(x, out, rows_out); }, out);
    auto run_async = [&](auto kernel, int stages, int per_sm, const char *name) {
        const int smem = stages * UNIT_BYTES;
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        int fit;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 128, smem));
        if (fit < per_sm) { printf("%-34s does not fit (%d per SM)\n", name, fit); return; }
        time(name, [&] { kernel<<<sms * per_sm, 128, smem>>>(x, out, rows_out); }, out);
    };
    run_async(async_pool<2>, 2, 1, "async, 2 stages, 1 block/SM");
    run_async(async_pool<2>, 2, 2, "async, 2 stages, 2 blocks/SM");
    run_async(async_pool<2>, 2, 3, "async, 2 stages, 3 blocks/SM");
    run_async(async_pool<3>, 3, 1, "async, 3 stages, 1 block/SM");
    run_async(async_pool<3>, 3, 2, "async, 3 stages, 2 blocks/SM");
    run_async(async_pool<4>, 4, 1, "async, 4 stages, 1 block/SM");
    run_async(async_pool<6>, 6, 1, "async, 6 stages, 1 block/SM");
    return 0;
}
