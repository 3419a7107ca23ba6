/* Backend "cpu": OpenMP over (batch, head, query block), tiled online-softmax
 * forward, and a backward that only visits kept blocks (dK/dV per key block
 * through the transposed mask, then dQ per query block: no atomics). */
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

const sparge_simd_ops *sparge_simd_best(void)
{
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#ifdef SPARGE_HAVE_AVX512
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        return &sparge_simd_avx512;
#endif
#ifdef SPARGE_HAVE_AVX2
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return &sparge_simd_avx2;
#endif
#endif
    return &sparge_simd_generic;
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
    ctx->simd = sparge_simd_best();
    int bound = sparge_cpu_bind_threads();
    snprintf(desc, len, "%d OpenMP thread(s), SIMD %s, %s", max_threads(), ctx->simd->name,
             bound ? "bound to cores by hwloc" : "not bound");
    *impl = ctx;
    return SPARGE_OK;
}

static void cpu_close(void *impl) { free(impl); }

/* rows×D tile of x starting at token n0, converted to f32, row stride D. */
static void load_tile(const sparge_view *x, int64_t b, int64_t h, int64_t n0, int64_t rows, float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        int64_t off = view_offset(x, b, h, n0 + r, 0);
        if (x->dtype == SPARGE_F32 && x->sd == 1)
            memcpy(out + r * x->D, (const float *)x->data + off, (size_t)x->D * sizeof(float));
        else
            for (int64_t d = 0; d < x->D; d++)
                out[r * x->D + d] = view_load(x, off + d * x->sd);
    }
}

static void store_tile(const sparge_view *x, int64_t b, int64_t h, int64_t n0, int64_t rows, const float *src)
{
    for (int64_t r = 0; r < rows; r++) {
        int64_t off = view_offset(x, b, h, n0 + r, 0);
        for (int64_t d = 0; d < x->D; d++)
            view_store(x, off + d * x->sd, src[r * x->D + d]);
    }
}

static int64_t block_rows(int64_t i, int block, int64_t n) { return i * block + block <= n ? block : n - i * block; }

/* Per-thread scratch: all buffers or none. */
typedef struct {
    float *buf[8];
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
    for (int i = 0; i < 8; i++)
        free(s->buf[i]);
}

static sparge_status cpu_pool(void *impl, const sparge_pool_args *a)
{
    (void)impl;
    const sparge_view *x = &a->x, *o = &a->out;
    int64_t tasks = x->B * x->H * o->N;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t bh = t / o->N, i = t % o->N, b = bh / x->H, h = bh % x->H;
        int64_t t0 = i * a->block, rows = block_rows(i, a->block, x->N);
        for (int64_t d = 0; d < x->D; d++) {
            float sum = 0.0f;
            for (int64_t r = 0; r < rows; r++)
                sum += view_load(x, view_offset(x, b, h, t0 + r, d));
            view_store(o, view_offset(o, b, h, i, d), sum / (float)rows);
        }
    }
    return SPARGE_OK;
}

static sparge_status cpu_pooled_map(void *impl, const sparge_map_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_view *q = &a->qbar, *k = &a->kbar, *m = &a->map;
    int64_t D = q->D, nqb = q->N, nkb = k->N;
    int failed = 0;
#pragma omp parallel
    {
        scratch s;
        size_t sizes[3] = {(size_t)(nqb * D), (size_t)(nkb * D), (size_t)(nqb * nkb)};
        int ok = scratch_alloc(&s, sizes, 3);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < q->B * q->H; bh++) {
            if (failed)
                continue;
            int64_t b = bh / q->H, h = bh % q->H;
            load_tile(q, b, h, 0, nqb, s.buf[0]);
            load_tile(k, b, h, 0, nkb, s.buf[1]);
            ctx->simd->abt(s.buf[0], D, s.buf[1], D, s.buf[2], nkb, nqb, nkb, D);
            for (int64_t i = 0; i < nqb; i++) {
                float *row = s.buf[2] + i * nkb, mx = -INFINITY;
                int nan = 0;
                for (int64_t j = 0; j < nkb; j++) {
                    row[j] *= a->scale;
                    nan |= isnan(row[j]);
                    mx = row[j] > mx ? row[j] : mx;
                }
                float inv = 1.0f / ctx->simd->exp_sum(row, nkb, mx);
                for (int64_t j = 0; j < nkb; j++)
                    view_store(m, view_offset(m, b, h, i, j), nan ? NAN : row[j] * inv);
            }
        }
        scratch_free(&s);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for the pooled map") : SPARGE_OK;
}

