/* The fp64 reference backward against central finite differences of the
 * fp64 reference forward, dense and masked, causal or not, with ragged blocks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "../backends/cpu/ref.h"
#include "../src/backend.h"

/* L = Σ w∘O for fixed random weights w; dL/dO = w. */
static double loss(const double *q, const double *k, const double *v, const double *w, int64_t Nq, int64_t Nk,
                   int64_t D, double scale, int bq, int bk, int causal, const uint8_t *keep, int64_t nkb)
{
    double *o = malloc((size_t)(Nq * D) * sizeof *o), *lse = malloc((size_t)Nq * sizeof *lse), l = 0.0;
    sparge_ref_head_forward(q, k, v, Nq, Nk, D, scale, bq, bk, causal, keep, nkb, o, lse);
    for (int64_t i = 0; i < Nq * D; i++)
        l += w[i] * o[i];
    free(o);
    free(lse);
    return l;
}

static void check_case(int64_t Nq, int64_t Nk, int64_t D, int bq, int bk, int masked, int causal, uint64_t seed)
{
    tu_rng r = {seed};
    double scale = 1.0 / sqrt((double)D);
    double *q = malloc((size_t)(Nq * D) * 8), *k = malloc((size_t)(Nk * D) * 8), *v = malloc((size_t)(Nk * D) * 8),
           *w = malloc((size_t)(Nq * D) * 8);
    for (int64_t i = 0; i < Nq * D; i++) {
        q[i] = tu_normal(&r);
        w[i] = tu_normal(&r);
    }
    for (int64_t i = 0; i < Nk * D; i++) {
        k[i] = tu_normal(&r);
        v[i] = tu_normal(&r);
    }
    int64_t nqb = (Nq + bq - 1) / bq, nkb = (Nk + bk - 1) / bk;
    uint8_t *keep = NULL;
    if (masked) {
        keep = malloc((size_t)(nqb * nkb));
        for (int64_t i = 0; i < nqb * nkb; i++)
            keep[i] = tu_uniform(&r) < 0.5;
        for (int64_t i = 0; i < nqb; i++) {
            int64_t allowed, d0, d1;
            keep[i * nkb + (i % nkb)] = 1; /* every row keeps a block */
            sparge_row_rule(i, Nq, Nk, bq, bk, causal, &allowed, &d0, &d1);
            for (int64_t j = d0; j <= d1; j++) /* causal rows keep their diagonal blocks */
                keep[i * nkb + j] = 1;
        }
    }
    double *o = malloc((size_t)(Nq * D) * 8), *lse = malloc((size_t)Nq * 8);
    double *dq = malloc((size_t)(Nq * D) * 8), *dk = malloc((size_t)(Nk * D) * 8), *dv = malloc((size_t)(Nk * D) * 8);
    sparge_ref_head_forward(q, k, v, Nq, Nk, D, scale, bq, bk, causal, keep, nkb, o, lse);
    memset(dk, 0, (size_t)(Nk * D) * 8); /* the backward adds to dK and dV */
    memset(dv, 0, (size_t)(Nk * D) * 8);
    sparge_ref_head_backward(q, k, v, o, w, lse, Nq, Nk, D, scale, bq, bk, causal, keep, nkb, dq, dk, dv);
    double *params[3] = {q, k, v}, *grads[3] = {dq, dk, dv};
    int64_t sizes[3] = {Nq * D, Nk * D, Nk * D};
    const double h = 1e-5;
    for (int t = 0; t < 3; t++)
        for (int probe = 0; probe < 12; probe++) {
            int64_t i = (int64_t)(tu_next(&r) % (uint64_t)sizes[t]);
            double saved = params[t][i];
            params[t][i] = saved + h;
            double lp = loss(q, k, v, w, Nq, Nk, D, scale, bq, bk, causal, keep, nkb);
            params[t][i] = saved - h;
            double lm = loss(q, k, v, w, Nq, Nk, D, scale, bq, bk, causal, keep, nkb);
            params[t][i] = saved;
            double fd = (lp - lm) / (2 * h), an = grads[t][i];
            if (!(fabs(fd - an) <= 1e-6 * fmax(1.0, fabs(fd))))
                fail_msg("%s[%lld]: analytic %.10g vs finite difference %.10g (Nq=%lld Nk=%lld D=%lld masked=%d "
                         "causal=%d)", t == 0 ? "dQ" : t == 1 ? "dK" : "dV", (long long)i, an, fd, (long long)Nq,
                         (long long)Nk, (long long)D, masked, causal);
        }
    free(q); free(k); free(v); free(w); free(keep); free(o); free(lse); free(dq); free(dk); free(dv);
}

static void test_dense(void **state)
{
    (void)state;
    check_case(20, 20, 8, 8, 4, 0, 0, 1);
    check_case(13, 29, 16, 4, 8, 0, 0, 2);
}

static void test_masked(void **state)
{
    (void)state;
    check_case(37, 23, 8, 8, 4, 1, 0, 3);
    check_case(50, 61, 12, 16, 8, 1, 0, 4);
}

/* Bottom-right aligned causal attention, Nq = Nk and Nq < Nk, dense and with diagonal-keeping masks. */
static void test_causal(void **state)
{
    (void)state;
    check_case(20, 20, 8, 8, 4, 0, 1, 5);
    check_case(13, 29, 16, 4, 8, 0, 1, 6);
    check_case(37, 41, 8, 8, 4, 1, 1, 7);
    check_case(50, 61, 12, 16, 8, 1, 1, 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_dense), cmocka_unit_test(test_masked),
                                       cmocka_unit_test(test_causal)};
    return cmocka_run_group_tests_name("grad", tests, NULL, NULL);
}
