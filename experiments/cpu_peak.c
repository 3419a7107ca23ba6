/* FMA peak (f32) of this CPU: independent FMA chains in registers, one thread
 * and one per OpenMP thread, per SIMD width the CPU supports. The attention
 * targets of the cpu backend are stated against the all-threads figure.
 * Usage: cpu_peak [seconds per measurement, default 0.5] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define X86 1
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Each kernel runs `iters` rounds of CHAINS independent FMAs on named
 * register variables (an array would be kept in memory at -O2) and returns a
 * value that depends on every chain, so the compiler cannot drop any of them.
 * 12 chains cover FMA latency × pipes of current x86 cores (4 × 2) and, with
 * the two constants, still fit the 16 ymm registers of AVX2. */
#define CHAINS 12
#define REPEAT(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
/* Kernel `name` over the vector type and operations #defined as VEC, SET1, FMA, ADD, FIRST. */
#define DEFINE_KERNEL(name, attr)                                                                                 \
    attr static float name(long iters, float seed)                                                                \
    {                                                                                                             \
        const VEC m = SET1(0.999999f), a = SET1(1e-7f);                                                            \
        REPEAT(DECLARE)                                                                                           \
        for (long i = 0; i < iters; i++) {                                                                        \
            REPEAT(STEP)                                                                                          \
        }                                                                                                         \
        VEC s = SET1(0.0f);                                                                                       \
        REPEAT(SUM)                                                                                               \
        return FIRST(s);                                                                                          \
    }
#define DECLARE(c) VEC acc##c = SET1(seed + (float)c);
#define STEP(c) acc##c = FMA(acc##c, m, a);
#define SUM(c) s = ADD(s, acc##c);
#define VEC float
#define SET1(x) (x)
#define FMA(x, y, z) ((x) * (y) + (z))
#define ADD(x, y) ((x) + (y))
#define FIRST(x) (x)
/* Without -mfma this is a multiply and an add: a baseline, not a peak. */
DEFINE_KERNEL(fma_scalar, )
#undef VEC
#undef SET1
#undef FMA
#undef ADD
#undef FIRST

#ifdef X86
#define VEC __m256
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define FIRST _mm256_cvtss_f32
DEFINE_KERNEL(fma_avx2, __attribute__((target("avx2,fma"))))
#undef VEC
#undef SET1
#undef FMA
#undef ADD
#undef FIRST

#define VEC __m512
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define FIRST _mm512_cvtss_f32
DEFINE_KERNEL(fma_avx512, __attribute__((target("avx512f"))))
#endif

typedef struct {
    const char *name;
    int lanes;
    float (*kernel)(long, float);
} tier;

/* GFLOP/s of `threads` threads, each running the kernel for about `seconds`. */
static double measure(const tier *t, int threads, double seconds)
{
    long iters = 1 << 16;
    double elapsed = 0.0;
    volatile float sink = 0.0f;
    for (;;) { /* grow the count until one run takes long enough to time */
        double t0 = now();
#pragma omp parallel num_threads(threads)
        {
            float r = t->kernel(iters, 1.0f);
#pragma omp atomic
            sink += r;
        }
        elapsed = now() - t0;
        if (elapsed >= seconds)
            break;
        iters = elapsed > 1e-3 ? (long)((double)iters * seconds * 1.1 / elapsed) : iters * 8;
    }
    (void)sink;
    return 2.0 * CHAINS * t->lanes * (double)iters * threads / elapsed * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    static const char usage[] = "usage: %s [SECONDS]\nThe f32 FMA peak of every SIMD tier on one thread and on all: "
                                "the median of 5 measurements of SECONDS each (a number in (0, 60], default 0.5).\n";
    if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf(usage, argv[0]);
        return 0;
    }
    double seconds = 0.5;
    if (argc > 2) {
        fprintf(stderr, usage, argv[0]);
        return 2;
    }
    if (argc == 2) {
        char *end;
        seconds = strtod(argv[1], &end);
        if (end == argv[1] || *end || !(seconds > 0.0 && seconds <= 60.0)) {
            fprintf(stderr, "%s: SECONDS wants a number in (0, 60], not '%s'\n", argv[0], argv[1]);
            return 2;
        }
    }
    tier tiers[3];
    int n = 0;
    tiers[n++] = (tier){"scalar (mul+add)", 1, fma_scalar};
#ifdef X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        tiers[n++] = (tier){"avx2+fma (8 lanes)", 8, fma_avx2};
    if (__builtin_cpu_supports("avx512f"))
        tiers[n++] = (tier){"avx512f (16 lanes)", 16, fma_avx512};
#endif
    int all = 1;
#ifdef _OPENMP
    all = omp_get_max_threads();
#endif
    printf("f32 FMA peak, %d chains per thread, median of 5 runs of %.2f s (min..max)\n", CHAINS, seconds);
    for (int i = 0; i < n; i++) {
        int counts[2] = {1, all};
        for (int c = 0; c < (all > 1 ? 2 : 1); c++) {
            double g[5];
            for (int r = 0; r < 5; r++)
                g[r] = measure(&tiers[i], counts[c], seconds);
            qsort(g, 5, sizeof g[0], cmp_double);
            printf("  %-20s %2d thread(s): %8.1f GFLOP/s (%.1f..%.1f)\n", tiers[i].name, counts[c], g[2], g[0], g[4]);
        }
    }
    return 0;
}
