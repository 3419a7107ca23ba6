/* The shapes real models use, on every available device against cpu-ref: grouped K/V heads (GQA, MQA),
 * block-causal masks (bottom-right aligned, Nq = Nk and Nq < Nk), packed variable-length batches, and their
 * combinations; forward, backward and mask prediction, ragged blocks, both layouts. Then cpu-ref itself against
 * definitions it does not share code with: grouped heads equal repeated K/V heads, a varlen batch equals its
 * sequences run one at a time, and one with empty sequences the batch without them, causal attention equals a
 * naive token-masked softmax. Bad layouts are refused and write nothing. */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "testutil.h"
#include "../src/backend.h"

static sparge_device *ref;

typedef struct {
    const char *name;
    int64_t H, Hkv, D;
    int bq, bk, causal;
    int nseq;               /* 0: fixed length (B = 2, Nq, Nk below); else varlen with these lengths */
    int64_t Nq, Nk;
    int32_t lq[4], lk[4];   /* varlen lengths */
    double topk, topp;
} shape_case;

static const shape_case cases[] = {
    {"gqa 8/2", 8, 2, 64, 128, 64, 0, 0, 300, 300, {0}, {0}, 0.2, 0.5},
    {"mqa 6/1", 6, 1, 32, 64, 32, 0, 0, 200, 150, {0}, {0}, 0.3, 0.0},
    {"causal", 2, 2, 64, 128, 64, 1, 0, 390, 390, {0}, {0}, 0.1, 0.4},
    {"causal nq<nk", 2, 2, 64, 128, 64, 1, 0, 200, 333, {0}, {0}, 0.25, 0.3},
    {"causal gqa", 4, 2, 128, 128, 128, 1, 0, 260, 260, {0}, {0}, 0.2, 0.6},
    {"varlen", 2, 2, 64, 128, 64, 0, 4, 0, 0, {300, 77, 129, 256}, {300, 77, 129, 256}, 0.2, 0.5},
    {"varlen nq!=nk", 3, 3, 32, 64, 64, 0, 3, 0, 0, {100, 250, 64}, {140, 90, 64}, 0.25, 0.0},
    {"varlen causal gqa", 4, 1, 64, 128, 64, 1, 3, 0, 0, {200, 129, 64}, {260, 129, 190}, 0.15, 0.5},
    {"varlen empty causal", 2, 1, 64, 128, 64, 1, 4, 0, 0, {0, 200, 0, 131}, {0, 333, 64, 131}, 0.2, 0.5},
};
enum { CASES = sizeof cases / sizeof cases[0] };

static void check_close(const char *what, const shape_case *c, const char *dev, sparge_dtype dt, tu_tensor *got,
                        tu_tensor *want)
{
    double *g = tu_get(got), *w = tu_get(want), e = check_rel_l2(g, w, tu_numel(got));
    if (!(e <= sparge_dtype_tolerance(dt)))
        fail_msg("%s on %s, case %s, %s: rel L2 %.3g > %.3g", what, dev, c->name, sparge_dtype_name(dt), e,
                 sparge_dtype_tolerance(dt));
    free(g);
    free(w);
}

/* Tensors of a case on a device: q, k, v, o, d_o, dq, dk, dv; packed [1, H, T, D] when varlen. */
typedef struct {
    tu_tensor t[8];
    int64_t B, Tq, Tk;
} case_tensors;

static void case_alloc(case_tensors *x, sparge_device *dev, const shape_case *c, sparge_dtype dt, tu_layout lay)
{
    x->B = c->nseq ? 1 : 2;
    x->Tq = c->Nq, x->Tk = c->Nk;
    if (c->nseq)
        for (int s = 0, tq = 0, tk = 0; s < c->nseq; s++) {
            x->Tq = tq += c->lq[s];
            x->Tk = tk += c->lk[s];
        }
    const int64_t heads[8] = {c->H, c->Hkv, c->Hkv, c->H, c->H, c->H, c->Hkv, c->Hkv};
    for (int i = 0; i < 8; i++) {
        const int64_t n = i == 1 || i == 2 || i == 6 || i == 7 ? x->Tk : x->Tq;
        x->t[i] = tu_alloc(dev, dt, lay, x->B, heads[i], n, c->D);
    }
}

static void case_free(case_tensors *x)
{
    for (int i = 0; i < 8; i++)
        tu_free(&x->t[i]);
}

static sparge_mask_layout case_layout(const shape_case *c, const case_tensors *x, int32_t *cq, int32_t *ck)
{
    sparge_mask_layout l = {.B = c->nseq ? c->nseq : x->B, .H = c->H, .Nq = x->Tq, .Nk = x->Tk, .block_q = c->bq,
                            .block_k = c->bk, .causal = c->causal};
    if (c->nseq) {
        cq[0] = ck[0] = 0;
        for (int s = 0; s < c->nseq; s++) {
            cq[s + 1] = cq[s] + c->lq[s];
            ck[s + 1] = ck[s] + c->lk[s];
        }
        l.cu_seqlens_q = cq;
        l.cu_seqlens_k = ck;
    }
    return l;
}

/* One case on one device: the device's own prediction against cpu-ref's (exact on the CPU tiers, rounding ties
 * allowed elsewhere), then forward and backward on cpu-ref's selection against cpu-ref. */
