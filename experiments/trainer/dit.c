/* The video DiT: parameters, forward and backward by hand (llm.c-style).
 *
 * Per block (pre-norm, adaLN-Zero; mod = Linear(SiLU(c)) split into shift1, scale1, gate1,
 * shift2, scale2, gate2):
 *   x ← x + gate1 · proj(attn(qkv(LN(x)·(1+scale1)+shift1)))
 *   x ← x + gate2 · fc2(GELU(fc1(LN(x)·(1+scale2)+shift2)))
 * Attention runs through sparge on Q/K/V viewed in place inside the qkv activation
 * ([B, N, 3, heads, hd] = BNHD views with token stride 3·dim), no copies. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"
#include "trainer.h"

typedef struct {
    float *ada_w, *ada_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *fc1_w, *fc1_b, *fc2_w, *fc2_b;
} block_params;

typedef struct {
    float *x_in, *mod, *xhat1, *rstd1, *h1, *qkv, *att, *lse, *proj, *x_mid, *xhat2, *rstd2, *h2, *fc1, *gelu, *fc2;
} block_acts;

struct tr_model {
    tr_dims dm;
    int block_q, block_k;
    /* parameters */
    int ntensors;
    tr_param tensors[16 + 10 * TR_MAX_DEPTH];
    size_t nparams;
    float *params, *grads;
    float *x_emb_w, *x_emb_b, *t_w1, *t_b1, *t_w2, *t_b2, *y_emb, *f_ada_w, *f_ada_b, *f_w, *f_b;
    block_params blk[TR_MAX_DEPTH];
    /* activations */
    float *acts;
    float *pos, *xp, *tfreq, *th, *ths, *c, *cs, *x_final, *fmod, *xhatf, *rstdf, *hf, *out;
    int *y;
    block_acts ba[TR_MAX_DEPTH];
    /* backward scratch */
    float *dres, *dbuf, *dbuf2, *dqkv, *datt, *dfc, *dfc2, *dmod, *dcs, *dtmp, *dout;
    /* attention on a sparge device */
    sparge_device *dev;
    int host_resident; /* the device reads host memory: no staging copies */
    float *dev_qkv, *dev_att, *dev_lse, *dev_dqkv, *dev_datt; /* staging buffers on other devices */
    sparge_mask *masks[TR_MAX_DEPTH];
    tr_attn_mode mode;
    double topk, topp;
    int frozen, masks_valid, measure_error;
    double last_sparsity, last_l1, attn_ms;
};

static int sparge_failed(sparge_status s, char *err, size_t len, const char *what)
{
    return exp_fail(err, len, "%s: %s: %s", what, sparge_status_name(s), sparge_last_error());
}

/* ---------------------------------------------------------------- layout */

