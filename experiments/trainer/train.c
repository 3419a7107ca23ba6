/* Configuration, seeded randomness, AdamW, batches, losses, checkpoints, the Euler sampler and
 * the training loop of sparge-train. */
#define _POSIX_C_SOURCE 200809L /* mkdir */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/stat.h>
#include <unistd.h>

#include "exp.h"
#include "trainer.h"

/* ---------------------------------------------------------------- configuration */

void tr_config_defaults(tr_config *c)
{
    memset(c, 0, sizeof *c);
    c->frames = 8, c->height = 16, c->width = 16, c->channels = 3;
    c->dim = 64, c->heads = 4, c->depth = 4, c->classes = 4, c->mlp_ratio = 4;
    c->attn = TR_ATTN_DENSE, c->topk = 0.03, c->topp = 0.2, c->block_q = 64, c->block_k = 32;
    snprintf(c->device, sizeof c->device, "cpu");
    c->device_ops = 1;
    snprintf(c->attn_dtype, sizeof c->attn_dtype, "f32");
    c->loss = TR_LOSS_DIFFUSION;
    snprintf(c->data, sizeof c->data, "A");
    c->steps = 100, c->batch = 4, c->log_every = 10, c->ckpt_every = 0, c->warmup = 0;
    c->lr = 3e-4, c->beta1 = 0.9, c->beta2 = 0.999, c->adam_eps = 1e-8, c->weight_decay = 0.0, c->grad_clip = 1.0;
    c->seed = 0, c->data_seed = 1;
    c->save_optimizer = 1;
    c->sample_steps = 20, c->eval_batches = 2;
    c->target_sparsity = 0.95, c->calib_iters = 20;
    snprintf(c->dump_times, sizeof c->dump_times, "0.1,0.5,0.9");
}

const char *tr_attn_mode_name(tr_attn_mode m)
{
    static const char *names[] = {"dense", "hybrid", "topk", "topp"};
    return m >= 0 && m <= TR_ATTN_TOPP ? names[m] : "?";
}

typedef enum { K_INT, K_DOUBLE, K_U64, K_STRING, K_ATTN, K_LOSS, K_DATA, K_MODE, K_SCENE, K_ADALN } key_kind;
typedef struct {
    const char *name;
    key_kind kind;
    size_t offset, size;
} key_def;

#define KEY(name, kind) {#name, kind, offsetof(tr_config, name), sizeof(((tr_config *)0)->name)}
static const key_def KEYS[] = {
    KEY(frames, K_INT),       KEY(height, K_INT),      KEY(width, K_INT),         KEY(channels, K_INT),
    KEY(dim, K_INT),          KEY(heads, K_INT),       KEY(depth, K_INT),         KEY(classes, K_INT),
    KEY(mlp_ratio, K_INT),    KEY(attn, K_ATTN),       KEY(topk, K_DOUBLE),       KEY(topp, K_DOUBLE),
    KEY(block_q, K_INT),      KEY(block_k, K_INT),     KEY(device, K_STRING),     KEY(loss, K_LOSS),
    KEY(data, K_DATA),        KEY(steps, K_INT),       KEY(batch, K_INT),         KEY(log_every, K_INT),
    KEY(ckpt_every, K_INT),   KEY(warmup, K_INT),      KEY(lr, K_DOUBLE),         KEY(beta1, K_DOUBLE),
    KEY(beta2, K_DOUBLE),     KEY(adam_eps, K_DOUBLE), KEY(weight_decay, K_DOUBLE), KEY(grad_clip, K_DOUBLE),
    KEY(seed, K_U64),         KEY(data_seed, K_U64),   KEY(init, K_STRING),       KEY(teacher, K_STRING),
    KEY(resume, K_STRING),    KEY(out, K_STRING),      KEY(log, K_STRING),        KEY(sample_steps, K_INT),
    KEY(eval_batches, K_INT), KEY(stage_attention, K_INT), KEY(device_ops, K_INT),
    KEY(tf32, K_INT),         KEY(attn_dtype, K_STRING), KEY(mode, K_MODE),        KEY(scene, K_SCENE),
    {"adaln", K_ADALN, offsetof(tr_config, adaln_single), sizeof(int)}, KEY(time_limit, K_DOUBLE),
    KEY(ckpt_shard_mib, K_DOUBLE), KEY(save_optimizer, K_INT), KEY(tag, K_STRING),
    KEY(target_sparsity, K_DOUBLE), KEY(calib_iters, K_INT), KEY(dump_dir, K_STRING), KEY(dump_times, K_STRING),
};

static const char *const MODE_NAMES[] = {"train", "eval", "calibrate", "dump"};
static const char *const SCENE_NAMES[] = {"simple", "rich"};
static const char *const ADALN_NAMES[] = {"block", "single"};

/* The index of val among n names, or -1. */
static int name_index(const char *val, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(val, names[i]))
            return i;
    return -1;
}
#undef KEY

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    char *e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\n' || e[-1] == '\r'))
        *--e = 0;
    return s;
}

enum { NKEYS = sizeof KEYS / sizeof KEYS[0] };

/* Splits "key = value" (leading dashes allowed) in buf into its trimmed key and value; the index of the key in KEYS,
 * -1 for none, -2 when there is no '='. */
static int split_assignment(char *buf, char **key, char **val)
{
    char *s = buf;
    while (*s == '-')
        s++;
    char *eq = strchr(s, '=');
    if (!eq)
        return -2;
    *eq = 0;
    *key = trim(s), *val = trim(eq + 1);
    for (int i = 0; i < NKEYS; i++)
        if (!strcmp(KEYS[i].name, *key))
            return i;
    return -1;
}

int tr_config_set(tr_config *c, const char *assignment, char *err, size_t err_len)
{
    char buf[1024], *key = NULL, *val = NULL;
    snprintf(buf, sizeof buf, "%s", assignment);
    int i = split_assignment(buf, &key, &val);
    if (i == -2)
        return exp_fail(err, err_len, "'%s' is not key=value", assignment);
    if (i >= 0) {
        const key_def *k = &KEYS[i];
        char *field = (char *)c + k->offset, *end = NULL;
        errno = 0;
        switch (k->kind) {
        case K_INT: {
            long v = strtol(val, &end, 10);
            if (*val == 0 || *end || errno || v < -1000000000L || v > 1000000000L)
                return exp_fail(err, err_len, "%s=%s: not an integer in [-1e9, 1e9]", key, val);
            *(int *)field = (int)v;
            return 0;
        }
        case K_DOUBLE: {
            double v = strtod(val, &end);
            if (*val == 0 || *end || errno || !isfinite(v))
                return exp_fail(err, err_len, "%s=%s: not a finite number", key, val);
            *(double *)field = v;
            return 0;
        }
        case K_U64: {
            unsigned long long v = strtoull(val, &end, 10);
            if (*val == 0 || *val == '-' || *val == '+' || *end || errno)
                return exp_fail(err, err_len, "%s=%s: not an unsigned integer", key, val);
            *(uint64_t *)field = v;
            return 0;
        }
        case K_STRING:
            if (strlen(val) >= k->size)
                return exp_fail(err, err_len, "%s: value longer than %zu characters", key, k->size - 1);
            memcpy(field, val, strlen(val) + 1);
            return 0;
        case K_ATTN:
            for (int m = 0; m <= TR_ATTN_TOPP; m++)
                if (!strcmp(val, tr_attn_mode_name((tr_attn_mode)m))) {
                    c->attn = (tr_attn_mode)m;
                    return 0;
                }
            return exp_fail(err, err_len, "attn=%s: expected dense, hybrid, topk or topp", val);
        case K_LOSS:
            if (!strcmp(val, "diffusion") || !strcmp(val, "vd")) {
                c->loss = !strcmp(val, "vd") ? TR_LOSS_VD : TR_LOSS_DIFFUSION;
                return 0;
            }
            return exp_fail(err, err_len, "loss=%s: expected diffusion or vd", val);
        case K_DATA:
            if ((val[0] == 'A' || val[0] == 'B') && val[1] == 0) {
                snprintf(c->data, sizeof c->data, "%s", val);
                return 0;
            }
            return exp_fail(err, err_len, "data=%s: expected A or B", val);
        case K_MODE:
        case K_SCENE:
        case K_ADALN: {
            const char *const *names = k->kind == K_MODE ? MODE_NAMES : k->kind == K_SCENE ? SCENE_NAMES : ADALN_NAMES;
            int n = k->kind == K_MODE ? 4 : 2, v = name_index(val, names, n);
            if (v < 0)
                return exp_fail(err, err_len, "%s=%s: expected %s", key, val,
                                k->kind == K_MODE    ? "train, eval, calibrate or dump"
                                : k->kind == K_SCENE ? "simple or rich"
                                                     : "block or single");
            *(int *)field = v;
            return 0;
        }
        }
    }
    return exp_fail(err, err_len, "unknown key '%s' (README.md lists the keys)", key);
}

