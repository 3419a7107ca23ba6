/* Seeded synthetic attention inputs (the model behind each family is
 * documented in experiments/README.md, "Input families").
 *
 * Dimension 0 of Q and K is reserved: the families leave it at zero and the
 * sink overlay writes it, so a sink's share of a pooled row can be set exactly
 * from the base pooled logits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

/* ---------------------------------------------------------------- RNG */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void exp_rng_seed(exp_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t exp_rng_next(exp_rng *r)
{
    uint64_t *s = r->s, out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double exp_rng_uniform(exp_rng *r) { return (double)(exp_rng_next(r) >> 11) * 0x1.0p-53; }

double exp_rng_normal(exp_rng *r)
{
    double u1 = exp_rng_uniform(r), u2 = exp_rng_uniform(r);
    return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

/* Independent stream per (seed, purpose, head). */
static void rng_for(exp_rng *r, uint64_t seed, uint64_t purpose, int64_t head)
{
    uint64_t x = seed ^ (purpose * 0xd1b54a32d192ed03ull) ^ ((uint64_t)head * 0x8cb92ba72f3d8dd7ull);
    exp_rng_seed(r, x);
}

/* ---------------------------------------------------------------- families */

const char *exp_family_name(exp_family f)
{
    switch (f) {
    case EXP_UNIFORM: return "uniform";
    case EXP_SINK: return "sink";
    case EXP_VIDEO: return "video";
    case EXP_FILE: return "file";
    }
    return "?";
}

int exp_family_parse(const char *name)
{
    for (int f = EXP_UNIFORM; f <= EXP_FILE; f++)
        if (strcmp(name, exp_family_name((exp_family)f)) == 0)
            return f;
    return -1;
}

void exp_gen_defaults(exp_family f, exp_gen_params *p)
{
    memset(p, 0, sizeof *p);
    p->family = f;
    p->B = 1;
    p->H = 2;
    p->N = 32768; /* the token count of Wan2.1-1.3B at 480p (32760), rounded to whole blocks */
    p->D = 64;
    p->block_q = 128;
    p->block_k = 64;
    p->seed = 1;
    p->value_mean = 1.0;
    p->value_block = 1.0;
    p->value_noise = 1.0;
    p->token_jitter = 0.5;
    p->tau_min = 0.1;
    p->tau_max = 0.5;
    p->sharpness = 6.0;
    p->len_seq = 64.0;
    p->grid_t = 21;
    p->grid_h = 30;
    p->grid_w = 52;
    p->len_t = 1.5;
    p->len_s = 8.0;
    p->value_len = 1.0;
    p->sink_blocks = f == EXP_VIDEO ? 0 : 1;
    p->sink_mass_min = f == EXP_UNIFORM ? 0.95 : 0.3;
    p->sink_mass_max = f == EXP_UNIFORM ? 0.95 : 0.8;
    p->sink_rows = f == EXP_UNIFORM ? 0.25 : 1.0;
    p->sink_value_scale = f == EXP_UNIFORM ? 1.0 : 0.1;
    if (f == EXP_VIDEO)
        p->N = (int64_t)p->grid_t * p->grid_h * p->grid_w;
}

void exp_qkv_free(exp_qkv *x)
{
    if (!x)
        return;
    free(x->q);
    free(x->k);
    free(x->v);
    free(x->sink_share);
    free(x->sink_index);
    memset(x, 0, sizeof *x);
}

/* Random Fourier features of a Gaussian kernel: phi(p)·phi(p') =
 * (2/M) Σ_m cos(w_m·(p − p')) ≈ exp(−|(p − p')/len|² / 2), and |phi(p)| = 1.
 * w_m ~ N(0, diag(1/len²)); pdim coordinates; M even. */
typedef struct {
    int M, pdim;
    double *w; /* [M/2][pdim] */
} rff;

static int rff_init(rff *f, int M, int pdim, const double *len, exp_rng *r)
{
    f->M = M;
    f->pdim = pdim;
    f->w = malloc(sizeof(double) * (size_t)(M / 2) * (size_t)pdim);
    if (!f->w)
        return -1;
    for (int m = 0; m < M / 2; m++)
        for (int a = 0; a < pdim; a++)
            f->w[m * pdim + a] = exp_rng_normal(r) / len[a];
    return 0;
}

static void rff_eval(const rff *f, const double *pos, double *phi)
{
    double norm = sqrt(2.0 / f->M);
    for (int m = 0; m < f->M / 2; m++) {
        double arg = 0.0;
        for (int a = 0; a < f->pdim; a++)
            arg += f->w[m * f->pdim + a] * pos[a];
        phi[2 * m] = norm * cos(arg);
        phi[2 * m + 1] = norm * sin(arg);
    }
}

static void position_of(const exp_gen_params *p, int64_t t, double *pos)
{
    if (p->family == EXP_VIDEO) {
        int64_t hw = (int64_t)p->grid_h * p->grid_w;
        pos[0] = (double)(t / hw);
        pos[1] = (double)((t % hw) / p->grid_w);
        pos[2] = (double)(t % p->grid_w);
    } else {
        pos[0] = (double)t;
    }
}

/* q, k, v of one head [N, D] (pointers into the [B,H,N,D] arrays). */
typedef struct {
    float *q, *k, *v;
} head_ptrs;

enum { PURPOSE_QK = 1, PURPOSE_V = 2, PURPOSE_SINK = 3, PURPOSE_FEATURES = 4 };

static int gen_uniform_head(const exp_gen_params *p, int64_t head, head_ptrs h)
{
    int64_t N = p->N, D = p->D, nqb = (N + p->block_q - 1) / p->block_q, nkb = (N + p->block_k - 1) / p->block_k;
    exp_rng r;
    rng_for(&r, p->seed, PURPOSE_QK, head);
    double *omega = malloc(sizeof(double) * (size_t)(nqb * D)), *kappa = malloc(sizeof(double) * (size_t)(nkb * D));
    double *tau = malloc(sizeof(double) * (size_t)nqb);
    if (!omega || !kappa || !tau) {
        free(omega);
        free(kappa);
        free(tau);
        return -1;
    }
    /* D-1 usable dimensions: scale so the pooled logit s·q̄·k̄ has std ≈ tau_i. */
    double fix = sqrt((double)D / (double)(D - 1));
    for (int64_t i = 0; i < nqb; i++) {
        tau[i] = exp(log(p->tau_min) + (log(p->tau_max) - log(p->tau_min)) * exp_rng_uniform(&r));
        for (int64_t d = 0; d < D; d++)
            omega[i * D + d] = d ? fix * exp_rng_normal(&r) : 0.0;
    }
    for (int64_t j = 0; j < nkb; j++)
        for (int64_t d = 0; d < D; d++)
            kappa[j * D + d] = d ? exp_rng_normal(&r) : 0.0;
    for (int64_t t = 0; t < N; t++) {
        int64_t i = t / p->block_q, j = t / p->block_k;
        for (int64_t d = 1; d < D; d++) {
            h.q[t * D + d] = (float)(tau[i] * (omega[i * D + d] + p->token_jitter * exp_rng_normal(&r)));
            h.k[t * D + d] = (float)(kappa[j * D + d] + p->token_jitter * exp_rng_normal(&r));
        }
        h.q[t * D] = h.k[t * D] = 0.0f;
    }
    /* values: DC + a component shared by each key block + token noise */
    rng_for(&r, p->seed, PURPOSE_V, head);
    for (int64_t d = 0; d < D; d++)
        omega[d] = p->value_mean * exp_rng_normal(&r); /* reuse omega[0..D) as the DC vector */
    for (int64_t j = 0; j < nkb * D; j++)
        kappa[j] = exp_rng_normal(&r);
    for (int64_t t = 0; t < N; t++) {
        int64_t j = t / p->block_k;
        for (int64_t d = 0; d < D; d++)
            h.v[t * D + d] =
                (float)(omega[d] + p->value_block * kappa[j * D + d] + p->value_noise * exp_rng_normal(&r));
    }
    free(omega);
    free(kappa);
    free(tau);
    return 0;
}

/* Locality base (1-D sequence for the sink family, T×H×W grid for video):
 * q_t = k_t (up to jitter) = a·phi(pos_t) in dims 1..M, with s·a² = sharpness,
 * so the token logit is sharpness·kernel(distance) plus noise. Values: DC +
 * a smooth random field of position (another RFF map) + token noise. */
static int gen_locality_head(const exp_gen_params *p, int64_t head, head_ptrs h)
{
    int64_t N = p->N, D = p->D;
    int M = (int)((D - 1) / 2 * 2), pdim = p->family == EXP_VIDEO ? 3 : 1;
    double len[3], vlen[3];
    if (pdim == 3) {
        len[0] = p->len_t;
        len[1] = len[2] = p->len_s;
    } else {
        len[0] = p->len_seq;
    }
    for (int a = 0; a < pdim; a++)
        vlen[a] = len[a] * p->value_len;
    exp_rng r;
    rng_for(&r, p->seed, PURPOSE_FEATURES, head);
    rff fq = {0}, fv = {0};
    double *phi = malloc(sizeof(double) * (size_t)M), *dc = malloc(sizeof(double) * (size_t)D);
    double *wv = malloc(sizeof(double) * (size_t)D * (size_t)M);
    int ok = phi && dc && wv && !rff_init(&fq, M, pdim, len, &r) && !rff_init(&fv, M, pdim, vlen, &r);
    if (ok) {
        for (int64_t i = 0; i < (int64_t)D * M; i++)
            wv[i] = exp_rng_normal(&r);
        for (int64_t d = 0; d < D; d++)
            dc[d] = p->value_mean * exp_rng_normal(&r);
        double a = sqrt(p->sharpness * sqrt((double)D)), jit = p->token_jitter * a / sqrt((double)M);
        exp_rng rq, rv;
        rng_for(&rq, p->seed, PURPOSE_QK, head);
        rng_for(&rv, p->seed, PURPOSE_V, head);
        for (int64_t t = 0; t < N; t++) {
            double pos[3];
            position_of(p, t, pos);
            rff_eval(&fq, pos, phi);
            float *q = h.q + t * D, *k = h.k + t * D, *v = h.v + t * D;
            memset(q, 0, sizeof(float) * (size_t)D);
            memset(k, 0, sizeof(float) * (size_t)D);
            for (int m = 0; m < M; m++) {
                q[1 + m] = (float)(a * phi[m] + jit * exp_rng_normal(&rq));
                k[1 + m] = (float)(a * phi[m] + jit * exp_rng_normal(&rq));
            }
            rff_eval(&fv, pos, phi);
            for (int64_t d = 0; d < D; d++) {
                double g = 0.0;
                for (int m = 0; m < M; m++)
                    g += wv[d * M + m] * phi[m];
                v[d] = (float)(dc[d] + p->value_block * g + p->value_noise * exp_rng_normal(&rv));
            }
        }
    }
    free(phi);
    free(dc);
    free(wv);
    free(fq.w);
    free(fv.w);
    return ok ? 0 : -1;
}

void exp_pooled_map_host(const exp_qkv *x, int block_q, int block_k, double scale, double *map)
{
    int64_t N = x->N, D = x->D, nqb = (N + block_q - 1) / block_q, nkb = (N + block_k - 1) / block_k;
    if (scale == 0.0)
        scale = 1.0 / sqrt((double)D);
    double *qb = malloc(sizeof(double) * (size_t)(nqb * D)), *kb = malloc(sizeof(double) * (size_t)(nkb * D));
    if (!qb || !kb) {
        free(qb);
        free(kb);
        for (int64_t i = 0; i < x->B * x->H * nqb * nkb; i++)
            map[i] = NAN;
        return;
    }
    for (int64_t bh = 0; bh < x->B * x->H; bh++) {
        const float *q = x->q + bh * N * D, *k = x->k + bh * N * D;
        for (int pass = 0; pass < 2; pass++) {
            const float *src = pass ? k : q;
            double *dst = pass ? kb : qb;
            int64_t blk = pass ? block_k : block_q, nb = pass ? nkb : nqb;
            for (int64_t i = 0; i < nb; i++) {
                int64_t t0 = i * blk, rows = t0 + blk <= N ? blk : N - t0;
                for (int64_t d = 0; d < D; d++) {
                    double s = 0.0;
                    for (int64_t r = 0; r < rows; r++)
                        s += src[(t0 + r) * D + d];
                    dst[i * D + d] = s / (double)rows;
                }
            }
        }
        for (int64_t i = 0; i < nqb; i++) {
            double *row = map + (bh * nqb + i) * nkb, mx = -INFINITY, sum = 0.0;
            for (int64_t j = 0; j < nkb; j++) {
                double dot = 0.0;
                for (int64_t d = 0; d < D; d++)
                    dot += qb[i * D + d] * kb[j * D + d];
                row[j] = dot * scale;
                mx = row[j] > mx ? row[j] : mx;
            }
            for (int64_t j = 0; j < nkb; j++)
                sum += (row[j] = exp(row[j] - mx));
            for (int64_t j = 0; j < nkb; j++)
                row[j] /= sum;
        }
    }
    free(qb);
    free(kb);
}

/* Sink overlay: key blocks sink_index[] get k[0] = sqrt(D) on every token
 * (so s·k[0] = 1) and query block i gets q[0] = gamma_i on every token, with
 * gamma_i solved from the base pooled logits so that the sinks carry exactly
 * share_i of pooled row i:  e^gamma·A_i / (e^gamma·A_i + B_i) = share_i. */
static int add_sinks(const exp_gen_params *p, exp_qkv *x)
{
    int64_t N = x->N, D = x->D, nqb = (N + p->block_q - 1) / p->block_q, nkb = (N + p->block_k - 1) / p->block_k;
    int ns = p->sink_blocks;
    if (ns > nkb)
        ns = (int)nkb;
    x->sink_blocks = ns;
    x->sink_index = malloc(sizeof(int32_t) * (size_t)ns);
    x->sink_share = malloc(sizeof(double) * (size_t)(x->B * x->H * nqb));
    double *map = malloc(sizeof(double) * (size_t)(x->B * x->H * nqb * nkb));
    uint8_t *is_sink = calloc((size_t)nkb, 1);
    if (!x->sink_index || !x->sink_share || !map || !is_sink) {
        free(map);
        free(is_sink);
        return -1;
    }
    for (int s = 0; s < ns; s++) {
        x->sink_index[s] = (int32_t)((int64_t)s * nkb / ns);
        is_sink[x->sink_index[s]] = 1;
    }
    exp_pooled_map_host(x, p->block_q, p->block_k, 0.0, map); /* base map: dim 0 is still zero */
    double beta = sqrt((double)D);
    for (int64_t bh = 0; bh < x->B * x->H; bh++) {
        exp_rng r;
        rng_for(&r, p->seed, PURPOSE_SINK, bh);
        float *q = x->q + bh * N * D, *k = x->k + bh * N * D, *v = x->v + bh * N * D;
        for (int64_t t = 0; t < N; t++)
            if (is_sink[t / p->block_k]) {
                k[t * D] = (float)beta;
                for (int64_t d = 0; d < D; d++)
                    v[t * D + d] *= (float)p->sink_value_scale;
            }
        for (int64_t i = 0; i < nqb; i++) {
            const double *row = map + (bh * nqb + i) * nkb;
            double a = 0.0, b = 0.0;
            for (int64_t j = 0; j < nkb; j++)
                *(is_sink[j] ? &a : &b) += row[j];
            double share = p->sink_mass_min + (p->sink_mass_max - p->sink_mass_min) * exp_rng_uniform(&r);
            int on = exp_rng_uniform(&r) < p->sink_rows;
            x->sink_share[bh * nqb + i] = on ? share : -1.0;
            double gamma = on && b > 0.0 ? log(share / (1.0 - share) * b / a) : 0.0;
            int64_t t0 = i * p->block_q, t1 = t0 + p->block_q < N ? t0 + p->block_q : N;
            for (int64_t t = t0; t < t1; t++)
                q[t * D] = (float)gamma;
        }
    }
    free(map);
    free(is_sink);
    return 0;
}

int exp_generate(const exp_gen_params *p, exp_qkv *out)
{
    memset(out, 0, sizeof *out);
    exp_gen_params g = *p;
    if (g.family == EXP_VIDEO)
        g.N = (int64_t)g.grid_t * g.grid_h * g.grid_w;
    if (g.family == EXP_FILE || g.B <= 0 || g.H <= 0 || g.N <= 0 || g.D < 4 || g.block_q <= 0 || g.block_k <= 0) {
        fprintf(stderr, "exp_generate: bad parameters (family %s, B=%lld H=%lld N=%lld D=%lld; D must be >= 4)\n",
                exp_family_name(g.family), (long long)g.B, (long long)g.H, (long long)g.N, (long long)g.D);
        return -1;
    }
    if (g.family == EXP_UNIFORM && !(g.tau_min > 0.0 && g.tau_max >= g.tau_min)) {
        fprintf(stderr, "exp_generate: need 0 < tau_min <= tau_max (got %g, %g)\n", g.tau_min, g.tau_max);
        return -1;
    }
    if (g.sink_blocks > 0 && !(g.sink_mass_min > 0.0 && g.sink_mass_max < 1.0 && g.sink_mass_min <= g.sink_mass_max &&
                               g.sink_rows >= 0.0 && g.sink_rows <= 1.0)) {
        fprintf(stderr, "exp_generate: sink mass range must satisfy 0 < min <= max < 1 (got %g, %g)\n",
                g.sink_mass_min, g.sink_mass_max);
        return -1;
    }
    size_t n = (size_t)(g.B * g.H * g.N * g.D);
    out->B = g.B;
    out->H = g.H;
    out->N = g.N;
    out->D = g.D;
    out->q = malloc(n * sizeof(float));
    out->k = malloc(n * sizeof(float));
    out->v = malloc(n * sizeof(float));
    int rc = out->q && out->k && out->v ? 0 : -1;
    for (int64_t bh = 0; !rc && bh < g.B * g.H; bh++) {
        size_t off = (size_t)(bh * g.N * g.D);
        head_ptrs h = {out->q + off, out->k + off, out->v + off};
        rc = g.family == EXP_UNIFORM ? gen_uniform_head(&g, bh, h) : gen_locality_head(&g, bh, h);
    }
    if (!rc && g.sink_blocks > 0)
        rc = add_sinks(&g, out);
    if (rc) {
        fprintf(stderr, "exp_generate: out of host memory\n");
        exp_qkv_free(out);
        return -1;
    }
    snprintf(out->name, sizeof out->name, "%s",
             g.family == EXP_UNIFORM && g.sink_blocks > 0 ? "uniform+hubs" : exp_family_name(g.family));
    if (g.family == EXP_VIDEO)
        snprintf(out->label, sizeof out->label, "video %dx%dx%d%s", g.grid_t, g.grid_h, g.grid_w,
                 g.sink_blocks ? " + sinks" : "");
    else
        snprintf(out->label, sizeof out->label, "%s N=%lld", out->name, (long long)g.N);
    return 0;
}

static void block_center(int64_t t0, int64_t rows, int grid_h, int grid_w, double *c)
{
    c[0] = c[1] = c[2] = 0.0;
    int64_t hw = (int64_t)grid_h * grid_w;
    for (int64_t t = t0; t < t0 + rows; t++) {
        c[0] += (double)(t / hw);
        c[1] += (double)((t % hw) / grid_w);
        c[2] += (double)(t % grid_w);
    }
    for (int a = 0; a < 3; a++)
        c[a] /= (double)rows;
}

void exp_map_summarize(const exp_qkv *x, const double *map, int block_q, int block_k, int grid_t, int grid_h,
                       int grid_w, exp_map_summary *out)
{
    int64_t N = x->N, nqb = (N + block_q - 1) / block_q, nkb = (N + block_k - 1) / block_k, rows = x->B * x->H * nqb;
    exp_map_summary s = {0.0, INFINITY, -INFINITY, 0.0, 0.0, 0.0, NAN, NAN};
    double sink_sum = 0.0, loc_num = 0.0, loc_den = 0.0;
    int64_t sink_rows = 0;
    int video = grid_t > 0 && (int64_t)grid_t * grid_h * grid_w == N;
    double *kc = video ? malloc(sizeof(double) * 3 * (size_t)nkb) : NULL;
    if (kc)
        for (int64_t j = 0; j < nkb; j++)
            block_center(j * block_k, j * block_k + block_k <= N ? block_k : N - j * block_k, grid_h, grid_w,
                         kc + 3 * j);
    for (int64_t r = 0; r < rows; r++) {
        const double *row = map + r * nkb;
        double h = 0.0, mx = 0.0, mn = INFINITY, sink = 0.0;
        for (int64_t j = 0; j < nkb; j++) {
            if (row[j] > 0.0)
                h -= row[j] * log(row[j]);
            mx = row[j] > mx ? row[j] : mx;
            mn = row[j] < mn ? row[j] : mn;
        }
        h /= log((double)nkb);
        s.entropy_mean += h / (double)rows;
        s.entropy_min = h < s.entropy_min ? h : s.entropy_min;
        s.entropy_max = h > s.entropy_max ? h : s.entropy_max;
        double ratio = mn > 0.0 ? mx / mn : INFINITY;
        s.flat_ratio_max = ratio > s.flat_ratio_max ? ratio : s.flat_ratio_max;
        s.top1_mean += mx / (double)rows;
        if (x->sink_share && x->sink_share[r] >= 0.0) {
            for (int sb = 0; sb < x->sink_blocks; sb++)
                sink += row[x->sink_index[sb]];
            double err = fabs(sink - x->sink_share[r]);
            s.sink_err_max = err > s.sink_err_max ? err : s.sink_err_max;
            sink_sum += sink;
            sink_rows++;
        }
        if (kc) {
            int64_t i = r % nqb, t0 = i * block_q;
            double qc[3], wsum = 0.0, usum = 0.0;
            block_center(t0, t0 + block_q <= N ? block_q : N - t0, grid_h, grid_w, qc);
            for (int64_t j = 0; j < nkb; j++) {
                double d = 0.0;
                for (int a = 0; a < 3; a++)
                    d += (qc[a] - kc[3 * j + a]) * (qc[a] - kc[3 * j + a]);
                d = sqrt(d);
                wsum += row[j] * d;
                usum += d / (double)nkb;
            }
            loc_num += wsum;
            loc_den += usum;
        }
    }
    s.sink_share_mean = sink_rows ? sink_sum / (double)sink_rows : NAN;
    if (kc)
        s.locality = loc_num / loc_den;
    free(kc);
    *out = s;
}
