/* Conformance of one backend (BACKEND) against cpu-ref, the fp64 oracle:
 * the shared mask vectors, pooling, the pooled map, mask selection, forward
 * and backward over a grid of shapes (several B·H, ragged N, Nq ≠ Nk, D from
 * 32 to 256, BHND and BNHD views, f32/f16/bf16), fresh random inputs and
 * poisoned outputs; the backend's gradients of a scalar loss against finite differences of the fp64 forward.
 * Exits 77 when the backend is compiled in but has no device.
 * Combinations a backend does not support must fail cleanly with
 * SPARGE_ERR_UNSUPPORTED and leave the outputs untouched. */
#define _POSIX_C_SOURCE 200809L /* setenv, unsetenv, strdup */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "../backends/cpu/ref.h"

static sparge_device *dev, *ref;

typedef struct {
    int64_t B, H, Nq, Nk, D;
    int bq, bk;
} shape;

static const shape grid[] = {
    {1, 1, 128, 128, 64, 128, 64},   {2, 3, 300, 300, 64, 128, 64},  {1, 2, 1000, 700, 128, 128, 64},
    {2, 1, 77, 200, 128, 128, 128},  {1, 2, 520, 390, 128, 128, 128}, {1, 3, 260, 190, 32, 64, 32},
    {1, 1, 150, 333, 256, 128, 64},  {3, 2, 129, 65, 64, 128, 64},  {2, 1, 200, 270, 64, 128, 128},
};
enum { GRID = sizeof grid / sizeof grid[0] };
static const sparge_dtype dtypes[] = {SPARGE_F32, SPARGE_F16, SPARGE_BF16};

static int skipped, ran;

/* Fresh inputs per case: normal with a per-head "sink" key block so masks are not flat. */
static void fill_inputs(tu_tensor *x, tu_rng *r, int sink_block, int bk, double sd)
{
    int64_t B = x->t.shape[0], H = x->t.shape[1], N = x->t.shape[2], D = x->t.shape[3];
    double *v = malloc((size_t)(B * H * N * D) * sizeof *v);
    for (int64_t i = 0; i < B * H * N * D; i++) {
        int64_t n = i / D % N;
        v[i] = sd * tu_normal(r) + (sink_block >= 0 && n / bk == sink_block ? 0.8 : 0.0);
    }
    tu_set(x, v);
    free(v);
}

/* A backend may refuse a valid combination; then nothing may be written. */
static int unsupported(sparge_status s, tu_tensor **outs, int n, const char *what)
{
    if (s != SPARGE_ERR_UNSUPPORTED)
        return 0;
    for (int i = 0; i < n; i++)
        assert_true(tu_still_poisoned(outs[i]));
    if (!sparge_last_error()[0])
        fail_msg("%s: unsupported without a message", what);
    skipped++;
    return 1;
}

static void check_close(const char *what, const shape *s, sparge_dtype dt, tu_layout lay, double *got, double *want,
                        int64_t n, double tol)
{
    double e = tu_rel_l2(got, want, n);
    if (!(e <= tol))
        fail_msg("%s: B=%lld H=%lld Nq=%lld Nk=%lld D=%lld bq=%d bk=%d %s %s: rel L2 %.3g > %.3g", what,
                 (long long)s->B, (long long)s->H, (long long)s->Nq, (long long)s->Nk, (long long)s->D, s->bq, s->bk,
                 sparge_dtype_name(dt), lay == TU_BHND ? "BHND" : "BNHD", e, tol);
}

/* check_close of a backend tensor against the reference's. */
static void check_tensors(const char *what, const shape *s, sparge_dtype dt, tu_layout lay, tu_tensor *got,
                          tu_tensor *want, double tol)
{
    double *g = tu_get(got), *w = tu_get(want);
    check_close(what, s, dt, lay, g, w, tu_numel(got), tol);
    free(g);
    free(w);
}

/* check_close of the backend's forward LSE (n floats in device memory) against the reference's (host). */
static void check_lse(const char *what, const shape *s, sparge_dtype dt, tu_layout lay, const float *lse,
                      const float *want, int64_t n)
{
    float *host = malloc((size_t)n * sizeof *host);
    double *g = malloc((size_t)n * sizeof *g), *w = malloc((size_t)n * sizeof *w);
    assert_int_equal(sparge_memcpy_to_host(dev, host, lse, (size_t)n * sizeof *host), SPARGE_OK);
    for (int64_t t = 0; t < n; t++) {
        g[t] = host[t];
        w[t] = want[t];
    }
    check_close(what, s, dt, lay, g, w, n, 1e-5);
    free(host);
    free(g);
    free(w);
}

/* The decision for row i differs between the backend and the reference: accept
 * only if the reference's decision was within 1e-5 (relative) of flipping. */
static int close_call(const float *row, int64_t n, double k, double p, int64_t kept_ref)
{
    int32_t *order = malloc((size_t)n * sizeof *order);
    for (int64_t j = 0; j < n; j++)
        order[j] = (int32_t)j;
    for (int64_t a = 1; a < n; a++) /* insertion sort: descending, ties by index */
        for (int64_t b = a; b > 0 && (row[order[b]] > row[order[b - 1]]); b--) {
            int32_t t = order[b]; order[b] = order[b - 1]; order[b - 1] = t;
        }
    int close = 0;
    if (kept_ref < n) {
        double x = row[order[kept_ref - 1]], y = row[order[kept_ref]];
        close |= fabs(x - y) <= 1e-5 * fmax(fabs(x), fabs(y));
    }
    if (p > 0.0) {
        double cum = 0.0;
        for (int64_t t = 0; t < n; t++) {
            cum += row[order[t]];
            close |= fabs(cum - p) <= 1e-5 * fmax(p, 1e-30);
        }
    }
    (void)k;
    free(order);
    return close;
}

/* The transpose lists exactly the kept (i, j) pairs of dense, ascending, -1 past each count. */
static void check_transpose(const sparge_mask_shape *ms, const uint8_t *dense, const int32_t *tcnt, const int32_t *tidx)
{
    for (int64_t bh = 0; bh < ms->B * ms->H; bh++)
        for (int64_t j = 0; j < ms->Nkb; j++) {
            const int32_t *list = tidx + (bh * ms->Nkb + j) * ms->Nqb;
            int64_t c = 0;
            for (int64_t i = 0; i < ms->Nqb; i++)
                if (dense[(bh * ms->Nqb + i) * ms->Nkb + j])
                    assert_int_equal(list[c++], i);
            assert_int_equal(tcnt[bh * ms->Nkb + j], c);
            for (; c < ms->Nqb; c++)
                assert_int_equal(list[c], -1);
        }
}

static void compare_masks(sparge_mask *got, sparge_mask *want, const sparge_mask_params *mp, const shape *s)
{
    sparge_mask_shape ms;
    assert_int_equal(sparge_mask_get_shape(want, &ms), SPARGE_OK);
    int64_t rows = ms.B * ms.H * ms.Nqb, cells = rows * ms.Nkb;
    uint8_t *dg = malloc((size_t)cells), *dw = malloc((size_t)cells);
    float *map = malloc((size_t)cells * sizeof *map);
    int32_t *cnt = malloc((size_t)rows * 4), *idx = malloc((size_t)cells * 4);
    int32_t *tcnt = malloc((size_t)(ms.B * ms.H * ms.Nkb) * 4), *tidx = malloc((size_t)cells * 4);
    assert_int_equal(sparge_mask_get_dense(got, dg), SPARGE_OK);
    assert_int_equal(sparge_mask_get_dense(want, dw), SPARGE_OK);
    assert_int_equal(sparge_mask_get_pooled_map(want, map), SPARGE_OK);
    assert_int_equal(sparge_mask_get_csr(got, cnt, idx, tcnt, tidx), SPARGE_OK);
    int64_t differing = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t kept = 0, c = 0;
        for (int64_t j = 0; j < ms.Nkb; j++) {
            kept += dw[r * ms.Nkb + j];
            if (dg[r * ms.Nkb + j]) /* CSR agrees with the dense view, ascending */
                assert_int_equal(idx[r * ms.Nkb + c++], j);
        }
        assert_int_equal(cnt[r], c);
        assert_true(c >= 1);
        for (; c < ms.Nkb; c++) /* the rest of the CSR row is -1 */
            assert_int_equal(idx[r * ms.Nkb + c], -1);
        if (memcmp(dg + r * ms.Nkb, dw + r * ms.Nkb, (size_t)ms.Nkb) != 0) {
            differing++;
            if (!close_call(map + r * ms.Nkb, ms.Nkb, mp->topk, mp->topp, kept))
                fail_msg("mask row %lld differs from cpu-ref and the decision was not close (B=%lld H=%lld Nq=%lld)",
                         (long long)r, (long long)s->B, (long long)s->H, (long long)s->Nq);
        }
    }
    if (differing)
        printf("  note: %lld mask row(s) differ within the 1e-5 rounding margin\n", (long long)differing);
    check_transpose(&ms, dg, tcnt, tidx);
    free(dg);
    free(dw);
    free(map);
    free(cnt);
    free(idx);
    free(tcnt);
    free(tidx);
}

