/* Mask objects: allocation on the device, prediction, import and export. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core.h"

sparge_mask_params sparge_mask_params_default(void)
{
    sparge_mask_params p = {128, 64, 0.03, 0.20, 0.0f, 0};
    return p;
}

/* Frees the mask's arrays (the device's queued work that reads them finishes first: free synchronizes). */
static void free_arrays(sparge_mask *m)
{
    sparge_device *dev = m->dev;
    void *bufs[] = {m->v.counts, m->v.indices, m->v.t_counts, m->v.t_indices, m->v.dense, m->v.row_mass,
                    m->pooled_q, m->pooled_k, m->map, m->dev_seq};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            dev->be->free(dev->impl, bufs[i]);
}

static void release(sparge_mask *m)
{
    sparge_device *dev = m->dev;
    free_arrays(m);
    free(m->host_seq);
    pthread_mutex_destroy(&m->lock);
    free(m);
    sparge_device_release(dev);
}

void sparge_mask_destroy(sparge_mask *mask)
{
    if (mask)
        release(mask);
}

static sparge_status alloc_array(sparge_mask *m, int64_t count, size_t elem, void **out, const char *fn)
{
    int64_t bytes;
    if (sparge_mul_overflows(count, (int64_t)elem, &bytes) || (uint64_t)bytes > SIZE_MAX)
        return SPARGE_FAIL(SPARGE_ERR_OVERFLOW, "%s: mask arrays overflow", fn);
    return m->dev->be->alloc(m->dev->impl, (size_t)bytes, out);
}

/* The layout's sequences: their offsets (checked: from 0, non-decreasing, ending at the totals), the longest
 * lengths, keys for every sequence with queries, and causal's Nq ≤ Nk per sequence. */
static sparge_status check_layout(const sparge_mask_layout *l, int64_t *max_q, int64_t *max_k, const char *fn)
{
    if (l->B <= 0 || l->H <= 0 || l->Nq <= 0 || l->Nk <= 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: B, H, Nq, Nk must be > 0 (got %lld, %lld, %lld, %lld)", fn,
                           (long long)l->B, (long long)l->H, (long long)l->Nq, (long long)l->Nk);
    if (l->block_q <= 0 || l->block_k <= 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: block sizes must be > 0 (got bq=%d, bk=%d)", fn, l->block_q,
                           l->block_k);
    if (l->Nq > INT32_MAX || l->Nk > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_OVERFLOW, "%s: Nq and Nk must fit in int32", fn);
    if (!l->cu_seqlens_q != !l->cu_seqlens_k)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: cu_seqlens_%s is NULL but cu_seqlens_%s is not (give both or neither)",
                           fn, l->cu_seqlens_q ? "k" : "q", l->cu_seqlens_q ? "q" : "k");
    *max_q = l->Nq;
    *max_k = l->Nk;
    if (!l->cu_seqlens_q) {
        if (l->causal && l->Nq > l->Nk)
            return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: causal attention needs Nq <= Nk (got Nq=%lld, Nk=%lld)", fn,
                               (long long)l->Nq, (long long)l->Nk);
        return SPARGE_OK;
    }
    const int32_t *cu[2] = {l->cu_seqlens_q, l->cu_seqlens_k};
    const int64_t total[2] = {l->Nq, l->Nk};
    int64_t *longest[2] = {max_q, max_k};
    for (int t = 0; t < 2; t++) {
        const char *which = t ? "cu_seqlens_k" : "cu_seqlens_q";
        if (cu[t][0] != 0)
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: %s[0] = %d must be 0", fn, which, cu[t][0]);
        *longest[t] = 0;
        for (int64_t b = 0; b < l->B; b++) {
            if (cu[t][b + 1] < cu[t][b])
                return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: %s must not decrease (entries %lld and %lld are %d, %d)",
                                   fn, which, (long long)b, (long long)b + 1, cu[t][b], cu[t][b + 1]);
            if (cu[t][b + 1] - cu[t][b] > *longest[t])
                *longest[t] = cu[t][b + 1] - cu[t][b];
        }
        if (cu[t][l->B] != total[t])
            return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: %s[%lld] = %d but the packed tensors hold %lld tokens", fn, which,
                               (long long)l->B, cu[t][l->B], (long long)total[t]);
    }
    for (int64_t b = 0; b < l->B; b++) {
        const int64_t nq = cu[0][b + 1] - cu[0][b], nk = cu[1][b + 1] - cu[1][b];
        if (nq > 0 && nk == 0)
            return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: sequence %lld has %lld query and 0 key tokens (its queries would "
                               "attend nothing)", fn, (long long)b, (long long)nq);
        if (l->causal && nq > nk)
            return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: causal attention needs Nq <= Nk, sequence %lld has %lld query and "
                               "%lld key tokens", fn, (long long)b, (long long)nq, (long long)nk);
    }
    return SPARGE_OK;
}

