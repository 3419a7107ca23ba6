/* The host table of ops.h: GEMMs through CBLAS, the rest as plain loops (LayerNorm and GELU over
 * OpenMP threads). ops_cuda.cu implements the same table on a CUDA device, one for one. A build without
 * CBLAS (one for CUDA devices, m4/sparge_blas.m4) runs the GEMMs as plain loops too: correct, not fast. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef SPARGE_TRAINER_CBLAS
#include <cblas.h>
#endif

#include "exp.h"
#include "ops.h"
#include "sparge.h"
#include "trainer.h"

typedef struct {
    tr_ops ops;
    tr_part part;   /* what the time since `since` counts to */
    double since;   /* exp_now() of the last mark */
    double ms[TR_PARTS];
} cpu_ops;

static void mark(tr_ops *o, tr_part part)
{
    cpu_ops *c = (cpu_ops *)o;
    double now = exp_now();
    if (c->part != TR_PART_IDLE)
        c->ms[c->part] += 1e3 * (now - c->since);
    c->since = now;
    c->part = part;
}

static void times(tr_ops *o, double ms[TR_PARTS])
{
    cpu_ops *c = (cpu_ops *)o;
    mark(o, TR_PART_IDLE);
    for (int i = 0; i < TR_PARTS; i++)
        ms[i] = c->ms[i], c->ms[i] = 0.0;
}

static void destroy(tr_ops *o) { free(o); }
static int error(tr_ops *o, char *err, size_t err_len) { return (void)o, (void)err, (void)err_len, 0; }
static void *alloc(tr_ops *o, size_t bytes) { return (void)o, calloc(1, bytes ? bytes : 1); }
static void release(tr_ops *o, void *p) { (void)o, free(p); }
static void upload(tr_ops *o, void *dst, const void *src, size_t bytes) { (void)o, memcpy(dst, src, bytes); }
static void download(tr_ops *o, void *dst, const void *src, size_t bytes) { (void)o, memcpy(dst, src, bytes); }
static void zero(tr_ops *o, void *dst, size_t bytes) { mark(o, TR_PART_OTHER), memset(dst, 0, bytes); }
static void copy(tr_ops *o, float *dst, const float *src, size_t n) { (void)o, memcpy(dst, src, n * sizeof *dst); }

#ifdef SPARGE_TRAINER_CBLAS
/* out[rows, OUT] = in · wᵀ */
static void gemm_in_wt(float *out, const float *in, const float *w, int rows, int IN, int OUT)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, OUT, IN, 1.0f, in, IN, w, IN, 0.0f, out, OUT);
}

/* din[rows, IN] = dout · w (+ din when accumulate) */
static void gemm_dout_w(float *din, const float *dout, const float *w, int rows, int IN, int OUT, int accumulate)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, IN, OUT, 1.0f, dout, OUT, w, IN,
                accumulate ? 1.0f : 0.0f, din, IN);
}

/* dw[OUT, IN] += doutᵀ · in */
static void gemm_doutt_in(float *dw, const float *dout, const float *in, int rows, int IN, int OUT)
{
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OUT, IN, rows, 1.0f, dout, OUT, in, IN, 1.0f, dw, IN);
}
#else
static void gemm_in_wt(float *out, const float *in, const float *w, int rows, int IN, int OUT)
{
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < OUT; j++) {
            float acc = 0.0f;
            for (int k = 0; k < IN; k++)
                acc += in[(size_t)r * IN + k] * w[(size_t)j * IN + k];
            out[(size_t)r * OUT + j] = acc;
        }
}

static void gemm_dout_w(float *din, const float *dout, const float *w, int rows, int IN, int OUT, int accumulate)
{
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *d = din + (size_t)r * IN;
        if (!accumulate)
            memset(d, 0, (size_t)IN * sizeof *d);
        for (int j = 0; j < OUT; j++) {
            const float g = dout[(size_t)r * OUT + j], *wj = w + (size_t)j * IN;
            for (int i = 0; i < IN; i++)
                d[i] += g * wj[i];
        }
    }
}

