/* Tests of the experiment helpers (experiments/exp.h): the input generators'
 * statistics, the calibration to equal sparsity, the safetensors reader and
 * writer, the error decomposition the drivers report, the drivers' option
 * parser and input loop, the statistics, and the exp_stats and exp_discrim
 * drivers (run from the build directory, as make check does). */
#define _POSIX_C_SOURCE 200809L /* popen, mkdir */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "exp.h"

static exp_gen_params small(exp_family f)
{
    exp_gen_params p;
    exp_gen_defaults(f, &p);
    p.H = 2;
    p.N = 2048; /* Nqb = 16, Nkb = 32 */
    p.D = 32;
    p.seed = 7;
    return p;
}

static double *pooled(const exp_qkv *x, const exp_gen_params *p)
{
    int64_t nqb = (x->N + p->block_q - 1) / p->block_q, nkb = (x->N + p->block_k - 1) / p->block_k;
    double *map = malloc(sizeof(double) * (size_t)(x->B * x->H * nqb * nkb));
    assert_non_null(map);
    exp_pooled_map_host(x, p->block_q, p->block_k, 0.0, map);
    return map;
}

static double row_entropy(const double *row, int64_t n)
{
    double h = 0.0;
    for (int64_t j = 0; j < n; j++)
        h -= row[j] > 0.0 ? row[j] * log(row[j]) : 0.0;
    return h / log((double)n);
}

static void test_rng(void **state)
{
    (void)state;
    exp_rng a, b, c;
    exp_rng_seed(&a, 42);
    exp_rng_seed(&b, 42);
    exp_rng_seed(&c, 43);
    int differ = 0;
    for (int i = 0; i < 100; i++) {
        uint64_t x = exp_rng_next(&a);
        assert_true(x == exp_rng_next(&b));
        differ |= x != exp_rng_next(&c);
    }
    assert_true(differ);
    double s = 0.0, s2 = 0.0;
    const int n = 200000;
    for (int i = 0; i < n; i++) {
        double z = exp_rng_normal(&a);
        s += z;
        s2 += z * z;
    }
    assert_true(fabs(s / n) < 0.01);
    assert_true(fabs(s2 / n - 1.0) < 0.02);
}

static void test_generators_seeded(void **state)
{
    (void)state;
    for (int f = EXP_UNIFORM; f <= EXP_VIDEO; f++) {
        exp_gen_params p = small((exp_family)f);
        if (f == EXP_VIDEO) {
            p.grid_t = 2;
            p.grid_h = 8;
            p.grid_w = 16;
        }
        exp_qkv a, b;
        assert_int_equal(exp_generate(&p, &a), 0);
        assert_int_equal(exp_generate(&p, &b), 0);
        size_t n = (size_t)(a.B * a.H * a.N * a.D);
        assert_memory_equal(a.q, b.q, n * sizeof(float));
        assert_memory_equal(a.k, b.k, n * sizeof(float));
        assert_memory_equal(a.v, b.v, n * sizeof(float));
        exp_qkv_free(&b);
        p.seed++;
        assert_int_equal(exp_generate(&p, &b), 0);
        assert_true(memcmp(a.q, b.q, n * sizeof(float)) != 0);
        exp_qkv_free(&a);
        exp_qkv_free(&b);
    }
}

/* Every sink row carries exactly the requested pooled mass — in the host map
 * and in the map the library predicts from the same Q and K. */
static void check_sinks(int sink_blocks)
{
    exp_gen_params p = small(EXP_SINK);
    p.sink_blocks = sink_blocks;
    exp_qkv x;
    assert_int_equal(exp_generate(&p, &x), 0);
    assert_non_null(x.sink_share);
    assert_int_equal(x.sink_blocks, sink_blocks);
    double *map = pooled(&x, &p);
    int64_t nqb = 16, nkb = 32, rows = x.B * x.H * nqb;
    double lo = 1.0, hi = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        double share = 0.0;
        for (int s = 0; s < x.sink_blocks; s++)
            share += map[r * nkb + x.sink_index[s]];
        assert_true(fabs(share - x.sink_share[r]) < 1e-6);
        assert_true(x.sink_share[r] >= p.sink_mass_min && x.sink_share[r] <= p.sink_mass_max);
        lo = fmin(lo, x.sink_share[r]);
        hi = fmax(hi, x.sink_share[r]);
    }
    assert_true(hi - lo > 0.2); /* shares really are spread over the requested range */

    sparge_device *dev;
    sparge_mask *mask;
    assert_int_equal(sparge_device_open("cpu", &dev), SPARGE_OK);
    assert_int_equal(sparge_mask_create(dev, x.B, x.H, x.N, x.N, p.block_q, p.block_k, &mask), SPARGE_OK);
    sparge_tensor q = sparge_tensor_bhnd(x.q, SPARGE_F32, x.B, x.H, x.N, x.D), k = q;
    k.data = x.k;
    sparge_mask_params mp = sparge_mask_params_default();
    assert_int_equal(sparge_mask_predict(dev, &q, &k, &mp, mask), SPARGE_OK);
    float *lib = malloc(sizeof(float) * (size_t)(rows * nkb));
    assert_non_null(lib);
    assert_int_equal(sparge_mask_get_pooled_map(mask, lib), SPARGE_OK);
    for (int64_t r = 0; r < rows; r++) {
        double share = 0.0;
        for (int s = 0; s < x.sink_blocks; s++)
            share += lib[r * nkb + x.sink_index[s]];
        assert_true(fabs(share - x.sink_share[r]) < 1e-4);
    }
    exp_map_summary sum;
    exp_map_summarize(&x, map, p.block_q, p.block_k, 0, 0, 0, &sum);
    assert_true(sum.sink_err_max < 1e-6);
    free(lib);
    free(map);
    sparge_mask_destroy(mask);
    sparge_device_close(dev);
    exp_qkv_free(&x);
}

static void test_sink_mass_one(void **state)
{
    (void)state;
    check_sinks(1);
}

static void test_sink_mass_several(void **state)
{
    (void)state;
    check_sinks(3);
}

/* Near-uniform rows are flat; the uniform family's hub rows put the requested
 * mass on the hub, and the rest of the matrix stays flat. */