static void run_case(sparge_device *dev, const shape_case *c, sparge_dtype dt, tu_layout lay, uint64_t seed)
{
    case_tensors x, r;
    case_alloc(&x, dev, c, dt, lay);
    case_alloc(&r, ref, c, dt, lay);
    tu_rng g1 = {seed}, g2 = {seed};
    for (int i = 0; i < 5; i++) {
        tu_fill_normal(&x.t[i], &g1, 1.0);
        tu_fill_normal(&r.t[i], &g2, 1.0);
    }
    for (int i = 3; i < 8; i++)
        if (i != 4)
            tu_poison(&x.t[i]);
    int32_t cq[5], ck[5];
    const sparge_mask_layout l = case_layout(c, &x, cq, ck);
    sparge_mask *m, *rm;
    assert_int_equal(sparge_mask_create_ex(dev, &l, &m), SPARGE_OK);
    assert_int_equal(sparge_mask_create_ex(ref, &l, &rm), SPARGE_OK);
    sparge_mask_params mp = {c->bq, c->bk, c->topk, c->topp, 0.0f, c->causal};
    assert_int_equal(sparge_mask_predict(ref, &r.t[0].t, &r.t[1].t, &mp, rm), SPARGE_OK);
    if (sparge_mask_predict(dev, &x.t[0].t, &x.t[1].t, &mp, m) != SPARGE_OK)
        fail_msg("%s: %s: prediction failed: %s", sparge_device_name(dev), c->name, sparge_last_error());
    sparge_mask_shape ms;
    assert_int_equal(sparge_mask_get_shape(rm, &ms), SPARGE_OK);
    assert_int_equal(ms.causal, c->causal);
    assert_int_equal(ms.varlen, c->nseq > 0);
    const int64_t cells = ms.B * ms.H * ms.Nqb * ms.Nkb;
    uint8_t *dg = malloc((size_t)cells), *dw = malloc((size_t)cells);
    assert_int_equal(sparge_mask_get_dense(m, dg), SPARGE_OK);
    assert_int_equal(sparge_mask_get_dense(rm, dw), SPARGE_OK);
    const int cpu = !strncmp(sparge_device_backend(dev), "cpu", 3);
    int64_t differ = 0;
    for (int64_t row = 0; row < cells / ms.Nkb; row++)
        differ += memcmp(dg + row * ms.Nkb, dw + row * ms.Nkb, (size_t)ms.Nkb) != 0;
    if (differ && cpu)
        fail_msg("%s: %s: %lld mask rows differ from cpu-ref", sparge_device_name(dev), c->name, (long long)differ);
    if (differ)
        print_message("  %s %s: %lld of %lld rows differ from cpu-ref (rounding of the pooled map)\n",
                      sparge_device_name(dev), c->name, (long long)differ, (long long)(cells / ms.Nkb));
    assert_true(differ * 50 <= cells / ms.Nkb);
    /* Attend with cpu-ref's selection on both. */
    assert_int_equal(sparge_mask_set_dense(m, dw), SPARGE_OK);
    float *lse;
    const int64_t n_lse = x.B * c->H * x.Tq;
    float *rlse = malloc((size_t)n_lse * sizeof *rlse);
    assert_int_equal(sparge_malloc(dev, (size_t)n_lse * sizeof *lse, (void **)&lse), SPARGE_OK);
    sparge_attn_params ap = {0.0f, lay == TU_BHND, 0}; /* both dQ paths: the deterministic pass and atomics */
    if (sparge_attention_forward(dev, &x.t[0].t, &x.t[1].t, &x.t[2].t, m, &ap, &x.t[3].t, lse) != SPARGE_OK)
        fail_msg("%s: %s: forward failed: %s", sparge_device_name(dev), c->name, sparge_last_error());
    assert_int_equal(sparge_attention_forward(ref, &r.t[0].t, &r.t[1].t, &r.t[2].t, rm, &ap, &r.t[3].t, rlse), SPARGE_OK);
    check_close("forward O", c, sparge_device_name(dev), dt, &x.t[3], &r.t[3]);
    /* The backward takes each device's own forward outputs. */
    if (sparge_attention_backward(dev, &x.t[0].t, &x.t[1].t, &x.t[2].t, &x.t[3].t, &x.t[4].t, lse, m, &ap, &x.t[5].t,
                                  &x.t[6].t, &x.t[7].t) != SPARGE_OK)
        fail_msg("%s: %s: backward failed: %s", sparge_device_name(dev), c->name, sparge_last_error());
    assert_int_equal(sparge_attention_backward(ref, &r.t[0].t, &r.t[1].t, &r.t[2].t, &r.t[3].t, &r.t[4].t, rlse, rm, &ap,
                                               &r.t[5].t, &r.t[6].t, &r.t[7].t),
                     SPARGE_OK);
    check_close("backward dQ", c, sparge_device_name(dev), dt, &x.t[5], &r.t[5]);
    check_close("backward dK", c, sparge_device_name(dev), dt, &x.t[6], &r.t[6]);
    check_close("backward dV", c, sparge_device_name(dev), dt, &x.t[7], &r.t[7]);
    /* Dense (no mask) causal for the fixed-length cases. */
    if (!c->nseq) {
        sparge_attn_params dense = {0.0f, 0, c->causal};
        tu_poison(&x.t[3]);
        assert_int_equal(sparge_attention_forward(dev, &x.t[0].t, &x.t[1].t, &x.t[2].t, NULL, &dense, &x.t[3].t, NULL),
                         SPARGE_OK);
        assert_int_equal(sparge_attention_forward(ref, &r.t[0].t, &r.t[1].t, &r.t[2].t, NULL, &dense, &r.t[3].t, NULL),
                         SPARGE_OK);
        check_close("dense forward O", c, sparge_device_name(dev), dt, &x.t[3], &r.t[3]);
    }
    sparge_free(dev, lse);
    free(rlse);
    free(dg);
    free(dw);
    sparge_mask_destroy(m);
    sparge_mask_destroy(rm);
    case_free(&x);
    case_free(&r);
}

/* Every device but cpu-ref, each case, f32 and bf16, both layouts. */
static void test_devices(void **state)
{
    (void)state;
    int ran = 0;
    for (int b = 0; b < sparge_backend_count(); b++) {
        const char *name = sparge_backend_name(b);
        for (int i = 0; strcmp(name, "cpu-ref") && i < sparge_backend_device_count(name); i++) {
            char dn[64];
            snprintf(dn, sizeof dn, strncmp(name, "cpu", 3) ? "%s:%d" : "%s", name, i);
            sparge_device *dev;
            assert_int_equal(sparge_device_open(dn, &dev), SPARGE_OK);
            for (int c = 0; c < CASES; c++)
                for (int d = 0; d < 2; d++)
                    for (int lay = 0; lay < 2; lay++, ran++)
                        run_case(dev, &cases[c], d ? SPARGE_BF16 : SPARGE_F32, (tu_layout)lay,
                                 1000u * (uint64_t)c + 10u * (uint64_t)d + (uint64_t)lay);
            print_message("  %s: %d shape cases passed\n", dn, CASES * 4);
            sparge_device_close(dev);
        }
    }
    assert_true(ran > 0);
}

/* Naive attention of one head with a token mask: causal keeps key u for query t when u <= t + off. */
static void naive(const double *q, const double *k, const double *v, int64_t nq, int64_t nk, int64_t D, int causal,
                  double *o)
{
    const double scale = 1.0 / sqrt((double)D);
    for (int64_t t = 0; t < nq; t++) {
        double m = -INFINITY, sum = 0.0, *s = malloc((size_t)nk * sizeof *s);
        for (int64_t u = 0; u < nk; u++) {
            s[u] = -INFINITY;
            if (!causal || u <= t + nk - nq) {
                s[u] = 0.0;
                for (int64_t d = 0; d < D; d++)
                    s[u] += q[t * D + d] * k[u * D + d] * scale;
            }
            m = fmax(m, s[u]);
        }
        for (int64_t d = 0; d < D; d++)
            o[t * D + d] = 0.0;
        for (int64_t u = 0; u < nk; u++) {
            const double p = exp(s[u] - m);
            sum += p;
            for (int64_t d = 0; d < D; d++)
                o[t * D + d] += p * v[u * D + d];
        }
        for (int64_t d = 0; d < D; d++)
            o[t * D + d] /= sum;
        free(s);
    }
}

/* cpu-ref against definitions: dense causal equals the naive token-masked softmax; grouped heads equal the same
 * call with K/V heads repeated; a varlen batch equals each sequence run alone with its rows of the mask. */
