/* Conformance of every available device against cpu-ref, the fp64 oracle (docs/DESIGN.md §2, §4.1).
 *
 * The devices are found at run time: every device of every compiled-in backend but cpu-ref ("cpu" here; "cuda:0",
 * "cuda-generic:0" and "hip:0" where present). test_grid and test_grid_grad run the harness's whole table
 * (src/check.c) in its test and grad modes; the other tests are particular checks (the shared mask vectors,
 * prediction over wide rows, ties, exact boundaries and non-finite inputs, the pooled map's kernels, the
 * transpose's life, gradients against finite differences), each run on every device. Kernel variants are chosen
 * with sparge_device_set_option. A combination a device does not support must fail cleanly with
 * SPARGE_ERR_UNSUPPORTED and leave the outputs untouched. */
#define _POSIX_C_SOURCE 200809L /* setenv, unsetenv, strdup: the environment's initial option values */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "check.h"
#include "../backends/cpu/ref.h"

enum { MAX_DEVICES = 16 };
static sparge_device *devs[MAX_DEVICES], *dev, *ref;
static int ndev;

typedef struct {
    int64_t B, H, Nq, Nk, D;
    int bq, bk;
} shape;

static const sparge_dtype dtypes[] = {SPARGE_F32, SPARGE_F16, SPARGE_BF16};

static int has_option(sparge_device *d, const char *name)
{
    const char *v;
    return sparge_device_get_option(d, name, &v) == SPARGE_OK;
}

/* Runs body with dev set to each device that has the option `needs` (every device if NULL); skips the test when
 * none has it. */
static void on_devices(const char *needs, void (*body)(void))
{
    int ran = 0;
    for (int i = 0; i < ndev; i++) {
        if (needs && !has_option(devs[i], needs))
            continue;
        dev = devs[i];
        printf("  on %s\n", sparge_device_name(dev));
        body();
        ran++;
    }
    if (!ran)
        skip();
}

/* ---------------------------------------------------------------- the harness's table */

/* Results per device: passes of any case, of the cases that set fwd_order=natural, and of the many-rows cases;
 * the (case, device) pairs where a mask prediction was refused. */
typedef struct {
    int passed[MAX_DEVICES], natural[MAX_DEVICES], many_rows[MAX_DEVICES], predict_refused;
} tally;

static void count_result(void *user, const check_case *c, const char *device, check_result r,
                         const char *const *tiers)
{
    tally *t = user;
    /* Only a variant a case forces through an option may refuse the prediction (map_tile=f16x3 on the
     * portable tier); with the device's own choices every prediction of the table must run. */
    if (!strcmp(tiers[0], "-") && !c->options) {
        printf("  %s on %s: the mask prediction was refused\n", c->name, device);
        t->predict_refused++;
    }
    for (int i = 0; i < ndev; i++)
        if (r == CHECK_PASS && !strcmp(device, sparge_device_name(devs[i]))) {
            t->passed[i]++;
            t->natural[i] += c->options && strstr(c->options, "fwd_order=natural") != NULL;
            t->many_rows[i] += !strncmp(c->name, "many-rows", 9);
        }
}

static void run_table(check_mode mode, tally *t)
{
    check_config cfg = {.mode = mode, .full = 1, .on_result = count_result, .user = t};
    check_summary s;
    memset(t, 0, sizeof *t);
    const int rc = check_run(&cfg, &s);
    assert_int_equal(s.failed, 0);
    assert_int_equal(rc, 0);
    assert_int_equal(s.devices, ndev);
    for (int i = 0; i < ndev; i++)
        if (!t->passed[i])
            fail_msg("%s passed no case of the table", sparge_device_name(devs[i]));
}

/* The whole table against cpu-ref: pooling, pooled map, prediction and selection, forward and backward over
 * several B·H, ragged N, Nq ≠ Nk, D from 32 to 256, both layouts, every dtype, masked and dense, and the device
 * options' kernel variants. Every device predicts every mask of the table with its own choices (a forward or
 * backward, or a variant an option forces, may be refused cleanly). A device with the forward's launch order
 * runs tensor-core cases in the natural order too, and every many-rows case (360 query blocks in several waves). */
