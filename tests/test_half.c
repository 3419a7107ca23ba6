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

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_f16_roundtrip), cmocka_unit_test(test_f16_rounding),
                                       cmocka_unit_test(test_bf16)};
    return cmocka_run_group_tests_name("half", tests, NULL, NULL);
}
