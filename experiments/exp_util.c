/* The drivers' command line (option tables, the common options, the opening and closing of a run), the loop over
 * their inputs, progress and small output helpers. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/stat.h>
#include <unistd.h>

#include "exp.h"

_Static_assert(SPARGE_F32 == 0 && SPARGE_F16 == 1 && SPARGE_BF16 == 2, "--dtype stores its choice's index");

enum { MAX_OPTS = 64 }; /* the common options (32 at most) and a driver's own */
/* help lines: "  --name ARG" padded to NAME_WIDTH, then the text wrapped at HELP_WIDTH columns */
enum { NAME_WIDTH = 28, HELP_WIDTH = 118 };

void exp_opts_init(exp_opts *o, const exp_driver *d)
{
    memset(o, 0, sizeof *o);
    o->driver = d;
    o->backend = "cpu";
    o->dtype = SPARGE_F32;
    o->names[0] = "q";
    o->names[1] = "k";
    o->names[2] = "v";
    o->seeds = 1;
    o->topk = exp_paper_arms[EXP_TOPK].k;
    o->hybrid_k = exp_paper_arms[EXP_HYBRID].k;
    for (int f = 0; f < 3; f++)
        o->families[f] = f;
    o->nfamilies = 3;
    /* the knobs start at the generators' defaults: those of the families each knob applies to agree */
    exp_gen_params u, s, v;
    exp_gen_defaults(EXP_UNIFORM, &u);
    exp_gen_defaults(EXP_SINK, &s);
    exp_gen_defaults(EXP_VIDEO, &v);
    o->knobs = (exp_knobs){.seed = (int64_t)u.seed,
                           .heads = u.H,
                           .dim = u.D,
                           .tokens = u.N,
                           .grid = {v.grid_t, v.grid_h, v.grid_w},
                           .block_q = u.block_q,
                           .block_k = u.block_k,
                           .tau = {u.tau_min, u.tau_max},
                           .focus = {u.sink_rows, u.sink_mass_min},
                           .sink_mass = {s.sink_mass_min, s.sink_mass_max},
                           .sink_blocks = s.sink_blocks,
                           .video_sinks = v.sink_blocks,
                           .sink_value = s.sink_value_scale,
                           .sharpness = u.sharpness,
                           .len_seq = u.len_seq,
                           .len_t = u.len_t,
                           .len_s = u.len_s,
                           .jitter = u.token_jitter,
                           .value = {u.value_mean, u.value_block, u.value_noise}};
    if (d->nfamilies)
        o->nfamilies = d->nfamilies;
    if (d->tokens)
        o->knobs.tokens = d->tokens;
}

/* ---------------------------------------------------------------- custom values */

static const char *parse_grid(void *ptr, const char *v)
{
    int dims[3];
    for (int i = 0; i < 3; i++) {
        char *end;
        long x = strtol(v, &end, 10);
        if (end == v || x < 1 || x > 4096 || *end != (i < 2 ? 'x' : 0))
            return "TxHxW, three whole numbers in [1, 4096]";
        dims[i] = (int)x;
        v = end + 1;
    }
    memcpy(ptr, dims, sizeof dims);
    return NULL;
}

static void show_grid(const void *ptr, char *buf, size_t len)
{
    const int *g = ptr;
    snprintf(buf, len, "%dx%dx%d", g[0], g[1], g[2]);
}

static const char *parse_families(void *ptr, const char *v)
{
    exp_opts *o = ptr;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", v);
    int n = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int f = exp_family_parse(tok);
        if (n == 3 || f < 0 || f == EXP_FILE)
            return "one to three of uniform, sink, video, separated by commas";
        o->families[n++] = f;
    }
    if (!n)
        return "one to three of uniform, sink, video, separated by commas";
    o->nfamilies = n;
    return NULL;
}

static void show_families(const void *ptr, char *buf, size_t len)
{
    const exp_opts *o = ptr;
    buf[0] = 0;
    for (int i = 0; i < o->nfamilies; i++)
        snprintf(buf + strlen(buf), len - strlen(buf), "%s%s", i ? "," : "", exp_family_name(o->families[i]));
}

