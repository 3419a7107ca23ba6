/* Bad input changes nothing: a call that fails leaves every output, the mask and the files untouched; sizes that
 * overflow, outputs that alias inputs and misaligned data are refused; handles have defined lifetimes. Each test
 * names the defect it guards against. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"

static sparge_device *cpu, *ref;

static int setup(void **state)
{
    (void)state;
    return sparge_device_open("cpu", &cpu) || sparge_device_open("cpu-ref", &ref) ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    sparge_device_close(cpu);
    sparge_device_close(ref);
    return 0;
}

static void expect(sparge_status want, sparge_status got, const char *what)
{
    if (got != want)
        fail_msg("%s returned %s, expected %s (%s)", what, sparge_status_name(got), sparge_status_name(want),
                 sparge_last_error());
    if (want != SPARGE_OK && strlen(sparge_last_error()) < 10)
        fail_msg("%s failed without a message", what);
}
#define EXPECT(want, call) expect((want), (call), #call)

static float *normal_floats(int64_t n, uint64_t seed)
{
    float *x = malloc((size_t)n * sizeof *x);
    tu_rng r = {seed};
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)tu_normal(&r);
    return x;
}

/* sparge_attention checks that the forward can run before it predicts into the caller's mask: with a head
 * dimension the CPU refuses, the mask keeps its earlier selection and O stays poisoned. */
static void test_failed_attention_keeps_mask(void **state)
{
    (void)state;
    enum { B = 1, H = 2, N = 300, DS = 64, DL = 300 };
    float *q = normal_floats(B * H * N * DL, 1), *k = normal_floats(B * H * N * DL, 2), *v = normal_floats(B * H * N * DL, 3);
    float *o = malloc(sizeof(float) * B * H * N * DL);
    sparge_mask *m;
    EXPECT(SPARGE_OK, sparge_mask_create(cpu, B, H, N, N, 128, 64, &m));
    sparge_tensor qs = sparge_tensor_bhnd(q, SPARGE_F32, B, H, N, DS), ks = sparge_tensor_bhnd(k, SPARGE_F32, B, H, N, DS);
    sparge_mask_params mp = {128, 64, 0.25, 0.0, 0.0f, 0};
    EXPECT(SPARGE_OK, sparge_mask_predict(cpu, &qs, &ks, &mp, m));
    uint8_t before[B * H * 3 * 5], after[B * H * 3 * 5];
    EXPECT(SPARGE_OK, sparge_mask_get_dense(m, before));
    sparge_tensor ql = sparge_tensor_bhnd(q, SPARGE_F32, B, H, N, DL), kl = sparge_tensor_bhnd(k, SPARGE_F32, B, H, N, DL),
                  vl = sparge_tensor_bhnd(v, SPARGE_F32, B, H, N, DL), ol = sparge_tensor_bhnd(o, SPARGE_F32, B, H, N, DL);
    memset(o, 0xff, sizeof(float) * B * H * N * DL);
    sparge_mask_params full = {128, 64, 1.0, 0.0, 0.0f, 0}; /* would keep every block */
    EXPECT(SPARGE_ERR_UNSUPPORTED, sparge_attention(cpu, &ql, &kl, &vl, &full, &ol, NULL, m));
    EXPECT(SPARGE_OK, sparge_mask_get_dense(m, after));
    assert_memory_equal(before, after, sizeof before);
    for (int64_t i = 0; i < B * H * N * DL; i++)
        assert_true(isnan(o[i]));
    sparge_mask_destroy(m);
    free(q), free(k), free(v), free(o);
}

/* Block sizes far beyond the sequence: one block holds the whole sequence. The cpu tier's tiles are sized by the
 * sequence, not the block (block_k = 2^30 overflowed its tile sizes; 2^20 ran out of memory). */