static sparge_status cpu_forward(void *impl, const sparge_fwd_args *a)
{
    sparge_status st = cpu_check_head_dim(a->q.D, "cpu");
    if (st)
        return st;
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    int64_t D = a->q.D, Nq = a->q.N, Nk = a->k.N, H = a->q.H;
    int64_t nqb = (Nq + a->bq - 1) / a->bq, nkb = (Nk + a->bk - 1) / a->bk, tasks = a->q.B * H * nqb;
    int failed = 0;
#pragma omp parallel
    {
        scratch s;
        size_t sizes[7] = {(size_t)(a->bq * D), (size_t)(a->bk * D), (size_t)(a->bk * D), (size_t)(a->bq * a->bk),
                           (size_t)(a->bq * D), (size_t)(2 * a->bq), (size_t)nkb};
        if (!scratch_alloc(&s, sizes, 7)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        float *qt = s.buf[0], *kt = s.buf[1], *vt = s.buf[2], *st = s.buf[3], *ot = s.buf[4], *ml = s.buf[5];
        int32_t *all = (int32_t *)s.buf[6];
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed)
                continue;
            int64_t bh = task / nqb, i = task % nqb, b = bh / H, h = bh % H;
            int64_t nq = block_rows(i, a->bq, Nq);
            const int32_t *idx;
            int64_t cnt = kept_blocks(a->mask, bh, i, nkb, &idx, all);
            load_tile(&a->q, b, h, i * a->bq, nq, qt);
            memset(ot, 0, (size_t)(nq * D) * sizeof(float));
            float *m = ml, *l = ml + a->bq;
            for (int64_t r = 0; r < nq; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            for (int64_t c = 0; c < cnt; c++) {
                int64_t j = idx[c], nk = block_rows(j, a->bk, Nk);
                load_tile(&a->k, b, h, j * a->bk, nk, kt);
                load_tile(&a->v, b, h, j * a->bk, nk, vt);
                k_->abt(qt, D, kt, D, st, nk, nq, nk, D);
                for (int64_t r = 0; r < nq; r++) {
                    float *row = st + r * nk, mx = m[r];
                    for (int64_t u = 0; u < nk; u++) {
                        row[u] *= a->scale;
                        mx = row[u] > mx ? row[u] : mx;
                    }
                    float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
                    l[r] = l[r] * corr + k_->exp_sum(row, nk, mx);
                    m[r] = mx;
                    if (corr != 1.0f)
                        for (int64_t d = 0; d < D; d++)
                            ot[r * D + d] *= corr;
                }
                k_->ab(st, nk, vt, D, ot, D, nq, D, nk);
            }
            for (int64_t r = 0; r < nq; r++) {
                float inv = 1.0f / l[r];
                for (int64_t d = 0; d < D; d++)
                    ot[r * D + d] *= inv;
                if (a->lse)
                    a->lse[bh * Nq + i * a->bq + r] = m[r] + logf(l[r]);
            }
            store_tile(&a->o, b, h, i * a->bq, nq, ot);
        }
        scratch_free(&s);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for attention tiles") : SPARGE_OK;
}

/* P = exp(scale·Q Kᵀ − lse) and dS = P∘(dO Vᵀ − Δ) for one (query block, key block) pair. */
static void block_grads(const sparge_simd_ops *k_, const float *qt, const float *dot_, const float *kt, const float *vt,
                        const float *lse, const float *delta, int64_t nq, int64_t nk, int64_t D, float scale, float *p,
                        float *ds)
{
    k_->abt(qt, D, kt, D, p, nk, nq, nk, D);
    k_->abt(dot_, D, vt, D, ds, nk, nq, nk, D);
    for (int64_t r = 0; r < nq; r++)
        for (int64_t u = 0; u < nk; u++) {
            float pr = expf(scale * p[r * nk + u] - lse[r]);
            p[r * nk + u] = pr;
            ds[r * nk + u] = pr * (ds[r * nk + u] - delta[r]);
        }
}

static sparge_status cpu_backward(void *impl, const sparge_bwd_args *a)
{
    sparge_status st = cpu_check_head_dim(a->q.D, "cpu");
    if (st)
        return st;
    const cpu_ctx *ctx = impl;
    const sparge_simd_ops *k_ = ctx->simd;
    int64_t D = a->q.D, Nq = a->q.N, Nk = a->k.N, H = a->q.H, BH = a->q.B * H;
    int64_t nqb = (Nq + a->bq - 1) / a->bq, nkb = (Nk + a->bk - 1) / a->bk;
    int64_t bmax = a->bq > a->bk ? a->bq : a->bk, nmax = nqb > nkb ? nqb : nkb;
    float *delta = malloc((size_t)(BH * Nq) * sizeof(float));
    if (!delta)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for the backward");
    int failed = 0;
#pragma omp parallel
    {
        scratch s;
        size_t sizes[8] = {(size_t)(bmax * D), (size_t)(bmax * D), (size_t)(bmax * D), (size_t)(bmax * D),
                           (size_t)(a->bq * a->bk), (size_t)(a->bq * a->bk), (size_t)(2 * bmax * D), (size_t)nmax};
        if (!scratch_alloc(&s, sizes, 8)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        float *qt = s.buf[0], *dot_ = s.buf[1], *kt = s.buf[2], *vt = s.buf[3], *p = s.buf[4], *ds = s.buf[5];
        float *acc = s.buf[6], *ot = s.buf[0];
        int32_t *all = (int32_t *)s.buf[7];
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < BH * nqb; task++) {
                int64_t bh = task / nqb, i = task % nqb, nq = block_rows(i, a->bq, Nq);
                load_tile(&a->o, bh / H, bh % H, i * a->bq, nq, ot);
                load_tile(&a->d_o, bh / H, bh % H, i * a->bq, nq, dot_);
                for (int64_t r = 0; r < nq; r++) {
                    float sum = 0.0f;
                    for (int64_t d = 0; d < D; d++)
                        sum += ot[r * D + d] * dot_[r * D + d];
                    delta[bh * Nq + i * a->bq + r] = sum;
                }
            }
            /* dK, dV: one task per key block, over the query blocks that keep it. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < BH * nkb; task++) {
                int64_t bh = task / nkb, j = task % nkb, b = bh / H, h = bh % H, nk = block_rows(j, a->bk, Nk);
                float *dk = acc, *dv = acc + bmax * D;
                memset(acc, 0, (size_t)(2 * bmax * D) * sizeof(float));
                load_tile(&a->k, b, h, j * a->bk, nk, kt);
                load_tile(&a->v, b, h, j * a->bk, nk, vt);
                const int32_t *idx = all;
                int64_t cnt = nqb;
                if (a->mask) {
                    idx = a->mask->t_indices + (bh * nkb + j) * nqb;
                    cnt = a->mask->t_counts[bh * nkb + j];
                } else
                    for (int64_t i = 0; i < nqb; i++)
                        all[i] = (int32_t)i;
                for (int64_t c = 0; c < cnt; c++) {
                    int64_t i = idx[c], nq = block_rows(i, a->bq, Nq);
                    load_tile(&a->q, b, h, i * a->bq, nq, qt);
                    load_tile(&a->d_o, b, h, i * a->bq, nq, dot_);
                    block_grads(k_, qt, dot_, kt, vt, a->lse + bh * Nq + i * a->bq, delta + bh * Nq + i * a->bq, nq,
                                nk, D, a->scale, p, ds);
                    k_->atb(p, nk, dot_, D, dv, D, nk, D, nq);
                    k_->atb(ds, nk, qt, D, dk, D, nk, D, nq);
                }
                for (int64_t x = 0; x < nk * D; x++)
                    dk[x] *= a->scale;
                store_tile(&a->dk, b, h, j * a->bk, nk, dk);
                store_tile(&a->dv, b, h, j * a->bk, nk, dv);
            }
            /* dQ: one task per query block, over its kept key blocks. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < BH * nqb; task++) {
                int64_t bh = task / nqb, i = task % nqb, b = bh / H, h = bh % H, nq = block_rows(i, a->bq, Nq);
                float *dq = acc;
                memset(dq, 0, (size_t)(nq * D) * sizeof(float));
                load_tile(&a->q, b, h, i * a->bq, nq, qt);
                load_tile(&a->d_o, b, h, i * a->bq, nq, dot_);
                const int32_t *idx;
                int64_t cnt = kept_blocks(a->mask, bh, i, nkb, &idx, all);
                for (int64_t c = 0; c < cnt; c++) {
                    int64_t j = idx[c], nk = block_rows(j, a->bk, Nk);
                    load_tile(&a->k, b, h, j * a->bk, nk, kt);
                    load_tile(&a->v, b, h, j * a->bk, nk, vt);
                    block_grads(k_, qt, dot_, kt, vt, a->lse + bh * Nq + i * a->bq, delta + bh * Nq + i * a->bq, nq,
                                nk, D, a->scale, p, ds);
                    k_->ab(ds, nk, kt, D, dq, D, nq, D, nk);
                }
                for (int64_t x = 0; x < nq * D; x++)
                    dq[x] *= a->scale;
                store_tile(&a->dq, b, h, i * a->bq, nq, dq);
            }
        }
        scratch_free(&s);
    }
    free(delta);
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for backward tiles") : SPARGE_OK;
}

const sparge_backend sparge_backend_cpu = {
    "cpu",          cpu_device_count,       cpu_open,          cpu_close,      sparge_cpu_alloc,
    sparge_cpu_free, sparge_cpu_copy,       sparge_cpu_fill,   NULL,           NULL,
    NULL,           NULL,
    cpu_pool,       cpu_pooled_map,         sparge_cpu_mask_select,            sparge_cpu_mask_from_dense,
    cpu_forward,    cpu_backward};
