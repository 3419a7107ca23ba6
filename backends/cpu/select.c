/* Per-row hybrid Top-k ∪ Top-p selection (docs/DESIGN.md, "Masks"): the row's blocks in descending order,
 * ties by lower index; keep the first max(n_k, n_p), at least one. Both tiers select the same sets. */
#include <math.h>
#include <stdio.h>

#include "cpu.h"

int64_t sparge_topk_count(double topk, int64_t n)
{
    if (topk <= 0.0)
        return 0;
    int64_t c = (int64_t)floor(topk * (double)n + 1e-6);
    return c < 1 ? 1 : c > n ? n : c;
}

/* Descending value, ties by lower index: a total order. The entries carry what the comparison needs, so sorts
 * on several threads share no state. */
static int by_score(const void *pa, const void *pb)
{
    const cpu_ranked *a = pa, *b = pb;
    if (a->value != b->value)
        return a->value > b->value ? -1 : 1;
    return a->index < b->index ? -1 : a->index > b->index;
}

int64_t sparge_select_row(const float *row, int64_t n, double topk, double topp, cpu_ranked *order, uint8_t *keep,
                          double *mass)
{
    int has_nan = 0;
    for (int64_t j = 0; j < n; j++) {
        order[j] = (cpu_ranked){row[j] == 0.0f ? 0.0f : row[j], (int32_t)j}; /* -0 ranks as +0 */
        has_nan |= isnan(row[j]);
    }
    if (has_nan) {
        memset(keep, 1, (size_t)n);
        *mass = NAN;
        return n;
    }
    qsort(order, (size_t)n, sizeof *order, by_score);
    int64_t nk = sparge_topk_count(topk, n), np = 0;
    if (topp > 0.0) {
        double cum = 0.0;
        np = n; /* rounding may leave the total below p: keep the whole row */
        for (int64_t t = 0; t < n; t++) {
            cum += order[t].value;
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
        keep[order[t].index] = 1;
        sum += order[t].value;
    }
    *mass = sum;
    return kept;
}

/* The same selection for rows that keep few blocks: the kept prefix of the order is built by repeated arg-max,
 * O(kept·n) instead of a full sort, with the same cumulative sums in the same order, so the result is
 * identical. Rows that keep many blocks or hold NaN take sparge_select_row itself. */
static int64_t select_row_few(const float *row, int64_t n, double topk, double topp, cpu_ranked *order, uint8_t *keep,
                              double *mass)
{
    enum { MAX_PICKS = 32 };
    int64_t nk = sparge_topk_count(topk, n), np = topp > 0.0 ? -1 : 0, t = 0;
    int has_nan = 0;
    for (int64_t j = 0; j < n; j++)
        has_nan |= isnan(row[j]);
    if (has_nan || nk > MAX_PICKS)
        return sparge_select_row(row, n, topk, topp, order, keep, mass);
    memset(keep, 0, (size_t)n);
    double cum = 0.0;
    while (np < 0 || t < nk || t < 1) {
        if (t == n) { /* rounding left the row's total below p: keep it whole */
            np = n;
            break;
        }
        if (t == MAX_PICKS)
            return sparge_select_row(row, n, topk, topp, order, keep, mass);
        int64_t best = -1;
        for (int64_t j = 0; j < n; j++)
            if (!keep[j] && (best < 0 || row[j] > row[best]))
                best = j;
        keep[best] = 1;
        order[t++].index = (int32_t)best;
        if (np < 0 && (cum += row[best]) >= topp)
            np = t;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < t; i++)
        sum += row[order[i].index];
    *mass = sum;
    return t;
}

typedef int64_t (*select_fn)(const float *, int64_t, double, double, cpu_ranked *, uint8_t *, double *);

/* Every row of a->map into a->mask (dense, row_mass, then the CSR), threaded when `threads`. A row selects among
 * its allowed blocks and keeps its diagonal blocks besides (causal: docs/DESIGN.md §1.12); a row past its
 * sequence's query blocks keeps nothing. */
static sparge_status select_rows(void *impl, const sparge_select_args *a, select_fn select, int threads)
{
    const sparge_mask_view *m = &a->mask;
    const sparge_view *map = &a->map;
    int64_t rows = m->B * m->H * m->Nqb;
    int failed = 0;
    (void)threads; /* read by the OpenMP pragma alone */
#pragma omp parallel if (threads)
    {
        cpu_ranked *order = malloc((size_t)m->Nkb * sizeof *order);
        float *row = malloc((size_t)m->Nkb * sizeof *row);
        if (!order || !row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                int64_t bh = r / m->Nqb, i = r % m->Nqb, b = bh / m->H, h = bh % m->H, n, d0, d1;
                uint8_t *keep = m->dense + r * m->Nkb;
                memset(keep, 0, (size_t)m->Nkb);
                if (!cpu_row(m, b, i, &n, &d0, &d1)) {
                    m->row_mass[r] = 0.0f;
                    continue;
                }
                const float *src = (const float *)map->data + view_offset(map, b, h, i, 0);
                for (int64_t j = 0; j < n; j++)
                    row[j] = src[j * map->sd];
                double mass;
                select(row, n, a->topk, a->topp, order, keep, &mass);
                for (int64_t j = d0; j <= d1; j++)
                    if (!keep[j]) {
                        keep[j] = 1;
                        mass += row[j];
                    }
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

/* cpu-ref: a full sort of every row. */
sparge_status sparge_ref_mask_select(void *impl, const sparge_select_args *a)
{
    return select_rows(impl, a, sparge_select_row, 0);
}

/* cpu: rows on every thread, few-block rows by arg-max. */
sparge_status sparge_cpu_mask_select(void *impl, const sparge_select_args *a)
{
    return select_rows(impl, a, select_row_few, 1);
}
