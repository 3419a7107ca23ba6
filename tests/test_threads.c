/* Calls from several threads at once (docs/RELIABILITY.md, "Threads"), on every device present: selections
 * and predictions on distinct masks of one device; forwards, backwards (the first of them building the
 * transpose) and getters on ONE shared mask (plain, and causal varlen with grouped heads); devices opened and
 * closed, options set and the build and topology text asked for; masks used and destroyed after their device
 * handle was closed. Every result is compared with the same work done on one thread. Under ThreadSanitizer
 * (tests/tsan.sh) any unsynchronised access in the library fails the run as well.
 *
 * CMocka's assertions are not thread-safe: worker threads record what went wrong and the test's thread
 * asserts after joining them. */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { THREADS = 8, ROUNDS = 3 };

/* What a worker saw: the first failure, and how many results differed from the single-threaded ones. */
typedef struct {
    char error[512];
    int mismatches;
} outcome;

static void record(outcome *r, const char *what, sparge_status s)
{
    if (!r->error[0])
        snprintf(r->error, sizeof r->error, "%s: %s: %s", what, sparge_status_name(s), sparge_last_error());
}

static void assert_clean(const outcome *r, int n)
{
    for (int i = 0; i < n; i++) {
        if (r[i].error[0])
            fail_msg("thread %d: %s", i, r[i].error);
        if (r[i].mismatches)
            fail_msg("thread %d: %d result(s) differ from the single-threaded run", i, r[i].mismatches);
    }
}

static void start_all(pthread_t *th, int n, void *(*fn)(void *), void *args, size_t arg_size)
{
    for (int i = 0; i < n; i++)
        assert_int_equal(pthread_create(&th[i], NULL, fn, (char *)args + (size_t)i * arg_size), 0);
}

static void join_all(pthread_t *th, int n)
{
    for (int i = 0; i < n; i++)
        assert_int_equal(pthread_join(th[i], NULL), 0);
}

/* The devices of this build that are present: "cpu", "cpu-ref", then "cuda:0"... Returns the count. */
static int present_devices(char names[][32], int max)
{
    int n = 0;
    for (int b = 0; b < sparge_backend_count() && n < max; b++) {
        const char *be = sparge_backend_name(b);
        if (sparge_backend_device_count(be) > 0)
            snprintf(names[n++], 32, strncmp(be, "cpu", 3) ? "%s:0" : "%s", be);
    }
    return n;
}

/* An f32 [B,H,N,D] tensor in dev's memory. */
static sparge_tensor dev_tensor(sparge_device *dev, int64_t B, int64_t H, int64_t N, int64_t D)
{
    void *p = NULL;
    assert_int_equal(sparge_malloc(dev, (size_t)(B * H * N * D) * sizeof(float), &p), SPARGE_OK);
    return sparge_tensor_bhnd(p, SPARGE_F32, B, H, N, D);
}

static size_t tensor_bytes(const sparge_tensor *t) { return sparge_tensor_span_bytes(t); }

static float *random_host(int64_t n, uint64_t seed)
{
    tu_rng r = {seed};
    float *x = malloc((size_t)n * sizeof(float));
    assert_non_null(x);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)tu_normal(&r);
    return x;
}

/* dev_tensor filled with normal values from seed. */
static sparge_tensor dev_random(sparge_device *dev, int64_t B, int64_t H, int64_t N, int64_t D, uint64_t seed)
{
    sparge_tensor t = dev_tensor(dev, B, H, N, D);
    float *x = random_host(B * H * N * D, seed);
    assert_int_equal(sparge_memcpy_to_device(dev, t.data, x, tensor_bytes(&t)), SPARGE_OK);
    free(x);
    return t;
}

