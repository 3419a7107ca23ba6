/* Every bad input gets a specific status and a message, leaves the outputs
 * untouched, and never crashes; NaN/Inf inputs propagate. */
#define _POSIX_C_SOURCE 200809L /* setenv, unsetenv, strdup */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { B = 1, H = 2, NQ = 70, NK = 50, D = 16 };
static float q[B * H * NQ * D], k[B * H * NK * D], v[B * H * NK * D], o[B * H * NQ * D], lse[B * H * NQ];
static sparge_device *dev;

static void fill(float *x, int n, uint64_t seed)
{
    tu_rng r = {seed};
    for (int i = 0; i < n; i++)
        x[i] = (float)tu_normal(&r);
}

static int setup(void **state)
{
    (void)state;
    fill(q, B * H * NQ * D, 1);
    fill(k, B * H * NK * D, 2);
    fill(v, B * H * NK * D, 3);
    return sparge_device_open("cpu", &dev) == SPARGE_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    sparge_device_close(dev);
    return 0;
}

/* The call fails with `want`, says why, and leaves o and lse as poisoned. */
#define EXPECT_FAIL(want, call)                                                                                        \
    do {                                                                                                               \
        memset(o, 0xff, sizeof o);                                                                                     \
        memset(lse, 0xff, sizeof lse);                                                                                 \
        sparge_status s_ = (call);                                                                                     \
        if (s_ != (want))                                                                                              \
            fail_msg("%s returned %s, expected %s (%s)", #call, sparge_status_name(s_), sparge_status_name(want),       \
                     sparge_last_error());                                                                             \
        assert_true(strlen(sparge_last_error()) > 10);                                                                 \
        for (size_t i_ = 0; i_ < sizeof o; i_++)                                                                       \
            assert_int_equal(((unsigned char *)o)[i_], 0xff);                                                          \
        for (size_t i_ = 0; i_ < sizeof lse; i_++)                                                                     \
            assert_int_equal(((unsigned char *)lse)[i_], 0xff);                                                        \
    } while (0)

static void test_devices(void **state)
{
    (void)state;
    sparge_device *d = NULL;
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_device_open(NULL, &d));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_device_open("cpu", NULL));
    EXPECT_FAIL(SPARGE_ERR_NO_DEVICE, sparge_device_open("tpu", &d));
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_open("cpu:x", &d));
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_open("cpu: 0", &d)); /* the index is digits alone */
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_open("cpu:+0", &d));
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_open("cpu:", &d));
    EXPECT_FAIL(SPARGE_ERR_NO_DEVICE, sparge_device_open("cpu:7", &d));
    assert_non_null(strstr(sparge_last_error(), "sparge_device_open: "));
    if (sparge_backend_device_count("cuda") == 0)
        EXPECT_FAIL(SPARGE_ERR_NO_DEVICE, sparge_device_open("cuda:0", &d));
    assert_null(d);
    assert_int_equal(sparge_device_open("auto", &d), SPARGE_OK);
    sparge_device_close(d);
    /* An unknown SIMD tier is refused; a known one this CPU cannot run falls back to the widest it can. */
    char *simd = getenv("SPARGE_CPU_SIMD") ? strdup(getenv("SPARGE_CPU_SIMD")) : NULL;
    d = NULL;
    assert_int_equal(setenv("SPARGE_CPU_SIMD", "avx-512", 1), 0);
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_open("cpu", &d));
    assert_non_null(strstr(sparge_last_error(), "SPARGE_CPU_SIMD"));
    assert_null(d);
    assert_int_equal(setenv("SPARGE_CPU_SIMD", "avx512", 1), 0);
    assert_int_equal(sparge_device_open("cpu", &d), SPARGE_OK);
    sparge_device_close(d);
    assert_int_equal(simd ? setenv("SPARGE_CPU_SIMD", simd, 1) : unsetenv("SPARGE_CPU_SIMD"), 0);
    free(simd);
    assert_string_equal(sparge_status_name(SPARGE_ERR_SHAPE), "SPARGE_ERR_SHAPE");
    void *p = NULL;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_malloc(dev, 0, &p));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_malloc(NULL, 16, &p));
}