int tr_config_load(tr_config *c, const char *path, char *err, size_t err_len)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return exp_fail(err, err_len, "%s: cannot open: %s", path, strerror(errno));
    char line[1024], msg[768], buf[1024], *key, *val;
    int lineno = 0, set_on[NKEYS] = {0}; /* the line that set each key */
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n' && !feof(f)) {
            fclose(f);
            return exp_fail(err, err_len, "%s:%d: line longer than %zu characters", path, lineno, sizeof line - 2);
        }
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        char *s = trim(line);
        if (!*s)
            continue;
        snprintf(buf, sizeof buf, "%s", s);
        int k = split_assignment(buf, &key, &val);
        if (k >= 0 && set_on[k]) {
            fclose(f);
            return exp_fail(err, err_len, "%s:%d: %s is already set on line %d", path, lineno, key, set_on[k]);
        }
        if (tr_config_set(c, s, msg, sizeof msg)) {
            fclose(f);
            return exp_fail(err, err_len, "%s:%d: %s", path, lineno, msg);
        }
        if (k >= 0)
            set_on[k] = lineno;
    }
    fclose(f);
    return 0;
}

int tr_config_check(const tr_config *c, char *err, size_t err_len)
{
    if (c->frames < 1 || c->height < 2 || c->width < 2 || c->height % 2 || c->width % 2)
        return exp_fail(err, err_len, "video %dx%dx%d: frames >= 1, height and width even and >= 2 (patch 1x2x2)",
                        c->frames, c->height, c->width);
    if (c->channels < 1 || c->channels > 8)
        return exp_fail(err, err_len, "channels=%d: must be in [1, 8]", c->channels);
    if (c->dim < 6 || c->dim % 2 || c->heads < 1 || c->dim % c->heads)
        return exp_fail(err, err_len, "dim=%d heads=%d: dim must be even, >= 6 and a multiple of heads", c->dim,
                        c->heads);
    if (c->dim / c->heads > 256)
        return exp_fail(err, err_len, "head dim %d exceeds 256 (sparge's CPU limit)", c->dim / c->heads);
    if (c->depth < 0 || c->depth > TR_MAX_DEPTH)
        return exp_fail(err, err_len, "depth=%d: must be in [0, %d]", c->depth, TR_MAX_DEPTH);
    if (c->classes < 1 || c->mlp_ratio < 1)
        return exp_fail(err, err_len, "classes=%d mlp_ratio=%d: both must be >= 1", c->classes, c->mlp_ratio);
    if (strcmp(c->attn_dtype, "f32") && strcmp(c->attn_dtype, "bf16"))
        return exp_fail(err, err_len, "attn_dtype=%s: expected f32 or bf16", c->attn_dtype);
    if (c->block_q < 1 || c->block_k < 1)
        return exp_fail(err, err_len, "block_q=%d block_k=%d: must be >= 1", c->block_q, c->block_k);
    if (c->topk < 0 || c->topk > 1 || c->topp < 0 || c->topp > 1)
        return exp_fail(err, err_len, "topk=%g topp=%g: must be in [0, 1]", c->topk, c->topp);
    if ((c->attn == TR_ATTN_HYBRID && c->topk == 0 && c->topp == 0) || (c->attn == TR_ATTN_TOPK && c->topk == 0) ||
        (c->attn == TR_ATTN_TOPP && c->topp == 0))
        return exp_fail(err, err_len, "attn=%s needs a nonzero topk/topp", tr_attn_mode_name(c->attn));
    if (c->batch < 1 || c->steps < 0 || c->log_every < 1 || c->ckpt_every < 0 || c->warmup < 0 ||
        c->sample_steps < 1 || c->eval_batches < 1)
        return exp_fail(err, err_len, "batch >= 1, steps >= 0, log_every >= 1, ckpt_every >= 0, warmup >= 0, "
                                      "sample_steps >= 1, eval_batches >= 1");
    if (!(c->lr >= 0) || c->beta1 < 0 || c->beta1 >= 1 || c->beta2 < 0 || c->beta2 >= 1 || !(c->adam_eps > 0))
        return exp_fail(err, err_len, "lr >= 0, beta1/beta2 in [0, 1), adam_eps > 0");
    if (c->time_limit < 0 || c->ckpt_shard_mib < 0 || (c->save_optimizer != 0 && c->save_optimizer != 1))
        return exp_fail(err, err_len, "time_limit >= 0, ckpt_shard_mib >= 0, save_optimizer 0 or 1");
    if (c->mode == TR_MODE_TRAIN && c->time_limit > 0 && !c->out[0])
        return exp_fail(err, err_len, "time_limit=%g stops training early so that resume= can continue it: give "
                        "out=CKPT, or the steps trained would be lost", c->time_limit);
    if (!(c->grad_clip >= 0))
        return exp_fail(err, err_len, "grad_clip=%g: the largest gradient norm kept, >= 0 (0: no clipping)",
                        c->grad_clip);
    const struct {
        const char *name;
        int value;
    } flags[] = {{"device_ops", c->device_ops}, {"tf32", c->tf32}, {"stage_attention", c->stage_attention}};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (flags[i].value != 0 && flags[i].value != 1)
            return exp_fail(err, err_len, "%s=%d: must be 0 or 1", flags[i].name, flags[i].value);
    if (!(c->target_sparsity >= 0 && c->target_sparsity < 1) || c->calib_iters < 1 || c->calib_iters > 60)
        return exp_fail(err, err_len, "target_sparsity=%g calib_iters=%d: in [0, 1) and [1, 60]", c->target_sparsity,
                        c->calib_iters);
    return 0;
}

void tr_config_model_string(const tr_config *c, char *out, size_t len)
{
    snprintf(out, len, "frames=%d height=%d width=%d channels=%d dim=%d heads=%d depth=%d classes=%d mlp_ratio=%d%s",
             c->frames, c->height, c->width, c->channels, c->dim, c->heads, c->depth, c->classes, c->mlp_ratio,
             c->adaln_single ? " adaln=single" : "");
}

void tr_config_string(const tr_config *c, char *out, size_t len)
{
    size_t at = 0;
    out[0] = 0;
    for (size_t i = 0; i < sizeof KEYS / sizeof KEYS[0] && at + 1 < len; i++) {
        const key_def *k = &KEYS[i];
        const char *field = (const char *)c + k->offset;
        char v[600];
        switch (k->kind) {
        case K_INT: snprintf(v, sizeof v, "%d", *(const int *)field); break;
        case K_DOUBLE: { /* the shortest of %.15g and %.17g that reads back exactly */
            double x = *(const double *)field;
            snprintf(v, sizeof v, "%.15g", x);
            if (strtod(v, NULL) != x)
                snprintf(v, sizeof v, "%.17g", x);
            break;
        }
        case K_U64: snprintf(v, sizeof v, "%llu", (unsigned long long)*(const uint64_t *)field); break;
        case K_STRING:
        case K_DATA: snprintf(v, sizeof v, "%s", field); break;
        case K_ATTN: snprintf(v, sizeof v, "%s", tr_attn_mode_name(c->attn)); break;
        case K_LOSS: snprintf(v, sizeof v, "%s", c->loss == TR_LOSS_VD ? "vd" : "diffusion"); break;
        case K_MODE: snprintf(v, sizeof v, "%s", MODE_NAMES[c->mode]); break;
        case K_SCENE: snprintf(v, sizeof v, "%s", SCENE_NAMES[c->scene]); break;
        case K_ADALN: snprintf(v, sizeof v, "%s", ADALN_NAMES[c->adaln_single]); break;
        }
        at += (size_t)snprintf(out + at, len - at, "%s%s=%s", i ? " " : "", k->name, v);
    }
}

/* ---------------------------------------------------------------- randomness */

uint64_t tr_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static const uint64_t rng_step = 0x9e3779b97f4a7c15ull;

double tr_uniform(uint64_t *state)
{
    *state += rng_step;
    return (double)(tr_mix(*state) >> 11) * 0x1.0p-53;
}