static void add_tensor(tr_model *m, const char *name, int64_t d0, int64_t d1, int decay)
{
    tr_param *p = &m->tensors[m->ntensors++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = d1 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->size = (size_t)d0 * (size_t)(d1 ? d1 : 1);
    p->offset = m->nparams;
    p->decay = decay;
    m->nparams += p->size;
}

static void add_linear(tr_model *m, const char *prefix, int in, int out)
{
    char name[64];
    snprintf(name, sizeof name, "%s.weight", prefix);
    add_tensor(m, name, out, in, 1);
    snprintf(name, sizeof name, "%s.bias", prefix);
    add_tensor(m, name, out, 0, 0);
}

static float *P(tr_model *m, int *idx) { return m->params + m->tensors[(*idx)++].offset; }

static void build_layout(tr_model *m)
{
    const tr_dims *d = &m->dm;
    char pre[48];
    add_linear(m, "x_embedder", d->P, d->d);
    add_linear(m, "t_embedder.mlp0", d->F, d->d);
    add_linear(m, "t_embedder.mlp2", d->d, d->d);
    add_tensor(m, "y_embedder.weight", d->K, d->d, 0);
    for (int l = 0; l < d->L; l++) {
        snprintf(pre, sizeof pre, "blocks.%d.adaLN", l);
        add_linear(m, pre, d->d, 6 * d->d);
        snprintf(pre, sizeof pre, "blocks.%d.attn.qkv", l);
        add_linear(m, pre, d->d, 3 * d->d);
        snprintf(pre, sizeof pre, "blocks.%d.attn.proj", l);
        add_linear(m, pre, d->d, d->d);
        snprintf(pre, sizeof pre, "blocks.%d.mlp.fc1", l);
        add_linear(m, pre, d->d, d->M);
        snprintf(pre, sizeof pre, "blocks.%d.mlp.fc2", l);
        add_linear(m, pre, d->M, d->d);
    }
    add_linear(m, "final.adaLN", d->d, 2 * d->d);
    add_linear(m, "final.linear", d->d, d->P);
}

static void bind_params(tr_model *m)
{
    int i = 0;
    m->x_emb_w = P(m, &i), m->x_emb_b = P(m, &i);
    m->t_w1 = P(m, &i), m->t_b1 = P(m, &i), m->t_w2 = P(m, &i), m->t_b2 = P(m, &i);
    m->y_emb = P(m, &i);
    for (int l = 0; l < m->dm.L; l++) {
        block_params *b = &m->blk[l];
        b->ada_w = P(m, &i), b->ada_b = P(m, &i), b->qkv_w = P(m, &i), b->qkv_b = P(m, &i);
        b->proj_w = P(m, &i), b->proj_b = P(m, &i), b->fc1_w = P(m, &i), b->fc1_b = P(m, &i);
        b->fc2_w = P(m, &i), b->fc2_b = P(m, &i);
    }
    m->f_ada_w = P(m, &i), m->f_ada_b = P(m, &i), m->f_w = P(m, &i), m->f_b = P(m, &i);
}

/* The gradient of a parameter lives at the same offset in the gradient array. */
static float *G(tr_model *m, const float *param) { return m->grads + (param - m->params); }

/* Carves the activation buffers out of one allocation (two passes: count, then assign). */
static size_t carve(tr_model *m, float *base)
{
    const tr_dims *d = &m->dm;
    size_t BN = (size_t)d->B * d->N, off = 0;
#define TAKE(ptr, n)                                                                                          \
    do {                                                                                                       \
        if (base)                                                                                              \
            (ptr) = base + off;                                                                                \
        off += ((size_t)(n) + 15) & ~(size_t)15;                                                               \
    } while (0)
    TAKE(m->pos, (size_t)d->N * d->d);
    TAKE(m->xp, BN * d->P);
    TAKE(m->tfreq, (size_t)d->B * d->F);
    TAKE(m->th, (size_t)d->B * d->d);
    TAKE(m->ths, (size_t)d->B * d->d);
    TAKE(m->c, (size_t)d->B * d->d);
    TAKE(m->cs, (size_t)d->B * d->d);
    for (int l = 0; l < d->L; l++) {
        block_acts *a = &m->ba[l];
        TAKE(a->x_in, BN * d->d);
        TAKE(a->mod, (size_t)d->B * 6 * d->d);
        TAKE(a->xhat1, BN * d->d);
        TAKE(a->rstd1, BN);
        TAKE(a->h1, BN * d->d);
        TAKE(a->qkv, BN * 3 * d->d);
        TAKE(a->att, BN * d->d);
        TAKE(a->lse, (size_t)d->B * d->nh * d->N);
        TAKE(a->proj, BN * d->d);
        TAKE(a->x_mid, BN * d->d);
        TAKE(a->xhat2, BN * d->d);
        TAKE(a->rstd2, BN);
        TAKE(a->h2, BN * d->d);
        TAKE(a->fc1, BN * d->M);
        TAKE(a->gelu, BN * d->M);
        TAKE(a->fc2, BN * d->d);
    }
    TAKE(m->x_final, BN * d->d);
    TAKE(m->fmod, (size_t)d->B * 2 * d->d);
    TAKE(m->xhatf, BN * d->d);
    TAKE(m->rstdf, BN);
    TAKE(m->hf, BN * d->d);
    TAKE(m->out, BN * d->P);
    TAKE(m->dres, BN * d->d);
    TAKE(m->dbuf, BN * d->d);
    TAKE(m->dbuf2, BN * d->d);
    TAKE(m->dqkv, BN * 3 * d->d);
    TAKE(m->datt, BN * d->d);
    TAKE(m->dfc, BN * d->M);
    TAKE(m->dfc2, BN * d->M);
    TAKE(m->dmod, (size_t)d->B * 6 * d->d);
    TAKE(m->dcs, (size_t)d->B * d->d);
    TAKE(m->dtmp, (size_t)d->B * d->d);
    TAKE(m->dout, BN * d->P);
#undef TAKE
    return off;
}

/* Sinusoids of the token's frame, row and column in three slices of the width. */
static void positional_encoding(tr_model *m)
{
    const tr_dims *d = &m->dm;
    int ds = 2 * (d->d / 6), dt = d->d - 2 * ds; /* slices for (t) and (y), (x); each even */
    for (int t = 0; t < d->T; t++)
        for (int y = 0; y < d->Hp; y++)
            for (int x = 0; x < d->Wp; x++) {
                float *pe = m->pos + ((size_t)(t * d->Hp + y) * d->Wp + x) * d->d;
                const int coord[3] = {t, y, x}, width[3] = {dt, ds, ds};
                int at = 0;
                for (int a = 0; a < 3; a++) {
                    int half = width[a] / 2;
                    for (int i = 0; i < half; i++) {
                        double w = coord[a] * exp(-log(10000.0) * i / (half > 1 ? half : 1));
                        pe[at + i] = (float)sin(w);
                        pe[at + half + i] = (float)cos(w);
                    }
                    at += width[a];
                }
            }
}

tr_model *tr_model_create(const tr_config *c, int B, sparge_device *dev, char *err, size_t err_len)
{
    if (tr_config_check(c, err, err_len))
        return NULL;
    if (B < 1 || !dev) {
        exp_fail(err, err_len, "model: batch must be >= 1 (got %d) and a device is needed", B);
        return NULL;
    }
    tr_model *m = calloc(1, sizeof *m);
    if (!m) {
        exp_fail(err, err_len, "model: out of memory");
        return NULL;
    }
    tr_dims *d = &m->dm;
    d->B = B;
    d->T = c->frames, d->H = c->height, d->W = c->width, d->C = c->channels;
    d->Hp = d->H / 2, d->Wp = d->W / 2, d->N = d->T * d->Hp * d->Wp, d->P = 4 * d->C;
    d->d = c->dim, d->nh = c->heads, d->hd = c->dim / c->heads, d->M = c->mlp_ratio * c->dim, d->F = c->dim;
    d->L = c->depth, d->K = c->classes;
    m->block_q = c->block_q, m->block_k = c->block_k;
    m->dev = dev;
    const char *backend = sparge_device_backend(dev);
    m->host_resident = (!strcmp(backend, "cpu") || !strcmp(backend, "cpu-ref")) && !c->stage_attention;
    build_layout(m);
    size_t nacts = carve(m, NULL);
    m->params = calloc(m->nparams, sizeof(float));
    m->grads = calloc(m->nparams, sizeof(float));
    m->acts = calloc(nacts, sizeof(float));
    m->y = calloc((size_t)B, sizeof(int));
    if (!m->params || !m->grads || !m->acts || !m->y) {
        exp_fail(err, err_len, "model: out of memory (%zu parameters, %zu activation floats)", m->nparams, nacts);
        tr_model_free(m);
        return NULL;
    }
    bind_params(m);
    carve(m, m->acts);
    positional_encoding(m);
    size_t BN = (size_t)B * d->N;
    if (!m->host_resident) {
        void **bufs[5] = {(void **)&m->dev_qkv, (void **)&m->dev_att, (void **)&m->dev_lse, (void **)&m->dev_dqkv,
                          (void **)&m->dev_datt};
        const size_t bytes[5] = {BN * 3 * d->d * 4, BN * d->d * 4, (size_t)B * d->nh * d->N * 4, BN * 3 * d->d * 4,
                                 BN * d->d * 4};
        for (int i = 0; i < 5; i++) {
            sparge_status s = sparge_malloc(dev, bytes[i], bufs[i]);
            if (s) {
                sparge_failed(s, err, err_len, "model: staging buffer");
                tr_model_free(m);
                return NULL;
            }
        }
    }
    for (int l = 0; l < d->L; l++) {
        sparge_status s = sparge_mask_create(dev, B, d->nh, d->N, d->N, c->block_q, c->block_k, &m->masks[l]);
        if (s) {
            sparge_failed(s, err, err_len, "model: mask");
            tr_model_free(m);
            return NULL;
        }
    }
    tr_model_set_attention(m, c->attn, c->topk, c->topp);
    return m;
}

void tr_model_free(tr_model *m)
{
    if (!m)
        return;
    for (int l = 0; l < m->dm.L; l++)
        sparge_mask_destroy(m->masks[l]);
    float *staged[5] = {m->dev_qkv, m->dev_att, m->dev_lse, m->dev_dqkv, m->dev_datt};
    for (int i = 0; i < 5; i++)
        if (staged[i])
            sparge_free(m->dev, staged[i]);
    free(m->params);
    free(m->grads);
    free(m->acts);
    free(m->y);
    free(m);
}

const tr_dims *tr_model_dims(const tr_model *m) { return &m->dm; }
size_t tr_model_num_params(const tr_model *m) { return m->nparams; }
int tr_model_num_tensors(const tr_model *m) { return m->ntensors; }
const tr_param *tr_model_tensor(const tr_model *m, int i) { return &m->tensors[i]; }
float *tr_model_params(tr_model *m) { return m->params; }
float *tr_model_grads(tr_model *m) { return m->grads; }
void tr_model_zero_grad(tr_model *m) { memset(m->grads, 0, m->nparams * sizeof(float)); }
double tr_model_last_sparsity(const tr_model *m) { return m->last_sparsity; }
double tr_model_last_attention_l1(const tr_model *m) { return m->last_l1; }
void tr_model_measure_attention_error(tr_model *m, int on) { m->measure_error = on; }
double tr_model_attention_ms(const tr_model *m) { return m->attn_ms; }
void tr_model_reset_timers(tr_model *m) { m->attn_ms = 0.0; }

const tr_param *tr_model_find(const tr_model *m, const char *name)
{
    for (int i = 0; i < m->ntensors; i++)
        if (!strcmp(m->tensors[i].name, name))
            return &m->tensors[i];
    return NULL;
}

void tr_model_set_attention(tr_model *m, tr_attn_mode mode, double topk, double topp)
{
    m->mode = mode;
    m->topk = mode == TR_ATTN_TOPP ? 0.0 : topk;
    m->topp = mode == TR_ATTN_TOPK ? 0.0 : topp;
    m->masks_valid = 0;
}

void tr_model_freeze_masks(tr_model *m, int frozen) { m->frozen = frozen; }

void tr_model_init(tr_model *m, uint64_t seed)
{
    uint64_t s = tr_mix(seed ^ 0x5eed1417ull);
    memset(m->params, 0, m->nparams * sizeof(float));
    for (int i = 0; i < m->ntensors; i++) {
        const tr_param *p = &m->tensors[i];
        float *w = m->params + p->offset;
        int zero = strstr(p->name, "adaLN") || strstr(p->name, "final.linear");
        if (p->ndim == 1 || zero)
            continue; /* biases, adaLN modulations and the final linear start at zero (adaLN-Zero) */
        if (!strcmp(p->name, "y_embedder.weight") || strstr(p->name, "t_embedder")) {
            for (size_t j = 0; j < p->size; j++)
                w[j] = (float)(0.02 * tr_normal(&s));
        } else {
            double a = sqrt(6.0 / (double)(p->shape[0] + p->shape[1])); /* Xavier uniform */
            for (size_t j = 0; j < p->size; j++)
                w[j] = (float)(a * (2.0 * tr_uniform(&s) - 1.0));
        }
    }
}

/* ---------------------------------------------------------------- small kernels */

/* h = xhat·(1 + scale[b]) + shift[b]; shift/scale are chunks of mod rows of stride ms. */
static void modulate_forward(float *h, const float *xhat, const float *shift, const float *scale, int ms, int B, int N,
                             int d)
{
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            size_t r = ((size_t)b * N + n) * d;
            for (int i = 0; i < d; i++)
                h[r + i] = xhat[r + i] * (1.0f + scale[(size_t)b * ms + i]) + shift[(size_t)b * ms + i];
        }
}