sparge_status sparge_mask_create_named(sparge_device *dev, const sparge_mask_layout *l, const char *fn,
                                       sparge_mask **out)
{
    if (!dev || !l || !out)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: %s is NULL", fn, !dev ? "device" : !l ? "layout" : "out");
    int64_t Nq, Nk;
    sparge_status s = check_layout(l, &Nq, &Nk, fn);
    if (s)
        return s;
    const int64_t B = l->B, H = l->H;
    int64_t Nqb = (Nq + l->block_q - 1) / l->block_q, Nkb = (Nk + l->block_k - 1) / l->block_k, bh, rows, cells;
    if (sparge_mul_overflows(B, H, &bh) || sparge_mul_overflows(bh, Nqb, &rows) ||
        sparge_mul_overflows(rows, Nkb, &cells) || cells > INT64_MAX / 8)
        return SPARGE_FAIL(SPARGE_ERR_OVERFLOW, "%s: B*H*Nqb*Nkb overflows", fn);
    sparge_mask *m = calloc(1, sizeof *m);
    if (!m)
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    if (pthread_mutex_init(&m->lock, NULL) != 0) {
        free(m);
        return SPARGE_FAIL(SPARGE_ERR_RUNTIME, "%s: cannot create the mask's lock", fn);
    }
    m->dev = dev;
    atomic_fetch_add(&dev->refs, 1);
    m->v = (sparge_mask_view){.B = B, .H = H, .Nq = Nq, .Nk = Nk, .Nqb = Nqb, .Nkb = Nkb, .bq = l->block_q,
                              .bk = l->block_k, .causal = l->causal != 0};
    m->Tq = l->Nq;
    m->Tk = l->Nk;
    if ((s = alloc_array(m, rows, 4, (void **)&m->v.counts, fn)) ||
        (s = alloc_array(m, cells, 4, (void **)&m->v.indices, fn)) ||
        (s = alloc_array(m, bh * Nkb, 4, (void **)&m->v.t_counts, fn)) ||
        (s = alloc_array(m, cells, 4, (void **)&m->v.t_indices, fn)) ||
        (s = alloc_array(m, cells, 1, (void **)&m->v.dense, fn)) ||
        (s = alloc_array(m, rows, 4, (void **)&m->v.row_mass, fn))) {
        release(m);
        return s;
    }
    if (l->cu_seqlens_q) {
        const size_t n = (size_t)(B + 1);
        if (!(m->host_seq = malloc(2 * n * sizeof(int32_t)))) {
            release(m);
            return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
        }
        memcpy(m->host_seq, l->cu_seqlens_q, n * sizeof(int32_t));
        memcpy(m->host_seq + n, l->cu_seqlens_k, n * sizeof(int32_t));
        if ((s = alloc_array(m, (int64_t)(2 * n), 4, (void **)&m->dev_seq, fn)) ||
            (s = dev->be->copy(dev->impl, m->dev_seq, m->host_seq, 2 * n * sizeof(int32_t), SPARGE_COPY_H2D))) {
            release(m);
            return s;
        }
        m->v.seq_q = m->dev_seq;
        m->v.seq_k = m->dev_seq + n;
    }
    *out = m;
    return SPARGE_OK;
}

sparge_status sparge_mask_create_ex(sparge_device *dev, const sparge_mask_layout *l, sparge_mask **out)
{
    return sparge_mask_create_named(dev, l, "sparge_mask_create_ex", out);
}

sparge_status sparge_mask_create(sparge_device *dev, int64_t B, int64_t H, int64_t Nq, int64_t Nk, int block_q,
                                 int block_k, sparge_mask **out)
{
    const sparge_mask_layout l = {.B = B, .H = H, .Nq = Nq, .Nk = Nk, .block_q = block_q, .block_k = block_k};
    return sparge_mask_create_named(dev, &l, "sparge_mask_create", out);
}

