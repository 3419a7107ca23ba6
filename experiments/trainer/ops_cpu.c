/* Host kernels of the model: GEMMs through CBLAS, the rest as plain loops. A CUDA path
 * replaces this file's functions one for one (cuBLAS for the GEMMs). */
#include <math.h>
#include <string.h>

#include <cblas.h>

#include "trainer.h"

void tr_linear_forward(float *out, const float *in, const float *w, const float *b, int rows, int IN, int OUT)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, OUT, IN, 1.0f, in, IN, w, IN, 0.0f, out, OUT);
    if (b)
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < OUT; o++)
                out[(size_t)r * OUT + o] += b[o];
}

void tr_linear_backward(float *din, float *dw, float *db, const float *dout, const float *in, const float *w,
                        int rows, int IN, int OUT, int accumulate)
{
    if (din)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, IN, OUT, 1.0f, dout, OUT, w, IN,
                    accumulate ? 1.0f : 0.0f, din, IN);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OUT, IN, rows, 1.0f, dout, OUT, in, IN, 1.0f, dw, IN);
    if (db)
        for (int r = 0; r < rows; r++)
            for (int o = 0; o < OUT; o++)
                db[o] += dout[(size_t)r * OUT + o];
}

void tr_layernorm_forward(float *xhat, float *rstd, const float *x, int rows, int d)
{
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

void tr_layernorm_backward(float *dx, const float *dxhat, const float *xhat, const float *rstd, int rows, int d)
{
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

/* tanh through expf: glibc's tanhf (via expm1f) took most of a CPU training step. Saturates
 * correctly (expf → inf gives 1, → 0 gives −1); absolute error ~1e-7 near 0, where GELU
 * multiplies it by x. */
static inline float fast_tanh(float z) { return 1.0f - 2.0f / (expf(2.0f * z) + 1.0f); }

float tr_gelu(float x)
{
    const float c = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + fast_tanh(c * (x + 0.044715f * x * x * x)));
}

float tr_gelu_grad(float x)
{
    const float c = 0.7978845608028654f;
    float th = fast_tanh(c * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

float tr_silu(float x) { return x / (1.0f + expf(-x)); }

float tr_silu_grad(float x)
{
    float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
}