static void test_grid(void **state)
{
    (void)state;
    tally t;
    int many_rows = 0;
    for (int i = 0; i < check_case_count(); i++)
        many_rows += !strncmp(check_case_get(i)->name, "many-rows", 9);
    run_table(CHECK_MODE_TEST, &t);
    assert_int_equal(t.predict_refused, 0);
    for (int i = 0; i < ndev; i++)
        if (has_option(devs[i], "fwd_order") && (!t.natural[i] || t.many_rows[i] != many_rows))
            fail_msg("%s: %d cases passed with fwd_order=natural, %d of the %d many-rows cases",
                     sparge_device_name(devs[i]), t.natural[i], t.many_rows[i], many_rows);
}

/* The table's small cases: each device's gradients against finite differences of the fp64 forward. */
static void test_grid_grad(void **state)
{
    (void)state;
    tally t;
    run_table(CHECK_MODE_GRAD, &t);
}

/* Every option of every device refuses a value it does not accept, with a message naming the option, and keeps
 * its value; an unknown option is refused too. An invalid value in an option's environment variable makes opening
 * the device fail with a message naming the variable. */
static void options_refuse_invalid(void)
{
    for (int i = 0; i < sparge_device_option_count(dev); i++) {
        const char *name, *value, *env, *again;
        char before[64];
        assert_int_equal(sparge_device_option(dev, i, &name, &value, NULL, &env, NULL), SPARGE_OK);
        snprintf(before, sizeof before, "%s", value);
        assert_int_equal(sparge_device_set_option(dev, name, "bogus"), SPARGE_ERR_INVALID);
        if (!strstr(sparge_last_error(), name))
            fail_msg("%s: refusing %s=bogus: the message does not name the option: %s", sparge_device_name(dev), name,
                     sparge_last_error());
        assert_int_equal(sparge_device_get_option(dev, name, &again), SPARGE_OK);
        assert_string_equal(again, before);
        if (!env)
            continue;
        char *saved = getenv(env) ? strdup(getenv(env)) : NULL;
        sparge_device *other = NULL;
        assert_int_equal(setenv(env, "bogus", 1), 0);
        const sparge_status s = sparge_device_open(sparge_device_name(dev), &other);
        assert_int_equal(saved ? setenv(env, saved, 1) : unsetenv(env), 0);
        free(saved);
        sparge_device_close(other);
        assert_int_equal(s, SPARGE_ERR_INVALID);
        if (!strstr(sparge_last_error(), env))
            fail_msg("opening %s with %s=bogus: the message does not name the variable: %s", sparge_device_name(dev),
                     env, sparge_last_error());
    }
    assert_int_equal(sparge_device_set_option(dev, "no_such_option", "on"), SPARGE_ERR_INVALID);
}

static void test_options_refuse_invalid(void **state)
{
    (void)state;
    on_devices(NULL, options_refuse_invalid);
}

/* ---------------------------------------------------------------- particular checks */

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

/* A device may refuse a valid combination; then nothing may be written. */
static int unsupported(sparge_status s, tu_tensor **outs, int n, const char *what)
{
    if (s != SPARGE_ERR_UNSUPPORTED)
        return 0;
    for (int i = 0; i < n; i++)
        assert_true(tu_still_poisoned(outs[i]));
    if (!sparge_last_error()[0])
        fail_msg("%s: unsupported without a message", what);
    printf("  %s: %s refused it: %s\n", what, sparge_device_name(dev), sparge_last_error());
    return 1;
}

static void check_close(const char *what, const shape *s, sparge_dtype dt, tu_layout lay, double *got, double *want,
                        int64_t n, double tol)
{
    double e = check_rel_l2(got, want, n);
    if (!(e <= tol))
        fail_msg("%s on %s: B=%lld H=%lld Nq=%lld Nk=%lld D=%lld bq=%d bk=%d %s %s: rel L2 %.3g > %.3g", what,
                 sparge_device_name(dev), (long long)s->B, (long long)s->H, (long long)s->Nq, (long long)s->Nk,
                 (long long)s->D, s->bq, s->bk, sparge_dtype_name(dt), lay == TU_BHND ? "BHND" : "BNHD", e, tol);
}

