/* Hand-computed mask selections (docs/DESIGN.md §1.6-§1.8), statistics, the transpose and
 * imported and exported masks, on both CPU tiers. */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"

static const char *const tiers[] = {"cpu-ref", "cpu"};

/* Kept blocks of one pooled-map row; returns the count or -status. */
static int select_row(sparge_device *dev, const float *row, int n, double k, double p, int *kept)
{
    sparge_mask *m;
    assert_int_equal(sparge_mask_create(dev, 1, 1, 1, n, 1, 1, &m), SPARGE_OK);
    sparge_tensor map = sparge_tensor_bhnd((void *)row, SPARGE_F32, 1, 1, 1, n);
    sparge_mask_params mp = {1, 1, k, p, 0.0f, 0};
    sparge_status s = sparge_mask_select(dev, &map, &mp, m);
    int32_t cnt = -(int32_t)s, idx[64];
    if (s == SPARGE_OK) {
        assert_int_equal(sparge_mask_get_csr(m, &cnt, idx, NULL, NULL), SPARGE_OK);
        for (int j = 0; j < cnt; j++)
            kept[j] = idx[j];
    }
    sparge_mask_destroy(m);
    return cnt;
}

#define EXPECT_KEPT(dev, row, k, p, ...)                                                                               \
    do {                                                                                                               \
        const int want[] = {__VA_ARGS__};                                                                              \
        int got[64], n = (int)(sizeof(row) / sizeof(row[0]));                                                          \
        int c = select_row(dev, row, n, k, p, got);                                                                    \
        assert_int_equal(c, (int)(sizeof want / sizeof want[0]));                                                      \
        for (int i_ = 0; i_ < c; i_++)                                                                                 \
            assert_int_equal(got[i_], want[i_]);                                                                       \
    } while (0)

static void test_hand_cases(void **state)
{
    (void)state;
    static const float sink[] = {0.6f, 0.2f, 0.1f, 0.05f, 0.05f};
    static const float flat[] = {0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f};
    static const float unsorted[] = {0.05f, 0.3f, 0.05f, 0.4f, 0.2f};
    for (int t = 0; t < 2; t++) {
        sparge_device *dev = tu_open_or_null(tiers[t]);
        assert_non_null(dev);
        EXPECT_KEPT(dev, sink, 0.0, 0.6, 0);           /* Top-p: the sink alone reaches p */
        EXPECT_KEPT(dev, sink, 0.4, 0.6, 0, 1);        /* hybrid: Top-k floor of 2 blocks */
        EXPECT_KEPT(dev, sink, 0.0, 0.85, 0, 1, 2);    /* 0.6+0.2 < 0.85 ≤ 0.9 */
        EXPECT_KEPT(dev, sink, 0.2, 0.0, 0);           /* Top-k: floor(0.2·5) = 1 */
        EXPECT_KEPT(dev, sink, 0.01, 0.0, 0);          /* k > 0 keeps at least one */
        EXPECT_KEPT(dev, sink, 1.0, 0.0, 0, 1, 2, 3, 4);
        EXPECT_KEPT(dev, sink, 0.0, 1.0, 0, 1, 2, 3, 4);
        EXPECT_KEPT(dev, sink, 0.0, 1e-9, 0);          /* at least one block */
        EXPECT_KEPT(dev, flat, 0.25, 0.0, 0, 1);       /* flat row, ties → lower index */
        EXPECT_KEPT(dev, flat, 0.0, 0.3, 0, 1, 2);     /* 3 × 0.125 ≥ 0.3 */
        EXPECT_KEPT(dev, flat, 0.5, 0.3, 0, 1, 2, 3);  /* union: max(4, 3) */
        EXPECT_KEPT(dev, unsorted, 0.0, 0.7, 1, 3);    /* ascending indices, by score */
        EXPECT_KEPT(dev, unsorted, 0.6, 0.0, 1, 3, 4);
        /* k = p = 0 is rejected, and so is anything outside [0, 1] or NaN */
        int got[8];
        assert_int_equal(select_row(dev, sink, 5, 0.0, 0.0, got), -SPARGE_ERR_INVALID);
        assert_int_equal(select_row(dev, sink, 5, -0.1, 0.2, got), -SPARGE_ERR_INVALID);
        assert_int_equal(select_row(dev, sink, 5, 0.1, 1.5, got), -SPARGE_ERR_INVALID);
        assert_int_equal(select_row(dev, sink, 5, NAN, 0.2, got), -SPARGE_ERR_INVALID);
        assert_int_equal(select_row(dev, sink, 5, 0.1, NAN, got), -SPARGE_ERR_INVALID);
        /* a NaN row keeps every block (NaN inputs propagate to the output) */
        static const float nan_row[] = {0.5f, NAN, 0.5f};
        assert_int_equal(select_row(dev, nan_row, 3, 0.1, 0.1, got), 3);
        sparge_device_close(dev);
    }
}

