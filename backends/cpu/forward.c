/* Block-sparse attention forward: O and LSE of every query over the tokens of its kept key blocks. */
#include <math.h>
#include <stdio.h>

#include "cpu.h"
#include "ref.h"

/* Key u of block row i may be attended by query t: kept block (keep NULL: every block), and with causal at most
 * t + Nk − Nq. */
static int keeps(const uint8_t *keep, int64_t stride, int64_t i, int64_t j) { return !keep || keep[i * stride + j]; }

static double score(const double *q, const double *k, int64_t D, double scale)
{
    double dot = 0.0;
    for (int64_t d = 0; d < D; d++)
        dot += q[d] * k[d];
    return scale * dot;
}

/* Two passes over the attended keys (max, then sum): no scratch memory. */
void sparge_ref_head_forward(const double *q, const double *k, const double *v, int64_t Nq, int64_t Nk, int64_t D,
                             double scale, int bq, int bk, int causal, const uint8_t *keep, int64_t keep_stride,
                             double *o, double *lse)
{
    const int64_t last = causal ? Nk - Nq : Nk; /* key u attended when u <= t + last (causal) */
    for (int64_t t = 0; t < Nq; t++) {
        int64_t i = t / bq, end = causal ? t + last + 1 : Nk;
        double m = -INFINITY, sum = 0.0;
        for (int64_t u = 0; u < end; u++)
            if (keeps(keep, keep_stride, i, u / bk)) {
                double s = score(q + t * D, k + u * D, D, scale);
                if (s > m)
                    m = s;
            }
        for (int64_t d = 0; d < D; d++)
            o[t * D + d] = 0.0;
        for (int64_t u = 0; u < end; u++) {
            if (!keeps(keep, keep_stride, i, u / bk))
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

/* cpu-ref: one (sequence, query head) at a time in fp64, reading its group's K/V head. Work buffers are allocated
 * before the first head is written, so a failure leaves the outputs untouched. */
sparge_status sparge_ref_forward(void *impl, const sparge_fwd_args *a)
{
    (void)impl;
    const sparge_mask_view *m = a->mask;
    const int64_t D = a->q.D, H = a->q.H, group = H / a->k.H;
    double *b[5];
    const int64_t sizes[5] = {a->q.N * D, a->k.N * D, a->k.N * D, a->q.N * D, a->q.N};
    if (!ref_alloc_all(5, b, sizes))
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu-ref: out of host memory for the forward");
    double *qd = b[0], *kd = b[1], *vd = b[2], *o = b[3], *lse = b[4];
    for (int64_t bh = 0; bh < attn_batches(&a->q, m) * H; bh++) {
        int64_t s = bh / H, h = bh % H, tb, q0, nq, k0, nk;
        cpu_seq(m, s, a->q.N, a->k.N, &tb, &q0, &nq, &k0, &nk);
        ref_gather(&a->q, tb, h, q0, nq, qd);
        ref_gather(&a->k, tb, h / group, k0, nk, kd);
        ref_gather(&a->v, tb, h / group, k0, nk, vd);
        sparge_ref_head_forward(qd, kd, vd, nq, nk, D, a->scale, a->bq, a->bk, a->causal, ref_head_keep(m, s, h),
                                m ? m->Nkb : 0, o, lse);
        ref_scatter(&a->o, tb, h, q0, nq, o);
        if (a->lse)
            for (int64_t t = 0; t < nq; t++)
                a->lse[lse_index(&a->q, tb, h, q0 + t)] = (float)lse[t];
    }
    ref_free_all(5, b);
    return SPARGE_OK;
}

/* Queries past key u's diagonal (causal) get -inf in Sᵀ [key × query] of key block j against query block i. */
void sparge_cpu_causal_tile(float *st, int64_t ldt, int64_t nk, int64_t nq, int64_t u0, int64_t t0, int64_t off)
{
    for (int64_t r = 0; r < nk; r++)
        for (int64_t c = 0; c < nq && u0 + r > t0 + c + off; c++)
            st[r * ldt + c] = -INFINITY;
}

/* cpu: OpenMP over (sequence, head, query block), tiled online softmax. Tiles are computed transposed,
 * Sᵀ = K·(s·Q)ᵀ [key × query], so that K and V are used row-major straight from f32 views (no copy, no
 * transpose), each query block's Qᵀ is built once and reused over all its key blocks, and the softmax statistics
 * of a query are vertical vector operations (no horizontal reductions). Every product goes through one
 * register-blocked GEMM. */
sparge_status sparge_cpu_forward(void *impl, const sparge_fwd_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *qv = &a->q, *kv = &a->k, *vv = &a->v, *ov = &a->o;
    const sparge_mask_view *mk = a->mask;
    int64_t D = qv->D, Nq = qv->N, Nk = kv->N, H = qv->H, group = H / kv->H, bq = a->bq, bk = a->bk;
    /* A block longer than the sequence holds the whole sequence: tiles never exceed it. */
    int64_t tq = bq < Nq ? bq : Nq, tk = bk < Nk ? bk : Nk, ldt = pad16(tq);
    /* Rows and the CSR's row stride follow the mask's layout (varlen: the longest sequence's blocks). */
    int64_t nqb = mk ? mk->Nqb : (Nq + bq - 1) / bq, nkb = mk ? mk->Nkb : (Nk + bk - 1) / bk;
    int64_t tasks = attn_batches(qv, mk) * H * nqb, claimed = 0;
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
        /* Dynamic scheduling that claims the next task one ahead, so that its Q block can be prefetched during the
         * last pair. */
        int64_t next = tasks;
        if (!failed) {
#pragma omp atomic capture
            next = claimed++;
        }
        while (next < tasks) {
            int64_t task = next;
#pragma omp atomic capture
            next = claimed++;
            int64_t bh = task / nqb, i = task % nqb, sq = bh / H, h = bh % H, hk = h / group, b, q0, nqs, k0, nks;
            cpu_seq(mk, sq, Nq, Nk, &b, &q0, &nqs, &k0, &nks);
            if (i * bq >= nqs)
                continue; /* past this sequence's query blocks */
            int64_t nq = block_rows(i, bq, nqs), allowed, d0, d1;
            sparge_row_rule(i, nqs, nks, (int)bq, (int)bk, a->causal, &allowed, &d0, &d1);
            const int32_t *idx;
            int64_t cnt = kept_blocks(mk, bh, i, nkb, &idx, all);
            if (!mk && cnt > allowed) /* dense causal: the blocks up to the diagonal */
                cnt = allowed;
            k_->load(row_ptr(qv, b, h, q0 + i * bq), qv->dtype, qv->sn, qv->sd, nq, D, a->scale, qt, ldt, 1);
            for (int64_t r = 0; r < nq; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            const kv_source src = {k_, kv, vv, b, hk, k0, bk, nks, kbuf, vbuf};
            for (int64_t c = 0; c < cnt; c++) {
                const int64_t j = idx[c];
                const kv_tile t = kv_block_f32(&src, idx, c, cnt);
                k_->gemm(t.rows, nq, D, t.k, t.ldk, 1, qt, ldt, st_, ldt, 0, NULL); /* Sᵀ = K (sQ)ᵀ */
                if (a->causal && j >= d0)
                    sparge_cpu_causal_tile(st_, ldt, t.rows, nq, j * bk, i * bq, nks - nqs);
                k_->softmax_cols(st_, ldt, t.rows, nq, m, l, corr);                 /* Pᵀ, m, l */
                k_->gemm(nq, D, t.rows, st_, 1, ldt, t.v, t.ldv, ot, D, c > 0, corr); /* O = corr·O + P V */
            }
            for (int64_t r = 0; r < nq; r++) {
                inv[r] = 1.0f / l[r];
                if (a->lse)
                    a->lse[lse_index(qv, b, h, q0 + i * bq + r)] = m[r] + logf(l[r]);
            }
            k_->store(ot, D, inv, nq, D, row_ptr(ov, b, h, q0 + i * bq), ov->dtype, ov->sn, ov->sd);
            if (next < tasks) {
                int64_t bhn = next / nqb, in = next % nqb, bn, q0n, nqn, k0n, nkn;
                cpu_seq(mk, bhn / H, Nq, Nk, &bn, &q0n, &nqn, &k0n, &nkn);
                if (in * bq < nqn)
                    prefetch_rows(qv, bn, bhn % H, q0n + in * bq, block_rows(in, bq, nqn));
            }
        }
        cpu_scratch_free(&s);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for attention tiles") : SPARGE_OK;
}
