/* Core-internal definitions shared by the core's sources. */
#ifndef SPARGE_CORE_H
#define SPARGE_CORE_H

#include <stdatomic.h>
#include <pthread.h>

#include "backend.h"

enum { SPARGE_MAX_OPTIONS = 16, SPARGE_OPTION_LEN = 32 };

struct sparge_device {
    const sparge_backend *be; /* the first tier; be->next... the others, sharing impl */
    int index;
    void *impl;
    char name[64];
    char description[256];
    double timer_t0;  /* wall-clock start when the backend has no timer */
    int timer_running; /* sparge_timer_start was called and its stop not yet */
    int strict;       /* option "strict": no fallback to the next tier */
    /* GPU devices (a stream and scratch memory in impl) run one call at a time; CPU devices need no lock. */
    int serialized;
    pthread_mutex_t lock;
    /* The handle and each live mask hold a reference: sparge_device_close with masks alive defers the release
     * until the last of them is destroyed. */
    atomic_int refs;
    int closed;
    /* Current text of each option: [0] "strict", then be->options[0..n_options). */
    char option_values[SPARGE_MAX_OPTIONS][SPARGE_OPTION_LEN];
};

struct sparge_mask {
    sparge_device *dev;
    sparge_mask_view v;   /* device arrays */
    float *pooled_q;      /* [B,H,Nqb,D] f32 workspace, sized at first predict */
    float *pooled_k;
    int64_t pooled_d;     /* D the pooled buffers were sized for (0: none) */
    int64_t pooled_hkv;   /* K heads pooled_k was sized for */
    int64_t Tq, Tk;       /* tokens of the tensors: Nq, Nk, or the packed totals of a varlen mask */
    int32_t *host_seq;    /* varlen: host copy of the token offsets, q's B+1 then k's B+1 (NULL: fixed) */
    int32_t *dev_seq;     /* the same on the device (seq_q, seq_k of the view point into it) */
    float *map;           /* [B,H,Nqb,Nkb] f32 */
    int predicted;        /* map and row_mass hold a prediction */
    int filled;           /* the mask holds a selection */
    int transposed;       /* t_counts/t_indices hold the transpose of that selection (under lock) */
    pthread_mutex_t lock; /* readers running at once may all need the transpose: one builds it */
};

/* Hold dev's lock around a call into its backend (GPU devices; a no-op on CPU devices). */
static inline void sparge_dev_lock(sparge_device *dev)
{
    if (dev->serialized)
        pthread_mutex_lock(&dev->lock);
}
static inline void sparge_dev_unlock(sparge_device *dev)
{
    if (dev->serialized)
        pthread_mutex_unlock(&dev->lock);
}
/* Drops one reference of dev; the last one closes the backend's device and frees the handle. */
void sparge_device_release(sparge_device *dev);

/* The tier of dev that runs d: the first whose supports() accepts it (only the first with strict=on). On
 * refusal, the message names fn and each tier's reason. */
sparge_status sparge_pick_tier(sparge_device *dev, const sparge_op_desc *d, const char *fn,
                               const sparge_backend **tier);
/* Memory a tensor or the LSE occupies, for the aliasing checks (lo 0: absent). */
typedef struct {
    uintptr_t lo, hi;
    const char *role;
    const sparge_view *view; /* NULL: a plain range (the LSE) */
} sparge_region;
sparge_region sparge_view_region(const sparge_view *v, const char *role);
sparge_region sparge_lse_region(const float *lse, int64_t count, const char *role);
/* Refuses an output that overlaps an input or another output. */
sparge_status sparge_check_disjoint(const sparge_region *outs, int n_out, const sparge_region *ins, int n_in,
                                    const char *fn);
/* 1 if every row of v is contiguous along D and starts 16-byte aligned. */
int sparge_rows_aligned(const sparge_view *v);

/* Validate t as a tensor of the given role; fills the flat view. */
sparge_status sparge_check_tensor(const sparge_tensor *t, const char *fn, const char *role, int is_output,
                                  sparge_view *out);
/* a*b (and a*b*c ...) into *out, failing on overflow past INT64_MAX/SIZE_MAX. */
int sparge_mul_overflows(int64_t a, int64_t b, int64_t *out);

/* sparge_mask_create_ex, with fn naming the public call in error messages. */
sparge_status sparge_mask_create_named(sparge_device *dev, const sparge_mask_layout *l, const char *fn,
                                       sparge_mask **out);
/* Ranges of k, p, block sizes and scale. */
sparge_status sparge_check_mask_params(const sparge_mask_params *p, const char *fn);
/* Sequence b of a mask: its query tokens [*q0, *q0 + *nq) and key tokens [*k0, *k0 + *nk) in the tensors, and the
 * tensors' batch index *tb (b, or 0 for packed varlen tensors). */
void sparge_mask_seq(const sparge_mask *m, int64_t b, int64_t *tb, int64_t *q0, int64_t *nq, int64_t *k0, int64_t *nk);

/* q and k views against the mask's layout (batch, heads, tokens; grouped K heads dividing q's). */
sparge_status sparge_check_tensors_for_mask(const sparge_mask *mask, const sparge_view *q, const sparge_view *k,
                                           const char *fn);
/* Everything sparge_mask_predict checks, and the tier that will run it; writes nothing. */
sparge_status sparge_check_predict(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                   const sparge_mask_params *params, const sparge_mask *mask, const char *fn,
                                   sparge_view *qv, sparge_view *kv, const sparge_backend **tier);
/* The prediction itself, after sparge_check_predict. */
sparge_status sparge_run_predict(sparge_device *dev, const sparge_view *qv, const sparge_view *kv,
                                 const sparge_mask_params *params, sparge_mask *mask, const sparge_backend *tier,
                                 const char *fn);
/* Builds the transpose of the mask's selection unless it is already current: once per selection. */
sparge_status sparge_mask_ensure_transpose(const sparge_mask *mask);
/* The mask's device arrays, or an error if it is not usable with these shapes on dev. */
sparge_status sparge_check_mask_for(sparge_device *dev, const sparge_mask *mask, const sparge_view *q,
                                    const sparge_view *k, const char *fn);

#endif