/* check_close of a device tensor against the reference's. */
static void check_tensors(const char *what, const shape *s, sparge_dtype dt, tu_layout lay, tu_tensor *got,
                          tu_tensor *want, double tol)
{
    double *g = tu_get(got), *w = tu_get(want);
    check_close(what, s, dt, lay, g, w, tu_numel(got), tol);
    free(g);
    free(w);
}

/* The device's selection against cpu-ref's (docs/DESIGN.md §2.2, through the harness's check_mask): well formed,
 * and equal row by row but for rows within the rounding margin of cpu-ref's pooled map rmap. */
static void compare_masks(sparge_mask *got, sparge_mask *want, const float *rmap, const sparge_mask_params *mp,
                          const shape *s)
{
    char msg[512];
    int64_t close = 0;
    if (check_mask(got, want, rmap, mp->topp, &close, msg, sizeof msg))
        fail_msg("%s on %s (B=%lld H=%lld Nq=%lld Nk=%lld bq=%d bk=%d, k=%g p=%g)", msg, sparge_device_name(dev),
                 (long long)s->B, (long long)s->H, (long long)s->Nq, (long long)s->Nk, s->bq, s->bk, mp->topk, mp->topp);
    if (close)
        printf("  note: %lld mask row(s) differ within the 1e-5 rounding margin\n", (long long)close);
}

