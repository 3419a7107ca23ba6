/* Shared by every GPU source (CUDA and HIP): the device context, status
 * helpers and the entry points each op file exports. Plain C++ host code plus
 * device helpers; see vendor.h for the vendor mapping. */
#ifndef SPARGE_GPU_H
#define SPARGE_GPU_H

#include "vendor.h"

#include "../../src/backend.h"

/* The device's tuning options (backend.cu parses them; 0 is each one's "auto"). */
/* _WS: fwd_kernel only (forward_sm90.cu's warp-specialized kernel) */
enum {
    GPU_KERNEL_AUTO = 0,
    GPU_KERNEL_MMA,
    GPU_KERNEL_WGMMA,
    GPU_KERNEL_WGMMA_WS
};
enum { GPU_DQ_AUTO = 0, GPU_DQ_PASS, GPU_DQ_ATOMIC };
enum { GPU_MAP_AUTO = 0, GPU_MAP_128X64, GPU_MAP_64X64, GPU_MAP_F16X3 };
struct gpu_options {
    int fwd_kernel;                    /* GPU_KERNEL_* */
    int fwd_warps, fwd_stages, fwd_split; /* a forced mma.sync forward tile; fwd_warps 0: tiles.h decides */
    int fwd_natural_order;             /* 1: masked rows launch as stored, not heaviest first */
    int bwd_kernel;                    /* GPU_KERNEL_*: the dK/dV kernel */
    int bwd_keys;                      /* keys per CTA of the wgmma dK/dV kernel; 0: by mask */
    int dq;                            /* GPU_DQ_* */
    int bwd_no_overlap;                /* 1: the dK/dV pass waits for the whole dQ pass */
    int map_tile;                      /* GPU_MAP_*: the pooled-map logits kernel */
};

constexpr int GPU_MAX_RETIRED = 48;

struct gpu_ctx {
    int device;
    gpuStream_t stream;
    int sm_count;
    int cc_major, cc_minor;
    size_t smem_optin;      /* max dynamic shared memory per block */
    int generic;            /* 1: portable tier only (cuda-generic, hip) */
    gpuEvent_t timer[2];    /* created on first use */
    void *workspace;        /* grown on demand by gpu_workspace() */
    size_t workspace_bytes;
    void *retired[GPU_MAX_RETIRED]; /* outgrown workspaces, freed at close */
    int n_retired;
    gpu_options opt;
};

/* CUDA and HIP objects of the same sources are linked into one library, so
 * everything with external linkage must differ per vendor: shared helpers are
 * renamed here, and each .cu file keeps its kernels and local helpers in an
 * anonymous namespace (or static). */
#define gpu_check SPARGE_GPU_FN(check)
#define gpu_workspace SPARGE_GPU_FN(workspace)

/* Turn a runtime error into a status with the runtime's message. */
sparge_status gpu_check(gpuError_t e, const char *file, int line, const char *what);
#define GPU_CHECK(call) gpu_check((call), __FILE__, __LINE__, #call)
/* Check the launch that was just queued. */
#define GPU_CHECK_LAUNCH(what) gpu_check(gpuGetLastError(), __FILE__, __LINE__, what)
/* At least `bytes` of scratch device memory for the call being queued on ctx (a later call may reuse it). */
sparge_status gpu_workspace(gpu_ctx *ctx, size_t bytes, void **out);

/* Programmatic dependent launch (CUDA, sm_90+). A kernel queued with it (gpu_launch_dependent below) calls
 * gpu_wait_for_previous_kernel() before touching global memory: it returns once the kernel queued before it
 * has completed and its writes are visible. gpu_allow_next_kernel(), after a block's last writes, lets such
 * a next kernel be scheduled before this grid has fully drained; it orders no memory (the wait does). Both
 * are empty before sm_90 and on HIP, where stream order alone applies. */