static void test_reference_definitions(void **state)
{
    (void)state;
    enum { H = 4, HK = 2, D = 16 };
    const int64_t nq = 70, nk = 90;
    tu_rng g = {77};
    /* Causal, dense, Nq < Nk, [1, H, N, D] f32. */
    tu_tensor q = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, nq, D), k = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, HK, nk, D),
              v = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, HK, nk, D), o = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, nq, D);
    tu_fill_normal(&q, &g, 1.0);
    tu_fill_normal(&k, &g, 1.0);
    tu_fill_normal(&v, &g, 1.0);
    sparge_attn_params causal = {0.0f, 0, 1};
    assert_int_equal(sparge_attention_forward(ref, &q.t, &k.t, &v.t, NULL, &causal, &o.t, NULL), SPARGE_OK);
    double *qd = tu_get(&q), *kd = tu_get(&k), *vd = tu_get(&v), *od = tu_get(&o), *want = malloc(sizeof(double) * nq * D);
    for (int h = 0; h < H; h++) {
        naive(qd + h * nq * D, kd + (h / (H / HK)) * nk * D, vd + (h / (H / HK)) * nk * D, nq, nk, D, 1, want);
        assert_true(check_rel_l2(od + h * nq * D, want, nq * D) < 1e-6);
    }
    /* Grouped heads against K/V repeated per query head (the same arithmetic: bit for bit). */
    tu_tensor kr = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, nk, D), vr = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, nk, D),
              o2 = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, nq, D);
    double *krd = malloc(sizeof(double) * H * nk * D), *vrd = malloc(sizeof(double) * H * nk * D);
    for (int h = 0; h < H; h++) {
        memcpy(krd + h * nk * D, kd + (h / (H / HK)) * nk * D, sizeof(double) * nk * D);
        memcpy(vrd + h * nk * D, vd + (h / (H / HK)) * nk * D, sizeof(double) * nk * D);
    }
    tu_set(&kr, krd);
    tu_set(&vr, vrd);
    assert_int_equal(sparge_attention_forward(ref, &q.t, &kr.t, &vr.t, NULL, &causal, &o2.t, NULL), SPARGE_OK);
    double *o2d = tu_get(&o2);
    assert_memory_equal(od, o2d, sizeof(double) * H * nq * D);
    /* Varlen: two sequences packed against each alone, with the rows of a predicted mask. */
    const int32_t cq[3] = {0, 30, 70}, ck[3] = {0, 50, 90};
    sparge_mask_layout l = {.B = 2, .H = H, .Nq = nq, .Nk = nk, .block_q = 16, .block_k = 8, .causal = 1,
                            .cu_seqlens_q = cq, .cu_seqlens_k = ck};
    sparge_mask *m;
    assert_int_equal(sparge_mask_create_ex(ref, &l, &m), SPARGE_OK);
    sparge_mask_params mp = {16, 8, 0.3, 0.3, 0.0f, 1};
    assert_int_equal(sparge_mask_predict(ref, &q.t, &k.t, &mp, m), SPARGE_OK);
    sparge_mask_shape ms;
    assert_int_equal(sparge_mask_get_shape(m, &ms), SPARGE_OK);
    assert_int_equal(ms.Nq, 40);
    assert_int_equal(ms.Nk, 50);
    uint8_t *dense = malloc((size_t)(ms.B * ms.H * ms.Nqb * ms.Nkb));
    assert_int_equal(sparge_mask_get_dense(m, dense), SPARGE_OK);
    assert_int_equal(sparge_attention_forward(ref, &q.t, &k.t, &v.t, m, NULL, &o.t, NULL), SPARGE_OK);
    double *ov = tu_get(&o);
    for (int s = 0; s < 2; s++) {
        const int64_t sq = cq[s + 1] - cq[s], sk = ck[s + 1] - ck[s], qb = (sq + 15) / 16, kb = (sk + 7) / 8;
        tu_tensor qs = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, sq, D), ks = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, HK, sk, D),
                  vs = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, HK, sk, D), os = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, sq, D);
        double *buf = malloc(sizeof(double) * H * sq * D);
        for (int h = 0; h < H; h++)
            memcpy(buf + h * sq * D, qd + (h * nq + cq[s]) * D, sizeof(double) * sq * D);
        tu_set(&qs, buf);
        double *kb_ = malloc(sizeof(double) * HK * sk * D), *vb_ = malloc(sizeof(double) * HK * sk * D);
        for (int h = 0; h < HK; h++) {
            memcpy(kb_ + h * sk * D, kd + (h * nk + ck[s]) * D, sizeof(double) * sk * D);
            memcpy(vb_ + h * sk * D, vd + (h * nk + ck[s]) * D, sizeof(double) * sk * D);
        }
        tu_set(&ks, kb_);
        tu_set(&vs, vb_);
        sparge_mask_layout ls = {.B = 1, .H = H, .Nq = sq, .Nk = sk, .block_q = 16, .block_k = 8, .causal = 1};
        sparge_mask *one;
        assert_int_equal(sparge_mask_create_ex(ref, &ls, &one), SPARGE_OK);
        /* The same sequence predicted alone selects what the packed prediction selected for it. */
        assert_int_equal(sparge_mask_predict(ref, &qs.t, &ks.t, &mp, one), SPARGE_OK);
        uint8_t *alone = malloc((size_t)(H * qb * kb));
        assert_int_equal(sparge_mask_get_dense(one, alone), SPARGE_OK);
        for (int h = 0; h < H; h++)
            for (int64_t i = 0; i < qb; i++)
                assert_memory_equal(alone + (h * qb + i) * kb, dense + ((s * H + h) * ms.Nqb + i) * ms.Nkb, (size_t)kb);
        for (int64_t i = 0; i < ms.Nqb; i++) /* past the sequence: nothing */
            for (int h = 0; h < H; h++)
                for (int64_t j = 0; j < ms.Nkb; j++)
                    if (i >= qb || j >= kb)
                        assert_int_equal(dense[((s * H + h) * ms.Nqb + i) * ms.Nkb + j], 0);
        assert_int_equal(sparge_attention_forward(ref, &qs.t, &ks.t, &vs.t, one, NULL, &os.t, NULL), SPARGE_OK);
        double *osd = tu_get(&os);
        for (int h = 0; h < H; h++)
            assert_memory_equal(osd + h * sq * D, ov + (h * nq + cq[s]) * D, sizeof(double) * sq * D);
        free(osd), free(alone), free(buf), free(kb_), free(vb_);
        sparge_mask_destroy(one);
        tu_free(&qs), tu_free(&ks), tu_free(&vs), tu_free(&os);
    }
    /* Causal rows keep their diagonal blocks and nothing above them; statistics count the allowed pairs only. */
    for (int64_t row = 0; row < ms.B * ms.H * ms.Nqb; row++) {
        const int64_t s = row / (ms.H * ms.Nqb), i = row % ms.Nqb, sq = cq[s + 1] - cq[s], sk = ck[s + 1] - ck[s];
        if (i * 16 >= sq)
            continue;
        int64_t allowed, d0, d1;
        sparge_row_rule(i, sq, sk, 16, 8, 1, &allowed, &d0, &d1);
        for (int64_t j = 0; j < ms.Nkb; j++) {
            if (j >= allowed)
                assert_int_equal(dense[row * ms.Nkb + j], 0);
            if (j >= d0 && j <= d1)
                assert_int_equal(dense[row * ms.Nkb + j], 1);
        }
    }
    sparge_mask_stats st;
    assert_int_equal(sparge_mask_get_stats(m, &st, NULL, NULL), SPARGE_OK);
    assert_true(st.sparsity >= 0.0 && st.sparsity < 1.0 && st.token_density > 0.0 && st.token_density <= 1.0);
    free(dense), free(qd), free(kd), free(vd), free(od), free(o2d), free(ov), free(want), free(krd), free(vrd);
    sparge_mask_destroy(m);
    tu_free(&q), tu_free(&k), tu_free(&v), tu_free(&o), tu_free(&kr), tu_free(&vr), tu_free(&o2);
}

/* Refused with a message naming the problem, nothing written. */
/* A mask predicts again from K with another number of K/V heads or another head dim than its last prediction
 * (MQA, GQA, plain heads, a smaller D, MQA again): each time its pooled map and selection equal those of a fresh
 * mask, on both CPU tiers (the pooled means it keeps between predictions must follow K's heads and D). */
