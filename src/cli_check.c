/* sparge check: a quick conformance run of every available backend (or one)
 * against cpu-ref: mask selection, forward (O, LSE) and backward. The full
 * grid lives in the test suite (make check); this is the field check. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char help[] =
    "usage: sparge check [--backend NAME]\n"
    "\n"
    "Compares every backend that has a device (or only NAME) against the fp64 reference\n"
    "cpu-ref on a few ragged shapes, in f32, f16 and bf16, BHND and BNHD: mask selection,\n"
    "forward O and LSE, and backward dQ, dK, dV (relative L2 error against DESIGN.md's\n"
    "tolerances). Unsupported combinations are listed as such. Exit status 1 on any failure.\n";

typedef struct {
    int64_t B, H, Nq, Nk, D;
    int bq, bk;
} check_shape;

static const check_shape shapes[] = {{1, 2, 300, 300, 64, 128, 64}, {2, 1, 260, 190, 128, 128, 128}};

/* A tensor on dev and its twin on the reference, same storage contents. */
typedef struct {
    sparge_tensor t, r;
    size_t bytes;
} pair;

static sparge_device *ref;

static sparge_status pair_alloc(sparge_device *dev, pair *p, sparge_dtype dt, int bnhd, int64_t B, int64_t H,
                                int64_t N, int64_t D, uint64_t seed)
{
    sparge_tensor (*view)(void *, sparge_dtype, int64_t, int64_t, int64_t, int64_t) =
        bnhd ? sparge_tensor_bnhd : sparge_tensor_bhnd;
    p->bytes = (size_t)(B * H * N * D) * sparge_dtype_size(dt);
    void *a = NULL, *b = NULL;
    sparge_status s;
    if ((s = sparge_malloc(dev, p->bytes, &a)) || (s = sparge_malloc(ref, p->bytes, &b)))
        return s;
    p->t = view(a, dt, B, H, N, D);
    p->r = view(b, dt, B, H, N, D);
    if ((s = cli_fill_random(ref, &p->r, seed)))
        return s;
    return sparge_memcpy_to_device(dev, a, b, p->bytes);
}

static void pair_free(sparge_device *dev, pair *p)
{
    sparge_free(dev, p->t.data);
    sparge_free(ref, p->r.data);
}

static double as_double(const void *storage, sparge_dtype dt, size_t i)
{
    if (dt == SPARGE_F32)
        return ((const float *)storage)[i];
    uint16_t h = ((const uint16_t *)storage)[i];
    return dt == SPARGE_F16 ? sparge_f16_to_f32(h) : sparge_bf16_to_f32(h);
}

/* Relative L2 of dev's result against the reference's (same storage layout). */
static double rel_error(sparge_device *dev, const pair *p)
{
    unsigned char *got = malloc(p->bytes);
    double num = 0.0, den = 0.0;
    if (!got || sparge_memcpy_to_host(dev, got, p->t.data, p->bytes)) {
        free(got);
        return NAN;
    }
    size_t n = p->bytes / sparge_dtype_size(p->t.dtype);
    for (size_t i = 0; i < n; i++) {
        double x = as_double(got, p->t.dtype, i), y = as_double(p->r.data, p->r.dtype, i);
        num += (x - y) * (x - y);
        den += y * y;
    }
    free(got);
    return sqrt(num / den); /* NaN anywhere makes this NaN: it never passes */
}

static double tolerance(sparge_dtype dt) { return dt == SPARGE_F32 ? 1e-5 : dt == SPARGE_F16 ? 3e-3 : 1e-2; }

