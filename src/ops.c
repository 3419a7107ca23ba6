/* Validation and dispatch of pooling, pooled map and attention. */
#include <math.h>
#include <stdlib.h>

#include "core.h"

static sparge_status need_dev(sparge_device *dev, const char *fn)
{
    return dev ? SPARGE_OK : SPARGE_FAIL(SPARGE_ERR_NULL, "%s: device is NULL", fn);
}

static float resolve_scale(float scale, int64_t D) { return scale != 0.0f ? scale : 1.0f / sqrtf((float)D); }

sparge_status sparge_pool(sparge_device *dev, const sparge_tensor *x, int block, sparge_tensor *out)
{
    static const char fn[] = "sparge_pool";
    sparge_status s;
    sparge_view xv, ov;
    if ((s = need_dev(dev, fn)) || (s = sparge_check_tensor(x, fn, "x", 0, &xv)) ||
        (s = sparge_check_tensor(out, fn, "out", 1, &ov)))
        return s;
    if (block <= 0)
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: block = %d must be > 0", fn, block);
    int64_t nb = (xv.N + block - 1) / block;
    if (ov.dtype != SPARGE_F32)
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: out must be f32, got %s", fn, sparge_dtype_name(ov.dtype));
    if (ov.B != xv.B || ov.H != xv.H || ov.N != nb || ov.D != xv.D)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: out must be [%lld,%lld,%lld,%lld] (ceil(N/block) rows)", fn,
                           (long long)xv.B, (long long)xv.H, (long long)nb, (long long)xv.D);
    const sparge_region out_r = sparge_view_region(&ov, "out"), in_r = sparge_view_region(&xv, "x");
    if ((s = sparge_check_disjoint(&out_r, 1, &in_r, 1, fn)))
        return s;
    sparge_op_desc d = {.op = SPARGE_OP_POOL, .dtype = xv.dtype, .head_dim = xv.D, .block_q = block, .B = xv.B,
                        .H = xv.H, .Nq = xv.N, .rows_aligned = sparge_rows_aligned(&xv) && sparge_rows_aligned(&ov)};
    const sparge_backend *be;
    if ((s = sparge_pick_tier(dev, &d, fn, &be)))
        return s;
    sparge_pool_args a = {xv, block, ov, NULL, 0};
    sparge_dev_lock(dev);
    s = be->pool(dev->impl, &a);
    sparge_dev_unlock(dev);
    return s;
}

sparge_status sparge_pooled_map(sparge_device *dev, const sparge_tensor *qbar, const sparge_tensor *kbar, float scale,
                                sparge_tensor *map)
{
    static const char fn[] = "sparge_pooled_map";
    sparge_status s;
    sparge_view qv, kv, mv;
    if ((s = need_dev(dev, fn)) ||
        (s = sparge_check_tensor(qbar, fn, "qbar", 0, &qv)) || (s = sparge_check_tensor(kbar, fn, "kbar", 0, &kv)) ||
        (s = sparge_check_tensor(map, fn, "map", 1, &mv)))
        return s;
    if (qv.dtype != SPARGE_F32 || kv.dtype != SPARGE_F32 || mv.dtype != SPARGE_F32)
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: qbar, kbar and map must be f32", fn);
    if (kv.B != qv.B || qv.H % kv.H || kv.D != qv.D)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: kbar's B and D must equal qbar's, and its heads divide qbar's", fn);
    if (mv.B != qv.B || mv.H != qv.H || mv.N != qv.N || mv.D != kv.N)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: map must be [B,H,Nqb,Nkb] = [%lld,%lld,%lld,%lld]", fn,
                           (long long)qv.B, (long long)qv.H, (long long)qv.N, (long long)kv.N);
    if (!isfinite(scale))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: scale is not finite", fn);
    const sparge_region out_r = sparge_view_region(&mv, "map");
    const sparge_region in_r[2] = {sparge_view_region(&qv, "qbar"), sparge_view_region(&kv, "kbar")};
    if ((s = sparge_check_disjoint(&out_r, 1, in_r, 2, fn)))
        return s;
    sparge_op_desc d = {.op = SPARGE_OP_POOLED_MAP, .dtype = SPARGE_F32, .head_dim = qv.D, .B = qv.B, .H = qv.H,
                        .Nq = qv.N, .Nk = kv.N, .kv_heads = kv.H,
                        .rows_aligned = sparge_rows_aligned(&qv) && sparge_rows_aligned(&kv) && sparge_rows_aligned(&mv)};
    const sparge_backend *be;
    if ((s = sparge_pick_tier(dev, &d, fn, &be)))
        return s;
    sparge_map_args a = {qv, kv, resolve_scale(scale, qv.D), mv, NULL};
    sparge_dev_lock(dev);
    s = be->pooled_map(dev->impl, &a);
    sparge_dev_unlock(dev);
    return s;
}

