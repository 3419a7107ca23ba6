/* sparge-train with its attention on another device than the CPU reference (issue 8, "CPU and CUDA
 * training steps agree"): the same seeded model takes the same AdamW steps with its attention on
 * `cpu-ref` and on each device under test: `cpu` (the tuned OpenMP tier), and the first GPU device
 * that opens (cuda-generic:0, else hip:0 — the trainer's activations are f32, which the tuned cuda
 * tier does not take; on a GPU the model stages Q/K/V, O, LSE and dO through device buffers). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "trainer.h"

enum { STEPS = 3 };


/* 4 frames of 8x8x3 -> 64 tokens; 2 heads of dim 16; query blocks of 16 tokens, key blocks of 8. */
static tr_config small_config(tr_attn_mode mode)
{
    tr_config c;
    tr_config_defaults(&c);
    c.frames = 4, c.height = 8, c.width = 8, c.channels = 3;
    c.dim = 32, c.heads = 2, c.depth = 2, c.classes = 4, c.mlp_ratio = 2;
    c.block_q = 16, c.block_k = 8;
    c.attn = mode, c.topk = 0.25, c.topp = 0.5;
    c.batch = 2, c.lr = 1e-3;
    return c;
}

typedef struct {
    double loss[STEPS], sparsity[STEPS];
    float *params; /* after the steps */
    float *initial;
    size_t n;
} run_result;

/* STEPS diffusion-loss AdamW steps on device `name`, every step's loss and mask sparsity. */
static void train_steps(const tr_config *c, const char *name, run_result *r)
{
    sparge_device *dev = NULL;
    assert_int_equal(sparge_device_open(name, &dev), SPARGE_OK);
    char err[512];
    tr_model *m = tr_model_create(c, c->batch, dev, err, sizeof err);
    if (!m)
        fail_msg("%s: %s", name, err);
    tr_model_init(m, 7);
    const tr_dims *d = tr_model_dims(m);
    /* adaLN-Zero starts at the zero velocity, where attention carries no gradient: perturb every weight */
    r->n = tr_model_num_params(m);
    float *p = tr_model_params(m);
    uint64_t s = 11;
    for (size_t i = 0; i < r->n; i++)
        p[i] += (float)(0.05 * tr_normal(&s));
    r->initial = malloc(r->n * sizeof(float));
    memcpy(r->initial, p, r->n * sizeof(float));
    size_t n = (size_t)c->batch * d->T * d->H * d->W * d->C;
    float *buf = malloc(6 * n * sizeof(float) + c->batch * (sizeof(float) + sizeof(int)));
    assert_non_null(buf);
    float *x0 = buf, *eps = buf + n, *xt = buf + 2 * n, *u = buf + 3 * n, *du = buf + 4 * n, *target = buf + 5 * n;
    float *t = buf + 6 * n;
    int *y = (int *)(t + c->batch);
    tr_adamw opt;
    assert_int_equal(tr_adamw_init(&opt, r->n), 0);
    for (int step = 0; step < STEPS; step++) {
        tr_make_batch(c, d, step, x0, y, t, eps, xt);
        for (size_t i = 0; i < n; i++)
            target[i] = eps[i] - x0[i];
        if (tr_model_forward(m, xt, t, y, u, err, sizeof err))
            fail_msg("%s forward: %s", name, err);
        r->loss[step] = tr_mse(u, target, n, du);
        r->sparsity[step] = tr_model_last_sparsity(m);
        tr_model_zero_grad(m);
        if (tr_model_backward(m, du, err, sizeof err))
            fail_msg("%s backward: %s", name, err);
        tr_clip_grad_norm(m, c->grad_clip);
        tr_adamw_step(&opt, m, c->lr, c->beta1, c->beta2, c->adam_eps, c->weight_decay);
    }
    r->params = malloc(r->n * sizeof(float));
    memcpy(r->params, p, r->n * sizeof(float));
    tr_adamw_free(&opt);
    free(buf);
    tr_model_free(m);
    sparge_device_close(dev);
}

static void steps_agree(tr_attn_mode mode, const char *device)
{
    tr_config c = small_config(mode);
    run_result ref, dut;
    train_steps(&c, "cpu-ref", &ref);
    train_steps(&c, device, &dut);
    assert_int_equal(ref.n, dut.n);
    for (int s = 0; s < STEPS; s++) {
        double rel = fabs(dut.loss[s] - ref.loss[s]) / ref.loss[s];
        printf("# %s on %s, step %d: loss cpu-ref %.7f, device %.7f (rel %.2e), sparsity %.4f / %.4f\n",
               tr_attn_mode_name(mode), device, s, ref.loss[s], dut.loss[s], rel, ref.sparsity[s], dut.sparsity[s]);
        assert_true(rel < 1e-4);
        assert_true(fabs(dut.sparsity[s] - ref.sparsity[s]) < 1e-12); /* the same blocks kept */
        if (mode != TR_ATTN_DENSE)
            assert_true(ref.sparsity[s] > 0.2);
    }
    /* AdamW normalises each update, so compare the whole update, not single near-zero coordinates */
    double diff = 0, norm = 0;
    for (size_t i = 0; i < ref.n; i++) {
        double dc = (double)ref.params[i] - ref.initial[i], dg = (double)dut.params[i] - dut.initial[i];
        diff += (dg - dc) * (dg - dc), norm += dc * dc;
    }
    printf("# %s on %s: relative L2 difference of the %d-step parameter update %.2e\n", tr_attn_mode_name(mode),
           device, STEPS, sqrt(diff / norm));
    assert_true(norm > 0);
    assert_true(sqrt(diff / norm) < 1e-2);
    free(ref.params), free(ref.initial), free(dut.params), free(dut.initial);
}

static void dense_steps_agree(void **state)
{
    steps_agree(TR_ATTN_DENSE, *state);
}

static void hybrid_steps_agree(void **state)
{
    steps_agree(TR_ATTN_HYBRID, *state);
}

int main(void)
{
    static const char *gpus[] = {"cuda-generic:0", "hip:0"};
    const char *gpu = NULL;
    for (size_t i = 0; i < sizeof gpus / sizeof *gpus && !gpu; i++) {
        sparge_device *dev = NULL;
        if (sparge_device_open(gpus[i], &dev) == SPARGE_OK) {
            gpu = gpus[i];
            sparge_device_close(dev);
        }
    }
    if (!gpu)
        printf("# no GPU device (cuda-generic:0, hip:0) opens: the GPU cases are skipped\n");
    const struct CMUnitTest cpu_tests[] = {
        cmocka_unit_test_prestate(dense_steps_agree, (void *)"cpu"),
        cmocka_unit_test_prestate(hybrid_steps_agree, (void *)"cpu"),
    };
    const struct CMUnitTest gpu_tests[] = {
        cmocka_unit_test_prestate(dense_steps_agree, (void *)gpu),
        cmocka_unit_test_prestate(hybrid_steps_agree, (void *)gpu),
    };
    int failed = cmocka_run_group_tests_name("cpu", cpu_tests, NULL, NULL);
    if (gpu)
        failed += cmocka_run_group_tests_name("gpu", gpu_tests, NULL, NULL);
    return failed;
}