/* One (shape, dtype, layout) on dev: returns 0 pass, 1 fail, 2 unsupported. */
static int check_one(sparge_device *dev, const check_shape *sh, sparge_dtype dt, int bnhd, double *fwd_err,
                     double *bwd_err, int *mask_rows)
{
    pair q, k, v, o, d_o, dq, dk, dv;
    pair *all[] = {&q, &k, &v, &o, &d_o, &dq, &dk, &dv};
    int64_t N[] = {sh->Nq, sh->Nk, sh->Nk, sh->Nq, sh->Nq, sh->Nq, sh->Nk, sh->Nk};
    sparge_status s = SPARGE_OK;
    int n = 0;
    for (; n < 8 && !s; n++)
        s = pair_alloc(dev, all[n], dt, bnhd, sh->B, sh->H, N[n], sh->D, 100 + (uint64_t)n);
    sparge_mask *m = NULL, *rm = NULL;
    float *lse = NULL, *rlse = malloc((size_t)(sh->B * sh->H * sh->Nq) * 4);
    sparge_mask_params mp = {sh->bq, sh->bk, 0.1, 0.5, 0.0f, 0};
    int result = 1;
    *fwd_err = *bwd_err = NAN;
    *mask_rows = -1;
    if (!s && !(s = sparge_mask_create(dev, sh->B, sh->H, sh->Nq, sh->Nk, sh->bq, sh->bk, &m)) &&
        !(s = sparge_mask_create(ref, sh->B, sh->H, sh->Nq, sh->Nk, sh->bq, sh->bk, &rm)) &&
        !(s = sparge_malloc(dev, (size_t)(sh->B * sh->H * sh->Nq) * 4, (void **)&lse)) &&
        !(s = sparge_mask_predict(ref, &q.r, &k.r, &mp, rm)) && !(s = sparge_mask_predict(dev, &q.t, &k.t, &mp, m))) {
        int64_t cells = sh->B * sh->H * ((sh->Nq + sh->bq - 1) / sh->bq) * ((sh->Nk + sh->bk - 1) / sh->bk);
        int64_t nkb = (sh->Nk + sh->bk - 1) / sh->bk;
        uint8_t *a = malloc((size_t)cells), *b = malloc((size_t)cells);
        if (!(s = sparge_mask_get_dense(m, a)) && !(s = sparge_mask_get_dense(rm, b))) {
            *mask_rows = 0;
            for (int64_t r = 0; r < cells / nkb; r++)
                *mask_rows += memcmp(a + r * nkb, b + r * nkb, (size_t)nkb) != 0;
            s = sparge_mask_set_dense(m, b); /* attend with the identical selection */
        }
        free(a);
        free(b);
    }
    if (!s && !(s = sparge_attention_forward(dev, &q.t, &k.t, &v.t, m, NULL, &o.t, lse)) &&
        !(s = sparge_attention_forward(ref, &q.r, &k.r, &v.r, rm, NULL, &o.r, rlse))) {
        *fwd_err = rel_error(dev, &o);
        /* backward from the reference's O and LSE on both sides */
        if (!(s = sparge_memcpy_to_device(dev, o.t.data, o.r.data, o.bytes)) &&
            !(s = sparge_memcpy_to_device(dev, lse, rlse, (size_t)(sh->B * sh->H * sh->Nq) * 4)) &&
            !(s = sparge_attention_backward(dev, &q.t, &k.t, &v.t, &o.t, &d_o.t, lse, m, NULL, &dq.t, &dk.t, &dv.t)) &&
            !(s = sparge_attention_backward(ref, &q.r, &k.r, &v.r, &o.r, &d_o.r, rlse, rm, NULL, &dq.r, &dk.r, &dv.r)))
            *bwd_err = fmax(rel_error(dev, &dq), fmax(rel_error(dev, &dk), rel_error(dev, &dv)));
    }
    if (s == SPARGE_ERR_UNSUPPORTED)
        result = 2;
    else if (s)
        fprintf(stderr, "  error: %s: %s\n", sparge_status_name(s), sparge_last_error());
    else
        result = !(*fwd_err <= tolerance(dt) && *bwd_err <= tolerance(dt));
    sparge_mask_destroy(m);
    sparge_mask_destroy(rm);
    sparge_free(dev, lse);
    free(rlse);
    for (int i = 0; i < n; i++)
        pair_free(dev, all[i]);
    return result;
}

int cli_check(int argc, char **argv)
{
    const char *only = NULL, *v;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return 0;
        }
        if ((v = cli_opt(argc, argv, &i, "--backend")))
            only = v;
        else {
            fprintf(stderr, "sparge check: unknown option '%s' (see sparge check --help)\n", argv[i]);
            return 2;
        }
    }
    sparge_status s = sparge_device_open("cpu-ref", &ref);
    if (s)
        return cli_fail("opening cpu-ref", s);
    int failures = 0, passed = 0;
    printf("%-16s %-5s %-4s %-22s %11s %11s %10s  %s\n", "device", "dtype", "view", "shape B,H,Nq,Nk,D", "fwd rel L2",
           "bwd rel L2", "mask rows", "result");
    for (int b = 0; b < sparge_backend_count(); b++) {
        const char *name = sparge_backend_name(b);
        if (!strcmp(name, "cpu-ref") || (only && strcmp(name, only) && strncmp(only, name, strlen(name))))
            continue;
        if (sparge_backend_device_count(name) == 0) {
            printf("%-16s no device present: skipped\n", name);
            continue;
        }
        sparge_device *dev;
        if ((s = sparge_device_open(only && strchr(only, ':') ? only : name, &dev)))
            return cli_fail("opening a device", s);
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            for (int d = 0; d < 3; d++)
                for (int bnhd = 0; bnhd < 2; bnhd++) {
                    const check_shape *sh = &shapes[si];
                    double fe, be;
                    int rows, r = check_one(dev, sh, (sparge_dtype)d, bnhd, &fe, &be, &rows);
                    char shape[64];
                    snprintf(shape, sizeof shape, "%lld,%lld,%lld,%lld,%lld", (long long)sh->B, (long long)sh->H,
                             (long long)sh->Nq, (long long)sh->Nk, (long long)sh->D);
                    printf("%-16s %-5s %-4s %-22s %11.2e %11.2e %10d  %s\n", sparge_device_name(dev),
                           sparge_dtype_name((sparge_dtype)d), bnhd ? "bnhd" : "bhnd", shape, fe, be, rows,
                           r == 0 ? "PASS" : r == 2 ? "unsupported" : "FAIL");
                    failures += r == 1;
                    passed += r == 0;
                }
        sparge_device_close(dev);
    }
    sparge_device_close(ref);
    printf("\n%d passed, %d failed\n", passed, failures);
    return failures ? 1 : 0;
}
