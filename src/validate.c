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
    if (!sparge_dtype_size(t->dtype))
        return SPARGE_FAIL(SPARGE_ERR_DTYPE, "%s: %s has unknown dtype %d", fn, role, (int)t->dtype);
    static const char dims[] = "BHND";
    int64_t elems = 1, span = 1;
    for (int i = 0; i < 4; i++) {
        if (t->shape[i] <= 0)
            return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: %s dimension %c is %lld (must be > 0)", fn, role, dims[i],
                               (long long)t->shape[i]);
        if (t->stride[i] < 0)
            return SPARGE_FAIL(SPARGE_ERR_INVALID,
                               "%s: %s stride of %c is negative (%lld; sparge_tensor_bhnd/bnhd give -1 when the "
                               "shape's size overflows)", fn, role, dims[i], (long long)t->stride[i]);
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
    if ((uintptr_t)t->data % sparge_dtype_size(t->dtype))
        return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: %s->data is not aligned to its %zu-byte elements", fn, role,
                           sparge_dtype_size(t->dtype));
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

/* Bytes [lo, hi) a view spans. */
static void view_range(const sparge_view *v, uintptr_t *lo, uintptr_t *hi)
{
    const int64_t n[4] = {v->B, v->H, v->N, v->D}, st[4] = {v->sb, v->sh, v->sn, v->sd};
    uint64_t last = 0; /* validated views: no overflow */
    for (int i = 0; i < 4; i++)
        last += (uint64_t)(n[i] - 1) * (uint64_t)st[i];
    *lo = (uintptr_t)v->data;
    *hi = *lo + (uintptr_t)((last + 1) * sparge_dtype_size(v->dtype));
}

/* Whether delta = Σ i_k·s_k for some |i_k| < n_k over dims k..3 sorted by descending stride, where rest[k] is
 * the reach Σ_{j≥k} (n_j − 1)·s_j. A view that does not overlap itself has s_k > rest[k+1], so at most two i_k
 * fit each level. */
static int reachable(int64_t delta, const int64_t *n, const int64_t *st, const int64_t *rest, int k)
{
    if (k == 4)
        return delta == 0;
    if (delta > rest[k] || -delta > rest[k])
        return 0;
    const int64_t r = rest[k + 1];
    int64_t lo = (delta - r) / st[k] - 1, hi = (delta + r) / st[k] + 1;
    if (lo < -(n[k] - 1)) lo = -(n[k] - 1);
    if (hi > n[k] - 1) hi = n[k] - 1;
    for (int64_t i = lo; i <= hi; i++)
        if (reachable(delta - i * st[k], n, st, rest, k + 1))
            return 1;
    return 0;
}

/* Two views of the same shape and strides (interleaved slices of one buffer, like Q, K and V of a packed QKV
 * projection) share an element exactly when their offset is a difference of two indices. */
static int same_layout_overlaps(const sparge_view *a, const sparge_view *b)
{
    const int64_t es = (int64_t)sparge_dtype_size(a->dtype);
    const int64_t bytes = (int64_t)((uintptr_t)b->data - (uintptr_t)a->data);
    if (bytes % es)
        return 1;
    int64_t n[4] = {a->B, a->H, a->N, a->D}, st[4] = {a->sb, a->sh, a->sn, a->sd}, rest[5] = {0, 0, 0, 0, 0};
    for (int i = 1; i < 4; i++) /* descending stride */
        for (int j = i; j > 0 && st[j] > st[j - 1]; j--) {
            int64_t t = st[j]; st[j] = st[j - 1]; st[j - 1] = t;
            t = n[j]; n[j] = n[j - 1]; n[j - 1] = t;
        }
    for (int k = 3; k >= 0; k--) {
        if (n[k] == 1 || st[k] == 0) { /* a dimension that adds no offset */
            n[k] = 1;
            st[k] = 1;
        }
        rest[k] = rest[k + 1] + (n[k] - 1) * st[k];
    }
    return reachable(bytes / es, n, st, rest, 0);
}

static int views_overlap(const sparge_region *a, const sparge_region *b)
{
    if (!(a->lo < b->hi && b->lo < a->hi))
        return 0;
    const sparge_view *x = a->view, *y = b->view;
    if (!x || !y || x->dtype != y->dtype || x->B != y->B || x->H != y->H || x->N != y->N || x->D != y->D ||
        x->sb != y->sb || x->sh != y->sh || x->sn != y->sn || x->sd != y->sd)
        return 1; /* ranges overlap and the layouts differ: refused as overlapping */
    return same_layout_overlaps(x, y);
}

sparge_status sparge_check_disjoint(const sparge_region *outs, int n_out, const sparge_region *ins, int n_in,
                                    const char *fn)
{
    for (int i = 0; i < n_out; i++) {
        if (!outs[i].lo)
            continue;
        for (int j = 0; j < n_in + i; j++) {
            const sparge_region *o = j < n_in ? &ins[j] : &outs[j - n_in];
            if (o->lo && views_overlap(&outs[i], o))
                return SPARGE_FAIL(SPARGE_ERR_INVALID, "%s: output %s overlaps %s %s in memory (outputs must not share "
                                   "an element with any input or other output)", fn, outs[i].role,
                                   j < n_in ? "input" : "output", o->role);
        }
    }
    return SPARGE_OK;
}

sparge_region sparge_view_region(const sparge_view *v, const char *role)
{
    sparge_region r = {0, 0, role, v};
    view_range(v, &r.lo, &r.hi);
    return r;
}

sparge_region sparge_lse_region(const float *lse, int64_t count, const char *role)
{
    sparge_region r = {(uintptr_t)lse, (uintptr_t)lse + (uintptr_t)count * sizeof(float), role, NULL};
    if (!lse)
        r.lo = r.hi = 0;
    return r;
}