static void run_case(const shape *s, sparge_dtype dt, tu_layout lay, tu_rng *rng)
{
    int64_t B = s->B, H = s->H, Nq = s->Nq, Nk = s->Nk, D = s->D;
    tu_tensor q = tu_alloc(dev, dt, lay, B, H, Nq, D), k = tu_alloc(dev, dt, lay, B, H, Nk, D),
              v = tu_alloc(dev, dt, lay, B, H, Nk, D), o = tu_alloc(dev, dt, lay, B, H, Nq, D),
              d_o = tu_alloc(dev, dt, lay, B, H, Nq, D), dq = tu_alloc(dev, dt, lay, B, H, Nq, D),
              dk = tu_alloc(dev, dt, lay, B, H, Nk, D), dv = tu_alloc(dev, dt, lay, B, H, Nk, D);
    tu_tensor rq = tu_alloc(ref, dt, lay, B, H, Nq, D), rk = tu_alloc(ref, dt, lay, B, H, Nk, D),
              rv = tu_alloc(ref, dt, lay, B, H, Nk, D), ro = tu_alloc(ref, dt, lay, B, H, Nq, D),
              rdo = tu_alloc(ref, dt, lay, B, H, Nq, D), rdq = tu_alloc(ref, dt, lay, B, H, Nq, D),
              rdk = tu_alloc(ref, dt, lay, B, H, Nk, D), rdv = tu_alloc(ref, dt, lay, B, H, Nk, D);
    uint64_t seed = tu_next(rng);
    tu_rng r1 = {seed}, r2 = {seed};
    int sink = (int)(tu_next(rng) % (uint64_t)((Nk + s->bk - 1) / s->bk));
    fill_inputs(&q, &r1, -1, s->bk, 1.0); fill_inputs(&rq, &r2, -1, s->bk, 1.0);
    fill_inputs(&k, &r1, sink, s->bk, 1.0); fill_inputs(&rk, &r2, sink, s->bk, 1.0);
    fill_inputs(&v, &r1, -1, s->bk, 1.0); fill_inputs(&rv, &r2, -1, s->bk, 1.0);
    fill_inputs(&d_o, &r1, -1, s->bk, 1.0); fill_inputs(&rdo, &r2, -1, s->bk, 1.0);

    /* pooling: every element written, matches fp64 means */
    int64_t nqb = (Nq + s->bq - 1) / s->bq, nkb = (Nk + s->bk - 1) / s->bk;
    tu_tensor pq = tu_alloc(dev, SPARGE_F32, TU_BHND, B, H, nqb, D), rpq = tu_alloc(ref, SPARGE_F32, TU_BHND, B, H, nqb, D);
    tu_poison(&pq);
    sparge_status st = sparge_pool(dev, &q.t, s->bq, &pq.t);
    if (!unsupported(st, (tu_tensor *[]){&pq}, 1, "pool")) {
        assert_int_equal(st, SPARGE_OK);
        assert_int_equal(sparge_pool(ref, &rq.t, s->bq, &rpq.t), SPARGE_OK);
        check_tensors("pool", s, dt, lay, &pq, &rpq, 1e-5);
    }
    tu_free(&pq);
    tu_free(&rpq);

    /* mask prediction on both; hybrid with values that keep a few blocks */
    sparge_mask_params mp = {s->bq, s->bk, 0.1, 0.5, 0.0f};
    sparge_mask *m, *rm;
    assert_int_equal(sparge_mask_create(dev, B, H, Nq, Nk, s->bq, s->bk, &m), SPARGE_OK);
    assert_int_equal(sparge_mask_create(ref, B, H, Nq, Nk, s->bq, s->bk, &rm), SPARGE_OK);
    assert_int_equal(sparge_mask_predict(ref, &rq.t, &rk.t, &mp, rm), SPARGE_OK);
    st = sparge_mask_predict(dev, &q.t, &k.t, &mp, m);
    assert_int_equal(st, SPARGE_OK);
    compare_masks(m, rm, &mp, s);

    /* attention with the reference's mask on both sides (identical selections) */
    uint8_t *dense = malloc((size_t)(B * H * nqb * nkb));
    assert_int_equal(sparge_mask_get_dense(rm, dense), SPARGE_OK);
    assert_int_equal(sparge_mask_set_dense(m, dense), SPARGE_OK);
    free(dense);
    compare_masks(m, rm, &mp, s); /* the CSR and transpose rebuilt from the dense view */
    float *lse, *rlse;
    assert_int_equal(sparge_malloc(dev, (size_t)(B * H * Nq) * 4, (void **)&lse), SPARGE_OK);
    rlse = malloc((size_t)(B * H * Nq) * 4);
    for (int masked = 0; masked < 2; masked++) {
        const sparge_mask *use = masked ? m : NULL, *ruse = masked ? rm : NULL;
        tu_poison(&o);
        assert_int_equal(sparge_memset(dev, lse, 0xff, (size_t)(B * H * Nq) * 4), SPARGE_OK);
        st = sparge_attention_forward(dev, &q.t, &k.t, &v.t, use, NULL, &o.t, lse);
        if (unsupported(st, (tu_tensor *[]){&o}, 1, "forward"))
            continue;
        assert_int_equal(st, SPARGE_OK);
        assert_int_equal(sparge_attention_forward(ref, &rq.t, &rk.t, &rv.t, ruse, NULL, &ro.t, rlse), SPARGE_OK);
        check_tensors(masked ? "forward O (masked)" : "forward O (dense)", s, dt, lay, &o, &ro, tu_tolerance(dt));
        check_lse("forward LSE", s, dt, lay, lse, rlse, B * H * Nq);

        /* backward from identical O and LSE (the reference's) on both sides */
        double *ref_o = tu_get(&ro);
        tu_set(&o, ref_o);
        free(ref_o);
        assert_int_equal(sparge_memcpy_to_device(dev, lse, rlse, (size_t)(B * H * Nq) * 4), SPARGE_OK);
        for (int det = 0; det < 2; det++) {
            tu_poison(&dq);
            tu_poison(&dk);
            tu_poison(&dv);
            sparge_attn_params ap = {0.0f, det};
            st = sparge_attention_backward(dev, &q.t, &k.t, &v.t, &o.t, &d_o.t, lse, use, &ap, &dq.t, &dk.t, &dv.t);
            if (unsupported(st, (tu_tensor *[]){&dq, &dk, &dv}, 3, "backward"))
                break;
            assert_int_equal(st, SPARGE_OK);
            assert_int_equal(sparge_attention_backward(ref, &rq.t, &rk.t, &rv.t, &ro.t, &rdo.t, rlse, ruse, &ap, &rdq.t,
                                                       &rdk.t, &rdv.t),
                             SPARGE_OK);
            tu_tensor *outs[3] = {&dq, &dk, &dv}, *refs[3] = {&rdq, &rdk, &rdv};
            static const char *names[3] = {"backward dQ", "backward dK", "backward dV"};
            double *first[3];
            for (int i = 0; i < 3; i++) {
                double *gg = tu_get(outs[i]), *ww = tu_get(refs[i]);
                check_close(names[i], s, dt, lay, gg, ww, tu_numel(outs[i]), tu_tolerance(dt));
                first[i] = gg;
                free(ww);
            }
            if (det) { /* deterministic: a second run gives bitwise the same gradients */
                for (int i = 0; i < 3; i++)
                    tu_poison(outs[i]);
                assert_int_equal(sparge_attention_backward(dev, &q.t, &k.t, &v.t, &o.t, &d_o.t, lse, use, &ap, &dq.t,
                                                           &dk.t, &dv.t),
                                 SPARGE_OK);
                for (int i = 0; i < 3; i++) {
                    double *again = tu_get(outs[i]);
                    if (memcmp(again, first[i], (size_t)tu_numel(outs[i]) * sizeof *again))
                        fail_msg("%s: deterministic backward not reproducible (B=%lld H=%lld Nq=%lld Nk=%lld D=%lld)",
                                 names[i], (long long)s->B, (long long)s->H, (long long)s->Nq, (long long)s->Nk,
                                 (long long)s->D);
                    free(again);
                }
            }
            for (int i = 0; i < 3; i++)
                free(first[i]);
        }
        ran++;
    }
    free(rlse);
    sparge_free(dev, lse);
    sparge_mask_destroy(m);
    sparge_mask_destroy(rm);
    tu_tensor *all[] = {&q, &k, &v, &o, &d_o, &dq, &dk, &dv, &rq, &rk, &rv, &ro, &rdo, &rdq, &rdk, &rdv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tu_free(all[i]);
}

static void test_grid(void **state)
{
    (void)state;
    tu_rng rng = {20260214};
    for (int g = 0; g < GRID; g++)
        for (int d = 0; d < 3; d++)
            for (int lay = 0; lay < 2; lay++)
                run_case(&grid[g], dtypes[d], (tu_layout)lay, &rng);
    printf("  %d forward/backward cases ran, %d unsupported combinations refused cleanly\n", ran, skipped);
    assert_true(ran > 0);
}

/* Sets (value non-NULL) or removes an environment variable; returns its previous value (to free), or NULL. */
static char *swap_env(const char *name, const char *value)
{
    const char *old = getenv(name);
    char *saved = old ? strdup(old) : NULL;
    if (value)
        assert_int_equal(setenv(name, value, 1), 0);
    else
        assert_int_equal(unsetenv(name), 0);
    return saved;
}

/* Setup and teardown of a test that sets the environment variable named by its initial state (a string): the
 * variable starts unset and gets its previous value back afterwards. */
static char *env_saved;
static int env_setup(void **state)
{
    env_saved = swap_env((const char *)*state, NULL);
    return 0;
}
static int env_teardown(void **state)
{
    free(swap_env((const char *)*state, env_saved));
    free(env_saved);
    env_saved = NULL;
    return 0;
}

/* cuda: the tensor-core cases of the grid again without the forward's launch order (SPARGE_CUDA_FWD_ORDER=natural;
 * test_grid ran the default, each head's rows heaviest first). An order has one entry per work item, so one that
 * dropped or repeated an item leaves poisoned output rows. Then an invalid choice is refused with a message
 * naming the variable, and nothing is written. */
static void test_grid_fwd_orders(void **state)
{
    (void)state;
    if (strcmp(BACKEND, "cuda"))
        skip();
    tu_rng rng = {20261202};
    const int ran0 = ran;
    free(swap_env("SPARGE_CUDA_FWD_ORDER", "natural"));
    for (int g = 0; g < GRID; g++)
        if (grid[g].D == 64 || grid[g].D == 128)
            for (int d = 1; d < 3; d++) /* f16, bf16 */
                run_case(&grid[g], dtypes[d], TU_BHND, &rng);
    printf("  %d cases ran with SPARGE_CUDA_FWD_ORDER=natural\n", ran - ran0);
    assert_true(ran > ran0);

    free(swap_env("SPARGE_CUDA_FWD_ORDER", "bogus"));
    tu_tensor x[4];
    for (int i = 0; i < 4; i++) {
        x[i] = tu_alloc(dev, SPARGE_BF16, TU_BHND, 1, 2, 300, 64);
        if (i < 3)
            tu_fill_normal(&x[i], &rng, 1.0);
        else
            tu_poison(&x[i]);
    }
    sparge_mask *m;
    assert_int_equal(sparge_mask_create(dev, 1, 2, 300, 300, 128, 64, &m), SPARGE_OK);
    sparge_mask_params mp = {128, 64, 0.5, 0.0, 0.0f};
    assert_int_equal(sparge_mask_predict(dev, &x[0].t, &x[1].t, &mp, m), SPARGE_OK);
    assert_int_equal(sparge_attention_forward(dev, &x[0].t, &x[1].t, &x[2].t, m, NULL, &x[3].t, NULL),
                     SPARGE_ERR_INVALID);
    assert_non_null(strstr(sparge_last_error(), "SPARGE_CUDA_FWD_ORDER"));
    assert_true(tu_still_poisoned(&x[3]));
    sparge_mask_destroy(m);
    for (int i = 0; i < 4; i++)
        tu_free(&x[i]);
}

/* cuda: 360 query blocks, more than the forward has CTAs resident (2 per SM, 264 on an H200), and 60 rows per head,
 * so the launch order sorts rows of many different lengths (a hybrid mask) in several 32-row rounds per head and
 * the rows run in several waves. Forward O and LSE against the reference, dense and masked, ragged Nq and Nk, both
 * layouts; O starts poisoned, so a row the order dropped fails. */
static void test_forward_many_rows(void **state)
{
    (void)state;
    if (strcmp(BACKEND, "cuda"))
        skip();
    const shape s = {2, 3, 128 * 60 - 5, 64 * 6 + 9, 128, 128, 64};
    const int64_t B = s.B, H = s.H, Nq = s.Nq, Nk = s.Nk, D = s.D, n_lse = B * H * Nq;
    tu_rng rng = {20261203};
    for (int lay = 0; lay < 2; lay++) {
        tu_tensor x[4], rx[4]; /* q, k, v, o */
        for (int i = 0; i < 4; i++) {
            const int64_t N = i == 1 || i == 2 ? Nk : Nq;
            x[i] = tu_alloc(dev, SPARGE_BF16, (tu_layout)lay, B, H, N, D);
            rx[i] = tu_alloc(ref, SPARGE_BF16, (tu_layout)lay, B, H, N, D);
            if (i < 3) {
                const uint64_t seed = tu_next(&rng);
                tu_rng r1 = {seed}, r2 = {seed};
                fill_inputs(&x[i], &r1, i == 1 ? 5 : -1, s.bk, 1.0);
                fill_inputs(&rx[i], &r2, i == 1 ? 5 : -1, s.bk, 1.0);
            }
        }
        sparge_mask *m, *rm;
        sparge_mask_params mp = {s.bq, s.bk, 0.1, 0.6, 0.0f};
        assert_int_equal(sparge_mask_create(dev, B, H, Nq, Nk, s.bq, s.bk, &m), SPARGE_OK);
        assert_int_equal(sparge_mask_create(ref, B, H, Nq, Nk, s.bq, s.bk, &rm), SPARGE_OK);
        assert_int_equal(sparge_mask_predict(ref, &rx[0].t, &rx[1].t, &mp, rm), SPARGE_OK);
        uint8_t *dense = malloc((size_t)(B * H * ((Nq + s.bq - 1) / s.bq) * ((Nk + s.bk - 1) / s.bk)));
        assert_int_equal(sparge_mask_get_dense(rm, dense), SPARGE_OK);
        assert_int_equal(sparge_mask_set_dense(m, dense), SPARGE_OK);
        free(dense);
        float *lse, *rlse = malloc((size_t)n_lse * 4);
        assert_int_equal(sparge_malloc(dev, (size_t)n_lse * 4, (void **)&lse), SPARGE_OK);
        for (int masked = 0; masked < 2; masked++) {
            tu_poison(&x[3]);
            assert_int_equal(sparge_memset(dev, lse, 0xff, (size_t)n_lse * 4), SPARGE_OK);
            assert_int_equal(sparge_attention_forward(dev, &x[0].t, &x[1].t, &x[2].t, masked ? m : NULL, NULL,
                                                      &x[3].t, lse),
                             SPARGE_OK);
            assert_int_equal(sparge_attention_forward(ref, &rx[0].t, &rx[1].t, &rx[2].t, masked ? rm : NULL, NULL,
                                                      &rx[3].t, rlse),
                             SPARGE_OK);
            check_tensors(masked ? "many rows: forward O (masked)" : "many rows: forward O (dense)", &s, SPARGE_BF16,
                          (tu_layout)lay, &x[3], &rx[3], tu_tolerance(SPARGE_BF16));
            check_lse("many rows: forward LSE", &s, SPARGE_BF16, (tu_layout)lay, lse, rlse, n_lse);
        }
        sparge_free(dev, lse);
        free(rlse);
        sparge_mask_destroy(m);
        sparge_mask_destroy(rm);
        for (int i = 0; i < 4; i++) {
            tu_free(&x[i]);
            tu_free(&rx[i]);
        }
    }
}

/* The shared vectors: each row as a 1-row pooled map; rows with margin < 1e-5 may flip. */
static void test_mask_vectors(void **state)
{
    (void)state;
    tu_mask_case *c;
    int n = tu_load_mask_cases(&c), flipped = 0;
    assert_true(n >= 10);
    for (int i = 0; i < n; i++) {
        sparge_mask *m;
        assert_int_equal(sparge_mask_create(dev, 1, 1, 1, c[i].n, 1, 1, &m), SPARGE_OK);
        float *row;
        assert_int_equal(sparge_malloc(dev, (size_t)c[i].n * 4, (void **)&row), SPARGE_OK);
        float *host = malloc((size_t)c[i].n * 4);
        for (int j = 0; j < c[i].n; j++)
            host[j] = (float)c[i].row[j];
        assert_int_equal(sparge_memcpy_to_device(dev, row, host, (size_t)c[i].n * 4), SPARGE_OK);
        sparge_tensor map = sparge_tensor_bhnd(row, SPARGE_F32, 1, 1, 1, c[i].n);
        sparge_mask_params mp = {1, 1, c[i].k, c[i].p, 0.0f};
        assert_int_equal(sparge_mask_select(dev, &map, &mp, m), SPARGE_OK);
        int32_t cnt, *idx = malloc((size_t)c[i].n * 4);
        assert_int_equal(sparge_mask_get_csr(m, &cnt, idx, NULL, NULL), SPARGE_OK);
        int same = cnt == c[i].nkeep;
        for (int j = 0; same && j < cnt; j++)
            same = idx[j] == c[i].keep[j];
        if (!same) {
            if (!(c[i].margin < 1e-5))
                fail_msg("mask vector %d (%s, k=%g p=%g): kept %d blocks, expected %d", i, c[i].note, c[i].k, c[i].p,
                         cnt, c[i].nkeep);
            flipped++;
        }
        free(idx);
        free(host);
        sparge_free(dev, row);
        sparge_mask_destroy(m);
    }
    printf("  %d mask vectors, %d within the rounding margin flipped\n", n, flipped);
    tu_free_mask_cases(c, n);
}

/* End-to-end vectors: Q, K → pooled means, pooled map and kept blocks. */
static void test_pooled_vectors(void **state)
{
    (void)state;
    tu_pooled_case *c;
    int n = tu_load_pooled_cases(&c);
    assert_true(n >= 1);
    for (int i = 0; i < n; i++) {
        tu_pooled_case *pc = &c[i];
        tu_tensor q = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, 1, pc->Nq, pc->D),
                  k = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, 1, pc->Nk, pc->D);
        tu_set(&q, pc->Q);
        tu_set(&k, pc->K);
        sparge_mask *m;
        assert_int_equal(sparge_mask_create(dev, 1, 1, pc->Nq, pc->Nk, pc->bq, pc->bk, &m), SPARGE_OK);
        sparge_mask_params mp = {pc->bq, pc->bk, pc->k, pc->p, (float)pc->scale};
        assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_OK);
        float *map = malloc((size_t)(pc->Nqb * pc->Nkb) * 4);
        assert_int_equal(sparge_mask_get_pooled_map(m, map), SPARGE_OK);
        double *mapd = malloc((size_t)(pc->Nqb * pc->Nkb) * sizeof *mapd);
        for (int j = 0; j < pc->Nqb * pc->Nkb; j++)
            mapd[j] = map[j];
        assert_true(tu_rel_l2(mapd, pc->map, pc->Nqb * pc->Nkb) <= 1e-5);
        int32_t *cnt = malloc((size_t)pc->Nqb * 4), *idx = malloc((size_t)(pc->Nqb * pc->Nkb) * 4);
        assert_int_equal(sparge_mask_get_csr(m, cnt, idx, NULL, NULL), SPARGE_OK);
        for (int r = 0; r < pc->Nqb; r++) {
            assert_int_equal(cnt[r], pc->keep_count[r]);
            for (int j = 0; j < cnt[r]; j++)
                assert_int_equal(idx[r * pc->Nkb + j], pc->keep[r * pc->Nkb + j]);
        }
        free(map);
        free(mapd);
        free(cnt);
        free(idx);
        sparge_mask_destroy(m);
        tu_free(&q);
        tu_free(&k);
    }
    tu_free_pooled_cases(c, n);
}

