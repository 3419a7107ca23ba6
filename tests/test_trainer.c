/* Tests of sparge-train (experiments/trainer): the hand-written backward against central finite
 * differences (dense and with a frozen sparse mask), a few training steps lowering the loss,
 * checkpoint round trips and an exact resume, the data generators, and the config parser. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, mkstemp, strdup */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "exp.h"
#include "trainer.h"

static sparge_device *open_device(const char *name)
{
    sparge_device *dev = NULL;
    assert_int_equal(sparge_device_open(name, &dev), SPARGE_OK);
    return dev;
}

/* Whether the eigen-solver of this build cannot run here: cuSOLVER's (a build without a host LAPACK) on a machine
 * without a CUDA device. The Fréchet distance is then NaN, and the tests that need it skip. */
static int eigen_solver_missing(void)
{
    sparge_device *dev = NULL;
    if (strncmp(tr_eigen_solver(), "cuSOLVER", 8) || sparge_device_open("cuda:0", &dev) == SPARGE_OK) {
        if (dev)
            sparge_device_close(dev);
        return 0;
    }
    print_message("# no CUDA device for this build's eigen-solver (%s): skipped\n", tr_eigen_solver());
    return 1;
}

/* 2 frames of 4x4x3 -> 8 tokens; 2 heads of dim 6; query blocks of 4 tokens, key blocks of 2. */
static tr_config tiny_config(void)
{
    tr_config c;
    tr_config_defaults(&c);
    c.frames = 2, c.height = 4, c.width = 4, c.channels = 3;
    c.dim = 12, c.heads = 2, c.depth = 2, c.classes = 3, c.mlp_ratio = 2;
    c.block_q = 4, c.block_k = 2;
    c.batch = 2;
    return c;
}

static void randomize(float *p, size_t n, uint64_t seed, double scale)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        p[i] = (float)(scale * tr_normal(&s));
}

typedef struct {
    tr_model *m;
    float *x, *t, *target, *u, *du;
    int y[4];
    size_t n;
} grad_case;

static double loss_of(grad_case *g)
{
    char err[512];
    if (tr_model_forward(g->m, g->x, g->t, g->y, g->u, err, sizeof err))
        fail_msg("%s", err);
    return tr_mse(g->u, g->target, g->n, NULL);
}

/* Every parameter tensor: the directional derivative along its gradient and its two largest
 * entries against central differences of the (double-accumulated) loss. The model is f32, so
 * the tolerance allows f32 rounding of the forward divided by the step. */
static void check_gradients(tr_attn_mode mode, int adaln_single)
{
    tr_config c = tiny_config();
    c.attn = mode, c.topk = 0.25, c.topp = 0.5, c.adaln_single = adaln_single;
    sparge_device *dev = open_device("cpu-ref");
    char err[512];
    grad_case g = {0};
    g.m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_non_null(g.m);
    const tr_dims *d = tr_model_dims(g.m);
    g.n = (size_t)c.batch * d->T * d->H * d->W * d->C;
    g.x = malloc(g.n * sizeof(float)), g.target = malloc(g.n * sizeof(float));
    g.u = malloc(g.n * sizeof(float)), g.du = malloc(g.n * sizeof(float));
    float t[2] = {0.3f, 0.8f};
    g.t = t, g.y[0] = 2, g.y[1] = 0;
    randomize(g.x, g.n, 1, 1.0);
    randomize(g.target, g.n, 2, 1.0);
    /* random (not adaLN-Zero) weights so that every path carries gradient */
    size_t np = tr_model_num_params(g.m);
    float *p = tr_model_params(g.m);
    randomize(p, np, 3, 0.3);
    double l0 = loss_of(&g);
    if (mode != TR_ATTN_DENSE) {
        double sp = tr_model_last_sparsity(g.m);
        assert_true(sp > 0.2 && sp < 0.9);
        tr_model_freeze_masks(g.m, 1); /* finite differences need the mask held fixed, as in the backward */
    }
    tr_mse(g.u, g.target, g.n, g.du);
    tr_model_zero_grad(g.m);
    assert_int_equal(tr_model_backward(g.m, g.du, err, sizeof err), 0);
    float *grad = malloc(np * sizeof(float));
    memcpy(grad, tr_model_grads(g.m), np * sizeof(float));
    assert_true(l0 > 0.1);
    double worst_dir = 0, worst_entry = 0;
    for (int i = 0; i < tr_model_num_tensors(g.m); i++) {
        const tr_param *tp = tr_model_tensor(g.m, i);
        const float *gt = grad + tp->offset;
        float *pt = p + tp->offset;
        double norm = 0;
        for (size_t j = 0; j < tp->size; j++)
            norm += (double)gt[j] * gt[j];
        norm = sqrt(norm);
        assert_true(norm > 1e-6); /* every tensor gets gradient (the classes used, at least) */
        /* directional derivative along v = g/|g| */
        const double h = 1e-2;
        float *saved = malloc(tp->size * sizeof(float));
        memcpy(saved, pt, tp->size * sizeof(float));
        for (size_t j = 0; j < tp->size; j++)
            pt[j] = (float)(saved[j] + h * gt[j] / norm);
        double lp = loss_of(&g);
        for (size_t j = 0; j < tp->size; j++)
            pt[j] = (float)(saved[j] - h * gt[j] / norm);
        double lm = loss_of(&g);
        memcpy(pt, saved, tp->size * sizeof(float));
        double fd = (lp - lm) / (2 * h), rel = fabs(fd - norm) / norm;
        if (rel > worst_dir)
            worst_dir = rel;
        if (rel > 2e-3)
            fail_msg("%s: directional derivative %.7g, backward %.7g (rel %.2e)", tp->name, fd, norm, rel);
        /* the two largest entries */
        size_t top[2] = {0, 0};
        for (size_t j = 0; j < tp->size; j++)
            if (fabsf(gt[j]) > fabsf(gt[top[0]]))
                top[1] = top[0], top[0] = j;
            else if (j != top[0] && fabsf(gt[j]) > fabsf(gt[top[1]]))
                top[1] = j;
        for (int e = 0; e < (tp->size > 1 ? 2 : 1); e++) {
            size_t j = top[e];
            const double he = 3e-3;
            pt[j] = (float)(saved[j] + he);
            double ep = loss_of(&g);
            pt[j] = (float)(saved[j] - he);
            double em = loss_of(&g);
            pt[j] = saved[j];
            double fde = (ep - em) / (((double)(float)(saved[j] + he)) - (double)(float)(saved[j] - he));
            double err_e = fabs(fde - gt[j]) / (fabs(gt[j]) + 1e-3 * norm + 1e-6);
            if (err_e > worst_entry)
                worst_entry = err_e;
            if (err_e > 1e-2)
                fail_msg("%s[%zu]: finite difference %.7g, backward %.7g", tp->name, j, fde, (double)gt[j]);
        }
        free(saved);
    }
    print_message("gradient check (%s%s): worst rel. error %.2e along gradients, %.2e on entries\n",
                  tr_attn_mode_name(mode), adaln_single ? ", adaln=single" : "", worst_dir, worst_entry);
    free(grad);
    free(g.x), free(g.target), free(g.u), free(g.du);
    tr_model_free(g.m);
    sparge_device_close(dev);
}

static void test_gradient_dense(void **state)
{
    (void)state;
    check_gradients(TR_ATTN_DENSE, 0);
}

/* adaln=single: one modulation weight for every block (its gradient the sum of the blocks'), a bias per block */
static void test_gradient_adaln_single(void **state)
{
    (void)state;
    check_gradients(TR_ATTN_HYBRID, 1);
}

static void test_gradient_hybrid_mask(void **state)
{
    (void)state;
    check_gradients(TR_ATTN_HYBRID, 0);
}