static void gemm_doutt_in(float *dw, const float *dout, const float *in, int rows, int IN, int OUT)
{
#pragma omp parallel for schedule(static)
    for (int j = 0; j < OUT; j++) {
        float *d = dw + (size_t)j * IN;
        for (int r = 0; r < rows; r++) {
            const float g = dout[(size_t)r * OUT + j], *x = in + (size_t)r * IN;
            for (int i = 0; i < IN; i++)
                d[i] += g * x[i];
        }
    }
}
#endif

static void linear_forward(tr_ops *o, float *out, const float *in, const float *w, const float *b, int rows, int IN,
                           int OUT)
{
    mark(o, TR_PART_GEMM);
    gemm_in_wt(out, in, w, rows, IN, OUT);
    if (b)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < OUT; j++)
                out[(size_t)r * OUT + j] += b[j];
}

static void linear_backward(tr_ops *o, float *din, float *dw, float *db, const float *dout, const float *in,
                            const float *w, int rows, int IN, int OUT, int accumulate)
{
    mark(o, TR_PART_GEMM);
    if (din)
        gemm_dout_w(din, dout, w, rows, IN, OUT, accumulate);
    gemm_doutt_in(dw, dout, in, rows, IN, OUT);
    if (db)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < OUT; j++)
                db[j] += dout[(size_t)r * OUT + j];
}

static void layernorm_forward(tr_ops *o, float *xhat, float *rstd, const float *x, int rows, int d)
{
    mark(o, TR_PART_OTHER);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * d;
        double mean = 0.0, var = 0.0;
        for (int i = 0; i < d; i++)
            mean += xr[i];
        mean /= d;
        for (int i = 0; i < d; i++)
            var += (xr[i] - mean) * (xr[i] - mean);
        var /= d;
        float rs = (float)(1.0 / sqrt(var + 1e-6));
        for (int i = 0; i < d; i++)
            xhat[(size_t)r * d + i] = (float)((xr[i] - mean) * rs);
        rstd[r] = rs;
    }
}

static void layernorm_backward(tr_ops *o, float *dx, const float *dxhat, const float *xhat, const float *rstd,
                               int rows, int d)
{
    mark(o, TR_PART_OTHER);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *g = dxhat + (size_t)r * d, *xh = xhat + (size_t)r * d;
        double mean_g = 0.0, mean_gx = 0.0;
        for (int i = 0; i < d; i++) {
            mean_g += g[i];
            mean_gx += (double)g[i] * xh[i];
        }
        mean_g /= d;
        mean_gx /= d;
        for (int i = 0; i < d; i++)
            dx[(size_t)r * d + i] += (float)(rstd[r] * (g[i] - mean_g - xh[i] * mean_gx));
    }
}

static void modulate_forward(tr_ops *o, float *h, const float *xhat, const float *shift, const float *scale, int ms,
                             int B, int N, int d)
{
    mark(o, TR_PART_OTHER);
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            size_t r = ((size_t)b * N + n) * d;
            for (int i = 0; i < d; i++)
                h[r + i] = xhat[r + i] * (1.0f + scale[(size_t)b * ms + i]) + shift[(size_t)b * ms + i];
        }
}

static void modulate_backward(tr_ops *o, float *dxhat, float *dshift, float *dscale, const float *dh,
                              const float *xhat, const float *scale, int ms, int B, int N, int d)
{
    mark(o, TR_PART_OTHER);
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

static void gated_add(tr_ops *o, float *out, const float *in, const float *gate, const float *y, int ms, int B,
                      int N, int d)
{
    mark(o, TR_PART_OTHER);
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            size_t r = ((size_t)b * N + n) * d;
            for (int i = 0; i < d; i++)
                out[r + i] = in[r + i] + gate[(size_t)b * ms + i] * y[r + i];
        }
}

