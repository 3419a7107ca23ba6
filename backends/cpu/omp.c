/* Backend "cpu": OpenMP over (batch, head, query block), tiled online-softmax
 * forward, and a backward that only visits kept blocks (dK/dV per key block
 * through the transposed mask; dQ in the same pass under per-block locks, or,
 * when deterministic, per query block in a second pass).
 *
 * Tiles are computed transposed, Sᵀ = K·(s·Q)ᵀ [key × query], so that K and V
 * are used row-major straight from f32 views (no copy, no transpose), each
 * query block's Qᵀ is built once and reused over all its key blocks, and the
 * softmax statistics of a query are vertical vector operations (no horizontal
 * reductions). Every product goes through one register-blocked GEMM. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "config.h"
#include "cpu.h"
#include "simd.h"
#include "topology.h"

typedef struct {
    const sparge_simd_ops *simd;
} cpu_ctx;

/* The widest tier this CPU runs, or the one named by SPARGE_CPU_SIMD when the
 * CPU runs that one (tests use it to cover every tier on one machine); NULL
 * when SPARGE_CPU_SIMD names no tier. */
const sparge_simd_ops *sparge_simd_best(void)
{
    const sparge_simd_ops *usable[3];
    int n = 0;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#ifdef SPARGE_HAVE_AVX512
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        usable[n++] = &sparge_simd_avx512;
#endif
#ifdef SPARGE_HAVE_AVX2
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        usable[n++] = &sparge_simd_avx2;
#endif
#endif
    usable[n++] = &sparge_simd_generic;
    const char *want = getenv("SPARGE_CPU_SIMD");
    if (want && strcmp(want, "generic") && strcmp(want, "avx2") && strcmp(want, "avx512"))
        return NULL;
    for (int i = 0; want && i < n; i++)
        if (strcmp(want, usable[i]->name) == 0)
            return usable[i];
    return usable[0];
}

static int max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int cpu_device_count(void) { return 1; }

static sparge_status cpu_open(int index, void **impl, char *desc, size_t len)
{
    (void)index;
    cpu_ctx *ctx = malloc(sizeof *ctx);
    if (!ctx)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory");
    if (!(ctx->simd = sparge_simd_best())) {
        free(ctx);
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "cpu: SPARGE_CPU_SIMD must be generic, avx2 or avx512, got \"%s\"",
                           getenv("SPARGE_CPU_SIMD"));
    }
    int bound = sparge_cpu_bind_threads();
    snprintf(desc, len, "%d OpenMP thread(s), SIMD %s, %s", max_threads(), ctx->simd->name,
             bound ? "workers bound to cores by hwloc" : "not bound");
    *impl = ctx;
    return SPARGE_OK;
}

static void cpu_close(void *impl) { free(impl); }

static int64_t block_rows(int64_t i, int block, int64_t n) { return i * block + block <= n ? block : n - i * block; }

/* Query-indexed tiles are padded to whole vectors (and 64-byte rows). */
static int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

/* Address of element (b, h, n, 0) of x. */
static void *row_ptr(const sparge_view *x, int64_t b, int64_t h, int64_t n)
{
    return (char *)x->data + (size_t)view_offset(x, b, h, n, 0) * sparge_dtype_size(x->dtype);
}

/* Rows [n0, n0 + rows) of x as f32 rows: the view itself when it is f32 with
 * unit d-stride (no copy), else converted into buf. Sets *ld to the row stride. */
static const float *rows_f32(const sparge_simd_ops *k_, const sparge_view *x, int64_t b, int64_t h, int64_t n0,
                             int64_t rows, float *buf, int64_t *ld)
{
    if (x->dtype == SPARGE_F32 && x->sd == 1) {
        *ld = x->sn;
        return row_ptr(x, b, h, n0);
    }
    k_->load(row_ptr(x, b, h, n0), x->dtype, x->sn, x->sd, rows, x->D, 1.0f, buf, x->D, 0);
    *ld = x->D;
    return buf;
}

