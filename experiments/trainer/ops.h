/* The operations of sparge-train's model and optimizer other than attention, behind one table, so
 * that dit.c and train.c run the same forward, backward and AdamW on the host (ops_cpu.c: CBLAS and
 * loops) or on a CUDA device (ops_cuda.cu: cuBLAS and kernels, every tensor resident on the device).
 *
 * Every tensor argument is memory of the table (alloc): host memory for the host table, device
 * memory for CUDA. Device operations are queued on the device's default stream, the one sparge's
 * attention runs on, so they are ordered with it. A failure is sticky: the first message is kept,
 * later operations do nothing (reductions report 0) and `error` returns it. Row-major throughout:
 * activations [rows, features], Linear weights [OUT, IN] (PyTorch's layout). */
#ifndef SPARGE_TRAINER_OPS_H
#define SPARGE_TRAINER_OPS_H

#include <stddef.h>
#include <stdint.h>

/* Parts of a training step, timed separately: the sparge calls, the GEMMs (Linear layers with their
 * bias), and everything else the model and the optimizer do. Idle: not counted (the work in between
 * calls of the model, such as another model's on the same device). */
typedef enum { TR_PART_OTHER = 0, TR_PART_GEMM, TR_PART_ATTENTION, TR_PARTS, TR_PART_IDLE = TR_PARTS } tr_part;

typedef struct tr_ops tr_ops;
struct tr_ops {
    const char *name; /* "host" or "cuda" */
    void (*destroy)(tr_ops *ops);
    /* failure: -1 with the first message in err; 0 when every operation so far succeeded */
    int (*error)(tr_ops *ops, char *err, size_t err_len);

    /* memory: alloc returns zeroed memory, or NULL (the failure is recorded); the copies to and
     * from the host return when the host buffer may be reused */
    void *(*alloc)(tr_ops *ops, size_t bytes);
    void (*release)(tr_ops *ops, void *p);
    void (*upload)(tr_ops *ops, void *dst, const void *src_host, size_t bytes);
    void (*download)(tr_ops *ops, void *dst_host, const void *src, size_t bytes);
    void (*zero)(tr_ops *ops, void *dst, size_t bytes);
    void (*copy)(tr_ops *ops, float *dst, const float *src, size_t n);

    /* timers: work issued from now on counts to `part` (clock on the host, events on the device);
     * times writes the milliseconds per part since the last call (waiting for the device) and
     * leaves the timer idle */
    void (*mark)(tr_ops *ops, tr_part part);
    void (*times)(tr_ops *ops, double ms[TR_PARTS]);