static const char *parse_names(void *ptr, const char *v)
{
    exp_opts *o = ptr;
    snprintf(o->names_buf, sizeof o->names_buf, "%s", v);
    char *c1 = strchr(o->names_buf, ','), *c2 = c1 ? strchr(c1 + 1, ',') : NULL;
    if (!c1 || !c2 || strchr(c2 + 1, ','))
        return "three tensor names separated by commas";
    *c1 = *c2 = 0;
    o->names[0] = o->names_buf;
    o->names[1] = c1 + 1;
    o->names[2] = c2 + 1;
    return NULL;
}

static void show_names(const void *ptr, char *buf, size_t len)
{
    const exp_opts *o = ptr;
    snprintf(buf, len, "%s,%s,%s", o->names[0], o->names[1], o->names[2]);
}

/* ---------------------------------------------------------------- the tables */

static int common_options(exp_opts *o, exp_opt *t)
{
    exp_knobs *k = &o->knobs;
    const exp_opt c[] = {
        {EXP_STR("--backend", &o->backend, "NAME", "sparge backend: cpu, cpu-ref, cuda[:N], cuda-generic, hip[:N]")},
        {EXP_STR("--ref", &o->ref_backend, "NAME", "backend of the dense reference"), .def = "the same backend"},
        {EXP_CHOICE("--dtype", &o->dtype, "f32|f16|bf16", "storage of Q, K, V, O")},
        {EXP_OUT("--csv", &o->csv, "write the results as CSV to PATH"), .header = o->driver->csv_header},
        {EXP_OUT("--md", &o->md, "write the Markdown results to PATH"), .def = "stdout"},
        {EXP_I64("--seed", &k->seed, "N", 0, 9007199254740992.0, "first seed of the synthetic inputs")},
        {EXP_INT("--seeds", &o->seeds, "N", 1, 1000, "number of seeds: seed, seed+1, ...")},
        {EXP_FLAG("--quiet", &o->quiet, "no progress on stderr")},
        {EXP_CUSTOM("--families", o, "LIST", parse_families, show_families,
                    "synthetic families to run, of uniform,sink,video")},
        {EXP_I64("--heads", &k->heads, "H", 1, 4096, "heads of every family")},
        {EXP_I64("--dim", &k->dim, "D", 4, 4096, "head dimension of every family")},
        {EXP_I64("--tokens", &k->tokens, "N", 1, 16777216, "tokens of the uniform and sink families")},
        {EXP_CUSTOM("--grid", k->grid, "TxHxW", parse_grid, show_grid,
                    "video grid in latent frames, rows, columns (21x30x52: Wan2.1 480p)")},
        {EXP_INT("--block-q", &k->block_q, "N", 1, 4096, "query block of the masks")},
        {EXP_INT("--block-k", &k->block_k, "N", 1, 4096, "key block of the masks")},
        {EXP_LIST("--tau", k->tau, 2, NULL, "MIN,MAX", 0.0, DBL_MAX,
                  "uniform: range of the near-uniform rows' pooled-logit std"),
         .excl = EXP_EXCL_MIN},
        {EXP_LIST("--focus", k->focus, 2, NULL, "ROWS,MASS", 0.0, 1.0,
                  "uniform: share of rows focused on the hub block, and their mass there (MASS < 1)")},
        {EXP_LIST("--sink-mass", k->sink_mass, 2, NULL, "MIN,MAX", 0.0, 1.0,
                  "sink and video: range of the sinks' pooled share of a row"),
         .excl = EXP_EXCL_MIN | EXP_EXCL_MAX},
        {EXP_INT("--sink-blocks", &k->sink_blocks, "N", 1, 4096, "sink: number of sink key blocks")},
        {EXP_DBL("--sink-value", &k->sink_value, "S", -DBL_MAX, DBL_MAX, "sink and video: scale of the sinks' values")},
        {EXP_INT("--video-sinks", &k->video_sinks, "N", 0, 4096, "video: number of sink key blocks")},
        {EXP_DBL("--sharpness", &k->sharpness, "S", -DBL_MAX, DBL_MAX, "sink and video: logit of a token with itself")},
        {EXP_DBL("--len-seq", &k->len_seq, "L", 0.0, DBL_MAX, "sink: locality length scale in tokens"),
         .excl = EXP_EXCL_MIN},
        {EXP_DBL("--len-t", &k->len_t, "L", 0.0, DBL_MAX, "video: locality length scale in frames"),
         .excl = EXP_EXCL_MIN},
        {EXP_DBL("--len-s", &k->len_s, "L", 0.0, DBL_MAX, "video: locality length scale in latent pixels"),
         .excl = EXP_EXCL_MIN},
        {EXP_DBL("--jitter", &k->jitter, "J", 0.0, DBL_MAX, "per-token part of q and k")},
        {EXP_LIST("--value", k->value, 3, NULL, "M,B,N", -DBL_MAX, DBL_MAX,
                  "value model: DC, block/field and noise scales")},
        {EXP_STR("--input", &o->input, "FILE", "real Q/K/V from a safetensors file (family 'file', replaces "
                                              "--families)"),
         .def = "none, synthetic inputs"},
        {EXP_CUSTOM("--names", o, "Q,K,V", parse_names, show_names, "tensor names in the --input file")},
        {EXP_CHOICE("--layout", &o->bnhd, "bhnd|bnhd", "layout of 4-D tensors in the --input file")},
    };
    const exp_opt equal[] = {
        {EXP_DBL("--topk", &o->topk, "K", 0.0, 1.0, "Top-k fraction of the equal-sparsity rules: it sets the sparsity"),
         .excl = EXP_EXCL_MIN},
        {EXP_DBL("--hybrid-k", &o->hybrid_k, "K", 0.0, 1.0, "the hybrid's k there (its p is calibrated)")},
    };
    if (o->driver->own_only) { /* outputs and --quiet only: the rest is about the synthetic families */
        int n = 0;
        for (int i = 0; i < EXP_COUNT(c); i++)
            if (!strcmp(c[i].name, "--csv") || !strcmp(c[i].name, "--md") || !strcmp(c[i].name, "--quiet"))
                t[n++] = c[i];
        return n;
    }
    memcpy(t, c, sizeof c);
    if (o->driver->equal)
        memcpy(t + EXP_COUNT(c), equal, sizeof equal);
    return EXP_COUNT(c) + (o->driver->equal ? EXP_COUNT(equal) : 0);
}

