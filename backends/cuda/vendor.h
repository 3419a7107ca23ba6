/* One source, two vendors: the names the GPU sources use, mapped to CUDA or
 * to HIP (compiled by hipcc with SPARGE_USE_HIP). Kernels use these names and
 * SPARGE_WARP_SIZE / the shuffle helpers, never the vendor's directly. */
#ifndef SPARGE_GPU_VENDOR_H
#define SPARGE_GPU_VENDOR_H

#ifdef SPARGE_USE_HIP
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
/* ROCm >= 5.7 has <hip/hip_bf16.h> (__hip_bfloat16); Debian's ROCm 5.2 only
 * <hip/hip_bfloat16.h> (hip_bfloat16). Both are 2-byte storage types; the
 * conversions below go through the bits, so they behave the same on either. */
#if __has_include(<hip/hip_bf16.h>)
#include <hip/hip_bf16.h>
typedef __hip_bfloat16 gpu_bf16;
#else
#include <hip/hip_bfloat16.h>
typedef hip_bfloat16 gpu_bf16;
#endif
#define gpuError_t hipError_t
#define gpuSuccess hipSuccess
#define gpuErrorMemoryAllocation hipErrorOutOfMemory
#define gpuStream_t hipStream_t
#define gpuEvent_t hipEvent_t
#define gpuDeviceProp hipDeviceProp_t
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuSetDevice hipSetDevice
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuEventCreate hipEventCreate
#define gpuEventDestroy hipEventDestroy
#define gpuEventRecord hipEventRecord
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventElapsedTime hipEventElapsedTime
#define gpuFuncSetAttribute(f, a, v) hipFuncSetAttribute((const void *)(f), a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
/* ROCm 5.2 has no opt-in field: a block may use all of its LDS (64 KiB on CDNA/RDNA). */
#define GPU_SMEM_OPTIN(prop) ((prop).sharedMemPerBlock)
typedef __half gpu_half;
#define SPARGE_GPU_FN(name) sparge_hip_##name
#define SPARGE_VENDOR "hip"
/* CDNA (gfx9) runs 64-wide wavefronts, RDNA (gfx10+) 32-wide. */
#if defined(__GFX10__) || defined(__GFX11__) || defined(__GFX12__)
#define SPARGE_WARP_SIZE 32
#else
#define SPARGE_WARP_SIZE 64
#endif
#define SPARGE_FULL_MASK 0xffffffffffffffffull
#define sparge_shfl_xor(v, m) __shfl_xor((v), (m))
#define sparge_shfl(v, l) __shfl((v), (l))
#define sparge_shfl_up(v, d) __shfl_up((v), (d))
/* Lane masks: bit i = lane i (the upper 32 bits are 0 on wave32). */
typedef unsigned long long sparge_lanes;
#define sparge_ballot(p) ((sparge_lanes)__ballot(p))
#define sparge_popc(m) __popcll(m)
#define sparge_ffs(m) __ffsll((long long)(m)) /* 1 + the lowest set lane, 0 for none */
/* Orders the wavefront's shared-memory accesses before and after it (what __syncwarp does on CUDA). */
#define sparge_syncwarp()                                                                                              \
    do {                                                                                                               \
        __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");                                                        \
        __builtin_amdgcn_wave_barrier();                                                                               \
        __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");                                                        \
    } while (0)
__device__ __forceinline__ float sparge_bf16_to_float(gpu_bf16 x)
{
    unsigned short bits;
    __builtin_memcpy(&bits, &x, sizeof bits);
    return __uint_as_float((unsigned)bits << 16);
}
/* Round to nearest even; NaN stays a (quiet) NaN. */
__device__ __forceinline__ gpu_bf16 sparge_float_to_bf16(float f)
{
    unsigned u = __float_as_uint(f);
    unsigned short bits = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                                          : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    gpu_bf16 x;
    __builtin_memcpy(&x, &bits, sizeof bits);
    return x;
}
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define gpuError_t cudaError_t
#define gpuSuccess cudaSuccess
#define gpuErrorMemoryAllocation cudaErrorMemoryAllocation
#define gpuStream_t cudaStream_t
#define gpuEvent_t cudaEvent_t
#define gpuDeviceProp cudaDeviceProp
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuSetDevice cudaSetDevice
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuEventCreate cudaEventCreate
#define gpuEventDestroy cudaEventDestroy
#define gpuEventRecord cudaEventRecord
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventElapsedTime cudaEventElapsedTime
#define gpuFuncSetAttribute(f, a, v) cudaFuncSetAttribute((f), a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define GPU_SMEM_OPTIN(prop) ((prop).sharedMemPerBlockOptin)
typedef __half gpu_half;
typedef __nv_bfloat16 gpu_bf16;
#define SPARGE_GPU_FN(name) sparge_cuda_##name
#define SPARGE_VENDOR "cuda"
#define SPARGE_WARP_SIZE 32
#define SPARGE_FULL_MASK 0xffffffffu
#define sparge_shfl_xor(v, m) __shfl_xor_sync(SPARGE_FULL_MASK, (v), (m))
#define sparge_shfl(v, l) __shfl_sync(SPARGE_FULL_MASK, (v), (l))
#define sparge_shfl_up(v, d) __shfl_up_sync(SPARGE_FULL_MASK, (v), (d))
typedef unsigned sparge_lanes; /* bit i = lane i */
#define sparge_ballot(p) __ballot_sync(SPARGE_FULL_MASK, (p))
#define sparge_popc(m) __popc(m)
#define sparge_ffs(m) __ffs((int)(m))
#define sparge_syncwarp() __syncwarp()
#define sparge_bf16_to_float __bfloat162float
#define sparge_float_to_bf16 __float2bfloat16_rn
#endif

#endif