uint64_t tr_rng_skip(uint64_t state, uint64_t draws)
{
    return state + draws * rng_step; /* tr_uniform's state is a counter */
}

double tr_normal(uint64_t *state)
{
    double u1 = tr_uniform(state), u2 = tr_uniform(state);
    return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

/* ---------------------------------------------------------------- optimizer */

int tr_adamw_init(tr_adamw *opt, tr_model *m, char *err, size_t err_len)
{
    tr_ops *o = tr_model_ops(m);
    opt->ops = o;
    opt->n = tr_model_num_params(m);
    opt->step = 0;
    opt->m = o->alloc(o, opt->n * sizeof(float));
    opt->v = o->alloc(o, opt->n * sizeof(float));
    if (!opt->m || !opt->v) {
        if (!o->error(o, err, err_len))
            exp_fail(err, err_len, "optimizer: out of memory");
        tr_adamw_free(opt);
        return -1;
    }
    return 0;
}

void tr_adamw_free(tr_adamw *opt)
{
    if (opt->ops) {
        if (opt->m)
            opt->ops->release(opt->ops, opt->m);
        if (opt->v)
            opt->ops->release(opt->ops, opt->v);
    }
    opt->m = opt->v = NULL;
}

int tr_adamw_step(tr_adamw *opt, tr_model *m, double lr, double beta1, double beta2, double eps, double wd,
                  char *err, size_t err_len)
{
    tr_ops *o = tr_model_ops(m);
    opt->step++;
    double c1 = 1.0 - pow(beta1, (double)opt->step), c2 = 1.0 - pow(beta2, (double)opt->step);
    float *p = tr_model_params(m), *g = tr_model_grads(m);
    for (int i = 0; i < tr_model_num_tensors(m); i++) {
        const tr_param *t = tr_model_tensor(m, i);
        o->adamw(o, p + t->offset, g + t->offset, opt->m + t->offset, opt->v + t->offset, t->size, lr, beta1, beta2,
                 c1, c2, eps, t->decay ? wd : 0.0);
    }
    o->mark(o, TR_PART_IDLE);
    return o->error(o, err, err_len);
}

int tr_clip_grad_norm(tr_model *m, double max_norm, double *norm, char *err, size_t err_len)
{
    tr_ops *o = tr_model_ops(m);
    size_t n = tr_model_num_params(m);
    double ss;
    o->sum_squares(o, tr_model_grads(m), n, &ss);
    *norm = sqrt(ss);
    if (max_norm > 0 && *norm > max_norm)
        o->scale(o, tr_model_grads(m), n, (float)(max_norm / *norm));
    o->mark(o, TR_PART_IDLE);
    return o->error(o, err, err_len);
}

/* ---------------------------------------------------------------- batches and losses */

void tr_make_batch(const tr_config *cfg, const tr_dims *dm, int64_t step, float *x0, int *y, float *t, float *eps,
                   float *xt)
{
    const size_t per = (size_t)dm->T * dm->H * dm->W * dm->C, n = (size_t)cfg->batch * per;
    /* Each video is a function of its index alone, so they render in parallel. */
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < cfg->batch; b++)
        tr_data_sample_scene(cfg->data[0], cfg->scene, cfg->data_seed, (uint64_t)step * cfg->batch + b, dm->T, dm->H,
                             dm->W, dm->C, dm->K, x0 + b * per, &y[b]);
    /* One stream: per video its time, then two draws per noise value; the stream's state at any draw is known in
     * closed form (tr_rng_skip), so the noise is drawn in parallel and equals the sequential draw. */
    const uint64_t s = tr_mix(cfg->seed * 0x100000001b3ull ^ tr_mix((uint64_t)step)), draws = 1 + 2 * (uint64_t)per;
    for (int b = 0; b < cfg->batch; b++) {
        uint64_t sb = tr_rng_skip(s, b * draws);
        t[b] = (float)tr_uniform(&sb);
    }
#pragma omp parallel for schedule(static)
    for (size_t j = 0; j < n; j++) {
        size_t b = j / per;
        uint64_t sj = tr_rng_skip(s, b * draws + 1 + 2 * (j - b * per));
        eps[j] = (float)tr_normal(&sj);
        xt[j] = (1.0f - t[b]) * x0[j] + t[b] * eps[j];
    }
}

double tr_mse(const float *u, const float *target, size_t n, float *du)
{
    double ss = 0.0;
    for (size_t i = 0; i < n; i++) {
        double e = (double)u[i] - target[i];
        ss += e * e;
        if (du)
            du[i] = (float)(2.0 * e / (double)n);
    }
    return ss / (double)n;
}

/* ---------------------------------------------------------------- checkpoints */

/* JSON string contents of s (quotes and backslashes escaped, control characters dropped) into out. */
static void json_escape(const char *s, char *out, size_t cap)
{
    size_t n = 0;
    for (; *s && n + 2 < cap; s++) {
        if ((unsigned char)*s < 0x20)
            continue;
        if (*s == '"' || *s == '\\')
            out[n++] = '\\';
        out[n++] = *s;
    }
    out[n] = 0;
}

/* The length of path without its ".safetensors" extension. */
static size_t stem_length(const char *path)
{
    size_t len = strlen(path), ext = strlen(".safetensors");
    return len > ext && !strcmp(path + len - ext, ".safetensors") ? len - ext : len;
}

/* The path of shard i (1-based) of n of the save `hash` beside the index file path: "dir/name.safetensors" ->
 * "dir/name-HASH-i-of-n.safetensors". Each save's shards have names of their own, so a save stopped before its index
 * replaced the previous one leaves the previous one whole. */
static void shard_path(const char *path, const char *hash, int i, int n, char *out, size_t cap)
{
    snprintf(out, cap, "%.*s-%s-%d-of-%d.safetensors", (int)stem_length(path), path, hash, i, n);
}

/* After a save to `path` is complete: removes the shards of other saves to it (names shard_path gives, with another
 * hash or shard count than this save's `hash` and `shards`; shards 0: a single-file save, which keeps none). A shard
 * left behind only takes room, so a failed removal is not an error. */
static void remove_old_shards(const char *path, const char *hash, int shards)
{
    const char *slash = strrchr(path, '/');
    const int dl = slash ? (int)(slash - path) + 1 : 0;
    const char *stem = path + dl;
    const size_t len = stem_length(stem);
    char dir[512];
    snprintf(dir, sizeof dir, "%.*s", dl, path); /* with its '/', or empty */
    DIR *d = opendir(dl ? dir : ".");
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, stem, len) || e->d_name[len] != '-' || strlen(e->d_name + len + 1) < 16)
            continue;
        const char *p = e->d_name + len + 1;
        int hex = 1, i, n, end = 0;
        for (int j = 0; j < 16; j++)
            hex &= isxdigit((unsigned char)p[j]) && !isupper((unsigned char)p[j]);
        if (!hex || sscanf(p + 16, "-%d-of-%d.safetensors%n", &i, &n, &end) != 2 || !end || p[16 + end])
            continue;
        if (shards && !strncmp(p, hash, 16) && n == shards) /* this save's */
            continue;
        char file[1100];
        snprintf(file, sizeof file, "%s%s", dir, e->d_name);
        (void)unlink(file);
    }
    closedir(d);
}