/* dxhat = dh·(1 + scale) (overwritten); dshift += Σ_n dh; dscale += Σ_n dh·xhat. */
static void modulate_backward(float *dxhat, float *dshift, float *dscale, const float *dh, const float *xhat,
                              const float *scale, int ms, int B, int N, int d)
{
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            size_t r = ((size_t)b * N + n) * d;
            for (int i = 0; i < d; i++) {
                dxhat[r + i] = dh[r + i] * (1.0f + scale[(size_t)b * ms + i]);
                dshift[(size_t)b * ms + i] += dh[r + i];
                dscale[(size_t)b * ms + i] += dh[r + i] * xhat[r + i];
            }
        }
}

/* out = in + gate[b]·y */
static void gated_add(float *out, const float *in, const float *gate, const float *y, int ms, int B, int N, int d)
{
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            size_t r = ((size_t)b * N + n) * d;
            for (int i = 0; i < d; i++)
                out[r + i] = in[r + i] + gate[(size_t)b * ms + i] * y[r + i];
        }
}

/* dy = dout·gate (overwritten); dgate += Σ_n dout·y. */
static void gated_add_backward(float *dy, float *dgate, const float *dout, const float *gate, const float *y, int ms,
                               int B, int N, int d)
{
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            size_t r = ((size_t)b * N + n) * d;
            for (int i = 0; i < d; i++) {
                dy[r + i] = dout[r + i] * gate[(size_t)b * ms + i];
                dgate[(size_t)b * ms + i] += dout[r + i] * y[r + i];
            }
        }
}

