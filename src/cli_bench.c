/* sparge bench: time mask prediction (pool + map + select), forward and
 * backward on one backend, over a list of sparsity levels. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>

#include "cli.h"

static const char help[] =
    "usage: sparge bench [options]\n"
    "\n"
    "Times mask prediction (pooling + pooled map + hybrid selection), the block-sparse\n"
    "forward and backward on one backend, and prints a table (device timers, --reps runs after\n"
    "--warmup runs). Dense-equivalent TFLOP/s = 4*B*H*pairs*D / t (x2.5 for the backward), pairs\n"
    "the (query, key) pairs attention may use: Nq*Nk, each sequence's own with --varlen, those up\n"
    "to the diagonal with --causal; effective TFLOP/s counts only the kept token pairs.\n"
    "fwd+mask is timed as one operation\n"
    "(prediction then forward) when --ops has both; step (mask prediction, forward and backward\n"
    "as one operation: a training step's attention; no prediction on dense levels or without mask\n"
    "in --ops) when --ops has fwd and bwd.\n"
    "\n"
    "  --backend NAME      device: cpu, cpu-ref, cuda[:N], cuda-generic[:N], hip[:N], auto (default auto)\n"
    "  --B N --H N         batch and heads (default 1, 2)\n"
    "  --N N               tokens (default 8192); --Nq/--Nk set them apart\n"
    "  --D N               head dimension (default 128)\n"
    "  --dtype T           f32, f16, bf16 (default f32 on CPU, bf16 on GPU)\n"
    "  --layout L          bhnd or bnhd (default bhnd)\n"
    "  --block-q N --block-k N   mask blocks (default 128, 64)\n"
    "  --kv-heads N        K/V heads, dividing --H (grouped heads; default --H)\n"
    "  --causal            block-causal attention (bottom-right aligned)\n"
    "  --varlen LIST       packed sequences of these lengths (comma list summing to --N, the same for keys: --B 1,\n"
    "                      no other --Nk, at most 64 lengths; 0 is an empty sequence); the dense level then keeps\n"
    "                      every block of every sequence\n"
    "  --topk K --topp P   hybrid mask parameters (default 0.03, 0.2: the paper's)\n"
    "  --sparsity LIST     comma list of levels: 'dense', 'hybrid' (k, p above) or a target\n"
    "                      sparsity in [0,1) reached with Top-k = 1 - s (default dense,hybrid)\n"
    "  --ops LIST          subset of mask,fwd,bwd (default mask,fwd,bwd)\n"
    "  --reps N --warmup N timed and warm-up runs (default 10, 2)\n"
    "  --timing MODE       queued: the runs are issued back to back and the mean per run is\n"
    "                      reported (what a training loop sees, and how the peer scripts time);\n"
    "                      each: every run is timed alone, synchronized, and the median is\n"
    "                      reported (adds the host's launch latency to every run) (default queued)\n"
    "  --settle S          idle S seconds before each timed operation, so that it does not run in\n"
    "                      the power state the one before left (a GPU at its power cap after the\n"
    "                      dense level runs the sparse levels at lower clocks) (default 0)\n"
    "  --deterministic     backward without atomics (bitwise reproducible)\n"
    "  --seed N            input seed (default 1)\n"
    "  --option NAME=VALUE set a device option (repeatable; sparge info lists them)\n"
    "  --fallback          let a call the device's first tier cannot run fall back to its next tier\n"
    "                      (default: strict=on, so every figure comes from the tier the table names)\n"
    "  --output FILE       also write the rows as JSON (FILE.json) or else CSV, each with the run's shape\n"
    "                      (K/V heads, causal, the --varlen lengths)\n"
    "  --export-mask PFX   write the last masked level's mask as PFX.json + PFX.u8 (dense uint8 [B,H,Nqb,Nkb];\n"
    "                      with --varlen the dense level's too: every block of every sequence)\n"
    "\n"
    "example: sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity dense,0.9,0.95,hybrid\n";

typedef struct {
    char level[32];
    double sparsity, density;
    double mask_ms, fwd_ms, fwd_mask_ms, bwd_ms, step_ms;
} bench_row;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Time per run of op(ctx) after `settle` idle seconds and `warmup` runs, or NAN on failure: with `queued`, the mean
 * of `reps` runs issued back to back between one pair of device timers; otherwise the median of `reps` runs timed
 * one at a time. */
