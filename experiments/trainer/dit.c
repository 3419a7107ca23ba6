/* The video DiT: parameters, forward and backward by hand (llm.c-style).
 *
 * Per block (pre-norm, adaLN-Zero; mod = Linear(SiLU(c)) split into shift1, scale1, gate1,
 * shift2, scale2, gate2):
 *   x ← x + gate1 · proj(attn(qkv(LN(x)·(1+scale1)+shift1)))
 *   x ← x + gate2 · fc2(GELU(fc1(LN(x)·(1+scale2)+shift2)))
 * Attention runs through sparge on Q/K/V viewed in place inside the qkv activation
 * ([B, N, 3, heads, hd] = BNHD views with token stride 3·dim), no copies. Every other operation
 * goes through the model's ops table (ops.h): the host's, or CUDA's when the device is a CUDA GPU
 * and device_ops is on; parameters, gradients and activations live in that table's memory. */
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
    uint16_t *qkv16, *att16; /* attn_dtype=bf16: what the attention reads and writes */
} block_acts;

struct tr_model {
    tr_dims dm;
    tr_ops *ops; /* owned; every array below is its memory */
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
    float *video, *tbuf, *velocity, *dvelocity, *target; /* batch in, u out, dLoss/du, loss target */
    int *ybuf;
    float *pos, *xp, *tfreq, *th, *ths, *c, *cs, *x_final, *fmod, *xhatf, *rstdf, *hf, *out;
    block_acts ba[TR_MAX_DEPTH];
    /* backward scratch */
    float *dres, *dbuf, *dbuf2, *dqkv, *datt, *dfc, *dfc2, *dmod, *dcs, *dtmp, *dout;
    uint16_t *dqkv16, *datt16;
    int bf16; /* attention in bf16 (attn_dtype) */
    /* attention on a sparge device */
    sparge_device *dev;
    int staged; /* host ops with attention on another device (or stage_attention): copies through buffers */
    float *dev_qkv, *dev_att, *dev_lse, *dev_dqkv, *dev_datt; /* the staging buffers */
    sparge_mask *masks[TR_MAX_DEPTH];
    tr_attn_mode mode;
    double topk, topp;
    int frozen, masks_valid, measure_error;
    double last_sparsity, last_l1;
    int adaln_single;
    /* tr_model_set_qkv_hook */
    tr_qkv_hook hook;
    void *hook_ctx;
    float *hook_buf; /* host copy of one layer's qkv activation */
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
    if (m->adaln_single) /* one weight for every block's modulation; the biases stay per block */
        add_tensor(m, "adaLN_single.weight", 6 * d->d, d->d, 1);
    for (int l = 0; l < d->L; l++) {
        snprintf(pre, sizeof pre, "blocks.%d.adaLN", l);
        if (m->adaln_single) {
            char name[64];
            snprintf(name, sizeof name, "%s.bias", pre);
            add_tensor(m, name, 6 * d->d, 0, 0);
        } else
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
    float *shared = m->adaln_single ? P(m, &i) : NULL;
    for (int l = 0; l < m->dm.L; l++) {
        block_params *b = &m->blk[l];
        b->ada_w = shared ? shared : P(m, &i);
        b->ada_b = P(m, &i), b->qkv_w = P(m, &i), b->qkv_b = P(m, &i);
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
#define TAKE16(ptr, n) /* n bf16 values in float slots, only for attn_dtype=bf16 */                             \
    do {                                                                                                       \
        float *f_ = NULL;                                                                                      \
        TAKE(f_, m->bf16 ? ((size_t)(n) + 1) / 2 : 0);                                                         \
        (ptr) = (uint16_t *)f_;                                                                                \
    } while (0)
    size_t video = (size_t)d->B * d->T * d->H * d->W * d->C;
    TAKE(m->video, video);
    TAKE(m->velocity, video);
    TAKE(m->dvelocity, video);
    TAKE(m->target, video);
    TAKE(m->tbuf, d->B);
    float *ybuf = NULL;
    TAKE(ybuf, d->B);
    m->ybuf = (int *)ybuf;
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
        TAKE16(a->qkv16, BN * 3 * d->d);
        TAKE16(a->att16, BN * d->d);
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
    TAKE16(m->dqkv16, BN * 3 * d->d);
    TAKE16(m->datt16, BN * d->d);
#undef TAKE16
#undef TAKE
    return off;
}

/* Sinusoids of the token's frame, row and column in three slices of the width, into host pos[N, d]. */
static void positional_encoding(const tr_dims *d, float *pos)
{
    int ds = 2 * (d->d / 6), dt = d->d - 2 * ds; /* slices for (t) and (y), (x); each even */
    for (int t = 0; t < d->T; t++)
        for (int y = 0; y < d->Hp; y++)
            for (int x = 0; x < d->Wp; x++) {
                float *pe = pos + ((size_t)(t * d->Hp + y) * d->Wp + x) * d->d;
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

/* The ops table for config c on dev: CUDA's when asked for (device_ops) on a CUDA device and built. */
static tr_ops *create_ops(const tr_config *c, sparge_device *dev, char *err, size_t err_len)
{
    const char *backend = sparge_device_backend(dev);
    int cuda = !strcmp(backend, "cuda") || !strcmp(backend, "cuda-generic");
#ifdef SPARGE_TRAINER_CUDA
    if (c->device_ops && cuda) {
        const char *colon = strchr(sparge_device_name(dev), ':');
        return tr_ops_cuda_create(colon ? atoi(colon + 1) : 0, c->tf32, err, err_len);
    }
#else
    (void)c, (void)cuda;
#endif
    tr_ops *ops = tr_ops_cpu_create();
    if (!ops)
        exp_fail(err, err_len, "model: out of memory");
    return ops;
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
    m->bf16 = !strcmp(c->attn_dtype, "bf16");
    m->adaln_single = c->adaln_single;
    m->dev = dev;
    if (!(m->ops = create_ops(c, dev, err, err_len))) {
        free(m);
        return NULL;
    }
    const char *backend = sparge_device_backend(dev);
    int host_device = !strcmp(backend, "cpu") || !strcmp(backend, "cpu-ref");
    m->staged = !strcmp(m->ops->name, "host") && (!host_device || c->stage_attention);
    build_layout(m);
    size_t nacts = carve(m, NULL);
    float *pos = malloc((size_t)d->N * d->d * sizeof(float));
    m->params = m->ops->alloc(m->ops, m->nparams * sizeof(float));
    m->grads = m->ops->alloc(m->ops, m->nparams * sizeof(float));
    m->acts = m->ops->alloc(m->ops, nacts * sizeof(float));
    if (!pos || !m->params || !m->grads || !m->acts) {
        if (m->ops->error(m->ops, err, err_len) == 0)
            exp_fail(err, err_len, "model: out of memory (%zu parameters, %zu activation floats)", m->nparams, nacts);
        free(pos);
        tr_model_free(m);
        return NULL;
    }
    bind_params(m);
    carve(m, m->acts);
    positional_encoding(d, pos);
    m->ops->upload(m->ops, m->pos, pos, (size_t)d->N * d->d * sizeof(float));
    free(pos);
    if (m->ops->error(m->ops, err, err_len)) {
        tr_model_free(m);
        return NULL;
    }
    size_t BN = (size_t)B * d->N;
    if (m->staged) {
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
    free(m->hook_buf);
    if (m->ops) {
        float *owned[3] = {m->params, m->grads, m->acts};
        for (int i = 0; i < 3; i++)
            if (owned[i])
                m->ops->release(m->ops, owned[i]);
        m->ops->destroy(m->ops);
    }
    free(m);
}

const tr_dims *tr_model_dims(const tr_model *m) { return &m->dm; }
size_t tr_model_num_params(const tr_model *m) { return m->nparams; }
int tr_model_num_tensors(const tr_model *m) { return m->ntensors; }
const tr_param *tr_model_tensor(const tr_model *m, int i) { return &m->tensors[i]; }
tr_ops *tr_model_ops(tr_model *m) { return m->ops; }
float *tr_model_params(tr_model *m) { return m->params; }
float *tr_model_grads(tr_model *m) { return m->grads; }
const float *tr_model_velocity(const tr_model *m) { return m->velocity; }
void tr_model_zero_grad(tr_model *m)
{
    m->ops->zero(m->ops, m->grads, m->nparams * sizeof(float));
    m->ops->mark(m->ops, TR_PART_IDLE);
}
double tr_model_last_sparsity(const tr_model *m) { return m->last_sparsity; }
double tr_model_last_attention_l1(const tr_model *m) { return m->last_l1; }
void tr_model_measure_attention_error(tr_model *m, int on) { m->measure_error = on; }
void tr_model_times(tr_model *m, double ms[TR_PARTS]) { m->ops->times(m->ops, ms); }

int tr_model_get_params(tr_model *m, float *host, char *err, size_t err_len)
{
    m->ops->download(m->ops, host, m->params, m->nparams * sizeof(float));
    return m->ops->error(m->ops, err, err_len);
}

int tr_model_set_params(tr_model *m, const float *host, char *err, size_t err_len)
{
    m->ops->upload(m->ops, m->params, host, m->nparams * sizeof(float));
    return m->ops->error(m->ops, err, err_len);
}

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

void tr_model_set_qkv_hook(tr_model *m, tr_qkv_hook hook, void *ctx)
{
    m->hook = hook;
    m->hook_ctx = ctx;
}

int tr_model_mask_dense(const tr_model *m, int layer, uint8_t *host, char *err, size_t err_len)
{
    if (layer < 0 || layer >= m->dm.L || m->mode == TR_ATTN_DENSE || !m->masks_valid)
        return exp_fail(err, err_len, "mask of layer %d: none predicted", layer);
    sparge_status s = sparge_mask_get_dense(m->masks[layer], host);
    return s ? sparge_failed(s, err, err_len, "mask") : 0;
}

int tr_model_init(tr_model *m, uint64_t seed, char *err, size_t err_len)
{
    float *host = calloc(m->nparams, sizeof(float));
    if (!host)
        return exp_fail(err, err_len, "init: out of memory");
    uint64_t s = tr_mix(seed ^ 0x5eed1417ull);
    for (int i = 0; i < m->ntensors; i++) {
        const tr_param *p = &m->tensors[i];
        float *w = host + p->offset;
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
    int rc = tr_model_set_params(m, host, err, err_len);
    free(host);
    return rc;
}

/* The end of a call of the model: its timers stop counting until the next, and its first failure is reported. */
static int finish(tr_model *m, char *err, size_t err_len)
{
    m->ops->mark(m->ops, TR_PART_IDLE);
    return m->ops->error(m->ops, err, err_len);
}

/* ---------------------------------------------------------------- attention through sparge */

/* Q, K, V as BNHD views inside a [B, N, 3, heads, hd] buffer of the attention's dtype. */
static void qkv_views(const tr_model *m, void *qkv, sparge_tensor *q, sparge_tensor *k, sparge_tensor *v)
{
    const tr_dims *d = &m->dm;
    sparge_tensor *t[3] = {q, k, v};
    for (int i = 0; i < 3; i++) {
        t[i]->data = (char *)qkv + (size_t)i * d->d * (m->bf16 ? 2 : 4);
        t[i]->dtype = m->bf16 ? SPARGE_BF16 : SPARGE_F32;
        t[i]->shape[0] = d->B, t[i]->shape[1] = d->nh, t[i]->shape[2] = d->N, t[i]->shape[3] = d->hd;
        t[i]->stride[0] = (int64_t)d->N * 3 * d->d, t[i]->stride[1] = d->hd, t[i]->stride[2] = 3 * d->d;
        t[i]->stride[3] = 1;
    }
}

static int attention_forward(tr_model *m, int l, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    block_acts *a = &m->ba[l];
    tr_ops *o = m->ops;
    const size_t BN = (size_t)d->B * d->N, es = m->bf16 ? 2 : 4;
    const sparge_dtype dt = m->bf16 ? SPARGE_BF16 : SPARGE_F32;
    void *qkv = a->qkv, *att = a->att;
    float *lse = a->lse;
    sparge_status s;
    if (m->bf16) {
        o->to_bf16(o, a->qkv16, a->qkv, BN * 3 * d->d);
        qkv = a->qkv16, att = a->att16;
    }
    o->mark(o, TR_PART_ATTENTION);
    void *host_att = att;
    if (m->staged) {
        if ((s = sparge_memcpy_to_device(m->dev, m->dev_qkv, qkv, BN * 3 * d->d * es)))
            return sparge_failed(s, err, err_len, "attention: upload");
        qkv = m->dev_qkv, att = m->dev_att, lse = m->dev_lse;
    }
    sparge_tensor q, k, v;
    qkv_views(m, qkv, &q, &k, &v);
    sparge_tensor out = sparge_tensor_bnhd(att, dt, d->B, d->nh, d->N, d->hd);
    sparge_mask *mask = NULL;
    if (m->mode != TR_ATTN_DENSE) {
        mask = m->masks[l];
        if (!m->frozen || !m->masks_valid) {
            sparge_mask_params mp = {m->block_q, m->block_k, m->topk, m->topp, 0.0f, 0};
            if ((s = sparge_mask_predict(m->dev, &q, &k, &mp, mask)))
                return sparge_failed(s, err, err_len, "attention: mask prediction");
        }
    }
    sparge_attn_params ap = {0.0f, 1, 0};
    if ((s = sparge_attention_forward(m->dev, &q, &k, &v, mask, &ap, &out, lse)))
        return sparge_failed(s, err, err_len, "attention: forward");
    if (m->staged) {
        if ((s = sparge_memcpy_to_host(m->dev, host_att, att, BN * d->d * es)) ||
            (s = sparge_memcpy_to_host(m->dev, a->lse, lse, (size_t)d->B * d->nh * d->N * sizeof(float))))
            return sparge_failed(s, err, err_len, "attention: download");
    }
    if (m->bf16)
        o->from_bf16(o, a->att, a->att16, BN * d->d);
    if (mask && m->measure_error) { /* dense output into the backward's dO scratch, unused until then */
        void *host_dense = m->bf16 ? (void *)m->datt16 : m->datt, *dense = m->staged ? m->dev_datt : host_dense;
        sparge_tensor od = sparge_tensor_bnhd(dense, dt, d->B, d->nh, d->N, d->hd);
        if ((s = sparge_attention_forward(m->dev, &q, &k, &v, NULL, &ap, &od, NULL)))
            return sparge_failed(s, err, err_len, "attention: dense reference");
        if (m->staged && (s = sparge_memcpy_to_host(m->dev, host_dense, dense, BN * d->d * es)))
            return sparge_failed(s, err, err_len, "attention: download");
        if (m->bf16)
            o->from_bf16(o, m->datt, m->datt16, BN * d->d);
        double diff, ref;
        o->abs_diff_sums(o, a->att, m->datt, BN * d->d, &diff, &ref);
        m->last_l1 += (ref > 0 ? diff / ref : 0) / d->L;
    }
    return 0;
}

/* m->dqkv = gradient of Q, K, V given m->datt, with the forward's mask held fixed. */
static int attention_backward(tr_model *m, int l, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    block_acts *a = &m->ba[l];
    tr_ops *o = m->ops;
    const size_t BN = (size_t)d->B * d->N, es = m->bf16 ? 2 : 4;
    const sparge_dtype dt = m->bf16 ? SPARGE_BF16 : SPARGE_F32;
    void *qkv = a->qkv, *att = a->att, *datt = m->datt, *dqkv = m->dqkv;
    float *lse = a->lse;
    sparge_status s;
    if (m->bf16) {
        o->to_bf16(o, m->datt16, m->datt, BN * d->d);
        qkv = a->qkv16, att = a->att16, datt = m->datt16, dqkv = m->dqkv16;
    }
    o->mark(o, TR_PART_ATTENTION);
    void *host_dqkv = dqkv;
    if (m->staged) {
        if ((s = sparge_memcpy_to_device(m->dev, m->dev_qkv, qkv, BN * 3 * d->d * es)) ||
            (s = sparge_memcpy_to_device(m->dev, m->dev_att, att, BN * d->d * es)) ||
            (s = sparge_memcpy_to_device(m->dev, m->dev_lse, lse, (size_t)d->B * d->nh * d->N * sizeof(float))) ||
            (s = sparge_memcpy_to_device(m->dev, m->dev_datt, datt, BN * d->d * es)))
            return sparge_failed(s, err, err_len, "attention backward: upload");
        qkv = m->dev_qkv, att = m->dev_att, lse = m->dev_lse, datt = m->dev_datt, dqkv = m->dev_dqkv;
    }
    sparge_tensor q, k, v, dq, dk, dv;
    qkv_views(m, qkv, &q, &k, &v);
    qkv_views(m, dqkv, &dq, &dk, &dv);
    sparge_tensor out = sparge_tensor_bnhd(att, dt, d->B, d->nh, d->N, d->hd);
    sparge_tensor d_out = sparge_tensor_bnhd(datt, dt, d->B, d->nh, d->N, d->hd);
    sparge_attn_params ap = {0.0f, 1, 0};
    const sparge_mask *mask = m->mode == TR_ATTN_DENSE ? NULL : m->masks[l];
    if ((s = sparge_attention_backward(m->dev, &q, &k, &v, &out, &d_out, lse, mask, &ap, &dq, &dk, &dv)))
        return sparge_failed(s, err, err_len, "attention: backward");
    if (m->staged && (s = sparge_memcpy_to_host(m->dev, host_dqkv, dqkv, BN * 3 * d->d * es)))
        return sparge_failed(s, err, err_len, "attention backward: download");
    if (m->bf16)
        o->from_bf16(o, m->dqkv, m->dqkv16, BN * 3 * d->d);
    return 0;
}

/* ---------------------------------------------------------------- forward */

int tr_model_forward(tr_model *m, const float *x, const float *t, const int *y, float *u, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    const int B = d->B, N = d->N, D = d->d, BN = B * N;
    tr_ops *o = m->ops;
    size_t video = (size_t)B * d->T * d->H * d->W * d->C;
    for (int b = 0; b < B; b++)
        if (y[b] < 0 || y[b] >= d->K)
            return exp_fail(err, err_len, "forward: class %d of sample %d is outside [0, %d)", y[b], b, d->K);
    o->upload(o, m->ybuf, y, (size_t)B * sizeof(int));
    o->upload(o, m->tbuf, t, (size_t)B * sizeof(float));
    o->upload(o, m->video, x, video * sizeof(float));
    /* conditioning: c = MLP(sinusoid(1000 t)) + y_embedding[y] */
    o->timestep_embedding(o, m->tfreq, m->tbuf, B, d->F);
    o->linear_forward(o, m->th, m->tfreq, m->t_w1, m->t_b1, B, d->F, D);
    o->silu_forward(o, m->ths, m->th, (size_t)B * D);
    o->linear_forward(o, m->c, m->ths, m->t_w2, m->t_b2, B, D, D);
    o->class_embedding_forward(o, m->c, m->cs, m->y_emb, m->ybuf, B, D);
    /* tokens */
    o->patchify(o, m->xp, m->video, B, d->T, d->H, d->W, d->C);
    float *x0 = d->L ? m->ba[0].x_in : m->x_final;
    o->linear_forward(o, x0, m->xp, m->x_emb_w, m->x_emb_b, BN, d->P, D);
    o->add_positional(o, x0, m->pos, B, (size_t)N * D);
    m->last_sparsity = m->last_l1 = 0.0;
    for (int l = 0; l < d->L; l++) {
        block_params *p = &m->blk[l];
        block_acts *a = &m->ba[l];
        float *x_out = l + 1 < d->L ? m->ba[l + 1].x_in : m->x_final;
        const int ms = 6 * D;
        o->linear_forward(o, a->mod, m->cs, p->ada_w, p->ada_b, B, D, 6 * D);
        o->layernorm_forward(o, a->xhat1, a->rstd1, a->x_in, BN, D);
        o->modulate_forward(o, a->h1, a->xhat1, a->mod, a->mod + D, ms, B, N, D);
        o->linear_forward(o, a->qkv, a->h1, p->qkv_w, p->qkv_b, BN, D, 3 * D);
        if (o->error(o, err, err_len))
            return -1;
        if (m->hook) {
            size_t bytes = (size_t)BN * 3 * D * sizeof(float);
            if (!m->hook_buf && !(m->hook_buf = malloc(bytes)))
                return exp_fail(err, err_len, "forward: out of memory for the Q/K/V hook");
            o->download(o, m->hook_buf, a->qkv, bytes);
            if (o->error(o, err, err_len) || m->hook(m->hook_ctx, l, m->hook_buf, err, err_len))
                return -1;
        }
        if (attention_forward(m, l, err, err_len))
            return -1;
        o->linear_forward(o, a->proj, a->att, p->proj_w, p->proj_b, BN, D, D);
        o->gated_add(o, a->x_mid, a->x_in, a->mod + 2 * D, a->proj, ms, B, N, D);
        o->layernorm_forward(o, a->xhat2, a->rstd2, a->x_mid, BN, D);
        o->modulate_forward(o, a->h2, a->xhat2, a->mod + 3 * D, a->mod + 4 * D, ms, B, N, D);
        o->linear_forward(o, a->fc1, a->h2, p->fc1_w, p->fc1_b, BN, D, d->M);
        o->gelu_forward(o, a->gelu, a->fc1, (size_t)BN * d->M);
        o->linear_forward(o, a->fc2, a->gelu, p->fc2_w, p->fc2_b, BN, d->M, D);
        o->gated_add(o, x_out, a->x_mid, a->mod + 5 * D, a->fc2, ms, B, N, D);
    }
    if (m->mode != TR_ATTN_DENSE) {
        m->masks_valid = 1;
        /* after the blocks: reading the statistics waits for the device, once per forward */
        o->mark(o, TR_PART_ATTENTION);
        for (int l = 0; l < d->L; l++) {
            sparge_mask_stats st;
            sparge_status s = sparge_mask_get_stats(m->masks[l], &st, NULL, NULL);
            if (s)
                return sparge_failed(s, err, err_len, "attention: mask statistics");
            m->last_sparsity += st.sparsity / d->L;
        }
    }
    o->linear_forward(o, m->fmod, m->cs, m->f_ada_w, m->f_ada_b, B, D, 2 * D);
    o->layernorm_forward(o, m->xhatf, m->rstdf, m->x_final, BN, D);
    o->modulate_forward(o, m->hf, m->xhatf, m->fmod, m->fmod + D, 2 * D, B, N, D);
    o->linear_forward(o, m->out, m->hf, m->f_w, m->f_b, BN, D, d->P);
    o->unpatchify(o, m->velocity, m->out, B, d->T, d->H, d->W, d->C);
    if (u)
        o->download(o, u, m->velocity, video * sizeof(float));
    return finish(m, err, err_len);
}

int tr_model_loss(tr_model *m, const float *target, const tr_model *teacher, double *loss, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    tr_ops *o = m->ops;
    size_t video = (size_t)d->B * d->T * d->H * d->W * d->C;
    if (!target && (!teacher || strcmp(teacher->ops->name, o->name) || teacher->dm.B != d->B))
        return exp_fail(err, err_len, "loss: no target, or a teacher of another batch or memory");
    if (target)
        o->upload(o, m->target, target, video * sizeof(float));
    o->mse(o, m->dvelocity, m->velocity, target ? m->target : teacher->velocity, video, loss);
    return finish(m, err, err_len);
}

/* ---------------------------------------------------------------- backward */

int tr_model_backward(tr_model *m, const float *du, char *err, size_t err_len)
{
    const tr_dims *d = &m->dm;
    const int B = d->B, N = d->N, D = d->d, BN = B * N;
    tr_ops *o = m->ops;
    if (du)
        o->upload(o, m->dvelocity, du, (size_t)B * d->T * d->H * d->W * d->C * sizeof(float));
    o->patchify(o, m->dout, m->dvelocity, B, d->T, d->H, d->W, d->C);
    /* final layer */
    o->linear_backward(o, m->dbuf, G(m, m->f_w), G(m, m->f_b), m->dout, m->hf, m->f_w, BN, D, d->P, 0);
    o->zero(o, m->dmod, (size_t)B * 2 * D * sizeof(float));
    o->modulate_backward(o, m->dbuf2, m->dmod, m->dmod + D, m->dbuf, m->xhatf, m->fmod + D, 2 * D, B, N, D);
    o->zero(o, m->dres, (size_t)BN * D * sizeof(float));
    o->layernorm_backward(o, m->dres, m->dbuf2, m->xhatf, m->rstdf, BN, D);
    o->linear_backward(o, m->dcs, G(m, m->f_ada_w), G(m, m->f_ada_b), m->dmod, m->cs, m->f_ada_w, B, D, 2 * D, 0);
    /* blocks, last first; m->dres holds dLoss/d(block output) */
    for (int l = d->L - 1; l >= 0; l--) {
        block_params *p = &m->blk[l];
        block_acts *a = &m->ba[l];
        const int ms = 6 * D;
        o->zero(o, m->dmod, (size_t)B * ms * sizeof(float));
        /* x_out = x_mid + gate2·fc2: dres stays as d(x_mid) */
        o->gated_add_backward(o, m->dbuf, m->dmod + 5 * D, m->dres, a->mod + 5 * D, a->fc2, ms, B, N, D);
        o->linear_backward(o, m->dfc, G(m, p->fc2_w), G(m, p->fc2_b), m->dbuf, a->gelu, p->fc2_w, BN, d->M, D, 0);
        o->gelu_backward(o, m->dfc, a->fc1, (size_t)BN * d->M);
        o->linear_backward(o, m->dbuf, G(m, p->fc1_w), G(m, p->fc1_b), m->dfc, a->h2, p->fc1_w, BN, D, d->M, 0);
        o->modulate_backward(o, m->dbuf2, m->dmod + 3 * D, m->dmod + 4 * D, m->dbuf, a->xhat2, a->mod + 4 * D, ms, B,
                             N, D);
        o->layernorm_backward(o, m->dres, m->dbuf2, a->xhat2, a->rstd2, BN, D);
        /* x_mid = x_in + gate1·proj: dres stays as d(x_in) */
        o->gated_add_backward(o, m->dbuf, m->dmod + 2 * D, m->dres, a->mod + 2 * D, a->proj, ms, B, N, D);
        o->linear_backward(o, m->datt, G(m, p->proj_w), G(m, p->proj_b), m->dbuf, a->att, p->proj_w, BN, D, D, 0);
        if (o->error(o, err, err_len) || attention_backward(m, l, err, err_len))
            return -1;
        o->linear_backward(o, m->dbuf, G(m, p->qkv_w), G(m, p->qkv_b), m->dqkv, a->h1, p->qkv_w, BN, D, 3 * D, 0);
        o->modulate_backward(o, m->dbuf2, m->dmod, m->dmod + D, m->dbuf, a->xhat1, a->mod + D, ms, B, N, D);
        o->layernorm_backward(o, m->dres, m->dbuf2, a->xhat1, a->rstd1, BN, D);
        o->linear_backward(o, m->dcs, G(m, p->ada_w), G(m, p->ada_b), m->dmod, m->cs, p->ada_w, B, D, ms, 1);
    }
    /* patch embedding (the positional encoding is fixed) */
    o->linear_backward(o, NULL, G(m, m->x_emb_w), G(m, m->x_emb_b), m->dres, m->xp, m->x_emb_w, BN, d->P, D, 0);
    /* conditioning: c = t_mlp + y_emb */
    o->class_embedding_backward(o, G(m, m->y_emb), m->dcs, m->c, m->ybuf, B, D);
    o->linear_backward(o, m->dtmp, G(m, m->t_w2), G(m, m->t_b2), m->dcs, m->ths, m->t_w2, B, D, D, 0);
    o->silu_backward(o, m->dtmp, m->th, (size_t)B * D);
    o->linear_backward(o, NULL, G(m, m->t_w1), G(m, m->t_b1), m->dtmp, m->tfreq, m->t_w1, B, d->F, D, 0);
    return finish(m, err, err_len);
}
