/* Micro-kernels compiled once per SIMD tier (SIMD_TIER = generic, avx2, avx512,
 * each with its own -m flags). The AVX2 and AVX-512 builds use intrinsics,
 * chosen by the compiler's target macros; the generic build is portable C. */
#include <math.h>
#include <string.h>

#include "simd.h"

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define TIER_NAME_(t) #t
#define TIER_NAME(t) TIER_NAME_(t)

static inline float load1(const void *p, sparge_dtype t, int64_t i)
{
    switch (t) {
    case SPARGE_F16: return sparge_f16_to_f32(((const uint16_t *)p)[i]);
    case SPARGE_BF16: return sparge_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void store1(void *p, sparge_dtype t, int64_t i, float x)
{
    switch (t) {
    case SPARGE_F16: ((uint16_t *)p)[i] = sparge_f32_to_f16(x); break;
    case SPARGE_BF16: ((uint16_t *)p)[i] = sparge_f32_to_bf16(x); break;
    default: ((float *)p)[i] = x; break;
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline size_t elem_size(sparge_dtype t) { return t == SPARGE_F32 ? 4 : 2; }

/* ------------------------------------------------ vector vocabulary per width
 * A register tile of GEMM is MR rows × NV vectors: 6 × 4 accumulators of
 * AVX-512 leave 4 registers for B and 1 for the broadcast A (32 in all);
 * 6 × 2 of AVX2 fit its 16 registers the same way. */
#if defined(__AVX512F__)
typedef __m512 vec;
typedef __mmask16 vmask;
enum { VL = 16, MR = 6, NV = 4 };
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, x) _mm512_storeu_ps(p, x)
#define vmload(p, m) _mm512_maskz_loadu_ps(m, p)
#define vmstore(p, m, x) _mm512_mask_storeu_ps(p, m, x)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vfnma(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vmask vtail(int64_t w) { return w >= VL ? (vmask)0xffff : (vmask)((1u << w) - 1u); }
static inline float vsum(vec x) { return _mm512_reduce_add_ps(x); }

static inline vec load_cvt(const void *src, sparge_dtype t, int64_t w)
{
    vmask m = vtail(w);
    switch (t) {
    case SPARGE_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src));
    case SPARGE_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src)), 16));
    default: return vmload((const float *)src, m);
    }
}

/* f32 → bf16 bits in 32-bit lanes, rounding to nearest even; NaN stays a quiet NaN. */
static inline __m512i bf16_bits(vec x)
{
    __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    vmask is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                           _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_epi32(is_nan, _mm512_srli_epi32(r, 16), nan);
}

