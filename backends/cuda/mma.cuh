/* Tensor-core primitives of the mma.sync tier (sm_80 and newer, CUDA only):
 * cp.async with commit/wait groups, swizzled shared-memory tiles, ldmatrix,
 * mma.sync m16n8k16 (f16/bf16 in, f32 accumulate) and the fragment layouts
 * that tie them together. Shared by forward.cu and backward.cu.
 *
 * Conventions (PTX ISA "Matrix fragments for mma.m16n8k16"), for a lane of a warp
 * with g = lane / 4 ("group", 0..7) and t = lane % 4 ("thread in group", 0..3):
 *   A (16×16, row-major), 4 regs of 2 halves:  a0 = A[g][2t..2t+1]     a1 = A[g+8][2t..2t+1]
 *                                              a2 = A[g][2t+8..2t+9]   a3 = A[g+8][2t+8..2t+9]
 *   B (16×8, k×n), 2 regs of 2 halves:         b0 = B[2t..2t+1][g]     b1 = B[2t+8..2t+9][g]
 *   C/D (16×8, f32), 4 floats:                 c0,c1 = C[g][2t..2t+1]  c2,c3 = C[g+8][2t..2t+1]
 * The low 16 bits of a register hold the lower column (or k) index.
 *
 * Shared-memory tiles are row-major with rows of ROW_CHUNKS 16-byte chunks
 * (ROW_CHUNKS a multiple of 8, i.e. rows of 64 or more 16-bit elements). Chunk c
 * of row r lives at chunk position c ^ (r & 7): the eight rows an ldmatrix reads
 * at one logical chunk then hit eight different bank groups (no conflicts), and
 * cp.async writes of 16 bytes stay aligned.
 *
 * ldmatrix lane addressing (the helpers below return (row, chunk) inside a tile):
 *   lane_a_*   A operand 16×16 at (row0, chunk0) of a row-major [m][k] tile: ldmatrix_x4 → a0..a3.
 *              The same addressing on a row-major [k][n] tile with ldmatrix_x4_trans gives the
 *              B operands of two n8 tiles: r0,r1 = {b0,b1} of columns n0..n0+7, r2,r3 of n0+8..n0+15.
 *   lane_bt_*  B operand from a row-major [n][k] tile (e.g. K when computing Q·Kᵀ), 16 n × 16 k,
 *              ldmatrix_x4 (no transpose): r0,r1 = {b0,b1} of rows n0..n0+7, r2,r3 of n0+8..n0+15.
 *
 * cp.async groups: every cp_async_16 issued since the last commit belongs to the
 * next cp_async_commit(); cp_async_wait<N>() blocks until at most N of this
 * thread's committed groups are still in flight. Other threads' copies are only
 * visible after a __syncthreads() (or __syncwarp() for warp-private data).
 */
#ifndef SPARGE_MMA_CUH
#define SPARGE_MMA_CUH

#ifdef SPARGE_USE_HIP
#error "mma.cuh is the CUDA tensor-core tier; HIP builds use generic.cu"
#endif

#include <stdint.h>

#include "gpu.h"

namespace sparge_mma {

/* ---------------------------------------------------------------- addresses */

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* Byte offset of chunk `chunk` (16 bytes) of row `row` in a swizzled tile. */
template <int ROW_CHUNKS>
__device__ __forceinline__ uint32_t swizzle(int row, int chunk)
{
    static_assert(ROW_CHUNKS % 8 == 0, "swizzled rows need a multiple of 8 chunks (128 bytes)");
    return (uint32_t)((row * ROW_CHUNKS + (chunk ^ (row & 7))) * 16);
}

/* The same offset split for unrolled ldmatrix loops over 16-wide k steps: the chunk
 * pair (2·kk, 2·kk + 1) that a lane reads at k step kk sits at byte
 *   swizzle<ROW_CHUNKS>(row, 2·kk + c) = row·ROW_CHUNKS·16 + (kk·32 ^ swizzle_lane_xor(row, c)),   c ∈ {0, 1},
 * so a loop keeps one lane base address and one XOR per kk (row offsets by multiples of
 * 8 rows do not change it) instead of one register per (row, chunk) pair. */
__device__ __forceinline__ uint32_t swizzle_lane_xor(int row, int c) { return (uint32_t)(((c ^ row) & 7) * 16); }
__device__ __forceinline__ uint32_t swizzle_kstep(int kk, uint32_t lane_xor) { return (uint32_t)(kk * 32) ^ lane_xor; }

/* ldmatrix lane addressing, see the header comment. */
__device__ __forceinline__ int lane_a_row(int lane) { return lane & 15; }
__device__ __forceinline__ int lane_a_chunk(int lane) { return lane >> 4; }
__device__ __forceinline__ int lane_bt_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int lane_bt_chunk(int lane) { return (lane >> 3) & 1; }

/* Accumulator coordinates of this lane inside a 16×8 C tile: rows g and g+8, columns 2t and 2t+1. */
__device__ __forceinline__ int frag_row(int lane) { return lane >> 2; }
__device__ __forceinline__ int frag_col(int lane) { return (lane & 3) * 2; }

/* ---------------------------------------------------------------- cp.async */

/* Copy 16 bytes global → shared, bypassing L1. When !valid nothing is read and
 * the 16 bytes are zero-filled (ragged tails); src must still be a valid address. */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
__device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Step n of a double-buffered loop of nsteps: issue(n + 1, other buffer) prefetches the next step, then
 * waits until step n's group has landed and every thread of the CTA is past step n − 1. */
template <typename Issue>
__device__ __forceinline__ void cp_async_double_buffer_step(int n, int nsteps, Issue &&issue)
{
    if (n + 1 < nsteps) {
        issue(n + 1, (n & 1) ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}

/* ---------------------------------------------------------------- ldmatrix */

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t r[2], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t r[2], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

/* ---------------------------------------------------------------- mma.sync */

/* c += a · b for one m16n8k16 tile; T is gpu_half or gpu_bf16. */
template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]);

#define SPARGE_MMA_16816(T, PTX_TYPE)                                                                                  \
    template <>                                                                                                        \
    __device__ __forceinline__ void mma_16816<T>(float c[4], const uint32_t a[4], const uint32_t b[2])                 \
    {                                                                                                                  \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, "             \
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                                        \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                  \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));                              \
    }
SPARGE_MMA_16816(gpu_bf16, "bf16")
SPARGE_MMA_16816(gpu_half, "f16")
#undef SPARGE_MMA_16816

/* ---------------------------------------------------------------- fragments */

/* Two floats → one register of two 16-bit values (lo in the low half), round to nearest. */
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<gpu_bf16>(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<gpu_half>(float lo, float hi)
{
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The A operand (16 rows × 16 k) made of two adjacent f32 C tiles (16 rows × 8 each):
 * how P = softmax(S) feeds P·V without going through shared memory. */
template <typename T>
__device__ __forceinline__ void c_pair_to_a(uint32_t a[4], const float c_lo[4], const float c_hi[4])
{
    a[0] = pack2<T>(c_lo[0], c_lo[1]);
    a[1] = pack2<T>(c_lo[2], c_lo[3]);
    a[2] = pack2<T>(c_hi[0], c_hi[1]);
    a[3] = pack2<T>(c_hi[2], c_hi[3]);
}

/* Reductions over the 4 lanes of a group (the lanes that share an accumulator row). */
__device__ __forceinline__ float quad_max(float x)
{
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

} // namespace sparge_mma

#endif