static void test_predict_after_kv_heads_change(void **state)
{
    (void)state;
    enum { H = 4, N = 64, DMAX = 8, BLK = 16, NB = N / BLK, STEPS = 5 };
    static const char *const tiers[] = {"cpu-ref", "cpu"};
    static const int64_t hkv[STEPS] = {1, 2, 4, 2, 1}, dims[STEPS] = {8, 8, 8, 4, 8};
    float q[H * N * DMAX], k[H * N * DMAX], map[H * NB * NB], fresh_map[H * NB * NB];
    uint8_t dense[H * NB * NB], fresh_dense[H * NB * NB];
    tu_rng r = {20261207};
    for (int i = 0; i < H * N * DMAX; i++) {
        q[i] = (float)tu_normal(&r);
        k[i] = (float)tu_normal(&r) + (i / DMAX % N < BLK ? 1.5f : 0.0f); /* a sink block: rows are not flat */
    }
    for (int t = 0; t < 2; t++) {
        sparge_device *dev = tu_open_or_null(tiers[t]);
        assert_non_null(dev);
        sparge_mask *m, *f;
        assert_int_equal(sparge_mask_create(dev, 1, H, N, N, BLK, BLK, &m), SPARGE_OK);
        const sparge_mask_params mp = {BLK, BLK, 0.3, 0.5, 0.0f, 0};
        for (int c = 0; c < STEPS; c++) {
            sparge_tensor qt = sparge_tensor_bhnd(q, SPARGE_F32, 1, H, N, dims[c]),
                          kt = sparge_tensor_bhnd(k, SPARGE_F32, 1, hkv[c], N, dims[c]);
            assert_int_equal(sparge_mask_predict(dev, &qt, &kt, &mp, m), SPARGE_OK);
            assert_int_equal(sparge_mask_create(dev, 1, H, N, N, BLK, BLK, &f), SPARGE_OK);
            assert_int_equal(sparge_mask_predict(dev, &qt, &kt, &mp, f), SPARGE_OK);
            assert_int_equal(sparge_mask_get_pooled_map(m, map), SPARGE_OK);
            assert_int_equal(sparge_mask_get_pooled_map(f, fresh_map), SPARGE_OK);
            assert_int_equal(sparge_mask_get_dense(m, dense), SPARGE_OK);
            assert_int_equal(sparge_mask_get_dense(f, fresh_dense), SPARGE_OK);
            if (memcmp(map, fresh_map, sizeof map) || memcmp(dense, fresh_dense, sizeof dense))
                fail_msg("%s: prediction %d (%lld K heads, D = %lld) differs from a fresh mask's", tiers[t], c,
                         (long long)hkv[c], (long long)dims[c]);
            sparge_mask_destroy(f);
        }
        sparge_mask_destroy(m);
        sparge_device_close(dev);
    }
}

static void test_bad_layouts(void **state)
{
    (void)state;
    sparge_mask *m = NULL;
    const int32_t up[3] = {0, 40, 30}, ok[3] = {0, 30, 60}, from1[3] = {1, 30, 60};
    sparge_mask_layout l = {.B = 2, .H = 2, .Nq = 60, .Nk = 60, .block_q = 16, .block_k = 16,
                            .cu_seqlens_q = up, .cu_seqlens_k = ok};
#define REFUSED(want, call, word)                                                                                      \
    do {                                                                                                               \
        sparge_status s_ = (call);                                                                                     \
        if (s_ != (want) || !strstr(sparge_last_error(), word))                                                         \
            fail_msg("%s: %s, \"%s\" (expected %s naming %s)", #call, sparge_status_name(s_), sparge_last_error(),      \
                     sparge_status_name(want), word);                                                                  \
    } while (0)
    REFUSED(SPARGE_ERR_INVALID, sparge_mask_create_ex(ref, &l, &m), "must not decrease");
    l.cu_seqlens_q = from1;
    REFUSED(SPARGE_ERR_INVALID, sparge_mask_create_ex(ref, &l, &m), "must be 0");
    l.cu_seqlens_q = ok;
    l.Nq = 61;
    REFUSED(SPARGE_ERR_SHAPE, sparge_mask_create_ex(ref, &l, &m), "61");
    l.Nq = 60;
    l.cu_seqlens_k = NULL;
    REFUSED(SPARGE_ERR_NULL, sparge_mask_create_ex(ref, &l, &m), "cu_seqlens_k");
    sparge_mask_layout c = {.B = 1, .H = 1, .Nq = 100, .Nk = 50, .block_q = 16, .block_k = 16, .causal = 1};
    REFUSED(SPARGE_ERR_SHAPE, sparge_mask_create_ex(ref, &c, &m), "Nq <= Nk");
    assert_null(m);
    /* Heads: K's must divide q's. */
    float qb[1 * 6 * 32 * 8] = {0}, kb[1 * 4 * 32 * 8] = {0}, ob[1 * 6 * 32 * 8];
    sparge_tensor q = sparge_tensor_bhnd(qb, SPARGE_F32, 1, 6, 32, 8), k = sparge_tensor_bhnd(kb, SPARGE_F32, 1, 4, 32, 8),
                  o = sparge_tensor_bhnd(ob, SPARGE_F32, 1, 6, 32, 8);
    memset(ob, 0xff, sizeof ob);
    REFUSED(SPARGE_ERR_SHAPE, sparge_attention_forward(ref, &q, &k, &k, NULL, NULL, &o, NULL), "divide");
    sparge_attn_params causal = {0.0f, 0, 1};
    sparge_tensor k16 = sparge_tensor_bhnd(kb, SPARGE_F32, 1, 2, 16, 8);
    REFUSED(SPARGE_ERR_SHAPE, sparge_attention_forward(ref, &q, &k16, &k16, NULL, &causal, &o, NULL), "Nq <= Nk");
    sparge_tensor k31 = sparge_tensor_bhnd(kb, SPARGE_F32, 1, 2, 31, 8); /* one key fewer than queries */
    REFUSED(SPARGE_ERR_SHAPE, sparge_attention_forward(ref, &q, &k31, &k31, NULL, &causal, &o, NULL), "Nq <= Nk");
    for (size_t i = 0; i < sizeof ob / sizeof ob[0]; i++)
        assert_true(isnan(ob[i]));
    /* A causal mask refuses an import that drops a diagonal block or keeps one above the diagonal. */
    sparge_mask_layout cl = {.B = 1, .H = 1, .Nq = 32, .Nk = 32, .block_q = 16, .block_k = 16, .causal = 1};
    assert_int_equal(sparge_mask_create_ex(ref, &cl, &m), SPARGE_OK);
    const uint8_t above[4] = {1, 1, 1, 1}, no_diag[4] = {1, 0, 1, 0}, good[4] = {1, 0, 0, 1};
    REFUSED(SPARGE_ERR_INVALID, sparge_mask_set_dense(m, above), "above the causal diagonal");
    REFUSED(SPARGE_ERR_INVALID, sparge_mask_set_dense(m, no_diag), "diagonal");
    assert_int_equal(sparge_mask_set_dense(m, good), SPARGE_OK);
    /* A plain mask with a causal request, and params that disagree with the mask. */
    sparge_mask_params mp = {16, 16, 0.5, 0.0, 0.0f, 1};
    sparge_mask *plain;
    assert_int_equal(sparge_mask_create(ref, 1, 6, 32, 32, 16, 16, &plain), SPARGE_OK);
    sparge_tensor k6 = sparge_tensor_bhnd(kb, SPARGE_F32, 1, 2, 32, 8);
    REFUSED(SPARGE_ERR_MASK, sparge_mask_predict(ref, &q, &k6, &mp, plain), "causal");
    float mb[6 * 2 * 2];
    for (size_t i = 0; i < sizeof mb / sizeof mb[0]; i++)
        mb[i] = 0.25f * (float)(i % 4);
    sparge_tensor map = sparge_tensor_bhnd(mb, SPARGE_F32, 1, 6, 2, 2);
    REFUSED(SPARGE_ERR_MASK, sparge_mask_select(ref, &map, &mp, plain), "causal");
    uint8_t held[6 * 2 * 2];
    REFUSED(SPARGE_ERR_MASK, sparge_mask_get_dense(plain, held), "no selection");
    sparge_mask_destroy(plain);
    sparge_mask_destroy(m);
#undef REFUSED
}

/* Refusals on a causal varlen mask with grouped K/V heads, on the cpu tier: each call fails with its status and a
 * message, O, LSE, dQ, dK and dV keep their poison and the mask its selection. */