/* Options: listed with their values, set and read by name, refused with the accepted values when invalid (and then
 * unchanged); strict and the capability query agree with the tiers' limits. */
static void test_options_and_support(void **state)
{
    (void)state;
    const char *name, *value, *values, *env, *help;
    assert_int_equal(sparge_device_option_count(dev), 2); /* strict, simd */
    assert_int_equal(sparge_device_option(dev, 0, &name, &value, &values, &env, &help), SPARGE_OK);
    assert_string_equal(name, "strict");
    assert_string_equal(env, "SPARGE_STRICT");
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_option(dev, 2, &name, NULL, NULL, NULL, NULL));
    assert_int_equal(sparge_device_get_option(dev, "simd", &value), SPARGE_OK);
    const char *before = value;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_set_option(dev, "simd", "sse9"));
    assert_non_null(strstr(sparge_last_error(), "avx512"));
    assert_int_equal(sparge_device_get_option(dev, "simd", &value), SPARGE_OK);
    assert_string_equal(value, before);
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_set_option(dev, "no_such_option", "on"));
    assert_non_null(strstr(sparge_last_error(), "simd"));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_device_set_option(dev, NULL, "on"));
    assert_int_equal(sparge_device_set_option(dev, "simd", "generic"), SPARGE_OK);
    assert_int_equal(sparge_device_get_option(dev, "simd", &value), SPARGE_OK);
    assert_string_equal(value, "generic");
    assert_int_equal(sparge_device_set_option(dev, "simd", "auto"), SPARGE_OK);

    sparge_op_desc d = {.op = SPARGE_OP_FORWARD, .dtype = SPARGE_BF16, .head_dim = 96, .block_q = 128, .block_k = 64};
    const char *tier = NULL;
    assert_int_equal(sparge_device_supports(dev, &d, &tier), SPARGE_OK);
    assert_string_equal(tier, "cpu");
    d.head_dim = 300;
    EXPECT_FAIL(SPARGE_ERR_UNSUPPORTED, sparge_device_supports(dev, &d, &tier));
    assert_non_null(strstr(sparge_last_error(), "256"));
    /* descriptions no call can have: K/V heads not dividing the query heads, negative sizes */
    d.head_dim = 96, d.H = 6, d.kv_heads = 4;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_supports(dev, &d, &tier));
    assert_non_null(strstr(sparge_last_error(), "kv_heads 4"));
    d.kv_heads = 3;
    assert_int_equal(sparge_device_supports(dev, &d, &tier), SPARGE_OK);
    d.Nk = -1;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_supports(dev, &d, &tier));
    d.Nq = 200, d.Nk = 100, d.causal = 1; /* causal with more queries than keys */
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_supports(dev, &d, &tier));
    assert_non_null(strstr(sparge_last_error(), "Nq 200 > Nk 100"));
    d.Nk = 200;
    assert_int_equal(sparge_device_supports(dev, &d, &tier), SPARGE_OK);
    d.dtype = (sparge_dtype)99;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_supports(dev, &d, &tier));
    d.dtype = SPARGE_BF16, d.Nq = d.Nk = 0, d.causal = 0;
    d.op = SPARGE_OP_COUNT;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_supports(dev, &d, &tier));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_device_supports(dev, NULL, &tier));
    assert_int_equal(sparge_device_set_option(dev, "strict", "on"), SPARGE_OK);
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_device_set_option(dev, "strict", "yes"));
    assert_int_equal(sparge_device_set_option(dev, "strict", "off"), SPARGE_OK);
    assert_true(sparge_dtype_tolerance(SPARGE_F32) == 1e-5 && sparge_dtype_tolerance(SPARGE_F16) == 3e-3 &&
                sparge_dtype_tolerance(SPARGE_BF16) == 1e-2);
}

