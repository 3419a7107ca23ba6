/* Internal contract between the core and the backends.
 *
 * The core validates every argument once (shapes, dtypes, strides, ranges,
 * overflow, mask compatibility) and hands each backend flat, pre-validated
 * argument structs through one ops table per backend. A NULL slot means
 * "unsupported": the core answers SPARGE_ERR_UNSUPPORTED. A backend may still
 * refuse a valid call it cannot serve (e.g. D = 96 on a GPU kernel) with
 * SPARGE_ERR_UNSUPPORTED and a message naming the limit.
 *
 * This header is included by C and by CUDA/HIP C++ sources. */
#ifndef SPARGE_BACKEND_H
#define SPARGE_BACKEND_H

#include "sparge.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Flat view of a validated tensor: element strides, dims in [B,H,N,D] order. */
typedef struct {
    void *data;
    sparge_dtype dtype;
    int64_t B, H, N, D;
    int64_t sb, sh, sn, sd;
} sparge_view;

/* Device arrays of a mask (all int32 unless noted), see sparge.h. */
typedef struct {
    int64_t B, H, Nq, Nk, Nqb, Nkb;
    int bq, bk;
    int32_t *counts;    /* [B*H*Nqb] */
    int32_t *indices;   /* [B*H*Nqb*Nkb], ascending, -1 past count */
    /* the transpose, written only by mask_transpose: */
    int32_t *t_counts;  /* [B*H*Nkb] */
    int32_t *t_indices; /* [B*H*Nkb*Nqb], ascending, -1 past count */
    uint8_t *dense;     /* [B*H*Nqb*Nkb] */
    float *row_mass;    /* [B*H*Nqb] */
} sparge_mask_view;

typedef struct {
    sparge_view x;   /* input */
    int block;
    sparge_view out; /* f32 [B,H,Nb,D] */
} sparge_pool_args;

typedef struct {
    sparge_view qbar, kbar; /* f32 */
    float scale;
    sparge_view map; /* f32 [B,H,Nqb,Nkb] */
} sparge_map_args;

typedef struct {
    sparge_view map; /* f32 [B,H,Nqb,Nkb], rows are probabilities */
    double topk, topp;
    sparge_mask_view mask; /* writes counts, indices, dense, row_mass */
} sparge_select_args;

/* The whole of sparge_mask_predict: pool Q and K, the pooled map (softmax
 * rows written to map.map), selection into mask (as mask_select). */
typedef struct {
    sparge_pool_args q, k;
    sparge_map_args map;
    double topk, topp;
    sparge_mask_view mask;
} sparge_predict_args;

typedef struct {
    sparge_view q, k, v, o;
    float *lse;       /* [B*H*Nq] or NULL */
    float scale;
    int bq, bk;       /* blocking of the mask (or of the dense path) */
    const sparge_mask_view *mask; /* NULL: dense */
} sparge_fwd_args;

typedef struct {
    sparge_view q, k, v, o, d_o, dq, dk, dv;
    const float *lse;
    float scale;
    int bq, bk;
    int deterministic;
    const sparge_mask_view *mask; /* NULL: dense; its transpose is current */
} sparge_bwd_args;

typedef enum { SPARGE_COPY_H2D, SPARGE_COPY_D2H, SPARGE_COPY_D2D } sparge_copy_kind;

typedef struct sparge_backend {
    const char *name;          /* "cpu", "cuda", ... */
    int (*device_count)(void); /* 0: none present */
    /* Fill *impl for device `index`; describe into desc (≤ 255 chars). */
    sparge_status (*open)(int index, void **impl, char *desc, size_t desc_len);
    void (*close)(void *impl);

    sparge_status (*alloc)(void *impl, size_t bytes, void **ptr);
    sparge_status (*free)(void *impl, void *ptr);
    sparge_status (*copy)(void *impl, void *dst, const void *src, size_t bytes, sparge_copy_kind kind);
    sparge_status (*fill)(void *impl, void *dst, int byte, size_t bytes);
    sparge_status (*synchronize)(void *impl);
    sparge_status (*set_stream)(void *impl, void *stream);
    /* Device-side timing (events on GPUs); NULL: the core uses wall-clock time. */
    sparge_status (*timer_start)(void *impl);
    sparge_status (*timer_stop)(void *impl, double *ms);

    sparge_status (*pool)(void *impl, const sparge_pool_args *a);
    sparge_status (*pooled_map)(void *impl, const sparge_map_args *a);
    /* Writes dense, row_mass, counts and indices; the transpose is left to mask_transpose. */
    sparge_status (*mask_select)(void *impl, const sparge_select_args *a);
    /* Builds counts/indices from mask.dense (after set_dense), not the transpose. */
    sparge_status (*mask_from_dense)(void *impl, const sparge_mask_view *m);
    /* Builds t_counts/t_indices from m->dense. The core calls it once per selection, when the
     * backward or sparge_mask_get_csr first needs the transpose; a refusal writes nothing. */
    sparge_status (*mask_transpose)(void *impl, const sparge_mask_view *m);
    sparge_status (*forward)(void *impl, const sparge_fwd_args *a);
    sparge_status (*backward)(void *impl, const sparge_bwd_args *a);
    /* Optional fused prediction; NULL: the core calls pool, pooled_map and mask_select. */
    sparge_status (*mask_predict)(void *impl, const sparge_predict_args *a);
} sparge_backend;

/* Backends compiled in (defined in their own sources). */
extern const sparge_backend sparge_backend_cpu_ref;
extern const sparge_backend sparge_backend_cpu;
#ifdef SPARGE_HAVE_CUDA
extern const sparge_backend sparge_backend_cuda;
extern const sparge_backend sparge_backend_cuda_generic;
#endif
#ifdef SPARGE_HAVE_HIP
extern const sparge_backend sparge_backend_hip;
#endif

/* Record a failure message for this thread and return s. Used by backends too. */
sparge_status sparge_fail(sparge_status s, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
#define SPARGE_FAIL(s, ...) sparge_fail((s), __FILE__, __LINE__, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
