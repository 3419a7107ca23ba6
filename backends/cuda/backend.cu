/* GPU backend glue: devices, memory, streams and the ops tables.
 * Compiled by nvcc (backends "cuda" and "cuda-generic") and by hipcc ("hip"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

sparge_status gpu_check(gpuError_t e, const char *file, int line, const char *what)
{
    if (e == gpuSuccess)
        return SPARGE_OK;
    sparge_status s = e == gpuErrorMemoryAllocation ? SPARGE_ERR_OUT_OF_MEMORY : SPARGE_ERR_RUNTIME;
    (void)gpuGetLastError(); /* clear a non-sticky error so the next call starts clean */
    return sparge_fail(s, file, line, "%s failed: %s", what, gpuGetErrorString(e));
}

/* A buffer outgrown is kept until the device closes instead of freed: queued work or a captured CUDA graph may
 * still read it, and growth by at least half keeps the retired ones below twice the last. */
sparge_status gpu_workspace(gpu_ctx *ctx, size_t bytes, void **out)
{
    if (ctx->workspace_bytes < bytes) {
        if (ctx->workspace && ctx->n_retired == GPU_MAX_RETIRED)
            return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "GPU scratch memory grew %d times; close and reopen the device",
                               GPU_MAX_RETIRED);
        const size_t grown = ctx->workspace_bytes + ctx->workspace_bytes / 2;
        const size_t want = bytes > grown ? bytes : grown;
        void *fresh;
        sparge_status s = GPU_CHECK(gpuMalloc(&fresh, want));
        if (s)
            return s;
        if (ctx->workspace)
            ctx->retired[ctx->n_retired++] = ctx->workspace;
        ctx->workspace = fresh;
        ctx->workspace_bytes = want;
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
    for (int i = 0; i < ctx->n_retired; i++)
        (void)gpuFree(ctx->retired[i]);
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

/* ---------------------------------------------------------------- options */

static const sparge_option_def gpu_option_defs[] = {
    {"map_tile", "SPARGE_CUDA_MAP_TILE", "auto|128x64|64x64|f16x3",
     "pooled-map logits: fp32 FMA tiles (128x64, 64x64: same bits) or tensor cores on fp16 hi/lo splits (f16x3)"},
    {"fwd_kernel", "SPARGE_CUDA_FWD_KERNEL", "auto|mma|wgmma|wgmma-ws",
     "tensor-core forward: mma.sync, sm_90a wgmma, or sm_90a wgmma warp-specialized (a loading warpgroup, two "
     "computing ones with Q in registers, overlapping each tile's softmax with the MMAs; D = 256 runs wgmma)"},
    {"fwd_tile", "SPARGE_CUDA_FWD_TILE", "auto|WARPS,STAGES[,SPLIT]", "mma.sync forward tile (tiles.h)"},
    {"fwd_order", "SPARGE_CUDA_FWD_ORDER", "auto|head|natural",
     "masked forward launch order: each head's rows heaviest first (head), or as stored"},
    {"bwd_kernel", "SPARGE_CUDA_BWD_KERNEL", "auto|mma|wgmma|wgmma-ws",
     "tensor-core backward: mma.sync, sm_90a wgmma, or the wgmma dK/dV kernel warp-specialized where it takes 128 "
     "keys a CTA (a loading warpgroup feeding two computing ones through mbarriers; wgmma elsewhere)"},
    {"bwd_keys", "SPARGE_CUDA_BWD_KEYS", "auto|64|128", "keys per CTA of the wgmma dK/dV kernel"},
    {"dq", "SPARGE_CUDA_DQ", "auto|pass|atomic",
     "backward dQ: a separate pass over the mask or fp32 atomics (deterministic always takes the pass)"},
    {"bwd_overlap", "SPARGE_CUDA_BWD_OVERLAP", "auto|on|off",
     "the dK/dV pass may start on the SMs the wgmma dQ pass's last wave leaves idle"},
};
enum {
    OPT_MAP_TILE,
    OPT_FWD_KERNEL,
    OPT_FWD_TILE,
    OPT_FWD_ORDER,
    OPT_BWD_KERNEL,
    OPT_BWD_KEYS,
    OPT_DQ,
    OPT_BWD_OVERLAP
};

/* value's position in def's "auto|a|b" list (0 for auto), or -1. */
static int choice(const sparge_option_def *def, const char *value)
{
    const char *p = def->values;
    for (int i = 0;; i++) {
        const char *end = strchr(p, '|');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        if (strlen(value) == n && strncmp(value, p, n) == 0)
            return i;
        if (!end)
            return -1;
        p = end + 1;
    }
}

static sparge_status set_gpu_option(gpu_ctx *ctx, int index, const char *value)
{
    const sparge_option_def *def = &gpu_option_defs[index];
    gpu_options &o = ctx->opt;
    if (index == OPT_FWD_TILE && strcmp(value, "auto")) {
        int w = 0, st = 0, split = 0;
        char tail = 0;
        const int n = sscanf(value, "%d,%d,%d%c", &w, &st, &split, &tail);
        if ((n != 2 && n != 3) || (w != 4 && w != 8) || st < 2 || st > 8 || (split != 0 && split != 1))
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "option fwd_tile must be auto or WARPS,STAGES[,SPLIT] (4 or 8 warps, "
                               "2-8 stages, split 0 or 1), got \"%s\"", value);
        o.fwd_warps = w, o.fwd_stages = st, o.fwd_split = split;
        return SPARGE_OK;
    }
    const int c = index == OPT_FWD_TILE ? 0 : choice(def, value);
    if (c < 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "option %s must be one of %s, got \"%s\"", def->name, def->values, value);
    switch (index) {
    case OPT_MAP_TILE: o.map_tile = c; break; /* the GPU_MAP_* order */
    case OPT_FWD_KERNEL: o.fwd_kernel = c; break;
    case OPT_FWD_TILE: o.fwd_warps = 0; break;
    case OPT_FWD_ORDER: o.fwd_natural_order = c == 2; break;
    case OPT_BWD_KERNEL: o.bwd_kernel = c; break;
    case OPT_BWD_KEYS: o.bwd_keys = c == 0 ? 0 : c == 1 ? 64 : 128; break;
    case OPT_DQ: o.dq = c; break;
    case OPT_BWD_OVERLAP: o.bwd_no_overlap = c == 2; break;
    }
    return SPARGE_OK;
}