/* A pooled map [B,H,Nqb,Nkb] of softmax rows, so that Top-p has mass to cut. */
static sparge_tensor dev_map(sparge_device *dev, int64_t B, int64_t H, int64_t Nqb, int64_t Nkb, uint64_t seed)
{
    sparge_tensor t = dev_tensor(dev, B, H, Nqb, Nkb);
    float *x = random_host(B * H * Nqb * Nkb, seed);
    for (int64_t r = 0; r < B * H * Nqb; r++) {
        float *row = x + r * Nkb, sum = 0.0f;
        for (int64_t j = 0; j < Nkb; j++)
            sum += row[j] = expf(2.0f * row[j]);
        for (int64_t j = 0; j < Nkb; j++)
            row[j] /= sum;
    }
    assert_int_equal(sparge_memcpy_to_device(dev, t.data, x, tensor_bytes(&t)), SPARGE_OK);
    free(x);
    return t;
}

/* ------------------------------------------------------------------ selections on distinct masks */

/* Thread t's problem: its own shapes, map, Q and K, and what one thread computed for them. */
typedef struct {
    sparge_device *dev;
    int64_t Nq, Nk, Nqb, Nkb;
    sparge_mask_params params;
    sparge_tensor map, q, k;
    uint8_t *selected, *predicted; /* single-threaded results, [H,Nqb,Nkb] */
    outcome out;
} select_case;

enum { SEL_H = 2, SEL_D = 16, SEL_BQ = 16, SEL_BK = 8 };

/* Create a mask, select from the map and predict from Q, K; their dense views into the buffers. */
static sparge_status select_and_predict(select_case *c, uint8_t *selected, uint8_t *predicted, const char **what)
{
    sparge_mask *m = NULL;
    sparge_status s;
    if ((s = sparge_mask_create(c->dev, 1, SEL_H, c->Nq, c->Nk, SEL_BQ, SEL_BK, &m))) {
        *what = "sparge_mask_create";
        return s;
    }
    if ((s = sparge_mask_select(c->dev, &c->map, &c->params, m)))
        *what = "sparge_mask_select";
    else if ((s = sparge_mask_get_dense(m, selected)))
        *what = "sparge_mask_get_dense";
    else if ((s = sparge_mask_predict(c->dev, &c->q, &c->k, &c->params, m)))
        *what = "sparge_mask_predict";
    else if ((s = sparge_mask_get_dense(m, predicted)))
        *what = "sparge_mask_get_dense";
    sparge_mask_destroy(m);
    return s;
}

static void *select_worker(void *arg)
{
    select_case *c = arg;
    const size_t cells = (size_t)(SEL_H * c->Nqb * c->Nkb);
    uint8_t *sel = malloc(cells), *pred = malloc(cells);
    for (int round = 0; sel && pred && round < ROUNDS && !c->out.error[0]; round++) {
        const char *what = "";
        sparge_status s = select_and_predict(c, sel, pred, &what);
        if (s)
            record(&c->out, what, s);
        else
            c->out.mismatches += memcmp(sel, c->selected, cells) != 0 || memcmp(pred, c->predicted, cells) != 0;
    }
    if (!sel || !pred)
        snprintf(c->out.error, sizeof c->out.error, "out of host memory");
    free(sel);
    free(pred);
    return NULL;
}