/* Ask for rows [n0, n0 + rows) of x to be brought towards L2 while the current
 * block is computed: kept key blocks are scattered, so the hardware prefetcher
 * cannot guess the next one. */
static void prefetch_rows(const sparge_view *x, int64_t b, int64_t h, int64_t n0, int64_t rows)
{
#if defined(__GNUC__)
    size_t bytes = (size_t)(x->D * x->sd) * sparge_dtype_size(x->dtype);
    for (int64_t r = 0; r < rows; r++) {
        const char *p = row_ptr(x, b, h, n0 + r);
        for (size_t off = 0; off < bytes; off += 64)
            __builtin_prefetch(p + off, 0, 2);
    }
#else
    (void)x, (void)b, (void)h, (void)n0, (void)rows;
#endif
}

/* Per-thread scratch: all buffers or none. */
enum { MAX_SCRATCH = 10 };
typedef struct {
    float *buf[MAX_SCRATCH];
} scratch;

static int scratch_alloc(scratch *s, const size_t *floats, int n)
{
    int ok = 1;
    memset(s, 0, sizeof *s);
    for (int i = 0; i < n; i++)
        ok &= (s->buf[i] = aligned_alloc(64, (floats[i] * sizeof(float) + 63) / 64 * 64)) != NULL;
    return ok;
}

static void scratch_free(scratch *s)
{
    for (int i = 0; i < MAX_SCRATCH; i++)
        free(s->buf[i]);
}

/* Block means. When the heads of a token are adjacent (BNHD: sh = D, sd = 1), a
 * task sums every head of a block at once, as rows of H·D elements, so that the
 * reads are sequential; otherwise a task is one (b, h, block). Tasks go block
 * by block, so a thread's share is one contiguous span of either layout. */
static sparge_status cpu_pool(void *impl, const sparge_pool_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_view *x = &a->x, *o = &a->out;
    int fused = x->H > 1 && x->sd == 1 && x->sh == x->D;
    int64_t D = x->D, heads = fused ? x->H : 1, width = heads * D, groups = x->B * (fused ? 1 : x->H);
    int64_t tasks = groups * o->N;
    int failed = 0;
#pragma omp parallel
    {
        float *acc = malloc((size_t)width * sizeof *acc);
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t i = t / groups, g = t % groups, b = fused ? g : g / x->H, h = fused ? 0 : g % x->H;
                int64_t rows = block_rows(i, a->block, x->N);
                memset(acc, 0, (size_t)width * sizeof *acc);
                ctx->simd->sum_rows(row_ptr(x, b, h, i * a->block), x->dtype, x->sn, x->sd, rows, width, acc);
                for (int64_t e = 0; e < width; e++)
                    acc[e] /= (float)rows;
                for (int64_t hh = 0; hh < heads; hh++)
                    ctx->simd->store(acc + hh * D, D, NULL, 1, D, row_ptr(o, b, h + hh, i), o->dtype, o->sn, o->sd);
            }
        }
        free(acc);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for pooling") : SPARGE_OK;
}

static sparge_status cpu_pooled_map(void *impl, const sparge_map_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *q = &a->qbar, *k = &a->kbar, *m = &a->map;
    int64_t D = q->D, nqb = q->N, nkb = k->N;
    int failed = 0;
#pragma omp parallel
    {
        scratch s;
        size_t sizes[3] = {(size_t)(nqb * D), (size_t)(D * nkb), (size_t)(nqb * nkb)};
        if (!scratch_alloc(&s, sizes, 3)) {
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
                k_->load(row_ptr(k, b, h, 0), k->dtype, k->sn, k->sd, nkb, D, 1.0f, kbar_t, nkb, 1);
                k_->gemm(nqb, nkb, D, qbar, D, 1, kbar_t, nkb, map, nkb, 0, NULL);
                for (int64_t i = 0; i < nqb; i++) {
                    float *row = map + i * nkb, mx = -INFINITY;
                    int nan = 0;
                    for (int64_t j = 0; j < nkb; j++) {
                        row[j] *= a->scale;
                        nan |= isnan(row[j]);
                        mx = row[j] > mx ? row[j] : mx;
                    }
                    float inv = nan ? NAN : 1.0f / k_->exp_sum(row, nkb, mx);
                    k_->store(row, nkb, &inv, 1, nkb, row_ptr(m, b, h, i), m->dtype, m->sn, m->sd);
                }
            }
        }
        scratch_free(&s);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for the pooled map") : SPARGE_OK;
}

