/* exp_speed: kernel time against sparsity on one backend, timed with the
 * library's device timers (sparge_timer_start/stop: CUDA/HIP events on GPUs,
 * wall clock after a synchronize on CPUs). Median of --reps runs after
 * --warmup runs, for: dense attention (mask NULL), mask prediction (pool +
 * map + select) and the block-sparse forward (optionally the backward).
 * Levels are Top-k masks (k = 1 − sparsity: every row keeps the same count, so
 * the sparsity is exact) and, with --hybrid, the paper's hybrid masks, whose
 * rows keep uneven counts; inputs come from one synthetic family (--family,
 * default uniform; video gives the hybrid k = 0.03, p = 0.2 about 94.5 %). */
#define _POSIX_C_SOURCE 200809L /* getpid */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "exp.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef enum { OP_DENSE, OP_MASK, OP_SPARSE, OP_DENSE_BWD, OP_SPARSE_BWD } op_kind;

typedef struct {
    sparge_device *dev;
    sparge_tensor q, k, v, o, d_o, dq, dk, dv;
    float *lse;
    sparge_mask *mask;
    sparge_mask_params mp;
} bench;

static sparge_status run_op(bench *b, op_kind op)
{
    switch (op) {
    case OP_DENSE: return sparge_attention_forward(b->dev, &b->q, &b->k, &b->v, NULL, NULL, &b->o, b->lse);
    case OP_MASK: return sparge_mask_predict(b->dev, &b->q, &b->k, &b->mp, b->mask);
    case OP_SPARSE: return sparge_attention_forward(b->dev, &b->q, &b->k, &b->v, b->mask, NULL, &b->o, b->lse);
    case OP_DENSE_BWD:
        return sparge_attention_backward(b->dev, &b->q, &b->k, &b->v, &b->o, &b->d_o, b->lse, NULL, NULL, &b->dq,
                                         &b->dk, &b->dv);
    case OP_SPARSE_BWD:
        return sparge_attention_backward(b->dev, &b->q, &b->k, &b->v, &b->o, &b->d_o, b->lse, b->mask, NULL, &b->dq,
                                         &b->dk, &b->dv);
    }
    return SPARGE_ERR_INVALID;
}

static double median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

static int timed(bench *b, op_kind op, double *ms)
{
    return exp_check(sparge_timer_start(b->dev), "sparge_timer_start") || exp_check(run_op(b, op), "timed run") ||
                   exp_check(sparge_timer_stop(b->dev, ms), "sparge_timer_stop")
               ? -1
               : 0;
}

/* Median times in ms of op_a and (if op_b >= 0) op_b, run alternately so that
 * both see the same machine (the CPU may be shared): a ratio of the two is
 * then robust to load that drifts during the sweep. Returns 0 / -1. */
static int time_ops(bench *b, int op_a, int op_b, int warmup, int reps, double *ta, double *tb)
{
    double *a = malloc(sizeof(double) * (size_t)reps), *c = malloc(sizeof(double) * (size_t)reps);
    int rc = a && c ? 0 : -1;
    for (int i = 0; !rc && i < warmup; i++)
        rc = exp_check(run_op(b, (op_kind)op_a), "warm-up run") ||
             (op_b >= 0 && exp_check(run_op(b, (op_kind)op_b), "warm-up run"));
    for (int i = 0; !rc && i < reps; i++)
        rc = timed(b, (op_kind)op_a, &a[i]) || (op_b >= 0 && timed(b, (op_kind)op_b, &c[i]));
    if (!rc) {
        *ta = median(a, reps);
        if (op_b >= 0)
            *tb = median(c, reps);
    }
    free(a);
    free(c);
    return rc;
}

/* --hybrid: up to 16 (k, p) pairs. */
typedef struct {
    double kp[2 * 16];
    int n;
} hybrid_list;

static const char *parse_hybrid(void *ptr, const char *list)
{
    hybrid_list *h = ptr;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", list);
    h->n = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        double k, p;
        char end;
        if (h->n == 16 || sscanf(tok, "%lf:%lf%c", &k, &p, &end) != 2 || !(k >= 0.0 && k <= 1.0) ||
            !(p >= 0.0 && p <= 1.0))
            return "up to 16 k:p pairs separated by commas, with k and p in [0, 1]";
        h->kp[2 * h->n] = k;
        h->kp[2 * h->n + 1] = p;
        h->n++;
    }
    return h->n ? NULL : "up to 16 k:p pairs separated by commas, with k and p in [0, 1]";
}