void sparge_mask_seq(const sparge_mask *m, int64_t b, int64_t *tb, int64_t *q0, int64_t *nq, int64_t *k0, int64_t *nk)
{
    if (!m->host_seq) {
        *tb = b, *q0 = *k0 = 0, *nq = m->v.Nq, *nk = m->v.Nk;
        return;
    }
    const int32_t *cq = m->host_seq, *ck = m->host_seq + m->v.B + 1;
    *tb = 0, *q0 = cq[b], *nq = cq[b + 1] - cq[b], *k0 = ck[b], *nk = ck[b + 1] - ck[b];
}

sparge_status sparge_mask_get_shape(const sparge_mask *mask, sparge_mask_shape *out)
{
    if (!mask || !out)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_mask_get_shape: %s is NULL", mask ? "out" : "mask");
    *out = (sparge_mask_shape){mask->v.B, mask->v.H, mask->v.Nq, mask->v.Nk, mask->v.bq, mask->v.bk, mask->v.Nqb,
                               mask->v.Nkb, mask->v.causal, mask->host_seq != NULL};
    return SPARGE_OK;
}

sparge_status sparge_check_mask_params(const sparge_mask_params *p, const char *fn)
{
    if (!p)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: params is NULL", fn);
    if (!(p->topk >= 0.0 && p->topk <= 1.0))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: topk = %g is outside [0, 1]", fn, p->topk);
    if (!(p->topp >= 0.0 && p->topp <= 1.0))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: topp = %g is outside [0, 1]", fn, p->topp);
    if (p->topk == 0.0 && p->topp == 0.0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: topk = topp = 0 selects nothing (set at least one > 0)", fn);
    if (p->block_q < 0 || p->block_k < 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: block sizes must be > 0 (got bq=%d, bk=%d)", fn, p->block_q,
                           p->block_k);
    if (!isfinite(p->scale))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: scale is not finite", fn);
    return SPARGE_OK;
}

static sparge_status check_mask_device(sparge_device *dev, const sparge_mask *mask, const char *fn)
{
    if (!dev || !mask)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: %s is NULL", fn, dev ? "mask" : "device");
    if (mask->dev != dev)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: mask lives on %s, not on %s", fn, mask->dev->name, dev->name);
    return SPARGE_OK;
}

/* A mask's params may repeat its causal flag, not ask for one it was created without. */
static sparge_status check_causal_params(const sparge_mask_params *params, const sparge_mask *mask, const char *fn)
{
    if (params->causal && !mask->v.causal)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: params ask for causal attention but the mask was created without it "
                           "(sparge_mask_create_ex with causal = 1)", fn);
    return SPARGE_OK;
}

static sparge_status ensure(sparge_mask *m, float **buf, int64_t count, const char *fn)
{
    if (*buf)
        return SPARGE_OK;
    return alloc_array(m, count, sizeof(float), (void **)buf, fn);
}

/* A new selection is under way: what the mask held, its transpose included, no longer applies. */
static void forget_selection(sparge_mask *m)
{
    m->predicted = m->filled = m->transposed = 0;
}

sparge_status sparge_check_tensors_for_mask(const sparge_mask *mask, const sparge_view *q, const sparge_view *k,
                                           const char *fn)
{
    const sparge_mask_view *m = &mask->v;
    const int64_t tb = mask->host_seq ? 1 : m->B;
    if (q->B != tb || k->B != tb || q->H != m->H || q->N != mask->Tq || k->N != mask->Tk)
        return SPARGE_FAIL(SPARGE_ERR_MASK,
                           "%s: q [%lld,%lld,%lld,*] / k [%lld,*,%lld,*] do not match the mask's %s B=%lld H=%lld "
                           "Nq=%lld Nk=%lld", fn, (long long)q->B, (long long)q->H, (long long)q->N, (long long)k->B,
                           (long long)k->N, mask->host_seq ? "packed [1,H,Nq,*] views of" : "", (long long)tb,
                           (long long)m->H, (long long)mask->Tq, (long long)mask->Tk);
    if (q->H % k->H)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: k has %lld heads, which must divide q's %lld (grouped K/V heads)", fn,
                           (long long)k->H, (long long)q->H);
    return SPARGE_OK;
}

/* Blocks in params are 0 (the mask's own) or the mask's. */
static sparge_status check_param_blocks(const sparge_mask_params *params, const sparge_mask *mask, const char *fn)
{
    const sparge_mask_view *m = &mask->v;
    if ((params->block_q && params->block_q != m->bq) || (params->block_k && params->block_k != m->bk))
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: params ask for blocks %dx%d but the mask was created for %dx%d", fn,
                           params->block_q, params->block_k, m->bq, m->bk);
    return SPARGE_OK;
}