static void test_huge_blocks(void **state)
{
    (void)state;
    enum { B = 1, H = 2, NQ = 200, NK = 150, D = 32 };
    const int blocks[][2] = {{128, 1 << 30}, {1 << 30, 64}, {1 << 20, 1 << 20}, {2147483647, 2147483647}};
    float *q = normal_floats(B * H * NQ * D, 4), *k = normal_floats(B * H * NK * D, 5), *v = normal_floats(B * H * NK * D, 6);
    float *o = malloc(sizeof(float) * B * H * NQ * D), *o_ref = malloc(sizeof(float) * B * H * NQ * D);
    sparge_tensor qt = sparge_tensor_bhnd(q, SPARGE_F32, B, H, NQ, D), kt = sparge_tensor_bhnd(k, SPARGE_F32, B, H, NK, D),
                  vt = sparge_tensor_bhnd(v, SPARGE_F32, B, H, NK, D), ot = sparge_tensor_bhnd(o, SPARGE_F32, B, H, NQ, D),
                  rt = sparge_tensor_bhnd(o_ref, SPARGE_F32, B, H, NQ, D);
    for (size_t c = 0; c < sizeof blocks / sizeof blocks[0]; c++) {
        sparge_mask_params mp = {blocks[c][0], blocks[c][1], 0.5, 0.0, 0.0f, 0};
        memset(o, 0xff, sizeof(float) * B * H * NQ * D);
        EXPECT(SPARGE_OK, sparge_attention(cpu, &qt, &kt, &vt, &mp, &ot, NULL, NULL));
        EXPECT(SPARGE_OK, sparge_attention(ref, &qt, &kt, &vt, &mp, &rt, NULL, NULL));
        double num = 0, den = 0;
        for (int64_t i = 0; i < B * H * NQ * D; i++) {
            num += ((double)o[i] - o_ref[i]) * ((double)o[i] - o_ref[i]);
            den += (double)o_ref[i] * o_ref[i];
        }
        assert_true(sqrt(num / den) <= sparge_dtype_tolerance(SPARGE_F32));
    }
    free(q), free(k), free(v), free(o), free(o_ref);
}

/* Views whose size overflows are refused, not wrapped; unknown dtypes have no size. */
static void test_size_overflow(void **state)
{
    (void)state;
    float x[16];
    const int64_t big = (int64_t)1 << 22; /* the B stride, 2^66 elements, overflows */
    sparge_tensor t = sparge_tensor_bhnd(x, SPARGE_F32, big, big, big, big);
    for (int i = 0; i < 4; i++)
        assert_int_equal(t.stride[i], -1);
    assert_int_equal(sparge_tensor_span_bytes(&t), 0);
    t = sparge_tensor_bnhd(x, SPARGE_F32, big, big, big, big);
    assert_int_equal(t.stride[0], -1);
    sparge_tensor o = sparge_tensor_bhnd(x, SPARGE_F32, 1, 1, 4, 4);
    EXPECT(SPARGE_ERR_INVALID, sparge_pool(cpu, &t, 64, &o));
    assert_non_null(strstr(sparge_last_error(), "overflow"));
    /* 2^31 tokens that all read one row (N stride 0): a small span, but N does not fit in int32 */
    sparge_tensor tall = {x, SPARGE_F32, {1, 1, (int64_t)1 << 31, 4}, {0, 0, 0, 1}};
    sparge_tensor two = sparge_tensor_bhnd(x + 8, SPARGE_F32, 1, 1, 2, 4);
    memset(x, 0, 8 * sizeof(float));
    memset(x + 8, 0xff, 8 * sizeof(float));
    EXPECT(SPARGE_ERR_OVERFLOW, sparge_pool(cpu, &tall, 1 << 30, &two));
    assert_non_null(strstr(sparge_last_error(), "int32"));
    for (int i = 8; i < 16; i++)
        assert_true(isnan(x[i]));
    sparge_tensor wide = {x, SPARGE_F32, {2, 2, 2, 2}, {(int64_t)1 << 62, 1, 1, 1}};
    assert_int_equal(sparge_tensor_span_bytes(&wide), 0); /* 2^62 · 4 bytes wraps size_t */
    sparge_tensor bad = sparge_tensor_bhnd(x, (sparge_dtype)99, 1, 1, 4, 4);
    assert_int_equal(sparge_dtype_size((sparge_dtype)99), 0);
    assert_int_equal(sparge_tensor_span_bytes(&bad), 0);
    assert_true(sparge_dtype_tolerance((sparge_dtype)99) == 0.0);
}

/* Outputs that share memory with inputs or other outputs are refused, and nothing is written; interleaved views of
 * one packed buffer (Q, K, V heads side by side) that share no element are accepted. */
