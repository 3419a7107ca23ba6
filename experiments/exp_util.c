/* Command-line options shared by the drivers, progress and output helpers. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "exp.h"

void exp_opts_init(exp_opts *o)
{
    memset(o, 0, sizeof *o);
    o->backend = "cpu";
    o->dtype = SPARGE_F32;
    o->names[0] = "q";
    o->names[1] = "k";
    o->names[2] = "v";
    o->seeds = 1;
    for (int f = 0; f < 3; f++) {
        exp_gen_defaults((exp_family)f, &o->gen[f]);
        o->families[f] = f;
    }
    o->nfamilies = 3;
}

void exp_opts_usage(FILE *out)
{
    fputs("common options:\n"
          "  --backend NAME        cpu (default), cpu-ref, cuda[:N], cuda-generic, hip[:N]\n"
          "  --ref NAME            backend of the dense reference (default: the same backend)\n"
          "  --dtype f32|f16|bf16  storage of Q, K, V, O (default f32)\n"
          "  --csv PATH --md PATH  where to write the results (default: stdout gets Markdown)\n"
          "  --seed N --seeds N    first seed and number of seeds (default 1, 1)\n"
          "  --quiet               no progress on stderr\n"
          "inputs (synthetic families; see experiments/README.md):\n"
          "  --heads H --dim D --tokens N   uniform and sink families (default 2, 64, 32768)\n"
          "  --grid TxHxW          video grid (default 21x30x52, Wan2.1 480p latents)\n"
          "  --block-q N --block-k N        mask blocks (default 128, 64)\n"
          "  --tau MIN,MAX         uniform: near-uniform rows' pooled-logit std range (default 0.1,0.5)\n"
          "  --focus ROWS,MASS     uniform: share of rows focused on the hub block and its mass there (0.25,0.95)\n"
          "  --sink-mass MIN,MAX   sink: range of the sinks' pooled share per row (default 0.3,0.8)\n"
          "  --sink-blocks N       sink: number of sink key blocks (default 1)\n"
          "  --sink-value S        sink: scale of the sinks' values (default 0.1)\n"
          "  --video-sinks N       video: add N sink key blocks (default 0)\n"
          "  --sharpness S         sink/video: logit of a token with itself (default 6)\n"
          "  --len-seq L --len-t L --len-s L   locality length scales (default 64 tokens, 1.5 frames, 8 px)\n"
          "  --jitter J            per-token part of q and k (default 0.5)\n"
          "  --value M,B,N         value model: DC, block/field and noise scales (default 1,1,1)\n"
          "  --input FILE          real Q/K/V from a safetensors file (family 'file')\n"
          "  --names q,k,v         tensor names in FILE (default q,k,v)\n"
          "  --layout bhnd|bnhd    layout of 4-D tensors in FILE (default bhnd)\n",
          out);
}

static int parse_pair(const char *s, double *a, double *b)
{
    char *end;
    *a = strtod(s, &end);
    if (*end != ',')
        return -1;
    *b = strtod(end + 1, &end);
    return *end ? -1 : 0;
}

static int parse_i64(const char *s, int64_t *out)
{
    char *end;
    long long v = strtoll(s, &end, 10);
    if (*end || v <= 0)
        return -1;
    *out = v;
    return 0;
}

int exp_opts_parse(exp_opts *o, int argc, char **argv, int *i)
{
    const char *a = argv[*i];
    static const char *const with_value[] = {
        "--backend", "--ref",     "--dtype",   "--csv",         "--md",         "--seed",        "--seeds",
        "--heads",   "--dim",     "--tokens",  "--grid",        "--block-q",    "--block-k",     "--tau",  "--focus",
        "--sink-mass", "--sink-blocks", "--sink-value", "--video-sinks", "--sharpness", "--len-seq", "--len-t",
        "--len-s",   "--jitter",  "--value",   "--input",       "--names",      "--layout",  "--families"};
    if (strcmp(a, "--quiet") == 0) {
        o->quiet = 1;
        return 1;
    }
    int known = 0;
    for (size_t n = 0; n < sizeof with_value / sizeof with_value[0]; n++)
        known |= strcmp(a, with_value[n]) == 0;
    if (!known)
        return 0;
    if (*i + 1 >= argc) {
        fprintf(stderr, "%s needs a value\n", a);
        return -1;
    }
    const char *v = argv[++*i];
    exp_gen_params *g = o->gen;
    int64_t n = 0;
    double x, y;
    int bad = 0;
    if (!strcmp(a, "--backend"))
        o->backend = v;
    else if (!strcmp(a, "--ref"))
        o->ref_backend = v;
    else if (!strcmp(a, "--dtype")) {
        if (!strcmp(v, "f32")) o->dtype = SPARGE_F32;
        else if (!strcmp(v, "f16")) o->dtype = SPARGE_F16;
        else if (!strcmp(v, "bf16")) o->dtype = SPARGE_BF16;
        else bad = 1;
    } else if (!strcmp(a, "--csv"))
        o->csv = v;
    else if (!strcmp(a, "--md"))
        o->md = v;
    else if (!strcmp(a, "--input")) {
        o->input = v;
        o->families[0] = EXP_FILE, o->nfamilies = 1;
    } else if (!strcmp(a, "--families")) {
        int fam[3], n = exp_parse_families(v, fam, 3);
        bad = n < 1;
        if (!bad && !o->input) /* --input wins, whatever the order */
            memcpy(o->families, fam, sizeof fam), o->nfamilies = n;
    } else if (!strcmp(a, "--layout")) {
        if (!strcmp(v, "bhnd")) o->bnhd = 0;
        else if (!strcmp(v, "bnhd")) o->bnhd = 1;
        else bad = 1;
    } else if (!strcmp(a, "--names")) {
        static char buf[256];
        snprintf(buf, sizeof buf, "%s", v);
        char *c1 = strchr(buf, ','), *c2 = c1 ? strchr(c1 + 1, ',') : NULL;
        if (!c1 || !c2)
            bad = 1;
        else {
            *c1 = *c2 = 0;
            o->names[0] = buf;
            o->names[1] = c1 + 1;
            o->names[2] = c2 + 1;
        }
    } else if (!strcmp(a, "--seeds")) {
        bad = parse_i64(v, &n);
        o->seeds = (int)n;
    } else if (!strcmp(a, "--grid")) {
        int t, h, w;
        bad = sscanf(v, "%dx%dx%d", &t, &h, &w) != 3 || t <= 0 || h <= 0 || w <= 0;
        if (!bad) {
            g[EXP_VIDEO].grid_t = t;
            g[EXP_VIDEO].grid_h = h;
            g[EXP_VIDEO].grid_w = w;
            g[EXP_VIDEO].N = (int64_t)t * h * w;
        }
    } else if (!strcmp(a, "--tau")) {
        bad = parse_pair(v, &x, &y);
        g[EXP_UNIFORM].tau_min = x;
        g[EXP_UNIFORM].tau_max = y;
    } else if (!strcmp(a, "--focus")) {
        bad = parse_pair(v, &x, &y) || x < 0.0 || x > 1.0 || y <= 0.0 || y >= 1.0;
        g[EXP_UNIFORM].sink_rows = x;
        g[EXP_UNIFORM].sink_mass_min = g[EXP_UNIFORM].sink_mass_max = y;
        g[EXP_UNIFORM].sink_blocks = x > 0.0;
    } else if (!strcmp(a, "--sink-mass")) {
        bad = parse_pair(v, &x, &y);
        g[EXP_SINK].sink_mass_min = g[EXP_VIDEO].sink_mass_min = x;
        g[EXP_SINK].sink_mass_max = g[EXP_VIDEO].sink_mass_max = y;
    } else if (!strcmp(a, "--sink-blocks")) {
        bad = parse_i64(v, &n);
        g[EXP_SINK].sink_blocks = (int)n;
    } else if (!strcmp(a, "--video-sinks")) {
        char *end;
        long c = strtol(v, &end, 10);
        bad = *end || c < 0;
        g[EXP_VIDEO].sink_blocks = (int)c;
    } else if (!strcmp(a, "--value")) {
        double m, b, z;
        bad = sscanf(v, "%lf,%lf,%lf", &m, &b, &z) != 3;
        for (int f = 0; f < 3; f++) {
            g[f].value_mean = m;
            g[f].value_block = b;
            g[f].value_noise = z;
        }
    } else {
        char *end;
        x = strtod(v, &end);
        bad = *end != 0;
        for (int f = 0; f < 3 && !bad; f++) {
            if (!strcmp(a, "--seed")) g[f].seed = (uint64_t)x;
            else if (!strcmp(a, "--heads")) g[f].H = (int64_t)x;
            else if (!strcmp(a, "--dim")) g[f].D = (int64_t)x;
            else if (!strcmp(a, "--tokens") && f != EXP_VIDEO) g[f].N = (int64_t)x;
            else if (!strcmp(a, "--block-q")) g[f].block_q = (int)x;
            else if (!strcmp(a, "--block-k")) g[f].block_k = (int)x;
            else if (!strcmp(a, "--sink-value") && f != EXP_UNIFORM) g[f].sink_value_scale = x;
            else if (!strcmp(a, "--sharpness")) g[f].sharpness = x;
            else if (!strcmp(a, "--len-seq")) g[f].len_seq = x;
            else if (!strcmp(a, "--len-t")) g[f].len_t = x;
            else if (!strcmp(a, "--len-s")) g[f].len_s = x;
            else if (!strcmp(a, "--jitter")) g[f].token_jitter = x;
        }
    }
    if (bad) {
        fprintf(stderr, "bad value '%s' for %s\n", v, a);
        return -1;
    }
    return 1;
}