sparge_status sparge_check_mask_for(sparge_device *dev, const sparge_mask *mask, const sparge_view *q,
                                    const sparge_view *k, const char *fn)
{
    if (mask->dev != dev)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: mask lives on %s, not on %s", fn, mask->dev->name, dev->name);
    if (!mask->filled)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: the mask holds no selection yet (predict, select or set it first)", fn);
    return sparge_check_tensors_for_mask(mask, q, k, fn);
}

/* q [B,H,Nq,D]; every other tensor in list[] is checked against q (like-q) or k (like-k). */
typedef struct {
    const sparge_tensor *t;
    const char *role;
    int like_k, is_output;
    sparge_view *v;
} tensor_role;

static sparge_status check_attention_tensors(tensor_role *roles, int n, const char *fn)
{
    sparge_status s;
    for (int i = 0; i < n; i++)
        if ((s = sparge_check_tensor(roles[i].t, fn, roles[i].role, roles[i].is_output, roles[i].v)))
            return s;
    const sparge_view *q = roles[0].v, *k = roles[1].v;
    if (k->B != q->B || k->D != q->D)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: k [%lld,%lld,*,%lld] does not match q's B and D [%lld,%lld,*,%lld]", fn,
                           (long long)k->B, (long long)k->H, (long long)k->D, (long long)q->B, (long long)q->H,
                           (long long)q->D);
    if (q->H % k->H)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: k has %lld heads, which must divide q's %lld (grouped K/V heads: each "
                           "group of H/Hkv query heads reads one K/V head)", fn, (long long)k->H, (long long)q->H);
    for (int i = 1; i < n; i++) {
        const sparge_view *v = roles[i].v, *ref = roles[i].like_k ? k : q;
        if (v->B != ref->B || v->H != ref->H || v->N != ref->N || v->D != ref->D)
            return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: %s is [%lld,%lld,%lld,%lld] but must match %s [%lld,%lld,%lld,%lld]",
                               fn, roles[i].role, (long long)v->B, (long long)v->H, (long long)v->N, (long long)v->D,
                               roles[i].like_k ? "k" : "q", (long long)ref->B, (long long)ref->H, (long long)ref->N,
                               (long long)ref->D);
        if (v->dtype != q->dtype)
            return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: %s is %s but q is %s", fn, roles[i].role,
                               sparge_dtype_name(v->dtype), sparge_dtype_name(q->dtype));
    }
    return SPARGE_OK;
}

/* The call's description for the tiers: roles[0] is q, roles[1] k. */
static sparge_op_desc attention_desc(sparge_op op, const tensor_role *roles, int n, const sparge_mask *mask,
                                     int deterministic, int causal)
{
    const sparge_view *q = roles[0].v, *k = roles[1].v;
    sparge_op_desc d = {.op = op, .dtype = q->dtype, .head_dim = q->D, .B = q->B, .H = q->H, .Nq = q->N, .Nk = k->N,
                        .rows_aligned = 1, .deterministic = deterministic, .kv_heads = k->H, .causal = causal};
    if (mask) {
        d.block_q = mask->v.bq;
        d.block_k = mask->v.bk;
        d.B = mask->v.B;
        d.Nq = mask->v.Nq;
        d.Nk = mask->v.Nk;
        d.causal = mask->v.causal;
        d.varlen = mask->v.seq_q != NULL;
    }
    for (int i = 0; i < n; i++)
        d.rows_aligned &= sparge_rows_aligned(roles[i].v);
    return d;
}

static sparge_status check_lse_aligned(const float *lse, const char *fn)
{
    if ((uintptr_t)lse % sizeof(float))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: lse is not aligned to 4-byte floats", fn);
    return SPARGE_OK;
}

