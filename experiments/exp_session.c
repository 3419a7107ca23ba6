/* A device session: inputs uploaded once, the dense reference, the pooled map
 * for re-selection, and error measurement of sparse outputs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

int exp_check(sparge_status s, const char *what)
{
    if (s == SPARGE_OK)
        return 0;
    fprintf(stderr, "%s: %s: %s\n", what, sparge_status_name(s), sparge_last_error());
    return -1;
}

static size_t numel(const exp_qkv *x) { return (size_t)(x->B * x->H * x->N * x->D); }

/* Host f32 -> device buffer in dtype. */
static int upload(sparge_device *dev, const float *src, size_t n, sparge_dtype t, void **dst)
{
    size_t es = sparge_dtype_size(t);
    if (exp_check(sparge_malloc(dev, n * es, dst), "sparge_malloc"))
        return -1;
    const void *tmp = src;
    uint16_t *h = NULL;
    if (t != SPARGE_F32) {
        h = malloc(n * 2);
        if (!h) {
            fprintf(stderr, "upload: out of host memory\n");
            return -1;
        }
        for (size_t i = 0; i < n; i++)
            h[i] = t == SPARGE_F16 ? sparge_f32_to_f16(src[i]) : sparge_f32_to_bf16(src[i]);
        tmp = h;
    }
    int rc = exp_check(sparge_memcpy_to_device(dev, *dst, tmp, n * es), "sparge_memcpy_to_device");
    free(h);
    return rc;
}

static int download(sparge_device *dev, const void *src, size_t n, sparge_dtype t, float *dst)
{
    if (t == SPARGE_F32)
        return exp_check(sparge_memcpy_to_host(dev, dst, src, n * 4), "sparge_memcpy_to_host");
    uint16_t *h = malloc(n * 2);
    if (!h)
        return -1;
    int rc = exp_check(sparge_memcpy_to_host(dev, h, src, n * 2), "sparge_memcpy_to_host");
    for (size_t i = 0; !rc && i < n; i++)
        dst[i] = t == SPARGE_F16 ? sparge_f16_to_f32(h[i]) : sparge_bf16_to_f32(h[i]);
    free(h);
    return rc;
}

/* Dense attention of x on dev (f32 inputs on host), output to host. */
static int dense_on(sparge_device *dev, const exp_qkv *x, sparge_dtype t, float *o_host)
{
    void *q = NULL, *k = NULL, *v = NULL, *o = NULL;
    size_t n = numel(x);
    int rc = upload(dev, x->q, n, t, &q) || upload(dev, x->k, n, t, &k) || upload(dev, x->v, n, t, &v) ||
             exp_check(sparge_malloc(dev, n * sparge_dtype_size(t), &o), "sparge_malloc");
    if (!rc) {
        sparge_tensor tq = sparge_tensor_bhnd(q, t, x->B, x->H, x->N, x->D), tk = tq, tv = tq, to = tq;
        tk.data = k;
        tv.data = v;
        to.data = o;
        rc = exp_check(sparge_attention_forward(dev, &tq, &tk, &tv, NULL, NULL, &to, NULL), "dense reference") ||
             download(dev, o, n, t, o_host);
    }
    void *bufs[] = {q, k, v, o};
    for (int i = 0; i < 4; i++)
        if (bufs[i])
            sparge_free(dev, bufs[i]);
    return rc ? -1 : 0;
}

void exp_session_close(exp_session *s)
{
    if (s->dev) {
        void *bufs[] = {s->dq, s->dk, s->dv, s->dout, s->dmap};
        for (int i = 0; i < 5; i++)
            if (bufs[i])
                sparge_free(s->dev, bufs[i]);
        sparge_mask_destroy(s->mask);
        sparge_device_close(s->dev);
    }
    void *host[] = {s->map_host, s->o_ref, s->o_sparse, s->row_count, s->row_mass, s->row_err, s->row_ref_l1};
    for (int i = 0; i < 7; i++)
        free(host[i]);
    memset(s, 0, sizeof *s);
}