static sparge_status set_option_all(void *impl, int index, const char *value)
{
    return set_gpu_option((gpu_ctx *)impl, index, value);
}

/* The portable tier's devices take the map option only. */
static sparge_status set_option_map(void *impl, int index, const char *value)
{
    (void)index;
    return set_gpu_option((gpu_ctx *)impl, OPT_MAP_TILE, value);
}

/* ---------------------------------------------------------------- limits */

/* Mask prediction, pooled map and selection: the same kernels on every tier (the tensor-core logits only on the
 * tensor tier). */
static sparge_status mask_op_supports(const gpu_ctx *ctx, const sparge_op_desc *d, bool tensor_tier)
{
    const int64_t row = d->op == SPARGE_OP_MASK_PREDICT ? (d->Nk + d->block_k - 1) / d->block_k : d->Nk;
    if ((d->op == SPARGE_OP_MASK_PREDICT || d->op == SPARGE_OP_MASK_SELECT) && row > GPU_SELECT_MAX_ROW)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                           "mask selection: rows of %lld key blocks exceed the GPU block sort's limit of %lld "
                           "(raise block_k or select on the CPU)", (long long)row, (long long)GPU_SELECT_MAX_ROW);
    if (d->op == SPARGE_OP_MASK_PREDICT || d->op == SPARGE_OP_POOLED_MAP)
        return SPARGE_GPU_FN(map_fits)(ctx, d, tensor_tier);
    return SPARGE_OK;
}

static sparge_status no_f64(const sparge_op_desc *d, const char *tier)
{
    if (d->dtype == SPARGE_F64)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: f64 tensors run on cpu-ref only", tier);
    return SPARGE_OK;
}