static void test_layout_refusals_write_nothing(void **state)
{
    (void)state;
    enum { H = 4, HK = 2, T = 90, D = 8 };
    static float q[H * T * D], k[HK * T * D], v[HK * T * D], o[H * T * D], d_o[H * T * D], lse[H * T], dq[H * T * D],
        dk[HK * T * D], dv[HK * T * D], lse_fwd[H * T];
    static uint16_t v16[HK * T * D];
    tu_rng g = {47};
    for (int i = 0; i < H * T * D; i++)
        q[i] = (float)tu_normal(&g), d_o[i] = (float)tu_normal(&g);
    for (int i = 0; i < HK * T * D; i++)
        k[i] = (float)tu_normal(&g), v[i] = (float)tu_normal(&g);
    sparge_device *dev;
    assert_int_equal(sparge_device_open("cpu", &dev), SPARGE_OK);
    const int32_t cu[4] = {0, 1, 40, 90};
    const sparge_mask_layout l = {.B = 3, .H = H, .Nq = T, .Nk = T, .block_q = 16, .block_k = 8, .causal = 1,
                                  .cu_seqlens_q = cu, .cu_seqlens_k = cu};
    sparge_mask *m, *empty, *plain;
    assert_int_equal(sparge_mask_create_ex(dev, &l, &m), SPARGE_OK);
    assert_int_equal(sparge_mask_create_ex(dev, &l, &empty), SPARGE_OK);
    assert_int_equal(sparge_mask_create(dev, 1, H, T, T, 16, 8, &plain), SPARGE_OK);
    sparge_tensor Q = sparge_tensor_bhnd(q, SPARGE_F32, 1, H, T, D), K = sparge_tensor_bhnd(k, SPARGE_F32, 1, HK, T, D),
                  V = sparge_tensor_bhnd(v, SPARGE_F32, 1, HK, T, D), O = sparge_tensor_bhnd(o, SPARGE_F32, 1, H, T, D),
                  DO = sparge_tensor_bhnd(d_o, SPARGE_F32, 1, H, T, D),
                  DQ = sparge_tensor_bhnd(dq, SPARGE_F32, 1, H, T, D),
                  DK = sparge_tensor_bhnd(dk, SPARGE_F32, 1, HK, T, D),
                  DV = sparge_tensor_bhnd(dv, SPARGE_F32, 1, HK, T, D);
    const sparge_mask_params mp = {0, 0, 0.2, 0.3, 0.0f, 1}, plain_mp = {0, 0, 0.2, 0.3, 0.0f, 0};
    assert_int_equal(sparge_mask_predict(dev, &Q, &K, &mp, m), SPARGE_OK);
    assert_int_equal(sparge_mask_predict(dev, &Q, &K, &plain_mp, plain), SPARGE_OK);
    static float o_fwd[H * T * D];
    sparge_tensor OF = sparge_tensor_bhnd(o_fwd, SPARGE_F32, 1, H, T, D);
    assert_int_equal(sparge_attention_forward(dev, &Q, &K, &V, m, NULL, &OF, lse_fwd), SPARGE_OK);
    uint8_t before[3 * H * 4 * 7], after[sizeof before]; /* [B,H,Nqb,Nkb] over the longest sequence, 50 tokens */
    assert_int_equal(sparge_mask_get_dense(m, before), SPARGE_OK);
#define EXPECT_FAIL(want, call)                                                                                        \
    do {                                                                                                               \
        float *outs_[5] = {o, lse, dq, dk, dv};                                                                        \
        const size_t sizes_[5] = {sizeof o, sizeof lse, sizeof dq, sizeof dk, sizeof dv};                              \
        for (int i_ = 0; i_ < 5; i_++)                                                                                 \
            memset(outs_[i_], 0xff, sizes_[i_]);                                                                       \
        assert_int_equal(sparge_mask_get_shape(NULL, NULL), SPARGE_ERR_NULL); /* a message the call must replace */ \
        const sparge_status s_ = (call);                                                                               \
        if (s_ != (want) || strstr(sparge_last_error(), "get_shape") || !strstr(sparge_last_error(), ": "))          \
            fail_msg("%s: %s, \"%s\" (expected %s)", #call, sparge_status_name(s_), sparge_last_error(),               \
                     sparge_status_name(want));                                                                        \
        for (int i_ = 0; i_ < 5; i_++)                                                                                 \
            for (size_t j_ = 0; j_ < sizes_[i_]; j_++)                                                                 \
                if (((unsigned char *)outs_[i_])[j_] != 0xff)                                                          \
                    fail_msg("%s wrote output %d byte %zu", #call, i_, j_);                                            \
        assert_int_equal(sparge_mask_get_dense(m, after), SPARGE_OK);                                                  \
        assert_memory_equal(after, before, sizeof before);                                                             \
    } while (0)
    const sparge_attn_params det = {0.0f, 1, 1};
    sparge_tensor Kshort = sparge_tensor_bhnd(k, SPARGE_F32, 1, HK, T - 1, D),
                  DKs = sparge_tensor_bhnd(dk, SPARGE_F32, 1, HK, T - 1, D),
                  DVs = sparge_tensor_bhnd(dv, SPARGE_F32, 1, HK, T - 1, D),
                  K3 = sparge_tensor_bhnd(k, SPARGE_F32, 1, 3, T, D), V16 = sparge_tensor_bhnd(v16, SPARGE_F16, 1, HK, T, D),
                  DKq = sparge_tensor_bhnd(dk, SPARGE_F32, 1, HK, T, D / 2);
    /* the sequences as a padded batch */
    sparge_tensor Qb = sparge_tensor_bhnd(q, SPARGE_F32, 3, H, 30, D), Kb = sparge_tensor_bhnd(k, SPARGE_F32, 3, HK, 30, D),
                  Ob = sparge_tensor_bhnd(o, SPARGE_F32, 3, H, 30, D);
    /* forward */
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_forward(dev, &Q, &Kshort, &Kshort, m, NULL, &O, lse));
    EXPECT_FAIL(SPARGE_ERR_SHAPE, sparge_attention_forward(dev, &Q, &K3, &K3, m, NULL, &O, lse));
    EXPECT_FAIL(SPARGE_ERR_DTYPE, sparge_attention_forward(dev, &Q, &K, &V16, m, NULL, &O, lse));
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_forward(dev, &Q, &K, &V, empty, NULL, &O, lse));
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_forward(dev, &Q, &K, &V, plain, &det, &O, lse));
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_forward(dev, &Qb, &Kb, &Kb, m, NULL, &Ob, lse));
    /* deterministic backward */
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_attention_backward(dev, &Q, &K, &V, &OF, &DO, NULL, m, &det, &DQ, &DK, &DV));
    EXPECT_FAIL(SPARGE_ERR_SHAPE, sparge_attention_backward(dev, &Q, &K, &V, &OF, &DO, lse_fwd, m, &det, &DQ, &DKq,
                                                            &DV));
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_attention_backward(dev, &Q, &K, &V, &OF, &DO, lse_fwd, m, &det, &DQ, &DK,
                                                              &DK));
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_backward(dev, &Q, &K, &V, &OF, &DO, lse_fwd, empty, &det, &DQ, &DK,
                                                           &DV));
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention_backward(dev, &Q, &Kshort, &Kshort, &OF, &DO, lse_fwd, m, &det, &DQ,
                                                           &DKs, &DVs));
    /* prediction, the one-call attention, import, statistics, export */
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_mask_predict(dev, &Qb, &Kb, &mp, m));
    EXPECT_FAIL(SPARGE_ERR_SHAPE, sparge_mask_predict(dev, &Q, &K3, &mp, m));
    EXPECT_FAIL(SPARGE_ERR_MASK, sparge_attention(dev, &Q, &Kshort, &Kshort, &mp, &O, lse, m));
    uint8_t all[sizeof before];
    memset(all, 1, sizeof all);
    EXPECT_FAIL(SPARGE_ERR_INVALID, sparge_mask_set_dense(m, all));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_mask_get_stats(m, NULL, NULL, NULL));
    EXPECT_FAIL(SPARGE_ERR_NULL, sparge_mask_export(m, NULL, D, SPARGE_F32));
    /* a layout whose sequence 1 has queries but no keys, causal or not: refused naming it, no mask made */
    const int32_t no_keys[4] = {0, 1, 1, 90};
    sparge_mask_layout lk = l;
    lk.cu_seqlens_k = no_keys;
    for (int causal = 1; causal >= 0; causal--) {
        sparge_mask *unset = plain;
        lk.causal = causal;
        EXPECT_FAIL(SPARGE_ERR_SHAPE, sparge_mask_create_ex(dev, &lk, &unset));
        if (!strstr(sparge_last_error(), "sequence 1 has 39 query and 0 key tokens"))
            fail_msg("the refusal does not name the sequence without keys: %s", sparge_last_error());
        assert_ptr_equal(unset, plain);
    }