int exp_session_open(exp_session *s, const char *backend, const char *ref_backend, const exp_qkv *x,
                     sparge_dtype dtype, int block_q, int block_k)
{
    memset(s, 0, sizeof *s);
    s->x = x;
    s->dtype = dtype;
    s->block_q = block_q;
    s->block_k = block_k;
    s->Nqb = (x->N + block_q - 1) / block_q;
    s->Nkb = (x->N + block_k - 1) / block_k;
    s->rows = x->B * x->H * s->Nqb;
    size_t n = numel(x);
    if (exp_check(sparge_device_open(backend, &s->dev), "sparge_device_open"))
        return -1;
    s->map_host = malloc(sizeof(float) * (size_t)(s->rows * s->Nkb));
    s->o_ref = malloc(n * sizeof(float));
    s->o_sparse = malloc(n * sizeof(float));
    s->row_count = malloc(sizeof(int32_t) * (size_t)s->rows);
    s->row_mass = malloc(sizeof(float) * (size_t)s->rows);
    s->row_err = malloc(sizeof(double) * (size_t)s->rows);
    s->row_ref_l1 = malloc(sizeof(double) * (size_t)s->rows);
    if (!s->map_host || !s->o_ref || !s->o_sparse || !s->row_count || !s->row_mass || !s->row_err ||
        !s->row_ref_l1) {
        fprintf(stderr, "exp_session_open: out of host memory\n");
        exp_session_close(s);
        return -1;
    }
    int rc = upload(s->dev, x->q, n, dtype, &s->dq) || upload(s->dev, x->k, n, dtype, &s->dk) ||
             upload(s->dev, x->v, n, dtype, &s->dv) ||
             exp_check(sparge_malloc(s->dev, n * sparge_dtype_size(dtype), &s->dout), "sparge_malloc") ||
             exp_check(sparge_mask_create(s->dev, x->B, x->H, x->N, x->N, block_q, block_k, &s->mask),
                       "sparge_mask_create");
    if (!rc) {
        s->tq = sparge_tensor_bhnd(s->dq, dtype, x->B, x->H, x->N, x->D);
        s->tk = s->tv = s->tout = s->tq;
        s->tk.data = s->dk;
        s->tv.data = s->dv;
        s->tout.data = s->dout;
        sparge_mask_params mp = sparge_mask_params_default();
        mp.block_q = block_q;
        mp.block_k = block_k;
        rc = exp_check(sparge_mask_predict(s->dev, &s->tq, &s->tk, &mp, s->mask), "sparge_mask_predict") ||
             exp_check(sparge_mask_get_pooled_map(s->mask, s->map_host), "sparge_mask_get_pooled_map") ||
             upload(s->dev, s->map_host, (size_t)(s->rows * s->Nkb), SPARGE_F32, &s->dmap);
    }
    if (!rc) {
        s->tmap = sparge_tensor_bhnd(s->dmap, SPARGE_F32, x->B, x->H, s->Nqb, s->Nkb);
        if (ref_backend && *ref_backend && strcmp(ref_backend, backend) != 0) {
            rc = exp_check(sparge_device_open(ref_backend, &s->ref_dev), "sparge_device_open (reference)") ||
                 dense_on(s->ref_dev, x, SPARGE_F32, s->o_ref);
            if (s->ref_dev)
                sparge_device_close(s->ref_dev);
            s->ref_dev = NULL;
        } else {
            rc = exp_check(sparge_attention_forward(s->dev, &s->tq, &s->tk, &s->tv, NULL, NULL, &s->tout, NULL),
                           "dense forward") ||
                 download(s->dev, s->dout, n, dtype, s->o_ref);
        }
    }
    if (rc) {
        exp_session_close(s);
        return -1;
    }
    double l1 = 0.0;
    for (size_t i = 0; i < n; i++)
        l1 += fabs((double)s->o_ref[i]);
    s->ref_l1 = l1;
    return 0;
}

int64_t exp_select(exp_session *s, double k, double p)
{
    sparge_mask_params mp = {s->block_q, s->block_k, k, p, 0.0f, 0};
    sparge_mask_stats st;
    if (exp_check(sparge_mask_select(s->dev, &s->tmap, &mp, s->mask), "sparge_mask_select") ||
        exp_check(sparge_mask_get_stats(s->mask, &st, NULL, NULL), "sparge_mask_get_stats"))
        return -1;
    return st.kept_blocks;
}

int exp_sparse_forward(exp_session *s)
{
    return exp_check(sparge_attention_forward(s->dev, &s->tq, &s->tk, &s->tv, s->mask, NULL, &s->tout, NULL),
                     "sparse forward") ||
                   download(s->dev, s->dout, numel(s->x), s->dtype, s->o_sparse)
               ? -1
               : 0;
}