/* The forward's outputs o and lse (roles[3], may be NULL) against its inputs q, k, v and each other. */
static sparge_status check_forward_disjoint(const tensor_role *roles, const float *lse, const char *fn)
{
    const sparge_view *q = roles[0].v;
    sparge_status s = check_lse_aligned(lse, fn);
    if (s)
        return s;
    sparge_region outs[2] = {sparge_view_region(roles[3].v, "o"), sparge_lse_region(lse, q->B * q->H * q->N, "lse")};
    sparge_region ins[3];
    for (int i = 0; i < 3; i++)
        ins[i] = sparge_view_region(roles[i].v, roles[i].role);
    return sparge_check_disjoint(outs, 2, ins, 3, fn);
}

/* Also causal: a dense call's needs Nq ≤ Nk; with a mask it may only repeat the mask's. */
static sparge_status check_attn_params(const sparge_attn_params *p, const sparge_mask *mask, const sparge_view *q,
                                       const sparge_view *k, const char *fn)
{
    if (!p)
        return SPARGE_OK;
    if (!isfinite(p->scale))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: scale is not finite", fn);
    if (p->causal && mask && !mask->v.causal)
        return SPARGE_FAIL(SPARGE_ERR_MASK, "%s: params ask for causal attention but the mask was created without it", fn);
    if (p->causal && !mask && q->N > k->N)
        return SPARGE_FAIL(SPARGE_ERR_SHAPE, "%s: causal attention needs Nq <= Nk (got Nq=%lld, Nk=%lld)", fn,
                           (long long)q->N, (long long)k->N);
    return SPARGE_OK;
}

sparge_status sparge_attention_forward(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                       const sparge_tensor *v, const sparge_mask *mask, const sparge_attn_params *params,
                                       sparge_tensor *o, float *lse)
{
    static const char fn[] = "sparge_attention_forward";
    sparge_status s;
    sparge_view qv, kv, vv, ov;
    tensor_role roles[] = {{q, "q", 0, 0, &qv}, {k, "k", 1, 0, &kv}, {v, "v", 1, 0, &vv}, {o, "o", 0, 1, &ov}};
    const sparge_backend *be;
    if ((s = need_dev(dev, fn)) || (s = check_attention_tensors(roles, 4, fn)) ||
        (s = check_attn_params(params, mask, &qv, &kv, fn)) || (mask && (s = sparge_check_mask_for(dev, mask, &qv, &kv, fn))))
        return s;
    if ((s = check_forward_disjoint(roles, lse, fn)))
        return s;
    const int causal = mask ? mask->v.causal : params && params->causal;
    sparge_op_desc d = attention_desc(SPARGE_OP_FORWARD, roles, 4, mask, 0, causal);
    if ((s = sparge_pick_tier(dev, &d, fn, &be)))
        return s;
    sparge_fwd_args a = {qv, kv, vv, ov, lse, resolve_scale(params ? params->scale : 0.0f, qv.D),
                         mask ? mask->v.bq : 128, mask ? mask->v.bk : 64, causal, mask ? &mask->v : NULL};
    sparge_dev_lock(dev);
    s = be->forward(dev->impl, &a);
    sparge_dev_unlock(dev);
    return s;
}