/* The driver's own options first: they are what its help is about. */
static int all_options(exp_opts *o, exp_opt *t)
{
    const exp_driver *d = o->driver;
    if (d->nown) /* a driver without options of its own may leave own NULL */
        memcpy(t, d->own, sizeof(exp_opt) * (size_t)d->nown);
    return d->nown + common_options(o, t + d->nown);
}

static const exp_opt *find(const exp_opt *t, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name))
            return &t[i];
    return NULL;
}

static int ignored(const exp_driver *d, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = d->ignores; p && (p = strstr(p, name)); p += n)
        if (p[n] == ' ' || p[n] == 0)
            return 1;
    return 0;
}

/* ---------------------------------------------------------------- values */

static int whole(const exp_opt *op) { return op->kind == EXP_OPT_INT || op->kind == EXP_OPT_I64; }

static void bound(char *buf, size_t len, double x)
{
    if (fabs(x) == DBL_MAX)
        snprintf(buf, len, "%sinf", x < 0 ? "-" : "");
    else
        snprintf(buf, len, "%.17g", x);
}

/* What a value of op must be, for the error message. */
static void wanted(const exp_opt *op, char *buf, size_t len)
{
    char lo[32], hi[32], range[96];
    bound(lo, sizeof lo, op->min);
    bound(hi, sizeof hi, op->max);
    snprintf(range, sizeof range, "%s%s, %s%s", op->excl & EXP_EXCL_MIN || op->min == -DBL_MAX ? "(" : "[", lo, hi,
             op->excl & EXP_EXCL_MAX || op->max == DBL_MAX ? ")" : "]");
    switch (op->kind) {
    case EXP_OPT_INT:
    case EXP_OPT_I64: snprintf(buf, len, "a whole number in %s", range); break;
    case EXP_OPT_DBL: snprintf(buf, len, "a number in %s", range); break;
    case EXP_OPT_LIST:
        if (!op->count)
            snprintf(buf, len, "%d comma-separated numbers in %s", op->len, range);
        else
            snprintf(buf, len, "1 to %d comma-separated numbers in %s%s%s%s", op->len, range, op->none ? ", or '" : "",
                     op->none ? op->none : "", op->none ? "'" : "");
        break;
    case EXP_OPT_CHOICE: snprintf(buf, len, "one of %s", op->arg); break;
    default: buf[0] = 0;
    }
}

