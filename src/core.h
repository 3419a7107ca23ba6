/* Core-internal definitions shared by the core's sources. */
#ifndef SPARGE_CORE_H
#define SPARGE_CORE_H

#include "backend.h"

struct sparge_device {
    const sparge_backend *be;
    int index;
    void *impl;
    char name[64];
    char description[256];
    double timer_t0; /* wall-clock start when the backend has no timer */
};

struct sparge_mask {
    sparge_device *dev;
    sparge_mask_view v;   /* device arrays */
    float *pooled_q;      /* [B,H,Nqb,D] f32 workspace, sized at first predict */
    float *pooled_k;
    int64_t pooled_d;     /* D the pooled buffers were sized for (0: none) */
    float *map;           /* [B,H,Nqb,Nkb] f32 */
    int predicted;        /* map and row_mass hold a prediction */
    int filled;           /* the mask holds a selection */
    int transposed;       /* t_counts/t_indices hold the transpose of that selection */
};

/* Validate t as a tensor of the given role; fills the flat view. */
sparge_status sparge_check_tensor(const sparge_tensor *t, const char *fn, const char *role, int is_output,
                                  sparge_view *out);
/* a*b (and a*b*c ...) into *out, failing on overflow past INT64_MAX/SIZE_MAX. */
int sparge_mul_overflows(int64_t a, int64_t b, int64_t *out);

/* Ranges of k, p, block sizes and scale. */
sparge_status sparge_check_mask_params(const sparge_mask_params *p, const char *fn);
/* Builds the transpose of the mask's selection unless it is already current: once per selection. */
sparge_status sparge_mask_ensure_transpose(const sparge_mask *mask);
/* The mask's device arrays, or an error if it is not usable with these shapes on dev. */
sparge_status sparge_check_mask_for(sparge_device *dev, const sparge_mask *mask, const sparge_view *q,
                                    const sparge_view *k, const char *fn);

#endif