/* Mask prediction over wide rows (the GPU's warp-per-row selection up to 2048 key blocks, its block sort
 * beyond) with ties: random keys against cpu-ref; flat rows (every key token the same, so every score in a
 * row ties) must keep the lowest indices; with twin key blocks (2m and 2m+1 identical, and pair m alike
 * pair m + 17) every class of equal blocks must keep a prefix of its ascending indices. */
/* Predicts the mask of (q, k) on the backend and of (rq, rk) on cpu-ref, checks the pooled maps (rel. L2
 * ≤ 1e-5) and the selections, and returns the backend's mask (the caller destroys it). */
static sparge_mask *predict_and_compare(const shape *s, sparge_dtype dt, tu_layout lay, tu_tensor *q, tu_tensor *k,
                                        tu_tensor *rq, tu_tensor *rk, const sparge_mask_params *mp)
{
    sparge_mask *m, *rm;
    assert_int_equal(sparge_mask_create(dev, s->B, s->H, s->Nq, s->Nk, s->bq, s->bk, &m), SPARGE_OK);
    assert_int_equal(sparge_mask_create(ref, s->B, s->H, s->Nq, s->Nk, s->bq, s->bk, &rm), SPARGE_OK);
    const int64_t cells = s->B * s->H * ((s->Nq + s->bq - 1) / s->bq) * ((s->Nk + s->bk - 1) / s->bk);
    uint8_t *all = malloc((size_t)cells);
    memset(all, 1, (size_t)cells);
    assert_int_equal(sparge_mask_set_dense(m, all), SPARGE_OK); /* poison: a full CSR row has no -1 tail */
    free(all);
    assert_int_equal(sparge_mask_predict(dev, &q->t, &k->t, mp, m), SPARGE_OK);
    assert_int_equal(sparge_mask_predict(ref, &rq->t, &rk->t, mp, rm), SPARGE_OK);
    float *map = malloc((size_t)cells * sizeof *map), *rmap = malloc((size_t)cells * sizeof *rmap);
    double *mapd = malloc((size_t)cells * sizeof *mapd), *rmapd = malloc((size_t)cells * sizeof *rmapd);
    assert_int_equal(sparge_mask_get_pooled_map(m, map), SPARGE_OK);
    assert_int_equal(sparge_mask_get_pooled_map(rm, rmap), SPARGE_OK);
    for (int64_t i = 0; i < cells; i++) {
        mapd[i] = map[i];
        rmapd[i] = rmap[i];
    }
    check_close("pooled map", s, dt, lay, mapd, rmapd, cells, 1e-5);
    compare_masks(m, rm, mp, s);
    free(map);
    free(rmap);
    free(mapd);
    free(rmapd);
    sparge_mask_destroy(rm);
    return m;
}