/* video [B,T,H,W,C] <-> tokens [B,N,P]: token (b, t, y, x) holds the 2x2 patch at (2y, 2x) of frame t,
 * its values in (py, px, c) order. A permutation: unpatchify is also patchify's adjoint. */
static void patch_indices(const tr_dims *d, size_t token, size_t *video_offsets)
{
    size_t x = token % d->Wp, y = token / d->Wp % d->Hp, bt = token / ((size_t)d->Wp * d->Hp); /* bt = b*T + t */
    for (int py = 0; py < 2; py++)
        for (int px = 0; px < 2; px++)
            video_offsets[py * 2 + px] = ((bt * d->H + 2 * y + py) * d->W + 2 * x + px) * d->C;
}

static void patchify(const tr_dims *d, const float *video, float *tokens)
{
    for (size_t tok = 0; tok < (size_t)d->B * d->N; tok++) {
        size_t off[4];
        patch_indices(d, tok, off);
        for (int q = 0; q < 4; q++)
            memcpy(tokens + tok * d->P + q * d->C, video + off[q], (size_t)d->C * sizeof(float));
    }
}

static void unpatchify(const tr_dims *d, const float *tokens, float *video)
{
    for (size_t tok = 0; tok < (size_t)d->B * d->N; tok++) {
        size_t off[4];
        patch_indices(d, tok, off);
        for (int q = 0; q < 4; q++)
            memcpy(video + off[q], tokens + tok * d->P + q * d->C, (size_t)d->C * sizeof(float));
    }
}