/* One number of op's kind and range; -1 when s is not one. */
static int number(const exp_opt *op, const char *s, double *x)
{
    char *end;
    *x = strtod(s, &end);
    if (end == s || *end || !isfinite(*x) || (whole(op) && *x != floor(*x)))
        return -1;
    if (*x < op->min || *x > op->max || (op->excl & EXP_EXCL_MIN && *x == op->min) ||
        (op->excl & EXP_EXCL_MAX && *x == op->max))
        return -1;
    return 0;
}

static int list(const exp_opt *op, const char *v)
{
    if (op->count && op->none && !strcmp(v, op->none)) {
        *op->count = 0;
        return 0;
    }
    double x[64];
    int n = 0;
    const char *s = v;
    for (;;) {
        char tok[64];
        size_t l = strcspn(s, ",");
        if (n == op->len || n == (int)(sizeof x / sizeof x[0]) || l >= sizeof tok)
            return -1;
        memcpy(tok, s, l);
        tok[l] = 0;
        if (number(op, tok, &x[n++]))
            return -1;
        if (!s[l])
            break;
        s += l + 1;
    }
    if (!op->count && n != op->len)
        return -1;
    memcpy(op->ptr, x, sizeof(double) * (size_t)n);
    if (op->count)
        *op->count = n;
    return 0;
}

static int choice(const exp_opt *op, const char *v)
{
    size_t n = strlen(v);
    int i = 0;
    for (const char *c = op->arg; *c; i++) {
        size_t l = strcspn(c, "|");
        if (l == n && !strncmp(c, v, n)) {
            *(int *)op->ptr = i;
            return 0;
        }
        c += l + (c[l] == '|');
    }
    return -1;
}

/* Stores value v of op; returns 0, or -1 with the message in err. */
static int set(const exp_driver *d, const exp_opt *op, const char *v, char *err, size_t err_len)
{
    double x = 0.0;
    int bad = 0;
    const char *want = NULL;
    switch (op->kind) {
    case EXP_OPT_FLAG: *(int *)op->ptr = 1; break;
    case EXP_OPT_STR: *(const char **)op->ptr = v; break;
    case EXP_OPT_OUT: break; /* exp_parse opens it once every other value is good */
    case EXP_OPT_INT:
        if (!(bad = number(op, v, &x)))
            *(int *)op->ptr = (int)x;
        break;
    case EXP_OPT_I64:
        if (!(bad = number(op, v, &x)))
            *(int64_t *)op->ptr = (int64_t)x;
        break;
    case EXP_OPT_DBL:
        if (!(bad = number(op, v, &x)))
            *(double *)op->ptr = x;
        break;
    case EXP_OPT_LIST: bad = list(op, v); break;
    case EXP_OPT_CHOICE: bad = choice(op, v); break;
    case EXP_OPT_CUSTOM: bad = (want = op->parse(op->ptr, v)) != NULL; break;
    }
    if (!bad)
        return 0;
    char buf[160];
    if (!want)
        wanted(op, buf, sizeof buf), want = buf;
    return exp_fail(err, err_len, "%s: %s wants %s, not '%s'", d->name, op->name, want, v);
}

/* The current value of op, as the help shows it. */
static void show(const exp_opt *op, char *buf, size_t len)
{
    buf[0] = 0;
    if (op->def) {
        snprintf(buf, len, "%s", op->def);
        return;
    }
    switch (op->kind) {
    case EXP_OPT_FLAG: snprintf(buf, len, "%s", *(const int *)op->ptr ? "on" : "off"); break;
    case EXP_OPT_STR: {
        const char *v = *(const char *const *)op->ptr;
        snprintf(buf, len, "%s", v ? v : "none");
        break;
    }
    case EXP_OPT_OUT: snprintf(buf, len, "none"); break;
    case EXP_OPT_INT: snprintf(buf, len, "%d", *(const int *)op->ptr); break;
    case EXP_OPT_I64: snprintf(buf, len, "%lld", (long long)*(const int64_t *)op->ptr); break;
    case EXP_OPT_DBL: snprintf(buf, len, "%g", *(const double *)op->ptr); break;
    case EXP_OPT_LIST: {
        int n = op->count ? *op->count : op->len;
        if (!n && op->none)
            snprintf(buf, len, "%s", op->none);
        for (int i = 0; i < n; i++)
            snprintf(buf + strlen(buf), len - strlen(buf), "%s%g", i ? "," : "", ((const double *)op->ptr)[i]);
        break;
    }
    case EXP_OPT_CHOICE: {
        const char *c = op->arg;
        for (int i = *(const int *)op->ptr; i > 0 && *c; i--)
            c += strcspn(c, "|") + (c[strcspn(c, "|")] == '|');
        snprintf(buf, len, "%.*s", (int)strcspn(c, "|"), c);
        break;
    }
    case EXP_OPT_CUSTOM: op->show(op->ptr, buf, len); break;
    }
}