    /* out[rows, OUT] = in[rows, IN] · wᵀ + b (b may be NULL) */
    void (*linear_forward)(tr_ops *ops, float *out, const float *in, const float *w, const float *b, int rows,
                           int IN, int OUT);
    /* din = dout · w (overwritten, or added when accumulate; may be NULL), dw += doutᵀ · in, db += Σ_rows dout
     * (db may be NULL) */
    void (*linear_backward)(tr_ops *ops, float *din, float *dw, float *db, const float *dout, const float *in,
                            const float *w, int rows, int IN, int OUT, int accumulate);
    /* LayerNorm without affine, eps 1e-6, statistics in double: xhat, and the per-row rstd */
    void (*layernorm_forward)(tr_ops *ops, float *xhat, float *rstd, const float *x, int rows, int d);
    /* dx += rstd · (dxhat − mean(dxhat) − xhat · mean(dxhat ∘ xhat)) per row */
    void (*layernorm_backward)(tr_ops *ops, float *dx, const float *dxhat, const float *xhat, const float *rstd,
                               int rows, int d);
    /* h = xhat·(1 + scale[b]) + shift[b] over [B, N, d]; shift and scale rows have stride ms */
    void (*modulate_forward)(tr_ops *ops, float *h, const float *xhat, const float *shift, const float *scale,
                             int ms, int B, int N, int d);
    /* dxhat = dh·(1 + scale) (overwritten); dshift += Σ_n dh; dscale += Σ_n dh·xhat */
    void (*modulate_backward)(tr_ops *ops, float *dxhat, float *dshift, float *dscale, const float *dh,
                              const float *xhat, const float *scale, int ms, int B, int N, int d);
    /* out = in + gate[b]·y */
    void (*gated_add)(tr_ops *ops, float *out, const float *in, const float *gate, const float *y, int ms, int B,
                      int N, int d);
    /* dy = dout·gate (overwritten); dgate += Σ_n dout·y */
    void (*gated_add_backward)(tr_ops *ops, float *dy, float *dgate, const float *dout, const float *gate,
                               const float *y, int ms, int B, int N, int d);
    /* GELU (tanh approximation) and SiLU: out = f(x); the backward multiplies g in place by f'(x) */
    void (*gelu_forward)(tr_ops *ops, float *out, const float *x, size_t n);
    void (*gelu_backward)(tr_ops *ops, float *g, const float *x, size_t n);
    void (*silu_forward)(tr_ops *ops, float *out, const float *x, size_t n);
    void (*silu_backward)(tr_ops *ops, float *g, const float *x, size_t n);
    /* video [B,T,H,W,C] <-> tokens [B, T·(H/2)·(W/2), 4C]: 1x2x2 patches in raster order, values (py, px, c) */
    void (*patchify)(tr_ops *ops, float *tokens, const float *video, int B, int T, int H, int W, int C);
    void (*unpatchify)(tr_ops *ops, float *video, const float *tokens, int B, int T, int H, int W, int C);
    /* x[b] += pos for each of B rows of n values */
    void (*add_positional)(tr_ops *ops, float *x, const float *pos, int B, size_t n);
    /* out[b] = (cos(1000·t[b]·ω_i), sin(1000·t[b]·ω_i)), ω_i = 10000^(−i/(F/2)), i < F/2 */
    void (*timestep_embedding)(tr_ops *ops, float *out, const float *t, int B, int F);
    /* c[b] += table[y[b]]; cs = SiLU(c) */
    void (*class_embedding_forward)(tr_ops *ops, float *c, float *cs, const float *table, const int *y, int B,
                                    int d);
    /* dcs *= SiLU'(c) (in place, it becomes dc); dtable[y[b]] += dc[b] */
    void (*class_embedding_backward)(tr_ops *ops, float *dtable, float *dcs, const float *c, const int *y, int B,
                                     int d);
    /* mean((u − target)²) accumulated in double into *loss; du = 2(u − target)/n when du is not NULL */
    void (*mse)(tr_ops *ops, float *du, const float *u, const float *target, size_t n, double *loss);
    /* Σ|a − ref| and Σ|ref| in double */
    void (*abs_diff_sums)(tr_ops *ops, const float *a, const float *ref, size_t n, double *diff, double *refsum);
    /* Σ x² in double; x *= s */
    void (*sum_squares)(tr_ops *ops, const float *x, size_t n, double *out);
    void (*scale)(tr_ops *ops, float *x, size_t n, float s);
    /* bf16 (round to nearest even, as sparge_f32_to_bf16) and back */
    void (*to_bf16)(tr_ops *ops, uint16_t *dst, const float *src, size_t n);
    void (*from_bf16)(tr_ops *ops, float *dst, const uint16_t *src, size_t n);
    /* AdamW on one tensor of n values, in double: m = β1·m + (1−β1)·g, v = β2·v + (1−β2)·g²,
     * p −= lr·((m/c1) / (√(v/c2) + eps) + decay·p), c1/c2 the bias corrections */
    void (*adamw)(tr_ops *ops, float *p, const float *g, float *m, float *v, size_t n, double lr, double beta1,
                  double beta2, double c1, double c2, double eps, double decay);
};

/* The host table (ops_cpu.c). NULL when out of memory. */
tr_ops *tr_ops_cpu_create(void);
/* Whether this build has the CUDA table (configure found CUDA and cuBLAS). */
int tr_ops_cuda_available(void);
/* The CUDA table on device `index`; tf32: cuBLAS may use TF32 tensor cores (else strict fp32).
 * NULL with a message when CUDA fails or the table is not built. */
tr_ops *tr_ops_cuda_create(int index, int tf32, char *err, size_t err_len);

#endif