sparge_status sparge_attention_backward(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                        const sparge_tensor *v, const sparge_tensor *o, const sparge_tensor *d_o,
                                        const float *lse, const sparge_mask *mask, const sparge_attn_params *params,
                                        sparge_tensor *dq, sparge_tensor *dk, sparge_tensor *dv)
{
    static const char fn[] = "sparge_attention_backward";
    sparge_status s;
    sparge_view qv, kv, vv, ov, dov, dqv, dkv, dvv;
    tensor_role roles[] = {{q, "q", 0, 0, &qv},     {k, "k", 1, 0, &kv},    {v, "v", 1, 0, &vv},
                           {o, "o", 0, 0, &ov},     {d_o, "d_o", 0, 0, &dov}, {dq, "dq", 0, 1, &dqv},
                           {dk, "dk", 1, 1, &dkv},  {dv, "dv", 1, 1, &dvv}};
    const sparge_backend *be;
    if ((s = need_dev(dev, fn)) || (s = check_attention_tensors(roles, 8, fn)) ||
        (s = check_attn_params(params, mask, &qv, &kv, fn)) || (mask && (s = sparge_check_mask_for(dev, mask, &qv, &kv, fn))))
        return s;
    if (!lse)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: lse is NULL (pass the forward's LSE)", fn);
    if ((s = check_lse_aligned(lse, fn)))
        return s;
    sparge_region outs[3], ins[6];
    for (int i = 0; i < 5; i++)
        ins[i] = sparge_view_region(roles[i].v, roles[i].role);
    ins[5] = sparge_lse_region(lse, qv.B * qv.H * qv.N, "lse");
    for (int i = 0; i < 3; i++)
        outs[i] = sparge_view_region(roles[5 + i].v, roles[5 + i].role);
    if ((s = sparge_check_disjoint(outs, 3, ins, 6, fn)))
        return s;
    const int causal = mask ? mask->v.causal : params && params->causal;
    sparge_op_desc d = attention_desc(SPARGE_OP_BACKWARD, roles, 8, mask, params ? params->deterministic : 0, causal);
    if ((s = sparge_pick_tier(dev, &d, fn, &be)))
        return s;
    if (mask && (s = sparge_mask_ensure_transpose(mask))) /* queued ahead of the backward on GPUs, no wait */
        return s;
    sparge_bwd_args a = {qv, kv, vv, ov, dov, dqv, dkv, dvv, lse, resolve_scale(params ? params->scale : 0.0f, qv.D),
                         mask ? mask->v.bq : 128, mask ? mask->v.bk : 64, causal, params ? params->deterministic : 0,
                         mask ? &mask->v : NULL};
    sparge_dev_lock(dev);
    s = be->backward(dev->impl, &a);
    sparge_dev_unlock(dev);
    return s;
}

sparge_status sparge_attention(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                               const sparge_tensor *v, const sparge_mask_params *params, sparge_tensor *o, float *lse,
                               sparge_mask *mask)
{
    static const char fn[] = "sparge_attention";
    sparge_status s;
    sparge_view qv, kv, vv, ov;
    tensor_role roles[] = {{q, "q", 0, 0, &qv}, {k, "k", 1, 0, &kv}, {v, "v", 1, 0, &vv}, {o, "o", 0, 1, &ov}};
    const sparge_mask_params defaults = sparge_mask_params_default();
    sparge_mask_params p = params ? *params : defaults;
    if (!params) /* no params: the defaults with blocks of 0, which mean what they mean below */
        p.block_q = p.block_k = 0;
    if ((s = need_dev(dev, fn)) || (s = sparge_check_mask_params(&p, fn)) || (s = check_attention_tensors(roles, 4, fn)) ||
        (s = check_forward_disjoint(roles, lse, fn)))
        return s;
    sparge_mask *m = mask, *tmp = NULL;
    /* Blocks of 0 are the defaults for the temporary mask; a given mask's own otherwise (sparge_check_predict). */
    const sparge_mask_layout layout = {.B = qv.B, .H = qv.H, .Nq = qv.N, .Nk = kv.N,
                                       .block_q = p.block_q ? p.block_q : defaults.block_q,
                                       .block_k = p.block_k ? p.block_k : defaults.block_k,
                                       .causal = p.causal};
    if (!m && (s = sparge_mask_create_named(dev, &layout, fn, &tmp)))
        return s;
    if (!m)
        m = tmp;
    /* The whole call is checked before the mask or any output is written. */
    const sparge_backend *predict_tier, *forward_tier;
    sparge_view pq, pk;
    sparge_op_desc d = attention_desc(SPARGE_OP_FORWARD, roles, 4, m, 0, m->v.causal);
    if (!(s = sparge_check_predict(dev, q, k, &p, m, fn, &pq, &pk, &predict_tier)) &&
        !(s = sparge_pick_tier(dev, &d, fn, &forward_tier)) &&
        !(s = sparge_run_predict(dev, &pq, &pk, &p, m, predict_tier, fn))) {
        sparge_fwd_args a = {qv, kv, vv, ov, lse, resolve_scale(p.scale, qv.D), m->v.bq, m->v.bk, m->v.causal, &m->v};
        sparge_dev_lock(dev);
        s = forward_tier->forward(dev->impl, &a);
        sparge_dev_unlock(dev);
    }
    if (tmp) {
        /* The temporary mask must outlive the queued GPU work that reads it. */
        sparge_status s2 = sparge_synchronize(dev);
        sparge_mask_destroy(tmp);
        if (!s)
            s = s2;
    }
    return s;
}