/* 8 threads each create a mask, select and predict on it, ROUNDS times: the same sets as on one thread. */
static void test_parallel_selections(void **state)
{
    (void)state;
    char names[8][32];
    const int ndev = present_devices(names, 8);
    for (int d = 0; d < ndev; d++) {
        sparge_device *dev;
        assert_int_equal(sparge_device_open(names[d], &dev), SPARGE_OK);
        select_case c[THREADS];
        memset(c, 0, sizeof c);
        for (int t = 0; t < THREADS; t++) {
            c[t].dev = dev;
            c[t].Nq = 64 + 24 * t;
            c[t].Nk = 100 + 40 * t;
            c[t].Nqb = (c[t].Nq + SEL_BQ - 1) / SEL_BQ;
            c[t].Nkb = (c[t].Nk + SEL_BK - 1) / SEL_BK;
            c[t].params = (sparge_mask_params){.block_q = SEL_BQ, .block_k = SEL_BK, .topk = 0.05 * (t % 4), .topp = 0.3 + 0.1 * (t % 3)};
            c[t].map = dev_map(dev, 1, SEL_H, c[t].Nqb, c[t].Nkb, 100 + (uint64_t)t);
            c[t].q = dev_random(dev, 1, SEL_H, c[t].Nq, SEL_D, 200 + (uint64_t)t);
            c[t].k = dev_random(dev, 1, SEL_H, c[t].Nk, SEL_D, 300 + (uint64_t)t);
            const size_t cells = (size_t)(SEL_H * c[t].Nqb * c[t].Nkb);
            c[t].selected = malloc(cells);
            c[t].predicted = malloc(cells);
            assert_non_null(c[t].selected);
            assert_non_null(c[t].predicted);
            const char *what = "";
            sparge_status s = select_and_predict(&c[t], c[t].selected, c[t].predicted, &what);
            if (s)
                fail_msg("%s on one thread: %s", what, sparge_last_error());
        }
        pthread_t th[THREADS];
        start_all(th, THREADS, select_worker, c, sizeof c[0]);
        join_all(th, THREADS);
        for (int t = 0; t < THREADS; t++) {
            print_message("%s, thread %d: Nqb %lld Nkb %lld k %.2f p %.2f: %s\n", names[d], t, (long long)c[t].Nqb,
                          (long long)c[t].Nkb, c[t].params.topk, c[t].params.topp,
                          c[t].out.error[0] || c[t].out.mismatches ? "differs" : "same sets as one thread");
            sparge_free(dev, c[t].map.data);
            sparge_free(dev, c[t].q.data);
            sparge_free(dev, c[t].k.data);
            free(c[t].selected);
            free(c[t].predicted);
        }
        outcome out[THREADS];
        for (int t = 0; t < THREADS; t++)
            out[t] = c[t].out;
        sparge_device_close(dev);
        assert_clean(out, THREADS);
    }
}

/* ------------------------------------------------------------------ readers of one shared mask */

/* A shared mask's layout and its tensors' shapes: q [B,H,Tq,D], k and v [B,Hkv,Tk,D] (packed, B = 1, when varlen). */
typedef struct {
    const char *name;
    int64_t B, H, Hkv, Tq, Tk;
    sparge_mask_layout layout;
} shared_shape;

enum { SH_D = 16 };
static const int32_t sh_cu_q[4] = {0, 1, 33, 80}, sh_cu_k[4] = {0, 5, 40, 96};
static const shared_shape shared_shapes[] = {
    {"plain", 1, 2, 2, 96, 80, {.B = 1, .H = 2, .Nq = 96, .Nk = 80, .block_q = 16, .block_k = 16}},
    /* one query token, ragged blocks, one K/V head for two query heads */
    {"causal varlen mqa", 1, 2, 1, 80, 96,
     {.B = 3, .H = 2, .Nq = 80, .Nk = 96, .block_q = 16, .block_k = 16, .causal = 1, .cu_seqlens_q = sh_cu_q,
      .cu_seqlens_k = sh_cu_k}},
};

typedef struct {
    sparge_device *dev;
    const sparge_mask *mask; /* shared: only readers run on it while the threads run */
    const sparge_tensor *q, *k, *v, *o_ref, *d_o;
    const float *lse_ref;            /* device memory */
    const float *o_host, *lse_host;  /* the single-threaded forward */
    const float *grad_host[3];       /* the single-threaded deterministic backward: dQ, dK, dV */
    const int32_t *t_counts, *t_indices;
    pthread_barrier_t *go;
    int role; /* 0: backward, 1: forward then getters */
    outcome out;
} reader;

static int same_floats(sparge_device *dev, const sparge_tensor *t, const float *want, float *buf)
{
    const size_t bytes = tensor_bytes(t);
    return sparge_memcpy_to_host(dev, buf, t->data, bytes) == SPARGE_OK && memcmp(buf, want, bytes) == 0;
}

static double rel_error(const float *got, const float *ref, int64_t n)
{
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / den); /* NaN fails every comparison */
}