static void usage_lines(FILE *out, const exp_opt *t, int n)
{
    for (int i = 0; i < n; i++) {
        char head[64], def[512], text[1024];
        snprintf(head, sizeof head, "%s%s%s", t[i].name, t[i].arg ? " " : "", t[i].arg ? t[i].arg : "");
        show(&t[i], def, sizeof def);
        snprintf(text, sizeof text, "%s (default: %s)", t[i].help, def);
        fprintf(out, "  %-*s", NAME_WIDTH, head);
        int col = NAME_WIDTH + 2;
        for (char *w = strtok(text, " "); w; w = strtok(NULL, " ")) {
            int len = (int)strlen(w);
            if (col + 1 + len > HELP_WIDTH) {
                fprintf(out, "\n%*s", NAME_WIDTH + 2, "");
                col = NAME_WIDTH + 2;
            }
            fprintf(out, " %s", w);
            col += 1 + len;
        }
        fputc('\n', out);
    }
}

void exp_usage(FILE *out, exp_opts *o)
{
    const exp_driver *d = o->driver;
    exp_opt t[MAX_OPTS];
    int n = all_options(o, t);
    fprintf(out, "usage: %s [options]\n%s\n", d->name, d->about);
    if (d->nown) {
        fprintf(out, "options of %s:\n", d->name);
        usage_lines(out, t, d->nown);
    }
    fprintf(out, d->own_only ? "output options:\n" : "common options (synthetic families: experiments/README.md):\n");
    usage_lines(out, t + d->nown, n - d->nown);
    fprintf(out, "  %-*s %s\n", NAME_WIDTH, "--help", "this text");
    if (d->ignores)
        fprintf(out, "%s accepts but does not use %s (so one argument list serves every driver)\n", d->name,
                d->ignores);
}

/* The generator parameters of every family: defaults with the knobs applied. */
static void apply_knobs(exp_opts *o)
{
    const exp_knobs *k = &o->knobs;
    for (int f = 0; f < 3; f++) {
        exp_gen_params *g = &o->gen[f];
        exp_gen_defaults((exp_family)f, g);
        g->seed = (uint64_t)k->seed;
        g->H = k->heads;
        g->D = k->dim;
        g->block_q = k->block_q;
        g->block_k = k->block_k;
        g->sharpness = k->sharpness;
        g->len_seq = k->len_seq;
        g->len_t = k->len_t;
        g->len_s = k->len_s;
        g->token_jitter = k->jitter;
        g->value_mean = k->value[0];
        g->value_block = k->value[1];
        g->value_noise = k->value[2];
        if (f == EXP_UNIFORM) {
            g->N = k->tokens;
            g->tau_min = k->tau[0];
            g->tau_max = k->tau[1];
            g->sink_rows = k->focus[0];
            g->sink_mass_min = g->sink_mass_max = k->focus[1];
            g->sink_blocks = k->focus[0] > 0.0;
            continue;
        }
        g->sink_mass_min = k->sink_mass[0];
        g->sink_mass_max = k->sink_mass[1];
        g->sink_value_scale = k->sink_value;
        if (f == EXP_SINK) {
            g->N = k->tokens;
            g->sink_blocks = k->sink_blocks;
        } else {
            g->grid_t = k->grid[0];
            g->grid_h = k->grid[1];
            g->grid_w = k->grid[2];
            g->N = (int64_t)k->grid[0] * k->grid[1] * k->grid[2];
            g->sink_blocks = k->video_sinks;
        }
    }
}

static int open_output(exp_opts *o, const exp_opt *op, const char *path, char *err, size_t err_len);

