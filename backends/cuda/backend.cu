/* GPU backend glue: devices, memory, streams and the ops tables.
 * Compiled by nvcc (backends "cuda" and "cuda-generic") and by hipcc ("hip"). */
#include <stdio.h>
#include <stdlib.h>

#include "gpu.h"

sparge_status gpu_check(gpuError_t e, const char *file, int line, const char *what)
{
    if (e == gpuSuccess)
        return SPARGE_OK;
    sparge_status s = e == gpuErrorMemoryAllocation ? SPARGE_ERR_OUT_OF_MEMORY : SPARGE_ERR_RUNTIME;
    (void)gpuGetLastError(); /* clear a non-sticky error so the next call starts clean */
    return sparge_fail(s, file, line, "%s failed: %s", what, gpuGetErrorString(e));
}

sparge_status gpu_workspace(gpu_ctx *ctx, size_t bytes, void **out)
{
    if (ctx->workspace_bytes < bytes) {
        sparge_status s;
        /* The old buffer may still be read by queued work. */
        if ((s = GPU_CHECK(gpuStreamSynchronize(ctx->stream))) || (s = GPU_CHECK(gpuFree(ctx->workspace))))
            return s;
        ctx->workspace = NULL;
        ctx->workspace_bytes = 0;
        if ((s = GPU_CHECK(gpuMalloc(&ctx->workspace, bytes))))
            return s;
        ctx->workspace_bytes = bytes;
    }
    *out = ctx->workspace;
    return SPARGE_OK;
}

static int device_count(void)
{
    int n = 0;
    if (gpuGetDeviceCount(&n) != gpuSuccess) {
        (void)gpuGetLastError();
        return 0;
    }
    return n;
}

static sparge_status open_device(int index, void **impl, char *desc, size_t desc_len, int generic)
{
    gpuDeviceProp prop;
    sparge_status s;
    if ((s = GPU_CHECK(gpuSetDevice(index))) || (s = GPU_CHECK(gpuGetDeviceProperties(&prop, index))))
        return s;
    gpu_ctx *ctx = (gpu_ctx *)calloc(1, sizeof *ctx);
    if (!ctx)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "out of host memory");
    ctx->device = index;
    ctx->sm_count = prop.multiProcessorCount;
    ctx->cc_major = prop.major;
    ctx->cc_minor = prop.minor;
    ctx->smem_optin = GPU_SMEM_OPTIN(prop);
    ctx->generic = generic;
    snprintf(desc, desc_len, "%s (%s %d.%d, %d SMs, %.0f GiB)%s", prop.name, SPARGE_VENDOR, prop.major, prop.minor,
             prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0, generic ? ", portable tier" : "");
    *impl = ctx;
    return SPARGE_OK;
}

static void close_device(void *impl)
{
    gpu_ctx *ctx = (gpu_ctx *)impl;
    /* Best effort: closing cannot report failure, and the handle goes away either way. */
    (void)gpuSetDevice(ctx->device);
    (void)gpuStreamSynchronize(ctx->stream);
    (void)gpuFree(ctx->workspace);
    for (int i = 0; i < 2; i++)
        if (ctx->timer[i])
            (void)gpuEventDestroy(ctx->timer[i]);
    free(ctx);
}

/* Every entry point makes the handle's device current: a process may hold several. */
static sparge_status activate(void *impl, gpu_ctx **ctx)
{
    *ctx = (gpu_ctx *)impl;
    return GPU_CHECK(gpuSetDevice((*ctx)->device));
}

static sparge_status dev_alloc(void *impl, size_t bytes, void **ptr)
{
    gpu_ctx *ctx;
    sparge_status s = activate(impl, &ctx);
    return s ? s : GPU_CHECK(gpuMalloc(ptr, bytes));
}

static sparge_status dev_free(void *impl, void *ptr)
{
    gpu_ctx *ctx;
    sparge_status s;
    if ((s = activate(impl, &ctx)) || (s = GPU_CHECK(gpuStreamSynchronize(ctx->stream))))
        return s;
    return GPU_CHECK(gpuFree(ptr));
}

static sparge_status dev_copy(void *impl, void *dst, const void *src, size_t bytes, sparge_copy_kind kind)
{
    gpu_ctx *ctx;
    auto k = kind == SPARGE_COPY_H2D ? gpuMemcpyHostToDevice
             : kind == SPARGE_COPY_D2H ? gpuMemcpyDeviceToHost : gpuMemcpyDeviceToDevice;
    sparge_status s;
    if ((s = activate(impl, &ctx)) || (s = GPU_CHECK(gpuMemcpyAsync(dst, src, bytes, k, ctx->stream))))
        return s;
    /* Host buffers may be pageable and reused by the caller right after. */
    return GPU_CHECK(gpuStreamSynchronize(ctx->stream));
}

static sparge_status dev_fill(void *impl, void *dst, int byte, size_t bytes)
{
    gpu_ctx *ctx;
    sparge_status s = activate(impl, &ctx);
    return s ? s : GPU_CHECK(gpuMemsetAsync(dst, byte, bytes, ctx->stream));
}