static void test_uniform_flat(void **state)
{
    (void)state;
    exp_gen_params p = small(EXP_UNIFORM);
    exp_qkv x;
    assert_int_equal(exp_generate(&p, &x), 0);
    double *map = pooled(&x, &p);
    int64_t nkb = 32, rows = x.B * x.H * 16, hubs = 0;
    for (int64_t r = 0; r < rows; r++) {
        const double *row = map + r * nkb;
        if (x.sink_share[r] >= 0.0) {
            hubs++;
            assert_true(fabs(row[x.sink_index[0]] - 0.95) < 1e-6);
            continue;
        }
        double mx = 0.0, mn = 1.0;
        for (int64_t j = 0; j < nkb; j++) {
            mx = fmax(mx, row[j]);
            mn = fmin(mn, row[j]);
        }
        /* pooled logits with std <= 0.5: normalized entropy ≈ 1 − 0.5²/(2 ln 32) ≈ 0.96 */
        assert_true(row_entropy(row, nkb) > 0.95);
        assert_true(mx / mn < 20.0);
        assert_true(mx < 4.0 / nkb);
    }
    assert_true(hubs > 0 && hubs < rows);
    free(map);
    exp_qkv_free(&x);

    /* without hub rows every row is flat */
    p.sink_rows = 0.0;
    assert_int_equal(exp_generate(&p, &x), 0);
    map = pooled(&x, &p);
    exp_map_summary s;
    exp_map_summarize(&x, map, p.block_q, p.block_k, 0, 0, 0, &s);
    assert_true(s.entropy_min > 0.95);
    assert_true(s.top1_mean < 2.5 / nkb);
    free(map);
    exp_qkv_free(&x);
}

/* Video tokens in raster order: attention mass concentrates on blocks near the
 * query block in (frame, row, column), and neighbours' keys are more alike
 * than distant ones. */
static void test_video_locality(void **state)
{
    (void)state;
    exp_gen_params p = small(EXP_VIDEO);
    p.grid_t = 4;
    p.grid_h = 12;
    p.grid_w = 20;
    exp_qkv x;
    assert_int_equal(exp_generate(&p, &x), 0);
    assert_int_equal(x.N, 4 * 12 * 20);
    double *map = pooled(&x, &p);
    exp_map_summary s;
    exp_map_summarize(&x, map, p.block_q, p.block_k, p.grid_t, p.grid_h, p.grid_w, &s);
    assert_true(s.locality < 0.85);
    /* token level: cosine of k_t with its right neighbour vs with a token two frames away */
    double near = 0.0, far = 0.0;
    int64_t hw = 12 * 20, cnt = 0, D = x.D;
    for (int64_t t = 0; t + 2 * hw < x.N; t += 7) {
        if ((t + 1) % 20 == 0)
            continue;
        const float *a = x.k + t * D, *b = x.k + (t + 1) * D, *c = x.k + (t + 2 * hw + (hw / 2)) % x.N * D;
        double ab = 0, ac = 0, aa = 0, bb = 0, cc = 0;
        for (int64_t d = 0; d < D; d++) {
            ab += a[d] * b[d];
            ac += a[d] * c[d];
            aa += a[d] * a[d];
            bb += b[d] * b[d];
            cc += c[d] * c[d];
        }
        near += ab / sqrt(aa * bb);
        far += ac / sqrt(aa * cc);
        cnt++;
    }
    assert_true(near / cnt > far / cnt + 0.3);
    free(map);
    exp_qkv_free(&x);
}

/* Top-p and hybrid calibrated to Top-k's kept count hit it (up to one step of
 * the achieved-sparsity staircase), on each family. */
static void test_calibration(void **state)
{
    (void)state;
    for (int f = EXP_UNIFORM; f <= EXP_SINK; f++) {
        exp_gen_params p = small((exp_family)f);
        exp_qkv x;
        assert_int_equal(exp_generate(&p, &x), 0);
        exp_session s;
        assert_int_equal(exp_session_open(&s, "cpu", NULL, &x, SPARGE_F32, p.block_q, p.block_k), 0);
        assert_int_equal(s.rows, 32);
        for (int64_t n = 1; n <= 8; n *= 2) {
            exp_rule rules[EXP_RULES];
            double k = (double)n / (double)s.Nkb;
            assert_int_equal(exp_equal_sparsity_rules(&s, k, 0.6 * k, rules), 0);
            int64_t target = s.rows * n;
            assert_int_equal(exp_select(&s, rules[EXP_TOPK].k, rules[EXP_TOPK].p), target);
            for (int r = EXP_TOPP; r <= EXP_HYBRID; r++) {
                int64_t kept = exp_select(&s, rules[r].k, rules[r].p);
                assert_true(llabs(kept - target) <= 2);
                /* the step on the other side of the chosen p is no closer */
                double eps = 1e-9;
                if (rules[r].p - eps > 0.0) {
                    int64_t below = exp_select(&s, rules[r].k, rules[r].p - eps);
                    assert_true(llabs(kept - target) <= llabs(below - target));
                }
                int64_t above = exp_select(&s, rules[r].k, fmin(rules[r].p + eps, 1.0));
                assert_true(llabs(kept - target) <= llabs(above - target));
            }
            exp_point pt;
            assert_int_equal(exp_measure(&s, rules[EXP_TOPP].k, rules[EXP_TOPP].p, &pt), 0);
            assert_true(pt.rel_l1 > 0.0 && pt.rel_l1 < 2.0);
        }
        /* an unreachable target ends at p = 1 */
        double pmax;
        assert_int_equal(exp_calibrate_p(&s, 0.0, s.rows * s.Nkb + 1, &pmax), s.rows * s.Nkb);
        assert_true(pmax == 1.0);
        exp_session_close(&s);
        exp_qkv_free(&x);
    }
}

/* O − O_s = (1 − α)(μ_dropped − μ_kept) on sampled tokens of a sink input. */
static void test_decomposition(void **state)
{
    (void)state;
    exp_gen_params p = small(EXP_SINK);
    exp_qkv x;
    assert_int_equal(exp_generate(&p, &x), 0);
    exp_session s;
    assert_int_equal(exp_session_open(&s, "cpu", NULL, &x, SPARGE_F32, p.block_q, p.block_k), 0);
    assert_true(exp_select(&s, 0.0, 0.4) > 0);
    assert_int_equal(exp_sparse_forward(&s), 0);
    uint8_t *dense = malloc((size_t)(s.rows * s.Nkb));
    assert_non_null(dense);
    assert_int_equal(sparge_mask_get_dense(s.mask, dense), SPARGE_OK);
    int64_t N = x.N, D = x.D;
    double *pr = malloc(sizeof(double) * (size_t)N), scale = 1.0 / sqrt((double)D);
    assert_non_null(pr);
    for (int64_t t = 5; t < N; t += 301) {
        double mx = -INFINITY, z = 0.0, alpha = 0.0;
        for (int64_t u = 0; u < N; u++) {
            double dot = 0.0;
            for (int64_t d = 0; d < D; d++)
                dot += (double)x.q[t * D + d] * x.k[u * D + d];
            pr[u] = dot * scale;
            mx = fmax(mx, pr[u]);
        }
        for (int64_t u = 0; u < N; u++)
            z += (pr[u] = exp(pr[u] - mx));
        const uint8_t *keep = dense + (t / p.block_q) * s.Nkb;
        for (int64_t u = 0; u < N; u++)
            alpha += keep[u / p.block_k] ? pr[u] / z : 0.0;
        double err = 0.0, num = 0.0;
        for (int64_t d = 0; d < D; d++) {
            double mk = 0.0, md = 0.0;
            for (int64_t u = 0; u < N; u++)
                *(keep[u / p.block_k] ? &mk : &md) += pr[u] / z * x.v[u * D + d];
            double pred = (1.0 - alpha) * (md / (1.0 - alpha) - mk / alpha);
            double meas = (double)s.o_ref[t * D + d] - (double)s.o_sparse[t * D + d];
            err += fabs(meas - pred);
            num += fabs(meas);
        }
        assert_true(alpha > 0.0 && alpha < 1.0);
        assert_true(err <= 1e-4 * num + 1e-6);
    }
    free(pr);
    free(dense);
    exp_session_close(&s);
    exp_qkv_free(&x);
}

