/* Tensor views and fp16/bf16 conversion. */
#include <math.h>
#include <string.h>

#include "backend.h"

size_t sparge_dtype_size(sparge_dtype t)
{
    switch (t) {
    case SPARGE_F32: return 4;
    case SPARGE_F16:
    case SPARGE_BF16: return 2;
    case SPARGE_F64: return 8;
    }
    return 0;
}

const char *sparge_dtype_name(sparge_dtype t)
{
    switch (t) {
    case SPARGE_F32: return "f32";
    case SPARGE_F16: return "f16";
    case SPARGE_BF16: return "bf16";
    case SPARGE_F64: return "f64";
    }
    return "?";
}

/* a·b, or -1 when either is negative or the product overflows int64. */
static int64_t mul_or_invalid(int64_t a, int64_t b)
{
    if (a < 0 || b < 0 || (a != 0 && b > INT64_MAX / a))
        return -1;
    return a * b;
}

/* Strides whose product overflows are all set to -1, which every entry point refuses. */
static sparge_tensor contiguous(void *data, sparge_dtype t, const int64_t shape[4], const int order[4])
{
    sparge_tensor x = {data, t, {shape[0], shape[1], shape[2], shape[3]}, {0, 0, 0, 0}};
    int64_t step = 1;
    for (int i = 3; i >= 0; i--) {
        x.stride[order[i]] = step;
        step = mul_or_invalid(step, shape[order[i]]);
        if (step < 0 && i > 0) {
            x.stride[0] = x.stride[1] = x.stride[2] = x.stride[3] = -1;
            break;
        }
    }
    return x;
}

sparge_tensor sparge_tensor_bhnd(void *data, sparge_dtype t, int64_t B, int64_t H, int64_t N, int64_t D)
{
    const int64_t shape[4] = {B, H, N, D};
    const int order[4] = {0, 1, 2, 3}; /* memory order, outermost first */
    return contiguous(data, t, shape, order);
}

sparge_tensor sparge_tensor_bnhd(void *data, sparge_dtype t, int64_t B, int64_t H, int64_t N, int64_t D)
{
    const int64_t shape[4] = {B, H, N, D};
    const int order[4] = {0, 2, 1, 3};
    return contiguous(data, t, shape, order);
}

size_t sparge_tensor_span_bytes(const sparge_tensor *t)
{
    if (!t || !sparge_dtype_size(t->dtype))
        return 0;
    int64_t span = 1;
    for (int i = 0; i < 4; i++) {
        if (t->shape[i] <= 0)
            return 0;
        int64_t step = mul_or_invalid(t->shape[i] - 1, t->stride[i]);
        if (step < 0 || span > INT64_MAX - step)
            return 0;
        span += step;
    }
    int64_t bytes = mul_or_invalid(span, (int64_t)sparge_dtype_size(t->dtype));
    return bytes < 0 || (uint64_t)bytes > SIZE_MAX ? 0 : (size_t)bytes;
}

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, 4);
    return x;
}

uint16_t sparge_f32_to_bf16(float x)
{
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and NaN */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float sparge_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t sparge_f32_to_f16(float x)
{
    uint32_t u = f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to ≥ 65520: overflow to Inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* subnormal or zero in fp16 */
        /* Adding 0.5 aligns the mantissa so that fp32 rounding does the RNE. */
        float f = bits_f32(a) + 0.5f;
        return (uint16_t)(sign | (f32_bits(f) - 0x3f000000u));
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd; /* rebias exponent (−112 << 23) and round */
    return (uint16_t)(sign | (a >> 13));
}

float sparge_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f)
        return bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        float f = ldexpf((float)mant, -24);
        return sign ? -f : f;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}