/* In-register transpose of a 16×16 block held as 16 row vectors. */
static inline void transpose(vec r[VL])
{
    vec t[VL];
    for (int i = 0; i < VL; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    /* r[4g + j], 128-bit lane k: column 4k + j of rows 4g .. 4g + 3 */
    for (int g = 0; g < VL; g += 4)
        for (int j = 0; j < 2; j++) {
            __m512d lo = _mm512_castps_pd(t[g + j]), hi = _mm512_castps_pd(t[g + j + 2]);
            r[g + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
            r[g + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
        }
    for (int j = 0; j < 4; j++) {
        vec a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        vec c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
        t[8 + j] = _mm512_shuffle_f32x4(a, c, 0xdd);
        t[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
    for (int i = 0; i < VL; i++)
        r[i] = t[i];
}

static inline void store_cvt(void *dst, sparge_dtype t, vec x, int64_t w)
{
    vmask m = vtail(w);
    switch (t) {
    case SPARGE_F16:
        _mm256_mask_storeu_epi16(dst, m, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        break;
    case SPARGE_BF16: _mm256_mask_storeu_epi16(dst, m, _mm512_cvtepi32_epi16(bf16_bits(x))); break;
    default: vmstore((float *)dst, m, x); break;
    }
}

#else /* AVX2 + FMA + F16C */
typedef __m256 vec;
typedef __m256i vmask;
enum { VL = 8, MR = 6, NV = 2 };
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, x) _mm256_storeu_ps(p, x)
#define vmload(p, m) _mm256_maskload_ps(p, m)
#define vmstore(p, m, x) _mm256_maskstore_ps(p, m, x)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vfnma(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vmask vtail(int64_t w)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)min64(w, VL)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline float vsum(vec x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline vec load_cvt(const void *src, sparge_dtype t, int64_t w)
{
    uint16_t tmp[VL] = {0};
    if (t == SPARGE_F32)
        return w >= VL ? vload((const float *)src) : vmload((const float *)src, vtail(w));
    if (w < VL) {
        memcpy(tmp, src, (size_t)w * 2);
        src = tmp;
    }
    __m128i h = _mm_loadu_si128((const __m128i *)src);
    if (t == SPARGE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* In-register transpose of an 8×8 block held as 8 row vectors. */
static inline void transpose(vec r[VL])
{
    vec t[VL], u[VL];
    for (int i = 0; i < VL; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    /* u[4g + j], 128-bit lane k: column 4k + j of rows 4g .. 4g + 3 */
    for (int g = 0; g < VL; g += 4) {
        u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
        u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xee);
        u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xee);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}

static inline void store_cvt(void *dst, sparge_dtype t, vec x, int64_t w)
{
    __m128i h;
    if (t == SPARGE_F32) {
        if (w >= VL)
            vstore((float *)dst, x);
        else
            vmstore((float *)dst, vtail(w), x);
        return;
    }
    if (t == SPARGE_F16)
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else {
        __m256i u = _mm256_castps_si256(x), one = _mm256_set1_epi32(1);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
        __m256i b = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), nan, is_nan);
        h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    }
    if (w >= VL)
        _mm_storeu_si128((__m128i *)dst, h);
    else {
        uint16_t tmp[VL];
        _mm_storeu_si128((__m128i *)tmp, h);
        memcpy(dst, tmp, (size_t)w * 2);
    }
}
#endif

/* exp(x) = 2^n·e^r, n = round(x/ln2), r = x − n·ln2 (two-part ln2, |r| ≤ ln2/2), e^r by its
 * degree-7 Taylor polynomial (truncation < 5e-9 relative): within 2 ulp of expf. Results
 * below 2^-126 become 0 (no denormals downstream); NaN propagates; +inf gives +inf.
 * AVX-512 scales by 2^n with scalef; AVX2 builds 2^n in the exponent field (n clamped to [−126, 127]). */
static inline vec vexp(vec x)
{
#if defined(__AVX512F__)
    vmask under = _mm512_cmp_ps_mask(x, vset1(-87.33654f), _CMP_LT_OQ);
    x = _mm512_max_ps(vset1(-88.0f), _mm512_min_ps(vset1(89.0f), x)); /* NaN is the second operand: kept */
#else
    vec under = _mm256_cmp_ps(x, vset1(-87.33654f), _CMP_LT_OQ);
    vec over = _mm256_cmp_ps(x, vset1(88.72283f), _CMP_GT_OQ);
    x = _mm256_max_ps(vset1(-87.0f), _mm256_min_ps(vset1(88.37f), x)); /* NaN is the second operand: kept */
#endif
    vec n = vround(vmul(x, vset1(1.44269504088896341f)));
    vec r = vfnma(n, vset1(0.693359375f), x);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vec p = vset1(1.0f / 5040.0f);
    p = vfma(p, r, vset1(1.0f / 720.0f));
    p = vfma(p, r, vset1(1.0f / 120.0f));
    p = vfma(p, r, vset1(1.0f / 24.0f));
    p = vfma(p, r, vset1(1.0f / 6.0f));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.0f));
    p = vfma(p, r, vset1(1.0f));
#if defined(__AVX512F__)
    return _mm512_maskz_scalef_ps((vmask)~under, p, n);
#else
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    vec y = vmul(p, _mm256_castsi256_ps(e));
    y = _mm256_blendv_ps(y, vset1(INFINITY), over);
    return _mm256_andnot_ps(under, y);
#endif
}

/* w ≤ VL floats at p (lanes past w read as 0 / not written). */
static inline vec vld(const float *p, int64_t w) { return w >= VL ? vload(p) : vmload(p, vtail(w)); }
static inline void vst(float *p, vec x, int64_t w)
{
    if (w >= VL)
        vstore(p, x);
    else
        vmstore(p, vtail(w), x);
}

/* ------------------------------------------------ GEMM */

/* One mr × nv register tile; the last vector holds `last` (≤ VL) columns and
 * is masked when `masked`. With constant mr, nv, masked and the loops fully
 * unrolled, the accumulator array lives in registers (not on the stack). */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, const int masked, int64_t k,
                                                       const float *a, int64_t sai, int64_t sap, const float *b,
                                                       int64_t ldb, float *c, int64_t ldc, int accumulate,
                                                       const float *cs, int64_t last)
{
    vec s[MR][NV], bv[NV];
    vmask tail = vtail(masked ? last : VL);
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++)
            s[i][v] = vzero();
    for (int64_t p = 0; p < k; p++) {
        const float *bp = b + p * ldb, *ap = a + p * sap;
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++)
            bv[v] = masked && v == nv - 1 ? vmload(bp + v * VL, tail) : vload(bp + v * VL);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            vec x = vset1(ap[i * sai]);
#pragma GCC unroll 8
            for (int v = 0; v < nv; v++)
                s[i][v] = vfma(x, bv[v], s[i][v]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) {
            float *cp = c + i * ldc + v * VL;
            int m = masked && v == nv - 1;
            if (accumulate) {
                vec old = m ? vmload(cp, tail) : vload(cp);
                s[i][v] = cs ? vfma(vset1(cs[i]), old, s[i][v]) : vadd(old, s[i][v]);
            }
            if (m)
                vmstore(cp, tail, s[i][v]);
            else
                vstore(cp, s[i][v]);
        }
}

typedef void (*tile_fn)(int64_t k, const float *a, int64_t sai, int64_t sap, const float *b, int64_t ldb, float *c,
                        int64_t ldc, int accumulate, const float *cs, int64_t last);

#define DEF_TILE(mr, nv, masked)                                                                                   \
    static void tile_##mr##_##nv##_##masked(int64_t k, const float *a, int64_t sai, int64_t sap, const float *b,  \
                                            int64_t ldb, float *c, int64_t ldc, int accumulate, const float *cs,  \
                                            int64_t last)                                                          \
    {                                                                                                              \
        tile(mr, nv, masked, k, a, sai, sap, b, ldb, c, ldc, accumulate, cs, last);                                \
    }