static void show_hybrid(const void *ptr, char *buf, size_t len)
{
    const hybrid_list *h = ptr;
    snprintf(buf, len, "%s", h->n ? "" : "none");
    for (int i = 0; i < h->n; i++)
        snprintf(buf + strlen(buf), len - strlen(buf), "%s%g:%g", i ? "," : "", h->kp[2 * i], h->kp[2 * i + 1]);
}

static double sp[32] = {0.0, 0.5, 0.75, 0.9, 0.95, 0.97, 0.98}, paper_speedup = 16.2;
static int nsp = 7, reps = 10, warmup = 2, backward = 0, family = EXP_UNIFORM;
static hybrid_list hybrid;
static const char *export_prefix;
static int64_t batch = 1;

static const char csv_header[] =
    "backend,device,dtype,B,H,N,D,target_sparsity,sparsity,token_density,mask_ms,fwd_ms,total_ms,dense_ms,speedup_fwd,"
    "speedup_total,dense_equiv_tflops,effective_tflops,bwd_ms,dense_bwd_ms,speedup_bwd,rule,topk,topp,min_row_blocks,"
    "max_row_blocks\n";

static int run(exp_opts *o)
{
    if (nsp + hybrid.n == 0) {
        fprintf(stderr, "exp_speed: nothing to time: --sparsities none needs --hybrid\n");
        return 2;
    }
    if (export_prefix) { /* each mask is written after its level's timing: learn now, not then, that it cannot be */
        char probe[1100];
        snprintf(probe, sizeof probe, "%s.part%ld", export_prefix, (long)getpid());
        FILE *f = fopen(probe, "w");
        if (!f) {
            fprintf(stderr, "exp_speed: --export-masks %s: cannot write there: %s\n", export_prefix, strerror(errno));
            return 2;
        }
        fclose(f);
        unlink(probe);
    }
    int nhyb = hybrid.n;
    const double *hyb = hybrid.kp;
    o->gen[family].B = batch;
    exp_qkv x;
    exp_gen_params g;
    if (exp_family_input(o, o->input ? EXP_FILE : (exp_family)family, 0, &g, &x))
        return 1;
    FILE *csv = o->csv, *md = o->md;
    bench b = {0};
    if (exp_check(sparge_device_open(o->backend, &b.dev), "sparge_device_open"))
        return 1;
    size_t n = (size_t)(x.B * x.H * x.N * x.D), es = sparge_dtype_size(o->dtype);
    void *buf[8] = {0};
    const float *src[8] = {x.q, x.k, x.v, NULL, x.v, NULL, NULL, NULL}; /* d_o: reuse V as a fixed upstream gradient */
    int nbuf = backward ? 8 : 4;
    uint16_t *tmp = o->dtype == SPARGE_F32 ? NULL : malloc(n * 2);
    for (int i = 0; i < nbuf; i++) {
        if (exp_check(sparge_malloc(b.dev, n * es, &buf[i]), "sparge_malloc"))
            return 1;
        if (src[i]) {
            const void *h = src[i];
            if (tmp) {
                for (size_t e = 0; e < n; e++)
                    tmp[e] = o->dtype == SPARGE_F16 ? sparge_f32_to_f16(src[i][e]) : sparge_f32_to_bf16(src[i][e]);
                h = tmp;
            }
            if (exp_check(sparge_memcpy_to_device(b.dev, buf[i], h, n * es), "sparge_memcpy_to_device"))
                return 1;
        }
    }
    free(tmp);
    sparge_tensor *views[8] = {&b.q, &b.k, &b.v, &b.o, &b.d_o, &b.dq, &b.dk, &b.dv};
    for (int i = 0; i < nbuf; i++)
        *views[i] = sparge_tensor_bhnd(buf[i], o->dtype, x.B, x.H, x.N, x.D);
    void *lse = NULL;
    if (exp_check(sparge_malloc(b.dev, (size_t)(x.B * x.H * x.N) * sizeof(float), &lse), "sparge_malloc") ||
        exp_check(sparge_mask_create(b.dev, x.B, x.H, x.N, x.N, g.block_q, g.block_k, &b.mask), "sparge_mask_create"))
        return 1;
    b.lse = lse;
    double flops = 4.0 * (double)x.B * (double)x.H * (double)x.N * (double)x.N * (double)x.D;
    exp_progress(o, "%s on %s (%s), B=%lld H=%lld N=%lld D=%lld %s, median of %d after %d warm-up",
                 x.label, sparge_device_name(b.dev), sparge_device_description(b.dev), (long long)x.B, (long long)x.H,
                 (long long)x.N, (long long)x.D, sparge_dtype_name(o->dtype), reps, warmup);
    /* a first dense measurement for the header; each sparsity level re-times dense alternately with sparse */
    double t_dense, t_dense_bwd = -1.0;
    if (time_ops(&b, OP_DENSE, -1, warmup, reps, &t_dense, NULL) ||
        (backward && time_ops(&b, OP_DENSE_BWD, -1, warmup, reps, &t_dense_bwd, NULL)))
        return 1;
    exp_progress(o, "  dense forward %.3f ms (%.3f TFLOP/s)", t_dense, flops / t_dense * 1e-9);
    fprintf(md, "Device: %s (%s). Shape B=%lld H=%lld N=%lld D=%lld, %s, blocks %dx%d. Median of %d runs after %d "
                "warm-up; timer: sparge_timer_start/stop. Each sparse forward is timed alternately with a dense "
                "forward (mask NULL) and compared with that dense median, so a shared machine's drifting load "
                "cancels in the ratio."
                "\n\nDense forward, first measurement: %.3f ms (%.3f TFLOP/s).\n\n",
            sparge_device_name(b.dev), sparge_device_description(b.dev), (long long)x.B, (long long)x.H,
            (long long)x.N, (long long)x.D, sparge_dtype_name(o->dtype), g.block_q, g.block_k, reps, warmup, t_dense,
            flops / t_dense * 1e-9);
    if (backward)
        fprintf(md, "Dense backward: %.3f ms.\n\n", t_dense_bwd);
    fprintf(md, "| mask | sparsity | rows' kept blocks (min–max) | token density | mask prediction ms | sparse forward ms "
                "| dense forward ms (paired) | total ms | speedup (forward) | speedup (with mask) | dense-equiv. TFLOP/s "
                "| effective TFLOP/s |%s\n|---|---|---|---|---|---|---|---|---|---|---|---|%s\n",
            backward ? " backward ms | speedup (backward) |" : "", backward ? "---|---|" : "");
    double speedup_at_95 = NAN;
    int64_t nkb = (x.N + g.block_k - 1) / g.block_k, last_count = -1;
    for (int i = 0; i < nsp + nhyb; i++) {
        double topk, topp = 0.0, target = -1.0; /* target: the Top-k level's sparsity, -1 for hybrid masks */
        char rule[64], prefix[1024];
        if (i < nsp) {
            /* Top-k with exactly `count` blocks per row; targets rounding to the same count are run once */
            int64_t count = (int64_t)floor((1.0 - sp[i]) * (double)nkb + 1e-6);
            count = count < 1 ? 1 : count > nkb ? nkb : count;
            if (count == last_count)
                continue;
            last_count = count;
            topk = exp_topk_for_count(count, nkb);
            target = sp[i];
            snprintf(rule, sizeof rule, "Top-k");
        } else {
            topk = hyb[2 * (i - nsp)];
            topp = hyb[2 * (i - nsp) + 1];
            snprintf(rule, sizeof rule, "hybrid k=%g p=%g", topk, topp);
        }
        b.mp = (sparge_mask_params){g.block_q, g.block_k, topk, topp, 0.0f, 0};
        sparge_mask_stats st;
        double t_mask, t_fwd, t_bwd = -1.0;
        if (time_ops(&b, OP_MASK, -1, warmup, reps, &t_mask, NULL) ||
            exp_check(sparge_mask_get_stats(b.mask, &st, NULL, NULL), "sparge_mask_get_stats") ||
            time_ops(&b, OP_DENSE, OP_SPARSE, warmup, reps, &t_dense, &t_fwd) ||
            (backward && time_ops(&b, OP_DENSE_BWD, OP_SPARSE_BWD, warmup, reps, &t_dense_bwd, &t_bwd)))
            return 1;
        if (export_prefix) {
            if (i < nsp)
                snprintf(prefix, sizeof prefix, "%s-s%05.2f", export_prefix, 100.0 * st.sparsity);
            else
                snprintf(prefix, sizeof prefix, "%s-k%g-p%g", export_prefix, topk, topp);
            if (exp_check(sparge_mask_export(b.mask, prefix, x.D, o->dtype), "sparge_mask_export"))
                return 1;
        }
        double total = t_mask + t_fwd;
        if (i < nsp && fabs(st.sparsity - 0.95) < 0.01)
            speedup_at_95 = t_dense / total;
        fprintf(md, "| %s | %.2f %% | %d–%d | %.4f | %.3f | %.3f | %.3f | %.3f | %.2f× | %.2f× | %.3f | %.3f |", rule,
                100.0 * st.sparsity, st.min_row_blocks, st.max_row_blocks, st.token_density, t_mask, t_fwd, t_dense,
                total, t_dense / t_fwd, t_dense / total, flops / total * 1e-9,
                flops * (1.0 - st.sparsity) / t_fwd * 1e-9);
        if (backward)
            fprintf(md, " %.3f | %.2f× |", t_bwd, t_dense_bwd / t_bwd);
        fprintf(md, "\n");
        if (csv)
            fprintf(csv, "%s,%s,%s,%lld,%lld,%lld,%lld,%.4f,%.6f,%.6f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,"
                         "%.4f,%.4f,%s,%g,%g,%d,%d\n",
                    sparge_device_backend(b.dev), sparge_device_name(b.dev), sparge_dtype_name(o->dtype), (long long)x.B,
                    (long long)x.H, (long long)x.N, (long long)x.D, target, st.sparsity, st.token_density, t_mask, t_fwd,
                    total, t_dense, t_dense / t_fwd, t_dense / total, flops / total * 1e-9,
                    flops * (1.0 - st.sparsity) / t_fwd * 1e-9, t_bwd, t_dense_bwd,
                    backward ? t_dense_bwd / t_bwd : -1.0, i < nsp ? "topk" : "hybrid", topk, topp, st.min_row_blocks,
                    st.max_row_blocks);
        exp_progress(o, "  %s, sparsity %.4f: mask %.3f ms, sparse forward %.3f ms, speedup %.2fx (%.2fx with "
                     "mask)", rule, st.sparsity, t_mask, t_fwd, t_dense / t_fwd, t_dense / total);
    }
    if (!isnan(speedup_at_95))
        fprintf(md, "\nAt 95 %% sparsity: %.2f× over dense (mask prediction included); paper: %.1f× (RTX 5090, "
                    "their kernel against their dense baseline).\n",
                speedup_at_95, paper_speedup);
    for (int i = 0; i < nbuf; i++)
        sparge_free(b.dev, buf[i]);
    sparge_free(b.dev, lse);
    sparge_mask_destroy(b.mask);
    sparge_device_close(b.dev);
    exp_qkv_free(&x);
    return 0;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_I64("--batch", &batch, "B", 1, 4096, "batch size")},
        {EXP_LIST("--sparsities", sp, 32, &nsp, "S1,S2,...", 0.0, 1.0, "Top-k levels to time"), .none = "none"},
        {EXP_CUSTOM("--hybrid", &hybrid, "K:P,...", parse_hybrid, show_hybrid,
                    "also time hybrid masks (Top-k and Top-p) with these parameters")},
        {EXP_CHOICE("--family", &family, "uniform|sink|video", "synthetic inputs of that family (--grid for video)")},
        {EXP_INT("--reps", &reps, "R", 1, 1000000, "timed runs; the median is reported")},
        {EXP_INT("--warmup", &warmup, "W", 0, 1000000, "untimed runs before them")},
        {EXP_FLAG("--backward", &backward, "time the backward pass too")},
        {EXP_STR("--export-masks", &export_prefix, "PREFIX",
                 "write each level's mask as PREFIX-sNN.NN.{json,u8} (the format of `sparge bench --export-mask`, "
                 "read by experiments/peers/peer_bench.py)")},
        {EXP_DBL("--paper-speedup", &paper_speedup, "X", 0.0, DBL_MAX, "the paper's speedup at 95 % sparsity"),
         .excl = EXP_EXCL_MIN},
    };
    static const exp_driver d = {"exp_speed", "Attention time against sparsity on one backend, device-timed medians.",
                                 "--ref --seeds --families", own, EXP_COUNT(own), csv_header, .tokens = 4096,
                                 .run = run};
    return exp_main(&d, argc, argv);
}