/* Diffusion loss on a fixed held-out batch before and after 40 AdamW steps on A. */
static void test_training_lowers_loss(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.height = c.width = 8, c.frames = 4, c.dim = 24, c.heads = 2, c.block_q = 16, c.block_k = 8, c.batch = 4;
    c.lr = 2e-3;
    sparge_device *dev = open_device("cpu");
    char err[512];
    tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_non_null(m);
    assert_int_equal(tr_model_init(m, 5, err, sizeof err), 0);
    const tr_dims *d = tr_model_dims(m);
    size_t n = (size_t)c.batch * d->T * d->H * d->W * d->C;
    float *x0 = malloc(n * sizeof(float)), *eps = malloc(n * sizeof(float)), *xt = malloc(n * sizeof(float));
    float *u = malloc(n * sizeof(float)), *target = malloc(n * sizeof(float)), *du = malloc(n * sizeof(float));
    float t[4];
    int y[4];
    tr_adamw opt;
    assert_int_equal(tr_adamw_init(&opt, m, err, sizeof err), 0);
    double held_out[2];
    for (int phase = 0; phase < 2; phase++) {
        double sum = 0;
        for (int64_t b = 0; b < 4; b++) { /* batches 1000.. are never trained on */
            tr_make_batch(&c, d, 1000 + b, x0, y, t, eps, xt);
            for (size_t i = 0; i < n; i++)
                target[i] = eps[i] - x0[i];
            assert_int_equal(tr_model_forward(m, xt, t, y, u, err, sizeof err), 0);
            sum += tr_mse(u, target, n, NULL);
        }
        held_out[phase] = sum / 4;
        for (int64_t step = 0; phase == 0 && step < 40; step++) {
            tr_make_batch(&c, d, step, x0, y, t, eps, xt);
            for (size_t i = 0; i < n; i++)
                target[i] = eps[i] - x0[i];
            assert_int_equal(tr_model_forward(m, xt, t, y, u, err, sizeof err), 0);
            tr_mse(u, target, n, du);
            tr_model_zero_grad(m);
            assert_int_equal(tr_model_backward(m, du, err, sizeof err), 0);
            double norm;
            assert_int_equal(tr_clip_grad_norm(m, c.grad_clip, &norm, err, sizeof err), 0);
            assert_int_equal(tr_adamw_step(&opt, m, c.lr, c.beta1, c.beta2, c.adam_eps, c.weight_decay, err, sizeof err),
                             0);
        }
    }
    print_message("held-out diffusion loss: %.4f before, %.4f after 40 steps\n", held_out[0], held_out[1]);
    assert_true(held_out[1] < 0.85 * held_out[0]);
    tr_adamw_free(&opt);
    free(x0), free(eps), free(xt), free(u), free(target), free(du);
    tr_model_free(m);
    sparge_device_close(dev);
}

/* The staged attention path (what GPU devices use) gives the same outputs and gradients as the
 * in-place one, bit for bit, on the cpu device. */
static void test_staged_attention(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.attn = TR_ATTN_HYBRID, c.topk = 0.25, c.topp = 0.5;
    sparge_device *dev = open_device("cpu");
    char err[512];
    float *out[2][2];
    size_t n = 0, np = 0;
    for (int staged = 0; staged < 2; staged++) {
        c.stage_attention = staged;
        tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
        assert_non_null(m);
        const tr_dims *d = tr_model_dims(m);
        n = (size_t)c.batch * d->T * d->H * d->W * d->C, np = tr_model_num_params(m);
        randomize(tr_model_params(m), np, 31, 0.3);
        float *x = malloc(n * sizeof(float)), t[2] = {0.2f, 0.7f};
        int y[2] = {1, 0};
        randomize(x, n, 32, 1.0);
        out[staged][0] = malloc(n * sizeof(float));
        out[staged][1] = malloc(np * sizeof(float));
        assert_int_equal(tr_model_forward(m, x, t, y, out[staged][0], err, sizeof err), 0);
        assert_true(tr_model_last_sparsity(m) > 0.2);
        tr_model_zero_grad(m);
        assert_int_equal(tr_model_backward(m, x, err, sizeof err), 0); /* any dL/du will do */
        memcpy(out[staged][1], tr_model_grads(m), np * sizeof(float));
        free(x);
        tr_model_free(m);
    }
    assert_memory_equal(out[0][0], out[1][0], n * sizeof(float));
    assert_memory_equal(out[0][1], out[1][1], np * sizeof(float));
    for (int i = 0; i < 4; i++)
        free(out[i / 2][i % 2]);
    sparge_device_close(dev);
}

static char *temp_dir(void)
{
    char *dir = strdup("/tmp/test_trainer_XXXXXX");
    assert_non_null(mkdtemp(dir));
    return dir;
}

/* Removes a temp_dir() and everything in it, and frees its name. */
static void remove_temp_dir(char *dir)
{
    char command[600];
    snprintf(command, sizeof command, "rm -rf '%s'", dir);
    assert_int_equal(system(command), 0);
    free(dir);
}

/* save -> load gives bitwise identical outputs and moments; a model of another shape is refused
 * and left untouched. */
static void test_checkpoint_roundtrip(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.attn = TR_ATTN_HYBRID, c.topk = 0.25, c.topp = 0.5;
    sparge_device *dev = open_device("cpu");
    char err[512], path[600];
    char *dir = temp_dir();
    snprintf(path, sizeof path, "%s/ckpt.safetensors", dir);
    tr_model *a = tr_model_create(&c, c.batch, dev, err, sizeof err), *b = tr_model_create(&c, c.batch, dev, err, 512);
    assert_non_null(a);
    assert_non_null(b);
    size_t np = tr_model_num_params(a);
    randomize(tr_model_params(a), np, 11, 0.2);
    tr_adamw oa, ob;
    assert_int_equal(tr_adamw_init(&oa, a, err, sizeof err), 0);
    assert_int_equal(tr_adamw_init(&ob, b, err, sizeof err), 0);
    randomize(oa.m, np, 12, 1.0);
    randomize(oa.v, np, 13, 1.0);
    oa.step = 1234;
    assert_int_equal(tr_checkpoint_save(path, a, &oa, &c, err, sizeof err), 0);
    assert_int_equal(tr_checkpoint_load(path, b, &ob, err, sizeof err), 0);
    assert_memory_equal(tr_model_params(a), tr_model_params(b), np * sizeof(float));
    assert_memory_equal(oa.m, ob.m, np * sizeof(float));
    assert_memory_equal(oa.v, ob.v, np * sizeof(float));
    assert_int_equal(ob.step, 1234);
    const tr_dims *d = tr_model_dims(a);
    size_t n = (size_t)c.batch * d->T * d->H * d->W * d->C;
    float *x = malloc(n * sizeof(float)), *ua = malloc(n * sizeof(float)), *ub = malloc(n * sizeof(float));
    randomize(x, n, 14, 1.0);
    float t[2] = {0.1f, 0.9f};
    int y[2] = {1, 2};
    assert_int_equal(tr_model_forward(a, x, t, y, ua, err, sizeof err), 0);
    assert_int_equal(tr_model_forward(b, x, t, y, ub, err, sizeof err), 0);
    assert_memory_equal(ua, ub, n * sizeof(float));
    /* another width: refused, nothing changed */
    tr_config c2 = c;
    c2.dim = 16;
    tr_model *other = tr_model_create(&c2, c.batch, dev, err, sizeof err);
    assert_non_null(other);
    assert_int_equal(tr_checkpoint_load(path, other, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "shape"));
    for (size_t i = 0; i < tr_model_num_params(other); i++)
        assert_true(tr_model_params(other)[i] == 0.0f);
    /* weights only: no moments needed, but resuming needs them */
    assert_int_equal(tr_checkpoint_save(path, a, NULL, &c, err, sizeof err), 0);
    assert_int_equal(tr_checkpoint_load(path, b, NULL, err, sizeof err), 0);
    assert_int_equal(tr_checkpoint_load(path, b, &ob, err, sizeof err), -1);
    unlink(path);
    rmdir(dir);
    free(dir);
    free(x), free(ua), free(ub);
    tr_adamw_free(&oa);
    tr_adamw_free(&ob);
    tr_model_free(a);
    tr_model_free(b);
    tr_model_free(other);
    sparge_device_close(dev);
}

static float *load_params(const tr_config *c, const char *path)
{
    sparge_device *dev = open_device("cpu");
    char err[512];
    tr_model *m = tr_model_create(c, c->batch, dev, err, sizeof err);
    assert_non_null(m);
    if (tr_checkpoint_load(path, m, NULL, err, sizeof err))
        fail_msg("%s", err);
    size_t np = tr_model_num_params(m);
    float *p = malloc(np * sizeof(float));
    memcpy(p, tr_model_params(m), np * sizeof(float));
    tr_model_free(m);
    sparge_device_close(dev);
    return p;
}

/* 6 steps in one run == 3 steps, then resume for 3: the same weights, bit for bit; then velocity
 * distillation from that checkpoint as its own dense teacher starts at loss 0. */