static void *reader_worker(void *arg)
{
    reader *r = arg;
    sparge_device *dev = r->dev;
    const sparge_attn_params det = {.deterministic = 1};
    sparge_tensor out[3] = {{0}};
    const sparge_tensor *like[3] = {r->q, r->k, r->k};
    const int64_t nlse = r->q->shape[0] * r->q->shape[1] * r->q->shape[2], nqd = nlse * SH_D;
    sparge_mask_shape ms;
    sparge_status s = sparge_mask_get_shape(r->mask, &ms);
    const int64_t ntc = ms.B * ms.H * ms.Nkb, nti = ntc * ms.Nqb;
    float *lse = NULL, *host = malloc((size_t)nqd * sizeof(float) + tensor_bytes(r->k));
    int32_t *tc = malloc(sizeof(int32_t) * (size_t)ntc), *ti = malloc(sizeof(int32_t) * (size_t)nti);
    for (int i = 0; i < 3 && !s; i++) {
        void *p = NULL;
        s = sparge_malloc(dev, tensor_bytes(like[i]), &p);
        out[i] = sparge_tensor_bhnd(p, SPARGE_F32, like[i]->shape[0], like[i]->shape[1], like[i]->shape[2], SH_D);
    }
    if (!s)
        s = sparge_malloc(dev, (size_t)nlse * sizeof(float), (void **)&lse);
    if (s || !host || !tc || !ti)
        snprintf(r->out.error, sizeof r->out.error, "allocating the outputs failed");
    pthread_barrier_wait(r->go); /* every reader starts at once, before any has built the transpose */
    if (!r->out.error[0] && r->role == 0) {
        if ((s = sparge_attention_backward(dev, r->q, r->k, r->v, r->o_ref, r->d_o, r->lse_ref, r->mask, &det,
                                           &out[0], &out[1], &out[2])))
            record(&r->out, "sparge_attention_backward", s);
        else if ((s = sparge_synchronize(dev)))
            record(&r->out, "sparge_synchronize", s);
        else
            for (int i = 0; i < 3; i++)
                r->out.mismatches += !same_floats(dev, &out[i], r->grad_host[i], host); /* deterministic: bits */
    } else if (!r->out.error[0]) {
        sparge_mask_stats st;
        if ((s = sparge_attention_forward(dev, r->q, r->k, r->v, r->mask, NULL, &out[0], lse)))
            record(&r->out, "sparge_attention_forward", s);
        else if ((s = sparge_memcpy_to_host(dev, host, out[0].data, tensor_bytes(&out[0]))))
            record(&r->out, "sparge_memcpy_to_host", s);
        else
            r->out.mismatches += !(rel_error(host, r->o_host, nqd) <= 1e-6);
        if (!s && (s = sparge_memcpy_to_host(dev, host, lse, (size_t)nlse * sizeof(float))))
            record(&r->out, "sparge_memcpy_to_host", s);
        else if (!s)
            r->out.mismatches += !(rel_error(host, r->lse_host, nlse) <= 1e-6);
        if (!s && (s = sparge_mask_get_csr(r->mask, NULL, NULL, tc, ti)))
            record(&r->out, "sparge_mask_get_csr", s);
        else if (!s)
            r->out.mismatches += memcmp(tc, r->t_counts, sizeof(int32_t) * (size_t)ntc) != 0 ||
                                 memcmp(ti, r->t_indices, sizeof(int32_t) * (size_t)nti) != 0;
        if (!s && (s = sparge_mask_get_stats(r->mask, &st, NULL, NULL)))
            record(&r->out, "sparge_mask_get_stats", s);
    }
    for (int i = 0; i < 3; i++)
        sparge_free(dev, out[i].data);
    sparge_free(dev, lse);
    free(host);
    free(tc);
    free(ti);
    return NULL;
}

/* Each round a new selection on the shared mask (one writer, alone), then 8 readers at once: half run the
 * deterministic backward (the first of them builds the transpose), half the forward and the getters. Their
 * results must equal those computed on one thread with a second mask holding the same selection. Plain masks,
 * and a causal varlen mask with one K/V head for two query heads. */
