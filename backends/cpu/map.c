/* The pooled map: per (b, h) the row softmax of scale·Q̄K̄ᵀ; a row holding NaN becomes all NaN. With grouped K
 * heads, query head h reads pooled K head h / (H / Hkv). With a layout, each row's softmax runs over its allowed
 * key blocks only and every other entry (and every row past a sequence's blocks) is 0. */
#include <math.h>
#include <stdio.h>

#include "cpu.h"

/* Allowed entries of row (b, i): the layout's, or the whole row. */
static int64_t row_allowed(const sparge_map_args *a, int64_t b, int64_t i)
{
    int64_t allowed = a->kbar.N, d0, d1;
    if (a->layout && !cpu_row(a->layout, b, i, &allowed, &d0, &d1))
        return 0;
    return allowed;
}

/* cpu-ref: dot products and the softmax in fp64. */
sparge_status sparge_ref_pooled_map(void *impl, const sparge_map_args *a)
{
    (void)impl;
    const sparge_view *q = &a->qbar, *k = &a->kbar, *m = &a->map;
    const int64_t group = q->H / k->H;
    double *row = malloc((size_t)k->N * sizeof *row);
    if (!row)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu-ref: out of host memory for the pooled map");
    for (int64_t b = 0; b < q->B; b++)
        for (int64_t h = 0; h < q->H; h++)
            for (int64_t i = 0; i < q->N; i++) {
                const int64_t n = row_allowed(a, b, i);
                double mx = -INFINITY, sum = 0.0;
                int nan = 0;
                for (int64_t j = 0; j < n; j++) {
                    double dot = 0.0;
                    for (int64_t d = 0; d < q->D; d++)
                        dot += view_load_f64(q, view_offset(q, b, h, i, d)) *
                               view_load_f64(k, view_offset(k, b, h / group, j, d));
                    row[j] = dot * a->scale;
                    nan |= isnan(row[j]);
                    if (row[j] > mx)
                        mx = row[j];
                }
                for (int64_t j = 0; j < n; j++)
                    sum += row[j] = exp(row[j] - mx);
                for (int64_t j = 0; j < k->N; j++)
                    view_store(m, view_offset(m, b, h, i, j), j >= n ? 0.0f : nan ? NAN : (float)(row[j] / sum));
            }
    free(row);
    return SPARGE_OK;
}

/* cpu: one head per task, its logits as one SIMD GEMM. */
sparge_status sparge_cpu_pooled_map(void *impl, const sparge_map_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *q = &a->qbar, *k = &a->kbar, *m = &a->map;
    const int64_t D = q->D, nqb = q->N, nkb = k->N, group = q->H / k->H;
    int failed = 0;
#pragma omp parallel
    {
        cpu_scratch s;
        size_t sizes[3] = {(size_t)(nqb * D), (size_t)(D * nkb), (size_t)(nqb * nkb)};
        if (!cpu_scratch_alloc(&s, sizes, 3)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        float *qbar = s.buf[0], *kbar_t = s.buf[1], *map = s.buf[2];
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < q->B * q->H; bh++) {
                int64_t b = bh / q->H, h = bh % q->H;
                k_->load(row_ptr(q, b, h, 0), q->dtype, q->sn, q->sd, nqb, D, 1.0f, qbar, D, 0);
                k_->load(row_ptr(k, b, h / group, 0), k->dtype, k->sn, k->sd, nkb, D, 1.0f, kbar_t, nkb, 1);
                k_->gemm(nqb, nkb, D, qbar, D, 1, kbar_t, nkb, map, nkb, 0, NULL);
                for (int64_t i = 0; i < nqb; i++) {
                    const int64_t n = row_allowed(a, b, i);
                    float *row = map + i * nkb, mx = -INFINITY;
                    int nan = 0;
                    for (int64_t j = 0; j < n; j++) {
                        row[j] *= a->scale;
                        nan |= isnan(row[j]);
                        mx = row[j] > mx ? row[j] : mx;
                    }
                    float inv = nan ? NAN : n ? 1.0f / k_->exp_sum(row, n, mx) : 0.0f;
                    k_->store(row, nkb, &inv, 1, n, row_ptr(m, b, h, i), m->dtype, m->sn, m->sd);
                    for (int64_t j = n; j < nkb; j++)
                        view_store(m, view_offset(m, b, h, i, j), 0.0f);
                }
            }
        }
        cpu_scratch_free(&s);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for the pooled map") : SPARGE_OK;
}
