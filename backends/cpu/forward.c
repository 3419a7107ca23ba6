/* Block-sparse attention forward: O and LSE of every query over the tokens of its kept key blocks. */
#include <math.h>
#include <stdio.h>

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

/* cpu-ref: one (b, h) at a time in fp64. Work buffers are allocated before the first head is written, so a
 * failure leaves the outputs untouched. */
sparge_status sparge_ref_forward(void *impl, const sparge_fwd_args *a)
{
    (void)impl;
    int64_t Nq = a->q.N, Nk = a->k.N, D = a->q.D;
    double *b[5];
    const int64_t sizes[5] = {Nq * D, Nk * D, Nk * D, Nq * D, Nq};
    if (!ref_alloc_all(5, b, sizes))
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu-ref: out of host memory for the forward");
    double *qd = b[0], *kd = b[1], *vd = b[2], *o = b[3], *lse = b[4];
    for (int64_t bh = 0; bh < a->q.B * a->q.H; bh++) {
        int64_t bi = bh / a->q.H, h = bh % a->q.H;
        ref_gather(&a->q, bi, h, qd);
        ref_gather(&a->k, bi, h, kd);
        ref_gather(&a->v, bi, h, vd);
        sparge_ref_head_forward(qd, kd, vd, Nq, Nk, D, a->scale, a->bq, a->bk, ref_head_keep(a->mask, bi, h), o,
                                lse);
        ref_scatter(&a->o, bi, h, o);
        if (a->lse)
            for (int64_t t = 0; t < Nq; t++)
                a->lse[bh * Nq + t] = (float)lse[t];
    }
    ref_free_all(5, b);
    return SPARGE_OK;
}

/* cpu: OpenMP over (batch, head, query block), tiled online softmax. Tiles are computed transposed,
 * Sᵀ = K·(s·Q)ᵀ [key × query], so that K and V are used row-major straight from f32 views (no copy, no
 * transpose), each query block's Qᵀ is built once and reused over all its key blocks, and the softmax statistics
 * of a query are vertical vector operations (no horizontal reductions). Every product goes through one
 * register-blocked GEMM. */
sparge_status sparge_cpu_forward(void *impl, const sparge_fwd_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *qv = &a->q, *kv = &a->k, *vv = &a->v, *ov = &a->o;
    int64_t D = qv->D, Nq = qv->N, Nk = kv->N, H = qv->H, bq = a->bq, bk = a->bk;
    /* A block longer than the sequence holds the whole sequence: tiles never exceed it. */
    int64_t tq = bq < Nq ? bq : Nq, tk = bk < Nk ? bk : Nk, ldt = pad16(tq);
    int64_t nqb = (Nq + bq - 1) / bq, nkb = (Nk + bk - 1) / bk, tasks = qv->B * H * nqb, claimed = 0;
    int failed = 0;
#pragma omp parallel
    {
        cpu_scratch s;
        size_t sizes[6] = {(size_t)(D * ldt), (size_t)(tk * ldt), (size_t)(tq * D), (size_t)(4 * ldt),
                           (size_t)(2 * tk * D), (size_t)nkb};
        if (!cpu_scratch_alloc(&s, sizes, 6)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        float *qt = s.buf[0], *st_ = s.buf[1], *ot = s.buf[2], *m = s.buf[3], *l = m + ldt, *corr = l + ldt,
              *inv = corr + ldt, *kbuf = s.buf[4], *vbuf = kbuf + tk * D;
        int32_t *all = (int32_t *)s.buf[5];
        /* Dynamic scheduling that claims the next task one ahead, so that its Q block and first K/V block can be
         * prefetched during the last pair. */
        int64_t next = tasks;
        if (!failed) {
#pragma omp atomic capture
            next = claimed++;
        }
        while (next < tasks) {
            int64_t task = next;
#pragma omp atomic capture
            next = claimed++;
            int64_t bh = task / nqb, i = task % nqb, b = bh / H, h = bh % H, nq = block_rows(i, bq, Nq);
            const int32_t *idx;
            int64_t cnt = kept_blocks(a->mask, bh, i, nkb, &idx, all);
            k_->load(row_ptr(qv, b, h, i * bq), qv->dtype, qv->sn, qv->sd, nq, D, a->scale, qt, ldt, 1);
            for (int64_t r = 0; r < nq; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            for (int64_t c = 0; c < cnt; c++) {
                int64_t j = idx[c], nk = block_rows(j, bk, Nk), ldk, ldv;
                if (c + 1 < cnt) {
                    int64_t jn = idx[c + 1], nkn = block_rows(jn, bk, Nk);
                    prefetch_rows(kv, b, h, jn * bk, nkn);
                    prefetch_rows(vv, b, h, jn * bk, nkn);
                } else if (next < tasks) {
                    int64_t bhn = next / nqb, in = next % nqb, bn = bhn / H, hn = bhn % H, jn = 0;
                    if (a->mask)
                        jn = a->mask->indices[(bhn * nqb + in) * nkb];
                    prefetch_rows(qv, bn, hn, in * bq, block_rows(in, bq, Nq));
                    prefetch_rows(kv, bn, hn, jn * bk, block_rows(jn, bk, Nk));
                    prefetch_rows(vv, bn, hn, jn * bk, block_rows(jn, bk, Nk));
                }
                const float *kt = rows_f32(k_, kv, b, h, j * bk, nk, kbuf, &ldk);
                const float *vt = rows_f32(k_, vv, b, h, j * bk, nk, vbuf, &ldv);
                k_->gemm(nk, nq, D, kt, ldk, 1, qt, ldt, st_, ldt, 0, NULL);    /* Sᵀ = K (sQ)ᵀ */
                k_->softmax_cols(st_, ldt, nk, nq, m, l, corr);                 /* Pᵀ, m, l */
                k_->gemm(nq, D, nk, st_, 1, ldt, vt, ldv, ot, D, c > 0, corr); /* O = corr·O + P V */
            }
            for (int64_t r = 0; r < nq; r++) {
                inv[r] = 1.0f / l[r];
                if (a->lse)
                    a->lse[bh * Nq + i * bq + r] = m[r] + logf(l[r]);
            }
            k_->store(ot, D, inv, nq, D, row_ptr(ov, b, h, i * bq), ov->dtype, ov->sn, ov->sd);
        }
        cpu_scratch_free(&s);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for attention tiles") : SPARGE_OK;
}