static char *tmp_path(const char *tag)
{
    static char path[256];
    snprintf(path, sizeof path, "%s/sparge-exp-%ld-%s.safetensors", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (long)getpid(), tag);
    return path;
}

static void test_safetensors_roundtrip(void **state)
{
    (void)state;
    float a[2 * 3 * 4], b[5];
    for (int i = 0; i < 24; i++)
        a[i] = (float)(i - 11) * 0.37f;
    for (int i = 0; i < 5; i++)
        b[i] = 1000.0f + (float)i;
    const char *names[2] = {"alpha", "beta"};
    const float *data[2] = {a, b};
    int nd[2] = {3, 1};
    int64_t shapes[2][8] = {{2, 3, 4}, {5}};
    sparge_dtype types[3] = {SPARGE_F32, SPARGE_F16, SPARGE_BF16};
    for (int ti = 0; ti < 3; ti++) {
        char err[640], *path = tmp_path("rt");
        assert_int_equal(exp_st_write(path, 2, names, data, nd, (const int64_t(*)[8])shapes, types[ti],
                                      "{\"layout\":\"BHND\"}", err, sizeof err),
                         0);
        exp_st_file f;
        assert_int_equal(exp_st_open(path, &f, err, sizeof err), 0);
        assert_int_equal(f.count, 2);
        const exp_st_tensor *t = exp_st_find(&f, "alpha");
        assert_non_null(t);
        assert_int_equal(t->ndim, 3);
        assert_int_equal(t->shape[2], 4);
        float *ra = exp_st_read_f32(&f, t, err, sizeof err);
        float *rb = exp_st_read_f32(&f, exp_st_find(&f, "beta"), err, sizeof err);
        assert_non_null(ra);
        assert_non_null(rb);
        double tol = types[ti] == SPARGE_F32 ? 0.0 : types[ti] == SPARGE_F16 ? 1e-3 : 8e-3;
        for (int i = 0; i < 24; i++)
            assert_true(fabs(ra[i] - a[i]) <= tol * fabs(a[i]));
        for (int i = 0; i < 5; i++)
            assert_true(fabs(rb[i] - b[i]) <= tol * fabs(b[i]));
        free(ra);
        free(rb);
        exp_st_close(&f);
        unlink(path);
    }
}

/* A write that fails part-way (here at a file-size limit) leaves the file that was at the path and no partial file; a
 * directory that does not exist is refused with the reason. */
static void test_safetensors_write_fails(void **state)
{
    (void)state;
    static float big[64 * 1024];
    float small[3] = {1.0f, 2.0f, 3.0f};
    const char *names[1] = {"x"};
    int nd[1] = {1};
    int64_t shape_small[1][8] = {{3}}, shape_big[1][8] = {{64 * 1024}};
    char err[640], *path = tmp_path("fail"), part[300];
    snprintf(part, sizeof part, "%s.part%ld", path, (long)getpid());
    const float *data_small[1] = {small}, *data_big[1] = {big};
    assert_int_equal(exp_st_write(path, 1, names, data_small, nd, (const int64_t(*)[8])shape_small, SPARGE_F32, NULL,
                                  err, sizeof err),
                     0);
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 16384;
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = exp_st_write(path, 1, names, data_big, nd, (const int64_t(*)[8])shape_big, SPARGE_F32, NULL, err,
                          sizeof err);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, old_handler);
    assert_int_equal(rc, -1);
    assert_non_null(strstr(err, "write failed"));
    assert_int_equal(access(part, F_OK), -1);
    exp_st_file f;
    assert_int_equal(exp_st_open(path, &f, err, sizeof err), 0);
    assert_int_equal(f.count, 1);
    assert_int_equal(exp_st_find(&f, "x")->shape[0], 3);
    exp_st_close(&f);
    unlink(path);
    assert_int_equal(exp_st_write("/nonexistent-dir/x.safetensors", 1, names, data_small, nd,
                                  (const int64_t(*)[8])shape_small, SPARGE_F32, NULL, err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "No such file or directory"));
}

/* A file laid out by hand (not by our writer): metadata, odd key order and
 * whitespace, BF16 data; then malformed files are refused with a message. */
static void test_safetensors_handmade(void **state)
{
    (void)state;
    const char *hdr = "{ \"__metadata__\" : {\"format\": \"pt\", \"nested\": {\"a\": [1, 2.5e3, null, true]}},\n"
                      "  \"x\" : { \"shape\" : [2, 1], \"data_offsets\" : [0, 4], \"dtype\" : \"BF16\" } }  ";
    uint64_t hlen = strlen(hdr);
    uint16_t data[2] = {0x3f80, 0xc040}; /* 1.0, -3.0 in bf16 */
    char *path = tmp_path("hand"), err[640];
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    for (int i = 0; i < 8; i++)
        fputc((int)((hlen >> (8 * i)) & 0xff), fp);
    fwrite(hdr, 1, hlen, fp);
    fwrite(data, 2, 2, fp);
    fclose(fp);
    exp_st_file f;
    assert_int_equal(exp_st_open(path, &f, err, sizeof err), 0);
    assert_int_equal(f.count, 1);
    char value[16];
    assert_int_equal(exp_st_metadata(&f, "format", value, sizeof value), 0);
    assert_string_equal(value, "pt");
    assert_int_equal(exp_st_metadata(&f, "nested", value, sizeof value), -1); /* not a string */
    assert_int_equal(exp_st_metadata(&f, "absent", value, sizeof value), -1);
    float *x = exp_st_read_f32(&f, &f.tensors[0], err, sizeof err);
    assert_non_null(x);
    assert_true(x[0] == 1.0f && x[1] == -3.0f);
    free(x);
    exp_st_close(&f);

    /* the declared data runs past the end of the file */
    const char *bad[] = {"{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
                         "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,4]}}",
                         "{\"x\":{\"dtype\":\"F32\",\"shape\":[1]}}", "{\"x\":",
                         /* a negative dimension; a shape whose element count wraps to 0 in 64 bits; a number past
                          * int64; a header ending inside a number */
                         "{\"x\":{\"dtype\":\"F32\",\"shape\":[-1,-1],\"data_offsets\":[0,4]}}",
                         "{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,0]}}",
                         "{\"x\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999999],\"data_offsets\":[0,4]}}",
                         "{\"x\":{\"dtype\":\"F32\",\"shape\":[1"};
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        hlen = strlen(bad[b]);
        fp = fopen(path, "wb");
        assert_non_null(fp);
        for (int i = 0; i < 8; i++)
            fputc((int)((hlen >> (8 * i)) & 0xff), fp);
        fwrite(bad[b], 1, hlen, fp);
        fwrite(data, 2, 2, fp);
        fclose(fp);
        err[0] = 0;
        assert_int_equal(exp_st_open(path, &f, err, sizeof err), -1);
        assert_true(strlen(err) > 0);
    }
    unlink(path);
}