static void test_resume_and_distillation(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.log_every = 100;
    char err[512], full[256], part[256], vd[256], logp[256];
    char *dir = temp_dir();
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    snprintf(part, sizeof part, "%s/part.safetensors", dir);
    snprintf(vd, sizeof vd, "%s/vd.safetensors", dir);
    snprintf(logp, sizeof logp, "%s/vd.csv", dir);
    c.steps = 6;
    snprintf(c.out, sizeof c.out, "%s", full);
    if (tr_train(&c, err, sizeof err))
        fail_msg("%s", err);
    c.steps = 3;
    snprintf(c.out, sizeof c.out, "%s", part);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    c.steps = 6;
    snprintf(c.resume, sizeof c.resume, "%s", part);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    float *a = load_params(&c, full), *b = load_params(&c, part);
    sparge_device *dev = open_device("cpu");
    tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_memory_equal(a, b, tr_model_num_params(m) * sizeof(float));
    tr_model_free(m);
    sparge_device_close(dev);
    /* distillation: dense student = dense teacher at step 1, so the first logged loss is 0 */
    tr_config v = tiny_config();
    v.loss = TR_LOSS_VD, v.steps = 2, v.log_every = 100;
    snprintf(v.init, sizeof v.init, "%s", full);
    snprintf(v.out, sizeof v.out, "%s", vd);
    snprintf(v.log, sizeof v.log, "%s", logp);
    assert_int_equal(tr_train(&v, err, sizeof err), 0);
    FILE *f = fopen(logp, "r");
    assert_non_null(f);
    char header[256];
    long long step;
    double loss;
    assert_non_null(fgets(header, sizeof header, f));
    assert_non_null(strstr(header, "step,loss"));
    assert_int_equal(fscanf(f, "%lld,%lf", &step, &loss), 2);
    assert_int_equal(step, 1);
    assert_true(loss == 0.0);
    fclose(f);
    /* a sparse student differs from its teacher from the first step */
    v.attn = TR_ATTN_TOPK, v.topk = 0.25;
    assert_int_equal(tr_train(&v, err, sizeof err), 0);
    f = fopen(logp, "r");
    assert_non_null(fgets(header, sizeof header, f));
    assert_int_equal(fscanf(f, "%lld,%lf", &step, &loss), 2);
    assert_true(loss > 0.0);
    fclose(f);
    /* evaluation of the 6-step model against itself as the teacher: dense has no velocity error,
     * Top-k some; Euler samples and the reference videos give finite statistics */
    tr_config e = tiny_config();
    e.mode = TR_MODE_EVAL, e.sample_steps = 4;
    snprintf(e.init, sizeof e.init, "%s", full);
    snprintf(e.teacher, sizeof e.teacher, "%s", full);
    tr_eval_result r;
    assert_int_equal(tr_evaluate(&e, &r, err, sizeof err), 0);
    assert_true(r.velocity_mse == 0.0 && r.sparsity == 0.0 && r.attention_rel_l1 == 0.0);
    assert_true(r.diffusion_loss > 0.1 && isfinite(r.sample.sharpness) && r.reference.sharpness > 0.0);
    e.attn = TR_ATTN_TOPK, e.topk = 0.25;
    assert_int_equal(tr_evaluate(&e, &r, err, sizeof err), 0);
    assert_true(r.velocity_rel_l2 > 0.0 && r.velocity_rel_l2 < 1.0 && r.sparsity > 0.5);
    assert_true(r.attention_rel_l1 > 1e-3 && r.attention_rel_l1 < 2.0);
    e.topk = 1.0; /* every block kept: the sparse path equals dense up to rounding */
    assert_int_equal(tr_evaluate(&e, &r, err, sizeof err), 0);
    assert_true(r.sparsity == 0.0 && r.attention_rel_l1 < 1e-5 && r.velocity_rel_l2 < 1e-5);
    /* vd without a teacher is refused */
    v.init[0] = 0;
    assert_int_equal(tr_train(&v, err, sizeof err), -1);
    assert_non_null(strstr(err, "teacher"));
    unlink(full), unlink(part), unlink(vd), unlink(logp);
    rmdir(dir);
    free(dir);
    free(a), free(b);
}

/* Copies file src to dst. */
static void copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb"), *out = fopen(dst, "wb");
    assert_non_null(in);
    assert_non_null(out);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        assert_int_equal(fwrite(buf, 1, n, out), n);
    fclose(in);
    assert_int_equal(fclose(out), 0);
}

/* The path of the first shard that the index file `index` names. */
static void first_shard(const char *index, char *out, size_t cap)
{
    char err[512], list[1024];
    exp_st_file f;
    assert_int_equal(exp_st_open(index, &f, err, sizeof err), 0);
    assert_int_equal(exp_st_metadata(&f, "shards", list, sizeof list), 0);
    exp_st_close(&f);
    const char *slash = strrchr(index, '/');
    snprintf(out, cap, "%.*s%.*s", slash ? (int)(slash - index) + 1 : 0, index, (int)strcspn(list, ","), list);
}

/* Checkpoints split into shards and runs stopped by time_limit: 6 steps in one run equal 1 + 1 + 4 steps through
 * sharded checkpoints, bit for bit; each save's shards have names of their own, and a completed save removes those
 * of earlier saves (a stopped save's too) and nothing else; weights-only checkpoints (save_optimizer=0) load as
 * init= but not as resume=. */
static void test_sharded_resume(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.log_every = 100, c.adaln_single = 1, c.steps = 6;
    char err[512], full[256], part[256], shard[1100], weights[256];
    char *dir = temp_dir();
    snprintf(full, sizeof full, "%s/full.safetensors", dir);
    snprintf(part, sizeof part, "%s/part.safetensors", dir);
    snprintf(weights, sizeof weights, "%s/weights.safetensors", dir);
    snprintf(c.out, sizeof c.out, "%s", full);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    /* every run stops after its first step: the limit is always past at the first step boundary */
    c.time_limit = 1e-9, c.ckpt_shard_mib = 0.02;
    snprintf(c.out, sizeof c.out, "%s", part);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    snprintf(c.resume, sizeof c.resume, "%s", part);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    sparge_device *dev = open_device("cpu");
    tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_non_null(m);
    tr_adamw opt;
    assert_int_equal(tr_adamw_init(&opt, m, err, sizeof err), 0);
    assert_int_equal(tr_checkpoint_load(part, m, &opt, err, sizeof err), 0);
    assert_int_equal(opt.step, 2);
    exp_st_file index;
    char list[1024];
    assert_int_equal(exp_st_open(part, &index, err, sizeof err), 0);
    assert_int_equal(index.count, 0);
    assert_int_equal(exp_st_metadata(&index, "shards", list, sizeof list), 0);
    exp_st_close(&index);
    int shards = 0;
    for (char *name = strtok(list, ","); name; name = strtok(NULL, ","), shards++) {
        snprintf(shard, sizeof shard, "%s/%s", dir, name);
        FILE *f = fopen(shard, "rb");
        assert_non_null(f);
        fseek(f, 0, SEEK_END);
        assert_true(ftell(f) <= (long)(0.02 * 1048576));
        fclose(f);
    }
    print_message("sharded checkpoint: %d shards of at most 0.02 MiB (%zu parameters with their moments)\n", shards,
                  tr_model_num_params(m));
    assert_true(shards > 1);
    char kept[1100], step2[1100], orphan[1100], upper[1100], bak[1100];
    first_shard(part, step2, sizeof step2);
    snprintf(kept, sizeof kept, "%s/step2-shard1.safetensors", dir);
    copy_file(step2, kept);
    /* the shard of a save stopped before its index, and two files that only look like shards */
    snprintf(orphan, sizeof orphan, "%s/part-0123456789abcdef-1-of-3.safetensors", dir);
    snprintf(upper, sizeof upper, "%s/part-0123456789ABCDEF-1-of-3.safetensors", dir);
    snprintf(bak, sizeof bak, "%s/part-0123456789abcdef-1-of-3.safetensors.bak", dir);
    copy_file(kept, orphan);
    copy_file(kept, upper);
    copy_file(kept, bak);
    c.time_limit = 0;
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    float *a = load_params(&c, full), *b = load_params(&c, part);
    assert_memory_equal(a, b, tr_model_num_params(m) * sizeof(float));
    first_shard(part, shard, sizeof shard);
    assert_string_not_equal(shard, step2);
    assert_int_not_equal(access(step2, F_OK), 0);
    assert_int_not_equal(access(orphan, F_OK), 0);
    assert_int_equal(access(upper, F_OK), 0);
    assert_int_equal(access(bak, F_OK), 0);
    /* the step-6 index with the step-2 save's first shard in place of its own is refused */
    char now[1100];
    snprintf(now, sizeof now, "%s/step6-shard1.safetensors", dir);
    copy_file(shard, now);
    copy_file(kept, shard);
    assert_int_equal(tr_checkpoint_load(part, m, &opt, err, sizeof err), -1);
    assert_non_null(strstr(err, "not of the save its index names"));
    copy_file(now, shard);
    assert_int_equal(tr_checkpoint_load(part, m, &opt, err, sizeof err), 0);
    assert_int_equal(opt.step, 6);
    /* weights only */
    tr_config w = c;
    w.save_optimizer = 0, w.ckpt_shard_mib = 0;
    snprintf(w.out, sizeof w.out, "%s", weights);
    assert_int_equal(tr_train(&w, err, sizeof err), 0); /* resumed at its last step: no step, the weights written */
    assert_int_equal(tr_checkpoint_load(weights, m, &opt, err, sizeof err), -1);
    assert_int_equal(tr_checkpoint_load(weights, m, NULL, err, sizeof err), 0);
    assert_memory_equal(tr_model_params(m), a, tr_model_num_params(m) * sizeof(float));
    /* a model without adaln=single cannot load it */
    tr_config blockwise = c;
    blockwise.adaln_single = 0;
    tr_model *other = tr_model_create(&blockwise, c.batch, dev, err, sizeof err);
    assert_int_equal(tr_checkpoint_load(weights, other, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "blocks.0.adaLN.weight"));
    tr_model_free(other);
    free(a), free(b);
    tr_adamw_free(&opt);
    tr_model_free(m);
    sparge_device_close(dev);
    remove_temp_dir(dir);
}

/* mode=calibrate finds the p whose held-out sparsity is the target, for Top-p and for the hybrid (whose p need not
 * be below Top-p's: each layer's mask changes the next layers' inputs). */
