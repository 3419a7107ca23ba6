/* Micro-kernels compiled once per SIMD tier (SIMD_TIER = generic, avx2, avx512,
 * each with its own -m flags); the compiler vectorizes the inner loops. */
#include <math.h>

#include "simd.h"

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define TIER_NAME_(t) #t
#define TIER_NAME(t) TIER_NAME_(t)

static void abt(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m, int64_t n,
                int64_t k)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t p = 0; p < k; p++)
                acc += a[i * lda + p] * b[j * ldb + p];
            c[i * ldc + j] = acc;
        }
}

static void ab(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m, int64_t n,
               int64_t k)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t p = 0; p < k; p++) {
            float s = a[i * lda + p];
            for (int64_t j = 0; j < n; j++)
                c[i * ldc + j] += s * b[p * ldb + j];
        }
}

static void atb(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc, int64_t m, int64_t n,
                int64_t k)
{
    for (int64_t p = 0; p < k; p++)
        for (int64_t i = 0; i < m; i++) {
            float s = a[p * lda + i];
            for (int64_t j = 0; j < n; j++)
                c[i * ldc + j] += s * b[p * ldb + j];
        }
}

static float exp_sum(float *x, int64_t n, float m)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
        sum += x[i] = expf(x[i] - m);
    return sum;
}

const sparge_simd_ops CAT(sparge_simd_, SIMD_TIER) = {TIER_NAME(SIMD_TIER), abt, ab, atb, exp_sum};