static void test_shared_mask_readers(void **state)
{
    (void)state;
    char names[8][32];
    const int ndev = present_devices(names, 8);
    for (int d = 0; d < ndev; d++)
        for (size_t sh_i = 0; sh_i < sizeof shared_shapes / sizeof shared_shapes[0]; sh_i++) {
            const shared_shape *sh = &shared_shapes[sh_i];
            sparge_device *dev;
            assert_int_equal(sparge_device_open(names[d], &dev), SPARGE_OK);
            const int64_t B = sh->B, H = sh->H, Hkv = sh->Hkv, Tq = sh->Tq, Tk = sh->Tk;
            sparge_tensor q = dev_random(dev, B, H, Tq, SH_D, 1), k = dev_random(dev, B, Hkv, Tk, SH_D, 2),
                          v = dev_random(dev, B, Hkv, Tk, SH_D, 3), d_o = dev_random(dev, B, H, Tq, SH_D, 4),
                          o = dev_tensor(dev, B, H, Tq, SH_D), dq = dev_tensor(dev, B, H, Tq, SH_D),
                          dk = dev_tensor(dev, B, Hkv, Tk, SH_D), dv = dev_tensor(dev, B, Hkv, Tk, SH_D);
            const int64_t nlse = B * H * Tq;
            float *lse = NULL;
            assert_int_equal(sparge_malloc(dev, sizeof(float) * (size_t)nlse, (void **)&lse), SPARGE_OK);
            float *o_host = malloc(tensor_bytes(&o)), *lse_host = malloc(sizeof(float) * (size_t)nlse);
            float *grads[3] = {malloc(tensor_bytes(&dq)), malloc(tensor_bytes(&dk)), malloc(tensor_bytes(&dv))};
            sparge_mask *shared, *solo;
            assert_int_equal(sparge_mask_create_ex(dev, &sh->layout, &shared), SPARGE_OK);
            assert_int_equal(sparge_mask_create_ex(dev, &sh->layout, &solo), SPARGE_OK);
            sparge_mask_shape ms;
            assert_int_equal(sparge_mask_get_shape(shared, &ms), SPARGE_OK);
            const int64_t ntc = ms.B * ms.H * ms.Nkb, nti = ntc * ms.Nqb;
            int32_t *tc = malloc(sizeof(int32_t) * (size_t)ntc), *ti = malloc(sizeof(int32_t) * (size_t)nti);
            const sparge_attn_params det = {.deterministic = 1};
            outcome out[ROUNDS][THREADS];
            for (int round = 0; round < ROUNDS; round++) {
                const sparge_mask_params mp = {.topk = 0.1 * round, .topp = 0.4 + 0.1 * round};
                sparge_tensor map = dev_map(dev, ms.B, ms.H, ms.Nqb, ms.Nkb, 50 + (uint64_t)round);
                /* the single-threaded results, on the solo mask */
                assert_int_equal(sparge_mask_select(dev, &map, &mp, solo), SPARGE_OK);
                assert_int_equal(sparge_attention_forward(dev, &q, &k, &v, solo, NULL, &o, lse), SPARGE_OK);
                assert_int_equal(
                    sparge_attention_backward(dev, &q, &k, &v, &o, &d_o, lse, solo, &det, &dq, &dk, &dv), SPARGE_OK);
                assert_int_equal(sparge_mask_get_csr(solo, NULL, NULL, tc, ti), SPARGE_OK);
                assert_int_equal(sparge_memcpy_to_host(dev, o_host, o.data, tensor_bytes(&o)), SPARGE_OK);
                assert_int_equal(sparge_memcpy_to_host(dev, lse_host, lse, sizeof(float) * (size_t)nlse),
                                 SPARGE_OK);
                const sparge_tensor *g[3] = {&dq, &dk, &dv};
                for (int i = 0; i < 3; i++)
                    assert_int_equal(sparge_memcpy_to_host(dev, grads[i], g[i]->data, tensor_bytes(g[i])),
                                     SPARGE_OK);
                /* the writer, alone: a new selection whose transpose nobody has built yet */
                assert_int_equal(sparge_mask_select(dev, &map, &mp, shared), SPARGE_OK);
                assert_int_equal(sparge_synchronize(dev), SPARGE_OK);
                pthread_barrier_t go;
                assert_int_equal(pthread_barrier_init(&go, NULL, THREADS), 0);
                reader r[THREADS];
                memset(r, 0, sizeof r);
                for (int t = 0; t < THREADS; t++)
                    r[t] = (reader){dev, shared, &q, &k, &v, &o, &d_o, lse, o_host, lse_host,
                                    {grads[0], grads[1], grads[2]}, tc, ti, &go, t % 2, {{0}, 0}};
                pthread_t th[THREADS];
                start_all(th, THREADS, reader_worker, r, sizeof r[0]);
                join_all(th, THREADS);
                pthread_barrier_destroy(&go);
                for (int t = 0; t < THREADS; t++)
                    out[round][t] = r[t].out;
                print_message("%s, %s mask, round %d (k %.1f, p %.1f): 4 backwards building the transpose, "
                              "4 forwards and getters at once\n", names[d], sh->name, round, mp.topk, mp.topp);
                sparge_free(dev, map.data);
            }
            sparge_mask_destroy(shared);
            sparge_mask_destroy(solo);
            sparge_tensor *all[8] = {&q, &k, &v, &d_o, &o, &dq, &dk, &dv};
            for (int i = 0; i < 8; i++)
                sparge_free(dev, all[i]->data);
            sparge_free(dev, lse);
            free(o_host);
            free(lse_host);
            for (int i = 0; i < 3; i++)
                free(grads[i]);
            free(tc);
            free(ti);
            sparge_device_close(dev);
            for (int round = 0; round < ROUNDS; round++)
                assert_clean(out[round], THREADS);
        }
}