/* The shared vectors: each row as a 1-row pooled map; rows with margin < 1e-5 may flip. */
static void mask_vectors(void)
{
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
        sparge_mask_params mp = {1, 1, c[i].k, c[i].p, 0.0f, 0};
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

static void test_mask_vectors(void **state)
{
    (void)state;
    on_devices(NULL, mask_vectors);
}

/* End-to-end vectors: Q, K → pooled means, pooled map and kept blocks. */
static void pooled_vectors(void)
{
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
        sparge_mask_params mp = {pc->bq, pc->bk, pc->k, pc->p, (float)pc->scale, 0};
        assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_OK);
        float *map = malloc((size_t)(pc->Nqb * pc->Nkb) * 4);
        assert_int_equal(sparge_mask_get_pooled_map(m, map), SPARGE_OK);
        double *mapd = malloc((size_t)(pc->Nqb * pc->Nkb) * sizeof *mapd);
        for (int j = 0; j < pc->Nqb * pc->Nkb; j++)
            mapd[j] = map[j];
        assert_true(check_rel_l2(mapd, pc->map, pc->Nqb * pc->Nkb) <= 1e-5);
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

static void test_pooled_vectors(void **state)
{
    (void)state;
    on_devices(NULL, pooled_vectors);
}

/* The causal and varlen vectors of one case in one layout: the device's prediction (pooled map within 1e-5, kept
 * blocks exactly: each row's allowed prefix, Top-k counted over it, diagonal blocks kept, rows past a sequence
 * empty), then its selection on the expected map itself (exactly). */
static void causal_vector(const tu_causal_case *c, tu_layout lay)
{
    const int64_t tb = c->cu_q ? 1 : c->B, rows = (int64_t)c->B * c->H * c->Nqb, cells = rows * c->Nkb;
    tu_tensor q = tu_alloc(dev, SPARGE_F32, lay, tb, c->H, c->Nq, c->D), k = tu_alloc(dev, SPARGE_F32, lay, tb, c->Hkv,
                                                                                    c->Nk, c->D);
    tu_tensor map = tu_alloc(dev, SPARGE_F32, TU_BHND, c->B, c->H, c->Nqb, c->Nkb);
    tu_set(&q, c->Q);
    tu_set(&k, c->K);
    tu_set(&map, c->map);
    const sparge_mask_layout l = {.B = c->B, .H = c->H, .Nq = c->Nq, .Nk = c->Nk, .block_q = c->bq, .block_k = c->bk,
                                  .causal = c->causal, .cu_seqlens_q = c->cu_q, .cu_seqlens_k = c->cu_k};
    sparge_mask *m;
    assert_int_equal(sparge_mask_create_ex(dev, &l, &m), SPARGE_OK);
    const sparge_mask_params mp = {c->bq, c->bk, c->k, c->p, (float)c->scale, c->causal};
    float *got = malloc((size_t)cells * sizeof *got);
    double *gotd = malloc((size_t)cells * sizeof *gotd);
    int32_t *cnt = malloc((size_t)rows * sizeof *cnt), *idx = malloc((size_t)cells * sizeof *idx);
    for (int pass = 0; pass < 2; pass++) {
        const char *what = pass ? "selection on the expected map" : "prediction";
        if (!pass) {
            if (sparge_mask_predict(dev, &q.t, &k.t, &mp, m) != SPARGE_OK)
                fail_msg("causal vector %s on %s: prediction: %s", c->name, sparge_device_name(dev),
                         sparge_last_error());
            assert_int_equal(sparge_mask_get_pooled_map(m, got), SPARGE_OK);
            for (int64_t i = 0; i < cells; i++)
                gotd[i] = got[i];
            const double e = check_rel_l2(gotd, c->map, cells);
            if (!(e <= 1e-5))
                fail_msg("causal vector %s on %s (%s): pooled map rel. L2 %.3g > 1e-5", c->name,
                         sparge_device_name(dev), lay == TU_BHND ? "BHND" : "BNHD", e);
        } else if (sparge_mask_select(dev, &map.t, &mp, m) != SPARGE_OK) {
            fail_msg("causal vector %s on %s: selection: %s", c->name, sparge_device_name(dev), sparge_last_error());
        }
        assert_int_equal(sparge_mask_get_csr(m, cnt, idx, NULL, NULL), SPARGE_OK);
        for (int64_t r = 0; r < rows; r++) {
            int same = cnt[r] == c->keep_count[r];
            for (int j = 0; same && j < cnt[r]; j++)
                same = idx[r * c->Nkb + j] == c->keep[r * c->Nkb + j];
            if (!same)
                fail_msg("causal vector %s on %s (%s), %s: row %lld (sequence %lld, head %lld, query block %lld) "
                         "keeps %d blocks, expected %d", c->name, sparge_device_name(dev),
                         lay == TU_BHND ? "BHND" : "BNHD", what, (long long)r, (long long)(r / (c->H * c->Nqb)),
                         (long long)(r / c->Nqb % c->H), (long long)(r % c->Nqb), cnt[r], c->keep_count[r]);
        }
    }
    free(got);
    free(gotd);
    free(cnt);
    free(idx);
    sparge_mask_destroy(m);
    tu_free(&q);
    tu_free(&k);
    tu_free(&map);
}

/* Causal and varlen vectors: each case in both layouts, on every device and on cpu-ref, the oracle itself. */
static void causal_vectors(void)
{
    tu_causal_case *c;
    const int n = tu_load_causal_cases(&c);
    assert_true(n >= 5);
    for (int i = 0; i < n; i++)
        for (int lay = 0; lay < 2; lay++)
            causal_vector(&c[i], (tu_layout)lay);
    printf("  %d causal and varlen vectors, both layouts\n", n);
    tu_free_causal_cases(c, n);
}

static void test_causal_vectors(void **state)
{
    (void)state;
    on_devices(NULL, causal_vectors);
    dev = ref;
    printf("  on %s\n", sparge_device_name(dev));
    causal_vectors();
}

/* Predicts the mask of (q, k) on the device and of (rq, rk) on cpu-ref, checks the pooled maps (rel. L2
 * ≤ 1e-5) and the selections, and returns the device's mask (the caller destroys it). */
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
    compare_masks(m, rm, rmap, mp, s);
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

/* Rows 16-byte aligned and contiguous along D (sparge_op_desc.rows_aligned) for tensors of tu_alloc. */
static int rows_aligned(const tu_tensor *x)
{
    const int64_t n = 16 / (int64_t)sparge_dtype_size(x->t.dtype);
    return x->t.stride[3] == 1 && (uintptr_t)x->t.data % 16 == 0 && x->t.stride[0] % n == 0 &&
           x->t.stride[1] % n == 0 && x->t.stride[2] % n == 0;
}

/* Each logits kernel of the pooled map (option map_tile: 128x64 and 64x64 in fp32 FMAs, f16x3 on the tensor cores,
 * auto where it can run) on ragged tiles with logits of several units, D a multiple of 16 and not: the map and the
 * selection match cpu-ref, and the two fp32 tiles give the same bits (each logit one fmaf chain over D in order)
 * and so the same selection. f16x3 runs wherever sparge_device_supports accepts it (the "cuda" tier) and is
 * refused cleanly elsewhere. */
static void map_tiles(void)
{
    tu_rng rng = {20261203};
    static const char *const tiles[3] = {"128x64", "64x64", "f16x3"};
    static const int64_t Ds[2] = {128, 36};
    const char *value;
    char saved[32];
    assert_int_equal(sparge_device_get_option(dev, "map_tile", &value), SPARGE_OK);
    snprintf(saved, sizeof saved, "%s", value);
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
        sparge_mask_params mp = {128, 64, 0.03, 0.2, 0.0f, 0};
        const shape s = {1, H, N, N, D, 128, 64};
        const sparge_op_desc desc = {.op = SPARGE_OP_MASK_PREDICT, .dtype = dt, .head_dim = D, .block_q = 128,
                                     .block_k = 64, .B = 1, .H = H, .Nq = N, .Nk = N,
                                     .rows_aligned = rows_aligned(&q) && rows_aligned(&k)};
        float *maps[2];
        int32_t *idx[2];
        for (int t = 0; t < 3; t++) {
            const char *tier;
            assert_int_equal(sparge_device_set_option(dev, "map_tile", tiles[t]), SPARGE_OK);
            if (sparge_device_supports(dev, &desc, &tier) != SPARGE_OK) {
                assert_true(t == 2); /* the fp32 tiles run everywhere */
                sparge_mask *m;
                uint8_t *all = malloc((size_t)cells), *after = malloc((size_t)cells);
                memset(all, 1, (size_t)cells);
                assert_int_equal(sparge_mask_create(dev, 1, H, N, N, 128, 64, &m), SPARGE_OK);
                assert_int_equal(sparge_mask_set_dense(m, all), SPARGE_OK);
                assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &mp, m), SPARGE_ERR_UNSUPPORTED);
                assert_true(sparge_last_error()[0] != 0);
                printf("  logits kernel %s, D=%lld: refused (%s)\n", tiles[t], (long long)D, sparge_last_error());
                assert_int_equal(sparge_mask_get_dense(m, after), SPARGE_OK);
                assert_memory_equal(after, all, (size_t)cells);
                sparge_mask_destroy(m);
                free(all);
                free(after);
                continue;
            }
            printf("  logits kernel %s, D=%lld, on tier %s\n", tiles[t], (long long)D, tier);
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
    assert_int_equal(sparge_device_set_option(dev, "map_tile", saved), SPARGE_OK);
}