__device__ __forceinline__ void gpu_wait_for_previous_kernel()
{
#if !defined(SPARGE_USE_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void gpu_allow_next_kernel()
{
#if !defined(SPARGE_USE_HIP) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;"); /* no memory clobber: it needs no ordering */
#endif
}

#ifndef SPARGE_USE_HIP
/* Queues kernel<<<grid, block, smem>>>(args) on ctx's stream as a programmatic dependent of the kernel queued
 * before it (sm_90+): its grid may launch once every block of that kernel has called gpu_allow_next_kernel() or
 * exited; the kernel orders its reads with gpu_wait_for_previous_kernel() (or an acquire of its own). */
template <typename... Params, typename... Args>
sparge_status gpu_launch_dependent(gpu_ctx *ctx, void (*kernel)(Params...), unsigned grid, unsigned block,
                                   size_t smem, const char *what, Args... args)
{
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = ctx->stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return gpu_check(cudaLaunchKernelEx(&cfg, kernel, args...), __FILE__, __LINE__, what);
}
#endif

/* Queues kernel on ctx's stream, as a programmatic dependent (gpu_launch_dependent) where its device code holds
 * gpu_wait_for_previous_kernel(): PTX built for sm_90 or later, on an sm_90+ device; a plain launch elsewhere
 * (an sm_80 build JIT-compiled on an H200 has no wait). */
template <typename... Params, typename... Args>
sparge_status gpu_launch_after(gpu_ctx *ctx, void (*kernel)(Params...), unsigned grid, unsigned block, size_t smem,
                               const char *what, Args... args)
{
#ifndef SPARGE_USE_HIP
    if (ctx->cc_major >= 9) {
        cudaFuncAttributes fa;
        sparge_status s = gpu_check(cudaFuncGetAttributes(&fa, kernel), __FILE__, __LINE__, what);
        if (s)
            return s;
        if (fa.ptxVersion >= 90)
            return gpu_launch_dependent(ctx, kernel, grid, block, smem, what, args...);
    }
#endif
    kernel<<<grid, block, smem, ctx->stream>>>(args...);
    return GPU_CHECK_LAUNCH(what);
}

constexpr int GPU_MAX_WARPS = 1024 / 32; /* warps of the largest block */

/* A mask's layout on the device (docs/DESIGN.md §1.12): which key blocks a row may keep and which it must. */
struct gpu_layout {
    const int32_t *seq_q, *seq_k; /* varlen token offsets, or NULL */
    int64_t Nq, Nk;               /* fixed lengths (varlen: unused) */
    int64_t H, Nqb;               /* row r = (b·H + h)·Nqb + i */
    int bq, bk, causal;
    int plain;                    /* fixed length and not causal: every row allows all its blocks, forces none */
};

inline gpu_layout gpu_layout_of(const sparge_mask_view *m)
{
    return gpu_layout{m->seq_q, m->seq_k, m->Nq, m->Nk, m->H, m->Nqb, m->bq, m->bk, m->causal,
                      !m->causal && !m->seq_q};
}

/* Row r of the layout: false when it lies past its sequence's query blocks; else its allowed key blocks
 * [0, *allowed) and always-kept blocks *d0..*d1 (sparge_row_rule). */
__device__ __forceinline__ bool gpu_layout_row(const gpu_layout &L, int64_t r, int64_t *allowed, int64_t *d0,
                                               int64_t *d1)
{
    const int64_t b = r / (L.H * L.Nqb), i = r % L.Nqb;
    int64_t nq = L.Nq, nk = L.Nk;
    if (L.seq_q) {
        nq = L.seq_q[b + 1] - L.seq_q[b];
        nk = L.seq_k[b + 1] - L.seq_k[b];
    }
    if (i * L.bq >= nq)
        return false;
    sparge_row_rule(i, nq, nk, L.bq, L.bk, L.causal, allowed, d0, d1);
    return true;
}

/* Top-k's count of a row of n blocks, as backends/cpu/select.c computes it: the products and sums rounded as the
 * host rounds them (no fused multiply-add). */
__device__ __forceinline__ int64_t gpu_topk_count(double topk, int64_t n)
{
    if (topk <= 0.0)
        return 0;
    const int64_t c = (int64_t)floor(__dadd_rn(__dmul_rn(topk, (double)n), 1e-6));
    return c < 1 ? 1 : c > n ? n : c;
}

/* Grouped K/V heads: query head h reads K/V head h / group. gpu_kv_magic(group) (host) makes the divisor a
 * multiply-high, exact for h · group < 2^32; a division by a run-time value in the attention kernels' prologue
 * kept their K/V pointers live through the loop (ptxas: 24 → 100 bytes of spills in the mma.sync forward). */
inline uint32_t gpu_kv_magic(int64_t group)
{
    return group <= 1 ? 0u : (uint32_t)((((uint64_t)1 << 32) + (uint64_t)group - 1) / (uint64_t)group);
}
__device__ __forceinline__ int gpu_kv_head(int h, uint32_t magic) { return magic ? (int)__umulhi((unsigned)h, magic) : h; }

/* Sequence b as an attention kernel sees it: the tensors' batch index, its first query and key token, their counts.
 * Varlen (P's seq_q, seq_k: the B+1 token offsets of the sequences in packed [1, H, T, D] tensors): sequence b;
 * fixed length: batch b, all of P's Nq and Nk. P is the forward's or the backward's parameter block. */
struct gpu_seq {
    int tb, q_off, k_off, nq, nk;
};
template <bool VARLEN, typename P> __device__ __forceinline__ gpu_seq gpu_seq_of(const P &p, int b)
{
    if (VARLEN)
        return {0, p.seq_q[b], p.seq_k[b], p.seq_q[b + 1] - p.seq_q[b], p.seq_k[b + 1] - p.seq_k[b]};
    return {b, 0, 0, p.Nq, p.Nk};
}

/* NaN by the bits: the CUDA build uses fast math. */
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }

/* Inclusive prefix sum over the warp's lanes. */
template <typename T> __device__ __forceinline__ T warp_inclusive_scan(T x)
{
    const int lane = threadIdx.x % SPARGE_WARP_SIZE;
    for (int o = 1; o < SPARGE_WARP_SIZE; o <<= 1) {
        const T y = sparge_shfl_up(x, o);
        if (lane >= o)
            x += y;
    }
    return x;
}

/* Exclusive prefix sum over the block; *total gets the block's sum. scratch
 * holds GPU_MAX_WARPS values. All threads must call it. */
template <typename T> __device__ T block_exclusive_scan(T x, T *total, T *scratch)
{
    const int lane = threadIdx.x % SPARGE_WARP_SIZE, warp = threadIdx.x / SPARGE_WARP_SIZE;
    const int warps = (blockDim.x + SPARGE_WARP_SIZE - 1) / SPARGE_WARP_SIZE;
    const T incl = warp_inclusive_scan(x);
    if (lane == SPARGE_WARP_SIZE - 1)
        scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const T w = warp_inclusive_scan(lane < warps ? scratch[lane] : T(0));
        if (lane < warps)
            scratch[lane] = w;
    }
    __syncthreads();
    T before = warp > 0 ? scratch[warp - 1] : T(0);
    *total = scratch[warps - 1];
    __syncthreads(); /* scratch may be reused right away */
    return before + incl - x;
}