#if defined(__AVX512F__)
#define FOR_NV(X, mr, m) X(mr, 1, m) X(mr, 2, m) X(mr, 3, m) X(mr, 4, m)
#define NV_ROW(mr, m) {tile_##mr##_1_##m, tile_##mr##_2_##m, tile_##mr##_3_##m, tile_##mr##_4_##m}
#else
#define FOR_NV(X, mr, m) X(mr, 1, m) X(mr, 2, m)
#define NV_ROW(mr, m) {tile_##mr##_1_##m, tile_##mr##_2_##m}
#endif
#define FOR_MR(m) FOR_NV(DEF_TILE, 1, m) FOR_NV(DEF_TILE, 2, m) FOR_NV(DEF_TILE, 3, m) \
    FOR_NV(DEF_TILE, 4, m) FOR_NV(DEF_TILE, 5, m) FOR_NV(DEF_TILE, 6, m)
FOR_MR(0)
FOR_MR(1)
#define MR_ROWS(m) {NV_ROW(1, m), NV_ROW(2, m), NV_ROW(3, m), NV_ROW(4, m), NV_ROW(5, m), NV_ROW(6, m)}
static const tile_fn tiles[2][MR][NV] = {MR_ROWS(0), MR_ROWS(1)};

/* Panels of NV·VL columns; within one, the B panel stays in L1 while every row strip passes. */
static void gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t sai, int64_t sap, const float *b, int64_t ldb,
                 float *c, int64_t ldc, int accumulate, const float *c_scale)
{
    for (int64_t j0 = 0; j0 < n; j0 += NV * VL) {
        int64_t w = min64(n - j0, NV * VL), nv = (w + VL - 1) / VL, last = w - (nv - 1) * VL;
        int masked = last < VL;
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
            int64_t mr = min64(m - i0, MR);
            tiles[masked][mr - 1][nv - 1](k, a + i0 * sai, sai, sap, b + j0, ldb, c + i0 * ldc + j0, ldc, accumulate,
                                          c_scale ? c_scale + i0 : NULL, last);
        }
    }
}

/* ------------------------------------------------ softmax pieces */

