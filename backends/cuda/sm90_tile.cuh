/* Shared-memory tiles of the Hopper (sm_90a) wgmma kernels: forward_sm90.cu, backward_sm90.cu, dq_sm90.cu.
 *
 * A tile is a run of 64-row regions; a region holds D/64 panels of 64 rows × 128 bytes (64 elements of
 * one row), each in the 128-byte swizzle (16-byte chunk c of row r at chunk position c ^ (r & 7)), and
 * starts 1024-byte aligned. That is the canonical SWIZZLE_128B layout of the PTX ISA's matrix descriptors:
 *   K-major operand: 8-row core groups CORE_GROUP_BYTES apart (SBO); a 16-wide k step is +32 bytes
 *     inside a panel, panels are k steps 4 apart;
 *   MN-major operand: 8-row groups CORE_GROUP_BYTES apart (SBO), 64-column panels PANEL_BYTES apart
 *     (LBO), so 16 rows of k are 2 · CORE_GROUP_BYTES. */
#ifndef SPARGE_CUDA_SM90_TILE_CUH
#define SPARGE_CUDA_SM90_TILE_CUH

#include <stdint.h>

#include "mma.cuh"
#include "wgmma.cuh"

namespace sparge_sm90 {

constexpr int REGION_ROWS = 64, PANEL_ROW_BYTES = 128, CORE_GROUP_BYTES = 8 * PANEL_ROW_BYTES,
              PANEL_BYTES = REGION_ROWS * PANEL_ROW_BYTES;

/* x, the same in every lane of the warp, as a value the compiler knows to be warp-uniform: what derives from it
 * (tile addresses, wgmma descriptors, loop counters) can then stay in uniform registers instead of being moved
 * there before every wgmma. */
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

/* The dynamic shared memory from its first 1024-byte boundary, where the swizzle pattern starts: its
 * shared-space address, and in *generic the same place as a pointer. */
__device__ __forceinline__ uint32_t aligned_smem(unsigned char *raw, unsigned char **generic)
{
    const uint32_t a = (sparge_mma::smem_addr(raw) + 1023u) & ~1023u;
    *generic = raw + (a - sparge_mma::smem_addr(raw));
    return a;
}

/* Byte offset of 16-byte chunk `chunk` of row `row` (< 64) inside one region. */
__device__ __forceinline__ uint32_t panel_offset(int row, int chunk)
{
    return (uint32_t)((chunk >> 3) * PANEL_BYTES + row * PANEL_ROW_BYTES + (((chunk & 7) ^ (row & 7)) << 4));
}

/* Byte offset of 16-byte chunk `chunk` of row `row` in a tile of 64-row regions with rows of D elements. */
template <int D>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk)
{
    return (uint32_t)((row / REGION_ROWS) * (REGION_ROWS * D * 2)) + panel_offset(row % REGION_ROWS, chunk);
}

/* cp.async ROWS rows of D elements from global row row0 (row stride sn) into the tile at dst, spread
 * over THREADS threads (tid: this thread's index among them); rows at or past `limit` are zero-filled, and with
 * PAD the chunks at or past dch (a head dim padded to the tile's D).
 * A thread's rows lie ROW_STEP apart, a multiple of 8 that divides the 64-row regions, so the swizzle
 * ((row & 7) ^ chunk) is the same for all of them and each one's shared address is the first one's plus
 * a constant: unrolled, a row costs a pointer step, a bounds test and the copy. */
template <typename T, int D, int ROWS, int THREADS = 256, bool PAD = false>
__device__ __forceinline__ void load_tile(uint32_t dst, const T *base, int64_t sn, int row0, int limit, int tid,
                                          int dch = 0)
{
    constexpr int ROW_CHUNKS = D / 8, ROW_STEP = THREADS / ROW_CHUNKS;
    static_assert(REGION_ROWS % ROW_STEP == 0 && ROW_STEP % 8 == 0 && ROWS % REGION_ROWS == 0, "bad tile split");
    const int ch = tid % ROW_CHUNKS, r0 = tid / ROW_CHUNKS, rows = PAD && ch >= dch ? 0 : limit - row0;
    const T *src = base + (int64_t)(row0 + r0) * sn + ch * 8;
    const uint32_t to = dst + tile_offset<D>(r0, ch);
    const int64_t step = ROW_STEP * sn;
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; i++) {
        constexpr int REGION_BYTES = REGION_ROWS * D * 2;
        const int r = i * ROW_STEP; /* past r0; r0 < ROW_STEP never crosses a region */
        const bool ok = r0 + r < rows;
        sparge_mma::cp_async_16(to + (r / REGION_ROWS) * REGION_BYTES + (r % REGION_ROWS) * PANEL_ROW_BYTES,
                                ok ? src : base, ok);
        src += step;
    }
}

/* Store one warpgroup's staged 64 × D tile (rows of D/8 16-byte chunks in mma.cuh's swizzle) to the global
 * rows row0..row0+63 below `limit`, 16 bytes per access, and with PAD only the chunks below dch; wg_tid: the
 * thread's index in its warpgroup. */
template <typename T, int D, bool PAD = false>
__device__ __forceinline__ void store_wg_rows(T *base, int64_t sn, int row0, int limit, const unsigned char *stage,
                                              int wg_tid, int dch = 0)
{
    constexpr int ROW_CHUNKS = D / 8;
#pragma unroll
    for (int it = 0; it < REGION_ROWS * ROW_CHUNKS / 128; it++) {
        const int c = it * 128 + wg_tid, row_local = c / ROW_CHUNKS, ch = c % ROW_CHUNKS;
        if (row0 + row_local < limit && (!PAD || ch < dch))
            *reinterpret_cast<uint4 *>(base + (int64_t)(row0 + row_local) * sn + ch * 8) =
                *reinterpret_cast<const uint4 *>(stage + sparge_mma::swizzle<ROW_CHUNKS>(row_local, ch));
    }
}

/* acc (64×64 f32) = A·Bᵀ over D, A and B 64-row tiles of this layout read as K-major operands: the
 * S = Q·Kᵀ-shaped products of the wgmma kernels (one group; the caller fences, commits and waits). The first
 * k step does not read acc (scale-d 0), so acc needs no clearing. */
template <typename T, int D>
__device__ __forceinline__ void wgmma_a_bt(float acc[32], uint32_t a_tile, uint32_t b_tile)
{
    const uint64_t a0 = sparge_wgmma::sw128_desc(a_tile, 16, CORE_GROUP_BYTES),
                   b0 = sparge_wgmma::sw128_desc(b_tile, 16, CORE_GROUP_BYTES);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const uint32_t off = (kk >> 2) * PANEL_BYTES + (kk & 3) * 32;
        sparge_wgmma::wgmma_ss_n64<T, 0, 0>(acc, sparge_wgmma::desc_advance(a0, off),
                                            sparge_wgmma::desc_advance(b0, off), kk > 0);
    }
}

/* mbarriers of the warp-specialized kernels (a loading warpgroup and computing ones; forward_sm90.cu,
 * backward_sm90.cu) and their register split. */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* Arrive (release, CTA scope): this thread's earlier writes are visible to whoever waits out the phase. */
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* Wait (acquire, CTA scope) until the phase of this parity has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity)
{
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
template <int REGS>
__device__ __forceinline__ void set_max_regs_dec()
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void set_max_regs_inc()
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

} // namespace sparge_sm90

#endif
