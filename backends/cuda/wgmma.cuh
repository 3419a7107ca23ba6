/* Hopper warpgroup MMA (wgmma.mma_async, sm_90a) wrappers of forward_sm90.cu, backward_sm90.cu and dq_sm90.cu. */
#ifndef SPARGE_CUDA_WGMMA_CUH
#define SPARGE_CUDA_WGMMA_CUH

#include <stdint.h>

#include "vendor.h"

namespace sparge_wgmma {

/* Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA "Matrix Descriptor Format"). */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32 |
           (uint64_t)1 << 62;
}
/* desc for a start address `bytes` further on: only the low word's address field (address >> 4) changes, and it
 * cannot carry out since shared memory lies below 256 KiB, so one 32-bit add replaces rebuilding the descriptor. */
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes)
{
    return (desc >> 32) << 32 | (uint32_t)((uint32_t)desc + (bytes >> 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accesses of an operand register across wgmma fences/waits. */
__device__ __forceinline__ void fence_operand(float &r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t &r) { asm volatile("" : "+r"(r)::"memory"); }
/* fence_operand on every register of an operand array. */
template <typename R, int N>
__device__ __forceinline__ void fence_operands(R (&x)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        fence_operand(x[i]);
}
template <typename R, int N, int M>
__device__ __forceinline__ void fence_operands(R (&x)[N][M])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        fence_operands(x[i]);
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* d (64×64 f32, accumulator layout) = (accumulate ? d : 0) + A·B, both from shared memory; TRANS_A / TRANS_B = 0: the
 * operand is K-major, 1: MN-major. */
template <typename T, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss_n64(float d[32], uint64_t desc_a, uint64_t desc_b, int accumulate);
/* d (64×N f32) += A·B, A in registers (4 per thread, the accumulator layout packed to 16 bits),
 * B MN-major in shared memory. */
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_t(float d[N / 2], const uint32_t a[4], uint64_t desc_b);
/* d (64×64 f32) = (accumulate ? d : 0) + A·B, A in registers as above, B K-major in shared memory. */
template <typename T>
__device__ __forceinline__ void wgmma_rs_n64(float d[32], const uint32_t a[4], uint64_t desc_b, int accumulate);

/* The asm operand lists of a 64×64 and a 64×128 f32 accumulator: %0..%31 / %0..%63 bound to d[0..]. */
#define SPARGE_WGMMA_ACC32                                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                          \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SPARGE_WGMMA_ACC64                                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                          \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                 \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                 \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SPARGE_WGMMA_OUT32(d)                                                                                          \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                    \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),              \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),            \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define SPARGE_WGMMA_OUT64(d)                                                                                          \
    SPARGE_WGMMA_OUT32(d),                                                                                             \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),            \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),            \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),            \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

/* One specialization per dtype (TYPE: its PTX name) and operand major-ness; only the type names differ. */
#define SPARGE_WGMMA_SS_N64(T, TYPE, TRANS_A, TRANS_B)                                                                 \
    template <>                                                                                                        \
    __device__ __forceinline__ void wgmma_ss_n64<T, TRANS_A, TRANS_B>(float d[32], uint64_t desc_a, uint64_t desc_b,   \
                                                                      int accumulate)                                  \
    {                                                                                                                  \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                      \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " SPARGE_WGMMA_ACC32                \
                     ", %32, %33, p, 1, 1, " #TRANS_A ", " #TRANS_B ";\n}\n"                                           \
                     : SPARGE_WGMMA_OUT32(d)                                                                           \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                     \
    }
/* OPERANDS: the A registers and the B descriptor, numbered after the N/2 accumulators. */
#define SPARGE_WGMMA_RS_T(T, TYPE, N, ACC, OUT, OPERANDS)                                                              \
    template <>                                                                                                        \
    __device__ __forceinline__ void wgmma_rs_t<T, N>(float d[N / 2], const uint32_t a[4], uint64_t desc_b)             \
    {                                                                                                                  \
        asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " ACC ", " OPERANDS             \
                     ", 1, 1, 1, 1;\n"                                                                                 \
                     : OUT(d)                                                                                          \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                                       \
    }

SPARGE_WGMMA_SS_N64(gpu_bf16, "bf16", 0, 0)
SPARGE_WGMMA_SS_N64(gpu_bf16, "bf16", 1, 1)
SPARGE_WGMMA_SS_N64(gpu_half, "f16", 0, 0)
SPARGE_WGMMA_SS_N64(gpu_half, "f16", 1, 1)
#define SPARGE_WGMMA_RS_N64(T, TYPE)                                                                                   \
    template <>                                                                                                        \
    __device__ __forceinline__ void wgmma_rs_n64<T>(float d[32], const uint32_t a[4], uint64_t desc_b,                 \
                                                    int accumulate)                                                    \
    {                                                                                                                  \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                      \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " SPARGE_WGMMA_ACC32                \
                     ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                                    \
                     : SPARGE_WGMMA_OUT32(d)                                                                           \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));                      \
    }

SPARGE_WGMMA_RS_N64(gpu_bf16, "bf16")
SPARGE_WGMMA_RS_N64(gpu_half, "f16")
SPARGE_WGMMA_RS_T(gpu_bf16, "bf16", 64, SPARGE_WGMMA_ACC32, SPARGE_WGMMA_OUT32, "{%32, %33, %34, %35}, %36")
SPARGE_WGMMA_RS_T(gpu_bf16, "bf16", 128, SPARGE_WGMMA_ACC64, SPARGE_WGMMA_OUT64, "{%64, %65, %66, %67}, %68")
SPARGE_WGMMA_RS_T(gpu_half, "f16", 64, SPARGE_WGMMA_ACC32, SPARGE_WGMMA_OUT32, "{%32, %33, %34, %35}, %36")
SPARGE_WGMMA_RS_T(gpu_half, "f16", 128, SPARGE_WGMMA_ACC64, SPARGE_WGMMA_OUT64, "{%64, %65, %66, %67}, %68")

#undef SPARGE_WGMMA_SS_N64
#undef SPARGE_WGMMA_RS_N64
#undef SPARGE_WGMMA_RS_T
#undef SPARGE_WGMMA_OUT64
#undef SPARGE_WGMMA_OUT32
#undef SPARGE_WGMMA_ACC64
#undef SPARGE_WGMMA_ACC32

} // namespace sparge_wgmma

#endif