static void test_map_tiles(void **state)
{
    (void)state;
    on_devices("map_tile", map_tiles);
}

/* Mask prediction over wide rows (the GPU's warp-per-row selection up to 2048 key blocks, its block sort
 * beyond) with ties: random keys against cpu-ref; flat rows (every key token the same, so every score in a
 * row ties) must keep the lowest indices; with twin key blocks (2m and 2m+1 identical, and pair m alike
 * pair m + 17) every class of equal blocks must keep a prefix of its ascending indices. */
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
    sparge_mask_params mp = {(int)bq, (int)bk, kind == 1 ? 0.1 : 0.03, kind == 1 ? 0.0 : 0.2, 0.0f, 0};
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

static void predict_wide_rows(void)
{
    tu_rng rng = {20261201};
    static const int64_t widths[] = {300, 1182, 2048, 2100};
    for (int w = 0; w < 4; w++)
        for (int kind = 0; kind < 3; kind++) {
            predict_wide_case(widths[w], kind, SPARGE_F32, TU_BHND, &rng);
            predict_wide_case(widths[w], kind, SPARGE_BF16, TU_BNHD, &rng);
        }
}

static void test_predict_wide_rows(void **state)
{
    (void)state;
    on_devices(NULL, predict_wide_rows);
}

/* A shape with many pooled-map tiles (the GPU's 128×64 logits tiles take over from 1024 of them) and
 * query-block columns longer than one transpose chunk: 16 heads of 1000 × 1000 blocks (ragged tails). */