/* Inputs whose pooled rows are far from zero: each token is 2·c[its block] + noise (c standard normal per
 * block and d), so the logits reach several units and one TF32 product alone (about 1e-3 of each term) would
 * miss the pooled map's 1e-5 tolerance; random tokens average out to logits near 0, where it would not. */
static void fill_block_offsets(double *v, int64_t BH, int64_t N, int64_t D, int64_t bs, tu_rng *r)
{
    double *c = malloc((size_t)D * sizeof *c);
    for (int64_t bh = 0; bh < BH; bh++)
        for (int64_t n = 0; n < N; n++) {
            if (n % bs == 0)
                for (int64_t d = 0; d < D; d++)
                    c[d] = 2.0 * tu_normal(r);
            for (int64_t d = 0; d < D; d++)
                v[(bh * N + n) * D + d] = c[d] + 0.5 * tu_normal(r);
        }
    free(c);
}

/* cuda: each logits kernel of the pooled map (SPARGE_CUDA_MAP_TILE=128x64|64x64 in fp32 FMAs, f16x3 on the
 * tensor cores, the default where it can run) on ragged tiles with logits of several units, D a multiple of 16
 * and not: the map and the selection match cpu-ref, and the two fp32 tiles give the same bits (each logit one
 * fmaf chain over D in order) and so the same selection. Then an invalid choice is refused with a message
 * naming the variable. */
static void test_map_tiles(void **state)
{
    (void)state;
    if (strcmp(BACKEND, "cuda"))
        skip();
    tu_rng rng = {20261203};
    static const char *const tiles[3] = {"128x64", "64x64", "f16x3"};
    static const int64_t Ds[2] = {128, 36};
    for (int c = 0; c < 2; c++) {
        const int64_t H = 3, N = 9000, D = Ds[c], Nqb = (N + 127) / 128, Nkb = (N + 63) / 64, cells = H * Nqb * Nkb;
        const sparge_dtype dt = c ? SPARGE_F32 : SPARGE_BF16;
        const tu_layout lay = c ? TU_BNHD : TU_BHND;
        tu_tensor q = tu_alloc(dev, dt, lay, 1, H, N, D), k = tu_alloc(dev, dt, lay, 1, H, N, D);
        tu_tensor rq = tu_alloc(ref, dt, lay, 1, H, N, D), rk = tu_alloc(ref, dt, lay, 1, H, N, D);
        double *v = malloc((size_t)(H * N * D) * sizeof *v);
        fill_block_offsets(v, H, N, D, 128, &rng);
        tu_set(&q, v);
        tu_set(&rq, v);
        fill_block_offsets(v, H, N, D, 64, &rng);
        tu_set(&k, v);
        tu_set(&rk, v);
        free(v);
        sparge_mask_params mp = {128, 64, 0.03, 0.2, 0.0f};
        const shape s = {1, H, N, N, D, 128, 64};
        float *maps[2];
        int32_t *idx[2];
        for (int t = 0; t < 3; t++) {
            free(swap_env("SPARGE_CUDA_MAP_TILE", tiles[t]));
            printf("  logits kernel %s, D=%lld\n", tiles[t], (long long)D);
            sparge_mask *m = predict_and_compare(&s, dt, lay, &q, &k, &rq, &rk, &mp);
            if (t < 2) {
                maps[t] = malloc((size_t)cells * sizeof(float));
                idx[t] = malloc((size_t)cells * sizeof(int32_t));
                assert_int_equal(sparge_mask_get_pooled_map(m, maps[t]), SPARGE_OK);
                assert_int_equal(sparge_mask_get_csr(m, NULL, idx[t], NULL, NULL), SPARGE_OK);
            }
            sparge_mask_destroy(m);
        }
        assert_memory_equal(maps[1], maps[0], (size_t)cells * sizeof(float));
        assert_memory_equal(idx[1], idx[0], (size_t)cells * sizeof(int32_t));
        for (int t = 0; t < 2; t++) {
            free(maps[t]);
            free(idx[t]);
        }
        tu_free(&q);
        tu_free(&k);
        tu_free(&rq);
        tu_free(&rk);
    }

    tu_tensor q = tu_alloc(dev, SPARGE_BF16, TU_BHND, 1, 1, 300, 64), k = tu_alloc(dev, SPARGE_BF16, TU_BHND, 1, 1, 300, 64);
    tu_fill_normal(&q, &rng, 1.0);
    tu_fill_normal(&k, &rng, 1.0);
    sparge_mask_params mp = {128, 64, 0.03, 0.2, 0.0f};
    free(swap_env("SPARGE_CUDA_MAP_TILE", "bogus"));
    sparge_mask *m;
    assert_int_equal(sparge_mask_create(dev, 1, 1, 300, 300, 128, 64, &m), SPARGE_OK);
    assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_ERR_INVALID);
    assert_non_null(strstr(sparge_last_error(), "SPARGE_CUDA_MAP_TILE"));
    sparge_mask_destroy(m);
    tu_free(&q);
    tu_free(&k);
}

