/* The mask's index lists on the GPU: CSR rows from an imported dense view, and the transpose (per key block the
 * ascending query blocks that keep it), which the core asks for once per selection when it is first needed. */
#include <stdint.h>

#include "gpu.h"

namespace {

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
} // namespace

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