int tr_checkpoint_save(const char *path, tr_model *m, const tr_adamw *opt, const tr_config *c, char *err,
                       size_t err_len)
{
    int nt = tr_model_num_tensors(m), n = opt ? 3 * nt + 1 : nt;
    const char **names = calloc((size_t)n, sizeof *names);
    const float **data = calloc((size_t)n, sizeof *data);
    int *ndims = calloc((size_t)n, sizeof *ndims);
    int64_t(*shapes)[8] = calloc((size_t)n, sizeof *shapes);
    char(*owned)[80] = calloc((size_t)n, sizeof *owned);
    size_t np = tr_model_num_params(m);
    float *host = malloc(np * sizeof(float) * (opt ? 3 : 1)); /* parameters, then the moments */
    float step = opt ? (float)opt->step : 0.0f;
    int rc = -1;
    if (!names || !data || !ndims || !shapes || !owned || !host) {
        exp_fail(err, err_len, "%s: out of memory", path);
        goto out;
    }
    if (tr_model_get_params(m, host, err, err_len))
        goto out;
    if (opt) {
        opt->ops->download(opt->ops, host + np, opt->m, np * sizeof(float));
        opt->ops->download(opt->ops, host + 2 * np, opt->v, np * sizeof(float));
        if (opt->ops->error(opt->ops, err, err_len))
            goto out;
    }
    for (int i = 0; i < nt; i++) {
        const tr_param *p = tr_model_tensor(m, i);
        for (int copy = 0; copy < (opt ? 3 : 1); copy++) {
            int k = copy * nt + i;
            const float *base = host + copy * np;
            snprintf(owned[k], sizeof owned[k], "%s%s", copy == 0 ? "" : copy == 1 ? "adamw.m." : "adamw.v.",
                     p->name);
            names[k] = owned[k];
            data[k] = base + p->offset;
            ndims[k] = p->ndim;
            shapes[k][0] = p->shape[0];
            shapes[k][1] = p->shape[1];
        }
    }
    if (opt) {
        names[n - 1] = "train.step";
        data[n - 1] = &step;
        ndims[n - 1] = 1;
        shapes[n - 1][0] = 1;
    }
    char model[400], tag[600], meta[6000];
    tr_config_model_string(c, model, sizeof model);
    json_escape(c->tag, tag, sizeof tag);
    /* shards: consecutive tensors, each file's data and header (at most 2 KiB plus 256 bytes a tensor) within the
     * limit */
    double limit = c->ckpt_shard_mib * 1048576.0, used = 0;
    size_t total = 0;
    for (int k = 0; k < n; k++)
        total += 4 * (size_t)shapes[k][0] * (size_t)(ndims[k] == 2 ? shapes[k][1] : 1);
    if (c->ckpt_shard_mib <= 0 || (double)total + 2048.0 + 256.0 * n <= limit) {
        snprintf(meta, sizeof meta, "{\"format\":\"sparge-train\",\"model\":\"%s\",\"tag\":\"%s\"}", model, tag);
        rc = exp_st_write(path, n, names, data, ndims, (const int64_t(*)[8])shapes, SPARGE_F32, meta, err, err_len);
        if (!rc)
            remove_old_shards(path, NULL, 0);
        goto out;
    }
    int *first = calloc((size_t)n + 1, sizeof *first), shards = 0, count = 0;
    if (!first) {
        exp_fail(err, err_len, "%s: out of memory", path);
        goto out;
    }
    for (int k = 0; k < n; k++) {
        double bytes = 4.0 * (double)shapes[k][0] * (double)(ndims[k] == 2 ? shapes[k][1] : 1);
        if (bytes + 2048.0 + 256.0 > limit) {
            free(first);
            exp_fail(err, err_len, "%s: tensor '%s' (%.0f bytes) does not fit in a shard of ckpt_shard_mib=%g", path,
                     names[k], bytes, c->ckpt_shard_mib);
            goto out;
        }
        if (!shards || used + bytes + 2048.0 + 256.0 * (count + 1) > limit)
            first[shards++] = k, used = 0, count = 0;
        used += bytes, count++;
    }
    first[shards] = n;
    /* every file of this save carries its id, a hash of what it saves (so that the same state gives the same bytes),
     * and its shards are named after it: loading refuses an index whose shards do not all carry its id (a shard
     * copied over from another save) */
    uint64_t hash = 1469598103934665603ull; /* FNV-1a over the saved values' bytes and the step */
    const unsigned char *bytes = (const unsigned char *)host;
    for (size_t b = 0; b < np * sizeof(float) * (opt ? 3 : 1); b++)
        hash = (hash ^ bytes[b]) * 1099511628211ull;
    char id[64], hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)hash);
    snprintf(id, sizeof id, "%s-%.0f", hex, (double)step);
    char list[4096] = "", file[600];
    for (int i = 0; i < shards; i++) {
        shard_path(path, hex, i + 1, shards, file, sizeof file);
        const char *base = strrchr(file, '/') ? strrchr(file, '/') + 1 : file;
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? "," : "", base);
        snprintf(meta, sizeof meta, "{\"format\":\"sparge-train\",\"model\":\"%s\",\"shard\":\"%d/%d\",\"save\":\"%s\"}",
                 model, i + 1, shards, id);
        count = first[i + 1] - first[i];
        if (exp_st_write(file, count, names + first[i], data + first[i], ndims + first[i],
                         (const int64_t(*)[8])(shapes + first[i]), SPARGE_F32, meta, err, err_len)) {
            free(first);
            goto out;
        }
    }
    free(first);
    /* the index last: a checkpoint is complete once it names its shards */
    snprintf(meta, sizeof meta,
             "{\"format\":\"sparge-train\",\"model\":\"%s\",\"tag\":\"%s\",\"shards\":\"%s\",\"save\":\"%s\"}", model,
             tag, list, id);
    rc = exp_st_write(path, 0, NULL, NULL, NULL, NULL, SPARGE_F32, meta, err, err_len);
    if (!rc)
        remove_old_shards(path, hex, shards);
out:
    free(host);
    free(names);
    free(data);
    free(ndims);
    free(shapes);
    free(owned);
    return rc;
}

/* A checkpoint's files: the one file, or the shards an index file names. */
typedef struct {
    exp_st_file f[64];
    int n;
} ckpt_files;

static void ckpt_close(ckpt_files *c)
{
    for (int i = 0; i < c->n; i++)
        exp_st_close(&c->f[i]);
    c->n = 0;
}

static int ckpt_open(const char *path, ckpt_files *c, char *err, size_t err_len)
{
    c->n = 0;
    exp_st_file index;
    if (exp_st_open(path, &index, err, err_len))
        return -1;
    char list[4096];
    if (exp_st_metadata(&index, "shards", list, sizeof list)) {
        c->f[c->n++] = index; /* one file */
        return 0;
    }
    char id[64] = "", shard_id[64];
    int has_id = !exp_st_metadata(&index, "save", id, sizeof id); /* checkpoints written before the ids have none */
    exp_st_close(&index);
    const char *slash = strrchr(path, '/');
    int dir_len = slash ? (int)(slash - path + 1) : 0;
    for (char *name = strtok(list, ","); name; name = strtok(NULL, ",")) {
        char file[1024];
        snprintf(file, sizeof file, "%.*s%s", dir_len, path, name);
        if (c->n == (int)(sizeof c->f / sizeof c->f[0]) || exp_st_open(file, &c->f[c->n], err, err_len)) {
            if (c->n == (int)(sizeof c->f / sizeof c->f[0]))
                exp_fail(err, err_len, "%s: more than %d shards", path, c->n);
            ckpt_close(c);
            return -1;
        }
        c->n++;
        if (has_id && (exp_st_metadata(&c->f[c->n - 1], "save", shard_id, sizeof shard_id) || strcmp(id, shard_id))) {
            ckpt_close(c);
            return exp_fail(err, err_len, "%s: shard %s is not of the save its index names (a save that was interrupted?)",
                            path, name);
        }
    }
    return c->n ? 0 : exp_fail(err, err_len, "%s: an index that names no shards", path);
}

/* Reads tensor `name` of the model's shape into dst. */
static int read_tensor(const ckpt_files *c, const char *path, const char *name, const tr_param *p, float *dst,
                       char *err, size_t err_len)
{
    const exp_st_tensor *t = NULL;
    const exp_st_file *f = NULL;
    for (int i = 0; i < c->n && !t; i++)
        t = exp_st_find(f = &c->f[i], name);
    if (!t)
        return exp_fail(err, err_len, "%s: no tensor '%s'", path, name);
    int64_t want1 = p->ndim == 2 ? p->shape[1] : 0, got1 = t->ndim == 2 ? t->shape[1] : 0;
    if (t->ndim != p->ndim || t->shape[0] != p->shape[0] || got1 != want1)
        return exp_fail(err, err_len,
                        "%s: tensor '%s' has another shape than this model's [%lld%s%lld] (other config?)", path,
                        name, (long long)p->shape[0], p->ndim == 2 ? "," : "", (long long)want1);
    float *v = exp_st_read_f32(f, t, err, err_len);
    if (!v)
        return -1;
    memcpy(dst, v, p->size * sizeof(float));
    free(v);
    return 0;
}