static void test_calibrate(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.frames = 4, c.height = 8, c.width = 8, c.dim = 24, c.block_q = 8, c.block_k = 4, c.eval_batches = 2;
    char err[512], path[256];
    char *dir = temp_dir();
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    sparge_device *dev = open_device("cpu");
    tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_non_null(m);
    randomize(tr_model_params(m), tr_model_num_params(m), 41, 0.3);
    assert_int_equal(tr_checkpoint_save(path, m, NULL, &c, err, sizeof err), 0);
    tr_model_free(m);
    sparge_device_close(dev);
    snprintf(c.init, sizeof c.init, "%s", path);
    c.mode = TR_MODE_CALIBRATE, c.target_sparsity = 0.6;
    double p, sp, p_h, sp_h;
    c.attn = TR_ATTN_TOPP;
    if (tr_calibrate(&c, &p, &sp, err, sizeof err))
        fail_msg("%s", err);
    c.attn = TR_ATTN_HYBRID, c.topk = 0.25;
    assert_int_equal(tr_calibrate(&c, &p_h, &sp_h, err, sizeof err), 0);
    print_message("calibrated to sparsity 0.6: Top-p p %.6f (sparsity %.4f), hybrid k 0.25 p %.6f (%.4f)\n", p, sp,
                  p_h, sp_h);
    assert_true(p > 0 && p < 1 && fabs(sp - 0.6) < 0.03);
    assert_true(p_h >= 0 && p_h < 1 && fabs(sp_h - 0.6) < 0.03);
    c.attn = TR_ATTN_TOPK;
    assert_int_equal(tr_calibrate(&c, &p, &sp, err, sizeof err), -1);
    unlink(path);
    rmdir(dir);
    free(dir);
}

typedef struct {
    int layer;
    float *qkv;
    size_t n;
} capture;

static int capture_layer(void *ctx, int layer, const float *qkv, char *err, size_t err_len)
{
    (void)err, (void)err_len;
    capture *c = ctx;
    if (layer == c->layer)
        memcpy(c->qkv, qkv, c->n * sizeof(float));
    return 0;
}

/* mode=dump writes every layer's Q/K/V at every time in the layout exp_* --input reads: the values of the model's
 * qkv activation on the first held-out batch at that time. */
static void test_dump(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    char err[512], path[256], file[600];
    char *dir = temp_dir();
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    sparge_device *dev = open_device("cpu");
    tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_non_null(m);
    randomize(tr_model_params(m), tr_model_num_params(m), 51, 0.3);
    assert_int_equal(tr_checkpoint_save(path, m, NULL, &c, err, sizeof err), 0);
    snprintf(c.init, sizeof c.init, "%s", path);
    snprintf(c.dump_dir, sizeof c.dump_dir, "%s/qkv", dir);
    snprintf(c.dump_times, sizeof c.dump_times, "0.2,0.8");
    c.mode = TR_MODE_DUMP;
    if (tr_dump(&c, err, sizeof err))
        fail_msg("%s", err);
    snprintf(file, sizeof file, "%s/manifest.csv", c.dump_dir);
    FILE *f = fopen(file, "r");
    assert_non_null(f);
    char line[256];
    int lines = 0;
    while (fgets(line, sizeof line, f))
        lines++;
    fclose(f);
    assert_int_equal(lines, 1 + 2 * c.depth);
    /* layer 1 at t = 0.8 against a forward of the same batch with a hook on the model */
    const tr_dims *d = tr_model_dims(m);
    size_t per = (size_t)c.batch * d->T * d->H * d->W * d->C;
    float *x0 = malloc(per * sizeof(float)), *eps = malloc(per * sizeof(float)), *xt = malloc(per * sizeof(float));
    float t[2];
    int y[2];
    tr_config held_out = c;
    tr_make_batch(&held_out, d, 1000000000, x0, y, t, eps, xt);
    t[0] = t[1] = 0.8f;
    for (size_t j = 0; j < per; j++)
        xt[j] = (1.0f - t[0]) * x0[j] + t[0] * eps[j];
    capture cap = {1, malloc((size_t)c.batch * d->N * 3 * d->d * sizeof(float)), (size_t)c.batch * d->N * 3 * d->d};
    tr_model_set_qkv_hook(m, capture_layer, &cap);
    assert_int_equal(tr_model_forward(m, xt, t, y, NULL, err, sizeof err), 0);
    snprintf(file, sizeof file, "%s/L01_t0.800.safetensors", c.dump_dir);
    const char *names[3] = {"q", "k", "v"};
    exp_qkv x;
    assert_int_equal(exp_load_qkv(file, names, 0, &x), 0);
    assert_true(x.B == c.batch && x.H == c.heads && x.N == d->N && x.D == d->hd);
    for (int b = 0; b < c.batch; b++)
        for (int h = 0; h < c.heads; h++)
            for (int n = 0; n < d->N; n++)
                for (int e = 0; e < d->hd; e++) {
                    size_t src = ((size_t)b * d->N + n) * 3 * d->d + (size_t)h * d->hd + e;
                    size_t dst = (((size_t)b * c.heads + h) * d->N + n) * d->hd + e;
                    assert_true(x.q[dst] == cap.qkv[src] && x.k[dst] == cap.qkv[src + d->d] &&
                                x.v[dst] == cap.qkv[src + 2 * d->d]);
                }
    exp_qkv_free(&x);
    free(cap.qkv), free(x0), free(eps), free(xt);
    tr_model_free(m);
    sparge_device_close(dev);
    remove_temp_dir(dir);
}

/* With only the final bias non-zero the velocity is constant, so Euler integration from t = 1 to
 * 0 must land on noise − velocity exactly, whatever the number of steps. */
static void test_euler_sampler(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    sparge_device *dev = open_device("cpu");
    char err[512];
    tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_non_null(m);
    assert_int_equal(tr_model_init(m, 1, err, sizeof err), 0);
    const tr_param *bias = tr_model_find(m, "final.linear.bias");
    assert_non_null(bias);
    randomize(tr_model_params(m) + bias->offset, bias->size, 21, 1.0);
    const tr_dims *d = tr_model_dims(m);
    size_t n = (size_t)c.batch * d->T * d->H * d->W * d->C;
    float *x = malloc(n * sizeof(float)), *noise = malloc(n * sizeof(float)), *u = malloc(n * sizeof(float));
    float *scratch = malloc(n * sizeof(float));
    randomize(noise, n, 22, 1.0);
    int y[2] = {0, 1};
    float t[2] = {0.5f, 0.5f};
    assert_int_equal(tr_model_forward(m, noise, t, y, u, err, sizeof err), 0);
    for (int steps = 1; steps <= 7; steps += 6) {
        memcpy(x, noise, n * sizeof(float));
        assert_int_equal(tr_sample_euler(m, x, y, steps, scratch, err, sizeof err), 0);
        for (size_t i = 0; i < n; i++)
            assert_float_equal(x[i], noise[i] - u[i], 1e-5);
    }
    /* the velocity is the bias of the token's patch entry: pixel (0,0) of each video gets bias[c] */
    for (int ch = 0; ch < d->C; ch++)
        assert_float_equal(u[ch], tr_model_params(m)[bias->offset + ch], 1e-6);
    free(x), free(noise), free(u), free(scratch);
    tr_model_free(m);
    sparge_device_close(dev);
}

static void mean_stats(char dist, uint64_t seed, int count, tr_video_stats *mean)
{
    const int T = 8, H = 16, W = 16, C = 3;
    float *v = malloc((size_t)T * H * W * C * sizeof(float));
    memset(mean, 0, sizeof *mean);
    for (int i = 0; i < count; i++) {
        int label;
        tr_video_stats s;
        tr_data_sample(dist, seed, (uint64_t)i, T, H, W, C, 4, v, &label);
        tr_video_statistics(v, T, H, W, C, &s);
        mean->sharpness += s.sharpness / count, mean->temporal_change += s.temporal_change / count;
        mean->temporal_jitter += s.temporal_jitter / count, mean->mean_c0 += s.mean_c0 / count;
    }
    free(v);
}