sparge_status sparge_check_predict(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                   const sparge_mask_params *params, const sparge_mask *mask, const char *fn,
                                   sparge_view *qv, sparge_view *kv, const sparge_backend **tier)
{
    sparge_status s;
    if ((s = check_mask_device(dev, mask, fn)) || (s = sparge_check_mask_params(params, fn)) ||
        (s = sparge_check_tensor(q, fn, "q", 0, qv)) || (s = sparge_check_tensor(k, fn, "k", 0, kv)))
        return s;
    const sparge_mask_view *m = &mask->v;
    if ((s = check_param_blocks(params, mask, fn)) || (s = sparge_check_tensors_for_mask(mask, qv, kv, fn)))
        return s;
    if ((s = check_causal_params(params, mask, fn)))
        return s;
    if (kv->D != qv->D)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: q has D=%lld but k has D=%lld", fn, (long long)qv->D, (long long)kv->D);
    if (kv->dtype != qv->dtype)
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: q is %s but k is %s", fn, sparge_dtype_name(qv->dtype),
                           sparge_dtype_name(kv->dtype));
    sparge_op_desc d = {.op = SPARGE_OP_MASK_PREDICT, .dtype = qv->dtype, .head_dim = qv->D, .block_q = m->bq,
                        .block_k = m->bk, .B = m->B, .H = m->H, .Nq = m->Nq, .Nk = m->Nk,
                        .rows_aligned = sparge_rows_aligned(qv) && sparge_rows_aligned(kv), .kv_heads = kv->H,
                        .causal = m->causal, .varlen = mask->host_seq != NULL};
    return sparge_pick_tier(dev, &d, fn, tier);
}

sparge_status sparge_run_predict(sparge_device *dev, const sparge_view *qv, const sparge_view *kv,
                                 const sparge_mask_params *params, sparge_mask *mask, const sparge_backend *be,
                                 const char *fn)
{
    sparge_status s;
    const sparge_mask_view *m = &mask->v;
    const int64_t Hkv = kv->H;
    if (mask->pooled_d != qv->D || mask->pooled_hkv != Hkv) {
        dev->be->free(dev->impl, mask->pooled_q);
        dev->be->free(dev->impl, mask->pooled_k);
        mask->pooled_q = mask->pooled_k = NULL;
        mask->pooled_d = 0;
    }
    int64_t bh = m->B * m->H;
    if ((s = ensure(mask, &mask->pooled_q, bh * m->Nqb * qv->D, fn)) ||
        (s = ensure(mask, &mask->pooled_k, m->B * Hkv * m->Nkb * qv->D, fn)) ||
        (s = ensure(mask, &mask->map, bh * m->Nqb * m->Nkb, fn)))
        return s;
    mask->pooled_d = qv->D;
    mask->pooled_hkv = Hkv;
    const int64_t D = qv->D;
    /* K is pooled once per K head; query heads of a group share it. */
    sparge_view pq = {mask->pooled_q, SPARGE_F32, m->B, m->H, m->Nqb, D, m->H * m->Nqb * D, m->Nqb * D, D, 1};
    sparge_view pk = {mask->pooled_k, SPARGE_F32, m->B, Hkv, m->Nkb, D, Hkv * m->Nkb * D, m->Nkb * D, D, 1};
    sparge_view map = {mask->map, SPARGE_F32, m->B, m->H, m->Nqb, m->Nkb, m->H * m->Nqb * m->Nkb, m->Nqb * m->Nkb, m->Nkb, 1};
    float scale = params->scale != 0.0f ? params->scale : 1.0f / sqrtf((float)D);
    sparge_pool_args pa = {*qv, m->bq, pq, m->seq_q, m->seq_q ? m->B : 0},
                     pb = {*kv, m->bk, pk, m->seq_k, m->seq_k ? m->B : 0};
    sparge_map_args ma = {pq, pk, scale, map, m->causal || m->seq_q ? &mask->v : NULL};
    forget_selection(mask);
    sparge_dev_lock(dev);
    if (be->mask_predict) {
        sparge_predict_args fa = {pa, pb, ma, params->topk, params->topp, mask->v};
        s = be->mask_predict(dev->impl, &fa);
    } else {
        sparge_select_args sa = {map, params->topk, params->topp, mask->v};
        if (!(s = be->pool(dev->impl, &pa)) && !(s = be->pool(dev->impl, &pb)) && !(s = be->pooled_map(dev->impl, &ma)))
            s = be->mask_select(dev->impl, &sa);
    }
    sparge_dev_unlock(dev);
    if (s)
        return s;
    mask->filled = mask->predicted = 1;
    return SPARGE_OK;
}

