/* Block-sparse attention backward: dQ, dK, dV of the forward with the mask held fixed (FlashAttention-2's
 * backward restricted to the kept blocks). */
#include <math.h>
#include <stdio.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu.h"
#include "ref.h"

static int keeps(const uint8_t *keep, int64_t nkb, int64_t i, int64_t j) { return !keep || keep[i * nkb + j]; }

static double dot(const double *a, const double *b, int64_t D)
{
    double s = 0.0;
    for (int64_t d = 0; d < D; d++)
        s += a[d] * b[d];
    return s;
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
            double dp = dot(d_o + t * D, v + u * D, D);
            double p = exp(scale * dot(q + t * D, k + u * D, D) - lse[t]), ds = p * (dp - delta);
            for (int64_t d = 0; d < D; d++) {
                dv[u * D + d] += p * d_o[t * D + d];
                dq[t * D + d] += scale * ds * k[u * D + d];
                dk[u * D + d] += scale * ds * q[t * D + d];
            }
        }
    }
}

/* cpu-ref: one (b, h) at a time in fp64; buffers first, so a failure writes nothing. */
sparge_status sparge_ref_backward(void *impl, const sparge_bwd_args *a)
{
    (void)impl;
    int64_t Nq = a->q.N, Nk = a->k.N, D = a->q.D;
    double *b[9];
    const int64_t sizes[9] = {Nq * D, Nk * D, Nk * D, Nq * D, Nq * D, Nq, Nq * D, Nk * D, Nk * D};
    if (!ref_alloc_all(9, b, sizes))
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu-ref: out of host memory for the backward");
    double *qd = b[0], *kd = b[1], *vd = b[2], *od = b[3], *dod = b[4], *lse = b[5], *dq = b[6], *dk = b[7],
           *dv = b[8];
    for (int64_t bh = 0; bh < a->q.B * a->q.H; bh++) {
        int64_t bi = bh / a->q.H, h = bh % a->q.H;
        ref_gather(&a->q, bi, h, qd);
        ref_gather(&a->k, bi, h, kd);
        ref_gather(&a->v, bi, h, vd);
        ref_gather(&a->o, bi, h, od);
        ref_gather(&a->d_o, bi, h, dod);
        for (int64_t t = 0; t < Nq; t++)
            lse[t] = a->lse[bh * Nq + t];
        sparge_ref_head_backward(qd, kd, vd, od, dod, lse, Nq, Nk, D, a->scale, a->bq, a->bk,
                                 ref_head_keep(a->mask, bi, h), dq, dk, dv);
        ref_scatter(&a->dq, bi, h, dq);
        ref_scatter(&a->dk, bi, h, dk);
        ref_scatter(&a->dv, bi, h, dv);
    }
    ref_free_all(9, b);
    return SPARGE_OK;
}

/* f32 operands of one head shared by the backward's phases: per query block
 * (sQ)ᵀ and dOᵀ (D × ldt each), Q and dO rows when the views cannot be used
 * directly, Δ = rowsum(dO∘O), and the dQ accumulator of the one-pass mode. */
typedef struct {
    float *qt, *dot, *q, *d_o, *delta, *dq;
} bwd_head;

/* Sᵀ → Pᵀ and dPᵀ → dSᵀ of query block i (nq rows) against one key block (nk rows of K and V). */
static void block_grads(const sparge_simd_ops *k_, const bwd_head *hd, int64_t i, int64_t ldt, int64_t D,
                        const float *lse, const float *kt, int64_t ldk, const float *vt, int64_t ldv, int64_t nq,
                        int64_t nk, float *pt, float *dst)
{
    k_->gemm(nk, nq, D, kt, ldk, 1, hd->qt + i * D * ldt, ldt, pt, ldt, 0, NULL);
    k_->gemm(nk, nq, D, vt, ldv, 1, hd->dot + i * D * ldt, ldt, dst, ldt, 0, NULL);
    k_->grad_cols(pt, dst, ldt, nk, nq, lse, hd->delta + i * ldt);
}

/* Two modes. Deterministic: dK, dV per key block, then dQ per query block in a
 * second pass that recomputes P and dS (7 block products per kept pair, no
 * shared writes). Otherwise: dQ is accumulated in the first pass under a lock
 * per query block (5 products per pair; the order of the dQ sums varies). */