static void test_data(void **state)
{
    (void)state;
    const int T = 8, H = 16, W = 16, C = 3;
    size_t n = (size_t)T * H * W * C;
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    int la, lb, labels[4] = {0};
    for (int dist = 0; dist < 2; dist++) {
        char which = dist ? 'B' : 'A';
        tr_data_sample(which, 7, 3, T, H, W, C, 4, a, &la);
        tr_data_sample(which, 7, 3, T, H, W, C, 4, b, &lb);
        assert_memory_equal(a, b, n * sizeof(float)); /* a pure function of (seed, index) */
        assert_int_equal(la, lb);
        tr_data_sample(which, 8, 3, T, H, W, C, 4, b, &lb);
        assert_memory_not_equal(a, b, n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            assert_true(isfinite(a[i]) && fabsf(a[i]) < 3.0f);
    }
    for (int i = 0; i < 200; i++) {
        tr_data_sample('A', 1, (uint64_t)i, 2, 4, 4, 3, 4, a, &la);
        labels[la]++;
    }
    for (int k = 0; k < 4; k++)
        assert_true(labels[k] > 25); /* every class appears */
    tr_video_stats sa, sb;
    mean_stats('A', 1, 64, &sa);
    mean_stats('B', 1, 64, &sb);
    print_message("A: sharpness %.4f, temporal change %.4f, jitter %.4f, channel 0 %.4f\n", sa.sharpness,
                  sa.temporal_change, sa.temporal_jitter, sa.mean_c0);
    print_message("B: sharpness %.4f, temporal change %.4f, jitter %.4f, channel 0 %.4f\n", sb.sharpness,
                  sb.temporal_change, sb.temporal_jitter, sb.mean_c0);
    assert_true(sb.temporal_jitter > 1.5 * sa.temporal_jitter);
    assert_true(fabs(sb.mean_c0 - sa.mean_c0) > 0.1);
    /* rich scenes: pure functions of (seed, index) too, unlike the simple ones, and their class is the pan's
     * direction, which the recognizer reads off the frame differences */
    tr_data_sample_scene('A', TR_SCENE_RICH, 7, 3, T, H, W, C, 4, a, &la);
    tr_data_sample_scene('A', TR_SCENE_RICH, 7, 3, T, H, W, C, 4, b, &lb);
    assert_memory_equal(a, b, n * sizeof(float));
    tr_data_sample('A', 7, 3, T, H, W, C, 4, b, &lb);
    assert_memory_not_equal(a, b, n * sizeof(float));
    int correct = 0, rich_labels[4] = {0};
    for (int i = 0; i < 100; i++) {
        tr_motion mo;
        tr_data_sample_scene(i % 2 ? 'B' : 'A', TR_SCENE_RICH, 1, 3000000000ull + (uint64_t)i, T, H, W, C, 4, a, &la);
        for (size_t j = 0; j < n; j++)
            assert_true(isfinite(a[j]) && fabsf(a[j]) < 3.0f);
        tr_motion_estimate(a, T, H, W, C, 4, &mo);
        correct += i % 2 == 0 && mo.label == la;
        rich_labels[la]++;
    }
    print_message("recognizer on rich A scenes, 8x16x16x3, 4 classes: %.2f of 50\n", correct / 50.0);
    assert_true(correct >= 40);
    for (int k = 0; k < 4; k++)
        assert_true(rich_labels[k] > 10);
    free(a), free(b);
}

/* A batch is the sequential definition: per video its scene, its time, then its noise from one stream. */
static void test_make_batch(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.batch = 3, c.scene = TR_SCENE_RICH, c.seed = 5;
    tr_dims d = {.T = 4, .H = 8, .W = 10, .C = 3, .K = 4};
    size_t per = (size_t)d.T * d.H * d.W * d.C, n = c.batch * per;
    float *x0 = malloc(n * sizeof(float)), *eps = malloc(n * sizeof(float)), *xt = malloc(n * sizeof(float));
    float *rx0 = malloc(n * sizeof(float)), *reps = malloc(n * sizeof(float)), *rxt = malloc(n * sizeof(float));
    float t[3], rt[3];
    int y[3], ry[3];
    for (int64_t step = 0; step < 3; step++) {
        tr_make_batch(&c, &d, step * 1000003, x0, y, t, eps, xt);
        uint64_t s = tr_mix(c.seed * 0x100000001b3ull ^ tr_mix((uint64_t)(step * 1000003)));
        for (int b = 0; b < c.batch; b++) {
            tr_data_sample_scene('A', TR_SCENE_RICH, c.data_seed, (uint64_t)(step * 1000003) * c.batch + b, d.T, d.H,
                                 d.W, d.C, d.K, rx0 + b * per, &ry[b]);
            rt[b] = (float)tr_uniform(&s);
            for (size_t i = 0; i < per; i++) {
                reps[b * per + i] = (float)tr_normal(&s);
                rxt[b * per + i] = (1.0f - rt[b]) * rx0[b * per + i] + rt[b] * reps[b * per + i];
            }
        }
        assert_memory_equal(x0, rx0, n * sizeof(float));
        assert_memory_equal(y, ry, sizeof y);
        assert_memory_equal(t, rt, sizeof t);
        assert_memory_equal(eps, reps, n * sizeof(float));
        assert_memory_equal(xt, rxt, n * sizeof(float));
    }
    free(x0), free(eps), free(xt), free(rx0), free(reps), free(rxt);
}

/* ---------------------------------------------------------------- metrics */

/* Accuracy of the motion recognizer on `count` held-out videos of A (indices no stream reaches). */
static double recognizer_accuracy(int T, int H, int W, int C, int K, int count, double *strength)
{
    float *v = malloc((size_t)T * H * W * C * sizeof(float));
    int correct = 0;
    *strength = 0;
    for (int i = 0; i < count; i++) {
        int label;
        tr_motion m;
        tr_data_sample('A', 1, 3000000000ull + (uint64_t)i, T, H, W, C, K, v, &label);
        assert_int_equal(tr_motion_estimate(v, T, H, W, C, K, &m), 0);
        correct += m.label == label;
        *strength += m.strength / count;
    }
    free(v);
    print_message("recognizer on A, %d frames of %dx%dx%d, %d classes: accuracy %.3f, peak strength %.3f\n", T, H,
                  W, C, K, (double)correct / count, *strength);
    return (double)correct / count;
}

/* Floors a little below the accuracies measured on these 200 videos (README.md, "Evaluation"). */
static void test_motion_recognizer(void **state)
{
    (void)state;
    double strength;
    assert_true(recognizer_accuracy(8, 16, 16, 3, 4, 200, &strength) >= 0.97); /* tiny.cfg's shape */
    assert_true(strength > 0.6);
    assert_true(recognizer_accuracy(8, 16, 16, 3, 8, 200, &strength) >= 0.95);
    assert_true(recognizer_accuracy(3, 16, 24, 1, 6, 200, &strength) >= 0.90);
    assert_true(recognizer_accuracy(8, 32, 32, 3, 8, 100, &strength) >= 0.90);
    /* a blob moving at a known sub-pixel velocity over a static texture: vy > 0 is down the rows */
    const int T = 6, H = 16, W = 20, C = 2;
    float *v = malloc((size_t)T * H * W * C * sizeof(float));
    const double vx = 0.6, vy = -0.8;
    for (int t = 0; t < T; t++)
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                double dx = fmod(x - (5 + vx * t) + 1.5 * W, W) - W / 2.0; /* wrapped offset to the centre */
                double dy = fmod(y - (9 + vy * t) + 1.5 * H, H) - H / 2.0;
                for (int c = 0; c < C; c++)
                    v[(((size_t)t * H + y) * W + x) * C + c] =
                        (float)((c ? -1 : 1) * exp(-(dx * dx + dy * dy) / 4.5) + 0.3 * sin(0.9 * x + 2.0 * y + c));
            }
    tr_motion m;
    assert_int_equal(tr_motion_estimate(v, T, H, W, C, 16, &m), 0);
    print_message("blob at (0.6, -0.8) px/frame: estimated (%.3f, %.3f), strength %.3f\n", m.vx, m.vy, m.strength);
    assert_true(fabs(m.vx - vx) < 0.15 && fabs(m.vy - vy) < 0.15);
    assert_int_equal(m.label, 14); /* angle −53° = 307°, nearest of 16 directions: 14 · 22.5° = 315° */
    /* too few frames, or nothing moving: no label */
    assert_int_equal(tr_motion_estimate(v, 2, H, W, C, 4, &m), -1);
    assert_int_equal(m.label, -1);
    for (int t = 1; t < T; t++)
        memcpy(v + (size_t)t * H * W * C, v, (size_t)H * W * C * sizeof(float));
    assert_int_equal(tr_motion_estimate(v, T, H, W, C, 4, &m), -1);
    free(v);
}

/* On pure noise the recognizer guesses: accuracy against the classes near 1/K, no favoured class. */
static void test_motion_recognizer_chance(void **state)
{
    (void)state;
    const int T = 8, H = 16, W = 16, C = 3, count = 400;
    float *v = malloc((size_t)T * H * W * C * sizeof(float));
    uint64_t s = 99;
    for (int K = 4; K <= 8; K += 4) {
        int correct = 0, votes[8] = {0};
        double strength = 0;
        for (int i = 0; i < count; i++) {
            for (size_t j = 0; j < (size_t)T * H * W * C; j++)
                v[j] = (float)tr_normal(&s);
            int label = (int)(tr_uniform(&s) * K);
            tr_motion m;
            tr_motion_estimate(v, T, H, W, C, K, &m);
            correct += m.label == label;
            votes[m.label]++;
            strength += m.strength / count;
        }
        int most = 0;
        for (int k = 0; k < K; k++)
            most = votes[k] > most ? votes[k] : most;
        print_message("noise, %d classes: accuracy %.3f (chance %.3f), most frequent class %.3f, strength %.3f\n", K,
                      (double)correct / count, 1.0 / K, (double)most / count, strength);
        assert_true((double)correct / count < 1.5 / K);
        assert_true((double)most / count < 2.0 / K);
        assert_true(strength < 0.2);
    }
    free(v);
}