/* Element load/store for the three storage dtypes, fp32 in registers. */
template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<gpu_half>(gpu_half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<gpu_bf16>(gpu_bf16 x) { return sparge_bf16_to_float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ gpu_half from_f32<gpu_half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ gpu_bf16 from_f32<gpu_bf16>(float x) { return sparge_float_to_bf16(x); }

/* 16-byte vector load: vec16<T>::n elements of T, converted to fp32.
 * p must be 16-byte aligned. */
template <typename T> struct vec16 { static constexpr int n = 16 / (int)sizeof(T); };
template <typename T> __device__ __forceinline__ void load_vec16(const T *p, float *out)
{
    uint4 raw = *(const uint4 *)p;
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
    if constexpr (sizeof(T) == 4) {
        for (int e = 0; e < 4; e++)
            out[e] = __uint_as_float(w[e]);
    } else {
        for (int e = 0; e < 4; e++) {
            unsigned short lo = (unsigned short)(w[e] & 0xffffu), hi = (unsigned short)(w[e] >> 16);
            T tlo, thi;
            __builtin_memcpy(&tlo, &lo, 2);
            __builtin_memcpy(&thi, &hi, 2);
            out[2 * e] = to_f32<T>(tlo);
            out[2 * e + 1] = to_f32<T>(thi);
        }
    }
}

/* Entry points of the op files (SPARGE_GPU_FN adds the vendor prefix). Each runs a call its tier's supports()
 * (backend.cu) accepted. */
sparge_status SPARGE_GPU_FN(pool)(gpu_ctx *ctx, const sparge_pool_args *a);
/* Pools two tensors (Q and K) in one launch; both share one dtype (pool.cu). */
sparge_status SPARGE_GPU_FN(pool_pair)(gpu_ctx *ctx, const sparge_pool_args *a, const sparge_pool_args *b);
sparge_status SPARGE_GPU_FN(pooled_map)(gpu_ctx *ctx, const sparge_map_args *a);
/* The two steps of the map (map.cu), for the fused prediction: the logits scale·qbar·kbarᵀ into a->map, and
 * their row softmax in place. */
sparge_status SPARGE_GPU_FN(map_logits)(gpu_ctx *ctx, const sparge_map_args *a);
sparge_status SPARGE_GPU_FN(map_softmax)(gpu_ctx *ctx, const sparge_map_args *a);
/* Whether the map of these sizes runs with the device's map_tile option (tensor tier: tensor cores allowed). */
sparge_status SPARGE_GPU_FN(map_fits)(const gpu_ctx *ctx, const sparge_op_desc *d, bool tensor_tier);
sparge_status SPARGE_GPU_FN(mask_select)(gpu_ctx *ctx, const sparge_select_args *a);
/* Softmax and selection of predicted logits rows in a->map.map (select.cu). */
sparge_status SPARGE_GPU_FN(select_predicted)(gpu_ctx *ctx, const sparge_predict_args *a);
/* Widest row the selection takes, in key blocks. */
constexpr int64_t GPU_SELECT_MAX_ROW = 512 * 16;
sparge_status SPARGE_GPU_FN(mask_predict)(gpu_ctx *ctx, const sparge_predict_args *a);
sparge_status SPARGE_GPU_FN(mask_from_dense)(gpu_ctx *ctx, const sparge_mask_view *m);
sparge_status SPARGE_GPU_FN(mask_transpose)(gpu_ctx *ctx, const sparge_mask_view *m);
/* Portable tier (generic.cu): f32/f16/bf16, D ≤ 256 where a tile fits the device's shared memory. */
sparge_status SPARGE_GPU_FN(generic_forward)(gpu_ctx *ctx, const sparge_fwd_args *a);
sparge_status SPARGE_GPU_FN(generic_backward)(gpu_ctx *ctx, const sparge_bwd_args *a);
/* Whether a tile of the portable kernels fits the device for head dim D (forward, or the backward's two). */
sparge_status SPARGE_GPU_FN(generic_fits)(const gpu_ctx *ctx, int64_t D, bool backward);
#ifndef SPARGE_USE_HIP
/* Tensor-core tier (forward.cu, backward.cu; sm_90a kernels in *_sm90.cu): mma.sync and wgmma, f16/bf16,
 * D a multiple of 8 up to 128, and 256 (its backward on sm_90 only), masks of 128 × 64 or 128 × 128 blocks. */
sparge_status sparge_cuda_mma_forward(gpu_ctx *ctx, const sparge_fwd_args *a);
sparge_status sparge_cuda_mma_backward(gpu_ctx *ctx, const sparge_bwd_args *a);
/* The kernels these options and this device pick for head dim D exist in the build and fit the device. */
sparge_status sparge_cuda_forward_fits(const gpu_ctx *ctx, int D);
sparge_status sparge_cuda_backward_fits(const gpu_ctx *ctx, int D, int bk, int deterministic); /* bk 0: dense */
#endif

#endif
