/* Backend "cpu-ref": scalar, fp64 accumulation, no threads. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "ref.h"

static int keeps(const uint8_t *keep, int64_t nkb, int64_t i, int64_t j) { return !keep || keep[i * nkb + j]; }

static double score(const double *q, const double *k, int64_t D, double scale)
{
    double dot = 0.0;
    for (int64_t d = 0; d < D; d++)
        dot += q[d] * k[d];
    return scale * dot;
}

/* Two passes over the kept keys (max, then sum): no scratch memory. */
void sparge_ref_head_forward(const double *q, const double *k, const double *v, int64_t Nq, int64_t Nk, int64_t D,
                             double scale, int bq, int bk, const uint8_t *keep, double *o, double *lse)
{
    int64_t nkb = (Nk + bk - 1) / bk;
    for (int64_t t = 0; t < Nq; t++) {
        int64_t i = t / bq;
        double m = -INFINITY, sum = 0.0;
        for (int64_t u = 0; u < Nk; u++)
            if (keeps(keep, nkb, i, u / bk)) {
                double s = score(q + t * D, k + u * D, D, scale);
                if (s > m)
                    m = s;
            }
        for (int64_t d = 0; d < D; d++)
            o[t * D + d] = 0.0;
        for (int64_t u = 0; u < Nk; u++) {
            if (!keeps(keep, nkb, i, u / bk))
                continue;
            double p = exp(score(q + t * D, k + u * D, D, scale) - m);
            sum += p;
            for (int64_t d = 0; d < D; d++)
                o[t * D + d] += p * v[u * D + d];
        }
        for (int64_t d = 0; d < D; d++)
            o[t * D + d] /= sum;
        lse[t] = m + log(sum);
    }
}

void sparge_ref_head_backward(const double *q, const double *k, const double *v, const double *o, const double *d_o,
                              const double *lse, int64_t Nq, int64_t Nk, int64_t D, double scale, int bq, int bk,
                              const uint8_t *keep, double *dq, double *dk, double *dv)
{
    int64_t nkb = (Nk + bk - 1) / bk;
    memset(dq, 0, (size_t)(Nq * D) * sizeof *dq);
    memset(dk, 0, (size_t)(Nk * D) * sizeof *dk);
    memset(dv, 0, (size_t)(Nk * D) * sizeof *dv);
    for (int64_t t = 0; t < Nq; t++) {
        int64_t i = t / bq;
        double delta = 0.0;
        for (int64_t d = 0; d < D; d++)
            delta += d_o[t * D + d] * o[t * D + d];
        for (int64_t u = 0; u < Nk; u++) {
            if (!keeps(keep, nkb, i, u / bk))
                continue;
            double dp = score(d_o + t * D, v + u * D, D, 1.0);
            double p = exp(score(q + t * D, k + u * D, D, scale) - lse[t]), ds = p * (dp - delta);
            for (int64_t d = 0; d < D; d++) {
                dv[u * D + d] += p * d_o[t * D + d];
                dq[t * D + d] += scale * ds * k[u * D + d];
                dk[u * D + d] += scale * ds * q[t * D + d];
            }
        }
    }
}

/* ---------------------------------------------------------------- backend ops */

static void gather(const sparge_view *x, int64_t b, int64_t h, double *out)
{
    for (int64_t n = 0; n < x->N; n++)
        for (int64_t d = 0; d < x->D; d++)
            out[n * x->D + d] = view_load(x, view_offset(x, b, h, n, d));
}

static void scatter(const sparge_view *x, int64_t b, int64_t h, const double *src)
{
    for (int64_t n = 0; n < x->N; n++)
        for (int64_t d = 0; d < x->D; d++)
            view_store(x, view_offset(x, b, h, n, d), (float)src[n * x->D + d]);
}

/* Allocates n buffers of the given element counts, all or none. */
static int alloc_all(int n, double **bufs, const int64_t *counts)
{
    int ok = 1;
    for (int i = 0; i < n; i++)
        ok &= (bufs[i] = malloc((size_t)counts[i] * sizeof(double))) != NULL;
    if (!ok)
        for (int i = 0; i < n; i++)
            free(bufs[i]);
    return ok;
}

static void free_all(int n, double **bufs)
{
    for (int i = 0; i < n; i++)
        free(bufs[i]);
}

static sparge_status no_memory(void) { return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu-ref: out of host memory"); }

static int ref_device_count(void) { return 1; }

static sparge_status ref_open(int index, void **impl, char *desc, size_t len)
{
    (void)index;
    *impl = NULL; /* NULL impl: the shared CPU helpers run single-threaded */
    snprintf(desc, len, "scalar fp64 reference (oracle), one thread");
    return SPARGE_OK;
}

static sparge_status ref_pool(void *impl, const sparge_pool_args *a)
{
    (void)impl;
    const sparge_view *x = &a->x, *o = &a->out;
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t i = 0; i < o->N; i++) {
                int64_t t0 = i * a->block, t1 = t0 + a->block < x->N ? t0 + a->block : x->N;
                for (int64_t d = 0; d < x->D; d++) {
                    double sum = 0.0;
                    for (int64_t t = t0; t < t1; t++)
                        sum += view_load(x, view_offset(x, b, h, t, d));
                    view_store(o, view_offset(o, b, h, i, d), (float)(sum / (double)(t1 - t0)));
                }
            }
    return SPARGE_OK;
}