int exp_parse(exp_opts *o, int argc, char **argv, char *err, size_t err_len)
{
    const exp_driver *d = o->driver;
    exp_opt t[MAX_OPTS];
    int n = all_options(o, t);
    /* names first: --help then shows the defaults whatever stands before it */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return 1;
        const exp_opt *op = find(t, n, argv[i]);
        if (!op)
            return exp_fail(err, err_len, "%s: unknown option '%s' (see --help)", d->name, argv[i]);
        if (op->kind != EXP_OPT_FLAG && ++i == argc)
            return exp_fail(err, err_len, "%s: %s needs a value", d->name, op->name);
    }
    const char *path[MAX_OPTS] = {0};
    for (int i = 1; i < argc; i++) {
        const exp_opt *op = find(t, n, argv[i]);
        const char *v = op->kind == EXP_OPT_FLAG ? NULL : argv[++i];
        if (set(d, op, v, err, err_len))
            return -1;
        if (op->kind == EXP_OPT_OUT)
            path[op - t] = v;
    }
    const exp_knobs *k = &o->knobs;
    if (k->tau[0] > k->tau[1])
        return exp_fail(err, err_len, "%s: --tau wants MIN <= MAX, not %g,%g", d->name, k->tau[0], k->tau[1]);
    if (k->sink_mass[0] > k->sink_mass[1])
        return exp_fail(err, err_len, "%s: --sink-mass wants MIN <= MAX, not %g,%g", d->name, k->sink_mass[0],
                        k->sink_mass[1]);
    if (!(k->focus[1] > 0.0 && k->focus[1] < 1.0))
        return exp_fail(err, err_len, "%s: --focus wants MASS in (0, 1), not %g", d->name, k->focus[1]);
    if (o->input) {
        FILE *f = fopen(o->input, "rb"); /* read by the run; a missing file is a bad command line */
        if (!f)
            return exp_fail(err, err_len, "%s: --input %s: cannot open: %s", d->name, o->input, strerror(errno));
        fclose(f);
        o->families[0] = EXP_FILE, o->nfamilies = 1;
    }
    apply_knobs(o);
    for (int i = 0; i < n; i++) {
        if (!path[i] || ignored(d, t[i].name))
            continue;
        for (int j = 0; j < i; j++)
            if (path[j] && !ignored(d, t[j].name) && !strcmp(path[i], path[j])) {
                exp_close_outputs(o, 0);
                return exp_fail(err, err_len, "%s: %s and %s name the same file '%s'", d->name, t[j].name, t[i].name,
                                path[i]);
            }
        if (open_output(o, &t[i], path[i], err, err_len)) {
            exp_close_outputs(o, 0);
            return -1;
        }
    }
    if (!o->md)
        o->md = stdout;
    return 0;
}

int exp_part_path(const char *path, char **part)
{
    struct stat st;
    *part = NULL;
    if (!lstat(path, &st) && !S_ISREG(st.st_mode))
        return 0;
    const size_t len = strlen(path) + 32;
    if (!(*part = malloc(len)))
        return -1;
    snprintf(*part, len, "%s.part%ld", path, (long)getpid());
    return 0;
}

/* Opens output op at path as an exp_output (exp.h) with its header written. Returns 0, or -1 with the message. */
static int open_output(exp_opts *o, const exp_opt *op, const char *path, char *err, size_t err_len)
{
    const char *name = o->driver->name;
    if (o->noutputs == EXP_MAX_OUTPUTS)
        return exp_fail(err, err_len, "%s: more than %d outputs", name, EXP_MAX_OUTPUTS);
    char *part;
    if (exp_part_path(path, &part))
        return exp_fail(err, err_len, "%s: %s: out of memory", name, op->name);
    FILE *f = fopen(part ? part : path, "w");
    if (!f) {
        int e = errno;
        free(part);
        return exp_fail(err, err_len, "%s: %s cannot write '%s': %s", name, op->name, path, strerror(e));
    }
    if (op->header)
        fputs(op->header, f);
    *(FILE **)op->ptr = f;
    o->outputs[o->noutputs++] = (exp_output){.f = op->ptr, .name = op->name, .path = path, .part = part};
    return 0;
}