int exp_measure(exp_session *s, double k, double p, exp_point *pt)
{
    sparge_mask_stats st;
    if (exp_select(s, k, p) < 0 || exp_sparse_forward(s) ||
        exp_check(sparge_mask_get_stats(s->mask, &st, NULL, NULL), "sparge_mask_get_stats"))
        return -1;
    size_t n = numel(s->x);
    double l1 = 0.0, l2 = 0.0, r2 = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)s->o_sparse[i] - (double)s->o_ref[i];
        l1 += fabs(d);
        l2 += d * d;
        r2 += (double)s->o_ref[i] * (double)s->o_ref[i];
    }
    *pt = (exp_point){k, p, st.kept_blocks, st.sparsity, st.token_density, st.mean_row_mass, l1 / s->ref_l1,
                      sqrt(l2 / r2)};
    return 0;
}

double exp_topk_for_count(int64_t n, int64_t Nkb) { return (double)n / (double)Nkb; }

int64_t exp_calibrate_p(exp_session *s, double k, int64_t target_kept, double *p_out)
{
    /* kept(p) is a non-decreasing step function: find the smallest p with
     * kept >= target, then compare with the step just below it. */
    double lo = 0.0, hi = 1.0;
    int64_t kept_hi = exp_select(s, k, hi), kept_lo;
    if (kept_hi < 0)
        return -1;
    if (kept_hi < target_kept) { /* even p = 1 keeps too little: cannot happen unless target > all */
        *p_out = hi;
        return kept_hi;
    }
    for (int it = 0; it < 60 && hi - lo > 1e-12; it++) {
        double mid = 0.5 * (lo + hi);
        int64_t kept = exp_select(s, k, mid);
        if (kept < 0)
            return -1;
        if (kept >= target_kept) {
            hi = mid;
            kept_hi = kept;
        } else {
            lo = mid;
        }
    }
    kept_lo = lo > 0.0 || k > 0.0 ? exp_select(s, k, lo) : -1;
    double p = hi;
    int64_t kept = kept_hi;
    /* Prefer the step at or above the target unless the one below is strictly closer. */
    if (kept_lo >= 0 && target_kept - kept_lo < kept_hi - target_kept) {
        p = lo;
        kept = kept_lo;
    }
    *p_out = p;
    /* leave the mask holding the chosen selection */
    return exp_select(s, k, p) == kept ? kept : -1;
}

int exp_row_stats(exp_session *s)
{
    sparge_mask_stats st;
    if (exp_check(sparge_mask_get_csr(s->mask, s->row_count, NULL, NULL, NULL), "sparge_mask_get_csr") ||
        exp_check(sparge_mask_get_stats(s->mask, &st, NULL, s->row_mass), "sparge_mask_get_stats"))
        return -1;
    const exp_qkv *x = s->x;
    for (int64_t bh = 0; bh < x->B * x->H; bh++)
        for (int64_t i = 0; i < s->Nqb; i++) {
            int64_t t0 = i * s->block_q, t1 = t0 + s->block_q < x->N ? t0 + s->block_q : x->N;
            double num = 0.0, den = 0.0;
            for (int64_t e = (bh * x->N + t0) * x->D; e < (bh * x->N + t1) * x->D; e++) {
                num += fabs((double)s->o_sparse[e] - (double)s->o_ref[e]);
                den += fabs((double)s->o_ref[e]);
            }
            s->row_err[bh * s->Nqb + i] = num / den;
            s->row_ref_l1[bh * s->Nqb + i] = den;
        }
    return 0;
}

const exp_rule exp_paper_arms[EXP_RULES] = {{"Top-k", 0.05, 0.0}, {"Top-p", 0.0, 0.4}, {"hybrid", 0.03, 0.2}};

int exp_equal_sparsity_rules(exp_session *s, double topk, double hybrid_k, exp_rule out[EXP_RULES])
{
    int64_t n = (int64_t)floor(topk * (double)s->Nkb + 1e-6);
    n = n < 1 ? 1 : n;
    int64_t target = s->rows * n;
    double p_topp, p_hyb;
    if (exp_calibrate_p(s, 0.0, target, &p_topp) < 0 || exp_calibrate_p(s, hybrid_k, target, &p_hyb) < 0)
        return -1;
    out[EXP_TOPK] = (exp_rule){"Top-k", exp_topk_for_count(n, s->Nkb), 0.0};
    out[EXP_TOPP] = (exp_rule){"Top-p", 0.0, p_topp};
    out[EXP_HYBRID] = (exp_rule){"hybrid", hybrid_k, p_hyb};
    return 0;
}