#undef EXPECT_FAIL
    sparge_mask_destroy(m);
    sparge_mask_destroy(empty);
    sparge_mask_destroy(plain);
    sparge_device_close(dev);
}

/* Rows [n0, n0 + n) of each head of a [1, heads, N, D] fp64 image into dst at row d0 of [1, heads, M, D]. */
static void copy_rows(double *dst, int64_t M, int64_t d0, const double *src, int64_t N, int64_t n0, int64_t n,
                      int64_t heads, int64_t D)
{
    for (int64_t h = 0; h < heads; h++)
        memcpy(dst + (h * M + d0) * D, src + (h * N + n0) * D, sizeof(double) * (size_t)(n * D));
}

/* Exports m to a temporary prefix and reads the files back: its JSON into json (NUL-terminated) and exactly n bytes of
 * its dense view into bytes, nothing past them. Both files are removed. */
static void export_mask(const sparge_mask *m, int64_t D, char *json, size_t json_cap, uint8_t *bytes, size_t n)
{
    char prefix[] = "/tmp/sparge-test-export-XXXXXX", path[64];
    int fd = mkstemp(prefix);
    assert_true(fd >= 0);
    close(fd);
    remove(prefix);
    assert_int_equal(sparge_mask_export(m, prefix, D, SPARGE_F32), SPARGE_OK);
    snprintf(path, sizeof path, "%s.json", prefix);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    const size_t len = fread(json, 1, json_cap - 1, f);
    json[len] = 0;
    assert_true(len > 0);
    fclose(f);
    remove(path);
    snprintf(path, sizeof path, "%s.u8", prefix);
    f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fread(bytes, 1, n, f), n);
    assert_int_equal(fgetc(f), EOF); /* nothing past [B,H,Nqb,Nkb] */
    fclose(f);
    remove(path);
}

/* Empty sequences (docs/DESIGN.md §1.12): a causal packed batch whose sequences 0 and 2 have keys but no queries
 * and whose last has no token equals, on both CPU tiers, the batch of its sequences 1 and 3 alone: the same rows
 * selected (an empty sequence's keep nothing), the same statistics (an empty sequence's per-head sparsity 0), O and
 * LSE, dQ and those sequences' dK, dV, in both backward modes; the keys of the empty sequences get dK = dV = 0. Its
 * rows refuse an import that keeps a block, and its export names its offsets and imports back. */
static void test_empty_sequences(void **state)
{
    (void)state;
    enum { H = 2, HK = 1, D = 8, TQ = 70, TK = 110, TKC = 85, B = 5 };
    const int32_t cq[B + 1] = {0, 0, 30, 30, 70, 70}, ck[B + 1] = {0, 20, 60, 65, 110, 110};
    const int32_t sq[3] = {0, 30, 70}, sk[3] = {0, 40, 85}; /* sequences 1 and 3 alone */
    const sparge_mask_layout l = {.B = B, .H = H, .Nq = TQ, .Nk = TK, .block_q = 16, .block_k = 8, .causal = 1,
                                  .cu_seqlens_q = cq, .cu_seqlens_k = ck},
                             lc = {.B = 2, .H = H, .Nq = TQ, .Nk = TKC, .block_q = 16, .block_k = 8, .causal = 1,
                                   .cu_seqlens_q = sq, .cu_seqlens_k = sk};
    const sparge_mask_params mp = {0, 0, 0.3, 0.3, 0.0f, 1};
    static const char *const tiers[2] = {"cpu-ref", "cpu"};
    for (int t = 0; t < 2; t++) {
        sparge_device *dev;
        assert_int_equal(sparge_device_open(tiers[t], &dev), SPARGE_OK);
        tu_rng g = {53};
        tu_tensor x[8], c[8]; /* q, k, v, o, dO, dq, dk, dv: the batch with empty sequences, and without */
        const int64_t heads[8] = {H, HK, HK, H, H, H, HK, HK};
        for (int i = 0; i < 8; i++) {
            const int keys = i == 1 || i == 2 || i == 6 || i == 7;
            x[i] = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, heads[i], keys ? TK : TQ, D);
            c[i] = tu_alloc(dev, SPARGE_F32, TU_BHND, 1, heads[i], keys ? TKC : TQ, D);
        }
        for (int i = 0; i < 5; i++) {
            tu_fill_normal(&x[i], &g, 1.0);
            double *v = tu_get(&x[i]);
            if (i == 1 || i == 2) { /* the keys of sequences 1 and 3 */
                double *kc = malloc(sizeof(double) * HK * TKC * D);
                copy_rows(kc, TKC, 0, v, TK, ck[1], ck[2] - ck[1], HK, D);
                copy_rows(kc, TKC, sk[1], v, TK, ck[3], ck[4] - ck[3], HK, D);
                tu_set(&c[i], kc);
                free(kc);
            } else {
                tu_set(&c[i], v);
            }
            free(v);
        }
        sparge_mask *m, *mc;
        assert_int_equal(sparge_mask_create_ex(dev, &l, &m), SPARGE_OK);
        assert_int_equal(sparge_mask_create_ex(dev, &lc, &mc), SPARGE_OK);
        assert_int_equal(sparge_mask_predict(dev, &x[0].t, &x[1].t, &mp, m), SPARGE_OK);
        assert_int_equal(sparge_mask_predict(dev, &c[0].t, &c[1].t, &mp, mc), SPARGE_OK);
        sparge_mask_shape ms, msc;
        assert_int_equal(sparge_mask_get_shape(m, &ms), SPARGE_OK);
        assert_int_equal(sparge_mask_get_shape(mc, &msc), SPARGE_OK);
        assert_true(ms.Nqb == msc.Nqb && ms.Nkb == msc.Nkb);
        const int64_t row = ms.Nqb * ms.Nkb; /* one (sequence, head)'s cells */
        uint8_t *dense = malloc((size_t)(B * H * row)), *dc = malloc((size_t)(2 * H * row));
        uint8_t *zero = calloc(1, (size_t)row);
        assert_int_equal(sparge_mask_get_dense(m, dense), SPARGE_OK);
        assert_int_equal(sparge_mask_get_dense(mc, dc), SPARGE_OK);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++) {
                const uint8_t *want = b == 1 || b == 3 ? dc + ((b / 2) * H + h) * row : zero;
                if (memcmp(dense + (b * H + h) * row, want, (size_t)row))
                    fail_msg("%s: sequence %d head %d selects other blocks than without the empty sequences", tiers[t],
                             b, h);
            }
        sparge_mask_stats st, stc;
        double hs[B * H], hsc[2 * H];
        assert_int_equal(sparge_mask_get_stats(m, &st, hs, NULL), SPARGE_OK);
        assert_int_equal(sparge_mask_get_stats(mc, &stc, hsc, NULL), SPARGE_OK);
        assert_true(st.kept_blocks == stc.kept_blocks && st.total_blocks == stc.total_blocks);
        assert_true(st.sparsity == stc.sparsity && st.token_density == stc.token_density);
        assert_true(st.mean_row_mass == stc.mean_row_mass);
        assert_true(st.min_row_blocks == stc.min_row_blocks && st.max_row_blocks == stc.max_row_blocks);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                assert_true(hs[b * H + h] == (b == 1 || b == 3 ? hsc[(b / 2) * H + h] : 0.0));
        /* attention on both, then the gradients: the same values where both have them */
        float lse[H * TQ], lsec[H * TQ];
        assert_int_equal(sparge_attention_forward(dev, &x[0].t, &x[1].t, &x[2].t, m, NULL, &x[3].t, lse), SPARGE_OK);
        assert_int_equal(sparge_attention_forward(dev, &c[0].t, &c[1].t, &c[2].t, mc, NULL, &c[3].t, lsec), SPARGE_OK);
        double *o = tu_get(&x[3]), *oc = tu_get(&c[3]), lse_d[H * TQ], lsec_d[H * TQ];
        assert_true(check_rel_l2(o, oc, H * TQ * D) <= 1e-6);
        for (int i = 0; i < H * TQ; i++)
            lse_d[i] = lse[i], lsec_d[i] = lsec[i];
        assert_true(check_rel_l2(lse_d, lsec_d, H * TQ) <= 1e-6);
        free(o), free(oc);
        for (int det = 0; det < 2; det++) {
            const sparge_attn_params ap = {0.0f, det, 1};
            for (int i = 5; i < 8; i++)
                tu_poison(&x[i]), tu_poison(&c[i]);
            assert_int_equal(sparge_attention_backward(dev, &x[0].t, &x[1].t, &x[2].t, &x[3].t, &x[4].t, lse, m, &ap,
                                                       &x[5].t, &x[6].t, &x[7].t), SPARGE_OK);
            assert_int_equal(sparge_attention_backward(dev, &c[0].t, &c[1].t, &c[2].t, &c[3].t, &c[4].t, lsec, mc, &ap,
                                                       &c[5].t, &c[6].t, &c[7].t), SPARGE_OK);
            double *dq = tu_get(&x[5]), *dqc = tu_get(&c[5]);
            assert_true(check_rel_l2(dq, dqc, H * TQ * D) <= 1e-6);
            free(dq), free(dqc);
            for (int i = 6; i < 8; i++) {
                double *g = tu_get(&x[i]), *gc = tu_get(&c[i]), *own = calloc(HK * TK * D, sizeof(double));
                copy_rows(own, TK, ck[1], gc, TKC, 0, ck[2] - ck[1], HK, D);
                copy_rows(own, TK, ck[3], gc, TKC, sk[1], ck[4] - ck[3], HK, D);
                /* the keys of sequences 0 and 2 (no query) are 0, not left poisoned (NaN) */
                if (!(check_rel_l2(g, own, HK * TK * D) <= 1e-6))
                    fail_msg("%s: %s of the batch with empty sequences (deterministic %d) differs", tiers[t],
                             i == 6 ? "dK" : "dV", det);
                for (int64_t e = 0; e < (int64_t)ck[1] * D; e++)
                    assert_true(g[e] == 0.0);
                free(g), free(gc), free(own);
            }
        }
        /* an import keeping a block in a row of sequence 2 (no query) is refused; the selection stays */
        uint8_t *bad = malloc((size_t)(B * H * row)), *held = malloc((size_t)(B * H * row));
        memcpy(bad, dense, (size_t)(B * H * row));
        bad[(2 * H + 1) * row] = 1;
        assert_int_equal(sparge_mask_set_dense(m, bad), SPARGE_ERR_INVALID);
        if (!strstr(sparge_last_error(), "past its sequence's query blocks"))
            fail_msg("%s: the refused import does not say why: %s", tiers[t], sparge_last_error());
        assert_int_equal(sparge_mask_get_dense(m, held), SPARGE_OK);
        assert_memory_equal(held, dense, (size_t)(B * H * row));
        /* the export names the offsets, and a mask of that layout takes its bytes back */
        char text[1024];
        export_mask(m, D, text, sizeof text, bad, (size_t)(B * H * row));
        if (!strstr(text, "\"cu_seqlens_q\": [0, 0, 30, 30, 70, 70],") ||
            !strstr(text, "\"cu_seqlens_k\": [0, 20, 60, 65, 110, 110],"))
            fail_msg("%s: the export does not name the offsets: %s", tiers[t], text);
        sparge_mask *back;
        assert_int_equal(sparge_mask_create_ex(dev, &l, &back), SPARGE_OK);
        assert_int_equal(sparge_mask_set_dense(back, bad), SPARGE_OK);
        assert_int_equal(sparge_mask_get_dense(back, held), SPARGE_OK);
        assert_memory_equal(held, dense, (size_t)(B * H * row));
        sparge_mask_destroy(back);
        free(bad), free(held), free(dense), free(dc), free(zero);
        sparge_mask_destroy(m);
        sparge_mask_destroy(mc);
        for (int i = 0; i < 8; i++)
            tu_free(&x[i]), tu_free(&c[i]);
        sparge_device_close(dev);
    }
}