int tr_checkpoint_load(const char *path, tr_model *m, tr_adamw *opt, char *err, size_t err_len)
{
    ckpt_files *files = malloc(sizeof *files);
    if (!files)
        return exp_fail(err, err_len, "%s: out of memory", path);
    if (ckpt_open(path, files, err, err_len)) {
        free(files);
        return -1;
    }
    size_t n = tr_model_num_params(m);
    float *staged = malloc(n * sizeof(float) * (opt ? 3 : 1));
    int rc = -1;
    float step = 0.0f;
    if (!staged) {
        exp_fail(err, err_len, "%s: out of memory", path);
        goto out;
    }
    for (int i = 0; i < tr_model_num_tensors(m); i++) {
        const tr_param *p = tr_model_tensor(m, i);
        char name[80];
        if (read_tensor(files, path, p->name, p, staged + p->offset, err, err_len))
            goto out;
        for (int copy = 1; opt && copy < 3; copy++) {
            snprintf(name, sizeof name, "adamw.%c.%s", copy == 1 ? 'm' : 'v', p->name);
            if (read_tensor(files, path, name, p, staged + copy * n + p->offset, err, err_len))
                goto out;
        }
    }
    if (opt) {
        const tr_param step_shape = {"train.step", 1, {1, 0}, 0, 1, 0};
        if (read_tensor(files, path, "train.step", &step_shape, &step, err, err_len))
            goto out;
    }
    if (tr_model_set_params(m, staged, err, err_len))
        goto out;
    if (opt) {
        opt->ops->upload(opt->ops, opt->m, staged + n, n * sizeof(float));
        opt->ops->upload(opt->ops, opt->v, staged + 2 * n, n * sizeof(float));
        if (opt->ops->error(opt->ops, err, err_len))
            goto out;
        opt->step = (int64_t)step;
    }
    rc = 0;
out:
    free(staged);
    ckpt_close(files);
    free(files);
    return rc;
}

/* ---------------------------------------------------------------- sampler */

int tr_sample_euler(tr_model *m, float *x, const int *y, int steps, float *scratch, char *err, size_t err_len)
{
    const tr_dims *d = tr_model_dims(m);
    size_t n = (size_t)d->B * d->T * d->H * d->W * d->C;
    float *t = malloc((size_t)d->B * sizeof(float));
    if (!t)
        return exp_fail(err, err_len, "sampler: out of memory");
    double dt = 1.0 / steps;
    for (int i = 0; i < steps; i++) {
        for (int b = 0; b < d->B; b++)
            t[b] = (float)(1.0 - i * dt);
        if (tr_model_forward(m, x, t, y, scratch, err, err_len)) {
            free(t);
            return -1;
        }
        for (size_t j = 0; j < n; j++)
            x[j] -= (float)dt * scratch[j];
    }
    free(t);
    return 0;
}

/* ---------------------------------------------------------------- training loop */

typedef struct {
    float *x0, *eps, *xt, *target, *t;
    int *y;
} train_batch;

static void make_train_batch(const tr_config *cfg, const tr_dims *d, int64_t step, train_batch *b)
{
    tr_make_batch(cfg, d, step, b->x0, b->y, b->t, b->eps, b->xt);
}

/* The run's record on stderr (the log): every key, the tag (commit) among them. */
static void print_record(const tr_config *cfg)
{
    char *line = malloc(16384);
    if (!line)
        return;
    tr_config_string(cfg, line, 16384);
    fprintf(stderr, "sparge-train: config %s\n", line);
    free(line);
}

/* Whether the checkpoint can be written at path: the file its save fills first (exp_part_path) is created and removed,
 * so that a run learns at its start, not after its last step, that its checkpoint cannot be written. */
static int check_writable(const char *key, const char *path, char *err, size_t err_len)
{
    char *part;
    if (exp_part_path(path, &part))
        return exp_fail(err, err_len, "%s=%s: out of memory", key, path);
    FILE *f = part ? fopen(part, "wb") : NULL;
    int e = 0;
    if (f) {
        fclose(f);
        unlink(part);
    } else if (part || access(path, W_OK))
        e = errno;
    free(part);
    if (e)
        return exp_fail(err, err_len, "%s=%s: cannot write there: %s", key, path, strerror(e));
    return 0;
}

/* The loss log, open for the rows after step `resumed` (0: a new run). A resumed run keeps the rows of the steps up to
 * its checkpoint's and drops later ones (a run stopped after its last checkpoint logged steps that run again), and the
 * log starts with its header whether or not the file existed. NULL with the message in err. */
static FILE *open_log(const char *path, int64_t resumed, char *err, size_t err_len)
{
    static const char header[] = "step,loss,grad_norm,lr,sparsity,step_ms,attention_ms,samples_per_s,gemm_ms,other_ms\n";
    char *part;
    if (exp_part_path(path, &part)) {
        exp_fail(err, err_len, "log=%s: out of memory", path);
        return NULL;
    }
    /* A path that is not a regular file (a link, /dev/stdout) is written in place, without the resumed rows. */
    FILE *old = resumed && part ? fopen(path, "r") : NULL, *f = fopen(part ? part : path, "w");
    if (!f) {
        exp_fail(err, err_len, "log=%s: cannot write there: %s", path, strerror(errno));
        if (old)
            fclose(old);
        free(part);
        return NULL;
    }
    fputs(header, f);
    char line[1024];
    while (old && fgets(line, sizeof line, old)) {
        char *end;
        long long step = strtoll(line, &end, 10);
        if (end != line && *end == ',' && step >= 1 && step <= resumed)
            fputs(line, f);
    }
    if (old)
        fclose(old);
    if (fflush(f) || ferror(f) || (part && rename(part, path))) {
        exp_fail(err, err_len, "log=%s: cannot write there: %s", path, strerror(errno));
        fclose(f);
        if (part)
            unlink(part);
        free(part);
        return NULL;
    }
    free(part);
    return f;
}

