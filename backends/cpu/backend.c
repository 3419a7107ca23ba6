/* The CPU backend's two tiers: their ops tables, their limits, device plumbing and options. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "config.h"
#include "cpu.h"
#include "topology.h"

/* Both tiers: every op, any layout; attention up to SPARGE_CPU_MAX_D; f64 storage on cpu-ref only. */
static sparge_status cpu_supports(const char *tier, const sparge_op_desc *d)
{
    if (d->dtype == SPARGE_F64 && strcmp(tier, "cpu-ref"))
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: f64 tensors run on cpu-ref only", tier);
    if ((d->op == SPARGE_OP_FORWARD || d->op == SPARGE_OP_BACKWARD) && d->head_dim > SPARGE_CPU_MAX_D)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: head dimension D = %lld exceeds the CPU limit of %d", tier,
                           (long long)d->head_dim, SPARGE_CPU_MAX_D);
    return SPARGE_OK;
}

static sparge_status ref_supports(void *impl, const sparge_op_desc *d)
{
    (void)impl;
    return cpu_supports("cpu-ref", d);
}

static sparge_status fast_supports(void *impl, const sparge_op_desc *d)
{
    (void)impl;
    return cpu_supports("cpu", d);
}

static int one_device(void) { return 1; }

static sparge_status host_alloc(void *impl, size_t bytes, void **ptr)
{
    (void)impl;
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = rounded >= bytes ? aligned_alloc(64, rounded) : NULL;
    if (!p)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes of host memory", bytes);
    *ptr = p;
    return SPARGE_OK;
}

static sparge_status host_free(void *impl, void *ptr)
{
    (void)impl;
    free(ptr);
    return SPARGE_OK;
}

static sparge_status host_copy(void *impl, void *dst, const void *src, size_t bytes, sparge_copy_kind kind)
{
    (void)impl, (void)kind;
    memmove(dst, src, bytes);
    return SPARGE_OK;
}

static sparge_status host_fill(void *impl, void *dst, int byte, size_t bytes)
{
    (void)impl;
    memset(dst, byte, bytes);
    return SPARGE_OK;
}

static sparge_status ref_open(int index, void **impl, char *desc, size_t len)
{
    (void)index;
    *impl = NULL; /* NULL impl: the shared CPU helpers run single-threaded */
    snprintf(desc, len, "scalar fp64 reference (oracle), one thread");
    return SPARGE_OK;
}

const sparge_backend sparge_backend_cpu_ref = {
    .name = "cpu-ref",
    .device_count = one_device,
    .open = ref_open,
    .alloc = host_alloc,
    .free = host_free,
    .copy = host_copy,
    .fill = host_fill,
    .supports = ref_supports,
    .pool = sparge_ref_pool,
    .pooled_map = sparge_ref_pooled_map,
    .mask_select = sparge_ref_mask_select,
    .forward = sparge_ref_forward,
    .backward = sparge_ref_backward,
    .mask_from_dense = sparge_cpu_mask_from_dense,
    .mask_transpose = sparge_cpu_mask_transpose,
};

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(SPARGE_HAVE_AVX2)
#include <cpuid.h>
/* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c". Its VEX encoding
 * needs the AVX state the "avx2" check already requires of the OS. */
static int has_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
#endif

/* The SIMD tiers this CPU runs, widest first; returns the count. */
static int usable_simd(const sparge_simd_ops *out[3])
{
    int n = 0;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#ifdef SPARGE_HAVE_AVX512
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        out[n++] = &sparge_simd_avx512;
#endif
#ifdef SPARGE_HAVE_AVX2
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c())
        out[n++] = &sparge_simd_avx2;
#endif
#endif
    out[n++] = &sparge_simd_generic;
    return n;
}

static const sparge_option_def cpu_options[] = {
    {"simd", "SPARGE_CPU_SIMD", "auto|avx512|avx2|generic",
     "SIMD tier of the cpu micro-kernels; one the CPU cannot run falls back to the widest it can"},
};

/* "auto" or a tier name: the named tier where this CPU runs it, else the widest it runs. */
static sparge_status cpu_set_option(void *impl, int index, const char *value)
{
    (void)index;
    cpu_ctx *ctx = impl;
    if (strcmp(value, "auto") && strcmp(value, "generic") && strcmp(value, "avx2") && strcmp(value, "avx512"))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "cpu: option simd must be auto, avx512, avx2 or generic, got \"%s\"",
                           value);
    const sparge_simd_ops *usable[3];
    int n = usable_simd(usable);
    ctx->simd = usable[0];
    for (int i = 0; i < n; i++)
        if (!strcmp(value, usable[i]->name))
            ctx->simd = usable[i];
    return SPARGE_OK;
}

static int max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static sparge_status cpu_open(int index, void **impl, char *desc, size_t len)
{
    (void)index;
    cpu_ctx *ctx = malloc(sizeof *ctx);
    if (!ctx)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory");
    cpu_set_option(ctx, 0, "auto");
    int bound = sparge_cpu_bind_threads();
    snprintf(desc, len, "%d OpenMP thread(s), widest SIMD tier %s, %s", max_threads(), ctx->simd->name,
             bound ? "workers bound to cores by hwloc" : "not bound");
    *impl = ctx;
    return SPARGE_OK;
}

static void cpu_close(void *impl) { free(impl); }

const sparge_backend sparge_backend_cpu = {
    .name = "cpu",
    .device_count = one_device,
    .open = cpu_open,
    .close = cpu_close,
    .alloc = host_alloc,
    .free = host_free,
    .copy = host_copy,
    .fill = host_fill,
    .supports = fast_supports,
    .pool = sparge_cpu_pool,
    .pooled_map = sparge_cpu_pooled_map,
    .mask_select = sparge_cpu_mask_select,
    .forward = sparge_cpu_forward,
    .backward = sparge_cpu_backward,
    .mask_from_dense = sparge_cpu_mask_from_dense,
    .mask_transpose = sparge_cpu_mask_transpose,
    .options = cpu_options,
    .n_options = sizeof cpu_options / sizeof cpu_options[0],
    .set_option = cpu_set_option,
};