static void test_aliasing(void **state)
{
    (void)state;
    enum { B = 1, H = 2, N = 96, D = 16, E = B * H * N * D };
    float *buf = normal_floats(9 * E, 7); /* 8 tensors, then the LSE (room for a tensor laid over it) */
    float *q = buf, *k = buf + E, *v = buf + 2 * E, *o = buf + 3 * E, *d_o = buf + 4 * E, *dq = buf + 5 * E,
          *dk = buf + 6 * E, *dv = buf + 7 * E, *lse = buf + 8 * E;
    sparge_tensor qt = sparge_tensor_bhnd(q, SPARGE_F32, B, H, N, D), kt = sparge_tensor_bhnd(k, SPARGE_F32, B, H, N, D),
                  vt = sparge_tensor_bhnd(v, SPARGE_F32, B, H, N, D), ot = sparge_tensor_bhnd(o, SPARGE_F32, B, H, N, D),
                  dot = sparge_tensor_bhnd(d_o, SPARGE_F32, B, H, N, D), dqt = sparge_tensor_bhnd(dq, SPARGE_F32, B, H, N, D),
                  dkt = sparge_tensor_bhnd(dk, SPARGE_F32, B, H, N, D), dvt = sparge_tensor_bhnd(dv, SPARGE_F32, B, H, N, D);
    float *snapshot = malloc(sizeof(float) * 9 * E);
    memcpy(snapshot, buf, sizeof(float) * 9 * E);
#define UNCHANGED() assert_memory_equal(buf, snapshot, sizeof(float) * 9 * E)
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_forward(cpu, &qt, &kt, &vt, NULL, NULL, &vt, lse));
    UNCHANGED();
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_forward(cpu, &qt, &kt, &vt, NULL, NULL, &kt, lse));
    UNCHANGED();
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_forward(cpu, &qt, &kt, &vt, NULL, NULL, &ot, o + 5));
    assert_non_null(strstr(sparge_last_error(), "lse"));
    UNCHANGED();
    sparge_tensor half = sparge_tensor_bhnd(v + E / 2, SPARGE_F32, B, H, N, D); /* o overlapping half of v */
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_forward(cpu, &qt, &kt, &vt, NULL, NULL, &half, lse));
    UNCHANGED();
    EXPECT(SPARGE_ERR_INVALID, sparge_attention(cpu, &qt, &kt, &vt, NULL, &qt, lse, NULL));
    UNCHANGED();
    sparge_tensor o_on_last = sparge_tensor_bhnd(v + E - 1, SPARGE_F32, B, H, N, D); /* o's first element is v's last */
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_forward(cpu, &qt, &kt, &vt, NULL, NULL, &o_on_last, lse));
    UNCHANGED();
    EXPECT(SPARGE_OK, sparge_attention_forward(cpu, &qt, &kt, &vt, NULL, NULL, &ot, lse));
    memcpy(snapshot, buf, sizeof(float) * 9 * E);
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_backward(cpu, &qt, &kt, &vt, &ot, &dot, lse, NULL, NULL, &dqt, &kt, &dvt));
    UNCHANGED();
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_backward(cpu, &qt, &kt, &vt, &ot, &dot, lse, NULL, NULL, &dqt, &dkt, &vt));
    UNCHANGED();
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_backward(cpu, &qt, &kt, &vt, &ot, &dot, lse, NULL, NULL, &dqt, &dqt, &dvt));
    assert_non_null(strstr(sparge_last_error(), "output dq"));
    UNCHANGED();
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_backward(cpu, &qt, &kt, &vt, &ot, &dot, lse, NULL, NULL, &ot, &dkt, &dvt));
    UNCHANGED();
    sparge_tensor dv_on_lse = sparge_tensor_bhnd(lse, SPARGE_F32, B, H, N, D); /* dV over the LSE it reads */
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_backward(cpu, &qt, &kt, &vt, &ot, &dot, lse, NULL, NULL, &dqt, &dkt,
                                                         &dv_on_lse));
    assert_non_null(strstr(sparge_last_error(), "lse"));
    /* dQ, dK, dV interleaved per token in one buffer ([B, N, 3, H, D]): no element shared, accepted. */
    float *packed = malloc(sizeof(float) * 3 * E);
    sparge_tensor pq = {packed, SPARGE_F32, {B, H, N, D}, {N * 3 * H * D, D, 3 * H * D, 1}};
    sparge_tensor pk = pq, pv = pq;
    pk.data = packed + H * D;
    pv.data = packed + 2 * H * D;
    EXPECT(SPARGE_OK, sparge_attention_backward(cpu, &qt, &kt, &vt, &ot, &dot, lse, NULL, NULL, &pq, &pk, &pv));
    pk.data = packed + H * D - 1; /* one element earlier: its first element is pq's last of the same token */
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_backward(cpu, &qt, &kt, &vt, &ot, &dot, lse, NULL, NULL, &pq, &pk, &pv));
    sparge_tensor pooled = sparge_tensor_bhnd(buf, SPARGE_F32, B, H, 1, D); /* pool's out inside its input */
    EXPECT(SPARGE_ERR_INVALID, sparge_pool(cpu, &qt, 128, &pooled));
    free(packed);
    free(snapshot);
    free(buf);