static sparge_status generic_supports(void *impl, const sparge_op_desc *d)
{
    const gpu_ctx *ctx = (const gpu_ctx *)impl;
    if (no_f64(d, "gpu"))
        return SPARGE_ERR_UNSUPPORTED;
    switch (d->op) {
    case SPARGE_OP_FORWARD:
    case SPARGE_OP_BACKWARD: return SPARGE_GPU_FN(generic_fits)(ctx, d->head_dim, d->op == SPARGE_OP_BACKWARD);
    default: return mask_op_supports(ctx, d, false);
    }
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

/* Every field in the order of struct sparge_backend (C++ designated initializers must keep it). */
#define GPU_TIER(NAME, NEXT, OPEN, SUPPORTS, FORWARD, BACKWARD, OPTIONS, N_OPTIONS, SET_OPTION)                      \
    {.name = NAME, .next = NEXT, .device_count = device_count, .open = OPEN, .close = close_device,                   \
     .alloc = dev_alloc, .free = dev_free, .copy = dev_copy, .fill = dev_fill, .synchronize = dev_sync,              \
     .set_stream = dev_set_stream, .timer_start = dev_timer_start, .timer_stop = dev_timer_stop,                     \
     .supports = SUPPORTS, .pool = op_pool, .pooled_map = op_map, .mask_select = op_select,                          \
     .mask_predict = op_predict, .forward = FORWARD, .backward = BACKWARD, .mask_from_dense = op_from_dense,         \
     .mask_transpose = op_transpose, .options = OPTIONS, .n_options = N_OPTIONS, .set_option = SET_OPTION}

static sparge_status open_generic(int index, void **impl, char *desc, size_t desc_len)
{
    return open_device(index, impl, desc, desc_len, 1);
}

/* Host code only: the device pass of hipcc must not emit the tables (const globals naming host functions). */
#ifdef SPARGE_USE_HIP
#ifndef __HIP_DEVICE_COMPILE__
extern "C" const sparge_backend sparge_backend_hip =
    GPU_TIER("hip", nullptr, open_generic, generic_supports, op_generic_forward, op_generic_backward,
             &gpu_option_defs[OPT_MAP_TILE], 1, set_option_map);
#endif
#else
static sparge_status open_fast(int index, void **impl, char *desc, size_t desc_len)
{
    return open_device(index, impl, desc, desc_len, 0);
}
GPU_OP(op_mma_forward, sparge_fwd_args, sparge_cuda_mma_forward)
GPU_OP(op_mma_backward, sparge_bwd_args, sparge_cuda_mma_backward)

/* The tensor-core tier's limits: f16/bf16, D a multiple of 8 up to 128 and 256, sm_80+, 16-byte rows,
 * masks of 128-row query blocks and 64- or 128-key blocks, 32-bit token and block counts; then whether the kernels its
 * options pick fit the device. */
static sparge_status cuda_supports(void *impl, const sparge_op_desc *d)
{
    const gpu_ctx *ctx = (const gpu_ctx *)impl;
    if (no_f64(d, "cuda"))
        return SPARGE_ERR_UNSUPPORTED;
    if (d->op != SPARGE_OP_FORWARD && d->op != SPARGE_OP_BACKWARD)
        return mask_op_supports(ctx, d, true);
    const char *what = d->op == SPARGE_OP_FORWARD ? "cuda forward" : "cuda backward";
    if (d->dtype != SPARGE_F16 && d->dtype != SPARGE_BF16)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: the tensor cores take f16 and bf16, not %s", what,
                           sparge_dtype_name(d->dtype));
    const int64_t D = d->head_dim;
    if (D % 8 || (D > 128 && D != 256))
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: head dim %lld (the tensor-core kernels take multiples of 8 up to "
                           "128, and 256)", what, (long long)D);
    if (ctx->cc_major < 8)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: the tensor-core kernels need sm_80 or newer (device is sm_%d%d)",
                           what, ctx->cc_major, ctx->cc_minor);
    if (d->block_q && (d->block_q != 128 || (d->block_k != 64 && d->block_k != 128)))
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: mask blocks of %d x %d (the tensor-core kernels take 128 x 64 "
                           "and 128 x 128)", what, d->block_q, d->block_k);
    if (!d->rows_aligned)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: every row must be contiguous along D and start 16-byte "
                           "aligned (data pointer and B/H/N strides multiples of 8 elements)", what);
    if (d->kv_heads > 65535 || d->H > 65535)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: more than 65535 heads", what); /* gpu_kv_head's range */
    if (d->Nq > INT32_MAX - 128 || d->Nk > INT32_MAX - 128 || d->B * d->H * ((d->Nq + 127) / 128) > INT32_MAX ||
        d->B * d->H * ((d->Nk + 63) / 64) > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: more than 2^31 tokens or blocks", what);
    if (d->op == SPARGE_OP_FORWARD)
        return sparge_cuda_forward_fits(ctx, (int)d->head_dim);
    return sparge_cuda_backward_fits(ctx, (int)d->head_dim, d->block_k, d->deterministic);
}

extern "C" const sparge_backend sparge_backend_cuda_generic =
    GPU_TIER("cuda-generic", nullptr, open_generic, generic_supports, op_generic_forward, op_generic_backward,
             &gpu_option_defs[OPT_MAP_TILE], 1, set_option_map);

/* cuda:N runs on the tensor-core tier, and what it cannot run on the portable tier of the same GPU. */
extern "C" const sparge_backend sparge_backend_cuda =
    GPU_TIER("cuda", &sparge_backend_cuda_generic, open_fast, cuda_supports, op_mma_forward, op_mma_backward,
             gpu_option_defs, sizeof gpu_option_defs / sizeof gpu_option_defs[0], set_option_all);
#endif