static void gated_add_backward(tr_ops *o, float *dy, float *dgate, const float *dout, const float *gate,
                               const float *y, int ms, int B, int N, int d)
{
    mark(o, TR_PART_OTHER);
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            size_t r = ((size_t)b * N + n) * d;
            for (int i = 0; i < d; i++) {
                dy[r + i] = dout[r + i] * gate[(size_t)b * ms + i];
                dgate[(size_t)b * ms + i] += dout[r + i] * y[r + i];
            }
        }
}

/* tanh through expf: glibc's tanhf (via expm1f) took most of a CPU training step. Saturates
 * correctly (expf → inf gives 1, → 0 gives −1); absolute error ~1e-7 near 0, where GELU
 * multiplies it by x. ops_cuda.cu uses the same formulas. */
static inline float fast_tanh(float z) { return 1.0f - 2.0f / (expf(2.0f * z) + 1.0f); }

static inline float gelu(float x)
{
    const float c = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + fast_tanh(c * (x + 0.044715f * x * x * x)));
}

static inline float gelu_grad(float x)
{
    const float c = 0.7978845608028654f;
    float th = fast_tanh(c * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline float silu_grad(float x)
{
    float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
}

static void gelu_forward(tr_ops *o, float *out, const float *x, size_t n)
{
    mark(o, TR_PART_OTHER);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)n; i++)
        out[i] = gelu(x[i]);
}

static void gelu_backward(tr_ops *o, float *g, const float *x, size_t n)
{
    mark(o, TR_PART_OTHER);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)n; i++)
        g[i] *= gelu_grad(x[i]);
}

static void silu_forward(tr_ops *o, float *out, const float *x, size_t n)
{
    mark(o, TR_PART_OTHER);
    for (size_t i = 0; i < n; i++)
        out[i] = silu(x[i]);
}

static void silu_backward(tr_ops *o, float *g, const float *x, size_t n)
{
    mark(o, TR_PART_OTHER);
    for (size_t i = 0; i < n; i++)
        g[i] *= silu_grad(x[i]);
}

/* Token `token` (of B·T·Hp·Wp) holds the 2x2 patch at (2y, 2x) of its frame: the video offsets of its
 * four pixels. A permutation, so unpatchify is also patchify's adjoint. */
static void patch_offsets(size_t token, int H, int W, int C, size_t *off)
{
    size_t Wp = (size_t)W / 2, Hp = (size_t)H / 2;
    size_t x = token % Wp, y = token / Wp % Hp, bt = token / (Wp * Hp); /* bt = b*T + t */
    for (int py = 0; py < 2; py++)
        for (int px = 0; px < 2; px++)
            off[py * 2 + px] = ((bt * H + 2 * y + py) * W + 2 * x + px) * C;
}

static void patchify(tr_ops *o, float *tokens, const float *video, int B, int T, int H, int W, int C)
{
    mark(o, TR_PART_OTHER);
    for (size_t tok = 0; tok < (size_t)B * T * (H / 2) * (W / 2); tok++) {
        size_t off[4];
        patch_offsets(tok, H, W, C, off);
        for (int q = 0; q < 4; q++)
            memcpy(tokens + tok * 4 * C + q * C, video + off[q], (size_t)C * sizeof(float));
    }
}

static void unpatchify(tr_ops *o, float *video, const float *tokens, int B, int T, int H, int W, int C)
{
    mark(o, TR_PART_OTHER);
    for (size_t tok = 0; tok < (size_t)B * T * (H / 2) * (W / 2); tok++) {
        size_t off[4];
        patch_offsets(tok, H, W, C, off);
        for (int q = 0; q < 4; q++)
            memcpy(video + off[q], tokens + tok * 4 * C + q * C, (size_t)C * sizeof(float));
    }
}

static void add_positional(tr_ops *o, float *x, const float *pos, int B, size_t n)
{
    mark(o, TR_PART_OTHER);
    for (int b = 0; b < B; b++)
        for (size_t i = 0; i < n; i++)
            x[(size_t)b * n + i] += pos[i];
}