#undef UNCHANGED
}

/* A data pointer not aligned to its element size is refused (cpu-ref read such floats through a misaligned
 * pointer), as is a misaligned LSE. */
static void test_misaligned(void **state)
{
    (void)state;
    enum { B = 1, H = 1, N = 64, D = 8, E = B * H * N * D };
    char *raw = malloc(sizeof(float) * (4 * E + B * H * N) + 8);
    memset(raw, 0, sizeof(float) * (4 * E + B * H * N) + 8);
    float *base = (float *)(raw + 4);
    sparge_tensor qt = sparge_tensor_bhnd(raw + 1, SPARGE_F32, B, H, N, D),
                  kt = sparge_tensor_bhnd(base + E, SPARGE_F32, B, H, N, D),
                  vt = sparge_tensor_bhnd(base + 2 * E, SPARGE_F32, B, H, N, D),
                  ot = sparge_tensor_bhnd(base + 3 * E, SPARGE_F32, B, H, N, D);
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_forward(ref, &qt, &kt, &vt, NULL, NULL, &ot, NULL));
    assert_non_null(strstr(sparge_last_error(), "aligned"));
    qt.data = base;
    EXPECT(SPARGE_ERR_INVALID, sparge_attention_forward(ref, &qt, &kt, &vt, NULL, NULL, &ot, (float *)(raw + 2)));
    sparge_tensor h = sparge_tensor_bhnd(raw + 1, SPARGE_BF16, B, H, N, D);
    sparge_tensor pooled = sparge_tensor_bhnd(base + 3 * E, SPARGE_F32, B, H, 1, D);
    EXPECT(SPARGE_ERR_INVALID, sparge_pool(cpu, &h, 64, &pooled));
    free(raw);
}

/* A mask may outlive its device handle: closing with masks alive defers the release until the last one is
 * destroyed (destroying a mask after closing its device was a use after free); NULL handles are no-ops. */
static void test_lifetimes(void **state)
{
    (void)state;
    sparge_device_close(NULL);
    sparge_mask_destroy(NULL);
    sparge_device *dev;
    EXPECT(SPARGE_OK, sparge_device_open("cpu", &dev));
    sparge_mask *a, *b;
    EXPECT(SPARGE_OK, sparge_mask_create(dev, 1, 1, 256, 256, 128, 64, &a));
    EXPECT(SPARGE_OK, sparge_mask_create(dev, 1, 1, 256, 256, 128, 64, &b));
    uint8_t dense[2 * 4];
    for (int i = 0; i < 8; i++)
        dense[i] = (uint8_t)(i % 3 == 0);
    EXPECT(SPARGE_OK, sparge_mask_set_dense(a, dense));
    sparge_device_close(dev);
    sparge_device_close(dev); /* ignored while masks keep the handle alive */
    uint8_t back[8];
    EXPECT(SPARGE_OK, sparge_mask_get_dense(a, back));
    assert_memory_equal(dense, back, 8);
    sparge_mask_destroy(a);
    sparge_mask_destroy(b); /* the last reference: the device goes now */
}