/* Feature rows of `count` videos of dist (seed 1, indices from `first`) at tiny.cfg's shape. */
static double *feature_rows(char dist, uint64_t first, int count)
{
    const int T = 8, H = 16, W = 16, C = 3;
    float *v = malloc((size_t)T * H * W * C * sizeof(float));
    double *f = malloc((size_t)count * TR_FEATURES * sizeof(double));
    for (int i = 0; i < count; i++) {
        int label;
        tr_data_sample(dist, 1, first + (uint64_t)i, T, H, W, C, 4, v, &label);
        assert_int_equal(tr_video_features(v, T, H, W, C, f + (size_t)i * TR_FEATURES), 0);
        for (int j = 0; j < TR_FEATURES; j++)
            assert_true(isfinite(f[(size_t)i * TR_FEATURES + j]));
    }
    free(v);
    return f;
}

/* Brute force: the softmax row of query i of (b, h), sorted descending, its normalized entropy and top mass. */
static void attention_row_reference(const float *qkv, int N, int heads, int hd, int b, int h, int i, int top,
                                    double *entropy, double *mass)
{
    const int d = heads * hd;
    double *p = malloc((size_t)N * sizeof(double)), z = 0, mx = -INFINITY;
    for (int j = 0; j < N; j++) {
        double dot = 0;
        for (int c = 0; c < hd; c++)
            dot += (double)qkv[((size_t)b * N + i) * 3 * d + h * hd + c] * qkv[((size_t)b * N + j) * 3 * d + d + h * hd + c];
        p[j] = dot / sqrt((double)hd);
        mx = fmax(mx, p[j]);
    }
    for (int j = 0; j < N; j++)
        z += p[j] = exp(p[j] - mx);
    *entropy = 0, *mass = 0;
    for (int j = 0; j < N; j++) {
        p[j] /= z;
        *entropy -= p[j] > 0 ? p[j] * log(p[j]) / log((double)N) : 0;
    }
    for (int r = 0; r < top; r++) { /* selection by repeated maximum: slow and obviously right */
        int best = 0;
        for (int j = 1; j < N; j++)
            best = p[j] > p[best] ? j : best;
        *mass += p[best];
        p[best] = -1;
    }
    free(p);
}

/* Token-level entropy and top mass: uniform rows (1, ⌈0.05 N⌉/N), a row on one key (≈ 0, ≈ 1), random rows against
 * the brute force, with query rows strided to max_rows per (b, h), ties included. */
static void test_attention_stats(void **state)
{
    (void)state;
    enum { B = 2, N = 37, HEADS = 3, HD = 5, D = HEADS * HD };
    float *qkv = calloc((size_t)B * N * 3 * D, sizeof(float));
    double e = 0, m = 0;
    long rows = 0;
    tr_attention_stats(qkv, B, N, HEADS, HD, 8, 0.05, &e, &m, &rows); /* q = 0: every row uniform */
    assert_int_equal(rows, B * HEADS * 8);                               /* rows 0, 5, …, 35 */
    assert_true(fabs(e / rows - 1.0) < 1e-12 && fabs(m / rows - 2.0 / N) < 1e-12);
    for (int b = 0; b < B; b++) /* every query 40 times key 0 of its sequence in every head; other keys 0 */
        for (int c = 0; c < D; c++) {
            qkv[((size_t)b * N) * 3 * D + D + c] = 1.0f;
            for (int i = 0; i < N; i++)
                qkv[((size_t)b * N + i) * 3 * D + c] = 40.0f;
        }
    e = m = 0, rows = 0;
    tr_attention_stats(qkv, B, N, HEADS, HD, N, 0.05, &e, &m, &rows);
    assert_int_equal(rows, B * HEADS * N);
    assert_true(e / rows < 1e-6 && m / rows > 1 - 1e-6);
    uint64_t seed = 7;
    for (size_t j = 0; j < (size_t)B * N * 3 * D; j++)
        qkv[j] = (float)(2.0 * tr_normal(&seed));
    for (int j = 0; j < N; j += 4) /* some equal keys: ties at the top-n boundary */
        memcpy(qkv + (size_t)j * 3 * D + D, qkv + D, D * sizeof(float));
    for (int top_pct = 5; top_pct <= 50; top_pct += 45) {
        const int top = (int)ceil(top_pct / 100.0 * N - 1e-9);
        double ref_e = 0, ref_m = 0;
        for (int b = 0; b < B; b++)
            for (int h = 0; h < HEADS; h++)
                for (int i = 0; i < N; i += 3) {
                    double re, rm;
                    attention_row_reference(qkv, N, HEADS, HD, b, h, i, top, &re, &rm);
                    ref_e += re, ref_m += rm;
                }
        e = m = 0, rows = 0;
        tr_attention_stats(qkv, B, N, HEADS, HD, 13, top_pct / 100.0, &e, &m, &rows); /* stride ⌈37/13⌉ = 3 */
        assert_int_equal(rows, B * HEADS * 13);
        assert_true(fabs(e - ref_e) < 1e-9 * ref_e && fabs(m - ref_m) < 1e-9 * ref_m);
        assert_true(ref_e / rows > 0.1 && ref_e / rows < 0.99); /* neither flat nor one-hot */
    }
    free(qkv);
}

static void test_frechet_distance(void **state)
{
    (void)state;
    if (eigen_solver_missing())
        skip();
    /* LAPACK's dsyevd: A v = λ v, orthonormal vectors and ascending values on a random symmetric matrix */
    enum { N = 9 };
    double a[N * N], work[N * N], values[N], vectors[N * N];
    uint64_t s = 5;
    for (int i = 0; i < N; i++)
        for (int j = 0; j <= i; j++)
            a[i * N + j] = a[j * N + i] = tr_normal(&s);
    memcpy(work, a, sizeof a);
    assert_int_equal(tr_symmetric_eigen(work, N, values, vectors), 0);
    for (int k = 0; k + 1 < N; k++)
        assert_true(values[k] <= values[k + 1]);
    for (int k = 0; k < N; k++)
        for (int i = 0; i < N; i++) {
            double av = 0, dot = 0;
            for (int j = 0; j < N; j++)
                av += a[i * N + j] * vectors[j * N + k], dot += vectors[j * N + i] * vectors[j * N + k];
            assert_true(fabs(av - values[k] * vectors[i * N + k]) < 1e-10);
            assert_true(fabs(dot - (i == k)) < 1e-10);
        }
    /* closed form: the 16 sign patterns of 4 dims, scaled and shifted, have sample mean μ and
     * diagonal covariance (16/15)·σ², so FD = Σ (μa − μb)² + (16/15)·Σ (σa − σb)²; rotating both
     * sets by the same rotation (non-diagonal covariances) leaves it unchanged */
    enum { D = 4, P = 16 };
    const double mu_a[D] = {0, 1, -2, 0.5}, mu_b[D] = {0.3, 1, -1, 0};
    const double sd_a[D] = {1, 2, 0.5, 1}, sd_b[D] = {2, 2, 1, 0.1};
    double xa[P * D], xb[P * D], ra[P * D], rb[P * D], expected = 0;
    for (int p = 0; p < P; p++)
        for (int j = 0; j < D; j++) {
            double sign = (p >> j) & 1 ? 1 : -1;
            xa[p * D + j] = mu_a[j] + sd_a[j] * sign, xb[p * D + j] = mu_b[j] + sd_b[j] * sign;
        }
    for (int j = 0; j < D; j++)
        expected += pow(mu_a[j] - mu_b[j], 2) + 16.0 / 15.0 * pow(sd_a[j] - sd_b[j], 2);
    double fd = tr_frechet_distance(xa, P, xb, P, D, NULL);
    print_message("Frechet distance of two diagonal Gaussians: %.12f, closed form %.12f\n", fd, expected);
    assert_true(fabs(fd - expected) < 1e-9 * expected);
    double c = cos(0.7), sn = sin(0.7), c2 = cos(-1.1), s2 = sin(-1.1); /* rotations in planes (0,1), (2,3) */
    for (int p = 0; p < P; p++) {
        const double *u = xa + p * D, *w = xb + p * D;
        ra[p * D] = c * u[0] - sn * u[1], ra[p * D + 1] = sn * u[0] + c * u[1];
        ra[p * D + 2] = c2 * u[2] - s2 * u[3], ra[p * D + 3] = s2 * u[2] + c2 * u[3];
        rb[p * D] = c * w[0] - sn * w[1], rb[p * D + 1] = sn * w[0] + c * w[1];
        rb[p * D + 2] = c2 * w[2] - s2 * w[3], rb[p * D + 3] = s2 * w[2] + c2 * w[3];
    }
    assert_true(fabs(tr_frechet_distance(ra, P, rb, P, D, NULL) - expected) < 1e-9 * expected);
    /* on video features: 0 for identical sets, symmetric, and B far from A compared with other A videos */
    double *ref = feature_rows('A', 3000000000ull, 128), *a2 = feature_rows('A', 5000000000ull, 64);
    double *b = feature_rows('B', 3000000000ull, 64), scale[TR_FEATURES];
    tr_feature_scales(ref, 128, TR_FEATURES, scale);
    for (int j = 0; j < TR_FEATURES; j++)
        assert_true(scale[j] > 0);
    assert_true(tr_frechet_distance(ref, 128, ref, 128, TR_FEATURES, scale) < 1e-9);
    double ab = tr_frechet_distance(a2, 64, b, 64, TR_FEATURES, scale);
    assert_true(fabs(ab - tr_frechet_distance(b, 64, a2, 64, TR_FEATURES, scale)) < 1e-9 * ab);
    double floor_a = tr_frechet_distance(a2, 64, ref, 128, TR_FEATURES, scale);
    double fd_b = tr_frechet_distance(b, 64, ref, 128, TR_FEATURES, scale);
    print_message("Frechet distance to 128 A videos: 64 other A videos %.3f, 64 B videos %.3f\n", floor_a, fd_b);
    assert_true(floor_a > 0 && fd_b > 20 * floor_a);
    free(ref), free(a2), free(b);
}

