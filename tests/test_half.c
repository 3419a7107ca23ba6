/* fp16 / bf16 conversions: exhaustive round trips and round-to-nearest-even. */
#include <math.h>
#include <string.h>

#include "testutil.h"

static void test_f16_roundtrip(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = sparge_f16_to_f32((uint16_t)h);
        if (isnan(f))
            assert_true(isnan(sparge_f16_to_f32(sparge_f32_to_f16(f))));
        else
            assert_int_equal(sparge_f32_to_f16(f), h);
    }
}

static void test_f16_rounding(void **state)
{
    (void)state;
    assert_int_equal(sparge_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(sparge_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);          /* tie → even */
    assert_int_equal(sparge_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);      /* tie → even (up) */
    assert_int_equal(sparge_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(sparge_f32_to_f16(65520.0f), 0x7c00);                 /* overflow → Inf */
    assert_int_equal(sparge_f32_to_f16(0x1p-24f), 0x0001);                 /* smallest subnormal */
    assert_int_equal(sparge_f32_to_f16(0x1p-25f), 0x0000);                 /* tie → even (zero) */
    assert_int_equal(sparge_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(sparge_f32_to_f16(INFINITY), 0x7c00);
    assert_true(isnan(sparge_f16_to_f32(sparge_f32_to_f16(NAN))));
#if defined(__FLT16_MAX__)
    uint32_t u = 12345;
    for (int i = 0; i < 1000000; i++) { /* random floats against the compiler's _Float16 */
        u = u * 1664525u + 1013904223u;
        float f;
        uint32_t bits = (u & 0x8fffffffu) | 0x30000000u;
        memcpy(&f, &bits, 4);
        _Float16 h = (_Float16)f;
        uint16_t hb;
        memcpy(&hb, &h, 2);
        if (!isnan(f))
            assert_int_equal(sparge_f32_to_f16(f), hb);
    }
#endif
}

static void test_bf16(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = sparge_bf16_to_f32((uint16_t)h);
        if (!isnan(f))
            assert_int_equal(sparge_f32_to_bf16(f), h);
    }
    assert_int_equal(sparge_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);     /* tie → even */
    assert_int_equal(sparge_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
    assert_true(isnan(sparge_bf16_to_f32(sparge_f32_to_bf16(NAN))));
}

/* Every f32 NaN, quiet or signalling, whatever its payload and sign, converts to a NaN (docs/DESIGN.md §1.1): a
 * payload held only in the low 16 bits must not become an infinity in bf16, nor one in the low 13 bits in f16. */
static void test_nan_payloads_stay_nan(void **state)
{
    (void)state;
    for (uint32_t sign = 0; sign < 2; sign++)
        for (uint32_t m = 1; m < (1u << 23); m = m * 3 + 1) {
            const uint32_t bits = sign << 31 | 0x7f800000u | m;
            float f;
            memcpy(&f, &bits, 4);
            assert_true(isnan(f));
            if (!isnan(sparge_bf16_to_f32(sparge_f32_to_bf16(f))))
                fail_msg("f32 NaN 0x%08x became bf16 0x%04x", bits, sparge_f32_to_bf16(f));
            if (!isnan(sparge_f16_to_f32(sparge_f32_to_f16(f))))
                fail_msg("f32 NaN 0x%08x became f16 0x%04x", bits, sparge_f32_to_f16(f));
        }
}

/* The attention's stores round to nearest even like the conversions above (docs/DESIGN.md §1.1). With Q = 0 every
 * score is 0, so O_t is the mean of the two value rows, exact in f32 on both CPU tiers; v1 lies 1..3 units in the
 * last place above v0, so about half the means sit halfway between two storable values. O must hold exactly the
 * conversion of that mean, in every SIMD tier of "cpu", contiguous and with an element stride of 2 along D (the
 * elements between the view's stay as they were). D = 19 leaves a partial vector at the end of each row. */
static void test_attention_stores_round_to_even(void **state)
{
    (void)state;
    enum { H = 2, NQ = 37, NK = 2, D = 19, NO = H * NQ * D };
    static const char *const devices[] = {"cpu-ref", "cpu"};
    static const char *const simd[] = {"auto", "avx2", "generic"};
    static const sparge_dtype dts[] = {SPARGE_F16, SPARGE_BF16};
    uint16_t q[H * NQ * D] = {0}, k[H * NK * D] = {0}, v[H * NK * D], o[2 * NO];
    uint32_t u = 20261205;
    for (int t = 0; t < 2; t++) {
        sparge_device *dev = tu_open_or_null(devices[t]);
        assert_non_null(dev);
        for (int s = 0; s < (t ? 3 : 1); s++) {
            if (t)
                assert_int_equal(sparge_device_set_option(dev, "simd", simd[s]), SPARGE_OK);
            for (int di = 0; di < 2; di++) {
                const sparge_dtype dt = dts[di];
                const int f16 = dt == SPARGE_F16;
                for (int h = 0; h < H; h++)
                    for (int d = 0; d < D; d++) {
                        u = u * 1664525u + 1013904223u;
                        /* sign, an exponent near 1, a mantissa ending in two 0 bits; v1 = v0 + 1..3 units */
                        uint16_t bits = f16 ? (uint16_t)((u >> 31) << 15 | (13 + (u >> 20) % 4) << 10 | (u & 0x3fcu))
                                            : (uint16_t)((u >> 31) << 15 | (125 + (u >> 20) % 4) << 7 | (u & 0x7cu));
                        v[(h * NK + 0) * D + d] = bits;
                        v[(h * NK + 1) * D + d] = (uint16_t)(bits + 1 + (u >> 8) % 3);
                    }
                for (int strided = 0; strided < 2; strided++) {
                    sparge_tensor qt = sparge_tensor_bhnd(q, dt, 1, H, NQ, D), kt = sparge_tensor_bhnd(k, dt, 1, H, NK, D),
                                  vt = sparge_tensor_bhnd(v, dt, 1, H, NK, D), ot = sparge_tensor_bhnd(o, dt, 1, H, NQ, D);
                    const int64_t es = strided ? 2 : 1;
                    for (int i = 0; i < 4; i++)
                        ot.stride[i] *= es;
                    memset(o, 0xff, sizeof o);
                    assert_int_equal(sparge_attention_forward(dev, &qt, &kt, &vt, NULL, NULL, &ot, NULL), SPARGE_OK);
                    for (int h = 0; h < H; h++)
                        for (int n = 0; n < NQ; n++)
                            for (int d = 0; d < D; d++) {
                                const uint16_t *vh = v + h * NK * D;
                                float a = f16 ? sparge_f16_to_f32(vh[d]) : sparge_bf16_to_f32(vh[d]);
                                float b = f16 ? sparge_f16_to_f32(vh[D + d]) : sparge_bf16_to_f32(vh[D + d]);
                                float mean = (float)(((double)a + (double)b) / 2.0);
                                uint16_t want = f16 ? sparge_f32_to_f16(mean) : sparge_f32_to_bf16(mean);
                                const int64_t at = ((h * NQ + n) * D + d) * es;
                                if (o[at] != want)
                                    fail_msg("%s simd=%s %s%s: O[%d,%d,%d] = 0x%04x, the mean %.9g rounds to 0x%04x",
                                             devices[t], simd[s], f16 ? "f16" : "bf16", strided ? " strided" : "", h,
                                             n, d, o[at], (double)mean, want);
                                if (strided)
                                    assert_int_equal(o[at + 1], 0xffff);
                            }
                }
            }
        }
        sparge_device_close(dev);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_f16_roundtrip), cmocka_unit_test(test_f16_rounding),
                                       cmocka_unit_test(test_bf16),
                                       cmocka_unit_test(test_nan_payloads_stay_nan),
                                       cmocka_unit_test(test_attention_stores_round_to_even)};
    return cmocka_run_group_tests_name("half", tests, NULL, NULL);
}