static void predict_many_tiles(void)
{
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
    sparge_mask_params mp = {bq, bk, 0.03, 0.2, 0.0f, 0};
    const shape s = {B, H, Nq, Nk, D, bq, bk};
    sparge_mask_destroy(predict_and_compare(&s, SPARGE_BF16, TU_BHND, &q, &k, &rq, &rk, &mp));
    free(v);
    tu_free(&q);
    tu_free(&k);
    tu_free(&rq);
    tu_free(&rk);
}

static void test_predict_many_tiles(void **state)
{
    (void)state;
    on_devices(NULL, predict_many_tiles);
}

/* Mask prediction shapes beyond the grid: a ragged last query block with rows of 513 key blocks (one past a
 * selection width of 512), 2600 query blocks (the transpose walks many row chunks) with D = 8, 24 heads, and an
 * odd D = 36. The pooled map must match cpu-ref too. */
static void predict_shapes(void)
{
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
        sparge_mask_params mp = {s->bq, s->bk, 0.03, 0.2, 0.0f, 0};
        sparge_mask_destroy(predict_and_compare(s, SPARGE_BF16, TU_BNHD, &q, &k, &rq, &rk, &mp));
        tu_free(&q);
        tu_free(&k);
        tu_free(&rq);
        tu_free(&rk);
    }
}