int tr_train(const tr_config *cfg, char *err, size_t err_len)
{
    if (tr_config_check(cfg, err, err_len) || (cfg->out[0] && check_writable("out", cfg->out, err, err_len)))
        return -1;
    if (cfg->loss == TR_LOSS_VD && !cfg->teacher[0] && !cfg->init[0])
        return exp_fail(err, err_len,
                        "loss=vd needs a teacher: teacher=CKPT (or init=CKPT, then the init is the teacher)");
    sparge_device *dev = NULL;
    sparge_status s = sparge_device_open(cfg->device, &dev);
    if (s)
        return exp_fail(err, err_len, "device %s: %s: %s", cfg->device, sparge_status_name(s), sparge_last_error());
    tr_model *student = NULL, *teacher = NULL;
    tr_adamw opt = {0};
    float *buf = NULL;
    FILE *log = NULL;
    int rc = -1;
    if (!(student = tr_model_create(cfg, cfg->batch, dev, err, err_len)))
        goto out;
    if (cfg->loss == TR_LOSS_VD) {
        tr_config tc = *cfg;
        tc.attn = TR_ATTN_DENSE;
        if (!(teacher = tr_model_create(&tc, cfg->batch, dev, err, err_len)) ||
            tr_checkpoint_load(cfg->teacher[0] ? cfg->teacher : cfg->init, teacher, NULL, err, err_len))
            goto out;
    }
    if (tr_adamw_init(&opt, student, err, err_len))
        goto out;
    if (cfg->resume[0]) {
        if (tr_checkpoint_load(cfg->resume, student, &opt, err, err_len))
            goto out;
    } else if (cfg->init[0]) {
        if (tr_checkpoint_load(cfg->init, student, NULL, err, err_len))
            goto out;
    } else if (tr_model_init(student, cfg->seed, err, err_len))
        goto out;
    const tr_dims *d = tr_model_dims(student);
    size_t n = (size_t)cfg->batch * d->T * d->H * d->W * d->C;
    /* two batches (x0, eps, xt, target, t, y): the next is made on the host while the device runs the
     * backward of this one (a batch is a pure function of its step, so nothing else changes) */
    size_t slot = 4 * n + 2 * (size_t)cfg->batch;
    buf = malloc(2 * slot * sizeof(float));
    if (!buf) {
        exp_fail(err, err_len, "batch buffers: out of memory");
        goto out;
    }
    train_batch batch[2];
    for (int i = 0; i < 2; i++) {
        float *b = buf + i * slot;
        batch[i].x0 = b, batch[i].eps = b + n, batch[i].xt = b + 2 * n, batch[i].target = b + 3 * n;
        batch[i].t = b + 4 * n, batch[i].y = (int *)(b + 4 * n + cfg->batch);
    }
    if (opt.step < cfg->steps)
        make_train_batch(cfg, d, opt.step, &batch[opt.step & 1]);
    if (cfg->log[0] && !(log = open_log(cfg->log, opt.step, err, err_len)))
        goto out;
    print_record(cfg);
    fprintf(stderr, "sparge-train: %zu parameters, %d tokens, attn=%s (%s) loss=%s data=%s device=%s (%s), ops=%s%s\n",
            tr_model_num_params(student), d->N, tr_attn_mode_name(cfg->attn), cfg->attn_dtype,
            cfg->loss == TR_LOSS_VD ? "vd" : "diffusion", cfg->data, sparge_device_name(dev),
            sparge_device_description(dev), tr_model_ops(student)->name,
            strcmp(tr_model_ops(student)->name, "cuda") ? "" : cfg->tf32 ? " (TF32 GEMMs)" : " (fp32 GEMMs)");
    if (opt.step)
        fprintf(stderr, "sparge-train: resumed at step %lld of %d\n", (long long)opt.step, cfg->steps);
    const double t_start = exp_now();
    double window_loss = 0, window_ms = 0, window_part[TR_PARTS] = {0};
    int window = 0;
    for (int64_t step = opt.step; step < cfg->steps; step++) {
        double t0 = exp_now(), part[TR_PARTS], teacher_part[TR_PARTS];
        tr_model_times(student, part); /* start both models' timers here */
        if (teacher)
            tr_model_times(teacher, teacher_part);
        train_batch *b = &batch[step & 1];
        if (tr_model_forward(student, b->xt, b->t, b->y, NULL, err, err_len))
            goto out;
        double loss;
        if (teacher) {
            if (tr_model_forward(teacher, b->xt, b->t, b->y, NULL, err, err_len) ||
                tr_model_loss(student, NULL, teacher, &loss, err, err_len))
                goto out;
        } else {
            for (size_t i = 0; i < n; i++)
                b->target[i] = b->eps[i] - b->x0[i];
            if (tr_model_loss(student, b->target, NULL, &loss, err, err_len))
                goto out;
        }
        if (!isfinite(loss)) {
            exp_fail(err, err_len, "step %lld: the loss is not finite (%g)", (long long)step, loss);
            goto out;
        }
        tr_model_zero_grad(student);
        double gnorm, lr = cfg->warmup && step < cfg->warmup ? cfg->lr * (step + 1) / cfg->warmup : cfg->lr;
        if (tr_model_backward(student, NULL, err, err_len))
            goto out;
        if (step + 1 < cfg->steps) /* on the host while the device runs the backward */
            make_train_batch(cfg, d, step + 1, &batch[(step + 1) & 1]);
        if (tr_clip_grad_norm(student, cfg->grad_clip, &gnorm, err, err_len) ||
            tr_adamw_step(&opt, student, lr, cfg->beta1, cfg->beta2, cfg->adam_eps, cfg->weight_decay, err, err_len))
            goto out;
        tr_model_times(student, part);
        if (teacher) {
            tr_model_times(teacher, teacher_part);
            for (int i = 0; i < TR_PARTS; i++)
                part[i] += teacher_part[i];
        }
        double ms = 1e3 * (exp_now() - t0);
        double sparsity = tr_model_last_sparsity(student);
        if (log)
            fprintf(log, "%lld,%.8g,%.6g,%.6g,%.6f,%.4f,%.4f,%.3f,%.4f,%.4f\n", (long long)step + 1, loss, gnorm, lr,
                    sparsity, ms, part[TR_PART_ATTENTION], cfg->batch * 1e3 / ms, part[TR_PART_GEMM],
                    part[TR_PART_OTHER]);
        window_loss += loss, window_ms += ms, window++;
        for (int i = 0; i < TR_PARTS; i++)
            window_part[i] += part[i];
        if ((step + 1) % cfg->log_every == 0 || step + 1 == cfg->steps) {
            fprintf(stderr,
                    "step %6lld/%d | loss %.6f | grad norm %.3g | lr %.3g | sparsity %.3f | %.1f ms/step (attention "
                    "%.1f, GEMMs %.1f, other %.1f) | %.1f samples/s\n",
                    (long long)step + 1, cfg->steps, window_loss / window, gnorm, lr, sparsity, window_ms / window,
                    window_part[TR_PART_ATTENTION] / window, window_part[TR_PART_GEMM] / window,
                    window_part[TR_PART_OTHER] / window, cfg->batch * 1e3 * window / window_ms);
            window_loss = window_ms = 0, window = 0;
            for (int i = 0; i < TR_PARTS; i++)
                window_part[i] = 0;
        }
        if (cfg->out[0] && cfg->ckpt_every && (step + 1) % cfg->ckpt_every == 0 &&
            tr_checkpoint_save(cfg->out, student, cfg->save_optimizer ? &opt : NULL, cfg, err, err_len))
            goto out;
        if (cfg->time_limit > 0 && step + 1 < cfg->steps && exp_now() - t_start >= cfg->time_limit) {
            fprintf(stderr, "sparge-train: time_limit %g s reached: stopped at step %lld of %d\n", cfg->time_limit,
                    (long long)step + 1, cfg->steps);
            break;
        }
    }
    if (cfg->out[0] && tr_checkpoint_save(cfg->out, student, cfg->save_optimizer ? &opt : NULL, cfg, err, err_len))
        goto out;
    rc = 0;
out:
    if (log)
        fclose(log);
    free(buf);
    tr_adamw_free(&opt);
    tr_model_free(teacher);
    tr_model_free(student);
    sparge_device_close(dev);
    return rc;
}

/* ---------------------------------------------------------------- evaluation */

static void add_stats(tr_video_stats *sum, const float *video, const tr_dims *d, double weight)
{
    tr_video_stats s;
    tr_video_statistics(video, d->T, d->H, d->W, d->C, &s);
    sum->sharpness += weight * s.sharpness, sum->temporal_change += weight * s.temporal_change;
    sum->temporal_jitter += weight * s.temporal_jitter, sum->mean_c0 += weight * s.mean_c0;
}

/* The VBench-like scores of tr_eval_result from the features and recognizer labels of the samples and
 * of the real videos (n each, classes y) and the features of the real reference set (README.md). */
static void score_videos(tr_eval_result *res, const double *sample_f, const int *sample_label, const double *real_f,
                         const int *real_label, const int *y, int n, const double *ref_f, int n_ref, int frames)
{
    double ref_mean[TR_FEATURES], scale[TR_FEATURES];
    tr_feature_mean(ref_f, n_ref, TR_FEATURES, ref_mean);
    tr_feature_scales(ref_f, n_ref, TR_FEATURES, scale);
    res->frechet = tr_frechet_distance(sample_f, n, ref_f, n_ref, TR_FEATURES, scale);
    res->frechet_floor = tr_frechet_distance(real_f, n, ref_f, n_ref, TR_FEATURES, scale);
    for (int i = 0; i < n; i++) {
        const double *fs = sample_f + (size_t)i * TR_FEATURES, *fr = real_f + (size_t)i * TR_FEATURES;
        res->class_accuracy += (double)(sample_label[i] == y[i]) / n;
        res->reference_class_accuracy += (double)(real_label[i] == y[i]) / n;
        res->imaging_quality += tr_imaging_quality(fs, ref_mean) / n;
        res->reference_imaging_quality += tr_imaging_quality(fr, ref_mean) / n;
        res->temporal_consistency += fs[TR_FEAT_TEMPORAL_CONSISTENCY] / n;
        res->reference_temporal_consistency += fr[TR_FEAT_TEMPORAL_CONSISTENCY] / n;
    }
    if (frames < 3) /* no motion to recognize */
        res->class_accuracy = res->reference_class_accuracy = NAN;
}

/* tr_attention_stats over every block of the held-out forwards (a tr_qkv_hook). */
typedef struct {
    const tr_dims *d;
    double entropy, top_mass;
    long rows;
} attention_stats;

static int attention_stats_hook(void *ctx, int layer, const float *qkv, char *err, size_t err_len)
{
    attention_stats *a = ctx;
    (void)layer;
    long before = a->rows;
    tr_attention_stats(qkv, a->d->B, a->d->N, a->d->nh, a->d->hd, TR_ATTN_STAT_ROWS, 0.05, &a->entropy, &a->top_mass,
                       &a->rows);
    return a->rows > before ? 0 : exp_fail(err, err_len, "attention statistics: out of memory");
}