static void predict_wide_case(int64_t Nkb, int kind, sparge_dtype dt, tu_layout lay, tu_rng *rng)
{
    const int64_t B = 1, H = 2, Nq = 200, D = 32, bq = 64, bk = 4;
    const int64_t Nk = kind == 0 ? Nkb * bk - 1 : Nkb * bk, Nqb = (Nq + bq - 1) / bq, rows = B * H * Nqb;
    tu_tensor q = tu_alloc(dev, dt, lay, B, H, Nq, D), k = tu_alloc(dev, dt, lay, B, H, Nk, D);
    tu_tensor rq = tu_alloc(ref, dt, lay, B, H, Nq, D), rk = tu_alloc(ref, dt, lay, B, H, Nk, D);
    double *qv = malloc((size_t)(B * H * Nq * D) * sizeof *qv), *kv = malloc((size_t)(B * H * Nk * D) * sizeof *kv);
    for (int64_t i = 0; i < B * H * Nq * D; i++)
        qv[i] = tu_normal(rng);
    double twin[4 * 32]; /* one random key block, repeated */
    for (int i = 0; i < 4 * 32; i++)
        twin[i] = tu_normal(rng);
    for (int64_t bh = 0; bh < B * H; bh++)
        for (int64_t t = 0; t < Nk; t++)
            for (int64_t d = 0; d < D; d++) {
                double *x = &kv[(bh * Nk + t) * D + d];
                if (kind == 0)
                    *x = tu_normal(rng) + (t / bk == 7 ? 1.0 : 0.0);
                else if (kind == 1)
                    *x = twin[d]; /* flat: every token alike */
                else /* twins */
                    *x = twin[t % bk * D + d] + 0.25 * (double)(t / bk / 2 % 17);
            }
    tu_set(&q, qv);
    tu_set(&rq, qv);
    tu_set(&k, kv);
    tu_set(&rk, kv);
    sparge_mask_params mp = {(int)bq, (int)bk, kind == 1 ? 0.1 : 0.03, kind == 1 ? 0.0 : 0.2, 0.0f};
    const shape s = {B, H, Nq, Nk, D, (int)bq, (int)bk};
    sparge_mask *m = predict_and_compare(&s, dt, lay, &q, &k, &rq, &rk, &mp);
    uint8_t *dg = malloc((size_t)(rows * Nkb));
    assert_int_equal(sparge_mask_get_dense(m, dg), SPARGE_OK);
    const int64_t nk = (int64_t)floor(0.1 * (double)Nkb + 1e-6);
    for (int64_t r = 0; r < rows; r++) {
        int dropped[17] = {0}; /* twins: a block of this class was dropped */
        for (int64_t j = 0; j < Nkb; j++) {
            const uint8_t got = dg[r * Nkb + j];
            if (kind == 1 && got != (j < nk))
                fail_msg("flat row %lld of %lld blocks: block %lld %s", (long long)r, (long long)Nkb, (long long)j,
                         got ? "kept" : "dropped");
            if (kind == 2) {
                if (got && dropped[j / 2 % 17])
                    fail_msg("twin classes, row %lld of %lld: block %lld kept after a lower equal block was dropped",
                             (long long)r, (long long)Nkb, (long long)j);
                dropped[j / 2 % 17] |= !got;
            }
        }
    }
    free(dg);
    free(qv);
    free(kv);
    sparge_mask_destroy(m);
    tu_free(&q);
    tu_free(&k);
    tu_free(&rq);
    tu_free(&rk);
}

static void test_predict_wide_rows(void **state)
{
    (void)state;
    tu_rng rng = {20261201};
    static const int64_t widths[] = {300, 1182, 2048, 2100};
    for (int w = 0; w < 4; w++)
        for (int kind = 0; kind < 3; kind++) {
            predict_wide_case(widths[w], kind, SPARGE_F32, TU_BHND, &rng);
            predict_wide_case(widths[w], kind, SPARGE_BF16, TU_BNHD, &rng);
        }
}

/* A shape with many pooled-map tiles (the GPU's 128×64 logits tiles take over from 1024 of them) and
 * query-block columns longer than one transpose chunk: 16 heads of 1000 × 1000 blocks (ragged tails). */
static void test_predict_many_tiles(void **state)
{
    (void)state;
    tu_rng rng = {20261202};
    const int64_t B = 1, H = 16, Nq = 1999, Nk = 1999, D = 32;
    const int bq = 2, bk = 2;
    tu_tensor q = tu_alloc(dev, SPARGE_BF16, TU_BHND, B, H, Nq, D), k = tu_alloc(dev, SPARGE_BF16, TU_BHND, B, H, Nk, D);
    tu_tensor rq = tu_alloc(ref, SPARGE_BF16, TU_BHND, B, H, Nq, D), rk = tu_alloc(ref, SPARGE_BF16, TU_BHND, B, H, Nk, D);
    double *v = malloc((size_t)(B * H * Nq * D) * sizeof *v);
    for (int64_t i = 0; i < B * H * Nq * D; i++)
        v[i] = tu_normal(&rng);
    tu_set(&q, v);
    tu_set(&rq, v);
    for (int64_t i = 0; i < B * H * Nk * D; i++)
        v[i] = tu_normal(&rng);
    tu_set(&k, v);
    tu_set(&rk, v);
    sparge_mask_params mp = {bq, bk, 0.03, 0.2, 0.0f};
    const shape s = {B, H, Nq, Nk, D, bq, bk};
    sparge_mask_destroy(predict_and_compare(&s, SPARGE_BF16, TU_BHND, &q, &k, &rq, &rk, &mp));
    free(v);
    tu_free(&q);
    tu_free(&k);
    tu_free(&rq);
    tu_free(&rk);
}

/* Mask prediction shapes beyond the grid: a ragged last query block with rows of 513 key blocks (one past a
 * selection width of 512), 2600 query blocks (the transpose walks many row chunks) with D = 8, 24 heads, and an
 * odd D = 36. The pooled map must match cpu-ref too. */
static void test_predict_shapes(void **state)
{
    (void)state;
    static const shape shapes[] = {
        {2, 5, 33 * 64 - 5, 513 * 4, 64, 64, 4}, {1, 2, 2600, 700, 8, 1, 2}, {1, 24, 500, 1000, 128, 16, 32},
        {1, 2, 300, 300, 36, 16, 8},
    };
    tu_rng rng = {20261203};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        const shape *s = &shapes[c];
        tu_tensor q = tu_alloc(dev, SPARGE_BF16, TU_BNHD, s->B, s->H, s->Nq, s->D),
                  k = tu_alloc(dev, SPARGE_BF16, TU_BNHD, s->B, s->H, s->Nk, s->D);
        tu_tensor rq = tu_alloc(ref, SPARGE_BF16, TU_BNHD, s->B, s->H, s->Nq, s->D),
                  rk = tu_alloc(ref, SPARGE_BF16, TU_BNHD, s->B, s->H, s->Nk, s->D);
        uint64_t seed = tu_next(&rng);
        tu_rng r1 = {seed}, r2 = {seed};
        int sink = (int)(tu_next(&rng) % (uint64_t)((s->Nk + s->bk - 1) / s->bk));
        fill_inputs(&q, &r1, -1, s->bk, 1.0); fill_inputs(&rq, &r2, -1, s->bk, 1.0);
        fill_inputs(&k, &r1, sink, s->bk, 1.0); fill_inputs(&rk, &r2, sink, s->bk, 1.0);
        sparge_mask_params mp = {s->bq, s->bk, 0.03, 0.2, 0.0f};
        sparge_mask_destroy(predict_and_compare(s, SPARGE_BF16, TU_BNHD, &q, &k, &rq, &rk, &mp));
        tu_free(&q);
        tu_free(&k);
        tu_free(&rq);
        tu_free(&rk);
    }
}