/* Q/K/V saved by the writer come back through exp_load_qkv in both layouts. */
static void test_load_qkv(void **state)
{
    (void)state;
    exp_gen_params p = small(EXP_UNIFORM);
    p.N = 300;
    exp_qkv x, y;
    assert_int_equal(exp_generate(&p, &x), 0);
    char err[640], *path = tmp_path("qkv");
    const char *names[3] = {"query", "key", "value"};
    int nd[3] = {4, 4, 4};
    /* BNHD copy of x */
    size_t n = (size_t)(x.B * x.H * x.N * x.D);
    float *bnhd[3];
    const float *src[3] = {x.q, x.k, x.v};
    for (int i = 0; i < 3; i++) {
        bnhd[i] = malloc(n * sizeof(float));
        assert_non_null(bnhd[i]);
        for (int64_t h = 0; h < x.H; h++)
            for (int64_t t = 0; t < x.N; t++)
                memcpy(bnhd[i] + (t * x.H + h) * x.D, src[i] + (h * x.N + t) * x.D, (size_t)x.D * sizeof(float));
    }
    int64_t shapes[3][8] = {{1, x.N, x.H, x.D}, {1, x.N, x.H, x.D}, {1, x.N, x.H, x.D}};
    const float *data[3] = {bnhd[0], bnhd[1], bnhd[2]};
    assert_int_equal(
        exp_st_write(path, 3, names, data, nd, (const int64_t(*)[8])shapes, SPARGE_F32, NULL, err, sizeof err), 0);
    assert_int_equal(exp_load_qkv(path, names, 1, &y), 0);
    assert_int_equal(y.H, x.H);
    assert_int_equal(y.N, x.N);
    assert_memory_equal(y.q, x.q, n * sizeof(float));
    assert_memory_equal(y.v, x.v, n * sizeof(float));
    exp_qkv_free(&y);
    const char *wrong[3] = {"q", "k", "v"};
    assert_int_equal(exp_load_qkv(path, wrong, 0, &y), -1);
    for (int i = 0; i < 3; i++)
        free(bnhd[i]);
    unlink(path);
    exp_qkv_free(&x);
}

/* ---------------------------------------------------------------- the drivers' command line */

/* A driver with an option of every kind; reset() restores their defaults between tests. */
static int t_int, t_flag, t_choice, t_count;
static int64_t t_i64;
static double t_dbl, t_list[4];
static const char *t_str;
static FILE *t_out;

static const exp_opt test_own[] = {
    {EXP_INT("--int", &t_int, "N", -3, 3, "a small int")},
    {EXP_I64("--i64", &t_i64, "N", 0, 1e12, "a large int")},
    {EXP_DBL("--dbl", &t_dbl, "X", 0.0, 1.0, "a fraction above 0"), .excl = EXP_EXCL_MIN},
    {EXP_LIST("--list", t_list, 4, &t_count, "A,B,...", -1.0, 1.0, "up to four numbers"), .none = "none"},
    {EXP_CHOICE("--choice", &t_choice, "red|green|blue", "a colour")},
    {EXP_FLAG("--flag", &t_flag, "a flag")},
    {EXP_STR("--str", &t_str, "S", "a string")},
    {EXP_OUT("--out", &t_out, "an output with a header"), .header = "a,b\n"},
};

static const exp_driver test_driver = {"exp_test", "Option parser tests.", "--ref --csv", test_own,
                                       EXP_COUNT(test_own), "x,y\n", .equal = 1};

static void reset(exp_opts *o, const exp_driver *d)
{
    t_int = 1, t_flag = 0, t_choice = 2, t_count = 1;
    t_i64 = 5;
    t_dbl = 0.5;
    t_list[0] = 0.25;
    t_str = NULL;
    t_out = NULL;
    exp_opts_init(o, d);
}

/* exp_parse on a command line given as one string of words separated by single spaces. */
static int parse_line(exp_opts *o, const char *line, char *err, size_t err_len)
{
    static char buf[1024];
    char *argv[64] = {"exp_test"};
    int argc = 1;
    snprintf(buf, sizeof buf, "%s", line);
    for (char *w = strtok(buf, " "); w && argc < 63; w = strtok(NULL, " "))
        argv[argc++] = w;
    err[0] = 0;
    return exp_parse(o, argc, argv, err, err_len);
}

static void test_parse_values(void **state)
{
    (void)state;
    exp_opts o;
    char err[512];
    reset(&o, &test_driver);
    assert_int_equal(parse_line(&o, "--int -3 --i64 1e12 --dbl 1 --list -1,0.5,1 --choice green --flag --str hi "
                                    "--dtype bf16 --seed 7 --tokens 1000 --grid 2x3x4 --focus 0,0.5 --families video,sink "
                                    "--names a,b,c --layout bnhd --topk 0.1 --hybrid-k 0 --ref ignored",
                                err, sizeof err),
                     0);
    assert_int_equal(t_int, -3);
    assert_true(t_i64 == 1000000000000LL);
    assert_true(t_dbl == 1.0);
    assert_int_equal(t_count, 3);
    assert_true(t_list[0] == -1.0 && t_list[1] == 0.5 && t_list[2] == 1.0);
    assert_int_equal(t_choice, 1);
    assert_int_equal(t_flag, 1);
    assert_string_equal(t_str, "hi");
    assert_int_equal(o.dtype, SPARGE_BF16);
    assert_true(o.topk == 0.1 && o.hybrid_k == 0.0);
    assert_int_equal(o.bnhd, 1);
    assert_string_equal(o.names[0], "a");
    assert_string_equal(o.names[2], "c");
    assert_int_equal(o.nfamilies, 2);
    assert_int_equal(o.families[0], EXP_VIDEO);
    assert_int_equal(o.families[1], EXP_SINK);
    /* the knobs reach every family they apply to */
    for (int f = 0; f < 3; f++)
        assert_true(o.gen[f].seed == 7);
    assert_true(o.gen[EXP_UNIFORM].N == 1000 && o.gen[EXP_SINK].N == 1000 && o.gen[EXP_VIDEO].N == 24);
    assert_int_equal(o.gen[EXP_UNIFORM].sink_blocks, 0); /* no hub rows */
    assert_true(o.md == stdout);
    assert_null(t_out);

    /* a list may be emptied by its word; --input replaces the families whatever the order */
    reset(&o, &test_driver);
    assert_int_equal(parse_line(&o, "--input /dev/null --list none --families uniform", err, sizeof err), 0);
    assert_int_equal(t_count, 0);
    assert_int_equal(o.nfamilies, 1);
    assert_int_equal(o.families[0], EXP_FILE);

    /* nothing given: the defaults, those of the generators included */
    reset(&o, &test_driver);
    assert_int_equal(parse_line(&o, "", err, sizeof err), 0);
    exp_gen_params g;
    for (int f = 0; f < 3; f++) {
        exp_gen_defaults((exp_family)f, &g);
        assert_memory_equal(&g, &o.gen[f], sizeof g);
    }
    assert_int_equal(t_int, 1);
    assert_int_equal(o.nfamilies, 3);
}