/* The hybrid selection of select.c (sparge_select_row) for rows that keep few
 * blocks: the kept prefix of its order (descending, ties by lower index) is
 * built by repeated arg-max, O(kept·n) instead of a full sort, with the same
 * cumulative sums in the same order, so the result is identical. Rows that
 * keep many blocks or hold NaN take sparge_select_row itself. */
static int64_t select_row_few(const float *row, int64_t n, double topk, double topp, int32_t *order, uint8_t *keep,
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
        order[t++] = (int32_t)best;
        if (np < 0 && (cum += row[best]) >= topp)
            np = t;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < t; i++)
        sum += row[order[i]];
    *mass = sum;
    return t;
}

static sparge_status cpu_mask_select(void *impl, const sparge_select_args *a)
{
    const sparge_mask_view *m = &a->mask;
    const sparge_view *map = &a->map;
    int64_t rows = m->B * m->H * m->Nqb;
    int failed = 0;
#pragma omp parallel
    {
        int32_t *order = malloc((size_t)m->Nkb * sizeof *order);
        float *row = malloc((size_t)m->Nkb * sizeof *row);
        if (!order || !row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                int64_t bh = r / m->Nqb, i = r % m->Nqb, b = bh / m->H, h = bh % m->H;
                const float *src = (const float *)map->data + view_offset(map, b, h, i, 0);
                for (int64_t j = 0; j < m->Nkb; j++)
                    row[j] = src[j * map->sd];
                double mass;
                select_row_few(row, m->Nkb, a->topk, a->topp, order, m->dense + r * m->Nkb, &mass);
                m->row_mass[r] = (float)mass;
            }
        }
        free(order);
        free(row);
    }
    if (failed)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for mask selection");
    return sparge_cpu_mask_from_dense(impl, m);
}