/* Top-k alone keeps floor(k·Nkb) blocks for k written as a decimal (docs/DESIGN.md §1.6): k = m/100 over rows of
 * 1..130 blocks, where k·Nkb in fp64 often lands just below the integer m·Nkb/100 (0.29·100 = 28.999999999999996
 * must keep 29). The count is the exact floor(m·Nkb/100), at least 1; the row descends, so the kept blocks are
 * its first ones. */
static void test_topk_count_decimal_k(void **state)
{
    (void)state;
    enum { MAX_N = 130 };
    float row[MAX_N];
    int32_t cnt, idx[MAX_N];
    for (int t = 0; t < 2; t++) {
        sparge_device *dev = tu_open_or_null(tiers[t]);
        assert_non_null(dev);
        for (int n = 1; n <= MAX_N; n++) {
            sparge_mask *m;
            assert_int_equal(sparge_mask_create(dev, 1, 1, 1, n, 1, 1, &m), SPARGE_OK);
            for (int j = 0; j < n; j++)
                row[j] = (float)(n - j) / (float)(n * (n + 1) / 2);
            sparge_tensor map = sparge_tensor_bhnd(row, SPARGE_F32, 1, 1, 1, n);
            for (int pct = 1; pct <= 100; pct++) {
                const sparge_mask_params mp = {1, 1, pct / 100.0, 0.0, 0.0f, 0};
                int want = pct * n / 100;
                if (want < 1)
                    want = 1;
                assert_int_equal(sparge_mask_select(dev, &map, &mp, m), SPARGE_OK);
                assert_int_equal(sparge_mask_get_csr(m, &cnt, idx, NULL, NULL), SPARGE_OK);
                if (cnt != want)
                    fail_msg("%s: k = %.2f over %d blocks keeps %d, not %d", tiers[t], pct / 100.0, n, (int)cnt, want);
                for (int j = 0; j < want; j++)
                    assert_int_equal(idx[j], j);
            }
            sparge_mask_destroy(m);
        }
        sparge_device_close(dev);
    }
}

/* 2 heads × 3 query blocks × 4 key blocks with ragged last blocks. */
static void test_stats_and_transpose(void **state)
{
    (void)state;
    static const uint8_t dense[2 * 3 * 4] = {1, 0, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1, /* head 0: 7 kept */
                                             0, 0, 0, 1, 0, 0, 1, 0, 1, 0, 0, 0}; /* head 1: 3 kept */
    for (int t = 0; t < 2; t++) {
        sparge_device *dev = tu_open_or_null(tiers[t]);
        sparge_mask *m;
        /* Nq = 10 with bq = 4: blocks of 4, 4, 2 tokens; Nk = 7 with bk = 2: 2, 2, 2, 1 */
        assert_int_equal(sparge_mask_create(dev, 1, 2, 10, 7, 4, 2, &m), SPARGE_OK);
        sparge_mask_stats st;
        assert_int_equal(sparge_mask_get_stats(m, &st, NULL, NULL), SPARGE_ERR_MASK); /* nothing selected yet */
        assert_int_equal(sparge_mask_set_dense(m, dense), SPARGE_OK);
        double head[2];
        float mass[6];
        assert_int_equal(sparge_mask_get_stats(m, &st, head, mass), SPARGE_OK);
        assert_int_equal(st.kept_blocks, 10);
        assert_int_equal(st.total_blocks, 24);
        assert_true(fabs(st.sparsity - (1.0 - 10.0 / 24.0)) < 1e-12);
        assert_true(fabs(head[0] - (1.0 - 7.0 / 12.0)) < 1e-12);
        assert_true(fabs(head[1] - (1.0 - 3.0 / 12.0)) < 1e-12);
        /* token pairs: head 0: 4·2 + 4·(2+2) + 2·7 = 38; head 1: 4·1 + 4·2 + 2·2 = 16 */
        assert_true(fabs(st.token_density - 54.0 / (2.0 * 10 * 7)) < 1e-12);
        assert_int_equal(st.min_row_blocks, 1);
        assert_int_equal(st.max_row_blocks, 4);
        assert_true(isnan(st.mean_row_mass) && isnan(mass[0])); /* imported: no pooled mass */
        int32_t tc[8], ti[8 * 3];
        assert_int_equal(sparge_mask_get_csr(m, NULL, NULL, tc, ti), SPARGE_OK);
        static const int32_t want_tc[8] = {2, 2, 2, 1, 1, 0, 1, 1};
        for (int j = 0; j < 8; j++)
            assert_int_equal(tc[j], want_tc[j]);
        assert_int_equal(ti[0 * 3 + 0], 0);
        assert_int_equal(ti[0 * 3 + 1], 2);
        assert_int_equal(ti[0 * 3 + 2], -1);
        assert_int_equal(ti[(4 + 3) * 3 + 0], 0); /* head 1, key block 3: query block 0 */
        /* every row must keep a block, the first and the last too; a refused import leaves the selection */
        uint8_t bad[24], back[24];
        for (int r = 0; r < 6; r++) {
            memcpy(bad, dense, 24);
            memset(bad + 4 * r, 0, 4);
            assert_int_equal(sparge_mask_set_dense(m, bad), SPARGE_ERR_INVALID);
            assert_int_equal(sparge_mask_get_dense(m, back), SPARGE_OK);
            assert_memory_equal(back, dense, 24);
        }
        sparge_mask_destroy(m);
        sparge_device_close(dev);
    }
}