typedef sparge_status (*bench_op)(void *ctx);
static int bench_failed; /* an operation failed: the table shows NaN and the exit status is 1 */
static double time_op(sparge_device *dev, bench_op op, void *ctx, double settle, int warmup, int reps, int queued,
                      const char *what)
{
    sparge_status s = SPARGE_OK;
    double result = NAN;
    if (settle > 0.0) {
        struct timespec idle = {(time_t)settle, (long)((settle - floor(settle)) * 1e9)};
        while (thrd_sleep(&idle, &idle) == -1) /* interrupted: sleep the rest */
            ;
    }
    for (int i = 0; !s && i < warmup; i++)
        s = op(ctx);
    if (queued) {
        if (!s)
            s = sparge_timer_start(dev);
        for (int i = 0; !s && i < reps; i++)
            s = op(ctx);
        if (!s && !(s = sparge_timer_stop(dev, &result)))
            result /= reps;
    } else {
        double *t = malloc((size_t)reps * sizeof *t);
        if (!t)
            s = SPARGE_ERR_OUT_OF_MEMORY;
        for (int i = 0; !s && i < reps; i++)
            if (!(s = sparge_timer_start(dev)) && !(s = op(ctx)))
                s = sparge_timer_stop(dev, &t[i]);
        if (!s) {
            qsort(t, (size_t)reps, sizeof *t, cmp_double);
            result = reps % 2 ? t[reps / 2] : 0.5 * (t[reps / 2 - 1] + t[reps / 2]);
        }
        free(t);
    }
    if (s) {
        bench_failed = cli_fail(what, s);
        return NAN;
    }
    return result;
}

typedef struct {
    sparge_device *dev;
    sparge_tensor q, k, v, o, d_o, dq, dk, dv;
    float *lse;
    sparge_mask *mask; /* NULL: dense */
    sparge_mask_params mp;
    sparge_attn_params ap;
    int step_predicts; /* op_step starts with the mask prediction */
} bench_ctx;

static sparge_status op_mask(void *p)
{
    bench_ctx *c = p;
    return sparge_mask_predict(c->dev, &c->q, &c->k, &c->mp, c->mask);
}
static sparge_status op_fwd(void *p)
{
    bench_ctx *c = p;
    return sparge_attention_forward(c->dev, &c->q, &c->k, &c->v, c->mask, &c->ap, &c->o, c->lse);
}
static sparge_status op_mask_fwd(void *p)
{
    sparge_status s = op_mask(p);
    return s ? s : op_fwd(p);
}
static sparge_status op_bwd(void *p)
{
    bench_ctx *c = p;
    return sparge_attention_backward(c->dev, &c->q, &c->k, &c->v, &c->o, &c->d_o, c->lse, c->mask, &c->ap, &c->dq,
                                     &c->dk, &c->dv);
}
static sparge_status op_step(void *p)
{
    sparge_status s = ((bench_ctx *)p)->step_predicts ? op_mask_fwd(p) : op_fwd(p);
    return s ? s : op_bwd(p);
}

/* Each op of the run on the device's first tier (or with --fallback any tier), named in the header; 1 if one is
 * unsupported (said on stderr). */
static int check_tiers(sparge_device *dev, sparge_op_desc d, int want_mask, int want_fwd, int want_bwd, int det)
{
    const sparge_op ops[3] = {SPARGE_OP_MASK_PREDICT, SPARGE_OP_FORWARD, SPARGE_OP_BACKWARD};
    const int wanted[3] = {want_mask, want_fwd, want_bwd};
    printf("tiers:");
    const char *sep = " ";
    for (int i = 0; i < 3; i++) {
        if (!wanted[i])
            continue;
        d.op = ops[i];
        d.deterministic = i == 2 && det;
        const char *tier;
        if (sparge_device_supports(dev, &d, &tier)) {
            printf("\n");
            fprintf(stderr, "sparge bench: %s\n", sparge_last_error());
            return 1;
        }
        printf("%s%s on %s", sep, sparge_op_name(d.op), tier);
        sep = ", ";
    }
    cli_print_options(dev, "\noptions:");
    return 0;
}