static sparge_status dev_sync(void *impl)
{
    gpu_ctx *ctx;
    sparge_status s = activate(impl, &ctx);
    return s ? s : GPU_CHECK(gpuStreamSynchronize(ctx->stream));
}

static sparge_status dev_set_stream(void *impl, void *stream)
{
    gpu_ctx *ctx;
    sparge_status s = activate(impl, &ctx);
    /* The handle's scratch (gpu_workspace: the forward's row order, the backward's accumulators) serves every
     * stream it is given: work queued on the old stream may still read it. */
    if (!s && ctx->stream != (gpuStream_t)stream && !(s = GPU_CHECK(gpuStreamSynchronize(ctx->stream))))
        ctx->stream = (gpuStream_t)stream;
    return s;
}

static sparge_status dev_timer_start(void *impl)
{
    gpu_ctx *ctx;
    sparge_status s = activate(impl, &ctx);
    for (int i = 0; i < 2 && !s; i++)
        if (!ctx->timer[i])
            s = GPU_CHECK(gpuEventCreate(&ctx->timer[i]));
    return s ? s : GPU_CHECK(gpuEventRecord(ctx->timer[0], ctx->stream));
}

static sparge_status dev_timer_stop(void *impl, double *ms)
{
    gpu_ctx *ctx;
    float f = 0.0f;
    sparge_status s = activate(impl, &ctx);
    if (s)
        return s;
    if (!ctx->timer[0])
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_timer_stop: the timer was not started");
    if ((s = GPU_CHECK(gpuEventRecord(ctx->timer[1], ctx->stream))) || (s = GPU_CHECK(gpuEventSynchronize(ctx->timer[1]))) ||
        (s = GPU_CHECK(gpuEventElapsedTime(&f, ctx->timer[0], ctx->timer[1]))))
        return s;
    *ms = f;
    return SPARGE_OK;
}

/* Op entry points: make the device current, then run the op file's entry. */
#define GPU_OP(name, args_t, entry)                                                                                    \
    static sparge_status name(void *impl, const args_t *a)                                                            \
    {                                                                                                                  \
        gpu_ctx *ctx;                                                                                                  \
        sparge_status s = activate(impl, &ctx);                                                                        \
        return s ? s : entry(ctx, a);                                                                                  \
    }
GPU_OP(op_pool, sparge_pool_args, SPARGE_GPU_FN(pool))
GPU_OP(op_map, sparge_map_args, SPARGE_GPU_FN(pooled_map))
GPU_OP(op_select, sparge_select_args, SPARGE_GPU_FN(mask_select))
GPU_OP(op_from_dense, sparge_mask_view, SPARGE_GPU_FN(mask_from_dense))
GPU_OP(op_transpose, sparge_mask_view, SPARGE_GPU_FN(mask_transpose))
GPU_OP(op_predict, sparge_predict_args, SPARGE_GPU_FN(mask_predict))
GPU_OP(op_generic_forward, sparge_fwd_args, SPARGE_GPU_FN(generic_forward))
GPU_OP(op_generic_backward, sparge_bwd_args, SPARGE_GPU_FN(generic_backward))

static sparge_status open_generic(int index, void **impl, char *desc, size_t desc_len)
{
    return open_device(index, impl, desc, desc_len, 1);
}

#ifdef SPARGE_USE_HIP
static sparge_status open_hip(int index, void **impl, char *desc, size_t desc_len)
{
    return open_generic(index, impl, desc, desc_len);
}

extern "C" const sparge_backend sparge_backend_hip = {
    "hip", device_count, open_hip, close_device, dev_alloc, dev_free, dev_copy, dev_fill, dev_sync, dev_set_stream,
    dev_timer_start, dev_timer_stop, op_pool, op_map, op_select, op_from_dense, op_transpose, op_generic_forward,
    op_generic_backward, op_predict};
#else
static sparge_status open_fast(int index, void **impl, char *desc, size_t desc_len)
{
    return open_device(index, impl, desc, desc_len, 0);
}
GPU_OP(op_mma_forward, sparge_fwd_args, sparge_cuda_mma_forward)
GPU_OP(op_mma_backward, sparge_bwd_args, sparge_cuda_mma_backward)

extern "C" const sparge_backend sparge_backend_cuda = {
    "cuda", device_count, open_fast, close_device, dev_alloc, dev_free, dev_copy, dev_fill, dev_sync, dev_set_stream,
    dev_timer_start, dev_timer_stop, op_pool, op_map, op_select, op_from_dense, op_transpose, op_mma_forward,
    op_mma_backward, op_predict};

extern "C" const sparge_backend sparge_backend_cuda_generic = {
    "cuda-generic", device_count, open_generic, close_device, dev_alloc, dev_free, dev_copy, dev_fill, dev_sync,
    dev_set_stream, dev_timer_start, dev_timer_stop, op_pool, op_map, op_select, op_from_dense, op_transpose,
    op_generic_forward, op_generic_backward, op_predict};
#endif