static void test_forward_bad_input(void **state)
{
    (void)state;
    sparge_tensor qt = sparge_tensor_bhnd(q, SPARGE_F32, B, H, NQ, D), kt = sparge_tensor_bhnd(k, SPARGE_F32, B, H, NK, D),
                  vt = sparge_tensor_bhnd(v, SPARGE_F32, B, H, NK, D), ot = sparge_tensor_bhnd(o, SPARGE_F32, B, H, NQ, D);
    /* NULL pointers */
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_attention_forward(NULL, &qt, &kt, &vt, NULL, NULL, &ot, lse));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_attention_forward(dev, NULL, &kt, &vt, NULL, NULL, &ot, lse));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_attention_forward(dev, &qt, &kt, &vt, NULL, NULL, NULL, lse));
    sparge_tensor nodata = qt;
    nodata.data = NULL;
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_attention_forward(dev, &nodata, &kt, &vt, NULL, NULL, &ot, lse));
    /* zero or negative dims, negative strides */
    sparge_tensor zero = sparge_tensor_bhnd(q, SPARGE_F32, B, H, 0, D), neg = sparge_tensor_bhnd(q, SPARGE_F32, B, -1, NQ, D);
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_attention_forward(dev, &zero, &kt, &vt, NULL, NULL, &ot, lse));
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_attention_forward(dev, &neg, &kt, &vt, NULL, NULL, &ot, lse));
    sparge_tensor negstride = qt;
    negstride.stride[2] = -D;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_attention_forward(dev, &negstride, &kt, &vt, NULL, NULL, &ot, lse));
    /* an output whose strides overlap itself */
    sparge_tensor alias = ot;
    alias.stride[2] = 0;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_attention_forward(dev, &qt, &kt, &vt, NULL, NULL, &alias, lse));
    /* mismatched shapes and dtypes */
    sparge_tensor kd = sparge_tensor_bhnd(k, SPARGE_F32, B, H, NK, D / 2);
    EXPECT_FAIL(SPARGE_ERR_SHAPE, sparge_attention_forward(dev, &qt, &kd, &vt, NULL, NULL, &ot, lse));
    sparge_tensor vn = sparge_tensor_bhnd(v, SPARGE_F32, B, H, NK - 1, D);
    EXPECT_FAIL(SPARGE_ERR_SHAPE, sparge_attention_forward(dev, &qt, &kt, &vn, NULL, NULL, &ot, lse));
    sparge_tensor oh = sparge_tensor_bhnd(o, SPARGE_F32, B, 1, NQ, D);
    EXPECT_FAIL(SPARGE_ERR_SHAPE, sparge_attention_forward(dev, &qt, &kt, &vt, NULL, NULL, &oh, lse));
    sparge_tensor k16 = sparge_tensor_bhnd(k, SPARGE_F16, B, H, NK, D);
    EXPECT_FAIL(SPARGE_ERR_DTYPE, sparge_attention_forward(dev, &qt, &k16, &vt, NULL, NULL, &ot, lse));
    sparge_tensor o16 = sparge_tensor_bhnd(o, SPARGE_BF16, B, H, NQ, D); /* an output of another dtype */
    EXPECT_FAIL(SPARGE_ERR_DTYPE, sparge_attention_forward(dev, &qt, &kt, &vt, NULL, NULL, &o16, lse));
    sparge_tensor badtype = qt;
    badtype.dtype = (sparge_dtype)7;
    EXPECT_FAIL(SPARGE_ERR_DTYPE, sparge_attention_forward(dev, &badtype, &kt, &vt, NULL, NULL, &ot, lse));
    /* a head dimension the backend doesn't support */
    sparge_tensor q300 = sparge_tensor_bhnd(q, SPARGE_F32, 1, 1, 2, 300), k300 = sparge_tensor_bhnd(k, SPARGE_F32, 1, 1, 2, 300),
                  v300 = sparge_tensor_bhnd(v, SPARGE_F32, 1, 1, 2, 300), o300 = sparge_tensor_bhnd(o, SPARGE_F32, 1, 1, 2, 300);
    EXPECT_FAIL(SPARGE_ERR_UNSUPPORTED, sparge_attention_forward(dev, &q300, &k300, &v300, NULL, NULL, &o300, lse));
    /* sizes whose products overflow */
    sparge_tensor huge = sparge_tensor_bhnd(q, SPARGE_F32, (int64_t)1 << 40, (int64_t)1 << 40, NQ, D);
    EXPECT_FAIL(SPARGE_ERR_OVERFLOW, sparge_attention_forward(dev, &huge, &kt, &vt, NULL, NULL, &ot, lse));
    /* a non-finite scale */
    sparge_attn_params ap = {NAN, 0, 0};
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_attention_forward(dev, &qt, &kt, &vt, NULL, &ap, &ot, lse));
}