/* ---------------------------------------------------------------- attention through sparge */

/* Q, K, V as BNHD views inside a [B, N, 3, heads, hd] buffer. */
static void qkv_views(const tr_dims *d, float *qkv, sparge_tensor *q, sparge_tensor *k, sparge_tensor *v)
{
    sparge_tensor *t[3] = {q, k, v};
    for (int i = 0; i < 3; i++) {
        t[i]->data = qkv + (size_t)i * d->d;
        t[i]->dtype = SPARGE_F32;
        t[i]->shape[0] = d->B, t[i]->shape[1] = d->nh, t[i]->shape[2] = d->N, t[i]->shape[3] = d->hd;
        t[i]->stride[0] = (int64_t)d->N * 3 * d->d, t[i]->stride[1] = d->hd, t[i]->stride[2] = 3 * d->d;
        t[i]->stride[3] = 1;
    }
}

static int attention_forward(tr_model *m, int l, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    block_acts *a = &m->ba[l];
    size_t BN = (size_t)d->B * d->N;
    float *qkv = a->qkv, *att = a->att, *lse = a->lse;
    sparge_status s;
    double t0 = exp_now();
    if (!m->host_resident) {
        qkv = m->dev_qkv, att = m->dev_att, lse = m->dev_lse;
        if ((s = sparge_memcpy_to_device(m->dev, qkv, a->qkv, BN * 3 * d->d * sizeof(float))))
            return sparge_failed(s, err, err_len, "attention: upload");
    }
    sparge_tensor q, k, v;
    qkv_views(d, qkv, &q, &k, &v);
    sparge_tensor o = sparge_tensor_bnhd(att, SPARGE_F32, d->B, d->nh, d->N, d->hd);
    sparge_mask *mask = NULL;
    if (m->mode != TR_ATTN_DENSE) {
        mask = m->masks[l];
        if (!m->frozen || !m->masks_valid) {
            sparge_mask_params mp = {m->block_q, m->block_k, m->topk, m->topp, 0.0f};
            if ((s = sparge_mask_predict(m->dev, &q, &k, &mp, mask)))
                return sparge_failed(s, err, err_len, "attention: mask prediction");
        }
        sparge_mask_stats st;
        if ((s = sparge_mask_get_stats(mask, &st, NULL, NULL)))
            return sparge_failed(s, err, err_len, "attention: mask statistics");
        m->last_sparsity += st.sparsity / d->L;
    }
    sparge_attn_params ap = {0.0f, 1};
    if ((s = sparge_attention_forward(m->dev, &q, &k, &v, mask, &ap, &o, lse)))
        return sparge_failed(s, err, err_len, "attention: forward");
    if (!m->host_resident) {
        if ((s = sparge_memcpy_to_host(m->dev, a->att, att, BN * d->d * sizeof(float))) ||
            (s = sparge_memcpy_to_host(m->dev, a->lse, lse, (size_t)d->B * d->nh * d->N * sizeof(float))))
            return sparge_failed(s, err, err_len, "attention: download");
    }
    m->attn_ms += 1e3 * (exp_now() - t0);
    if (mask && m->measure_error) { /* dense output into the backward's dO scratch, unused until then */
        float *dense = m->host_resident ? m->datt : m->dev_datt;
        sparge_tensor od = sparge_tensor_bnhd(dense, SPARGE_F32, d->B, d->nh, d->N, d->hd);
        if ((s = sparge_attention_forward(m->dev, &q, &k, &v, NULL, &ap, &od, NULL)))
            return sparge_failed(s, err, err_len, "attention: dense reference");
        if (!m->host_resident && (s = sparge_memcpy_to_host(m->dev, m->datt, dense, BN * d->d * sizeof(float))))
            return sparge_failed(s, err, err_len, "attention: download");
        double diff = 0, ref = 0;
        for (size_t i = 0; i < BN * d->d; i++) {
            diff += fabs((double)a->att[i] - m->datt[i]);
            ref += fabs((double)m->datt[i]);
        }
        m->last_l1 += (ref > 0 ? diff / ref : 0) / d->L;
    }
    return 0;
}