/* n standard normal values (the caller frees them), for inputs a test edits before setting them. */
static double *normal_values(int64_t n, tu_rng *r)
{
    double *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = tu_normal(r);
    return v;
}

/* Mask prediction where a key token is NaN in head 0 (so every row of it holds a NaN logit) and +inf in head 2
 * (where every row's largest logit is +inf, and inf - inf leaves NaN): those rows keep every block with a NaN row
 * mass, the rows of head 1 select as usual. Rows of 256 key blocks (a selection width exactly) and of 300. */
static void test_predict_nonfinite(void **state)
{
    (void)state;
    tu_rng rng = {20261204};
    static const int64_t widths[] = {256, 300};
    for (int w = 0; w < 2; w++) {
        const int64_t H = 3, Nq = 256, Nk = 64 * widths[w], D = 64, Nqb = 2, Nkb = widths[w];
        tu_tensor q = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, H, Nq, D), k = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, H, Nk, D);
        double *qv = normal_values(H * Nq * D, &rng);
        for (int64_t t = 0; t < Nq; t++) /* head 2: q·k reaches +inf at key block 1, so each row's max is +inf */
            qv[(2 * Nq + t) * D + 1] = 0.5 + fabs(qv[(2 * Nq + t) * D + 1]);
        tu_set(&q, qv);
        free(qv);
        double *kv = normal_values(H * Nk * D, &rng);
        kv[(0 * Nk + 5) * D + 3] = NAN;
        kv[(2 * Nk + 70) * D + 1] = INFINITY;
        tu_set(&k, kv);
        free(kv);
        sparge_mask *m;
        assert_int_equal(sparge_mask_create(dev, 1, H, Nq, Nk, 128, 64, &m), SPARGE_OK);
        sparge_mask_params mp = {128, 64, 0.03, 0.2, 0.0f};
        assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_OK);
        int32_t cnt[3 * 2];
        float mass[3 * 2];
        sparge_mask_stats st;
        assert_int_equal(sparge_mask_get_csr(m, cnt, NULL, NULL, NULL), SPARGE_OK);
        assert_int_equal(sparge_mask_get_stats(m, &st, NULL, mass), SPARGE_OK);
        for (int64_t r = 0; r < H * Nqb; r++) {
            const int finite = r / Nqb == 1;
            if (finite) {
                assert_true(cnt[r] >= 1 && cnt[r] < Nkb);
                assert_true(mass[r] >= 0.2f && mass[r] <= 1.0f);
            } else {
                assert_int_equal(cnt[r], Nkb);
                assert_true(isnan(mass[r]));
            }
        }
        sparge_mask_destroy(m);
        tu_free(&q);
        tu_free(&k);
    }
}

/* Top-p at an exact boundary, against cpu-ref's selection on the backend's own pooled map (so the same
 * probabilities, and the kept sets must be identical). One query block; 64 key blocks spread over the row hold
 * identical tokens along q̄, so they tie for the largest probability a, and p is set to their exact mass 64·a, then
 * to the next double above it (one block more). The GPU's selection, which decides by fp32 masses only when they are
 * clearly on one side of p, must take its fp64 path here. Then Top-k alone keeps 40 of the 64 ties, the first by
 * index: a selection must rank ties across all of a lane's register slots (and across warps, if a row is split).
 * Rows of 512 key blocks (a selection width) and of 300. */
static void test_predict_exact_boundary(void **state)
{
    (void)state;
    tu_rng rng = {20261205};
    static const int64_t widths[] = {512, 300};
    for (int w = 0; w < 2; w++) {
        const int64_t Nkb = widths[w], Nq = 128, Nk = 64 * Nkb, D = 64, ties = 64;
        double *qv = normal_values(Nq * D, &rng), *kv = normal_values(Nk * D, &rng);
        double qbar[64] = {0};
        for (int64_t i = 0; i < Nq * D; i++)
            qbar[i % D] += qv[i] / (double)Nq;
        for (int64_t j = 0; j < ties; j++) /* blocks 1 + j·Nkb/64: every token 12·q̄ (rounded to f32 alike) */
            for (int64_t t = (1 + j * Nkb / ties) * 64; t < (2 + j * Nkb / ties) * 64; t++)
                for (int64_t d = 0; d < D; d++)
                    kv[t * D + d] = (float)(12.0 * qbar[d]);
        tu_tensor q = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, 1, Nq, D), k = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, 1, Nk, D);
        tu_set(&q, qv);
        tu_set(&k, kv);
        float *map = malloc((size_t)Nkb * sizeof *map);
        sparge_mask *m;
        assert_int_equal(sparge_mask_create(dev, 1, 1, Nq, Nk, 128, 64, &m), SPARGE_OK);
        sparge_mask_params mp = {128, 64, 0.0, 0.2, 0.0f};
        assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_OK);
        assert_int_equal(sparge_mask_get_pooled_map(m, map), SPARGE_OK);
        float a = map[1];
        int64_t at_a = 0;
        for (int64_t j = 0; j < Nkb; j++) {
            assert_true(map[j] <= a);
            at_a += map[j] == a;
        }
        assert_int_equal(at_a, ties);
        const double exact = (double)ties * a; /* exact in fp64 in any order */
        const double ps[3] = {exact, nextafter(exact, 2.0), 0.0};
        const int64_t taken = 40;
        for (int c = 0; c < 3; c++) {
            mp.topp = ps[c];
            mp.topk = c == 2 ? ((double)taken + 0.5) / (double)Nkb : 0.0;
            assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_OK);
            tu_tensor rmap = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, 1, 1, Nkb);
            double *md = malloc((size_t)Nkb * sizeof *md);
            assert_int_equal(sparge_mask_get_pooled_map(m, map), SPARGE_OK);
            for (int64_t j = 0; j < Nkb; j++)
                md[j] = map[j];
            tu_set(&rmap, md);
            sparge_mask *rm;
            assert_int_equal(sparge_mask_create(ref, 1, 1, Nq, Nk, 128, 64, &rm), SPARGE_OK);
            assert_int_equal(sparge_mask_select(ref, &rmap.t, &mp, rm), SPARGE_OK);
            int32_t cnt, rcnt, *idx = malloc((size_t)Nkb * 4), *ridx = malloc((size_t)Nkb * 4);
            assert_int_equal(sparge_mask_get_csr(m, &cnt, idx, NULL, NULL), SPARGE_OK);
            assert_int_equal(sparge_mask_get_csr(rm, &rcnt, ridx, NULL, NULL), SPARGE_OK);
            assert_int_equal(rcnt, c == 2 ? taken : c ? ties + 1 : ties);
            assert_int_equal(cnt, rcnt);
            assert_memory_equal(idx, ridx, (size_t)cnt * 4);
            free(idx);
            free(ridx);
            free(md);
            sparge_mask_destroy(rm);
            tu_free(&rmap);
        }
        sparge_mask_destroy(m);
        free(map);
        free(qv);
        free(kv);
        tu_free(&q);
        tu_free(&k);
    }
}

/* Top-k prediction against cpu-ref's selection on the backend's own pooled map, so the kept sets must be identical
 * wherever the GPU's search for the n_k-th largest score ends. Rows near uniform (random tokens) and peaked (block
 * offsets, logits of several units), n_k from 1 to every block, at a full selection width (512), a wide one (1182)
 * and a ragged one (300). */