static void timestep_embedding(tr_ops *o, float *out, const float *t, int B, int F)
{
    mark(o, TR_PART_OTHER);
    int half = F / 2;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < half; i++) {
            double arg = 1000.0 * t[b] * exp(-log(10000.0) * i / half);
            out[(size_t)b * F + i] = (float)cos(arg);
            out[(size_t)b * F + half + i] = (float)sin(arg);
        }
}

static void class_embedding_forward(tr_ops *o, float *c, float *cs, const float *table, const int *y, int B, int d)
{
    mark(o, TR_PART_OTHER);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < d; i++) {
            c[(size_t)b * d + i] += table[(size_t)y[b] * d + i];
            cs[(size_t)b * d + i] = silu(c[(size_t)b * d + i]);
        }
}

static void class_embedding_backward(tr_ops *o, float *dtable, float *dcs, const float *c, const int *y, int B,
                                     int d)
{
    mark(o, TR_PART_OTHER);
    for (int i = 0; i < B * d; i++)
        dcs[i] *= silu_grad(c[i]);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < d; i++)
            dtable[(size_t)y[b] * d + i] += dcs[(size_t)b * d + i];
}

static void mse(tr_ops *o, float *du, const float *u, const float *target, size_t n, double *loss)
{
    mark(o, TR_PART_OTHER);
    *loss = tr_mse(u, target, n, du);
}

static void abs_diff_sums(tr_ops *o, const float *a, const float *ref, size_t n, double *diff, double *refsum)
{
    mark(o, TR_PART_OTHER);
    double sd = 0, sr = 0;
    for (size_t i = 0; i < n; i++) {
        sd += fabs((double)a[i] - ref[i]);
        sr += fabs((double)ref[i]);
    }
    *diff = sd, *refsum = sr;
}

static void sum_squares(tr_ops *o, const float *x, size_t n, double *out)
{
    mark(o, TR_PART_OTHER);
    double ss = 0.0;
    for (size_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    *out = ss;
}

static void scale(tr_ops *o, float *x, size_t n, float s)
{
    mark(o, TR_PART_OTHER);
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
}

static void to_bf16(tr_ops *o, uint16_t *dst, const float *src, size_t n)
{
    mark(o, TR_PART_OTHER);
    for (size_t i = 0; i < n; i++)
        dst[i] = sparge_f32_to_bf16(src[i]);
}

static void from_bf16(tr_ops *o, float *dst, const uint16_t *src, size_t n)
{
    mark(o, TR_PART_OTHER);
    for (size_t i = 0; i < n; i++)
        dst[i] = sparge_bf16_to_f32(src[i]);
}

static void adamw(tr_ops *o, float *p, const float *g, float *m, float *v, size_t n, double lr, double beta1,
                  double beta2, double c1, double c2, double eps, double decay)
{
    mark(o, TR_PART_OTHER);
    for (size_t j = 0; j < n; j++) {
        m[j] = (float)(beta1 * m[j] + (1 - beta1) * g[j]);
        v[j] = (float)(beta2 * v[j] + (1 - beta2) * (double)g[j] * g[j]);
        double update = (m[j] / c1) / (sqrt(v[j] / c2) + eps);
        p[j] = (float)(p[j] - lr * (update + decay * p[j]));
    }
}

tr_ops *tr_ops_cpu_create(void)
{
    cpu_ops *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->ops = (tr_ops){
        "host", destroy, error, alloc, release, upload, download, zero, copy, mark, times, linear_forward,
        linear_backward, layernorm_forward, layernorm_backward, modulate_forward, modulate_backward, gated_add,
        gated_add_backward, gelu_forward, gelu_backward, silu_forward, silu_backward, patchify, unpatchify,
        add_positional, timestep_embedding, class_embedding_forward, class_embedding_backward, mse, abs_diff_sums,
        sum_squares, scale, to_bf16, from_bf16, adamw,
    };
    c->part = TR_PART_IDLE;
    c->since = exp_now();
    return &c->ops;
}