/* m->dqkv = gradient of Q, K, V given m->datt, with the forward's mask held fixed. */
static int attention_backward(tr_model *m, int l, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    block_acts *a = &m->ba[l];
    size_t BN = (size_t)d->B * d->N;
    float *qkv = a->qkv, *att = a->att, *lse = a->lse, *datt = m->datt, *dqkv = m->dqkv;
    sparge_status s;
    double t0 = exp_now();
    if (!m->host_resident) {
        qkv = m->dev_qkv, att = m->dev_att, lse = m->dev_lse, datt = m->dev_datt, dqkv = m->dev_dqkv;
        if ((s = sparge_memcpy_to_device(m->dev, qkv, a->qkv, BN * 3 * d->d * sizeof(float))) ||
            (s = sparge_memcpy_to_device(m->dev, att, a->att, BN * d->d * sizeof(float))) ||
            (s = sparge_memcpy_to_device(m->dev, lse, a->lse, (size_t)d->B * d->nh * d->N * sizeof(float))) ||
            (s = sparge_memcpy_to_device(m->dev, datt, m->datt, BN * d->d * sizeof(float))))
            return sparge_failed(s, err, err_len, "attention backward: upload");
    }
    sparge_tensor q, k, v, dq, dk, dv;
    qkv_views(d, qkv, &q, &k, &v);
    qkv_views(d, dqkv, &dq, &dk, &dv);
    sparge_tensor o = sparge_tensor_bnhd(att, SPARGE_F32, d->B, d->nh, d->N, d->hd);
    sparge_tensor d_o = sparge_tensor_bnhd(datt, SPARGE_F32, d->B, d->nh, d->N, d->hd);
    sparge_attn_params ap = {0.0f, 1};
    const sparge_mask *mask = m->mode == TR_ATTN_DENSE ? NULL : m->masks[l];
    if ((s = sparge_attention_backward(m->dev, &q, &k, &v, &o, &d_o, lse, mask, &ap, &dq, &dk, &dv)))
        return sparge_failed(s, err, err_len, "attention: backward");
    if (!m->host_resident && (s = sparge_memcpy_to_host(m->dev, m->dqkv, dqkv, BN * 3 * d->d * sizeof(float))))
        return sparge_failed(s, err, err_len, "attention backward: download");
    m->attn_ms += 1e3 * (exp_now() - t0);
    return 0;
}

