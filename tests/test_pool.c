/* Pooling with ragged tails and the pooled map, on both CPU tiers. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static void test_pool_ragged(void **state)
{
    (void)state;
    static const char *const tiers[] = {"cpu-ref", "cpu"};
    for (int t = 0; t < 2; t++) {
        sparge_device *dev = tu_open_or_null(tiers[t]);
        /* x[b,h,n,d] = n + 10 d + 100 h, N = 10, block 4 → blocks of 4, 4, 2 rows */
        float x[2 * 10 * 3], out[2 * 3 * 3];
        for (int h = 0; h < 2; h++)
            for (int n = 0; n < 10; n++)
                for (int d = 0; d < 3; d++)
                    x[(h * 10 + n) * 3 + d] = (float)(n + 10 * d + 100 * h);
        sparge_tensor xt = sparge_tensor_bhnd(x, SPARGE_F32, 1, 2, 10, 3), ot = sparge_tensor_bhnd(out, SPARGE_F32, 1, 2, 3, 3);
        assert_int_equal(sparge_pool(dev, &xt, 4, &ot), SPARGE_OK);
        static const float mean_n[3] = {1.5f, 5.5f, 8.5f};
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 3; i++)
                for (int d = 0; d < 3; d++)
                    assert_true(fabsf(out[(h * 3 + i) * 3 + d] - (mean_n[i] + 10 * d + 100 * h)) < 1e-4f);
        /* wrong output shape is refused, output untouched */
        sparge_tensor bad = sparge_tensor_bhnd(out, SPARGE_F32, 1, 2, 2, 3);
        assert_int_equal(sparge_pool(dev, &xt, 4, &bad), SPARGE_ERR_SHAPE);
        assert_int_equal(sparge_pool(dev, &xt, 0, &ot), SPARGE_ERR_INVALID);
        sparge_device_close(dev);
    }
}

/* sparge_tensor_bnhd views memory laid out [B,N,H,D] (docs/DESIGN.md §1.1): x is written in that order by hand,
 * x = n + 10 d + 100 h + 1000 b, and the means of its ragged blocks come back [B,H,Nqb,D]. */
static void test_pool_bnhd(void **state)
{
    (void)state;
    enum { B = 2, H = 3, N = 10, D = 5, NB = 3 };
    static const char *const tiers[] = {"cpu-ref", "cpu"};
    static const float mean_n[NB] = {1.5f, 5.5f, 8.5f}; /* blocks of 4, 4, 2 rows */
    float x[B * N * H * D], out[B * H * NB * D];
    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++)
                    x[((b * N + n) * H + h) * D + d] = (float)(n + 10 * d + 100 * h + 1000 * b);
    for (int t = 0; t < 2; t++) {
        sparge_device *dev = tu_open_or_null(tiers[t]);
        assert_non_null(dev);
        sparge_tensor xt = sparge_tensor_bnhd(x, SPARGE_F32, B, H, N, D), ot = sparge_tensor_bhnd(out, SPARGE_F32, B, H, NB, D);
        assert_int_equal(sparge_pool(dev, &xt, 4, &ot), SPARGE_OK);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < NB; i++)
                    for (int d = 0; d < D; d++)
                        assert_true(fabsf(out[((b * H + h) * NB + i) * D + d] -
                                          (mean_n[i] + 10 * d + 100 * h + 1000 * b)) < 1e-3f);
        sparge_device_close(dev);
    }
}

static void test_pooled_map(void **state)
{
    (void)state;
    sparge_device *dev = tu_open_or_null("cpu");
    float q[2 * 2] = {1, 0, 0, 2}, k[3 * 2] = {1, 0, 0, 1, 1, 1}, map[2 * 3];
    sparge_tensor qt = sparge_tensor_bhnd(q, SPARGE_F32, 1, 1, 2, 2), kt = sparge_tensor_bhnd(k, SPARGE_F32, 1, 1, 3, 2),
                  mt = sparge_tensor_bhnd(map, SPARGE_F32, 1, 1, 2, 3);
    assert_int_equal(sparge_pooled_map(dev, &qt, &kt, 0.5f, &mt), SPARGE_OK);
    /* row 0: scores 0.5·(1, 0, 1); row 1: 0.5·(0, 2, 2) */
    double e0 = exp(0.5), z0 = 2 * e0 + 1, e1 = exp(1.0), z1 = 1 + 2 * e1;
    double want[6] = {e0 / z0, 1 / z0, e0 / z0, 1 / z1, e1 / z1, e1 / z1};
    for (int i = 0; i < 6; i++)
        assert_true(fabs(map[i] - want[i]) < 1e-6);
    /* kbar of another head dim than qbar is refused, the map untouched */
    float k_d3[3 * 3] = {0};
    sparge_tensor k3 = sparge_tensor_bhnd(k_d3, SPARGE_F32, 1, 1, 3, 3);
    memset(map, 0xff, sizeof map);
    assert_int_equal(sparge_pooled_map(dev, &qt, &k3, 0.5f, &mt), SPARGE_ERR_SHAPE);
    for (int i = 0; i < 6; i++)
        assert_true(isnan(map[i]));
    sparge_device_close(dev);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_pool_ragged), cmocka_unit_test(test_pool_bnhd),
                                       cmocka_unit_test(test_pooled_map)};
    return cmocka_run_group_tests_name("pool", tests, NULL, NULL);
}
