/* Block-sparse attention backward: dQ, dK, dV of the forward with the mask held fixed (FlashAttention-2's
 * backward restricted to the kept blocks). */
#include <math.h>
#include <stdio.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu.h"
#include "ref.h"

static int keeps(const uint8_t *keep, int64_t stride, int64_t i, int64_t j) { return !keep || keep[i * stride + j]; }

static double dot(const double *a, const double *b, int64_t D)
{
    double s = 0.0;
    for (int64_t d = 0; d < D; d++)
        s += a[d] * b[d];
    return s;
}

void sparge_ref_head_backward(const double *q, const double *k, const double *v, const double *o, const double *d_o,
                              const double *lse, int64_t Nq, int64_t Nk, int64_t D, double scale, int bq, int bk,
                              int causal, const uint8_t *keep, int64_t keep_stride, double *dq, double *dk, double *dv)
{
    memset(dq, 0, (size_t)(Nq * D) * sizeof *dq);
    for (int64_t t = 0; t < Nq; t++) {
        int64_t i = t / bq, end = causal ? t + Nk - Nq + 1 : Nk;
        double delta = 0.0;
        for (int64_t d = 0; d < D; d++)
            delta += d_o[t * D + d] * o[t * D + d];
        for (int64_t u = 0; u < end; u++) {
            if (!keeps(keep, keep_stride, i, u / bk))
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

/* cpu-ref: one (sequence, K head) at a time in fp64: its query heads' dQ, and dK, dV summed over them in head
 * order; buffers first, so a failure writes nothing. */
sparge_status sparge_ref_backward(void *impl, const sparge_bwd_args *a)
{
    (void)impl;
    const sparge_mask_view *m = a->mask;
    const int64_t D = a->q.D, H = a->q.H, Hk = a->k.H, group = H / Hk, Nq = a->q.N, Nk = a->k.N;
    double *b[9];
    const int64_t sizes[9] = {Nq * D, Nk * D, Nk * D, Nq * D, Nq * D, Nq, Nq * D, Nk * D, Nk * D};
    if (!ref_alloc_all(9, b, sizes))
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu-ref: out of host memory for the backward");
    double *qd = b[0], *kd = b[1], *vd = b[2], *od = b[3], *dod = b[4], *lse = b[5], *dq = b[6], *dk = b[7],
           *dv = b[8];
    for (int64_t bk_ = 0; bk_ < attn_batches(&a->q, m) * Hk; bk_++) {
        int64_t s = bk_ / Hk, hk = bk_ % Hk, tb, q0, nq, k0, nk;
        cpu_seq(m, s, Nq, Nk, &tb, &q0, &nq, &k0, &nk);
        ref_gather(&a->k, tb, hk, k0, nk, kd);
        ref_gather(&a->v, tb, hk, k0, nk, vd);
        memset(dk, 0, (size_t)(nk * D) * sizeof *dk);
        memset(dv, 0, (size_t)(nk * D) * sizeof *dv);
        for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
            ref_gather(&a->q, tb, h, q0, nq, qd);
            ref_gather(&a->o, tb, h, q0, nq, od);
            ref_gather(&a->d_o, tb, h, q0, nq, dod);
            for (int64_t t = 0; t < nq; t++)
                lse[t] = a->lse[lse_index(&a->q, tb, h, q0 + t)];
            sparge_ref_head_backward(qd, kd, vd, od, dod, lse, nq, nk, D, a->scale, a->bq, a->bk, a->causal,
                                     ref_head_keep(m, s, h), m ? m->Nkb : 0, dq, dk, dv);
            ref_scatter(&a->dq, tb, h, q0, nq, dq);
        }
        ref_scatter(&a->dk, tb, hk, k0, nk, dk);
        ref_scatter(&a->dv, tb, hk, k0, nk, dv);
    }
    ref_free_all(9, b);
    return SPARGE_OK;
}

/* f32 operands of one query head shared by the backward's phases: per query block (sQ)ᵀ and dOᵀ (D × ldt
 * each), Q and dO rows when the views cannot be used directly, Δ = rowsum(dO∘O), and the dQ accumulator of the
 * one-pass mode. */
typedef struct {
    float *qt, *dot, *q, *d_o, *delta, *dq;
} bwd_head;

/* Where a query block and key block of a sequence sit against the causal diagonal. */
typedef struct {
    int causal;
    int64_t off; /* Nk − Nq of the sequence */
} bwd_diag;

/* Sᵀ → Pᵀ and dPᵀ → dSᵀ of query block i (nq rows from token t0) against one key block (nk rows of K and V from
 * token u0); keys past a query's causal diagonal get P = dS = 0. */
static void block_grads(const sparge_simd_ops *k_, const bwd_head *hd, int64_t i, int64_t ldt, int64_t D,
                        const float *lse, const float *kt, int64_t ldk, const float *vt, int64_t ldv, int64_t nq,
                        int64_t nk, float *pt, float *dst, bwd_diag diag, int64_t t0, int64_t u0)
{
    k_->gemm(nk, nq, D, kt, ldk, 1, hd->qt + i * D * ldt, ldt, pt, ldt, 0, NULL);
    k_->gemm(nk, nq, D, vt, ldv, 1, hd->dot + i * D * ldt, ldt, dst, ldt, 0, NULL);
    if (diag.causal && u0 + nk - 1 > t0 + diag.off)
        sparge_cpu_causal_tile(pt, ldt, nk, nq, u0, t0, diag.off);
    k_->grad_cols(pt, dst, ldt, nk, nq, lse, hd->delta + i * ldt);
}

/* Two modes. Deterministic: dK, dV per key block, then dQ per query block in a second pass that recomputes P and dS
 * (7 block products per kept pair, no shared writes). Otherwise: dQ is accumulated in the first pass under a lock
 * per query block (5 products per pair; the order of the dQ sums varies). Work goes by (sequence, K head): the
 * group's query heads one after the other, each adding its dK, dV into f32 accumulators of the K head, which are
 * stored after the last one (a fixed order: deterministic in both modes). */
sparge_status sparge_cpu_backward(void *impl, const sparge_bwd_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *qv = &a->q, *kv = &a->k, *vv = &a->v, *dov = &a->d_o;
    const sparge_mask_view *mk = a->mask;
    int64_t D = qv->D, Nq = qv->N, Nk = kv->N, H = qv->H, Hk = kv->H, group = H / Hk, bq = a->bq, bk = a->bk;
    /* A block longer than the sequence holds the whole sequence: tiles never exceed it. */
    int64_t tq = bq < Nq ? bq : Nq, tk = bk < Nk ? bk : Nk, ldt = pad16(tq);
    /* The mask's layout (varlen: the longest sequence's blocks) gives the CSR strides and the buffers' sizes. */
    int64_t lqb = mk ? mk->Nqb : (Nq + bq - 1) / bq, lkb = mk ? mk->Nkb : (Nk + bk - 1) / bk;
    int q_direct = qv->dtype == SPARGE_F32 && qv->sd == 1, do_direct = dov->dtype == SPARGE_F32 && dov->sd == 1;
    int one_pass = !a->deterministic;
    /* One head's operands at a time keeps the extra memory at a few Nq×D. */
    size_t tiles = (size_t)(lqb * D * ldt), rows = (size_t)(Nq * D), krows = (size_t)(Nk * D);
    size_t floats = 2 * tiles + (size_t)(lqb * ldt) + (q_direct ? 0 : rows) + (do_direct ? 0 : rows) +
                    (one_pass ? rows : 0) + 2 * krows;
    float *shared = malloc(floats * sizeof(float));
#ifdef _OPENMP
    omp_lock_t *locks = one_pass ? malloc((size_t)lqb * sizeof *locks) : NULL;
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
    float *next = hd.delta + lqb * ldt;
    if (!q_direct) {
        hd.q = next;
        next += rows;
    }
    if (!do_direct) {
        hd.d_o = next;
        next += rows;
    }
    if (one_pass) {
        hd.dq = next;
        next += rows;
    }
    float *dk_acc = next, *dv_acc = next + krows; /* the K head's dK, dV over its query heads */
#ifdef _OPENMP
    for (int64_t i = 0; one_pass && i < lqb; i++)
        omp_init_lock(&locks[i]);
#endif
    int failed = 0;
#pragma omp parallel
    {
        cpu_scratch s;
        size_t bmax = (size_t)(tq > tk ? tq : tk);
        size_t sizes[7] = {(size_t)(tk * ldt), (size_t)(tk * ldt), 2 * bmax * (size_t)D, 2 * bmax * (size_t)D,
                           (size_t)(lqb > lkb ? lqb : lkb), (size_t)bmax, (size_t)(D * ldt)};
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
        for (int64_t sk = 0; !failed && sk < attn_batches(qv, mk) * Hk; sk++) {
            int64_t sq = sk / Hk, hk = sk % Hk, b, q0, nqs, k0, nks;
            cpu_seq(mk, sq, Nq, Nk, &b, &q0, &nqs, &k0, &nks);
            const int64_t nqb = (nqs + bq - 1) / bq, nkb = (nks + bk - 1) / bk;
            const bwd_diag diag = {a->causal, nks - nqs};
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                const int64_t bh = sq * H + h, first = h == hk * group;
                const float *lse = a->lse + lse_index(qv, b, h, q0);
                /* Phase 1: this head's (sQ)ᵀ, dOᵀ, f32 rows and Δ, per query block. */
#pragma omp for schedule(static)
                for (int64_t i = 0; i < nqb; i++) {
                    int64_t nq = block_rows(i, bq, nqs), t0 = i * bq;
                    k_->load(row_ptr(qv, b, h, q0 + t0), qv->dtype, qv->sn, qv->sd, nq, D, a->scale, hd.qt + i * D * ldt,
                             ldt, 1);
                    k_->load(row_ptr(dov, b, h, q0 + t0), dov->dtype, dov->sn, dov->sd, nq, D, 1.0f,
                             hd.dot + i * D * ldt, ldt, 1);
                    if (!q_direct)
                        k_->load(row_ptr(qv, b, h, q0 + t0), qv->dtype, qv->sn, qv->sd, nq, D, 1.0f, hd.q + t0 * D, D, 0);
                    if (!do_direct)
                        k_->load(row_ptr(dov, b, h, q0 + t0), dov->dtype, dov->sn, dov->sd, nq, D, 1.0f, hd.d_o + t0 * D,
                                 D, 0);
                    const sparge_view *ov = &a->o;
                    k_->load(row_ptr(ov, b, h, q0 + t0), ov->dtype, ov->sn, ov->sd, nq, D, 1.0f, ot, ldt, 1);
                    k_->dot_cols(ot, hd.dot + i * D * ldt, ldt, D, nq, hd.delta + i * ldt);
                    if (one_pass)
                        memset(hd.dq + t0 * D, 0, (size_t)(nq * D) * sizeof(float));
                }
                /* Phase 2: dK, dV of each key block over the query blocks that keep it (and dQ in one-pass mode). */
#pragma omp for schedule(dynamic, 1)
                for (int64_t j = 0; j < nkb; j++) {
                    int64_t nk = block_rows(j, bk, nks), ldk, ldv;
                    float *dk = acc, *dv = acc + bmax * D;
                    const float *kt = rows_f32(k_, kv, b, hk, k0 + j * bk, nk, kbuf, &ldk);
                    const float *vt = rows_f32(k_, vv, b, hk, k0 + j * bk, nk, vbuf, &ldv);
                    const int32_t *idx = all;
                    int64_t cnt = 0;
                    if (mk) {
                        idx = mk->t_indices + (bh * lkb + j) * lqb;
                        cnt = mk->t_counts[bh * lkb + j];
                    } else
                        for (int64_t i = 0, allowed, d0, d1; i < nqb; i++) {
                            sparge_row_rule(i, nqs, nks, (int)bq, (int)bk, a->causal, &allowed, &d0, &d1);
                            if (j < allowed)
                                all[cnt++] = (int32_t)i;
                        }
                    if (cnt == 0) /* no query keeps this block: zero gradient */
                        memset(acc, 0, 2 * bmax * (size_t)D * sizeof(float));
                    /* In one-pass mode, key blocks start at different query blocks so the dQ locks rarely collide. */
                    int64_t start = one_pass && cnt ? j % cnt : 0;
                    for (int64_t c = 0; c < cnt; c++) {
                        int64_t i = idx[(start + c) % cnt], nq = block_rows(i, bq, nqs), t0 = i * bq;
                        if (c + 1 < cnt) {
                            int64_t in = idx[(start + c + 1) % cnt], nqn = block_rows(in, bq, nqs);
                            prefetch_span(hd.qt + in * D * ldt, (size_t)(D * ldt) * sizeof(float));
                            prefetch_span(hd.dot + in * D * ldt, (size_t)(D * ldt) * sizeof(float));
                            if (q_direct)
                                prefetch_rows(qv, b, h, q0 + in * bq, nqn);
                            if (do_direct)
                                prefetch_rows(dov, b, h, q0 + in * bq, nqn);
                        }
                        const float *qr = q_direct ? row_ptr(qv, b, h, q0 + t0) : hd.q + t0 * D;
                        const float *dor = do_direct ? row_ptr(dov, b, h, q0 + t0) : hd.d_o + t0 * D;
                        int64_t ldq = q_direct ? qv->sn : D, lddo = do_direct ? dov->sn : D;
                        block_grads(k_, &hd, i, ldt, D, lse + t0, kt, ldk, vt, ldv, nq, nk, pt, dst, diag, t0, j * bk);
                        k_->gemm(nk, D, nq, pt, ldt, 1, dor, lddo, dv, D, c > 0, NULL); /* dV += Pᵀ dO */
                        k_->gemm(nk, D, nq, dst, ldt, 1, qr, ldq, dk, D, c > 0, NULL);  /* dK += dSᵀ Q */
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
                    float *dk_sum = dk_acc + j * bk * D, *dv_sum = dv_acc + j * bk * D;
                    for (int64_t e = 0; e < nk * D; e++) {
                        dk_sum[e] = first ? dk[e] : dk_sum[e] + dk[e];
                        dv_sum[e] = first ? dv[e] : dv_sum[e] + dv[e];
                    }
                }
                /* Phase 3: dQ of each query block (deterministic mode: over its kept key blocks). */
#pragma omp for schedule(dynamic, 1)
                for (int64_t i = 0; i < nqb; i++) {
                    int64_t nq = block_rows(i, bq, nqs), t0 = i * bq, allowed, d0, d1;
                    const float *dq = one_pass ? hd.dq + t0 * D : acc;
                    const int32_t *idx = all;
                    int64_t cnt = one_pass ? 0 : kept_blocks(mk, bh, i, lkb, &idx, all);
                    sparge_row_rule(i, nqs, nks, (int)bq, (int)bk, a->causal, &allowed, &d0, &d1);
                    if (!mk && cnt > allowed)
                        cnt = allowed;
                    const kv_source src = {k_, kv, vv, b, hk, k0, bk, nks, kbuf, vbuf};
                    for (int64_t c = 0; c < cnt; c++) {
                        const kv_tile t = kv_block_f32(&src, idx, c, cnt);
                        block_grads(k_, &hd, i, ldt, D, lse + t0, t.k, t.ldk, t.v, t.ldv, nq, t.rows, pt, dst, diag, t0,
                                    idx[c] * bk);
                        k_->gemm(nq, D, t.rows, dst, 1, ldt, t.k, t.ldk, acc, D, c > 0, NULL); /* dQ += dS K */
                    }
                    if (cnt == 0)
                        memset(acc, 0, (size_t)(nq * D) * sizeof(float));
                    k_->store(dq, D, scale_rows, nq, D, row_ptr(&a->dq, b, h, q0 + t0), a->dq.dtype, a->dq.sn,
                              a->dq.sd);
                }
            }
            /* The K head's dK, dV once every query head of its group has added to them. */
#pragma omp for schedule(static)
            for (int64_t j = 0; j < nkb; j++) {
                int64_t nk = block_rows(j, bk, nks);
                k_->store(dk_acc + j * bk * D, D, scale_rows, nk, D, row_ptr(&a->dk, b, hk, k0 + j * bk), a->dk.dtype,
                          a->dk.sn, a->dk.sd);
                k_->store(dv_acc + j * bk * D, D, NULL, nk, D, row_ptr(&a->dv, b, hk, k0 + j * bk), a->dv.dtype,
                          a->dv.sn, a->dv.sd);
            }
        }
        cpu_scratch_free(&s);
    }
#ifdef _OPENMP
    for (int64_t i = 0; one_pass && i < lqb; i++)
        omp_destroy_lock(&locks[i]);
    free(locks);
#endif
    free(shared);
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for backward tiles") : SPARGE_OK;
}