sparge_status sparge_mask_predict(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                  const sparge_mask_params *params, sparge_mask *mask)
{
    sparge_view qv, kv;
    const sparge_backend *be;
    static const char fn[] = "sparge_mask_predict";
    sparge_status s = sparge_check_predict(dev, q, k, params, mask, fn, &qv, &kv, &be);
    return s ? s : sparge_run_predict(dev, &qv, &kv, params, mask, be, fn);
}

sparge_status sparge_mask_select(sparge_device *dev, const sparge_tensor *pooled_map, const sparge_mask_params *params,
                                 sparge_mask *mask)
{
    static const char fn[] = "sparge_mask_select";
    sparge_status s;
    sparge_view mv;
    if ((s = check_mask_device(dev, mask, fn)) || (s = sparge_check_mask_params(params, fn)) ||
        (s = check_causal_params(params, mask, fn)) || (s = check_param_blocks(params, mask, fn)) ||
        (s = sparge_check_tensor(pooled_map, fn, "pooled_map", 0, &mv)))
        return s;
    if (mv.dtype != SPARGE_F32)
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: pooled_map must be f32", fn);
    if (mv.B != mask->v.B || mv.H != mask->v.H || mv.N != mask->v.Nqb || mv.D != mask->v.Nkb)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: pooled_map [%lld,%lld,%lld,%lld] is not the mask's [B,H,Nqb,Nkb]", fn,
                           (long long)mv.B, (long long)mv.H, (long long)mv.N, (long long)mv.D);
    sparge_op_desc d = {.op = SPARGE_OP_MASK_SELECT, .dtype = SPARGE_F32, .B = mv.B, .H = mv.H, .Nq = mv.N,
                        .Nk = mv.D, .rows_aligned = sparge_rows_aligned(&mv), .causal = mask->v.causal,
                        .varlen = mask->host_seq != NULL};
    const sparge_backend *be;
    if ((s = sparge_pick_tier(dev, &d, fn, &be)))
        return s;
    forget_selection(mask);
    sparge_select_args a = {mv, params->topk, params->topp, mask->v};
    sparge_dev_lock(dev);
    s = be->mask_select(dev->impl, &a);
    sparge_dev_unlock(dev);
    if (s)
        return s;
    mask->filled = 1;
    return SPARGE_OK;
}

sparge_status sparge_mask_set_dense(sparge_mask *mask, const uint8_t *dense_host)
{
    if (!mask || !dense_host)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_mask_set_dense: %s is NULL", mask ? "dense" : "mask");
    const sparge_mask_view *m = &mask->v;
    sparge_device *dev = mask->dev;
    int64_t rows = m->B * m->H * m->Nqb;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / (m->H * m->Nqb), i = r % m->Nqb;
        int64_t tb, q0, nq, k0, nk, allowed, d0, d1, kept = 0;
        sparge_mask_seq(mask, b, &tb, &q0, &nq, &k0, &nk);
        const int64_t nqb = (nq + m->bq - 1) / m->bq;
        if (i < nqb)
            sparge_row_rule(i, nq, nk, m->bq, m->bk, m->causal, &allowed, &d0, &d1);
        else
            allowed = 0, d0 = 1, d1 = 0;
        for (int64_t j = 0; j < m->Nkb; j++) {
            const int keep = dense_host[r * m->Nkb + j] != 0;
            if (keep && j >= allowed)
                return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_mask_set_dense: row %lld keeps block %lld, %s", (long long)r,
                                   (long long)j, i >= nqb ? "but the row lies past its sequence's query blocks"
                                   : m->causal ? "which lies above the causal diagonal" : "past its sequence's key blocks");
            if (!keep && j >= d0 && j <= d1)
                return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_mask_set_dense: row %lld drops block %lld, one of its "
                                   "diagonal blocks (causal rows keep %lld..%lld)", (long long)r, (long long)j,
                                   (long long)d0, (long long)d1);
            kept += keep;
        }
        if (!kept && i < nqb)
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "sparge_mask_set_dense: row %lld keeps no block (every row needs one)",
                               (long long)r);
    }
    uint8_t *norm = malloc((size_t)(rows * m->Nkb));
    float *nan_mass = malloc((size_t)rows * sizeof(float));
    sparge_status s = SPARGE_OK;
    if (!norm || !nan_mass)
        s = SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "sparge_mask_set_dense: out of host memory");
    if (!s) {
        for (int64_t i = 0; i < rows * m->Nkb; i++)
            norm[i] = dense_host[i] != 0;
        for (int64_t r = 0; r < rows; r++)
            nan_mass[r] = NAN;
        forget_selection(mask);
        sparge_dev_lock(dev);
        if (!(s = dev->be->copy(dev->impl, m->dense, norm, (size_t)(rows * m->Nkb), SPARGE_COPY_H2D)) &&
            !(s = dev->be->copy(dev->impl, m->row_mass, nan_mass, (size_t)rows * sizeof(float), SPARGE_COPY_H2D)) &&
            !(s = dev->be->mask_from_dense(dev->impl, m)))
            mask->filled = 1;
        sparge_dev_unlock(dev);
    }
    free(norm);
    free(nan_mass);
    return s;
}