/* Predicted masks carry the kept pooled mass of each row. */
static void test_row_mass(void **state)
{
    (void)state;
    sparge_device *dev = tu_open_or_null("cpu-ref");
    sparge_mask *m;
    static const float map[2][4] = {{0.7f, 0.1f, 0.1f, 0.1f}, {0.25f, 0.25f, 0.25f, 0.25f}};
    assert_int_equal(sparge_mask_create(dev, 1, 1, 2, 4, 1, 1, &m), SPARGE_OK);
    sparge_tensor t = sparge_tensor_bhnd((void *)map, SPARGE_F32, 1, 1, 2, 4);
    sparge_mask_params mp = {1, 1, 0.25, 0.5, 0.0f, 0};
    assert_int_equal(sparge_mask_select(dev, &t, &mp, m), SPARGE_OK);
    sparge_mask_stats st;
    float mass[2];
    assert_int_equal(sparge_mask_get_stats(m, &st, NULL, mass), SPARGE_OK);
    assert_true(fabsf(mass[0] - 0.7f) < 1e-6f);
    assert_true(fabsf(mass[1] - 0.5f) < 1e-6f);
    assert_true(fabs(st.mean_row_mass - 0.6) < 1e-6);
    sparge_mask_destroy(m);
    sparge_device_close(dev);
}

/* sparge_mask_export writes the dense view byte for byte and a JSON description
 * with the shape; bad arguments fail with a message and write nothing. */
static void test_export(void **state)
{
    (void)state;
    static const uint8_t dense[1 * 2 * 2 * 3] = {1, 0, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1};
    sparge_device *dev = tu_open_or_null("cpu");
    sparge_mask *m;
    assert_int_equal(sparge_mask_create(dev, 1, 2, 5, 9, 4, 4, &m), SPARGE_OK);
    char prefix[] = "/tmp/sparge-test-export-XXXXXX";
    int fd = mkstemp(prefix);
    assert_true(fd >= 0);
    close(fd);
    remove(prefix);
    assert_int_equal(sparge_mask_export(m, prefix, 64, SPARGE_BF16), SPARGE_ERR_MASK); /* nothing selected yet */
    assert_int_equal(sparge_mask_set_dense(m, dense), SPARGE_OK);
    assert_int_equal(sparge_mask_export(m, NULL, 64, SPARGE_BF16), SPARGE_ERR_NULL);
    assert_int_equal(sparge_mask_export(m, "/nonexistent-dir/mask", 64, SPARGE_BF16), SPARGE_ERR_INVALID);
    assert_non_null(strstr(sparge_last_error(), "/nonexistent-dir/mask.u8"));
    assert_int_equal(sparge_mask_export(m, prefix, 64, SPARGE_BF16), SPARGE_OK);
    char path[64], text[512] = {0};
    snprintf(path, sizeof path, "%s.u8", prefix);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t back[16];
    assert_int_equal(fread(back, 1, sizeof back, f), sizeof dense);
    fclose(f);
    remove(path);
    assert_memory_equal(back, dense, sizeof dense);
    snprintf(path, sizeof path, "%s.json", prefix);
    f = fopen(path, "r");
    assert_non_null(f);
    assert_true(fread(text, 1, sizeof text - 1, f) > 0);
    fclose(f);
    remove(path);
    static const char *const want[] = {"\"B\": 1,", "\"H\": 2,", "\"Nq\": 5,", "\"Nk\": 9,", "\"D\": 64,",
                                       "\"Nqb\": 2,", "\"Nkb\": 3,", "\"sparsity\": 0.416667", "\"dtype\": \"bf16\""};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(text, want[i]))
            fail_msg("export JSON lacks %s: %s", want[i], text);
    sparge_mask_destroy(m);
    sparge_device_close(dev);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_hand_cases), cmocka_unit_test(test_topk_count_decimal_k),
                                       cmocka_unit_test(test_stats_and_transpose),
                                       cmocka_unit_test(test_row_mass), cmocka_unit_test(test_export)};
    return cmocka_run_group_tests_name("mask", tests, NULL, NULL);
}