/* sparge_attention with a causal varlen mask of its own blocks and params whose blocks are 0 (the mask's, as for
 * sparge_mask_predict), or no params, predicts and attends as sparge_mask_predict then sparge_attention_forward do
 * with those blocks; a refusal of
 * the temporary mask and an export of an empty mask name the call that was made and write nothing. */
static void test_attention_given_mask(void **state)
{
    (void)state;
    enum { H = 4, HK = 2, D = 16 };
    sparge_device *dev;
    assert_int_equal(sparge_device_open("cpu", &dev), SPARGE_OK);
    const int32_t cq[4] = {0, 1, 70, 100}, ck[4] = {0, 9, 90, 130};
    const sparge_mask_layout l = {.B = 3, .H = H, .Nq = 100, .Nk = 130, .block_q = 32, .block_k = 16, .causal = 1,
                                  .cu_seqlens_q = cq, .cu_seqlens_k = ck};
    tu_rng g = {41};
    tu_tensor q = tu_alloc(dev, SPARGE_F32, TU_BNHD, 1, H, 100, D), k = tu_alloc(dev, SPARGE_F32, TU_BNHD, 1, HK, 130, D),
              v = tu_alloc(dev, SPARGE_F32, TU_BNHD, 1, HK, 130, D), o = tu_alloc(dev, SPARGE_F32, TU_BNHD, 1, H, 100, D),
              o2 = tu_alloc(dev, SPARGE_F32, TU_BNHD, 1, H, 100, D);
    tu_fill_normal(&q, &g, 1.0);
    tu_fill_normal(&k, &g, 1.0);
    tu_fill_normal(&v, &g, 1.0);
    float lse[H * 100], lse2[H * 100];
    sparge_mask *m, *m2;
    assert_int_equal(sparge_mask_create_ex(dev, &l, &m), SPARGE_OK);
    assert_int_equal(sparge_mask_create_ex(dev, &l, &m2), SPARGE_OK);
    const sparge_mask_params own = {0, 0, 0.2, 0.4, 0.0f, 1}, explicit = {32, 16, 0.2, 0.4, 0.0f, 1};
    if (sparge_attention(dev, &q.t, &k.t, &v.t, &own, &o.t, lse, m) != SPARGE_OK)
        fail_msg("sparge_attention with the mask's blocks: %s", sparge_last_error());
    assert_int_equal(sparge_mask_predict(dev, &q.t, &k.t, &explicit, m2), SPARGE_OK);
    assert_int_equal(sparge_attention_forward(dev, &q.t, &k.t, &v.t, m2, NULL, &o2.t, lse2), SPARGE_OK);
    uint8_t d1[3 * H * 3 * 6], d2[sizeof d1];
    assert_int_equal(sparge_mask_get_dense(m, d1), SPARGE_OK);
    assert_int_equal(sparge_mask_get_dense(m2, d2), SPARGE_OK);
    assert_memory_equal(d1, d2, sizeof d1);
    double *od = tu_get(&o), *o2d = tu_get(&o2);
    assert_memory_equal(od, o2d, sizeof(double) * (size_t)tu_numel(&o));
    free(od);
    free(o2d);
    assert_memory_equal(lse, lse2, sizeof lse);
    /* Without params: the defaults (k = 0.03, p = 0.2) on the mask's own blocks, as with blocks of 0. */
    const sparge_mask_params paper = {0, 0, 0.03, 0.2, 0.0f, 0};
    assert_int_equal(sparge_attention(dev, &q.t, &k.t, &v.t, NULL, &o.t, lse, m), SPARGE_OK);
    assert_int_equal(sparge_attention(dev, &q.t, &k.t, &v.t, &paper, &o2.t, lse2, m2), SPARGE_OK);
    assert_int_equal(sparge_mask_get_dense(m, d1), SPARGE_OK);
    assert_int_equal(sparge_mask_get_dense(m2, d2), SPARGE_OK);
    assert_memory_equal(d1, d2, sizeof d1);
    /* The temporary mask of a causal call with Nq > Nk: refused as sparge_attention's, o and lse untouched. */
    tu_tensor kshort = tu_alloc(dev, SPARGE_F32, TU_BNHD, 1, HK, 60, D), vshort = tu_alloc(dev, SPARGE_F32, TU_BNHD, 1, HK, 60, D);
    tu_fill_normal(&kshort, &g, 1.0);
    tu_fill_normal(&vshort, &g, 1.0);
    tu_poison(&o);
    memset(lse, 0xff, sizeof lse);
    const sparge_mask_params causal = {0, 0, 0.2, 0.4, 0.0f, 1};
    assert_int_equal(sparge_attention(dev, &q.t, &kshort.t, &vshort.t, &causal, &o.t, lse, NULL), SPARGE_ERR_SHAPE);
    if (!strstr(sparge_last_error(), "sparge_attention: "))
        fail_msg("the refusal does not name sparge_attention: %s", sparge_last_error());
    assert_true(tu_still_poisoned(&o));
    for (size_t i = 0; i < sizeof lse; i++)
        assert_int_equal(((unsigned char *)lse)[i], 0xff);
    /* An export of a mask that holds no selection. */
    sparge_mask *empty;
    assert_int_equal(sparge_mask_create_ex(dev, &l, &empty), SPARGE_OK);
    assert_int_equal(sparge_mask_export(empty, "/nonexistent-dir/mask", D, SPARGE_F32), SPARGE_ERR_MASK);
    if (!strstr(sparge_last_error(), "sparge_mask_export: "))
        fail_msg("the refusal does not name sparge_mask_export: %s", sparge_last_error());
    sparge_mask_destroy(empty);
    /* An export whose PREFIX.json cannot be written (a directory there) leaves an earlier PREFIX.u8 as it was and
     * no temporary file. */
    char dir[] = "/tmp/sparge-export-XXXXXX", pfx[64], path[80];
    assert_non_null(mkdtemp(dir));
    snprintf(pfx, sizeof pfx, "%s/m", dir);
    snprintf(path, sizeof path, "%s.json", pfx);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s.u8", pfx);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("earlier", f);
    fclose(f);
    assert_int_equal(sparge_mask_export(m, pfx, D, SPARGE_F32), SPARGE_ERR_INVALID);
    char earlier[16] = "";
    f = fopen(path, "r");
    assert_non_null(f);
    assert_non_null(fgets(earlier, sizeof earlier, f));
    fclose(f);
    assert_string_equal(earlier, "earlier");
    snprintf(path, sizeof path, "%s.u8.part", pfx);
    assert_int_not_equal(access(path, F_OK), 0);
    snprintf(path, sizeof path, "%s.json.part", pfx);
    assert_int_not_equal(access(path, F_OK), 0);
    snprintf(path, sizeof path, "%s.u8", pfx);
    remove(path);
    snprintf(path, sizeof path, "%s.json", pfx);
    rmdir(path);
    rmdir(dir);
    sparge_mask_destroy(m);
    sparge_mask_destroy(m2);
    tu_free(&q), tu_free(&k), tu_free(&v), tu_free(&o), tu_free(&o2), tu_free(&kshort), tu_free(&vshort);
    sparge_device_close(dev);
}

