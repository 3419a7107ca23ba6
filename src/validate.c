/* Argument validation shared by every entry point. */
#include <math.h>
#include <stdint.h>

#include "core.h"

int sparge_mul_overflows(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0)
        return 1;
    if (a != 0 && b > INT64_MAX / a)
        return 1;
    *out = a * b;
    return 0;
}

/* Output views must not alias themselves: with dims sorted by stride, each
 * stride must step over the whole extent of the dims below it. */
static int self_overlapping(const sparge_view *v)
{
    int64_t n[4] = {v->B, v->H, v->N, v->D}, s[4] = {v->sb, v->sh, v->sn, v->sd};
    for (int i = 1; i < 4; i++)
        for (int j = i; j > 0 && s[j] < s[j - 1]; j--) {
            int64_t t = s[j]; s[j] = s[j - 1]; s[j - 1] = t;
            t = n[j]; n[j] = n[j - 1]; n[j - 1] = t;
        }
    int64_t extent = 1;
    for (int i = 0; i < 4; i++) {
        if (n[i] == 1)
            continue;
        if (s[i] < extent)
            return 1;
        extent = s[i] * n[i];
    }
    return 0;
}

sparge_status sparge_check_tensor(const sparge_tensor *t, const char *fn, const char *role, int is_output,
                                  sparge_view *out)
{
    if (!t)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: tensor %s is NULL", fn, role);
    if (!t->data)
        return SPARGE_FAIL(SPARGE_ERR_NULL, "%s: %s->data is NULL", fn, role);
    if (t->dtype != SPARGE_F32 && t->dtype != SPARGE_F16 && t->dtype != SPARGE_BF16)
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: %s has unknown dtype %d", fn, role, (int)t->dtype);
    static const char dims[] = "BHND";
    int64_t elems = 1, span = 1;
    for (int i = 0; i < 4; i++) {
        if (t->shape[i] <= 0)
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: %s dimension %c is %lld (must be > 0)", fn, role, dims[i],
                               (long long)t->shape[i]);
        if (t->stride[i] < 0)
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: %s stride of %c is negative (%lld)", fn, role, dims[i],
                               (long long)t->stride[i]);
        int64_t step;
        if (sparge_mul_overflows(elems, t->shape[i], &elems) ||
            sparge_mul_overflows(t->shape[i] - 1, t->stride[i], &step) || span > INT64_MAX - step)
            return SPARGE_FAIL(SPARGE_ERR_OVERFLOW, "%s: %s size overflows (shape %lldx%lldx%lldx%lld)", fn, role,
                               (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2],
                               (long long)t->shape[3]);
        span += step;
    }
    if (t->shape[2] > INT32_MAX || t->shape[3] > INT32_MAX ||
        (uint64_t)span > SIZE_MAX / sparge_dtype_size(t->dtype) / 2)
        return SPARGE_FAIL(SPARGE_ERR_OVERFLOW, "%s: %s is too large (N and D must fit in int32)", fn, role);
    *out = (sparge_view){t->data, t->dtype, t->shape[0], t->shape[1], t->shape[2], t->shape[3],
                         t->stride[0], t->stride[1], t->stride[2], t->stride[3]};
    if (is_output && self_overlapping(out))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: output %s has overlapping strides", fn, role);
    return SPARGE_OK;
}

int sparge_rows_aligned(const sparge_view *v)
{
    const int64_t n = 16 / (int64_t)sparge_dtype_size(v->dtype);
    return v->sd == 1 && (uintptr_t)v->data % 16 == 0 && v->sb % n == 0 && v->sh % n == 0 && v->sn % n == 0;
}