static void test_predict_topk_exact(void **state)
{
    (void)state;
    tu_rng rng = {20261206};
    static const int64_t widths[] = {512, 1182, 300};
    static const double ks[] = {0.001, 0.03, 0.25, 0.95, 1.0};
    for (int w = 0; w < 3; w++)
        for (int peaked = 0; peaked < 2; peaked++) {
            const int64_t H = 2, Nkb = widths[w], Nq = 1000, Nk = 64 * Nkb - 17, D = 64, Nqb = (Nq + 127) / 128;
            double *qv, *kv;
            if (peaked) { /* fill_block_offsets writes every value */
                qv = malloc((size_t)(H * Nq * D) * sizeof *qv);
                kv = malloc((size_t)(H * Nk * D) * sizeof *kv);
                fill_block_offsets(qv, H, Nq, D, 128, &rng);
                fill_block_offsets(kv, H, Nk, D, 64, &rng);
            } else {
                qv = normal_values(H * Nq * D, &rng);
                kv = normal_values(H * Nk * D, &rng);
            }
            tu_tensor q = tu_alloc(dev, SPARGE_BF16, TU_BHND, 1, H, Nq, D),
                      k = tu_alloc(dev, SPARGE_BF16, TU_BHND, 1, H, Nk, D);
            tu_set(&q, qv);
            tu_set(&k, kv);
            tu_tensor rmap = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, Nqb, Nkb);
            const int64_t cells = H * Nqb * Nkb;
            float *map = malloc((size_t)cells * sizeof *map);
            double *md = malloc((size_t)cells * sizeof *md);
            int32_t *cnt = malloc((size_t)(H * Nqb) * 4), *rcnt = malloc((size_t)(H * Nqb) * 4);
            int32_t *idx = malloc((size_t)cells * 4), *ridx = malloc((size_t)cells * 4);
            sparge_mask *m, *rm;
            assert_int_equal(sparge_mask_create(dev, 1, H, Nq, Nk, 128, 64, &m), SPARGE_OK);
            assert_int_equal(sparge_mask_create(ref, 1, H, Nq, Nk, 128, 64, &rm), SPARGE_OK);
            for (size_t c = 0; c < sizeof ks / sizeof ks[0]; c++) {
                sparge_mask_params mp = {128, 64, ks[c], 0.0, 0.0f};
                assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_OK);
                assert_int_equal(sparge_mask_get_pooled_map(m, map), SPARGE_OK);
                for (int64_t i = 0; i < cells; i++)
                    md[i] = map[i];
                tu_set(&rmap, md);
                assert_int_equal(sparge_mask_select(ref, &rmap.t, &mp, rm), SPARGE_OK);
                assert_int_equal(sparge_mask_get_csr(m, cnt, idx, NULL, NULL), SPARGE_OK);
                assert_int_equal(sparge_mask_get_csr(rm, rcnt, ridx, NULL, NULL), SPARGE_OK);
                for (int64_t r = 0; r < H * Nqb; r++) {
                    if (cnt[r] != rcnt[r] || memcmp(idx + r * Nkb, ridx + r * Nkb, (size_t)cnt[r] * 4))
                        fail_msg("Top-k %g, %s rows of %lld blocks: row %lld keeps %d blocks, cpu-ref %d (or others)",
                                 ks[c], peaked ? "peaked" : "near-uniform", (long long)Nkb, (long long)r, cnt[r], rcnt[r]);
                }
            }
            sparge_mask_destroy(m);
            sparge_mask_destroy(rm);
            free(map);
            free(md);
            free(cnt);
            free(rcnt);
            free(idx);
            free(ridx);
            free(qv);
            free(kv);
            tu_free(&q);
            tu_free(&k);
            tu_free(&rmap);
        }
}

/* Mask prediction under each selection arm (Top-k only, Top-p only, p = 1, hybrid) on rows that mix distinct
 * scores with classes of equal ones (every third key block is a copy of one of 5 shared blocks, so exact ties sit
 * among distinct scores wherever the GPU's descent ends), at widths served by different selection kernels: the
 * kept sets against cpu-ref. */
static void test_predict_selection_arms(void **state)
{
    (void)state;
    static const double arms[][2] = {{0.05, 0.0}, {0.0, 0.4}, {0.0, 1.0}, {0.03, 0.2}, {0.5, 0.9}};
    static const int64_t widths[] = {77, 512, 1182};
    tu_rng rng = {20261204};
    const int64_t B = 1, H = 2, Nq = 300, D = 32, bq = 64, bk = 4;
    for (int w = 0; w < 3; w++) {
        const int64_t Nk = widths[w] * bk - 2; /* a ragged last block */
        const sparge_dtype dt = w % 2 ? SPARGE_BF16 : SPARGE_F32;
        const tu_layout lay = w % 2 ? TU_BNHD : TU_BHND;
        tu_tensor q = tu_alloc(dev, dt, lay, B, H, Nq, D), k = tu_alloc(dev, dt, lay, B, H, Nk, D);
        tu_tensor rq = tu_alloc(ref, dt, lay, B, H, Nq, D), rk = tu_alloc(ref, dt, lay, B, H, Nk, D);
        double *qv = malloc((size_t)(B * H * Nq * D) * sizeof *qv), *kv = malloc((size_t)(B * H * Nk * D) * sizeof *kv);
        double shared[5][4 * 32];
        for (int64_t i = 0; i < B * H * Nq * D; i++)
            qv[i] = tu_normal(&rng);
        for (int c = 0; c < 5; c++)
            for (int i = 0; i < 4 * 32; i++)
                shared[c][i] = tu_normal(&rng);
        for (int64_t bh = 0; bh < B * H; bh++)
            for (int64_t t = 0; t < Nk; t++)
                for (int64_t d = 0; d < D; d++)
                    kv[(bh * Nk + t) * D + d] = t / bk % 3 ? tu_normal(&rng) : shared[t / bk / 3 % 5][t % bk * D + d];
        tu_set(&q, qv);
        tu_set(&rq, qv);
        tu_set(&k, kv);
        tu_set(&rk, kv);
        const shape s = {B, H, Nq, Nk, D, (int)bq, (int)bk};
        for (int a = 0; a < 5; a++) {
            sparge_mask_params mp = {(int)bq, (int)bk, arms[a][0], arms[a][1], 0.0f};
            sparge_mask_destroy(predict_and_compare(&s, dt, lay, &q, &k, &rq, &rk, &mp));
        }
        free(qv);
        free(kv);
        tu_free(&q);
        tu_free(&k);
        tu_free(&rq);
        tu_free(&rk);
    }
}

/* get_csr's transpose of m (which builds it if this selection has none yet) against the dense view. */
static void expect_transpose(sparge_mask *m, const uint8_t *dense)
{
    sparge_mask_shape ms;
    assert_int_equal(sparge_mask_get_shape(m, &ms), SPARGE_OK);
    const int64_t cols = ms.B * ms.H * ms.Nkb;
    int32_t *tcnt = malloc((size_t)cols * 4), *tidx = malloc((size_t)(cols * ms.Nqb) * 4);
    assert_int_equal(sparge_mask_get_csr(m, NULL, NULL, tcnt, tidx), SPARGE_OK);
    check_transpose(&ms, dense, tcnt, tidx);
    free(tcnt);
    free(tidx);
}

/* The transpose is built once per selection, by whichever of the backward and get_csr needs it first. One mask
 * object holds in turn a prediction (the backward builds its transpose), the complement set from the host
 * (get_csr builds it) and the prediction again; each time get_csr's transpose and the backward's gradients
 * (against cpu-ref on the same selection) must follow the selection: a transpose left from the last one fails. */
static void test_transpose_follows_selection(void **state)
{
    (void)state;
    const shape s = {1, 2, 520, 390, 64, 128, 64};
    const sparge_dtype dt = SPARGE_BF16;
    const int64_t nkb = (s.Nk + s.bk - 1) / s.bk, rows = s.B * s.H * ((s.Nq + s.bq - 1) / s.bq);
    const int64_t nlse = s.B * s.H * s.Nq;
    enum { Q, K, V, DO, O, DQ, DK, DV, ROLES };
    static const int like_k[ROLES] = {0, 1, 1, 0, 0, 0, 1, 1};
    static const char *grad_names[3] = {"dQ", "dK", "dV"};
    tu_tensor x[ROLES], rx[ROLES];
    tu_rng rng = {20261205};
    for (int i = 0; i < ROLES; i++) {
        const int64_t n = like_k[i] ? s.Nk : s.Nq;
        x[i] = tu_alloc(dev, dt, TU_BHND, s.B, s.H, n, s.D);
        rx[i] = tu_alloc(ref, dt, TU_BHND, s.B, s.H, n, s.D);
        if (i <= DO) { /* the inputs, alike on both sides; K with a sink block so the mask is not flat */
            const uint64_t seed = tu_next(&rng);
            tu_rng r1 = {seed}, r2 = {seed};
            fill_inputs(&x[i], &r1, i == K ? 3 : -1, s.bk, 1.0);
            fill_inputs(&rx[i], &r2, i == K ? 3 : -1, s.bk, 1.0);
        }
    }
    const sparge_mask_params mp = {s.bq, s.bk, 0.1, 0.5, 0.0f};
    sparge_mask *m, *rm;
    assert_int_equal(sparge_mask_create(dev, s.B, s.H, s.Nq, s.Nk, s.bq, s.bk, &m), SPARGE_OK);
    assert_int_equal(sparge_mask_create(ref, s.B, s.H, s.Nq, s.Nk, s.bq, s.bk, &rm), SPARGE_OK);
    uint8_t *dense = malloc((size_t)(rows * nkb));
    float *lse, *rlse = malloc((size_t)nlse * 4);
    assert_int_equal(sparge_malloc(dev, (size_t)nlse * 4, (void **)&lse), SPARGE_OK);
    for (int sel = 0; sel < 3; sel++) {
        const int from_host = sel == 1; /* then get_csr builds the transpose, else the backward does */
        if (from_host) { /* the complement of the prediction, a block kept where a row would keep none */
            for (int64_t r = 0; r < rows; r++) {
                int64_t kept = 0;
                for (int64_t j = 0; j < nkb; j++) {
                    dense[r * nkb + j] = !dense[r * nkb + j];
                    kept += dense[r * nkb + j];
                }
                dense[r * nkb] |= !kept;
            }
            assert_int_equal(sparge_mask_set_dense(m, dense), SPARGE_OK);
        } else {
            assert_int_equal(sparge_mask_predict(dev, &x[Q].t, &x[K].t, &mp, m), SPARGE_OK);
            assert_int_equal(sparge_mask_get_dense(m, dense), SPARGE_OK);
        }
        assert_int_equal(sparge_mask_set_dense(rm, dense), SPARGE_OK);
        if (from_host)
            expect_transpose(m, dense);
        /* both backwards from the reference's O and LSE */
        assert_int_equal(sparge_attention_forward(ref, &rx[Q].t, &rx[K].t, &rx[V].t, rm, NULL, &rx[O].t, rlse),
                         SPARGE_OK);
        double *ro = tu_get(&rx[O]);
        tu_set(&x[O], ro);
        free(ro);
        assert_int_equal(sparge_memcpy_to_device(dev, lse, rlse, (size_t)nlse * 4), SPARGE_OK);
        for (int i = DQ; i <= DV; i++)
            tu_poison(&x[i]);
        assert_int_equal(sparge_attention_backward(dev, &x[Q].t, &x[K].t, &x[V].t, &x[O].t, &x[DO].t, lse, m, NULL,
                                                   &x[DQ].t, &x[DK].t, &x[DV].t),
                         SPARGE_OK);
        assert_int_equal(sparge_attention_backward(ref, &rx[Q].t, &rx[K].t, &rx[V].t, &rx[O].t, &rx[DO].t, rlse, rm,
                                                   NULL, &rx[DQ].t, &rx[DK].t, &rx[DV].t),
                         SPARGE_OK);
        for (int i = DQ; i <= DV; i++) {
            char what[64];
            snprintf(what, sizeof what, "selection %d (%s): backward %s", sel, from_host ? "set" : "predicted",
                     grad_names[i - DQ]);
            check_tensors(what, &s, dt, TU_BHND, &x[i], &rx[i], tu_tolerance(dt));
        }
        if (!from_host)
            expect_transpose(m, dense);
    }
    free(dense);
    free(rlse);
    sparge_free(dev, lse);
    sparge_mask_destroy(m);
    sparge_mask_destroy(rm);
    for (int i = 0; i < ROLES; i++) {
        tu_free(&x[i]);
        tu_free(&rx[i]);
    }
}