/* 1 if the comma list holds only words of `allowed` (space separated) and at least one. */
static int words_in(const char *list, const char *allowed)
{
    int n = 0;
    for (const char *p = list; *p;) {
        const size_t len = strcspn(p, ",");
        int ok = 0;
        for (const char *a = allowed; *a;) {
            const size_t alen = strcspn(a, " ");
            ok |= alen == len && !strncmp(a, p, len);
            a += alen + (a[alen] == ' ');
        }
        if (!ok)
            return 0;
        n++;
        p += len + (p[len] == ',');
    }
    return n > 0;
}

int cli_bench(int argc, char **argv)
{
    const char *backend = "auto", *levels = "dense,hybrid", *ops = "mask,fwd,bwd", *output = NULL, *export_pfx = NULL,
               *dtype_s = NULL, *layout = "bhnd", *timing = "queued", *v;
    const char *options[16];
    int n_options = 0, fallback = 0;
    int64_t B = 1, H = 2, Nq = 8192, Nk = -1, D = 128, reps = 10, warmup = 2, seed = 1;
    int bq = 128, bk = 64, det = 0, causal = 0;
    int64_t Hkv = 0;
    const char *varlen = NULL;
    double topk = 0.03, topp = 0.2, settle = 0.0;
    const int64_t IMAX = INT32_MAX;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return 0;
        }
        if ((v = cli_opt(argc, argv, &i, "--backend"))) backend = v;
        else if ((v = cli_opt(argc, argv, &i, "--B"))) B = cli_int(v, "--B", 1, 65535);
        else if ((v = cli_opt(argc, argv, &i, "--H"))) H = cli_int(v, "--H", 1, 65535);
        else if ((v = cli_opt(argc, argv, &i, "--N"))) Nq = cli_int(v, "--N", 1, IMAX);
        else if ((v = cli_opt(argc, argv, &i, "--Nq"))) Nq = cli_int(v, "--Nq", 1, IMAX);
        else if ((v = cli_opt(argc, argv, &i, "--Nk"))) Nk = cli_int(v, "--Nk", 1, IMAX);
        else if ((v = cli_opt(argc, argv, &i, "--D"))) D = cli_int(v, "--D", 1, 4096);
        else if ((v = cli_opt(argc, argv, &i, "--dtype"))) dtype_s = v;
        else if ((v = cli_opt(argc, argv, &i, "--layout"))) layout = v;
        else if ((v = cli_opt(argc, argv, &i, "--block-q"))) bq = (int)cli_int(v, "--block-q", 1, IMAX);
        else if ((v = cli_opt(argc, argv, &i, "--block-k"))) bk = (int)cli_int(v, "--block-k", 1, IMAX);
        else if ((v = cli_opt(argc, argv, &i, "--kv-heads"))) Hkv = cli_int(v, "--kv-heads", 1, 65535);
        else if ((v = cli_opt(argc, argv, &i, "--varlen"))) varlen = v;
        else if (!strcmp(argv[i], "--causal")) causal = 1;
        else if ((v = cli_opt(argc, argv, &i, "--topk"))) topk = cli_double(v, "--topk", 0.0, 1.0);
        else if ((v = cli_opt(argc, argv, &i, "--topp"))) topp = cli_double(v, "--topp", 0.0, 1.0);
        else if ((v = cli_opt(argc, argv, &i, "--sparsity"))) levels = v;
        else if ((v = cli_opt(argc, argv, &i, "--ops"))) ops = v;
        else if ((v = cli_opt(argc, argv, &i, "--reps"))) reps = cli_int(v, "--reps", 1, 1000000);
        else if ((v = cli_opt(argc, argv, &i, "--warmup"))) warmup = cli_int(v, "--warmup", 0, 1000000);
        else if ((v = cli_opt(argc, argv, &i, "--seed"))) seed = cli_int(v, "--seed", 0, INT64_MAX);
        else if ((v = cli_opt(argc, argv, &i, "--output"))) output = v;
        else if ((v = cli_opt(argc, argv, &i, "--export-mask"))) export_pfx = v;
        else if ((v = cli_opt(argc, argv, &i, "--timing"))) timing = v;
        else if ((v = cli_opt(argc, argv, &i, "--settle"))) settle = cli_double(v, "--settle", 0.0, 3600.0);
        else if ((v = cli_opt(argc, argv, &i, "--option"))) {
            if (n_options == (int)(sizeof options / sizeof options[0]) || !strchr(v, '=')) {
                fprintf(stderr, "sparge bench: --option takes NAME=VALUE (at most 16), got '%s'\n", v);
                return 2;
            }
            options[n_options++] = v;
        } else if (!strcmp(argv[i], "--fallback")) fallback = 1;
        else if (!strcmp(argv[i], "--deterministic")) det = 1;
        else {
            fprintf(stderr, "sparge bench: unknown option '%s' (see sparge bench --help)\n", argv[i]);
            return 2;
        }
    }
    if (Nk < 0)
        Nk = Nq;
    if (!Hkv)
        Hkv = H;
    if (H % Hkv) {
        fprintf(stderr, "sparge bench: --kv-heads %lld must divide --H %lld\n", (long long)Hkv, (long long)H);
        return 2;
    }
    /* --varlen: the lengths of the packed sequences, the same for queries and keys. */
    int32_t cu[65];
    int n_seq = 0;
    if (varlen) {
        if (B != 1 || Nk != Nq) {
            fprintf(stderr, "sparge bench: --varlen packs the sequences into --B 1 and needs --Nk = --N\n");
            return 2;
        }
        cu[0] = 0;
        int64_t total = 0;
        /* Every comma separates two lengths: an empty one ("100,,200", "100,") is refused like any non-number. */
        for (const char *p = varlen;; p++) {
            const size_t len = strcspn(p, ",");
            if (n_seq == 64) {
                fprintf(stderr, "sparge bench: --varlen takes at most 64 lengths\n");
                return 2;
            }
            char *one = malloc(len + 1);
            if (!one) {
                fprintf(stderr, "sparge bench: out of memory\n");
                return 1;
            }
            memcpy(one, p, len);
            one[len] = 0;
            total += cli_int(one, "--varlen", 0, Nq);
            free(one);
            if (total > Nq)
                break;
            cu[++n_seq] = (int32_t)total;
            p += len;
            if (!*p)
                break;
        }
        if (total != Nq) {
            fprintf(stderr, "sparge bench: --varlen lengths must sum to --N = %lld\n", (long long)Nq);
            return 2;
        }
    }
    /* The lengths as parsed ("100,200"), for the header and the output file's rows. */
    char lengths[64 * 12] = "";
    for (int sq = 0; sq < n_seq; sq++)
        snprintf(lengths + strlen(lengths), sizeof lengths - strlen(lengths), "%s%d", sq ? "," : "", cu[sq + 1] - cu[sq]);
    if (causal && Nq > Nk) {
        fprintf(stderr, "sparge bench: --causal needs --N <= --Nk\n");
        return 2;
    }
    if (strcmp(timing, "queued") && strcmp(timing, "each")) {
        fprintf(stderr, "sparge bench: --timing must be queued or each, got '%s'\n", timing);
        return 2;
    }
    const int queued = !strcmp(timing, "queued");
    if (strcmp(layout, "bhnd") && strcmp(layout, "bnhd")) {
        fprintf(stderr, "sparge bench: --layout must be bhnd or bnhd, got '%s'\n", layout);
        return 2;
    }
    if (!words_in(ops, "mask fwd bwd")) {
        fprintf(stderr, "sparge bench: --ops takes a comma list of mask, fwd and bwd, got '%s'\n", ops);
        return 2;
    }
    if (!*levels) {
        fprintf(stderr, "sparge bench: --sparsity takes a comma list of dense, hybrid or a sparsity in [0, 1)\n");
        return 2;
    }
    /* Every level is checked before anything runs: a typo in the last one must not cost (or print) the others. */
    int nlevels = 0, any_hybrid = 0;
    for (const char *p = levels;; p++) {
        const size_t len = strcspn(p, ",");
        char tok[64], *end;
        snprintf(tok, sizeof tok, "%.*s", (int)(len < sizeof tok ? len : sizeof tok - 1), p);
        const double target = strtod(tok, &end);
        if (!len || (strcmp(tok, "dense") && strcmp(tok, "hybrid") &&
                     (end == tok || *end || !(target >= 0.0 && target < 1.0)))) {
            fprintf(stderr, "sparge bench: --sparsity level '%s' is not dense, hybrid or a sparsity in [0, 1)\n", tok);
            return 2;
        }
        any_hybrid |= !strcmp(tok, "hybrid");
        if (++nlevels > 32) {
            fprintf(stderr, "sparge bench: --sparsity has more than 32 levels; run the rest in another call\n");
            return 2;
        }
        p += len;
        if (!*p)
            break;
    }
    if (any_hybrid && topk == 0.0 && topp == 0.0) {
        fprintf(stderr, "sparge bench: the hybrid level needs --topk or --topp above 0 (both are 0)\n");
        return 2;
    }
    if (export_pfx && !varlen && words_in(levels, "dense")) {
        fprintf(stderr, "sparge bench: --export-mask has no mask to write: every level of --sparsity is dense, which "
                        "runs without one\n");
        return 2;
    }
    /* The output file is tried (as PATH.part, removed at once) before any timing, and written at the end as PATH.part
     * renamed to PATH: a path that cannot be written fails first, and a failed run leaves no file. */
    const size_t out_len = output ? strlen(output) : 0;
    const int json = out_len > 5 && !strcmp(output + out_len - 5, ".json");
    char out_part[4096] = "";
    if (output) {
        FILE *f = NULL;
        if (out_len + 6 > sizeof out_part || (snprintf(out_part, sizeof out_part, "%s.part", output), 0) ||
            !(f = fopen(out_part, "w"))) {
            fprintf(stderr, "sparge bench: cannot write %s: %s\n", out_part[0] ? out_part : output,
                    out_part[0] ? strerror(errno) : "path too long");
            return 1;
        }
        fclose(f);
        remove(out_part);
    }
    const sparge_dtype dt_arg = dtype_s ? cli_dtype(dtype_s, "--dtype") : SPARGE_F32;
    /* The largest tensor, B·H·max(Nq, Nk)·D elements of 4 bytes, must be addressable. */
    const double elems = (double)B * (double)H * (double)(Nq > Nk ? Nq : Nk) * (double)D;
    if (elems * 4.0 > (double)INT64_MAX / 2) {
        fprintf(stderr, "sparge bench: --B x --H x --N x --D = %.3g elements is too large\n", elems);
        return 2;
    }
    bench_ctx c = {0};
    sparge_status s = sparge_device_open(backend, &c.dev);
    if (s)
        return cli_fail("opening the device", s);
    if (!fallback && (s = sparge_device_set_option(c.dev, "strict", "on")))
        return cli_fail("setting strict=on", s);
    for (int i = 0; i < n_options; i++) {
        char name[64];
        const size_t n = strcspn(options[i], "=");
        snprintf(name, sizeof name, "%.*s", (int)(n < sizeof name ? n : sizeof name - 1), options[i]);
        if ((s = sparge_device_set_option(c.dev, name, options[i] + n + 1)))
            return cli_fail("--option", s);
    }
    int gpu = strncmp(sparge_device_backend(c.dev), "cpu", 3) != 0;
    sparge_dtype dt = dtype_s ? dt_arg : gpu ? SPARGE_BF16 : SPARGE_F32;
    int bnhd = !strcmp(layout, "bnhd");
    sparge_tensor (*view)(void *, sparge_dtype, int64_t, int64_t, int64_t, int64_t) =
        bnhd ? sparge_tensor_bnhd : sparge_tensor_bhnd;
    size_t es = sparge_dtype_size(dt), qbytes = (size_t)(B * H * Nq * D) * es, kbytes = (size_t)(B * Hkv * Nk * D) * es;
    void *buf[8] = {0};
    size_t sizes[8] = {qbytes, kbytes, kbytes, qbytes, qbytes, qbytes, kbytes, kbytes};
    int want_bwd = strstr(ops, "bwd") != NULL;
    int nbuf = want_bwd ? 8 : 4;
    for (int i = 0; i < nbuf; i++)
        if ((s = sparge_malloc(c.dev, sizes[i], &buf[i])))
            return cli_fail("allocating tensors", s);
    if ((s = sparge_malloc(c.dev, (size_t)(B * H * Nq) * 4, (void **)&c.lse)))
        return cli_fail("allocating LSE", s);
    c.q = view(buf[0], dt, B, H, Nq, D);
    c.k = view(buf[1], dt, B, Hkv, Nk, D);
    c.v = view(buf[2], dt, B, Hkv, Nk, D);
    c.o = view(buf[3], dt, B, H, Nq, D);
    if (want_bwd) {
        c.d_o = view(buf[4], dt, B, H, Nq, D);
        c.dq = view(buf[5], dt, B, H, Nq, D);
        c.dk = view(buf[6], dt, B, Hkv, Nk, D);
        c.dv = view(buf[7], dt, B, Hkv, Nk, D);
    }
    const int want_mask = strstr(ops, "mask") != NULL, want_fwd = strstr(ops, "fwd") != NULL;
    const int masked = strcmp(levels, "dense") != 0 || varlen;
    printf("sparge bench on %s (%s)\n", sparge_device_name(c.dev), sparge_device_description(c.dev));
    sparge_op_desc desc = {.dtype = dt, .head_dim = D, .block_q = masked ? bq : 0, .block_k = masked ? bk : 0, .B = B,
                           .H = H, .Nq = Nq, .Nk = Nk, .rows_aligned = 1, .kv_heads = Hkv, .causal = causal,
                           .varlen = varlen != NULL};
    if (varlen) { /* as the calls describe themselves (sparge_op_desc): the sequences and the longest one */
        desc.B = n_seq;
        desc.Nq = 0;
        for (int sq = 0; sq < n_seq; sq++)
            desc.Nq = cu[sq + 1] - cu[sq] > desc.Nq ? cu[sq + 1] - cu[sq] : desc.Nq;
        desc.Nk = desc.Nq;
    }
    if (check_tiers(c.dev, desc, want_mask && masked, want_fwd || want_bwd, want_bwd, det))
        return 1;
    if ((s = cli_fill_random(c.dev, &c.q, (uint64_t)seed)) || (s = cli_fill_random(c.dev, &c.k, (uint64_t)seed + 1)) ||
        (s = cli_fill_random(c.dev, &c.v, (uint64_t)seed + 2)) ||
        (want_bwd && (s = cli_fill_random(c.dev, &c.d_o, (uint64_t)seed + 3))))
        return cli_fail("filling inputs", s);
    sparge_mask *mask;
    const sparge_mask_layout mask_layout = {.B = varlen ? n_seq : B, .H = H, .Nq = Nq, .Nk = Nk, .block_q = bq,
                                       .block_k = bk, .causal = causal, .cu_seqlens_q = varlen ? cu : NULL,
                                       .cu_seqlens_k = varlen ? cu : NULL};
    if ((s = sparge_mask_create_ex(c.dev, &mask_layout, &mask)))
        return cli_fail("creating the mask", s);
    c.ap.deterministic = det;
    c.ap.causal = causal && !varlen;

    printf("B=%lld H=%lld Nq=%lld Nk=%lld D=%lld %s %s, blocks %dx%d, %s of %lld after %lld warm-up",
           (long long)B, (long long)H, (long long)Nq, (long long)Nk, (long long)D, sparge_dtype_name(dt), layout, bq, bk,
           queued ? "mean of queued runs" : "median", (long long)reps, (long long)warmup);
    if (settle > 0.0)
        printf(", each after %g s idle", settle);
    if (Hkv != H)
        printf(", %lld K/V heads", (long long)Hkv);
    if (causal)
        printf(", causal");
    if (varlen)
        printf(", %d packed sequences (%s)", n_seq, lengths);
    printf("\n\n");
    printf("%-12s %8s %8s %9s %9s %11s %9s %9s %9s %9s %9s\n", "level", "sparsity", "mask ms", "fwd ms", "fwd+mask",
           "fwd TFLOP/s", "eff TF/s", "bwd ms", "bwd TF/s", "step ms", "speedup");
    /* Dense-equivalent work: every pair a query may attend (causal: up to its diagonal; varlen: its sequence). */
    double pairs = 0.0;
    for (int sq = 0; sq < (varlen ? n_seq : 1); sq++) {
        const int64_t nq = varlen ? cu[sq + 1] - cu[sq] : Nq, nk = varlen ? nq : Nk;
        pairs += causal ? (double)nq * (double)(nk - nq) + (double)nq * (double)(nq + 1) / 2.0 : (double)nq * (double)nk;
    }
    double flops = 4.0 * (double)B * (double)H * pairs * (double)D, dense_fwd = NAN;
    bench_row rows[32];
    int nrows = 0;
    char *list = malloc(strlen(levels) + 1);
    strcpy(list, levels);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        bench_row *r = &rows[nrows];
        memset(r, 0, sizeof *r);
        snprintf(r->level, sizeof r->level, "%s", tok);
        r->mask_ms = r->fwd_ms = r->fwd_mask_ms = r->bwd_ms = r->step_ms = NAN;
        int dense = !strcmp(tok, "dense"), masked_dense = dense && varlen != NULL;
        c.mask = dense && !masked_dense ? NULL : mask;
        c.mp = (sparge_mask_params){bq, bk, topk, topp, 0.0f, causal};
        if (masked_dense) { /* every block of every sequence, through the mask */
            c.mp.topk = 1.0;
            c.mp.topp = 0.0;
            if ((s = op_mask(&c)))
                return cli_fail("the dense varlen mask", s);
        } else if (!dense && strcmp(tok, "hybrid")) {
            const double target = strtod(tok, NULL); /* checked above */
            c.mp.topk = 1.0 - target; /* Top-k only: exactly that share of blocks per row */
            c.mp.topp = 0.0;
        }
        if (dense) {
            r->density = 1.0;
        } else {
            if (strstr(ops, "mask"))
                r->mask_ms = time_op(c.dev, op_mask, &c, settle, (int)warmup, (int)reps, queued, "mask prediction");
            else if ((s = op_mask(&c)))
                return cli_fail("mask prediction", s);
            sparge_mask_stats st;
            if ((s = sparge_mask_get_stats(mask, &st, NULL, NULL)))
                return cli_fail("mask statistics", s);
            r->sparsity = st.sparsity;
            r->density = st.token_density;
        }
        if (strstr(ops, "fwd") || want_bwd) {
            const int timed = strstr(ops, "fwd") != NULL; /* else one run for the backward's O and LSE */
            double t = time_op(c.dev, op_fwd, &c, timed ? settle : 0.0, timed ? (int)warmup : 0, timed ? (int)reps : 1,
                               queued, "forward");
            if (timed)
                r->fwd_ms = t;
        }
        if (want_bwd)
            r->bwd_ms = time_op(c.dev, op_bwd, &c, settle, (int)warmup, (int)reps, queued, "backward");
        if (dense)
            dense_fwd = r->fwd_ms;
        r->fwd_mask_ms = dense ? r->fwd_ms : NAN;
        if (!dense && strstr(ops, "mask") && strstr(ops, "fwd"))
            r->fwd_mask_ms = time_op(c.dev, op_mask_fwd, &c, settle, (int)warmup, (int)reps, queued, "mask prediction + forward");
        if (strstr(ops, "fwd") && want_bwd) {
            c.step_predicts = !dense && strstr(ops, "mask") != NULL;
            r->step_ms = time_op(c.dev, op_step, &c, settle, (int)warmup, (int)reps, queued,
                                 "step (mask prediction, forward, backward)");
        }
        printf("%-12s %7.2f%% %8.3f %9.3f %9.3f %11.3f %9.3f %9.3f %9.3f %9.3f %8.2fx\n", r->level, 100.0 * r->sparsity,
               r->mask_ms, r->fwd_ms, r->fwd_mask_ms, flops / (r->fwd_ms * 1e9), flops * r->density / (r->fwd_ms * 1e9),
               r->bwd_ms, 2.5 * flops / (r->bwd_ms * 1e9), r->step_ms, dense_fwd / r->fwd_mask_ms);
        fflush(stdout);
        nrows++;
        if (export_pfx && c.mask && (s = sparge_mask_export(mask, export_pfx, D, dt)))
            return cli_fail("exporting the mask", s);
    }
    free(list);
    if (output) {
        FILE *f = fopen(out_part, "w");
        if (!f) {
            fprintf(stderr, "sparge bench: cannot write %s: %s\n", out_part, strerror(errno));
            return 1;
        }
        char device[512];
        snprintf(device, sizeof device, "%s (%s)", sparge_device_name(c.dev), sparge_device_description(c.dev));
        if (json)
            fprintf(f, "[\n");
        else
            fprintf(f, "device,B,H,Nq,Nk,D,dtype,layout,block_q,block_k,kv_heads,causal,varlen,level,sparsity,token_density,"
                       "mask_ms,fwd_ms,fwd_mask_ms,bwd_ms,fwd_tflops,bwd_tflops,step_ms\n");
        for (int i = 0; i < nrows; i++) {
            bench_row *r = &rows[i];
            if (json)
                fprintf(f,
                        "  {\"device\": \"%s\", \"B\": %lld, \"H\": %lld, \"Nq\": %lld, \"Nk\": %lld, \"D\": %lld, "
                        "\"dtype\": \"%s\", \"layout\": \"%s\", \"block_q\": %d, \"block_k\": %d, \"kv_heads\": %lld, "
                        "\"causal\": %s, \"varlen\": [%s], \"level\": \"%s\", "
                        "\"sparsity\": %.6f, \"token_density\": %.6f, \"mask_ms\": %.6g, \"fwd_ms\": %.6g, "
                        "\"fwd_mask_ms\": %.6g, \"bwd_ms\": %.6g, \"step_ms\": %.6g}%s\n",
                        device, (long long)B, (long long)H, (long long)Nq, (long long)Nk,
                        (long long)D, sparge_dtype_name(dt), layout, bq, bk, (long long)Hkv, causal ? "true" : "false",
                        lengths, r->level, r->sparsity, r->density,
                        isnan(r->mask_ms) ? -1.0 : r->mask_ms, isnan(r->fwd_ms) ? -1.0 : r->fwd_ms,
                        isnan(r->fwd_mask_ms) ? -1.0 : r->fwd_mask_ms, isnan(r->bwd_ms) ? -1.0 : r->bwd_ms,
                        isnan(r->step_ms) ? -1.0 : r->step_ms, i + 1 < nrows ? "," : "");
            else
                fprintf(f, "\"%s\",%lld,%lld,%lld,%lld,%lld,%s,%s,%d,%d,%lld,%d,\"%s\",%s,%.6f,%.6f,%.6g,%.6g,%.6g,%.6g,%.2f,"
                           "%.2f,%.6g\n",
                        device, (long long)B, (long long)H, (long long)Nq, (long long)Nk,
                        (long long)D, sparge_dtype_name(dt), layout, bq, bk, (long long)Hkv, causal, lengths, r->level,
                        r->sparsity, r->density,
                        r->mask_ms, r->fwd_ms, r->fwd_mask_ms, r->bwd_ms, flops / (r->fwd_ms * 1e9), 2.5 * flops / (r->bwd_ms * 1e9),
                        r->step_ms);
        }
        if (json)
            fprintf(f, "]\n");
        const int write_failed = ferror(f), close_failed = fclose(f);
        if (write_failed || close_failed || rename(out_part, output)) {
            fprintf(stderr, "sparge bench: cannot write %s: %s\n", output, strerror(errno ? errno : EIO));
            remove(out_part);
            return 1;
        }
        printf("\nwrote %s\n", output);
    }
    sparge_mask_destroy(mask);
    for (int i = 0; i < nbuf; i++)
        sparge_free(c.dev, buf[i]);
    sparge_free(c.dev, c.lse);
    sparge_device_close(c.dev);
    return bench_failed;
}