static void test_predict_shapes(void **state)
{
    (void)state;
    on_devices(NULL, predict_shapes);
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
static void predict_nonfinite(void)
{
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
        sparge_mask_params mp = {128, 64, 0.03, 0.2, 0.0f, 0};
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

static void test_predict_nonfinite(void **state)
{
    (void)state;
    on_devices(NULL, predict_nonfinite);
}

/* Top-p at an exact boundary, against cpu-ref's selection on the device's own pooled map (so the same
 * probabilities, and the kept sets must be identical). One query block; 64 key blocks spread over the row hold
 * identical tokens along q̄, so they tie for the largest probability a, and p is set to their exact mass 64·a, then
 * to the next double above it (one block more). The GPU's selection, which decides by fp32 masses only when they are
 * clearly on one side of p, must take its fp64 path here. Then Top-k alone keeps 40 of the 64 ties, the first by
 * index: a selection must rank ties across all of a lane's register slots (and across warps, if a row is split).
 * Rows of 512 key blocks (a selection width) and of 300. */
static void predict_exact_boundary(void)
{
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
        sparge_mask_params mp = {128, 64, 0.0, 0.2, 0.0f, 0};
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

static void test_predict_exact_boundary(void **state)
{
    (void)state;
    on_devices(NULL, predict_exact_boundary);
}

/* Top-k prediction against cpu-ref's selection on the device's own pooled map, so the kept sets must be identical
 * wherever the GPU's search for the n_k-th largest score ends. Rows near uniform (random tokens) and peaked (block
 * offsets, logits of several units), n_k from 1 to every block, at a full selection width (512), a wide one (1182)
 * and a ragged one (300). */
static void predict_topk_exact(void)
{
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
                sparge_mask_params mp = {128, 64, ks[c], 0.0, 0.0f, 0};
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

static void test_predict_topk_exact(void **state)
{
    (void)state;
    on_devices(NULL, predict_topk_exact);
}

/* Mask prediction under each selection arm (Top-k only, Top-p only, p = 1, hybrid) on rows that mix distinct
 * scores with classes of equal ones (every third key block is a copy of one of 5 shared blocks, so exact ties sit
 * among distinct scores wherever the GPU's descent ends), at widths served by different selection kernels: the
 * kept sets against cpu-ref. */
static void predict_selection_arms(void)
{
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
            sparge_mask_params mp = {(int)bq, (int)bk, arms[a][0], arms[a][1], 0.0f, 0};
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

static void test_predict_selection_arms(void **state)
{
    (void)state;
    on_devices(NULL, predict_selection_arms);
}

/* get_csr's transpose of m (which builds it if this selection has none yet) against the dense view: m holds
 * dense, and its CSR and transpose list exactly its kept blocks. */
static void expect_transpose(sparge_mask *m, const uint8_t *dense)
{
    sparge_mask_shape ms;
    char msg[512];
    assert_int_equal(sparge_mask_get_shape(m, &ms), SPARGE_OK);
    const size_t cells = (size_t)(ms.B * ms.H * ms.Nqb * ms.Nkb);
    uint8_t *held = malloc(cells);
    assert_int_equal(sparge_mask_get_dense(m, held), SPARGE_OK);
    assert_memory_equal(held, dense, cells);
    free(held);
    if (check_mask(m, NULL, NULL, 0.0, NULL, msg, sizeof msg))
        fail_msg("%s on %s", msg, sparge_device_name(dev));
}

/* The transpose is built once per selection, by whichever of the backward and get_csr needs it first. One mask
 * object holds in turn a prediction (the backward builds its transpose), the complement set from the host
 * (get_csr builds it) and the prediction again; each time get_csr's transpose and the backward's gradients
 * (against cpu-ref on the same selection) must follow the selection: a transpose left from the last one fails. */
static void transpose_follows_selection(void)
{
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
    const sparge_mask_params mp = {s.bq, s.bk, 0.1, 0.5, 0.0f, 0};
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
            check_tensors(what, &s, dt, TU_BHND, &x[i], &rx[i], sparge_dtype_tolerance(dt));
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

static void test_transpose_follows_selection(void **state)
{
    (void)state;
    on_devices(NULL, transpose_follows_selection);
}

/* The device's gradient of the scalar loss L = Σ w∘O (dO = w) against central finite differences of the fp64
 * reference forward, test_grad's check run on the device's own forward and backward: one head of a ragged
 * masked shape, per dtype, inputs rounded to the dtype so both sides see the same values. */
static void grad_finite_differences(void)
{
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
        double *x[4]; /* the rounded values the device sees */
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
                        sparge_ref_head_forward(x[0], x[1], x[2], Nq, Nk, D, scale, bq, bk, 0, keep, (Nk + bk - 1) / bk, oo, ll);
                        l[side] = 0.0;
                        for (int64_t e = 0; e < n_q; e++)
                            l[side] += x[3][e] * oo[e];
                    }
                    x[t][i] = saved;
                    fd[probe] = (l[0] - l[1]) / (2 * h);
                    got[probe] = g[i];
                }
                const double err = check_rel_l2(got, fd, 16), tol = 2 * sparge_dtype_tolerance(dt);
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

static void test_grad_finite_differences(void **state)
{
    (void)state;
    on_devices(NULL, grad_finite_differences);
}


/* An argument runs only the tests whose names match it (a CMocka pattern: tests/tsan.sh runs a subset). */
int main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    char msg[512];
    ndev = check_open_devices(NULL, devs, MAX_DEVICES, msg, sizeof msg);
    if (ndev < 0) {
        fprintf(stderr, "%s\n", msg);
        return 1;
    }
    if (ndev == 0) {
        fprintf(stderr, "no device to check: SKIP\n");
        return TU_SKIP;
    }
    ref = tu_open_or_null("cpu-ref");
    if (!ref)
        return 1;
    printf("conformance against cpu-ref on:\n");
    for (int i = 0; i < ndev; i++)
        printf("  %s (%s)\n", sparge_device_name(devs[i]), sparge_device_description(devs[i]));
    if (msg[0])
        printf("compiled in without a device here: %s\n", msg);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mask_vectors),
        cmocka_unit_test(test_pooled_vectors),
        cmocka_unit_test(test_causal_vectors),
        cmocka_unit_test(test_grid),
        cmocka_unit_test(test_grid_grad),
        cmocka_unit_test(test_options_refuse_invalid),
        cmocka_unit_test(test_predict_wide_rows),
        cmocka_unit_test(test_predict_many_tiles),
        cmocka_unit_test(test_predict_shapes),
        cmocka_unit_test(test_predict_selection_arms),
        cmocka_unit_test(test_predict_nonfinite),
        cmocka_unit_test(test_predict_exact_boundary),
        cmocka_unit_test(test_predict_topk_exact),
        cmocka_unit_test(test_map_tiles),
        cmocka_unit_test(test_grad_finite_differences),
        cmocka_unit_test(test_transpose_follows_selection),
    };
    const int rc = cmocka_run_group_tests_name("conformance", tests, NULL, NULL);
    for (int i = 0; i < ndev; i++)
        sparge_device_close(devs[i]);
    sparge_device_close(ref);
    return rc;
}
