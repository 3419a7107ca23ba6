/* Dense f32 micro-kernels of the cpu tier. One source (simd.c) is compiled
 * once per ISA tier; sparge_simd_best() picks the widest the CPU supports at
 * run time, so the build never requires AVX-512 of the machine it runs on. */
#ifndef SPARGE_SIMD_H
#define SPARGE_SIMD_H

#include <stdint.h>

typedef struct {
    const char *name;
    /* C[m×n] = A[m×k] · B[n×k]ᵀ (row-major, leading dims lda, ldb, ldc). */
    void (*abt)(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m, int64_t n,
                int64_t k);
    /* C[m×n] += A[m×k] · B[k×n]. */
    void (*ab)(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m, int64_t n,
               int64_t k);
    /* C[m×n] += A[k×m]ᵀ · B[k×n]. */
    void (*atb)(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m, int64_t n,
                int64_t k);
    /* x[i] = exp(x[i] − m) for i < n; returns the sum. */
    float (*exp_sum)(float *x, int64_t n, float m);
} sparge_simd_ops;

extern const sparge_simd_ops sparge_simd_generic;
extern const sparge_simd_ops sparge_simd_avx2;
extern const sparge_simd_ops sparge_simd_avx512;

const sparge_simd_ops *sparge_simd_best(void);

#endif