static void test_mask_bad_input(void **state)
{
    (void)state;
    sparge_tensor qt = sparge_tensor_bhnd(q, SPARGE_F32, B, H, NQ, D), kt = sparge_tensor_bhnd(k, SPARGE_F32, B, H, NK, D),
                  vt = sparge_tensor_bhnd(v, SPARGE_F32, B, H, NK, D), ot = sparge_tensor_bhnd(o, SPARGE_F32, B, H, NQ, D);
    sparge_mask *m = NULL;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_mask_create(dev, B, H, NQ, NK, 0, 16, &m));
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_mask_create(dev, B, H, NQ, NK, 16, -4, &m));
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_mask_create(dev, B, 0, NQ, NK, 16, 16, &m));
    EXPECT_FAIL(SPARGE_ERR_OVERFLOW, sparge_mask_create(dev, (int64_t)1 << 40, (int64_t)1 << 40, NQ, NK, 16, 16, &m));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_mask_create(dev, B, H, NQ, NK, 16, 16, NULL));
    assert_null(m);
    assert_int_equal(sparge_mask_create(dev, B, H, NQ, NK, 16, 8, &m), SPARGE_OK);
    /* a mask that holds no selection yet */
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_forward(dev, &qt, &kt, &vt, m, NULL, &ot, lse));
    sparge_mask_params mp = {16, 8, 0.1, 0.3, 0.0f, 0};
    sparge_mask_params bad = mp;
    bad.topk = 1.5;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_mask_predict(dev, &qt, &kt, &bad, m));
    bad = mp;
    bad.topp = NAN;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_mask_predict(dev, &qt, &kt, &bad, m));
    bad = mp;
    bad.topk = bad.topp = 0.0;
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_mask_predict(dev, &qt, &kt, &bad, m));
    bad = mp;
    bad.block_q = 32; /* not the mask's blocks */
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_mask_predict(dev, &qt, &kt, &bad, m));
    bad = mp;
    bad.block_k = 16; /* the mask's query blocks, other key blocks */
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_mask_predict(dev, &qt, &kt, &bad, m));
    {
        /* a selection from a given map with those params: refused as the prediction is, the selection kept */
        enum { NQB = (NQ + 15) / 16, NKB = (NK + 7) / 8 };
        static float map[B * H * NQB * NKB];
        for (int i = 0; i < B * H * NQB * NKB; i++)
            map[i] = (float)(i % NKB + 1);
        sparge_tensor mt = sparge_tensor_bhnd(map, SPARGE_F32, B, H, NQB, NKB);
        uint8_t before[B * H * NQB * NKB], after[sizeof before];
        assert_int_equal(sparge_mask_select(dev, &mt, &mp, m), SPARGE_OK);
        assert_int_equal(sparge_mask_get_dense(m, before), SPARGE_OK);
        for (int i = 0; i < B * H * NQB * NKB; i++)
            map[i] = (float)(NKB - i % NKB);
        EXPECT_FAIL(SPARGE_ERR_MASK, sparge_mask_select(dev, &mt, &bad, m));
        assert_int_equal(sparge_mask_get_dense(m, after), SPARGE_OK);
        assert_memory_equal(before, after, sizeof before);
    }
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_mask_predict(dev, &qt, &kt, NULL, m));
    assert_int_equal(sparge_mask_predict(dev, &qt, &kt, &mp, m), SPARGE_OK);
    /* a mask built for other shapes */
    sparge_tensor q2 = sparge_tensor_bhnd(q, SPARGE_F32, B, H, NQ - 10, D), o2 = sparge_tensor_bhnd(o, SPARGE_F32, B, H, NQ - 10, D);
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_forward(dev, &q2, &kt, &vt, m, NULL, &o2, lse));
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_mask_predict(dev, &q2, &kt, &mp, m));
    /* a mask from another device */
    sparge_device *other;
    assert_int_equal(sparge_device_open("cpu-ref", &other), SPARGE_OK);
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_forward(other, &qt, &kt, &vt, m, NULL, &ot, lse));
    sparge_device_close(other);
    /* the backward needs the forward's LSE */
    float g[B * H * NQ * D];
    sparge_tensor gt = sparge_tensor_bhnd(g, SPARGE_F32, B, H, NQ, D);
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_attention_backward(dev, &qt, &kt, &vt, &qt, &qt, NULL, m, NULL, &gt, &kt, &vt));
    sparge_mask_destroy(m);
}