static void softmax_cols(float *s, int64_t lds, int64_t rows, int64_t n, float *m, float *l, float *corr)
{
    for (int64_t c = 0; c < n; c += VL) {
        int64_t w = min64(n - c, VL);
        vec m_old = vld(m + c, w), mx = m_old, sum = vzero();
        for (int64_t r = 0; r < rows; r++)
            mx = vmax(mx, vld(s + r * lds + c, w));
        vec cr = vexp(vsub(m_old, mx));
        for (int64_t r = 0; r < rows; r++) {
            vec p = vexp(vsub(vld(s + r * lds + c, w), mx));
            vst(s + r * lds + c, p, w);
            sum = vadd(sum, p);
        }
        vst(l + c, vfma(vld(l + c, w), cr, sum), w);
        vst(m + c, mx, w);
        vst(corr + c, cr, w);
    }
}

static void grad_cols(float *s, float *dp, int64_t ld, int64_t rows, int64_t n, const float *lse, const float *delta)
{
    for (int64_t c = 0; c < n; c += VL) {
        int64_t w = min64(n - c, VL);
        vec l = vld(lse + c, w), d = vld(delta + c, w);
        for (int64_t r = 0; r < rows; r++) {
            float *sp = s + r * ld + c, *dpp = dp + r * ld + c;
            vec p = vexp(vsub(vld(sp, w), l));
            vst(sp, p, w);
            vst(dpp, vmul(p, vsub(vld(dpp, w), d)), w);
        }
    }
}

static void dot_cols(const float *a, const float *b, int64_t ld, int64_t k, int64_t n, float *out)
{
    for (int64_t c = 0; c < n; c += VL) {
        int64_t w = min64(n - c, VL);
        vec acc = vzero();
        for (int64_t p = 0; p < k; p++)
            acc = vfma(vld(a + p * ld + c, w), vld(b + p * ld + c, w), acc);
        vst(out + c, acc, w);
    }
}

static float exp_sum(float *x, int64_t n, float m)
{
    vec sum = vzero(), mv = vset1(m);
    for (int64_t i = 0; i < n; i += VL) {
        int64_t w = min64(n - i, VL);
        vec p = vexp(vsub(vld(x + i, w), mv));
        vst(x + i, p, w);
        sum = vadd(sum, w < VL ? vld(x + i, w) : p); /* lanes past n must not count */
    }
    return vsum(sum);
}

/* ------------------------------------------------ conversions */

/* VL elements of row (element stride cs) starting at column c, w of them real. */
static inline vec load_row(const char *row, sparge_dtype t, int64_t cs, int64_t c, int64_t w)
{
    if (cs == 1)
        return load_cvt(row + (size_t)c * elem_size(t), t, w);
    float tmp[VL] = {0};
    for (int64_t i = 0; i < w; i++)
        tmp[i] = load1(row, t, (c + i) * cs);
    return vload(tmp);
}

static void load(const void *src, sparge_dtype t, int64_t rs, int64_t cs, int64_t rows, int64_t cols, float scale,
                 float *dst, int64_t ldd, int transposed)
{
    vec sv = vset1(scale);
    const char *base = src;
    size_t row_bytes = (size_t)rs * elem_size(t);
    if (!transposed) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c += VL) {
                int64_t w = min64(cols - c, VL);
                vst(dst + r * ldd + c, vmul(load_row(base + (size_t)r * row_bytes, t, cs, c, w), sv), w);
            }
        return;
    }
    /* VL×VL blocks transposed in registers: both sides stay contiguous. */
    for (int64_t r0 = 0; r0 < rows; r0 += VL) {
        int64_t h = min64(rows - r0, VL);
        for (int64_t c0 = 0; c0 < cols; c0 += VL) {
            int64_t w = min64(cols - c0, VL);
            vec blk[VL];
#pragma GCC unroll 16
            for (int64_t i = 0; i < VL; i++)
                blk[i] = i < h ? vmul(load_row(base + (size_t)(r0 + i) * row_bytes, t, cs, c0, w), sv) : vzero();
            transpose(blk);
#pragma GCC unroll 16
            for (int64_t i = 0; i < w; i++)
                vst(dst + (c0 + i) * ldd + r0, blk[i], h);
        }
    }
}