/* The backend's gradient of the scalar loss L = Σ w∘O (dO = w) against central finite differences of the fp64
 * reference forward, test_grad's check run on the backend's own forward and backward: one head of a ragged
 * masked shape, per dtype the backend runs, inputs rounded to the dtype so both sides see the same values. */
static void test_grad_finite_differences(void **state)
{
    (void)state;
    const int64_t Nq = 200, Nk = 150, D = 64, n_q = Nq * D, n_k = Nk * D;
    const int bq = 128, bk = 64;
    static const uint8_t keep[2 * 3] = {1, 0, 1, 0, 1, 1}; /* rows of 2 and 2 of the 3 key blocks, ragged */
    const double scale = 1.0 / sqrt((double)D), h = 1e-5;
    tu_rng r = {20261204};
    int tested = 0;
    for (int d = 0; d < 3; d++) {
        const sparge_dtype dt = dtypes[d];
        tu_tensor q = tu_alloc(dev, dt, TU_BHND, 1, 1, Nq, D), k = tu_alloc(dev, dt, TU_BHND, 1, 1, Nk, D),
                  v = tu_alloc(dev, dt, TU_BHND, 1, 1, Nk, D), w = tu_alloc(dev, dt, TU_BHND, 1, 1, Nq, D),
                  o = tu_alloc(dev, dt, TU_BHND, 1, 1, Nq, D), dq = tu_alloc(dev, dt, TU_BHND, 1, 1, Nq, D),
                  dk = tu_alloc(dev, dt, TU_BHND, 1, 1, Nk, D), dv = tu_alloc(dev, dt, TU_BHND, 1, 1, Nk, D);
        tu_tensor *inputs[4] = {&q, &k, &v, &w};
        double *x[4]; /* the rounded values the backend sees */
        for (int i = 0; i < 4; i++) {
            tu_fill_normal(inputs[i], &r, 1.0);
            x[i] = tu_get(inputs[i]);
        }
        sparge_mask *m;
        float *lse;
        assert_int_equal(sparge_mask_create(dev, 1, 1, Nq, Nk, bq, bk, &m), SPARGE_OK);
        assert_int_equal(sparge_mask_set_dense(m, keep), SPARGE_OK);
        assert_int_equal(sparge_malloc(dev, (size_t)Nq * 4, (void **)&lse), SPARGE_OK);
        tu_poison(&o);
        sparge_status st = sparge_attention_forward(dev, &q.t, &k.t, &v.t, m, NULL, &o.t, lse);
        if (!unsupported(st, (tu_tensor *[]){&o}, 1, "forward (finite differences)")) {
            assert_int_equal(st, SPARGE_OK);
            tu_poison(&dq);
            tu_poison(&dk);
            tu_poison(&dv);
            st = sparge_attention_backward(dev, &q.t, &k.t, &v.t, &o.t, &w.t, lse, m, NULL, &dq.t, &dk.t, &dv.t);
            assert_int_equal(st, SPARGE_OK);
            tu_tensor *grads[3] = {&dq, &dk, &dv};
            double worst = 0.0;
            const int64_t sizes[3] = {n_q, n_k, n_k};
            double *oo = malloc((size_t)n_q * sizeof *oo), *ll = malloc((size_t)Nq * sizeof *ll);
            for (int t = 0; t < 3; t++) {
                double *g = tu_get(grads[t]), got[16], fd[16];
                for (int probe = 0; probe < 16; probe++) {
                    const int64_t i = (int64_t)(tu_next(&r) % (uint64_t)sizes[t]);
                    const double saved = x[t][i];
                    double l[2];
                    for (int side = 0; side < 2; side++) {
                        x[t][i] = saved + (side ? -h : h);
                        sparge_ref_head_forward(x[0], x[1], x[2], Nq, Nk, D, scale, bq, bk, keep, oo, ll);
                        l[side] = 0.0;
                        for (int64_t e = 0; e < n_q; e++)
                            l[side] += x[3][e] * oo[e];
                    }
                    x[t][i] = saved;
                    fd[probe] = (l[0] - l[1]) / (2 * h);
                    got[probe] = g[i];
                }
                const double err = tu_rel_l2(got, fd, 16), tol = 2 * tu_tolerance(dt);
                worst = fmax(worst, err);
                if (!(err <= tol))
                    fail_msg("%s %s: gradient against finite differences rel L2 %.3g > %.3g", sparge_dtype_name(dt),
                             t == 0 ? "dQ" : t == 1 ? "dK" : "dV", err, tol);
                free(g);
            }
            free(oo);
            free(ll);
            printf("  %s gradients against finite differences: rel. L2 up to %.2g (16 probes each of dQ, dK, dV)\n",
                   sparge_dtype_name(dt), worst);
            tested++;
        }
        for (int i = 0; i < 4; i++)
            free(x[i]);
        sparge_free(dev, lse);
        sparge_mask_destroy(m);
        tu_tensor *all[] = {&q, &k, &v, &w, &o, &dq, &dk, &dv};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            tu_free(all[i]);
    }
    assert_true(tested > 0);
}

/* An argument runs only the tests whose names match it (a CMocka pattern: tests/tsan.sh runs a subset). */
int main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    if (sparge_backend_device_count(BACKEND) == 0) {
        fprintf(stderr, "backend '%s' has no device here: SKIP\n", BACKEND);
        return TU_SKIP;
    }
    dev = tu_open_or_null(BACKEND);
    ref = tu_open_or_null("cpu-ref");
    if (!dev || !ref)
        return 1;
    printf("conformance of %s (%s) against cpu-ref\n", sparge_device_name(dev), sparge_device_description(dev));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mask_vectors),
        cmocka_unit_test(test_pooled_vectors),
        cmocka_unit_test(test_grid),
        cmocka_unit_test(test_predict_wide_rows),
        cmocka_unit_test(test_predict_many_tiles),
        cmocka_unit_test(test_predict_shapes),
        cmocka_unit_test(test_predict_selection_arms),
        cmocka_unit_test(test_predict_nonfinite),
        cmocka_unit_test(test_predict_exact_boundary),
        cmocka_unit_test(test_predict_topk_exact),
        cmocka_unit_test_prestate_setup_teardown(test_grid_fwd_orders, env_setup, env_teardown,
                                                 (void *)"SPARGE_CUDA_FWD_ORDER"),
        cmocka_unit_test(test_forward_many_rows),
        cmocka_unit_test_prestate_setup_teardown(test_map_tiles, env_setup, env_teardown,
                                                 (void *)"SPARGE_CUDA_MAP_TILE"),
        cmocka_unit_test(test_grad_finite_differences),
        cmocka_unit_test(test_transpose_follows_selection),
    };
    int rc = cmocka_run_group_tests_name("conformance_" BACKEND, tests, NULL, NULL);
    sparge_device_close(dev);
    sparge_device_close(ref);
    return rc;
}