/* Imaging quality and temporal consistency: real A videos score better than B videos on both,
 * and A with added noise scores lower imaging quality. */
static void test_quality_scores(void **state)
{
    (void)state;
    const int count = 48, T = 8, H = 16, W = 16, C = 3;
    double *ref = feature_rows('A', 3000000000ull, count), *a = feature_rows('A', 5000000000ull, count);
    double *b = feature_rows('B', 5000000000ull, count), ref_mean[TR_FEATURES];
    tr_feature_mean(ref, count, TR_FEATURES, ref_mean);
    double iq_a = 0, iq_b = 0, iq_noisy = 0, tc_a = 0, tc_b = 0;
    float *v = malloc((size_t)T * H * W * C * sizeof(float));
    uint64_t s = 3;
    for (int i = 0; i < count; i++) {
        iq_a += tr_imaging_quality(a + (size_t)i * TR_FEATURES, ref_mean) / count;
        iq_b += tr_imaging_quality(b + (size_t)i * TR_FEATURES, ref_mean) / count;
        tc_a += a[(size_t)i * TR_FEATURES + TR_FEAT_TEMPORAL_CONSISTENCY] / count;
        tc_b += b[(size_t)i * TR_FEATURES + TR_FEAT_TEMPORAL_CONSISTENCY] / count;
        int label;
        double f[TR_FEATURES];
        tr_data_sample('A', 1, 5000000000ull + (uint64_t)i, T, H, W, C, 4, v, &label);
        for (size_t j = 0; j < (size_t)T * H * W * C; j++)
            v[j] += (float)(0.1 * tr_normal(&s));
        tr_video_features(v, T, H, W, C, f);
        iq_noisy += tr_imaging_quality(f, ref_mean) / count;
    }
    print_message("imaging quality A %.3f, A + N(0, 0.1) %.3f, B %.3f; temporal consistency A %.3f, B %.3f\n", iq_a,
                  iq_noisy, iq_b, tc_a, tc_b);
    assert_true(iq_a > 0.8 && iq_a <= 1.0 && iq_b < 0.6 && iq_noisy < iq_a - 0.15);
    assert_true(tc_a > 0.7 && tc_b < 0.5);
    free(v), free(ref), free(a), free(b);
}

/* mode=eval: the new scores of a freshly initialized model (adaLN-Zero: zero velocity, so its samples
 * are the noise) against real videos, and the new columns at the end of the CSV that sparge-train
 * prints (checked when the test runs in the build directory, as make check does). */
static void test_eval_scores(void **state)
{
    (void)state;
    if (eigen_solver_missing())
        skip();
    tr_config c = tiny_config();
    c.frames = 4, c.height = 8, c.width = 8, c.classes = 4, c.mode = TR_MODE_EVAL, c.sample_steps = 2, c.eval_batches = 3;
    char err[512], path[256];
    char *dir = temp_dir();
    snprintf(path, sizeof path, "%s/init.safetensors", dir);
    sparge_device *dev = open_device("cpu");
    tr_model *m = tr_model_create(&c, c.batch, dev, err, sizeof err);
    assert_non_null(m);
    assert_int_equal(tr_model_init(m, 3, err, sizeof err), 0);
    assert_int_equal(tr_checkpoint_save(path, m, NULL, &c, err, sizeof err), 0);
    tr_model_free(m);
    sparge_device_close(dev);
    snprintf(c.init, sizeof c.init, "%s", path);
    tr_eval_result r;
    if (tr_evaluate(&c, &r, err, sizeof err))
        fail_msg("%s", err);
    print_message("eval of an untrained model: class accuracy %.3f (real %.3f), Frechet %.2f (floor %.2f), imaging "
                  "quality %.3f (real %.3f), temporal consistency %.3f (real %.3f)\n",
                  r.class_accuracy, r.reference_class_accuracy, r.frechet, r.frechet_floor, r.imaging_quality,
                  r.reference_imaging_quality, r.temporal_consistency, r.reference_temporal_consistency);
    assert_true(r.class_accuracy >= 0 && r.class_accuracy <= 1 && r.reference_class_accuracy >= 0.8);
    assert_true(r.frechet_floor >= 0 && r.frechet > 2 * r.frechet_floor);
    assert_true(r.reference_imaging_quality > r.imaging_quality);
    assert_true(r.reference_temporal_consistency > r.temporal_consistency);
    /* an untrained model attends almost uniformly: normalized entropy near 1, its top 5 % of keys near 5 % of the mass */
    print_message("attention entropy %.4f, top-5 %% mass %.4f\n", r.attention_entropy, r.attention_top5_mass);
    assert_true(r.attention_entropy > 0.9 && r.attention_entropy <= 1.0);
    assert_true(r.attention_top5_mass >= 0.05 && r.attention_top5_mass < 0.3);
    const char *program = "experiments/trainer/sparge-train";
    if (access(program, X_OK) == 0) {
        char command[1024], header[1024], row[1024];
        snprintf(command, sizeof command,
                 "%s frames=4 height=8 width=8 channels=3 dim=12 heads=2 depth=2 classes=4 mlp_ratio=2 block_q=4 "
                 "block_k=2 batch=2 eval_batches=3 sample_steps=2 mode=eval init=%s",
                 program, path);
        FILE *p = popen(command, "r");
        assert_non_null(p);
        assert_non_null(fgets(header, sizeof header, p));
        assert_non_null(fgets(row, sizeof row, p));
        assert_int_equal(pclose(p), 0);
        int columns = 1;
        for (const char *h = header; (h = strchr(h, ',')); h++)
            columns++;
        assert_int_equal(columns, 23);
        assert_non_null(strstr(header, "ref_mean_c0,class_accuracy,ref_class_accuracy,frechet,frechet_floor,"
                                       "imaging_quality,ref_imaging_quality,temporal_consistency,"
                                       "ref_temporal_consistency,attention_entropy,attention_top5_mass\n"));
        double values[23];
        char *cursor = row;
        for (int i = 0; i < 23; i++, cursor++)
            values[i] = strtod(cursor, &cursor);
        assert_true(fabs(values[21] - r.attention_entropy) < 1e-5 && fabs(values[22] - r.attention_top5_mass) < 1e-5);
        double class_accuracy = values[13], frechet = values[15]; /* the 14th and 16th columns */
        print_message("sparge-train mode=eval: class_accuracy %.4f, frechet %.5g\n", class_accuracy, frechet);
        assert_true(isfinite(class_accuracy) && frechet >= 0);
        assert_true(fabs(frechet - r.frechet) < 1e-3 * r.frechet); /* the same evaluation, printed to 5 digits */
    } else
        print_message("%s not found from this directory: its CSV columns are not checked here\n", program);
    unlink(path);
    rmdir(dir);
    free(dir);
}