static void store(const float *src, int64_t lds, const float *row_scale, int64_t rows, int64_t cols, void *dst,
                  sparge_dtype t, int64_t rs, int64_t cs)
{
    for (int64_t r = 0; r < rows; r++) {
        vec sc = vset1(row_scale ? row_scale[r] : 1.0f);
        char *row = (char *)dst + (size_t)(r * rs) * elem_size(t);
        for (int64_t c = 0; c < cols; c += VL) {
            int64_t w = min64(cols - c, VL);
            vec x = vmul(vld(src + r * lds + c, w), sc);
            if (cs == 1)
                store_cvt(row + (size_t)c * elem_size(t), t, x, w);
            else {
                float tmp[VL];
                vstore(tmp, x);
                for (int64_t i = 0; i < w; i++)
                    store1(row, t, (c + i) * cs, tmp[i]);
            }
        }
    }
}

static void sum_rows(const void *src, sparge_dtype t, int64_t rs, int64_t cs, int64_t rows, int64_t cols, float *acc)
{
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)src + (size_t)(r * rs) * elem_size(t);
        for (int64_t c = 0; c < cols; c += VL) {
            int64_t w = min64(cols - c, VL);
            vst(acc + c, vadd(vld(acc + c, w), load_row(row, t, cs, c, w)), w);
        }
    }
}

#else /* ------------------------------------------------ portable C */

static void gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t sai, int64_t sap, const float *b, int64_t ldb,
                 float *c, int64_t ldc, int accumulate, const float *c_scale)
{
    for (int64_t i = 0; i < m; i++) {
        float *ci = c + i * ldc, sc = accumulate ? (c_scale ? c_scale[i] : 1.0f) : 0.0f;
        for (int64_t j = 0; j < n; j++)
            ci[j] = sc == 0.0f ? 0.0f : ci[j] * sc;
        for (int64_t p = 0; p < k; p++) {
            float x = a[i * sai + p * sap];
            const float *bp = b + p * ldb;
            for (int64_t j = 0; j < n; j++)
                ci[j] += x * bp[j];
        }
    }
}

static void softmax_cols(float *s, int64_t lds, int64_t rows, int64_t n, float *m, float *l, float *corr)
{
    for (int64_t c = 0; c < n; c++) {
        float mx = m[c], sum = 0.0f;
        for (int64_t r = 0; r < rows; r++)
            mx = s[r * lds + c] > mx ? s[r * lds + c] : mx;
        corr[c] = expf(m[c] - mx);
        for (int64_t r = 0; r < rows; r++)
            sum += s[r * lds + c] = expf(s[r * lds + c] - mx);
        l[c] = l[c] * corr[c] + sum;
        m[c] = mx;
    }
}

static void grad_cols(float *s, float *dp, int64_t ld, int64_t rows, int64_t n, const float *lse, const float *delta)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) {
            float p = expf(s[r * ld + c] - lse[c]);
            s[r * ld + c] = p;
            dp[r * ld + c] = p * (dp[r * ld + c] - delta[c]);
        }
}

static void dot_cols(const float *a, const float *b, int64_t ld, int64_t k, int64_t n, float *out)
{
    for (int64_t c = 0; c < n; c++) {
        float acc = 0.0f;
        for (int64_t p = 0; p < k; p++)
            acc += a[p * ld + c] * b[p * ld + c];
        out[c] = acc;
    }
}

static float exp_sum(float *x, int64_t n, float m)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
        sum += x[i] = expf(x[i] - m);
    return sum;
}

static void load(const void *src, sparge_dtype t, int64_t rs, int64_t cs, int64_t rows, int64_t cols, float scale,
                 float *dst, int64_t ldd, int transpose)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dst[transpose ? c * ldd + r : r * ldd + c] = scale * load1(src, t, r * rs + c * cs);
}

static void store(const float *src, int64_t lds, const float *row_scale, int64_t rows, int64_t cols, void *dst,
                  sparge_dtype t, int64_t rs, int64_t cs)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            store1(dst, t, r * rs + c * cs, src[r * lds + c] * (row_scale ? row_scale[r] : 1.0f));
}

static void sum_rows(const void *src, sparge_dtype t, int64_t rs, int64_t cs, int64_t rows, int64_t cols, float *acc)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            acc[c] += load1(src, t, r * rs + c * cs);
}
#endif

const sparge_simd_ops CAT(sparge_simd_, SIMD_TIER) = {TIER_NAME(SIMD_TIER), gemm, softmax_cols, grad_cols, dot_cols,
                                                      exp_sum, load, store, sum_rows};