/* ---------------------------------------------------------------- forward */

int tr_model_forward(tr_model *m, const float *x, const float *t, const int *y, float *u, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    const int B = d->B, N = d->N, D = d->d, BN = B * N;
    for (int b = 0; b < B; b++) {
        if (y[b] < 0 || y[b] >= d->K)
            return exp_fail(err, err_len, "forward: class %d of sample %d is outside [0, %d)", y[b], b, d->K);
        m->y[b] = y[b];
    }
    /* conditioning: c = MLP(sinusoid(1000 t)) + y_embedding[y] */
    int half = d->F / 2;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < half; i++) {
            double arg = 1000.0 * t[b] * exp(-log(10000.0) * i / half);
            m->tfreq[(size_t)b * d->F + i] = (float)cos(arg);
            m->tfreq[(size_t)b * d->F + half + i] = (float)sin(arg);
        }
    tr_linear_forward(m->th, m->tfreq, m->t_w1, m->t_b1, B, d->F, D);
    for (int i = 0; i < B * D; i++)
        m->ths[i] = tr_silu(m->th[i]);
    tr_linear_forward(m->c, m->ths, m->t_w2, m->t_b2, B, D, D);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < D; i++) {
            m->c[(size_t)b * D + i] += m->y_emb[(size_t)y[b] * D + i];
            m->cs[(size_t)b * D + i] = tr_silu(m->c[(size_t)b * D + i]);
        }
    /* tokens */
    patchify(d, x, m->xp);
    float *x0 = d->L ? m->ba[0].x_in : m->x_final;
    tr_linear_forward(x0, m->xp, m->x_emb_w, m->x_emb_b, BN, d->P, D);
    for (int b = 0; b < B; b++)
        for (size_t i = 0; i < (size_t)N * D; i++)
            x0[(size_t)b * N * D + i] += m->pos[i];
    m->last_sparsity = m->last_l1 = 0.0;
    for (int l = 0; l < d->L; l++) {
        block_params *p = &m->blk[l];
        block_acts *a = &m->ba[l];
        float *x_out = l + 1 < d->L ? m->ba[l + 1].x_in : m->x_final;
        const int ms = 6 * D;
        tr_linear_forward(a->mod, m->cs, p->ada_w, p->ada_b, B, D, 6 * D);
        tr_layernorm_forward(a->xhat1, a->rstd1, a->x_in, BN, D);
        modulate_forward(a->h1, a->xhat1, a->mod, a->mod + D, ms, B, N, D);
        tr_linear_forward(a->qkv, a->h1, p->qkv_w, p->qkv_b, BN, D, 3 * D);
        if (attention_forward(m, l, err, err_len))
            return -1;
        tr_linear_forward(a->proj, a->att, p->proj_w, p->proj_b, BN, D, D);
        gated_add(a->x_mid, a->x_in, a->mod + 2 * D, a->proj, ms, B, N, D);
        tr_layernorm_forward(a->xhat2, a->rstd2, a->x_mid, BN, D);
        modulate_forward(a->h2, a->xhat2, a->mod + 3 * D, a->mod + 4 * D, ms, B, N, D);
        tr_linear_forward(a->fc1, a->h2, p->fc1_w, p->fc1_b, BN, D, d->M);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < (int64_t)BN * d->M; i++)
            a->gelu[i] = tr_gelu(a->fc1[i]);
        tr_linear_forward(a->fc2, a->gelu, p->fc2_w, p->fc2_b, BN, d->M, D);
        gated_add(x_out, a->x_mid, a->mod + 5 * D, a->fc2, ms, B, N, D);
    }
    if (m->mode != TR_ATTN_DENSE)
        m->masks_valid = 1;
    tr_linear_forward(m->fmod, m->cs, m->f_ada_w, m->f_ada_b, B, D, 2 * D);
    tr_layernorm_forward(m->xhatf, m->rstdf, m->x_final, BN, D);
    modulate_forward(m->hf, m->xhatf, m->fmod, m->fmod + D, 2 * D, B, N, D);
    tr_linear_forward(m->out, m->hf, m->f_w, m->f_b, BN, D, d->P);
    unpatchify(d, m->out, u);
    return 0;
}

/* ---------------------------------------------------------------- backward */