/* A varlen mask's export states its sequences' offsets, from which a mask of the same layout is created and takes
 * the exported bytes back; a mask of other offsets refuses them and keeps its own selection. */
static void test_export_varlen(void **state)
{
    (void)state;
    enum { H = 2, D = 8 };
    const int32_t cq[4] = {0, 30, 31, 70}, ck[4] = {0, 50, 51, 90}, other[4] = {0, 40, 41, 70};
    const sparge_mask_layout l = {.B = 3, .H = H, .Nq = 70, .Nk = 90, .block_q = 16, .block_k = 8, .causal = 1,
                                  .cu_seqlens_q = cq, .cu_seqlens_k = ck};
    tu_rng g = {43};
    tu_tensor q = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, H, 70, D), k = tu_alloc(ref, SPARGE_F32, TU_BHND, 1, 1, 90, D);
    tu_fill_normal(&q, &g, 1.0);
    tu_fill_normal(&k, &g, 1.0);
    sparge_mask *m;
    assert_int_equal(sparge_mask_create_ex(ref, &l, &m), SPARGE_OK);
    const sparge_mask_params mp = {0, 0, 0.3, 0.3, 0.0f, 1};
    assert_int_equal(sparge_mask_predict(ref, &q.t, &k.t, &mp, m), SPARGE_OK);
    char text[1024];
    uint8_t bytes[3 * H * 3 * 7], held[sizeof bytes], back[sizeof bytes];
    export_mask(m, D, text, sizeof text, bytes, sizeof bytes);
    static const char *const want[] = {"\"B\": 3,", "\"Nqb\": 3,", "\"Nkb\": 7,", "\"causal\": true,",
                                       "\"varlen\": true,", "\"cu_seqlens_q\": [0, 30, 31, 70],",
                                       "\"cu_seqlens_k\": [0, 50, 51, 90],"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(text, want[i]))
            fail_msg("export JSON lacks %s: %s", want[i], text);
    assert_int_equal(sparge_mask_get_dense(m, held), SPARGE_OK);
    assert_memory_equal(bytes, held, sizeof bytes);
    sparge_mask *same, *shifted;
    assert_int_equal(sparge_mask_create_ex(ref, &l, &same), SPARGE_OK);
    assert_int_equal(sparge_mask_set_dense(same, bytes), SPARGE_OK);
    assert_int_equal(sparge_mask_get_dense(same, back), SPARGE_OK);
    assert_memory_equal(back, bytes, sizeof bytes);
    sparge_mask_layout lo = l;
    lo.cu_seqlens_q = other;
    assert_int_equal(sparge_mask_create_ex(ref, &lo, &shifted), SPARGE_OK);
    assert_int_equal(sparge_mask_predict(ref, &q.t, &k.t, &mp, shifted), SPARGE_OK);
    assert_int_equal(sparge_mask_get_dense(shifted, held), SPARGE_OK);
    assert_int_equal(sparge_mask_set_dense(shifted, bytes), SPARGE_ERR_INVALID);
    assert_int_equal(sparge_mask_get_dense(shifted, back), SPARGE_OK);
    assert_memory_equal(back, held, sizeof back);
    sparge_mask_destroy(m);
    sparge_mask_destroy(same);
    sparge_mask_destroy(shifted);
    tu_free(&q), tu_free(&k);
}

int main(void)
{
    if (sparge_device_open("cpu-ref", &ref) != SPARGE_OK)
        return 1;
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_reference_definitions), cmocka_unit_test(test_bad_layouts),
                                       cmocka_unit_test(test_predict_after_kv_heads_change),
                                       cmocka_unit_test(test_layout_refusals_write_nothing),
                                       cmocka_unit_test(test_attention_given_mask), cmocka_unit_test(test_export_varlen),
                                       cmocka_unit_test(test_empty_sequences),
                                       cmocka_unit_test(test_devices)};
    int rc = cmocka_run_group_tests_name("shapes", tests, NULL, NULL);
    sparge_device_close(ref);
    return rc;
}
