/* f32 micro-kernels of the cpu tier. One source (simd.c) is compiled once per
 * ISA tier (generic C, AVX2+FMA+F16C, AVX-512); backend.c picks the
 * widest the CPU supports at run time, so the build never requires AVX-512 of
 * the machine it runs on. */
#ifndef SPARGE_SIMD_H
#define SPARGE_SIMD_H

#include <stdint.h>

#include "sparge.h"

typedef struct {
    const char *name;
    /* C[m×n] = A·B, or with accumulate C = diag(c_scale)·C + A·B (c_scale NULL: C += A·B).
     * A(i,p) = a[i·sai + p·sap], so A may be row-major or transposed; B is row-major [k×n]
     * (ldb), C row-major (ldc). Any m, n, k ≥ 0. */
    void (*gemm)(int64_t m, int64_t n, int64_t k, const float *a, int64_t sai, int64_t sap, const float *b,
                 int64_t ldb, float *c, int64_t ldc, int accumulate, const float *c_scale);
    /* One online-softmax step over the columns of S [rows×n] (row stride lds), one column per query:
     * m' = max(m, max_r S[r][c]); corr[c] = exp(m − m'); S[r][c] = exp(S[r][c] − m');
     * l[c] = l[c]·corr[c] + Σ_r S[r][c]; m[c] = m'. */
    void (*softmax_cols)(float *s, int64_t lds, int64_t rows, int64_t n, float *m, float *l, float *corr);
    /* Backward, per column c of S and dP [rows×n] (row stride ld):
     * S[r][c] ← P = exp(S[r][c] − lse[c]); dP[r][c] ← dS = P·(dP[r][c] − delta[c]). */
    void (*grad_cols)(float *s, float *dp, int64_t ld, int64_t rows, int64_t n, const float *lse,
                      const float *delta);
    /* out[c] = Σ_p a[p·ld + c]·b[p·ld + c] (c < n, p < k, p ascending) with gemm's arithmetic per
     * element, so that Δ = rowsum(dO∘O) cancels exactly against dP = dO·Vᵀ where O is a row of V. */
    void (*dot_cols)(const float *a, const float *b, int64_t ld, int64_t k, int64_t n, float *out);
    /* x[i] = exp(x[i] − m) for i < n; returns the sum. */
    float (*exp_sum)(float *x, int64_t n, float m);
    /* rows×cols of src (dtype t, element strides rs, cs) times scale into f32:
     * dst[r·ldd + c], or dst[c·ldd + r] when transpose. */
    void (*load)(const void *src, sparge_dtype t, int64_t rs, int64_t cs, int64_t rows, int64_t cols, float scale,
                 float *dst, int64_t ldd, int transpose);
    /* dst[r·rs + c·cs] = src[r·lds + c]·row_scale[r] (row_scale NULL: 1) in dtype t, rounded to nearest even. */
    void (*store)(const float *src, int64_t lds, const float *row_scale, int64_t rows, int64_t cols, void *dst,
                  sparge_dtype t, int64_t rs, int64_t cs);
    /* acc[c] += Σ_r src[r·rs + c·cs] over rows×cols of dtype t, row by row. */
    void (*sum_rows)(const void *src, sparge_dtype t, int64_t rs, int64_t cs, int64_t rows, int64_t cols, float *acc);
} sparge_simd_ops;

extern const sparge_simd_ops sparge_simd_generic;
extern const sparge_simd_ops sparge_simd_avx2;
extern const sparge_simd_ops sparge_simd_avx512;



#endif