int exp_family_input(const exp_opts *o, exp_family f, uint64_t seed_offset, exp_gen_params *g, exp_qkv *x)
{
    *g = o->gen[f == EXP_FILE ? EXP_UNIFORM : f];
    g->seed += seed_offset;
    return f == EXP_FILE ? exp_load_qkv(o->input, o->names, o->bnhd, x) : exp_generate(g, x);
}

int exp_parse_families(const char *list, int *fam, int max)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", list);
    int n = 0;
    for (char *tok = strtok(buf, ","); tok && n < max; tok = strtok(NULL, ",")) {
        int f = exp_family_parse(tok);
        if (f < 0 || f == EXP_FILE) {
            fprintf(stderr, "unknown family '%s'\n", tok);
            return -1;
        }
        fam[n++] = f;
    }
    return n;
}

int exp_parse_numbers(const char *list, double *values, int max)
{
    char buf[512];
    snprintf(buf, sizeof buf, "%s", list);
    int n = 0;
    for (char *tok = strtok(buf, ","); tok && n < max; tok = strtok(NULL, ","))
        values[n++] = atof(tok);
    return n;
}

void exp_progress(const exp_opts *o, const char *tag, const char *fmt, ...)
{
    if (o && o->quiet)
        return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[%s] ", tag);
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

FILE *exp_open_out(const char *path)
{
    if (!path)
        return NULL;
    FILE *f = fopen(path, "w");
    if (!f)
        perror(path);
    return f;
}

FILE *exp_open_md(const char *path)
{
    return path ? exp_open_out(path) : stdout;
}

void exp_close_out(FILE *f)
{
    if (f && f != stdout)
        fclose(f);
}

double exp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