/* ------------------------------------------------------------------ devices, options, build and topology text */

typedef struct {
    const char *name;
    char description[256], topology[2048], build[1024]; /* what the thread saw, compared after the join */
    outcome out;
} opener;

static void *opener_worker(void *arg)
{
    opener *o = arg;
    for (int round = 0; round < ROUNDS && !o->out.error[0]; round++) {
        snprintf(o->topology, sizeof o->topology, "%s", sparge_topology_info());
        snprintf(o->build, sizeof o->build, "%s", sparge_build_info());
        sparge_device *dev;
        sparge_status s = sparge_device_open(o->name, &dev);
        if (s) {
            record(&o->out, "sparge_device_open", s);
            break;
        }
        snprintf(o->description, sizeof o->description, "%s", sparge_device_description(dev));
        /* an option of this handle only: "generic" runs everywhere, then back to the default */
        const char *value = NULL;
        if (!strcmp(sparge_device_backend(dev), "cpu")) {
            if ((s = sparge_device_set_option(dev, "simd", "generic")) ||
                (s = sparge_device_get_option(dev, "simd", &value)))
                record(&o->out, "the simd option", s);
            else
                o->out.mismatches += strcmp(value, "generic") != 0;
            if ((s = sparge_device_set_option(dev, "simd", "auto")))
                record(&o->out, "the simd option", s);
        }
        sparge_device_close(dev);
    }
    return NULL;
}

/* 8 threads open and close devices, set an option of their own handle and ask for the topology text and the
 * build text, at once. It runs first in this program so that the topology (loaded lazily by the first
 * caller) is loaded by these threads; the texts they saw are compared with single-threaded ones afterwards. */
static void test_devices_and_topology(void **state)
{
    (void)state;
    char names[8][32];
    const int ndev = present_devices(names, 8);
    opener o[THREADS];
    memset(o, 0, sizeof o);
    for (int t = 0; t < THREADS; t++)
        o[t].name = names[t % ndev];
    pthread_t th[THREADS];
    start_all(th, THREADS, opener_worker, o, sizeof o[0]);
    join_all(th, THREADS);
    outcome out[THREADS];
    for (int t = 0; t < THREADS; t++) {
        sparge_device *dev;
        assert_int_equal(sparge_device_open(o[t].name, &dev), SPARGE_OK);
        o[t].out.mismatches += strcmp(o[t].description, sparge_device_description(dev)) != 0;
        o[t].out.mismatches += strcmp(o[t].topology, sparge_topology_info()) != 0;
        o[t].out.mismatches += strcmp(o[t].build, sparge_build_info()) != 0;
        sparge_device_close(dev);
        out[t] = o[t].out;
    }
    print_message("%d threads opened %s%s and read the topology and build texts\n", THREADS, names[0],
                  ndev > 1 ? " and the other devices" : "");
    assert_clean(out, THREADS);
}