static sparge_status ref_pooled_map(void *impl, const sparge_map_args *a)
{
    (void)impl;
    const sparge_view *q = &a->qbar, *k = &a->kbar, *m = &a->map;
    double *row = malloc((size_t)k->N * sizeof *row);
    if (!row)
        return no_memory();
    for (int64_t b = 0; b < q->B; b++)
        for (int64_t h = 0; h < q->H; h++)
            for (int64_t i = 0; i < q->N; i++) {
                double mx = -INFINITY, sum = 0.0;
                int nan = 0;
                for (int64_t j = 0; j < k->N; j++) {
                    double dot = 0.0;
                    for (int64_t d = 0; d < q->D; d++)
                        dot += (double)view_load(q, view_offset(q, b, h, i, d)) *
                               (double)view_load(k, view_offset(k, b, h, j, d));
                    row[j] = dot * a->scale;
                    nan |= isnan(row[j]);
                    if (row[j] > mx)
                        mx = row[j];
                }
                for (int64_t j = 0; j < k->N; j++)
                    sum += row[j] = exp(row[j] - mx);
                for (int64_t j = 0; j < k->N; j++)
                    view_store(m, view_offset(m, b, h, i, j), nan ? NAN : (float)(row[j] / sum));
            }
    free(row);
    return SPARGE_OK;
}

/* The head's slice of the dense mask, or NULL for dense attention. */
static const uint8_t *head_keep(const sparge_mask_view *m, int64_t b, int64_t h)
{
    return m ? m->dense + (b * m->H + h) * m->Nqb * m->Nkb : NULL;
}

/* Work buffers are allocated before the first head is written, so a failure
 * leaves the outputs untouched. */
static sparge_status ref_forward(void *impl, const sparge_fwd_args *a)
{
    (void)impl;
    sparge_status st = cpu_check_head_dim(a->q.D, "cpu-ref");
    if (st)
        return st;
    int64_t Nq = a->q.N, Nk = a->k.N, D = a->q.D;
    double *b[5];
    const int64_t sizes[5] = {Nq * D, Nk * D, Nk * D, Nq * D, Nq};
    if (!alloc_all(5, b, sizes))
        return no_memory();
    double *qd = b[0], *kd = b[1], *vd = b[2], *o = b[3], *lse = b[4];
    for (int64_t bh = 0; bh < a->q.B * a->q.H; bh++) {
        int64_t bi = bh / a->q.H, h = bh % a->q.H;
        gather(&a->q, bi, h, qd);
        gather(&a->k, bi, h, kd);
        gather(&a->v, bi, h, vd);
        sparge_ref_head_forward(qd, kd, vd, Nq, Nk, D, a->scale, a->bq, a->bk, head_keep(a->mask, bi, h), o, lse);
        scatter(&a->o, bi, h, o);
        if (a->lse)
            for (int64_t t = 0; t < Nq; t++)
                a->lse[bh * Nq + t] = (float)lse[t];
    }
    free_all(5, b);
    return SPARGE_OK;
}

static sparge_status ref_backward(void *impl, const sparge_bwd_args *a)
{
    (void)impl;
    sparge_status st = cpu_check_head_dim(a->q.D, "cpu-ref");
    if (st)
        return st;
    int64_t Nq = a->q.N, Nk = a->k.N, D = a->q.D;
    double *b[9];
    const int64_t sizes[9] = {Nq * D, Nk * D, Nk * D, Nq * D, Nq * D, Nq, Nq * D, Nk * D, Nk * D};
    if (!alloc_all(9, b, sizes))
        return no_memory();
    double *qd = b[0], *kd = b[1], *vd = b[2], *od = b[3], *dod = b[4], *lse = b[5], *dq = b[6], *dk = b[7],
           *dv = b[8];
    for (int64_t bh = 0; bh < a->q.B * a->q.H; bh++) {
        int64_t bi = bh / a->q.H, h = bh % a->q.H;
        gather(&a->q, bi, h, qd);
        gather(&a->k, bi, h, kd);
        gather(&a->v, bi, h, vd);
        gather(&a->o, bi, h, od);
        gather(&a->d_o, bi, h, dod);
        for (int64_t t = 0; t < Nq; t++)
            lse[t] = a->lse[bh * Nq + t];
        sparge_ref_head_backward(qd, kd, vd, od, dod, lse, Nq, Nk, D, a->scale, a->bq, a->bk,
                                 head_keep(a->mask, bi, h), dq, dk, dv);
        scatter(&a->dq, bi, h, dq);
        scatter(&a->dk, bi, h, dk);
        scatter(&a->dv, bi, h, dv);
    }
    free_all(9, b);
    return SPARGE_OK;
}

const sparge_backend sparge_backend_cpu_ref = {
    "cpu-ref",        ref_device_count, ref_open,          NULL,
    sparge_cpu_alloc, sparge_cpu_free,  sparge_cpu_copy,   sparge_cpu_fill,
    NULL,             NULL,             NULL,              NULL,
    ref_pool,         ref_pooled_map,
    sparge_cpu_mask_select,             sparge_cpu_mask_from_dense,       sparge_cpu_mask_transpose,
    ref_forward,      ref_backward, NULL};