int tr_evaluate(const tr_config *cfg, tr_eval_result *res, char *err, size_t err_len)
{
    if (tr_config_check(cfg, err, err_len))
        return -1;
    if (!cfg->init[0])
        return exp_fail(err, err_len, "mode=eval needs the model to evaluate: init=CKPT");
    sparge_device *dev = NULL;
    sparge_status s = sparge_device_open(cfg->device, &dev);
    if (s)
        return exp_fail(err, err_len, "device %s: %s: %s", cfg->device, sparge_status_name(s), sparge_last_error());
    tr_model *model = NULL, *teacher = NULL;
    float *buf = NULL;
    double *features = NULL;
    int *labels = NULL, rc = -1;
    tr_config held_out = *cfg; /* held-out videos of A: indices far past any training stream */
    snprintf(held_out.data, sizeof held_out.data, "A");
    if (!(model = tr_model_create(cfg, cfg->batch, dev, err, err_len)) ||
        tr_checkpoint_load(cfg->init, model, NULL, err, err_len))
        goto out;
    if (cfg->teacher[0]) {
        tr_config tc = *cfg;
        tc.attn = TR_ATTN_DENSE;
        if (!(teacher = tr_model_create(&tc, cfg->batch, dev, err, err_len)) ||
            tr_checkpoint_load(cfg->teacher, teacher, NULL, err, err_len))
            goto out;
    }
    tr_model_measure_attention_error(model, 1);
    const tr_dims *d = tr_model_dims(model);
    size_t per = (size_t)d->T * d->H * d->W * d->C, n = (size_t)cfg->batch * per;
    buf = malloc(n * 6 * sizeof(float) + (size_t)cfg->batch * (sizeof(float) + sizeof(int)));
    int videos_n = cfg->eval_batches * cfg->batch, n_ref = TR_EVAL_REFERENCE_VIDEOS;
    features = malloc((2 * (size_t)videos_n + n_ref) * TR_FEATURES * sizeof(double));
    labels = malloc(3 * (size_t)videos_n * sizeof(int));
    if (!buf || !features || !labels) {
        exp_fail(err, err_len, "evaluation buffers: out of memory");
        goto out;
    }
    double *sample_f = features, *real_f = features + (size_t)videos_n * TR_FEATURES;
    double *ref_f = real_f + (size_t)videos_n * TR_FEATURES;
    int *sample_label = labels, *real_label = labels + videos_n, *classes = labels + 2 * videos_n;
    float *x0 = buf, *eps = buf + n, *xt = buf + 2 * n, *u = buf + 3 * n, *ut = buf + 4 * n, *x = buf + 5 * n;
    float *t = buf + 6 * n;
    int *y = (int *)(t + cfg->batch);
    memset(res, 0, sizeof *res);
    double diff2 = 0, ref2 = 0, videos = (double)cfg->eval_batches * cfg->batch;
    attention_stats stats = {d, 0, 0, 0};
    int oom = 0; /* a video's features could not be computed */
    for (int i = 0; i < cfg->eval_batches; i++) {
        tr_make_batch(&held_out, d, 1000000000 + i, x0, y, t, eps, xt);
        tr_model_set_qkv_hook(model, attention_stats_hook, &stats); /* not during the sampler's forwards */
        int failed = tr_model_forward(model, xt, t, y, u, err, err_len);
        tr_model_set_qkv_hook(model, NULL, NULL);
        if (failed)
            goto out;
        res->sparsity += tr_model_last_sparsity(model) / cfg->eval_batches;
        res->attention_rel_l1 += tr_model_last_attention_l1(model) / cfg->eval_batches;
        for (size_t j = 0; j < n; j++)
            x[j] = eps[j] - x0[j];
        res->diffusion_loss += tr_mse(u, x, n, NULL) / cfg->eval_batches;
        if (teacher) {
            if (tr_model_forward(teacher, xt, t, y, ut, err, err_len))
                goto out;
            for (size_t j = 0; j < n; j++) {
                diff2 += ((double)u[j] - ut[j]) * ((double)u[j] - ut[j]);
                ref2 += (double)ut[j] * ut[j];
            }
        }
        memcpy(x, eps, n * sizeof(float)); /* sample from the batch's noise, for its classes */
        if (tr_sample_euler(model, x, y, cfg->sample_steps, u, err, err_len))
            goto out;
        for (int b = 0; b < cfg->batch; b++) {
            add_stats(&res->sample, x + b * per, d, 1.0 / videos);
            add_stats(&res->reference, x0 + b * per, d, 1.0 / videos);
            classes[i * cfg->batch + b] = y[b];
        }
        /* A video's recognizer label and features are its own: the batch's samples and real videos in parallel. */
#pragma omp parallel for schedule(dynamic, 1) reduction(| : oom)
        for (int j = 0; j < 2 * cfg->batch; j++) {
            int b = j / 2, v = i * cfg->batch + b, real = j & 1;
            const float *video = (real ? x0 : x) + b * per;
            tr_motion m;
            tr_motion_estimate(video, d->T, d->H, d->W, d->C, d->K, &m);
            (real ? real_label : sample_label)[v] = m.label;
            oom |= tr_video_features(video, d->T, d->H, d->W, d->C,
                                     (real ? real_f : sample_f) + (size_t)v * TR_FEATURES);
        }
    }
#pragma omp parallel reduction(| : oom)
    { /* the reference set: real A videos at indices no stream reaches */
        float *video = malloc(per * sizeof(float));
#pragma omp for schedule(dynamic, 4)
        for (int r = 0; r < n_ref; r++) {
            int label;
            if (!video) {
                oom = 1;
                continue;
            }
            tr_data_sample_scene('A', cfg->scene, cfg->data_seed, (1ull << 62) + (uint64_t)r, d->T, d->H, d->W, d->C,
                                 d->K, video, &label);
            oom |= tr_video_features(video, d->T, d->H, d->W, d->C, ref_f + (size_t)r * TR_FEATURES);
        }
        free(video);
    }
    if (oom) {
        exp_fail(err, err_len, "video features: out of memory");
        goto out;
    }
    score_videos(res, sample_f, sample_label, real_f, real_label, classes, videos_n, ref_f, n_ref, d->T);
    res->velocity_mse = teacher ? diff2 / (n * (double)cfg->eval_batches) : NAN;
    res->velocity_rel_l2 = teacher ? sqrt(diff2 / ref2) : NAN;
    res->attention_entropy = stats.entropy / stats.rows;
    res->attention_top5_mass = stats.top_mass / stats.rows;
    rc = 0;
out:
    free(labels);
    free(features);
    free(buf);
    tr_model_free(teacher);
    tr_model_free(model);
    sparge_device_close(dev);
    return rc;
}

/* ---------------------------------------------------------------- calibration */

/* The model of init= on cfg's device, for the modes that only run forwards. */
static tr_model *open_model(const tr_config *cfg, sparge_device **dev, char *err, size_t err_len)
{
    if (tr_config_check(cfg, err, err_len))
        return NULL;
    if (!cfg->init[0]) {
        exp_fail(err, err_len, "mode=%s needs a model: init=CKPT", cfg->mode == TR_MODE_DUMP ? "dump" : "calibrate");
        return NULL;
    }
    sparge_status s = sparge_device_open(cfg->device, dev);
    if (s) {
        exp_fail(err, err_len, "device %s: %s: %s", cfg->device, sparge_status_name(s), sparge_last_error());
        return NULL;
    }
    tr_model *m = tr_model_create(cfg, cfg->batch, *dev, err, err_len);
    if (!m || tr_checkpoint_load(cfg->init, m, NULL, err, err_len)) {
        tr_model_free(m);
        sparge_device_close(*dev);
        *dev = NULL;
        return NULL;
    }
    return m;
}

/* Mean mask sparsity of m over the held-out batches (x_t, t, y of each, one after the other in xt, t, y). */
static int held_out_sparsity(tr_model *m, const tr_config *cfg, const float *xt, const float *t, const int *y,
                             size_t per_batch, double *sparsity, char *err, size_t err_len)
{
    *sparsity = 0;
    for (int i = 0; i < cfg->eval_batches; i++) {
        if (tr_model_forward(m, xt + i * per_batch, t + (size_t)i * cfg->batch, y + (size_t)i * cfg->batch, NULL, err,
                             err_len))
            return -1;
        *sparsity += tr_model_last_sparsity(m) / cfg->eval_batches;
    }
    return 0;
}

/* p on a grid of 1e-6 (the grid paper-repro/train.sh's calibration used). */
static double grid6(double p) { return round(p * 1e6) / 1e6; }

