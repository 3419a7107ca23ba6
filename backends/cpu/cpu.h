/* Shared by the two CPU tiers (cpu-ref and cpu). */
#ifndef SPARGE_CPU_H
#define SPARGE_CPU_H

#include "../../src/backend.h"

static inline int64_t view_offset(const sparge_view *v, int64_t b, int64_t h, int64_t n, int64_t d)
{
    return b * v->sb + h * v->sh + n * v->sn + d * v->sd;
}

static inline float view_load(const sparge_view *v, int64_t off)
{
    switch (v->dtype) {
    case SPARGE_F16: return sparge_f16_to_f32(((const uint16_t *)v->data)[off]);
    case SPARGE_BF16: return sparge_bf16_to_f32(((const uint16_t *)v->data)[off]);
    default: return ((const float *)v->data)[off];
    }
}

static inline void view_store(const sparge_view *v, int64_t off, float x)
{
    switch (v->dtype) {
    case SPARGE_F16: ((uint16_t *)v->data)[off] = sparge_f32_to_f16(x); break;
    case SPARGE_BF16: ((uint16_t *)v->data)[off] = sparge_f32_to_bf16(x); break;
    default: ((float *)v->data)[off] = x; break;
    }
}

/* DESIGN.md: CPU tiers serve any head dimension up to 256. */
#define SPARGE_CPU_MAX_D 256
static inline sparge_status cpu_check_head_dim(int64_t D, const char *backend)
{
    if (D > SPARGE_CPU_MAX_D)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: head dimension D = %lld exceeds the CPU limit of %d", backend,
                           (long long)D, SPARGE_CPU_MAX_D);
    return SPARGE_OK;
}

/* Host memory ops shared by both tiers. */
sparge_status sparge_cpu_alloc(void *impl, size_t bytes, void **ptr);
sparge_status sparge_cpu_free(void *impl, void *ptr);
sparge_status sparge_cpu_copy(void *impl, void *dst, const void *src, size_t bytes, sparge_copy_kind kind);
sparge_status sparge_cpu_fill(void *impl, void *dst, int byte, size_t bytes);

/* Hybrid Top-k ∪ Top-p selection of one pooled-map row of n entries
 * (DESIGN.md §1). order: scratch of n ints. Sets keep[j] to 0/1, returns the
 * kept count and the kept mass. A row holding NaN keeps every block. */
int64_t sparge_select_row(const float *row, int64_t n, double topk, double topp, int32_t *order, uint8_t *keep,
                          double *mass);
/* Number of blocks kept by Top-k alone (0 when topk = 0). */
int64_t sparge_topk_count(double topk, int64_t n);

/* Select every row of a->map into a->mask (dense, row_mass, CSR). */
sparge_status sparge_cpu_mask_select(void *impl, const sparge_select_args *a);
/* CSR rows from m->dense. */
sparge_status sparge_cpu_mask_from_dense(void *impl, const sparge_mask_view *m);
/* The transpose (t_counts, t_indices) from m->dense. */
sparge_status sparge_cpu_mask_transpose(void *impl, const sparge_mask_view *m);

/* Kept key blocks of query block i of head bh: NULL mask = all. Returns count;
 * fills idx (scratch of Nkb). */
static inline int64_t kept_blocks(const sparge_mask_view *m, int64_t bh, int64_t i, int64_t nkb, const int32_t **idx,
                                  int32_t *all)
{
    if (!m) {
        for (int64_t j = 0; j < nkb; j++)
            all[j] = (int32_t)j;
        *idx = all;
        return nkb;
    }
    *idx = m->indices + (bh * m->Nqb + i) * m->Nkb;
    return m->counts[bh * m->Nqb + i];
}

#endif