int tr_model_backward(tr_model *m, const float *du, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    const int B = d->B, N = d->N, D = d->d, BN = B * N;
    patchify(d, du, m->dout);
    /* final layer */
    tr_linear_backward(m->dbuf, G(m, m->f_w), G(m, m->f_b), m->dout, m->hf, m->f_w, BN, D, d->P, 0);
    memset(m->dmod, 0, (size_t)B * 2 * D * sizeof(float));
    modulate_backward(m->dbuf2, m->dmod, m->dmod + D, m->dbuf, m->xhatf, m->fmod + D, 2 * D, B, N, D);
    memset(m->dres, 0, (size_t)BN * D * sizeof(float));
    tr_layernorm_backward(m->dres, m->dbuf2, m->xhatf, m->rstdf, BN, D);
    tr_linear_backward(m->dcs, G(m, m->f_ada_w), G(m, m->f_ada_b), m->dmod, m->cs, m->f_ada_w, B, D, 2 * D, 0);
    /* blocks, last first; m->dres holds dLoss/d(block output) */
    for (int l = d->L - 1; l >= 0; l--) {
        block_params *p = &m->blk[l];
        block_acts *a = &m->ba[l];
        const int ms = 6 * D;
        memset(m->dmod, 0, (size_t)B * ms * sizeof(float));
        /* x_out = x_mid + gate2·fc2: dres stays as d(x_mid) */
        gated_add_backward(m->dbuf, m->dmod + 5 * D, m->dres, a->mod + 5 * D, a->fc2, ms, B, N, D);
        tr_linear_backward(m->dfc, G(m, p->fc2_w), G(m, p->fc2_b), m->dbuf, a->gelu, p->fc2_w, BN, d->M, D, 0);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < (int64_t)BN * d->M; i++)
            m->dfc[i] *= tr_gelu_grad(a->fc1[i]);
        tr_linear_backward(m->dbuf, G(m, p->fc1_w), G(m, p->fc1_b), m->dfc, a->h2, p->fc1_w, BN, D, d->M, 0);
        modulate_backward(m->dbuf2, m->dmod + 3 * D, m->dmod + 4 * D, m->dbuf, a->xhat2, a->mod + 4 * D, ms, B, N, D);
        tr_layernorm_backward(m->dres, m->dbuf2, a->xhat2, a->rstd2, BN, D);
        /* x_mid = x_in + gate1·proj: dres stays as d(x_in) */
        gated_add_backward(m->dbuf, m->dmod + 2 * D, m->dres, a->mod + 2 * D, a->proj, ms, B, N, D);
        tr_linear_backward(m->datt, G(m, p->proj_w), G(m, p->proj_b), m->dbuf, a->att, p->proj_w, BN, D, D, 0);
        if (attention_backward(m, l, err, err_len))
            return -1;
        tr_linear_backward(m->dbuf, G(m, p->qkv_w), G(m, p->qkv_b), m->dqkv, a->h1, p->qkv_w, BN, D, 3 * D, 0);
        modulate_backward(m->dbuf2, m->dmod, m->dmod + D, m->dbuf, a->xhat1, a->mod + D, ms, B, N, D);
        tr_layernorm_backward(m->dres, m->dbuf2, a->xhat1, a->rstd1, BN, D);
        tr_linear_backward(m->dcs, G(m, p->ada_w), G(m, p->ada_b), m->dmod, m->cs, p->ada_w, B, D, ms, 1);
    }
    /* patch embedding (the positional encoding is fixed) */
    tr_linear_backward(NULL, G(m, m->x_emb_w), G(m, m->x_emb_b), m->dres, m->xp, m->x_emb_w, BN, d->P, D, 0);
    /* conditioning: c = t_mlp + y_emb */
    for (int i = 0; i < B * D; i++)
        m->dcs[i] *= tr_silu_grad(m->c[i]);
    float *gy = G(m, m->y_emb);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < D; i++)
            gy[(size_t)m->y[b] * D + i] += m->dcs[(size_t)b * D + i];
    tr_linear_backward(m->dtmp, G(m, m->t_w2), G(m, m->t_b2), m->dcs, m->ths, m->t_w2, B, D, D, 0);
    for (int i = 0; i < B * D; i++)
        m->dtmp[i] *= tr_silu_grad(m->th[i]);
    tr_linear_backward(NULL, G(m, m->t_w1), G(m, m->t_b1), m->dtmp, m->tfreq, m->t_w1, B, d->F, D, 0);
    return 0;
}