/* Exporting writes both files or neither, and refuses a bad dtype or head dimension before writing. */
static void test_export(void **state)
{
    (void)state;
    char dir[] = "/tmp/sparge-export-XXXXXX", prefix[256], path[300];
    assert_non_null(mkdtemp(dir));
    snprintf(prefix, sizeof prefix, "%s/mask", dir);
    sparge_mask *m;
    EXPECT(SPARGE_OK, sparge_mask_create(cpu, 1, 1, 128, 128, 128, 64, &m));
    const uint8_t dense[2] = {1, 0};
    EXPECT(SPARGE_OK, sparge_mask_set_dense(m, dense));
    struct stat st;
    EXPECT(SPARGE_ERR_INVALID, sparge_mask_export(m, prefix, -1, SPARGE_BF16));
    EXPECT(SPARGE_ERR_DTYPE, sparge_mask_export(m, prefix, 64, (sparge_dtype)7));
    snprintf(path, sizeof path, "%s.u8", prefix);
    assert_int_not_equal(stat(path, &st), 0);
    /* The JSON cannot be written (a directory stands at its temporary name): no .u8 is left either. */
    snprintf(path, sizeof path, "%s.json.part", prefix);
    assert_int_equal(mkdir(path, 0700), 0);
    EXPECT(SPARGE_ERR_INVALID, sparge_mask_export(m, prefix, 64, SPARGE_BF16));
    snprintf(path, sizeof path, "%s.u8", prefix);
    assert_int_not_equal(stat(path, &st), 0);
    snprintf(path, sizeof path, "%s.u8.part", prefix);
    assert_int_not_equal(stat(path, &st), 0);
    snprintf(path, sizeof path, "%s.json.part", prefix);
    assert_int_equal(rmdir(path), 0);
    EXPECT(SPARGE_OK, sparge_mask_export(m, prefix, 64, SPARGE_BF16));
    snprintf(path, sizeof path, "%s.u8", prefix);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_size, 2);
    assert_int_equal(remove(path), 0);
    snprintf(path, sizeof path, "%s.json", prefix);
    assert_int_equal(remove(path), 0);
    assert_int_equal(rmdir(dir), 0);
    sparge_mask_destroy(m);
}

/* Stopping a timer that is not running is an error (it returned OK with a meaningless time); a tuning variable
 * that no backend of the build reads refuses the device instead of being ignored. */
static void test_timer_and_environment(void **state)
{
    (void)state;
    double ms = -1.0;
    EXPECT(SPARGE_ERR_INVALID, sparge_timer_stop(cpu, &ms));
    assert_true(ms == -1.0);
    EXPECT(SPARGE_OK, sparge_timer_start(cpu));
    EXPECT(SPARGE_OK, sparge_timer_stop(cpu, &ms));
    assert_true(ms >= 0.0);
    EXPECT(SPARGE_ERR_INVALID, sparge_timer_stop(cpu, &ms));
    int has_cuda = 0;
    for (int i = 0; i < sparge_backend_count(); i++)
        has_cuda |= !strcmp(sparge_backend_name(i), "cuda");
    sparge_device *d = NULL;
    assert_int_equal(setenv("SPARGE_CUDA_NO_SUCH_SWITCH", "1", 1), 0);
    EXPECT(SPARGE_ERR_INVALID, sparge_device_open("cpu", &d));
    assert_non_null(strstr(sparge_last_error(), "SPARGE_CUDA_NO_SUCH_SWITCH"));
    assert_int_equal(unsetenv("SPARGE_CUDA_NO_SUCH_SWITCH"), 0);
    assert_int_equal(setenv("SPARGE_CUDA_FWD_KERNEL", "mma", 1), 0);
    EXPECT(has_cuda ? SPARGE_OK : SPARGE_ERR_INVALID, sparge_device_open("cpu", &d));
    assert_int_equal(unsetenv("SPARGE_CUDA_FWD_KERNEL"), 0);
    sparge_device_close(d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_failed_attention_keeps_mask), cmocka_unit_test(test_huge_blocks),
        cmocka_unit_test(test_size_overflow),               cmocka_unit_test(test_aliasing),
        cmocka_unit_test(test_misaligned),                  cmocka_unit_test(test_lifetimes),
        cmocka_unit_test(test_export),                      cmocka_unit_test(test_timer_and_environment),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