/* ------------------------------------------------------------------ masks that outlive their device handle */

typedef struct {
    sparge_mask *mask;
    const uint8_t *dense; /* what was set */
    outcome out;
} orphan;

enum { OR_H = 2, OR_NQB = 6, OR_NKB = 10, OR_BLOCK = 8 };

static void *orphan_worker(void *arg)
{
    orphan *w = arg;
    uint8_t dense[OR_H * OR_NQB * OR_NKB];
    int32_t tc[OR_H * OR_NKB], ti[OR_H * OR_NKB * OR_NQB];
    sparge_mask_stats st;
    sparge_status s;
    if ((s = sparge_mask_get_dense(w->mask, dense)))
        record(&w->out, "sparge_mask_get_dense", s);
    else
        w->out.mismatches += memcmp(dense, w->dense, sizeof dense) != 0;
    if ((s = sparge_mask_get_csr(w->mask, NULL, NULL, tc, ti))) /* builds the transpose */
        record(&w->out, "sparge_mask_get_csr", s);
    else
        for (int h = 0; h < OR_H; h++)
            for (int j = 0; j < OR_NKB; j++) {
                int c = 0;
                for (int i = 0; i < OR_NQB; i++)
                    if (w->dense[(h * OR_NQB + i) * OR_NKB + j])
                        w->out.mismatches += ti[(h * OR_NKB + j) * OR_NQB + c++] != i;
                w->out.mismatches += tc[h * OR_NKB + j] != c;
            }
    if ((s = sparge_mask_get_stats(w->mask, &st, NULL, NULL)))
        record(&w->out, "sparge_mask_get_stats", s);
    sparge_mask_destroy(w->mask); /* the last of them releases the device */
    return NULL;
}

/* sparge_device_close with masks alive defers the release until the last mask is destroyed: after the close,
 * 8 threads read their masks (building the transpose) and destroy them at once. */
static void test_masks_outlive_device(void **state)
{
    (void)state;
    char names[8][32];
    const int ndev = present_devices(names, 8);
    for (int d = 0; d < ndev; d++) {
        sparge_device *dev;
        assert_int_equal(sparge_device_open(names[d], &dev), SPARGE_OK);
        static uint8_t dense[THREADS][OR_H * OR_NQB * OR_NKB];
        orphan w[THREADS];
        memset(w, 0, sizeof w);
        tu_rng r = {7};
        for (int t = 0; t < THREADS; t++) {
            for (int i = 0; i < OR_H * OR_NQB * OR_NKB; i++)
                dense[t][i] = i % OR_NKB == (i / OR_NKB) % OR_NKB || tu_uniform(&r) < 0.3;
            assert_int_equal(sparge_mask_create(dev, 1, OR_H, OR_NQB * OR_BLOCK - 3, OR_NKB * OR_BLOCK, OR_BLOCK,
                                                OR_BLOCK, &w[t].mask),
                             SPARGE_OK);
            assert_int_equal(sparge_mask_set_dense(w[t].mask, dense[t]), SPARGE_OK);
            w[t].dense = dense[t];
        }
        sparge_device_close(dev);
        pthread_t th[THREADS];
        start_all(th, THREADS, orphan_worker, w, sizeof w[0]);
        join_all(th, THREADS);
        print_message("%s: %d masks read and destroyed by %d threads after the device handle was closed\n",
                      names[d], THREADS, THREADS);
        outcome out[THREADS];
        for (int t = 0; t < THREADS; t++)
            out[t] = w[t].out;
        assert_clean(out, THREADS);
    }
}

/* An argument runs only the tests whose names match it (a CMocka pattern: "test_shared_*"). */
int main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_devices_and_topology), /* first: the topology is loaded by its threads */
        cmocka_unit_test(test_parallel_selections),
        cmocka_unit_test(test_shared_mask_readers),
        cmocka_unit_test(test_masks_outlive_device),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