/* NaN in a query row poisons that row only; NaN in a key reaches every row
 * that attends to it. Inf behaves like NaN after the products. Nothing crashes. */
static void test_nan_propagates(void **state)
{
    (void)state;
    static const char *const tiers[] = {"cpu", "cpu-ref"};
    for (int t = 0; t < 2; t++) {
        sparge_device *d;
        assert_int_equal(sparge_device_open(tiers[t], &d), SPARGE_OK);
        float qn[NQ * D], kn[NK * D], vn[NK * D], on[NQ * D];
        fill(qn, NQ * D, 5);
        fill(kn, NK * D, 6);
        fill(vn, NK * D, 7);
        qn[3 * D + 1] = NAN;
        sparge_tensor qt = sparge_tensor_bhnd(qn, SPARGE_F32, 1, 1, NQ, D), kt = sparge_tensor_bhnd(kn, SPARGE_F32, 1, 1, NK, D),
                      vt = sparge_tensor_bhnd(vn, SPARGE_F32, 1, 1, NK, D), ot = sparge_tensor_bhnd(on, SPARGE_F32, 1, 1, NQ, D);
        assert_int_equal(sparge_attention_forward(d, &qt, &kt, &vt, NULL, NULL, &ot, NULL), SPARGE_OK);
        assert_true(isnan(on[3 * D]));
        assert_false(isnan(on[4 * D]));
        /* through the one-call API: the NaN query block keeps every key block */
        sparge_mask_params mp = {16, 8, 0.05, 0.2, 0.0f, 0};
        assert_int_equal(sparge_attention(d, &qt, &kt, &vt, &mp, &ot, NULL, NULL), SPARGE_OK);
        assert_true(isnan(on[3 * D]));
        /* +Inf in a key: a query with a positive product sees score +Inf, then Inf − Inf = NaN */
        kn[7 * D] = INFINITY;
        int t_pos = 10;
        while (qn[t_pos * D] <= 0.0f)
            t_pos++;
        assert_int_equal(sparge_attention_forward(d, &qt, &kt, &vt, NULL, NULL, &ot, NULL), SPARGE_OK);
        assert_true(isnan(on[t_pos * D]));
        sparge_device_close(d);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_devices), cmocka_unit_test(test_options_and_support),
                                       cmocka_unit_test(test_forward_bad_input),
                                       cmocka_unit_test(test_mask_bad_input), cmocka_unit_test(test_nan_propagates)};
    return cmocka_run_group_tests_name("api", tests, setup, teardown);
}
