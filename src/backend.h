/* Internal contract between the core and the backends (docs/DESIGN.md, "Architecture").
 *
 * The core validates every argument once (shapes, dtypes, strides, ranges, overflow, mask compatibility),
 * describes the call as a sparge_op_desc, asks the device's tiers in order which one supports it, and hands
 * that tier flat, pre-validated argument structs through its ops table. A tier states all its limits in its
 * supports() function; an op slot that is NULL is never asked for.
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

/* Device arrays of a mask (all int32 unless noted), see sparge.h. Varlen: B sequences, Nq/Nk the longest one's
 * tokens, Nqb/Nkb its blocks; seq_q/seq_k the B+1 token offsets of the sequences in the packed tensors. */
typedef struct {
    int64_t B, H, Nq, Nk, Nqb, Nkb;
    int bq, bk;
    int causal;
    const int32_t *seq_q, *seq_k; /* NULL: fixed length */
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
    sparge_view out; /* f32 [B,H,Nb,D]; with seq, x is packed [1,H,T,D] and out [S,H,Nb_max,D], rows past a
                      * sequence's blocks zero */
    const int32_t *seq; /* NULL, or S+1 token offsets (device memory) */
    int64_t n_seq;
} sparge_pool_args;

typedef struct {
    sparge_view qbar, kbar; /* f32; kbar may have fewer heads (H / kbar.H query heads share one) */
    float scale;
    sparge_view map; /* f32 [B,H,Nqb,Nkb] */
    const sparge_mask_view *layout; /* NULL: every entry; else each row's softmax runs over its allowed blocks
                                     * (sparge_row_rule), and the other entries are 0 */
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

/* Attention: q [B,H,Nq,D], k/v [B,Hkv,Nk,D] with Hkv dividing H; with a varlen mask the views are packed
 * [1,H,T,D] and the mask's seq_q/seq_k cut them; lse [B*H*Nq] ([H*Tq] varlen). causal: the dense call's flag
 * (a mask carries its own). */
typedef struct {
    sparge_view q, k, v, o;
    float *lse;       /* or NULL */
    float scale;
    int bq, bk;       /* blocking of the mask (or of the dense path) */
    int causal;
    const sparge_mask_view *mask; /* NULL: dense */
} sparge_fwd_args;

typedef struct {
    sparge_view q, k, v, o, d_o, dq, dk, dv;
    const float *lse;
    float scale;
    int bq, bk;
    int causal;
    int deterministic;
    const sparge_mask_view *mask; /* NULL: dense; its transpose is current */
} sparge_bwd_args;

#if defined(__CUDACC__) || defined(__HIPCC__)
#define SPARGE_HD __host__ __device__
#else
#define SPARGE_HD
#endif

/* The block rule of a query block (docs/DESIGN.md §1.12), the same in every backend: query block i of a sequence
 * of nq query and nk key tokens may attend key blocks [0, *allowed); with causal, *d0..*d1 are its diagonal
 * blocks (those holding key t + nk − nq of one of its queries t), which a selection always keeps (d0 > d1: none).
 * Without causal every block is allowed and none is forced. */
static inline SPARGE_HD void sparge_row_rule(int64_t i, int64_t nq, int64_t nk, int bq, int bk, int causal,
                                             int64_t *allowed, int64_t *d0, int64_t *d1)
{
    const int64_t nkb = (nk + bk - 1) / bk;
    if (!causal) {
        *allowed = nkb;
        *d0 = 1;
        *d1 = 0;
        return;
    }
    const int64_t t0 = i * bq, t1 = (t0 + bq < nq ? t0 + bq : nq) - 1, off = nk - nq;
    *d0 = (t0 + off) / bk;
    *d1 = (t1 + off) / bk;
    *allowed = *d1 + 1;
}

typedef enum { SPARGE_COPY_H2D, SPARGE_COPY_D2H, SPARGE_COPY_D2D } sparge_copy_kind;

/* A tuning switch of a backend (docs/DESIGN.md, "Options"). The core keeps the current value's text per device;
 * the backend parses it into its device state with set_option. */
typedef struct {
    const char *name;    /* "fwd_kernel": what sparge_device_set_option takes */
    const char *env;     /* environment variable giving the value at open, or NULL */
    const char *values;  /* the accepted values, "auto" first ("auto|mma|wgmma") */
    const char *help;
} sparge_option_def;

/* One tier of a device: its ops and the one function that states its limits. A device is a chain of tiers
 * sharing one impl (the first tier opens it): the core dispatches each call to the first tier whose supports()
 * accepts it ("cuda" then "cuda-generic"), or only to the first with the device option strict=on. */
typedef struct sparge_backend {
    const char *name;                    /* "cpu", "cuda", ... */
    const struct sparge_backend *next;   /* the next tier on the same device, or NULL */
    int (*device_count)(void);           /* 0: none present */
    /* Fill *impl for device `index`; describe into desc (≤ 255 chars). */
    sparge_status (*open)(int index, void **impl, char *desc, size_t desc_len);
    void (*close)(void *impl);

    sparge_status (*alloc)(void *impl, size_t bytes, void **ptr);
    sparge_status (*free)(void *impl, void *ptr);
    sparge_status (*copy)(void *impl, void *dst, const void *src, size_t bytes, sparge_copy_kind kind);
    sparge_status (*fill)(void *impl, void *dst, int byte, size_t bytes);
    sparge_status (*synchronize)(void *impl);        /* NULL: nothing to wait for */
    sparge_status (*set_stream)(void *impl, void *stream); /* NULL: no streams */
    /* Device-side timing (events on GPUs); NULL: the core uses wall-clock time. */
    sparge_status (*timer_start)(void *impl);
    sparge_status (*timer_stop)(void *impl, double *ms);

    /* The tier's limits, in one place: SPARGE_OK if it runs d on impl's device, else SPARGE_ERR_UNSUPPORTED
     * through SPARGE_FAIL with a message naming the limit. Every op slot below is asked through it first. */
    sparge_status (*supports)(void *impl, const sparge_op_desc *d);
    sparge_status (*pool)(void *impl, const sparge_pool_args *a);
    sparge_status (*pooled_map)(void *impl, const sparge_map_args *a);
    /* Writes dense, row_mass, counts and indices; the transpose is left to mask_transpose. */
    sparge_status (*mask_select)(void *impl, const sparge_select_args *a);
    /* Fused prediction; NULL: the core calls pool, pooled_map and mask_select of the same tier. */
    sparge_status (*mask_predict)(void *impl, const sparge_predict_args *a);
    sparge_status (*forward)(void *impl, const sparge_fwd_args *a);
    sparge_status (*backward)(void *impl, const sparge_bwd_args *a);
    /* Mask bookkeeping, on the device's first tier: counts/indices from mask.dense (after set_dense), and
     * t_counts/t_indices from m->dense, once per selection when the backward or sparge_mask_get_csr first
     * needs the transpose. A refusal writes nothing. */
    sparge_status (*mask_from_dense)(void *impl, const sparge_mask_view *m);
    sparge_status (*mask_transpose)(void *impl, const sparge_mask_view *m);

    /* Tuning switches of the device (first tier only), parsed once at open from their environment variables
     * and afterwards by sparge_device_set_option. value "auto" restores the default. */
    const sparge_option_def *options;
    int n_options;
    sparge_status (*set_option)(void *impl, int index, const char *value);
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