int tr_calibrate(const tr_config *cfg, double *p_out, double *sparsity_out, char *err, size_t err_len)
{
    if (cfg->attn != TR_ATTN_TOPP && cfg->attn != TR_ATTN_HYBRID)
        return exp_fail(err, err_len, "mode=calibrate finds Top-p's p: attn=topp or attn=hybrid (with its topk)");
    sparge_device *dev = NULL;
    tr_model *m = open_model(cfg, &dev, err, err_len);
    if (!m)
        return -1;
    print_record(cfg);
    const tr_dims *d = tr_model_dims(m);
    size_t per = (size_t)cfg->batch * d->T * d->H * d->W * d->C, nb = (size_t)cfg->eval_batches;
    float *buf = malloc((3 * nb * per + 2 * nb * cfg->batch) * sizeof(float));
    int rc = -1;
    if (!buf) {
        exp_fail(err, err_len, "calibration: out of memory");
        goto out;
    }
    float *x0 = buf, *eps = buf + nb * per, *xt = buf + 2 * nb * per, *t = buf + 3 * nb * per;
    int *y = (int *)(t + nb * cfg->batch);
    tr_config held_out = *cfg; /* the held-out inputs of mode=eval */
    snprintf(held_out.data, sizeof held_out.data, "A");
    for (size_t i = 0; i < nb; i++)
        tr_make_batch(&held_out, d, 1000000000 + (int64_t)i, x0 + i * per, y + i * cfg->batch, t + i * cfg->batch,
                      eps + i * per, xt + i * per);
    double lo = 0, hi = 1, k = cfg->attn == TR_ATTN_HYBRID ? cfg->topk : 0, sp;
    for (int it = 0; it < cfg->calib_iters; it++) {
        double p = grid6((lo + hi) / 2);
        tr_model_set_attention(m, cfg->attn, k, p);
        if (held_out_sparsity(m, cfg, xt, t, y, per, &sp, err, err_len))
            goto out;
        fprintf(stderr, "calibrate: p %.6f sparsity %.4f\n", p, sp);
        if (sp > cfg->target_sparsity) /* sparsity falls as p grows */
            lo = p;
        else
            hi = p;
    }
    *p_out = grid6((lo + hi) / 2);
    tr_model_set_attention(m, cfg->attn, k, *p_out);
    if (held_out_sparsity(m, cfg, xt, t, y, per, sparsity_out, err, err_len))
        goto out;
    rc = 0;
out:
    free(buf);
    tr_model_free(m);
    sparge_device_close(dev);
    return rc;
}

/* ---------------------------------------------------------------- Q/K/V dumps */

typedef struct {
    const tr_config *cfg;
    const tr_dims *d;
    double time;
    FILE *manifest;
    float *q, *k, *v; /* [B, heads, N, hd] */
} dump_ctx;

static int dump_layer(void *ctx, int layer, const float *qkv, char *err, size_t err_len)
{
    dump_ctx *c = ctx;
    const tr_dims *d = c->d;
    size_t hd = (size_t)d->hd;
    for (int b = 0; b < d->B; b++)
        for (int h = 0; h < d->nh; h++)
            for (int n = 0; n < d->N; n++) {
                const float *src = qkv + ((size_t)b * d->N + n) * 3 * d->d + (size_t)h * hd; /* [B, N, 3, heads, hd] */
                size_t at = (((size_t)b * d->nh + h) * d->N + n) * hd;
                memcpy(c->q + at, src, hd * sizeof(float));
                memcpy(c->k + at, src + d->d, hd * sizeof(float));
                memcpy(c->v + at, src + 2 * d->d, hd * sizeof(float));
            }
    char name[64], path[700], meta[2048], tag[600];
    snprintf(name, sizeof name, "L%02d_t%.3f.safetensors", layer, c->time);
    snprintf(path, sizeof path, "%s/%s", c->cfg->dump_dir, name);
    json_escape(c->cfg->tag, tag, sizeof tag);
    snprintf(meta, sizeof meta,
             "{\"format\":\"sparge-train-qkv\",\"layer\":\"%d\",\"t\":\"%.6g\",\"block_q\":\"%d\",\"block_k\":\"%d\","
             "\"init\":\"%s\",\"tag\":\"%s\"}",
             layer, c->time, c->cfg->block_q, c->cfg->block_k, strrchr(c->cfg->init, '/') ? strrchr(c->cfg->init, '/') + 1
                                                                                            : c->cfg->init,
             tag);
    const char *names[3] = {"q", "k", "v"};
    const float *data[3] = {c->q, c->k, c->v};
    int ndims[3] = {4, 4, 4};
    int64_t shapes[3][8] = {{d->B, d->nh, d->N, d->hd}, {d->B, d->nh, d->N, d->hd}, {d->B, d->nh, d->N, d->hd}};
    if (exp_st_write(path, 3, names, data, ndims, (const int64_t(*)[8])shapes, SPARGE_F32, meta, err, err_len))
        return -1;
    fprintf(c->manifest, "%s,%d,%.6g,%d,%d,%d,%d,%d,%d\n", name, layer, c->time, d->B, d->nh, d->N, d->hd,
            c->cfg->block_q, c->cfg->block_k);
    return 0;
}

int tr_dump(const tr_config *cfg, char *err, size_t err_len)
{
    if (!cfg->dump_dir[0])
        return exp_fail(err, err_len, "mode=dump needs dump_dir=DIR");
    double times[32];
    int ntimes = 0;
    char list[sizeof cfg->dump_times];
    snprintf(list, sizeof list, "%s", cfg->dump_times);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        char *end;
        double t = strtod(tok, &end);
        if (end == tok || *end || !(t >= 0 && t <= 1) || ntimes == 32)
            return exp_fail(err, err_len, "dump_times=%s: up to 32 comma-separated times in [0, 1]", cfg->dump_times);
        times[ntimes++] = t;
    }
    if (!ntimes)
        return exp_fail(err, err_len, "dump_times is empty");
    if (mkdir(cfg->dump_dir, 0777) && errno != EEXIST)
        return exp_fail(err, err_len, "%s: cannot create: %s", cfg->dump_dir, strerror(errno));
    sparge_device *dev = NULL;
    tr_model *m = open_model(cfg, &dev, err, err_len);
    if (!m)
        return -1;
    print_record(cfg);
    const tr_dims *d = tr_model_dims(m);
    size_t per = (size_t)cfg->batch * d->T * d->H * d->W * d->C, qkv = (size_t)cfg->batch * d->N * d->d;
    float *buf = malloc((3 * per + 3 * qkv + cfg->batch) * sizeof(float));
    int *y = malloc((size_t)cfg->batch * sizeof(int)), rc = -1;
    char path[700];
    snprintf(path, sizeof path, "%s/manifest.csv", cfg->dump_dir);
    dump_ctx c = {cfg, d, 0, fopen(path, "w"), NULL, NULL, NULL};
    if (!buf || !y || !c.manifest) {
        exp_fail(err, err_len, !c.manifest ? "%s: cannot create" : "dump: out of memory", path);
        goto out;
    }
    fprintf(c.manifest, "file,layer,t,batch,heads,tokens,head_dim,block_q,block_k\n");
    float *x0 = buf, *eps = buf + per, *xt = buf + 2 * per, *t = buf + 3 * per + 3 * qkv;
    c.q = buf + 3 * per, c.k = c.q + qkv, c.v = c.k + qkv; /* each [B, heads, N, hd] = B·N·dim values */
    tr_config held_out = *cfg; /* the first held-out batch of mode=eval, at each of the times */
    snprintf(held_out.data, sizeof held_out.data, "A");
    tr_make_batch(&held_out, d, 1000000000, x0, y, t, eps, xt);
    tr_model_set_qkv_hook(m, dump_layer, &c);
    for (int i = 0; i < ntimes; i++) {
        c.time = times[i];
        size_t video = per / cfg->batch;
        for (int b = 0; b < cfg->batch; b++) {
            t[b] = (float)times[i];
            for (size_t j = b * video; j < (b + 1) * video; j++)
                xt[j] = (1.0f - t[b]) * x0[j] + t[b] * eps[j];
        }
        if (tr_model_forward(m, xt, t, y, NULL, err, err_len))
            goto out;
        fprintf(stderr, "dump: t = %.3f, %d layers written to %s\n", times[i], d->L, cfg->dump_dir);
    }
    rc = 0;
out:
    if (c.manifest)
        fclose(c.manifest);
    free(buf);
    free(y);
    tr_model_free(m);
    sparge_device_close(dev);
    return rc;
}