sparge_status sparge_cpu_backward(void *impl, const sparge_bwd_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *qv = &a->q, *kv = &a->k, *vv = &a->v, *dov = &a->d_o;
    int64_t D = qv->D, Nq = qv->N, Nk = kv->N, H = qv->H, BH = qv->B * H, bq = a->bq, bk = a->bk;
    /* A block longer than the sequence holds the whole sequence: tiles never exceed it. */
    int64_t tq = bq < Nq ? bq : Nq, tk = bk < Nk ? bk : Nk, ldt = pad16(tq);
    int64_t nqb = (Nq + bq - 1) / bq, nkb = (Nk + bk - 1) / bk;
    int q_direct = qv->dtype == SPARGE_F32 && qv->sd == 1, do_direct = dov->dtype == SPARGE_F32 && dov->sd == 1;
    int one_pass = !a->deterministic;
    /* One head's operands at a time keeps the extra memory at a few Nq×D. */
    size_t tiles = (size_t)(nqb * D * ldt), rows = (size_t)(Nq * D);
    size_t floats = 2 * tiles + (size_t)(nqb * ldt) + (q_direct ? 0 : rows) + (do_direct ? 0 : rows) +
                    (one_pass ? rows : 0);
    float *shared = malloc(floats * sizeof(float));
#ifdef _OPENMP
    omp_lock_t *locks = one_pass ? malloc((size_t)nqb * sizeof *locks) : NULL;
#endif
    if (!shared
#ifdef _OPENMP
        || (one_pass && !locks)
#endif
    ) {
        free(shared);
#ifdef _OPENMP
        free(locks);
#endif
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for the backward");
    }
    bwd_head hd = {shared, shared + tiles, NULL, NULL, shared + 2 * tiles, NULL};
    float *next = hd.delta + nqb * ldt;
    if (!q_direct) {
        hd.q = next;
        next += rows;
    }
    if (!do_direct) {
        hd.d_o = next;
        next += rows;
    }
    if (one_pass)
        hd.dq = next;
#ifdef _OPENMP
    for (int64_t i = 0; one_pass && i < nqb; i++)
        omp_init_lock(&locks[i]);
#endif
    int failed = 0;
#pragma omp parallel
    {
        cpu_scratch s;
        size_t bmax = (size_t)(tq > tk ? tq : tk);
        size_t sizes[7] = {(size_t)(tk * ldt), (size_t)(tk * ldt), 2 * bmax * (size_t)D, 2 * bmax * (size_t)D,
                           (size_t)(nqb > nkb ? nqb : nkb), (size_t)bmax, (size_t)(D * ldt)};
        if (!cpu_scratch_alloc(&s, sizes, 7)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        float *pt = s.buf[0], *dst = s.buf[1], *acc = s.buf[2], *kbuf = s.buf[3], *vbuf = kbuf + bmax * D;
        float *scale_rows = s.buf[5], *ot = s.buf[6];
        int32_t *all = (int32_t *)s.buf[4];
        for (size_t r = 0; !failed && r < bmax; r++)
            scale_rows[r] = a->scale;
        for (int64_t bh = 0; !failed && bh < BH; bh++) {
            int64_t b = bh / H, h = bh % H;
            const float *lse = a->lse + bh * Nq;
            /* Phase 1: this head's (sQ)ᵀ, dOᵀ, f32 rows and Δ, per query block. */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nqb; i++) {
                int64_t nq = block_rows(i, bq, Nq), t0 = i * bq;
                k_->load(row_ptr(qv, b, h, t0), qv->dtype, qv->sn, qv->sd, nq, D, a->scale, hd.qt + i * D * ldt, ldt,
                         1);
                k_->load(row_ptr(dov, b, h, t0), dov->dtype, dov->sn, dov->sd, nq, D, 1.0f, hd.dot + i * D * ldt, ldt,
                         1);
                if (!q_direct)
                    k_->load(row_ptr(qv, b, h, t0), qv->dtype, qv->sn, qv->sd, nq, D, 1.0f, hd.q + t0 * D, D, 0);
                if (!do_direct)
                    k_->load(row_ptr(dov, b, h, t0), dov->dtype, dov->sn, dov->sd, nq, D, 1.0f, hd.d_o + t0 * D, D, 0);
                const sparge_view *ov = &a->o;
                k_->load(row_ptr(ov, b, h, t0), ov->dtype, ov->sn, ov->sd, nq, D, 1.0f, ot, ldt, 1);
                k_->dot_cols(ot, hd.dot + i * D * ldt, ldt, D, nq, hd.delta + i * ldt);
                if (one_pass)
                    memset(hd.dq + t0 * D, 0, (size_t)(nq * D) * sizeof(float));
            }
            /* Phase 2: dK, dV of each key block over the query blocks that keep it (and dQ in one-pass mode). */
#pragma omp for schedule(dynamic, 1)
            for (int64_t j = 0; j < nkb; j++) {
                int64_t nk = block_rows(j, bk, Nk), ldk, ldv;
                float *dk = acc, *dv = acc + bmax * D;
                const float *kt = rows_f32(k_, kv, b, h, j * bk, nk, kbuf, &ldk);
                const float *vt = rows_f32(k_, vv, b, h, j * bk, nk, vbuf, &ldv);
                const int32_t *idx = all;
                int64_t cnt = nqb;
                if (a->mask) {
                    idx = a->mask->t_indices + (bh * nkb + j) * nqb;
                    cnt = a->mask->t_counts[bh * nkb + j];
                } else
                    for (int64_t i = 0; i < nqb; i++)
                        all[i] = (int32_t)i;
                if (cnt == 0) /* no query keeps this block: zero gradient */
                    memset(acc, 0, 2 * bmax * (size_t)D * sizeof(float));
                /* In one-pass mode, key blocks start at different query blocks so the dQ locks rarely collide. */
                int64_t start = one_pass && cnt ? j % cnt : 0;
                for (int64_t c = 0; c < cnt; c++) {
                    int64_t i = idx[(start + c) % cnt], nq = block_rows(i, bq, Nq), t0 = i * bq;
                    if (c + 1 < cnt) {
                        int64_t in = idx[(start + c + 1) % cnt], nqn = block_rows(in, bq, Nq);
                        prefetch_span(hd.qt + in * D * ldt, (size_t)(D * ldt) * sizeof(float));
                        prefetch_span(hd.dot + in * D * ldt, (size_t)(D * ldt) * sizeof(float));
                        if (q_direct)
                            prefetch_rows(qv, b, h, in * bq, nqn);
                        if (do_direct)
                            prefetch_rows(dov, b, h, in * bq, nqn);
                    }
                    const float *qr = q_direct ? row_ptr(qv, b, h, t0) : hd.q + t0 * D;
                    const float *dor = do_direct ? row_ptr(dov, b, h, t0) : hd.d_o + t0 * D;
                    int64_t ldq = q_direct ? qv->sn : D, lddo = do_direct ? dov->sn : D;
                    block_grads(k_, &hd, i, ldt, D, lse + t0, kt, ldk, vt, ldv, nq, nk, pt, dst);
                    k_->gemm(nk, D, nq, pt, ldt, 1, dor, lddo, dv, D, c > 0, NULL);  /* dV += Pᵀ dO */
                    k_->gemm(nk, D, nq, dst, ldt, 1, qr, ldq, dk, D, c > 0, NULL);   /* dK += dSᵀ Q */
                    if (one_pass) {
#ifdef _OPENMP
                        omp_set_lock(&locks[i]);
#endif
                        k_->gemm(nq, D, nk, dst, 1, ldt, kt, ldk, hd.dq + t0 * D, D, 1, NULL); /* dQ += dS K */
#ifdef _OPENMP
                        omp_unset_lock(&locks[i]);
#endif
                    }
                }
                k_->store(dk, D, scale_rows, nk, D, row_ptr(&a->dk, b, h, j * bk), a->dk.dtype, a->dk.sn, a->dk.sd);
                k_->store(dv, D, NULL, nk, D, row_ptr(&a->dv, b, h, j * bk), a->dv.dtype, a->dv.sn, a->dv.sd);
            }
            /* Phase 3: dQ of each query block (deterministic mode: over its kept key blocks). */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < nqb; i++) {
                int64_t nq = block_rows(i, bq, Nq), t0 = i * bq;
                const float *dq = one_pass ? hd.dq + t0 * D : acc;
                const int32_t *idx;
                int64_t cnt = one_pass ? 0 : kept_blocks(a->mask, bh, i, nkb, &idx, all);
                for (int64_t c = 0; c < cnt; c++) {
                    int64_t j = idx[c], nk = block_rows(j, bk, Nk), ldk, ldv;
                    if (c + 1 < cnt) {
                        int64_t jn = idx[c + 1], nkn = block_rows(jn, bk, Nk);
                        prefetch_rows(kv, b, h, jn * bk, nkn);
                        prefetch_rows(vv, b, h, jn * bk, nkn);
                    }
                    const float *kt = rows_f32(k_, kv, b, h, j * bk, nk, kbuf, &ldk);
                    const float *vt = rows_f32(k_, vv, b, h, j * bk, nk, vbuf, &ldv);
                    block_grads(k_, &hd, i, ldt, D, lse + t0, kt, ldk, vt, ldv, nq, nk, pt, dst);
                    k_->gemm(nq, D, nk, dst, 1, ldt, kt, ldk, acc, D, c > 0, NULL); /* dQ += dS K */
                }
                k_->store(dq, D, scale_rows, nq, D, row_ptr(&a->dq, b, h, t0), a->dq.dtype, a->dq.sn, a->dq.sd);
            }
        }
        cpu_scratch_free(&s);
    }
#ifdef _OPENMP
    for (int64_t i = 0; one_pass && i < nqb; i++)
        omp_destroy_lock(&locks[i]);
    free(locks);
#endif
    free(shared);
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for backward tiles") : SPARGE_OK;
}

