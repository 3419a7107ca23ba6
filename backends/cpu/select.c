/* Per-row mask selection and CSR bookkeeping, shared by the CPU tiers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

int64_t sparge_topk_count(double topk, int64_t n)
{
    if (topk <= 0.0)
        return 0;
    int64_t c = (int64_t)floor(topk * (double)n + 1e-6);
    return c < 1 ? 1 : c > n ? n : c;
}

/* Descending value, ties by lower index: a total order. */
static const float *sort_row;
#pragma omp threadprivate(sort_row)

static int by_score(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    float x = sort_row[a], y = sort_row[b];
    if (x != y)
        return x > y ? -1 : 1;
    return a < b ? -1 : a > b;
}

int64_t sparge_select_row(const float *row, int64_t n, double topk, double topp, int32_t *order, uint8_t *keep,
                          double *mass)
{
    int has_nan = 0;
    for (int64_t j = 0; j < n; j++) {
        order[j] = (int32_t)j;
        has_nan |= isnan(row[j]);
    }
    if (has_nan) {
        memset(keep, 1, (size_t)n);
        *mass = NAN;
        return n;
    }
    sort_row = row;
    qsort(order, (size_t)n, sizeof *order, by_score);
    int64_t nk = sparge_topk_count(topk, n), np = 0;
    if (topp > 0.0) {
        double cum = 0.0;
        np = n; /* rounding may leave the total below p: keep the whole row */
        for (int64_t t = 0; t < n; t++) {
            cum += row[order[t]];
            if (cum >= topp) {
                np = t + 1;
                break;
            }
        }
    }
    int64_t kept = nk > np ? nk : np;
    if (kept < 1)
        kept = 1;
    memset(keep, 0, (size_t)n);
    double sum = 0.0;
    for (int64_t t = 0; t < kept; t++) {
        keep[order[t]] = 1;
        sum += row[order[t]];
    }
    *mass = sum;
    return kept;
}

/* Per head, each line of dense (a query-block row of Nkb flags, or with by_key a key-block column of Nqb)
 * as the ascending positions it keeps, -1 past its count: the CSR rows, or the transpose. */
static void index_lines(void *impl, const sparge_mask_view *m, int by_key)
{
    (void)impl;
    const int64_t lines = by_key ? m->Nkb : m->Nqb, len = by_key ? m->Nqb : m->Nkb;
    const int64_t line_step = by_key ? 1 : m->Nkb, flag_step = by_key ? m->Nkb : 1, bh_n = m->B * m->H;
    int32_t *counts = by_key ? m->t_counts : m->counts, *indices = by_key ? m->t_indices : m->indices;
#pragma omp parallel for schedule(static) if (impl != NULL)
    for (int64_t bh = 0; bh < bh_n; bh++)
        for (int64_t l = 0; l < lines; l++) {
            const uint8_t *flags = m->dense + bh * m->Nqb * m->Nkb + l * line_step;
            int32_t *idx = indices + (bh * lines + l) * len, c = 0;
            for (int64_t p = 0; p < len; p++)
                if (flags[p * flag_step])
                    idx[c++] = (int32_t)p;
            counts[bh * lines + l] = c;
            for (int64_t p = c; p < len; p++)
                idx[p] = -1;
        }
}

sparge_status sparge_cpu_mask_from_dense(void *impl, const sparge_mask_view *m)
{
    index_lines(impl, m, 0);
    return SPARGE_OK;
}

sparge_status sparge_cpu_mask_transpose(void *impl, const sparge_mask_view *m)
{
    index_lines(impl, m, 1);
    return SPARGE_OK;
}

sparge_status sparge_cpu_mask_select(void *impl, const sparge_select_args *a)
{
    const sparge_mask_view *m = &a->mask;
    int64_t rows = m->B * m->H * m->Nqb;
    int failed = 0;
#pragma omp parallel if (impl != NULL)
    {
        int32_t *order = malloc((size_t)m->Nkb * sizeof *order);
        float *row = malloc((size_t)m->Nkb * sizeof *row);
        if (!order || !row) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                int64_t bh = r / m->Nqb, i = r % m->Nqb, b = bh / m->H, h = bh % m->H;
                const float *src = (const float *)a->map.data;
                for (int64_t j = 0; j < m->Nkb; j++)
                    row[j] = src[b * a->map.sb + h * a->map.sh + i * a->map.sn + j * a->map.sd];
                double mass;
                sparge_select_row(row, m->Nkb, a->topk, a->topp, order, m->dense + r * m->Nkb, &mass);
                m->row_mass[r] = (float)mass;
            }
        }
        free(order);
        free(row);
    }
    if (failed)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "mask selection: out of host memory");
    return sparge_cpu_mask_from_dense(impl, m);
}

sparge_status sparge_cpu_alloc(void *impl, size_t bytes, void **ptr)
{
    (void)impl;
    size_t rounded = (bytes + 63) / 64 * 64;
    void *p = rounded >= bytes ? aligned_alloc(64, rounded) : NULL;
    if (!p)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes of host memory", bytes);
    *ptr = p;
    return SPARGE_OK;
}

sparge_status sparge_cpu_free(void *impl, void *ptr)
{
    (void)impl;
    free(ptr);
    return SPARGE_OK;
}

sparge_status sparge_cpu_copy(void *impl, void *dst, const void *src, size_t bytes, sparge_copy_kind kind)
{
    (void)impl;
    (void)kind;
    memmove(dst, src, bytes);
    return SPARGE_OK;
}

sparge_status sparge_cpu_fill(void *impl, void *dst, int byte, size_t bytes)
{
    (void)impl;
    memset(dst, byte, bytes);
    return SPARGE_OK;
}