/* Only the backward and sparge_mask_get_csr read the transpose, so the first of them to need it builds it,
 * not the producers of the selection: forward-only use never pays for it. It is a cache derived from the
 * selection, which building it leaves unchanged, hence the cast from const (masks always come writable from
 * sparge_mask_create); readers running at once take turns through the mask's lock, and one builds it. */
sparge_status sparge_mask_ensure_transpose(const sparge_mask *mask)
{
    sparge_mask *m = (sparge_mask *)mask;
    sparge_device *dev = m->dev;
    sparge_status s = SPARGE_OK;
    pthread_mutex_lock(&m->lock);
    if (!m->transposed) {
        sparge_dev_lock(dev);
        s = dev->be->mask_transpose(dev->impl, &m->v);
        sparge_dev_unlock(dev);
        m->transposed = s == SPARGE_OK;
    }
    pthread_mutex_unlock(&m->lock);
    return s;
}

static sparge_status need_filled(const sparge_mask *mask, const char *fn)
{
    if (!mask)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: mask is NULL", fn);
    if (!mask->filled)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: the mask holds no selection yet (predict, select or set it first)", fn);
    return SPARGE_OK;
}

static sparge_status to_host(const sparge_mask *mask, void *dst, const void *src, int64_t bytes)
{
    sparge_device *dev = mask->dev;
    return dst ? dev->be->copy(dev->impl, dst, src, (size_t)bytes, SPARGE_COPY_D2H) : SPARGE_OK;
}

sparge_status sparge_mask_get_csr(const sparge_mask *mask, int32_t *counts, int32_t *indices, int32_t *t_counts,
                                  int32_t *t_indices)
{
    sparge_status s = need_filled(mask, "sparge_mask_get_csr");
    if (s)
        return s;
    if ((t_counts || t_indices) && (s = sparge_mask_ensure_transpose(mask)))
        return s;
    const sparge_mask_view *m = &mask->v;
    int64_t bh = m->B * m->H;
    if ((s = to_host(mask, counts, m->counts, bh * m->Nqb * 4)) ||
        (s = to_host(mask, indices, m->indices, bh * m->Nqb * m->Nkb * 4)) ||
        (s = to_host(mask, t_counts, m->t_counts, bh * m->Nkb * 4)))
        return s;
    return to_host(mask, t_indices, m->t_indices, bh * m->Nqb * m->Nkb * 4);
}

sparge_status sparge_mask_get_dense(const sparge_mask *mask, uint8_t *dense_host)
{
    sparge_status s = need_filled(mask, "sparge_mask_get_dense");
    if (s)
        return s;
    if (!dense_host)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_mask_get_dense: dense is NULL");
    const sparge_mask_view *m = &mask->v;
    return to_host(mask, dense_host, m->dense, m->B * m->H * m->Nqb * m->Nkb);
}

sparge_status sparge_mask_get_pooled_map(const sparge_mask *mask, float *map_host)
{
    if (!mask || !map_host)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_mask_get_pooled_map: %s is NULL", mask ? "map" : "mask");
    if (!mask->predicted)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "sparge_mask_get_pooled_map: the mask was not predicted from Q and K");
    const sparge_mask_view *m = &mask->v;
    return to_host(mask, map_host, mask->map, m->B * m->H * m->Nqb * m->Nkb * 4);
}