static void test_config(void **state)
{
    (void)state;
    tr_config c;
    char err[512];
    tr_config_defaults(&c);
    assert_int_equal(tr_config_set(&c, "dim=96", err, sizeof err), 0);
    assert_int_equal(c.dim, 96);
    assert_int_equal(tr_config_set(&c, "--attn=hybrid", err, sizeof err), 0);
    assert_int_equal(c.attn, TR_ATTN_HYBRID);
    assert_int_equal(tr_config_set(&c, "lr = 1e-3", err, sizeof err), 0);
    assert_true(c.lr == 1e-3);
    assert_int_equal(tr_config_set(&c, "dims=3", err, sizeof err), -1);
    assert_non_null(strstr(err, "unknown key"));
    assert_int_equal(tr_config_set(&c, "depth=two", err, sizeof err), -1);
    assert_int_equal(tr_config_set(&c, "loss=l1", err, sizeof err), -1);
    /* a seed is not negative (it would wrap to 2^64 - 1) */
    assert_int_equal(tr_config_set(&c, "seed=-1", err, sizeof err), -1);
    assert_non_null(strstr(err, "seed=-1"));
    assert_int_equal(tr_config_set(&c, "data_seed=+3", err, sizeof err), -1);
    assert_true(c.seed == 0 && c.data_seed == 1);
    assert_int_equal(tr_config_check(&c, err, sizeof err), 0);
    c.heads = 5;
    assert_int_equal(tr_config_check(&c, err, sizeof err), -1);
    assert_non_null(strstr(err, "heads"));
    /* switches are 0 or 1 */
    static const char *const switches[] = {"device_ops=2", "tf32=-1", "stage_attention=7"};
    for (size_t i = 0; i < sizeof switches / sizeof switches[0]; i++) {
        tr_config_defaults(&c);
        assert_int_equal(tr_config_set(&c, switches[i], err, sizeof err), 0);
        assert_int_equal(tr_config_check(&c, err, sizeof err), -1);
        if (!strstr(err, switches[i]))
            fail_msg("'%s': message '%s' does not name it", switches[i], err);
    }
    /* a negative clipping norm; a run stopped by its time limit without a checkpoint to resume from */
    static const char *const refused[][2] = {{"grad_clip=-1", "grad_clip=-1"}, {"time_limit=60", "out="}};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        tr_config_defaults(&c);
        assert_int_equal(tr_config_set(&c, refused[i][0], err, sizeof err), 0);
        assert_int_equal(tr_config_check(&c, err, sizeof err), -1);
        if (!strstr(err, refused[i][1]))
            fail_msg("'%s': message '%s' does not say '%s'", refused[i][0], err, refused[i][1]);
    }
    tr_config_defaults(&c);
    assert_int_equal(tr_config_set(&c, "time_limit=60", err, sizeof err), 0);
    assert_int_equal(tr_config_set(&c, "out=run", err, sizeof err), 0);
    assert_int_equal(tr_config_set(&c, "grad_clip=0", err, sizeof err), 0);
    assert_int_equal(tr_config_check(&c, err, sizeof err), 0);
    tr_config_defaults(&c);
    /* the run's record reads back as the same configuration */
    tr_config r, back;
    tr_config_defaults(&r);
    assert_int_equal(tr_config_set(&r, "adaln=single", err, sizeof err), 0);
    assert_int_equal(tr_config_set(&r, "scene=rich", err, sizeof err), 0);
    assert_int_equal(tr_config_set(&r, "mode=dump", err, sizeof err), 0);
    assert_int_equal(tr_config_set(&r, "tag=commit=abc123", err, sizeof err), 0);
    assert_int_equal(tr_config_set(&r, "lr=0.1", err, sizeof err), 0);
    assert_int_equal(tr_config_set(&r, "scene=fancy", err, sizeof err), -1);
    char record[8192];
    tr_config_string(&r, record, sizeof record);
    tr_config_defaults(&back);
    for (char *kv = strtok(record, " "); kv; kv = strtok(NULL, " "))
        if (tr_config_set(&back, kv, err, sizeof err))
            fail_msg("%s", err);
    assert_memory_equal(&r, &back, sizeof r);
    char cfg[] = "/tmp/test_trainer_cfg_XXXXXX";
    int fd = mkstemp(cfg);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "# comment\nframes = 4  # trailing\n\nheight=8\nbogus=1\n");
    fclose(f);
    tr_config_defaults(&c);
    assert_int_equal(tr_config_load(&c, cfg, err, sizeof err), -1);
    assert_non_null(strstr(err, ":5:"));
    assert_int_equal(c.frames, 4);
    /* a key set twice in one file is refused with both lines (overrides after the file still apply in order) */
    f = fopen(cfg, "w");
    fprintf(f, "frames = 4\nheight=8\n--frames=6\n");
    fclose(f);
    tr_config_defaults(&c);
    assert_int_equal(tr_config_load(&c, cfg, err, sizeof err), -1);
    assert_non_null(strstr(err, ":3: frames is already set on line 1"));
    /* a line too long for the reader is refused, not split */
    f = fopen(cfg, "w");
    fprintf(f, "tag = ");
    for (int i = 0; i < 1100; i++)
        fputc('x', f);
    fprintf(f, "\nframes = 2\n");
    fclose(f);
    tr_config_defaults(&c);
    assert_int_equal(tr_config_load(&c, cfg, err, sizeof err), -1);
    assert_non_null(strstr(err, ":1: line longer than"));
    unlink(cfg);
    assert_int_equal(tr_config_load(&c, cfg, err, sizeof err), -1);
    assert_non_null(strstr(err, "No such file or directory"));
}

/* The steps of a loss log (its first column) in order into steps[]; returns how many, -1 without the header line. */
static int log_steps(const char *path, long long *steps, int cap)
{
    FILE *f = fopen(path, "r");
    char line[1024];
    int n = 0;
    if (!f || !fgets(line, sizeof line, f) || strncmp(line, "step,loss,", 10)) {
        if (f)
            fclose(f);
        return -1;
    }
    while (n < cap && fgets(line, sizeof line, f))
        steps[n++] = atoll(line);
    fclose(f);
    return n;
}

/* A resumed run's loss log: the rows of the steps after the checkpoint are those of the resumed run, once (a run
 * stopped after its checkpoint had logged a step that runs again), and a new log file gets its header. */
static void test_resume_log(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    c.log_every = 100;
    char err[512], ckpt[256], logp[256], fresh[256], *dir = temp_dir();
    snprintf(ckpt, sizeof ckpt, "%s/ckpt.safetensors", dir);
    snprintf(logp, sizeof logp, "%s/log.csv", dir);
    snprintf(fresh, sizeof fresh, "%s/fresh.csv", dir);
    c.steps = 3;
    snprintf(c.out, sizeof c.out, "%s", ckpt);
    snprintf(c.log, sizeof c.log, "%s", logp);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    FILE *f = fopen(logp, "a"); /* the row of a step the stopped run logged after its checkpoint */
    fprintf(f, "4,1.0,1.0,0.0003,0.000000,1.0,1.0,1.0,1.0,1.0\n");
    fclose(f);
    c.steps = 5;
    snprintf(c.resume, sizeof c.resume, "%s", ckpt);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    long long steps[8];
    assert_int_equal(log_steps(logp, steps, 8), 5);
    for (int i = 0; i < 5; i++)
        assert_int_equal(steps[i], i + 1);
    c.steps = 6;
    snprintf(c.log, sizeof c.log, "%s", fresh);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    assert_int_equal(log_steps(fresh, steps, 8), 1);
    assert_int_equal(steps[0], 6);
    unlink(ckpt), unlink(logp), unlink(fresh);
    rmdir(dir);
    free(dir);
}

/* A log path that is a link is written through it (the drivers' outputs do the same), not replaced by a file. */
static void test_log_through_link(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    char err[512], target[256], *dir = temp_dir();
    c.steps = 2;
    snprintf(target, sizeof target, "%s/target.csv", dir);
    snprintf(c.log, sizeof c.log, "%s/link.csv", dir);
    assert_int_equal(symlink("target.csv", c.log), 0);
    assert_int_equal(tr_train(&c, err, sizeof err), 0);
    struct stat st;
    assert_int_equal(lstat(c.log, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    long long steps[4];
    assert_int_equal(log_steps(target, steps, 4), 2);
    unlink(c.log), unlink(target);
    rmdir(dir);
    free(dir);
}

/* A checkpoint path that cannot be written is refused before the first step, and leaves nothing behind. */
static void test_unwritable_out(void **state)
{
    (void)state;
    tr_config c = tiny_config();
    char err[512], *dir = temp_dir();
    c.steps = 3;
    snprintf(c.out, sizeof c.out, "/nonexistent-dir/out.safetensors");
    snprintf(c.log, sizeof c.log, "%s/log.csv", dir);
    assert_int_equal(tr_train(&c, err, sizeof err), -1);
    assert_non_null(strstr(err, "out=/nonexistent-dir/out.safetensors"));
    assert_non_null(strstr(err, "No such file or directory"));
    assert_int_equal(access(c.log, F_OK), -1); /* no step ran */
    rmdir(dir);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_unwritable_out),
        cmocka_unit_test(test_resume_log),
        cmocka_unit_test(test_log_through_link),
        cmocka_unit_test(test_data),
        cmocka_unit_test(test_make_batch),
        cmocka_unit_test(test_gradient_dense),
        cmocka_unit_test(test_gradient_hybrid_mask),
        cmocka_unit_test(test_gradient_adaln_single),
        cmocka_unit_test(test_sharded_resume),
        cmocka_unit_test(test_calibrate),
        cmocka_unit_test(test_dump),
        cmocka_unit_test(test_euler_sampler),
        cmocka_unit_test(test_staged_attention),
        cmocka_unit_test(test_checkpoint_roundtrip),
        cmocka_unit_test(test_resume_and_distillation),
        cmocka_unit_test(test_training_lowers_loss),
        cmocka_unit_test(test_motion_recognizer),
        cmocka_unit_test(test_motion_recognizer_chance),
        cmocka_unit_test(test_attention_stats),
        cmocka_unit_test(test_frechet_distance),
        cmocka_unit_test(test_quality_scores),
        cmocka_unit_test(test_eval_scores),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