int exp_close_outputs(exp_opts *o, int ok)
{
    const char *name = o->driver->name;
    int rc = 0;
    for (int i = 0; i < o->noutputs; i++) {
        exp_output *out = &o->outputs[i];
        errno = 0;
        int failed = ferror(*out->f);
        failed |= fclose(*out->f) != 0;
        int e = errno;
        *out->f = NULL;
        if (ok && failed) {
            fprintf(stderr, "%s: %s: writing '%s' failed%s%s\n", name, out->name, out->path, e ? ": " : "",
                    e ? strerror(e) : "");
            ok = 0, rc = -1;
        }
    }
    for (int i = 0; i < o->noutputs; i++) {
        exp_output *out = &o->outputs[i];
        if (out->part && ok && rename(out->part, out->path)) {
            fprintf(stderr, "%s: %s: cannot rename '%s' to '%s': %s\n", name, out->name, out->part, out->path,
                    strerror(errno));
            ok = 0, rc = -1;
        }
        if (out->part && !ok)
            unlink(out->part);
        free(out->part);
    }
    o->noutputs = 0;
    return rc;
}

/* ---------------------------------------------------------------- inputs */

int exp_family_input(const exp_opts *o, exp_family f, uint64_t seed_offset, exp_gen_params *g, exp_qkv *x)
{
    *g = o->gen[f == EXP_FILE ? EXP_UNIFORM : f];
    g->seed += seed_offset;
    return f == EXP_FILE ? exp_load_qkv(o->input, o->names, o->bnhd, x) : exp_generate(g, x);
}

/* Closes the previous input and opens the next; 1 with it, 0 after the last, -1 after an error (message printed). */
static int next_input(const exp_opts *o, exp_input *in)
{
    int seeds = ignored(o->driver, "--seeds") ? 1 : o->seeds;
    if (in->open) {
        exp_session_close(&in->s);
        exp_qkv_free(&in->x);
        in->open = 0;
    }
    if (in->index == o->nfamilies * seeds)
        return 0;
    in->fi = in->index / seeds;
    in->si = in->index % seeds;
    in->index++;
    in->family = (exp_family)o->families[in->fi];
    double t0 = exp_now();
    if (exp_family_input(o, in->family, (uint64_t)in->si, &in->g, &in->x))
        return -1;
    if (exp_session_open(&in->s, o->backend, o->ref_backend, &in->x, o->dtype, in->g.block_q, in->g.block_k)) {
        exp_qkv_free(&in->x);
        return -1;
    }
    in->open = 1;
    exp_progress(o, "%s seed %llu: dense reference on %s done (%.1fs)", in->x.label, (unsigned long long)in->g.seed,
                 sparge_device_name(in->s.dev), exp_now() - t0);
    return o->driver->equal && exp_equal_sparsity_rules(&in->s, o->topk, o->hybrid_k, in->equal) ? -1 : 1;
}

int exp_main(const exp_driver *d, int argc, char **argv)
{
    exp_opts o;
    exp_opts_init(&o, d);
    char err[512];
    int r = exp_parse(&o, argc, argv, err, sizeof err);
    if (r > 0)
        exp_usage(stdout, &o);
    if (r < 0)
        fprintf(stderr, "%s\n", err);
    if (r)
        return r > 0 ? 0 : 2;
    int rc = d->run ? d->run(&o) : 0;
    if (!rc && d->md_header)
        fputs(d->md_header, o.md);
    exp_input in = {0};
    while (!rc && d->each && (r = next_input(&o, &in)) != 0)
        rc = r < 0 ? 1 : d->each(&o, &in);
    if (in.open) {
        exp_session_close(&in.s);
        exp_qkv_free(&in.x);
    }
    if (!rc && d->done)
        rc = d->done(&o);
    if (exp_close_outputs(&o, !rc) && !rc)
        rc = 1;
    if (!rc && (fflush(stdout) || ferror(stdout))) {
        fprintf(stderr, "%s: writing the standard output failed\n", d->name);
        rc = 1;
    }
    return rc;
}

/* ---------------------------------------------------------------- output */

void exp_progress(const exp_opts *o, const char *fmt, ...)
{
    if (o->quiet)
        return;
    const char *tag = o->driver ? o->driver->name : "exp";
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[%s] ", strncmp(tag, "exp_", 4) ? tag : tag + 4);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

int exp_fail(char *err, size_t err_len, const char *fmt, ...)
{
    if (err && err_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return -1;
}

double exp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