sparge_status sparge_mask_get_stats(const sparge_mask *mask, sparge_mask_stats *out, double *head_sparsity,
                                    float *row_mass)
{
    sparge_status s = need_filled(mask, "sparge_mask_get_stats");
    if (s)
        return s;
    if (!out)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "sparge_mask_get_stats: out is NULL");
    const sparge_mask_view *m = &mask->v;
    int64_t bh = m->B * m->H, rows = bh * m->Nqb;
    uint8_t *dense = malloc((size_t)(rows * m->Nkb));
    float *mass = malloc((size_t)rows * sizeof(float));
    if (!dense || !mass) {
        free(dense);
        free(mass);
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "sparge_mask_get_stats: out of host memory");
    }
    if ((s = to_host(mask, dense, m->dense, rows * m->Nkb)) || (s = to_host(mask, mass, m->row_mass, rows * 4))) {
        free(dense);
        free(mass);
        return s;
    }
    /* Over the pairs a query may attend: causal rows stop at their diagonal, varlen rows at their sequence. */
    sparge_mask_stats st = {.min_row_blocks = INT32_MAX, .max_row_blocks = 0};
    double pairs = 0.0, allowed_pairs = 0.0, mass_sum = 0.0;
    int64_t real_rows = 0;
    for (int64_t bhi = 0; bhi < bh; bhi++) {
        int64_t tb, q0, nq, k0, nk, head_kept = 0, head_allowed = 0;
        sparge_mask_seq(mask, bhi / m->H, &tb, &q0, &nq, &k0, &nk);
        const int64_t nqb = (nq + m->bq - 1) / m->bq, off = nk - nq;
        for (int64_t i = 0; i < nqb; i++) {
            const uint8_t *row = dense + (bhi * m->Nqb + i) * m->Nkb;
            int64_t allowed, d0, d1, kept = 0;
            sparge_row_rule(i, nq, nk, m->bq, m->bk, m->causal, &allowed, &d0, &d1);
            const int64_t t0 = i * m->bq, t1 = t0 + m->bq < nq ? t0 + m->bq : nq;
            for (int64_t j = 0; j < allowed; j++) {
                const int64_t u0 = j * m->bk, u1 = u0 + m->bk < nk ? u0 + m->bk : nk;
                /* (t, u) with u in the block, and u ≤ t + off on the diagonal blocks of a causal row */
                double block_pairs = (double)(t1 - t0) * (double)(u1 - u0);
                if (m->causal && j >= d0) {
                    block_pairs = 0.0;
                    for (int64_t t = t0; t < t1; t++) {
                        const int64_t last = t + off + 1 < u1 ? t + off + 1 : u1;
                        block_pairs += last > u0 ? (double)(last - u0) : 0.0;
                    }
                }
                allowed_pairs += block_pairs;
                if (row[j]) {
                    kept++;
                    pairs += block_pairs;
                }
            }
            head_kept += kept;
            head_allowed += allowed;
            mass_sum += mass[bhi * m->Nqb + i];
            real_rows++;
            if (kept < st.min_row_blocks) st.min_row_blocks = (int32_t)kept;
            if (kept > st.max_row_blocks) st.max_row_blocks = (int32_t)kept;
        }
        st.kept_blocks += head_kept;
        st.total_blocks += head_allowed;
        if (head_sparsity) /* a sequence without queries may attend nothing, so it drops nothing: 0 */
            head_sparsity[bhi] = head_allowed ? 1.0 - (double)head_kept / (double)head_allowed : 0.0;
    }
    st.sparsity = 1.0 - (double)st.kept_blocks / (double)st.total_blocks;
    st.token_density = pairs / allowed_pairs;
    st.mean_row_mass = mass_sum / (double)real_rows; /* NaN for imported masks */
    if (row_mass)
        memcpy(row_mass, mass, (size_t)rows * sizeof(float));
    *out = st;
    free(dense);
    free(mass);
    return SPARGE_OK;
}

/* Writes n bytes to path; 0 with errno set on failure, and the file removed. */
static int write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return 0;
    int ok = fwrite(data, 1, n, f) == n;
    ok &= fclose(f) == 0;
    if (!ok)
        remove(path);
    return ok;
}