static sparge_status cpu_forward(void *impl, const sparge_fwd_args *a)
{
    sparge_status st = cpu_check_head_dim(a->q.D, "cpu");
    if (st)
        return st;
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *qv = &a->q, *kv = &a->k, *vv = &a->v, *ov = &a->o;
    int64_t D = qv->D, Nq = qv->N, Nk = kv->N, H = qv->H, ldt = pad16(a->bq);
    int64_t nqb = (Nq + a->bq - 1) / a->bq, nkb = (Nk + a->bk - 1) / a->bk, tasks = qv->B * H * nqb, claimed = 0;
    int failed = 0;
#pragma omp parallel
    {
        scratch s;
        size_t sizes[6] = {(size_t)(D * ldt), (size_t)(a->bk * ldt), (size_t)(a->bq * D), (size_t)(4 * ldt),
                           (size_t)(2 * a->bk * D), (size_t)nkb};
        if (!scratch_alloc(&s, sizes, 6)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        float *qt = s.buf[0], *st_ = s.buf[1], *ot = s.buf[2], *m = s.buf[3], *l = m + ldt, *corr = l + ldt,
              *inv = corr + ldt, *kbuf = s.buf[4], *vbuf = kbuf + a->bk * D;
        int32_t *all = (int32_t *)s.buf[5];
        /* Dynamic scheduling that claims the next task one ahead, so that its
         * Q block and first K/V block can be prefetched during the last pair. */
        int64_t next = tasks;
        if (!failed) {
#pragma omp atomic capture
            next = claimed++;
        }
        while (next < tasks) {
            int64_t task = next;
#pragma omp atomic capture
            next = claimed++;
            int64_t bh = task / nqb, i = task % nqb, b = bh / H, h = bh % H, nq = block_rows(i, a->bq, Nq);
            const int32_t *idx;
            int64_t cnt = kept_blocks(a->mask, bh, i, nkb, &idx, all);
            k_->load(row_ptr(qv, b, h, i * a->bq), qv->dtype, qv->sn, qv->sd, nq, D, a->scale, qt, ldt, 1);
            for (int64_t r = 0; r < nq; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            for (int64_t c = 0; c < cnt; c++) {
                int64_t j = idx[c], nk = block_rows(j, a->bk, Nk), ldk, ldv;
                if (c + 1 < cnt) {
                    int64_t jn = idx[c + 1], nkn = block_rows(jn, a->bk, Nk);
                    prefetch_rows(kv, b, h, jn * a->bk, nkn);
                    prefetch_rows(vv, b, h, jn * a->bk, nkn);
                } else if (next < tasks) {
                    int64_t bhn = next / nqb, in = next % nqb, bn = bhn / H, hn = bhn % H, jn = 0;
                    if (a->mask)
                        jn = a->mask->indices[(bhn * nqb + in) * nkb];
                    prefetch_rows(qv, bn, hn, in * a->bq, block_rows(in, a->bq, Nq));
                    prefetch_rows(kv, bn, hn, jn * a->bk, block_rows(jn, a->bk, Nk));
                    prefetch_rows(vv, bn, hn, jn * a->bk, block_rows(jn, a->bk, Nk));
                }
                const float *kt = rows_f32(k_, kv, b, h, j * a->bk, nk, kbuf, &ldk);
                const float *vt = rows_f32(k_, vv, b, h, j * a->bk, nk, vbuf, &ldv);
                k_->gemm(nk, nq, D, kt, ldk, 1, qt, ldt, st_, ldt, 0, NULL);    /* Sᵀ = K (sQ)ᵀ */
                k_->softmax_cols(st_, ldt, nk, nq, m, l, corr);                 /* Pᵀ, m, l */
                k_->gemm(nq, D, nk, st_, 1, ldt, vt, ldv, ot, D, c > 0, corr); /* O = corr·O + P V */
            }
            for (int64_t r = 0; r < nq; r++) {
                inv[r] = 1.0f / l[r];
                if (a->lse)
                    a->lse[bh * Nq + i * a->bq + r] = m[r] + logf(l[r]);
            }
            k_->store(ot, D, inv, nq, D, row_ptr(ov, b, h, i * a->bq), ov->dtype, ov->sn, ov->sd);
        }
        scratch_free(&s);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for attention tiles") : SPARGE_OK;
}

/* f32 operands of one head shared by the backward's phases: per query block
 * (sQ)ᵀ and dOᵀ (D × ldt each), Q and dO rows when the views cannot be used
 * directly, Δ = rowsum(dO∘O), and the dQ accumulator of the one-pass mode. */
typedef struct {
    float *qt, *dot, *q, *d_o, *delta, *dq;
} bwd_head;

static void prefetch_span(const void *p, size_t bytes)
{
#if defined(__GNUC__)
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)p + off, 0, 2);
#else
    (void)p, (void)bytes;
#endif
}

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
static sparge_status cpu_backward(void *impl, const sparge_bwd_args *a)
{
    sparge_status st = cpu_check_head_dim(a->q.D, "cpu");
    if (st)
        return st;
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    const sparge_view *qv = &a->q, *kv = &a->k, *vv = &a->v, *dov = &a->d_o;
    int64_t D = qv->D, Nq = qv->N, Nk = kv->N, H = qv->H, BH = qv->B * H, ldt = pad16(a->bq);
    int64_t nqb = (Nq + a->bq - 1) / a->bq, nkb = (Nk + a->bk - 1) / a->bk;
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
        scratch s;
        size_t bmax = (size_t)(a->bq > a->bk ? a->bq : a->bk);
        size_t sizes[7] = {(size_t)(a->bk * ldt), (size_t)(a->bk * ldt), 2 * bmax * (size_t)D, 2 * bmax * (size_t)D,
                           (size_t)(nqb > nkb ? nqb : nkb), (size_t)bmax, (size_t)(D * ldt)};
        if (!scratch_alloc(&s, sizes, 7)) {
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
                int64_t nq = block_rows(i, a->bq, Nq), t0 = i * a->bq;
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
                int64_t nk = block_rows(j, a->bk, Nk), ldk, ldv;
                float *dk = acc, *dv = acc + bmax * D;
                const float *kt = rows_f32(k_, kv, b, h, j * a->bk, nk, kbuf, &ldk);
                const float *vt = rows_f32(k_, vv, b, h, j * a->bk, nk, vbuf, &ldv);
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
                    int64_t i = idx[(start + c) % cnt], nq = block_rows(i, a->bq, Nq), t0 = i * a->bq;
                    if (c + 1 < cnt) {
                        int64_t in = idx[(start + c + 1) % cnt], nqn = block_rows(in, a->bq, Nq);
                        prefetch_span(hd.qt + in * D * ldt, (size_t)(D * ldt) * sizeof(float));
                        prefetch_span(hd.dot + in * D * ldt, (size_t)(D * ldt) * sizeof(float));
                        if (q_direct)
                            prefetch_rows(qv, b, h, in * a->bq, nqn);
                        if (do_direct)
                            prefetch_rows(dov, b, h, in * a->bq, nqn);
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
                k_->store(dk, D, scale_rows, nk, D, row_ptr(&a->dk, b, h, j * a->bk), a->dk.dtype, a->dk.sn, a->dk.sd);
                k_->store(dv, D, NULL, nk, D, row_ptr(&a->dv, b, h, j * a->bk), a->dv.dtype, a->dv.sn, a->dv.sd);
            }
            /* Phase 3: dQ of each query block (deterministic mode: over its kept key blocks). */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < nqb; i++) {
                int64_t nq = block_rows(i, a->bq, Nq), t0 = i * a->bq;
                const float *dq = one_pass ? hd.dq + t0 * D : acc;
                const int32_t *idx;
                int64_t cnt = one_pass ? 0 : kept_blocks(a->mask, bh, i, nkb, &idx, all);
                for (int64_t c = 0; c < cnt; c++) {
                    int64_t j = idx[c], nk = block_rows(j, a->bk, Nk), ldk, ldv;
                    if (c + 1 < cnt) {
                        int64_t jn = idx[c + 1], nkn = block_rows(jn, a->bk, Nk);
                        prefetch_rows(kv, b, h, jn * a->bk, nkn);
                        prefetch_rows(vv, b, h, jn * a->bk, nkn);
                    }
                    const float *kt = rows_f32(k_, kv, b, h, j * a->bk, nk, kbuf, &ldk);
                    const float *vt = rows_f32(k_, vv, b, h, j * a->bk, nk, vbuf, &ldv);
                    block_grads(k_, &hd, i, ldt, D, lse + t0, kt, ldk, vt, ldv, nq, nk, pt, dst);
                    k_->gemm(nq, D, nk, dst, 1, ldt, kt, ldk, acc, D, c > 0, NULL); /* dQ += dS K */
                }
                k_->store(dq, D, scale_rows, nq, D, row_ptr(&a->dq, b, h, t0), a->dq.dtype, a->dq.sn, a->dq.sd);
            }
        }
        scratch_free(&s);
    }
#ifdef _OPENMP
    for (int64_t i = 0; one_pass && i < nqb; i++)
        omp_destroy_lock(&locks[i]);
    free(locks);
#endif
    free(shared);
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for backward tiles") : SPARGE_OK;
}

const sparge_backend sparge_backend_cpu = {
    "cpu",          cpu_device_count,       cpu_open,          cpu_close,      sparge_cpu_alloc,
    sparge_cpu_free, sparge_cpu_copy,       sparge_cpu_fill,   NULL,           NULL,
    NULL,           NULL,
    cpu_pool,       cpu_pooled_map,         cpu_mask_select,                   sparge_cpu_mask_from_dense,
    sparge_cpu_mask_transpose,      cpu_forward,       cpu_backward,   NULL};