/* Every bad value is refused with a message that names its option; nothing is clamped. */
static void test_parse_refused(void **state)
{
    (void)state;
    static const char *const bad[][2] = {
        {"--tokens -5", "--tokens"},        {"--tokens 1e99", "--tokens"},    {"--seeds foo", "--seeds"},
        {"--seeds 0", "--seeds"},           {"--heads 2.5", "--heads"},       {"--int 4", "--int"},
        {"--int 0x", "--int"},              {"--i64 1e13", "--i64"},          {"--dbl 0", "--dbl"},
        {"--dbl nan", "--dbl"},             {"--dbl inf", "--dbl"},           {"--list 0.5,2", "--list"},
        {"--list 1,1,1,1,1", "--list"},     {"--list 1,,2", "--list"},        {"--value 1,2", "--value"},
        {"--choice purple", "--choice"},    {"--dtype f64", "--dtype"},       {"--grid 2x3", "--grid"},
        {"--grid 2x3x0", "--grid"},         {"--families uniform,x", "--families"}, {"--names a,b", "--names"},
        {"--tau 0.5,0.1", "--tau"},         {"--focus 0.5,1", "--focus"},     {"--sink-mass 0,0.5", "--sink-mass"},
        {"--topk 0", "--topk"},             {"--len-s 0", "--len-s"},         {"--bogus", "'--bogus'"},
        {"stray", "'stray'"},               {"--int 1 --tokens", "--tokens needs a value"},
        {"--input /nonexistent-dir/qkv.safetensors", "--input"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        exp_opts o;
        char err[512];
        reset(&o, &test_driver);
        assert_int_equal(parse_line(&o, bad[i][0], err, sizeof err), -1);
        if (!strstr(err, bad[i][1]) || !strstr(err, "exp_test"))
            fail_msg("'%s': message '%s' does not name %s", bad[i][0], err, bad[i][1]);
    }
    /* --topk and --hybrid-k belong to drivers that compare the rules at equal sparsity */
    exp_driver plain = test_driver;
    plain.equal = 0;
    exp_opts o;
    char err[512];
    reset(&o, &plain);
    assert_int_equal(parse_line(&o, "--topk 0.1", err, sizeof err), -1);
    assert_non_null(strstr(err, "unknown option '--topk'"));
    /* a driver of its own options takes only the outputs and --quiet of the common ones */
    exp_driver own = test_driver;
    own.own_only = 1;
    reset(&o, &own);
    assert_int_equal(parse_line(&o, "--int 2 --quiet --md /dev/null", err, sizeof err), 0);
    assert_true(o.quiet && t_int == 2);
    assert_int_equal(exp_close_outputs(&o, 1), 0);
    reset(&o, &own);
    assert_int_equal(parse_line(&o, "--tokens 5", err, sizeof err), -1);
    assert_non_null(strstr(err, "unknown option '--tokens'"));
}

/* --help stops at once: the defaults it shows are untouched by values before it. */
static void test_parse_help(void **state)
{
    (void)state;
    exp_opts o;
    char err[512];
    reset(&o, &test_driver);
    assert_int_equal(parse_line(&o, "--tokens 5 --int 3 --help --bogus", err, sizeof err), 1);
    assert_int_equal(t_int, 1);
    assert_true(o.knobs.tokens == 32768);
    reset(&o, &test_driver);
    assert_int_equal(parse_line(&o, "-h", err, sizeof err), 1);
}

/* The help lists every option, the driver's and the common ones, each with its default. */
static void test_usage(void **state)
{
    (void)state;
    exp_opts o;
    reset(&o, &test_driver);
    FILE *f = tmpfile();
    assert_non_null(f);
    exp_usage(f, &o);
    long len = ftell(f);
    char *text = calloc((size_t)len + 1, 1);
    assert_non_null(text);
    rewind(f);
    assert_int_equal(fread(text, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    static const char *const names[] = {
        "--int",      "--i64",       "--dbl",         "--list",      "--choice",  "--flag",   "--str",
        "--out",      "--backend",   "--ref",         "--dtype",     "--csv",     "--md",     "--seed",
        "--seeds",    "--quiet",     "--families",    "--heads",     "--dim",     "--tokens", "--grid",
        "--block-q",  "--block-k",   "--tau",         "--focus",     "--sink-mass", "--sink-blocks",
        "--sink-value", "--video-sinks", "--sharpness", "--len-seq", "--len-t",   "--len-s",  "--jitter",
        "--value",    "--input",     "--names",       "--layout",    "--topk",    "--hybrid-k"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char key[64];
        snprintf(key, sizeof key, "\n  %s ", names[i]);
        const char *at = strstr(text, key);
        if (!at)
            fail_msg("%s is not in the help", names[i]);
        const char *next = strstr(at + 1, "\n  --"), *def = strstr(at, "(default: ");
        if (!def || (next && def > next))
            fail_msg("%s has no default in the help", names[i]);
    }
    /* the defaults are the values */
    static const char *const shown[] = {"(default: 1)", "(default: 0.25)", "(default: blue)", "(default: off)",
                                        "(default: 32768)", "(default: 21x30x52)", "(default: 0.3,0.8)",
                                        "(default: q,k,v)", "(default: uniform,sink,video)", "(default: 0.05)"};
    for (size_t i = 0; i < sizeof shown / sizeof shown[0]; i++)
        if (!strstr(text, shown[i]))
            fail_msg("the help does not show %s", shown[i]);
    assert_non_null(strstr(text, "exp_test accepts but does not use --ref --csv"));
    free(text);
}

/* The first line of file path into got (empty when it cannot be read). */
static void first_line(const char *path, char *got, size_t len)
{
    got[0] = 0;
    FILE *f = fopen(path, "r");
    if (f) {
        if (!fgets(got, (int)len, f))
            got[0] = 0;
        fclose(f);
    }
}

/* Outputs open once the command line is good, with their header; an ignored one is not created. An output appears at
 * its path only when the run succeeds: a refused command line or a failed run leaves no file, and a file already there
 * stays as it was. */
static void test_parse_outputs(void **state)
{
    (void)state;
    exp_opts o;
    char err[512], line[1024], out[256], csv[256], got[16];
    snprintf(out, sizeof out, "%s", tmp_path("out"));
    snprintf(csv, sizeof csv, "%s", tmp_path("csv"));
    unlink(csv);
    reset(&o, &test_driver);
    snprintf(line, sizeof line, "--out %s --csv %s --int 9", out, csv);
    unlink(out);
    assert_int_equal(parse_line(&o, line, err, sizeof err), -1);
    assert_int_equal(access(out, F_OK), -1); /* refused before anything was created */
    reset(&o, &test_driver);
    snprintf(line, sizeof line, "--out %s --csv %s", out, csv);
    assert_int_equal(parse_line(&o, line, err, sizeof err), 0);
    assert_non_null(t_out);
    assert_null(o.csv);
    assert_int_equal(access(out, F_OK), -1); /* written beside its path until the run is over */
    fputs("1,2\n", t_out);
    assert_int_equal(exp_close_outputs(&o, 1), 0);
    assert_null(t_out);
    first_line(out, got, sizeof got);
    assert_string_equal(got, "a,b\n");
    assert_int_equal(access(csv, F_OK), -1);
    /* a failed run leaves the earlier file whole */
    reset(&o, &test_driver);
    snprintf(line, sizeof line, "--out %s", out);
    assert_int_equal(parse_line(&o, line, err, sizeof err), 0);
    fputs("partial", t_out);
    assert_int_equal(exp_close_outputs(&o, 0), 0);
    first_line(out, got, sizeof got);
    assert_string_equal(got, "a,b\n");
    unlink(out);
    reset(&o, &test_driver);
    assert_int_equal(parse_line(&o, "--out /nonexistent-dir/x.csv", err, sizeof err), -1);
    assert_non_null(strstr(err, "--out"));
    /* an output that cannot be opened takes back those opened before it */
    reset(&o, &test_driver);
    snprintf(line, sizeof line, "--out %s --md /nonexistent-dir/x.md", out);
    assert_int_equal(parse_line(&o, line, err, sizeof err), -1);
    assert_non_null(strstr(err, "--md"));
    assert_null(t_out);
    assert_int_equal(access(out, F_OK), -1);
    /* two outputs on one path */
    reset(&o, &test_driver);
    snprintf(line, sizeof line, "--out %s --md %s", out, out);
    assert_int_equal(parse_line(&o, line, err, sizeof err), -1);
    assert_non_null(strstr(err, "--out and --md name the same file"));
    assert_int_equal(access(out, F_OK), -1);
    /* a device that is not a regular file is written in place; a failed write fails the run */
    reset(&o, &test_driver);
    assert_int_equal(parse_line(&o, "--md /dev/full", err, sizeof err), 0);
    for (int i = 0; i < 10000; i++)
        fputs("a line of Markdown that the device has no room for\n", o.md);
    assert_int_equal(exp_close_outputs(&o, 1), -1);
}

/* exp_main's loop: every family times every seed, in order, with the session open and the rules at equal sparsity
 * computed; a driver that ignores --seeds sees one seed per family. */
static int seen[8][4], nseen;

static int record_input(exp_opts *o, exp_input *in)
{
    assert_true(nseen < 8);
    assert_true(in->s.rows > 0 && in->x.N == 256);
    assert_true(in->equal[EXP_HYBRID].k == o->hybrid_k && in->equal[EXP_TOPK].k > 0.0);
    seen[nseen][0] = in->fi;
    seen[nseen][1] = in->si;
    seen[nseen][2] = in->family;
    seen[nseen][3] = (int)in->g.seed;
    nseen++;
    return 0;
}

static int fail_third(exp_opts *o, exp_input *in)
{
    (void)o;
    (void)in;
    return ++nseen == 3 ? 7 : 0;
}

static void test_driver_loop(void **state)
{
    (void)state;
    char *argv[] = {"exp_test", "--quiet", "--tokens", "256", "--heads", "1", "--families", "sink,uniform",
                    "--seed", "4", "--seeds", "2"};
    int argc = (int)(sizeof argv / sizeof argv[0]);
    exp_driver d = {"exp_test", "Loop test.", NULL, NULL, 0, NULL, .equal = 1, .each = record_input};
    nseen = 0;
    assert_int_equal(exp_main(&d, argc, argv), 0);
    assert_int_equal(nseen, 4);
    static const int want[4][4] = {{0, 0, EXP_SINK, 4}, {0, 1, EXP_SINK, 5}, {1, 0, EXP_UNIFORM, 4},
                                   {1, 1, EXP_UNIFORM, 5}};
    assert_memory_equal(seen, want, sizeof want);
    d.ignores = "--seeds";
    nseen = 0;
    assert_int_equal(exp_main(&d, argc, argv), 0);
    assert_int_equal(nseen, 2);
    /* the first status other than 0 ends the loop and is the exit status */
    d.each = fail_third;
    d.ignores = NULL;
    nseen = 0;
    assert_int_equal(exp_main(&d, argc, argv), 7);
    assert_int_equal(nseen, 3);
    char *bad[] = {"exp_test", "--seeds", "-1"};
    assert_int_equal(exp_main(&d, 3, bad), 2);
    /* the failed run's --csv is not left behind */
    char csv[256];
    snprintf(csv, sizeof csv, "%s", tmp_path("loop"));
    unlink(csv);
    char *with_csv[] = {"exp_test", "--quiet", "--tokens", "256", "--heads", "1", "--families", "sink,uniform",
                        "--seeds", "2", "--csv", csv};
    nseen = 0;
    assert_int_equal(exp_main(&d, (int)(sizeof with_csv / sizeof with_csv[0]), with_csv), 7);
    assert_int_equal(access(csv, F_OK), -1);
    d.each = record_input;
    nseen = 0;
    assert_int_equal(exp_main(&d, (int)(sizeof with_csv / sizeof with_csv[0]), with_csv), 0);
    assert_int_equal(access(csv, F_OK), 0);
    unlink(csv);
}

/* Student's t and Welch's test against published values: t quantiles of tables, the incomplete beta's closed forms,
 * and a two-sample example worked by hand. */
static void test_statistics(void **state)
{
    (void)state;
    /* I_x(1, 1) = x; I_x(a, 1) = x^a; I_x(1, b) = 1 − (1 − x)^b */
    assert_true(fabs(exp_incomplete_beta(1, 1, 0.3) - 0.3) < 1e-12);
    assert_true(fabs(exp_incomplete_beta(2.5, 1, 0.4) - pow(0.4, 2.5)) < 1e-12);
    assert_true(fabs(exp_incomplete_beta(1, 3.5, 0.7) - (1 - pow(0.3, 3.5))) < 1e-12);
    /* two-sided p of t with 1 df is 1 − 2 atan(|t|)/π (Cauchy) */
    assert_true(fabs(exp_t_two_sided_p(1.7, 1) - (1 - 2 * atan(1.7) / 3.141592653589793)) < 1e-12);
    /* 97.5 % quantiles (tables): df 1 12.7062, 2 4.3027, 4 2.7764, 10 2.2281, 100 1.9840 */
    const double df[5] = {1, 2, 4, 10, 100}, q[5] = {12.7062, 4.3027, 2.7764, 2.2281, 1.9840};
    for (int i = 0; i < 5; i++)
        assert_true(fabs(exp_t_quantile(0.975, df[i]) - q[i]) < 5e-4);
    /* a = {1, 2, 3, 4}, b = {3, 5, 7}: means 2.5 and 5, variances 5/3 and 4; se² = 5/12 + 4/3 = 1.75,
     * t = −2.5/√1.75 = −1.8898, df = 1.75² / ((5/12)²/3 + (4/3)²/2) = 3.063 */
    const double a[4] = {1, 2, 3, 4}, b[3] = {3, 5, 7};
    exp_summary sa, sb;
    exp_summarize(a, 4, &sa);
    exp_summarize(b, 3, &sb);
    assert_true(fabs(sa.sd - sqrt(5.0 / 3)) < 1e-12 && sb.n == 3);
    exp_test t;
    exp_welch(&sa, &sb, 0.95, &t);
    assert_int_equal(t.kind, EXP_TEST_WELCH);
    assert_true(fabs(t.t + 2.5 / sqrt(1.75)) < 1e-9);
    assert_true(fabs(t.df - 1.75 * 1.75 / (25.0 / 144 / 3 + 16.0 / 9 / 2)) < 1e-9);
    assert_true(t.p > 0.1 && t.p < 0.2 && t.lo < t.diff && t.diff < t.hi && t.lo < 0 && t.hi > 0);
    /* the interval is the quantile times the standard error around the difference */
    assert_true(fabs((t.hi - t.diff) - exp_t_quantile(0.975, t.df) * sqrt(1.75)) < 1e-6);
    /* one value against a group: the one-sample test; one value each: no test */
    const double c = 10.0;
    exp_summary sc;
    exp_summarize(&c, 1, &sc);
    exp_welch(&sa, &sc, 0.95, &t);
    assert_int_equal(t.kind, EXP_TEST_ONE_SAMPLE);
    assert_true(fabs(t.df - 3) < 1e-12 && fabs(t.t - (2.5 - 10) / (sa.sd / 2)) < 1e-9 && t.p < 0.01);
    exp_welch(&sc, &sc, 0.95, &t);
    assert_int_equal(t.kind, EXP_TEST_NONE);
    assert_true(isnan(t.p));
}

/* Runs a driver of the build directory; returns its output (NULL when the program is not there). */
static char *run_program(const char *command)
{
    FILE *p = popen(command, "r");
    if (!p)
        return NULL;
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    len = fread(out, 1, cap - 1, p);
    out[len] = 0;
    int rc = pclose(p);
    if (rc) {
        fail_msg("'%s' failed (status %d): %s", command, rc, out);
    }
    return out;
}

/* exp_stats on a table made here: the means, the Welch verdicts (a clear difference holds, a small one is within
 * noise, a reversed one is opposite), and a sample metric that fails its sanity check gets no verdict. */
static void test_stats_driver(void **state)
{
    (void)state;
    const char *program = "experiments/exp_stats";
    if (access(program, X_OK)) {
        print_message("%s not found from this directory: not run here\n", program);
        return;
    }
    char csv[256], md[256], claims[256], cmd[2048];
    snprintf(csv, sizeof csv, "%s", tmp_path("stats_in"));
    snprintf(md, sizeof md, "%s", tmp_path("stats_md"));
    snprintf(claims, sizeof claims, "%s", tmp_path("stats_claims"));
    FILE *f = fopen(csv, "w");
    assert_non_null(f);
    fprintf(f, "table,arm,seed,loss,accuracy,ref_accuracy\n"
               "t,teacher,0,1.00,0.26,1.0\nt,null,0,9.0,0.25,1.0\nother,x,0,5,5,5\n"
               "t,good,1,0.50,0.3,1\nt,good,2,0.52,0.3,1\nt,good,3,0.51,0.3,1\n"
               "t,close,1,0.49,0.3,1\nt,close,2,0.56,0.3,1\nt,close,3,0.50,0.3,1\n"
               "t,bad,1,2.0,0.3,1\nt,bad,2,2.1,0.3,1\nt,bad,3,2.2,0.3,1\n");
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "%s --in %s --table t --metrics loss,accuracy --reference teacher --null null "
             "--sanity accuracy:ref_accuracy --claim 'loss|good|<|bad|clear' --claim 'loss|good|<|close|small' "
             "--claim 'loss|bad|<|good|reversed' --claim 'accuracy|good|>|teacher|acc' "
             "--claim 'loss|good|~5%%|close|match' --md %s --csv %s",
             program, csv, md, claims);
    free(run_program(cmd));
    f = fopen(claims, "r");
    assert_non_null(f);
    char line[1024], verdicts[5][64];
    assert_non_null(fgets(line, sizeof line, f));
    assert_non_null(strstr(line, "verdict"));
    for (int i = 0; i < 5; i++) {
        assert_non_null(fgets(line, sizeof line, f));
        line[strcspn(line, "\n")] = 0;
        snprintf(verdicts[i], sizeof verdicts[i], "%s", strrchr(line, ',') + 1);
    }
    fclose(f);
    assert_string_equal(verdicts[0], "holds");
    assert_string_equal(verdicts[1], "within noise");
    assert_string_equal(verdicts[2], "opposite");
    assert_string_equal(verdicts[3], "uninformative metric: no verdict"); /* the teacher is at chance */
    assert_string_equal(verdicts[4], "inconclusive");
    f = fopen(md, "r");
    assert_non_null(f);
    char text[8192] = "";
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = 0;
    fclose(f);
    assert_non_null(strstr(text, "| good | 3 | 0.51 ± 0.01"));
    assert_non_null(strstr(text, "**uninformative**"));
    assert_null(strstr(text, "| x |")); /* another table's row */
    /* an arm without runs is "not measured", shown without NaNs; a column that a claim or a sanity check names and
     * the table lacks (a misspelt metric) is an error, and nothing is written */
    snprintf(cmd, sizeof cmd, "%s --in %s --table t --claim 'loss|good|<|absent|later' --md %s", program, csv, md);
    free(run_program(cmd));
    f = fopen(md, "r");
    assert_non_null(f);
    n = fread(text, 1, sizeof text - 1, f);
    text[n] = 0;
    fclose(f);
    assert_non_null(strstr(text, "| — (n 0) | — | — | — | not measured |"));
    assert_null(strstr(text, "nan"));
    unlink(md);
    static const char *const misspelt[] = {"--claim 'los|good|<|bad|typo'", "--sanity accuracy:ref_acc",
                                           "--sanity acc:ref_accuracy"};
    for (size_t i = 0; i < sizeof misspelt / sizeof misspelt[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s --quiet --in %s --table t --reference teacher --null null %s --md %s 2>&1",
                 program, csv, misspelt[i], md);
        FILE *p = popen(cmd, "r");
        assert_non_null(p);
        n = fread(text, 1, sizeof text - 1, p);
        text[n] = 0;
        int rc = pclose(p);
        if (!rc || !strstr(text, "has no column"))
            fail_msg("%s: status %d, message '%s'", misspelt[i], rc, text);
        assert_int_equal(access(md, F_OK), -1);
    }
    unlink(csv), unlink(claims);
}

/* Writes Q/K/V of x as a one-file dump with its manifest into dir. */
static void write_dump(const char *dir, const exp_qkv *x, int block_q, int block_k)
{
    char path[512], err[640];
    snprintf(path, sizeof path, "%s/L00_t0.500.safetensors", dir);
    const char *names[3] = {"q", "k", "v"};
    const float *data[3] = {x->q, x->k, x->v};
    int nd[3] = {4, 4, 4};
    int64_t shapes[3][8] = {{x->B, x->H, x->N, x->D}, {x->B, x->H, x->N, x->D}, {x->B, x->H, x->N, x->D}};
    assert_int_equal(exp_st_write(path, 3, names, data, nd, (const int64_t(*)[8])shapes, SPARGE_F32, NULL, err,
                                  sizeof err),
                     0);
    snprintf(path, sizeof path, "%s/manifest.csv", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "file,layer,t,batch,heads,tokens,head_dim,block_q,block_k\nL00_t0.500.safetensors,0,0.5,%lld,%lld,%lld,"
               "%lld,%d,%d\n",
            (long long)x->B, (long long)x->H, (long long)x->N, (long long)x->D, block_q, block_k);
    fclose(f);
}

/* One column of the only data row of a CSV text. */
static double csv_value(const char *text, const char *name)
{
    const char *row = strchr(text, '\n') + 1;
    int col = 0;
    for (const char *h = text; h < row; col++) {
        size_t len = strcspn(h, ",\n");
        if (len == strlen(name) && !strncmp(h, name, len))
            break;
        h += len + 1;
    }
    for (int i = 0; i < col; i++)
        row = strchr(row, ',') + 1;
    return strtod(row, NULL);
}

/* exp_discrim on two dumps made here: flat rows (Q = 0), where Top-k and Top-p keep the same blocks, and sink rows,
 * where Top-p keeps fewer blocks than Top-k on strong-sink rows. A hybrid whose floor is Top-k's count must leave
 * nothing to its Top-p at equal sparsity (the floor binds on every row: the hybrid is Top-k); with half that floor on
 * flat rows the floor never binds and the hybrid is Top-p. */
static void test_discrim_driver(void **state)
{
    (void)state;
    const char *program = "experiments/exp_discrim";
    if (access(program, X_OK)) {
        print_message("%s not found from this directory: not run here\n", program);
        return;
    }
    char dir[256], cmd[1024];
    snprintf(dir, sizeof dir, "%s", tmp_path("discrim"));
    unlink(dir);
    assert_int_equal(mkdir(dir, 0700), 0);
    for (int kind = 0; kind < 2; kind++) {
        exp_gen_params p = small(kind ? EXP_SINK : EXP_UNIFORM);
        p.H = 1, p.N = 1024, p.block_q = 64, p.block_k = 16, p.sink_blocks = kind;
        exp_qkv x;
        assert_int_equal(exp_generate(&p, &x), 0);
        if (!kind)
            memset(x.q, 0, sizeof(float) * (size_t)(x.B * x.H * x.N * x.D)); /* flat pooled rows */
        write_dump(dir, &x, 64, 16);
        exp_qkv_free(&x);
        for (int half = 0; half < 2; half++) {
            snprintf(cmd, sizeof cmd,
                     "%s --dump %s --topk 0.125 --hybrid %s,0 --quiet --md /dev/null --csv /dev/stdout", program, dir,
                     half ? "0.0625" : "0.125");
            char *out = run_program(cmd);
            double entropy = csv_value(out, "entropy"), d_kp = csv_value(out, "distance_topk_topp");
            double d_hk = csv_value(out, "distance_hybrid_topk"), d_hp = csv_value(out, "distance_hybrid_topp");
            double binds = csv_value(out, "hybrid_floor_binds"), fewer = csv_value(out, "topp_rows_fewer");
            double sp_k = csv_value(out, "topk_sparsity"), sp_p = csv_value(out, "topp_sparsity");
            print_message("%s rows, hybrid floor %s Top-k's: entropy %.4f, distances Top-k/Top-p %.3f, hybrid/Top-k "
                          "%.3f, hybrid/Top-p %.3f; Top-p below n on %.2f of rows, floor binds on %.2f\n",
                          kind ? "sink" : "flat", half ? "half" : "all of", entropy, d_kp, d_hk, d_hp, fewer, binds);
            assert_true(fabs(sp_k - 0.875) < 1e-9 && fabs(sp_p - 0.875) < 0.01); /* equal sparsity */
            if (!half)
                assert_true(binds == 1.0 && d_hk == 0.0);
            if (!kind)
                assert_true(entropy > 0.9999 && d_kp == 0.0 && fewer == 0.0 && (!half || (binds == 0.0 && d_hp == 0.0)));
            else
                assert_true(entropy < 0.95 && d_kp > 0.05 && fewer > 0.1);
            free(out);
        }
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng),
        cmocka_unit_test(test_generators_seeded),
        cmocka_unit_test(test_sink_mass_one),
        cmocka_unit_test(test_sink_mass_several),
        cmocka_unit_test(test_uniform_flat),
        cmocka_unit_test(test_video_locality),
        cmocka_unit_test(test_calibration),
        cmocka_unit_test(test_decomposition),
        cmocka_unit_test(test_safetensors_roundtrip),
        cmocka_unit_test(test_safetensors_write_fails),
        cmocka_unit_test(test_safetensors_handmade),
        cmocka_unit_test(test_load_qkv),
        cmocka_unit_test(test_parse_values),
        cmocka_unit_test(test_parse_refused),
        cmocka_unit_test(test_parse_help),
        cmocka_unit_test(test_usage),
        cmocka_unit_test(test_parse_outputs),
        cmocka_unit_test(test_driver_loop),
        cmocka_unit_test(test_statistics),
        cmocka_unit_test(test_stats_driver),
        cmocka_unit_test(test_discrim_driver),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