/* Both files are written under temporary names and renamed once both exist, so a failure leaves neither. */
sparge_status sparge_mask_export(const sparge_mask *mask, const char *prefix, int64_t head_dim, sparge_dtype dtype)
{
    static const char fn[] = "sparge_mask_export";
    sparge_status s = need_filled(mask, fn);
    if (s)
        return s;
    if (!prefix)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: prefix is NULL", fn);
    if (head_dim <= 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: head_dim = %lld must be > 0", fn, (long long)head_dim);
    if (!sparge_dtype_size(dtype))
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: unknown dtype %d", fn, (int)dtype);
    sparge_mask_stats st;
    if ((s = sparge_mask_get_stats(mask, &st, NULL, NULL)))
        return s;
    const sparge_mask_view *m = &mask->v;
    const size_t cells = (size_t)(m->B * m->H * m->Nqb * m->Nkb), len = strlen(prefix) + 16;
    /* A varlen mask's rows are its sequences' blocks: the offsets say which rows and columns are real. */
    const size_t json_len = 1024 + (mask->host_seq ? 2 * (size_t)(m->B + 1) * 12 : 0);
    uint8_t *dense = malloc(cells);
    char *paths = malloc(5 * len), *json = malloc(json_len);
    if (!dense || !paths || !json) {
        free(dense);
        free(paths);
        free(json);
        return SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    }
    char *u8 = paths, *js = paths + len, *u8_tmp = paths + 2 * len, *js_tmp = paths + 3 * len, *u8_old = paths + 4 * len;
    snprintf(u8, len, "%s.u8", prefix);
    snprintf(js, len, "%s.json", prefix);
    snprintf(u8_tmp, len, "%s.u8.part", prefix);
    snprintf(js_tmp, len, "%s.json.part", prefix);
    snprintf(u8_old, len, "%s.u8.old", prefix);
    size_t n = (size_t)snprintf(json, json_len,
                                "{\"B\": %lld, \"H\": %lld, \"Nq\": %lld, \"Nk\": %lld, \"D\": %lld, \"block_q\": %d, "
                                "\"block_k\": %d, \"Nqb\": %lld, \"Nkb\": %lld, \"sparsity\": %.6f, \"dtype\": \"%s\", "
                                "\"causal\": %s, \"varlen\": %s, ",
                                (long long)m->B, (long long)m->H, (long long)m->Nq, (long long)m->Nk,
                                (long long)head_dim, m->bq, m->bk, (long long)m->Nqb, (long long)m->Nkb, st.sparsity,
                                sparge_dtype_name(dtype), m->causal ? "true" : "false",
                                mask->host_seq ? "true" : "false");
    for (int t = 0; mask->host_seq && t < 2; t++) {
        n += (size_t)snprintf(json + n, json_len - n, "\"cu_seqlens_%c\": [", t ? 'k' : 'q');
        for (int64_t b = 0; b <= m->B; b++)
            n += (size_t)snprintf(json + n, json_len - n, "%d%s", mask->host_seq[t * (m->B + 1) + b],
                                  b < m->B ? ", " : "], ");
    }
    n += (size_t)snprintf(json + n, json_len - n, "\"layout\": \"dense uint8 [B,H,Nqb,Nkb]\"}\n");
    const char *failed = NULL;
    int have_u8 = 0, have_js = 0, have_old = 0; /* files this call created */
    struct stat js_st;
    if ((s = to_host(mask, dense, m->dense, (int64_t)cells)))
        failed = "";
    else if (stat(js, &js_st) == 0 && S_ISDIR(js_st.st_mode))
        failed = js, errno = EISDIR;
    else if (!(have_u8 = write_file(u8_tmp, dense, cells)))
        failed = u8_tmp;
    else if (!(have_js = write_file(js_tmp, json, n)))
        failed = js_tmp;
    /* An existing PREFIX.u8 stays reachable as PREFIX.u8.old until PREFIX.json is in place, so that a failure there
     * puts it back: a failed export leaves both files as they were. */
    else if ((remove(u8_old), have_old = link(u8, u8_old) == 0, rename(u8_tmp, u8)))
        failed = u8;
    else if ((have_u8 = 0, rename(js_tmp, js)))
        failed = js;
    else
        have_js = 0;
    if (failed && *failed)
        s = SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: cannot write %s (%s)", fn, failed, strerror(errno));
    if (failed == js && have_u8 == 0 && have_js) /* the new PREFIX.u8 is in place: the old one back, or none */
        have_old ? (void)rename(u8_old, u8) : (void)remove(u8);
    else if (have_old)
        remove(u8_old);
    if (have_u8)
        remove(u8_tmp);
    if (have_js)
        remove(js_tmp);
    free(dense);
    free(paths);
    free(json);
    return s;
}
