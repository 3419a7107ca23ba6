/* Helpers shared by the experiment drivers (experiments/README.md documents them):
 * a seeded RNG, the three synthetic attention-input families, a safetensors
 * reader/writer, a device session that runs sparge's masks and attention and
 * measures errors against dense attention, calibration to equal sparsity, and
 * small output helpers (CSV, Markdown, progress). Everything is built on the
 * public API in src/sparge.h only. */
#ifndef SPARGE_EXP_H
#define SPARGE_EXP_H

#include <stdint.h>
#include <stdio.h>

#include "sparge.h"

/* ---------------------------------------------------------------- RNG */

/* xoshiro256** seeded through splitmix64: the same seed gives the same
 * stream on every platform. */
typedef struct {
    uint64_t s[4];
} exp_rng;

void exp_rng_seed(exp_rng *r, uint64_t seed);
uint64_t exp_rng_next(exp_rng *r);
double exp_rng_uniform(exp_rng *r); /* [0, 1) */
double exp_rng_normal(exp_rng *r);  /* N(0, 1) */

/* ---------------------------------------------------------------- inputs */

typedef enum { EXP_UNIFORM = 0, EXP_SINK, EXP_VIDEO, EXP_FILE } exp_family;

const char *exp_family_name(exp_family f);
/* "uniform", "sink", "video" (or "file"); returns -1 if unknown. */
int exp_family_parse(const char *name);

/* Generator parameters. exp_gen_defaults() fills documented defaults for a
 * family; every field may be overridden before exp_generate(). */
typedef struct {
    exp_family family;
    int64_t B, H, N, D; /* self-attention: Nq = Nk = N; video sets N = T*Hg*Wg */
    int block_q, block_k; /* the blocking the structure is aimed at (the mask's) */
    uint64_t seed;

    /* values: v = value_mean * m_h + value_block * (block/position component) + value_noise * eps */
    double value_mean, value_block, value_noise;
    double token_jitter; /* std of the per-token part of q and k (relative to the structured part) */

    /* uniform: per query block, the pooled logits have std tau_i, log-uniform in [tau_min, tau_max] */
    double tau_min, tau_max;

    /* locality (sink base in 1-D, video in 3-D): logit = sharpness * exp(-|dp/len|^2 / 2) */
    double sharpness;
    double len_seq;                /* sink family: length scale in tokens */
    int grid_t, grid_h, grid_w;    /* video grid, raster order (t, y, x) */
    double len_t, len_s;           /* video: length scales in frames and in latent pixels */
    double value_len;              /* length-scale multiplier of the value field */

    /* Sink overlay: sink_blocks key blocks carry a share of a pooled row drawn
     * uniformly in [sink_mass_min, sink_mass_max]; each query-block row gets
     * the overlay with probability sink_rows (others keep their base map).
     * sink family: every row, near no-op values (attention sinks).
     * uniform family: a quarter of the rows focus on one informative "hub"
     * block (values unscaled) — rows that differ in flatness from the rest. */
    int sink_blocks;
    double sink_mass_min, sink_mass_max;
    double sink_rows;
    double sink_value_scale; /* the sink tokens' values are scaled by this */
} exp_gen_params;

void exp_gen_defaults(exp_family f, exp_gen_params *p);

/* Host Q, K, V: f32, contiguous [B, H, N, D]. */
typedef struct {
    int64_t B, H, N, D;
    float *q, *k, *v;
    char label[96];
    /* the input's name in tables and plots: the family's, "uniform+hubs" where the uniform family has its hub rows
     * (experiments/README.md), "file" for --input */
    char name[32];
    /* with a sink overlay: requested sink share of each pooled row [B*H*Nqb],
     * negative for rows left without the overlay (NULL without sinks) */
    double *sink_share;
    int sink_blocks;
    int32_t *sink_index; /* [sink_blocks] key-block indices of the sinks */
} exp_qkv;

/* Returns 0 on success; on failure writes a message to stderr and returns -1. */
int exp_generate(const exp_gen_params *p, exp_qkv *out);
void exp_qkv_free(exp_qkv *x);

/* Pooled map in double on the host, exactly as DESIGN.md §1 defines it:
 * map [B,H,Nqb,Nkb], scale 0 -> 1/sqrt(D). Used by the generators and tests. */
void exp_pooled_map_host(const exp_qkv *x, int block_q, int block_k, double scale, double *map);

/* Summary of a pooled map's rows (over all B*H*Nqb rows). */
typedef struct {
    double entropy_mean, entropy_min, entropy_max; /* normalized: H(row) / log(Nkb), 1 = flat */
    double flat_ratio_max;  /* max over rows of max_j P / min_j P */
    double top1_mean;       /* mean of the largest entry */
    double sink_err_max;    /* max |sink share − requested| (0 if the input has no sinks) */
    double sink_share_mean; /* mean measured sink share (NaN without sinks) */
    double locality;        /* video: mass-weighted mean block distance / unweighted mean (NaN otherwise) */
} exp_map_summary;

/* grid_t/h/w: the video grid (0 for 1-D inputs). */
void exp_map_summarize(const exp_qkv *x, const double *map, int block_q, int block_k, int grid_t, int grid_h,
                       int grid_w, exp_map_summary *out);

/* ---------------------------------------------------------------- safetensors */

typedef struct {
    char name[128];
    char dtype[8]; /* "F32", "F16", "BF16" */
    int ndim;
    int64_t shape[8];
    uint64_t begin, end; /* byte offsets into the data section */
} exp_st_tensor;

typedef struct {
    int count;
    exp_st_tensor *tensors;
    uint64_t data_start; /* file offset of the data section */
    char path[512];
    char *metadata; /* the __metadata__ object's JSON text, or NULL */
} exp_st_file;

/* Parse the header. Returns 0, or -1 with a message in err. */
int exp_st_open(const char *path, exp_st_file *f, char *err, size_t err_len);
void exp_st_close(exp_st_file *f);
const exp_st_tensor *exp_st_find(const exp_st_file *f, const char *name);
/* The string value of key in the file's __metadata__ into out. Returns 0, or -1 when there is none. */
int exp_st_metadata(const exp_st_file *f, const char *key, char *out, size_t cap);
/* Read a tensor converted to f32 (malloc'd). Returns NULL with a message in err. */
float *exp_st_read_f32(const exp_st_file *f, const exp_st_tensor *t, char *err, size_t err_len);
/* The name a file bound for path is written under until it is complete: path.partPID (malloc'd) in *part, or NULL
 * where path exists and is not a regular file (/dev/stdout, a pipe, a symbolic link), which is written in place.
 * Returns 0, or -1 out of memory. */
int exp_part_path(const char *path, char **part);
/* Write n tensors, each 4-D or less, stored as dtype (f32 data converted). The file is written under
 * exp_part_path's name and renamed to path once complete: a failed write leaves what was at path. */
int exp_st_write(const char *path, int n, const char *const *names, const float *const *data, const int *ndims,
                 const int64_t (*shapes)[8], sparge_dtype dtype, const char *metadata_json, char *err, size_t err_len);

/* Load Q/K/V named names[0..2] from a safetensors file into x. Accepts 4-D
 * [B,H,N,D] (bnhd = 0) or [B,N,H,D] (bnhd = 1), or 3-D [H,N,D]. */
int exp_load_qkv(const char *path, const char *const names[3], int bnhd, exp_qkv *x);

/* ---------------------------------------------------------------- session */

/* One input on one device: Q/K/V uploaded in `dtype`, the dense output as the
 * reference, the pooled map (from sparge_mask_predict) for re-selection, and
 * a mask to fill. */
typedef struct {
    sparge_device *dev, *ref_dev;
    const exp_qkv *x;
    sparge_dtype dtype;
    int block_q, block_k;
    int64_t Nqb, Nkb, rows; /* rows = B*H*Nqb */
    void *dq, *dk, *dv, *dout; /* device memory */
    sparge_tensor tq, tk, tv, tout;
    float *map_host;   /* pooled map [B,H,Nqb,Nkb] */
    void *dmap;
    sparge_tensor tmap;
    sparge_mask *mask;
    float *o_ref;      /* dense output, host f32 [B,H,N,D] */
    float *o_sparse;   /* last sparse output, host f32 */
    double ref_l1;     /* sum |o_ref| */
    /* per query-block row [rows], filled by exp_row_stats for the current mask: kept blocks, kept pooled mass,
     * rel. L1 of the row's output, and the row's sum |o_ref| */
    int32_t *row_count;
    float *row_mass;
    double *row_err, *row_ref_l1;
} exp_session;

/* ref_backend: NULL or "" -> dense on `backend` itself; otherwise a separate
 * device (e.g. "cpu-ref") computes the dense reference in f32 inputs. */
int exp_session_open(exp_session *s, const char *backend, const char *ref_backend, const exp_qkv *x,
                     sparge_dtype dtype, int block_q, int block_k);
void exp_session_close(exp_session *s);

/* Fill s->mask by sparge_mask_select on the stored pooled map. Returns kept block pairs, -1 on error. */
int64_t exp_select(exp_session *s, double k, double p);
/* Run the sparse forward with s->mask into s->o_sparse. Returns 0 / -1. */
int exp_sparse_forward(exp_session *s);

typedef struct {
    double k, p;
    int64_t kept;
    double sparsity, token_density, mean_row_mass;
    double rel_l1, rel_l2;
} exp_point;

/* Select (k, p), run the forward, fill *pt. Returns 0 / -1. */
int exp_measure(exp_session *s, double k, double p, exp_point *pt);

/* Equal sparsity: find p (k fixed, may be 0) whose mask keeps the number of
 * block pairs closest to target_kept (bisection on the achieved sparsity;
 * ties prefer the smaller p). Returns the kept count, -1 on error. */
int64_t exp_calibrate_p(exp_session *s, double k, int64_t target_kept, double *p_out);
/* Top-k fraction whose count per row is n (so every row keeps exactly n blocks). */
double exp_topk_for_count(int64_t n, int64_t Nkb);

/* A masking rule: Top-k (p = 0), Top-p (k = 0) or hybrid. */
typedef struct {
    const char *name;
    double k, p;
} exp_rule;

enum { EXP_TOPK, EXP_TOPP, EXP_HYBRID, EXP_RULES };
/* The paper's ablation arms: Top-k k = 0.05, Top-p p = 0.4, hybrid k = 0.03, p = 0.2. */
extern const exp_rule exp_paper_arms[EXP_RULES];
/* The three rules at equal sparsity: Top-k keeps n = floor(topk·Nkb) blocks
 * per row; Top-p's p and the hybrid's p (its k fixed at hybrid_k) are
 * calibrated to the same kept count. Returns 0 / -1. */
int exp_equal_sparsity_rules(exp_session *s, double topk, double hybrid_k, exp_rule out[EXP_RULES]);

/* Fills the session's per-row statistics (row_count, row_mass, row_err, row_ref_l1) for its mask. Returns 0 / -1. */
int exp_row_stats(exp_session *s);

/* ---------------------------------------------------------------- statistics (exp_stats.c) */

/* n values: their mean and sample standard deviation (n − 1 denominator; NaN for n < 2). */
typedef struct {
    int n;
    double mean, sd;
} exp_summary;
void exp_summarize(const double *x, int n, exp_summary *out);

/* The regularized incomplete beta function I_x(a, b) (a, b > 0, x clamped to [0, 1]). */
double exp_incomplete_beta(double a, double b, double x);
/* Student's t with df degrees of freedom: P(|T| >= |t|), and the q-quantile (0.5 < q < 1). */
double exp_t_two_sided_p(double t, double df);
double exp_t_quantile(double q, double df);

typedef enum { EXP_TEST_NONE = 0, EXP_TEST_WELCH, EXP_TEST_ONE_SAMPLE } exp_test_kind;
/* The difference of two means a − b with its confidence interval [lo, hi] at `level` (e.g. 0.95) and the two-sided
 * p of t: Welch's t-test when both groups have two values or more (Welch–Satterthwaite degrees of freedom), the
 * one-sample test of the larger group against the single value of the other when one has one value, nothing
 * (kind NONE, NaNs) when neither has two. */
typedef struct {
    exp_test_kind kind;
    double diff, lo, hi, t, df, p;
} exp_test;
void exp_welch(const exp_summary *a, const exp_summary *b, double level, exp_test *out);

/* ---------------------------------------------------------------- command line */

/* An option is a row of a table: its name, what its value is, where the value goes and a line of help. Every
 * driver takes the common options (exp_parse adds them) and declares its own in a table of the same rows. */
typedef enum {
    EXP_OPT_FLAG,   /* int: set to 1; takes no value */
    EXP_OPT_STR,    /* const char *: the value itself */
    EXP_OPT_OUT,    /* FILE *: a path, opened for writing once every other value is good; kept by exp_close_outputs */
    EXP_OPT_INT,    /* int: a whole number in [min, max] */
    EXP_OPT_I64,    /* int64_t: a whole number in [min, max] */
    EXP_OPT_DBL,    /* double: a number in [min, max] (a bound is left out where excl says so) */
    EXP_OPT_LIST,   /* double[len]: comma-separated numbers as DBL; exactly len of them, or 1..len with count */
    EXP_OPT_CHOICE, /* int: the index of the value among choices ("a|b|c") */
    EXP_OPT_CUSTOM  /* anything: parse() reads the value, show() prints it */
} exp_opt_kind;

enum { EXP_EXCL_MIN = 1, EXP_EXCL_MAX = 2 };

typedef struct exp_opt {
    const char *name; /* "--stride" */
    exp_opt_kind kind;
    void *ptr;
    const char *arg;  /* the value's name in the help ("S"); for a CHOICE, its choices */
    const char *help;
    double min, max;  /* numbers: the accepted range */
    int excl;         /* EXP_EXCL_MIN, EXP_EXCL_MAX: the bound itself is refused */
    int len;          /* LIST: the most values */
    int *count;       /* LIST: how many were given (NULL: exactly len) */
    const char *none; /* LIST with a count: the word that gives no values ("none"), or NULL */
    const char *def;  /* the default as the help shows it, where the value itself does not say it */
    const char *header; /* OUT: the first line written once it is open (a CSV header) */
    /* CUSTOM: read value into ptr, returning NULL or what the value should be ("TxHxW, three whole numbers");
     * show writes the current value for the help. */
    const char *(*parse)(void *ptr, const char *value);
    void (*show)(const void *ptr, char *buf, size_t len);
} exp_opt;

/* Rows of an option table (designated initializers, so a row may add fields: {EXP_DBL(...), .excl = ...}). */
#define EXP_FLAG(n, p, h) .name = (n), .kind = EXP_OPT_FLAG, .ptr = (p), .help = (h)
#define EXP_STR(n, p, a, h) .name = (n), .kind = EXP_OPT_STR, .ptr = (p), .arg = (a), .help = (h)
#define EXP_OUT(n, p, h) .name = (n), .kind = EXP_OPT_OUT, .ptr = (p), .arg = "PATH", .help = (h)
#define EXP_NUMBER_(k, n, p, a, lo, hi, h)                                                                            \
    .name = (n), .kind = (k), .ptr = (p), .arg = (a), .min = (lo), .max = (hi), .help = (h)
#define EXP_INT(n, p, a, lo, hi, h) EXP_NUMBER_(EXP_OPT_INT, n, p, a, lo, hi, h)
#define EXP_I64(n, p, a, lo, hi, h) EXP_NUMBER_(EXP_OPT_I64, n, p, a, lo, hi, h)
#define EXP_DBL(n, p, a, lo, hi, h) EXP_NUMBER_(EXP_OPT_DBL, n, p, a, lo, hi, h)
#define EXP_LIST(n, p, length, cnt, a, lo, hi, h)                                                                    \
    EXP_NUMBER_(EXP_OPT_LIST, n, p, a, lo, hi, h), .len = (length), .count = (cnt)
#define EXP_CHOICE(n, p, choices, h) .name = (n), .kind = EXP_OPT_CHOICE, .ptr = (p), .arg = (choices), .help = (h)
#define EXP_CUSTOM(n, p, a, parser, shower, h)                                                                       \
    .name = (n), .kind = EXP_OPT_CUSTOM, .ptr = (p), .arg = (a), .parse = (parser), .show = (shower), .help = (h)
#define EXP_COUNT(table) ((int)(sizeof(table) / sizeof((table)[0])))

/* The family knobs, one value for every family they apply to (experiments/README.md, "Input families"). */
typedef struct {
    int64_t seed, heads, dim, tokens; /* tokens: uniform and sink */
    int grid[3];                      /* video: T, H, W */
    int block_q, block_k;
    double tau[2];       /* uniform: min, max */
    double focus[2];     /* uniform: share of hub rows, their mass on the hub */
    double sink_mass[2]; /* sink and video: min, max */
    int sink_blocks;     /* sink */
    int video_sinks;     /* video */
    double sink_value;   /* sink and video */
    double sharpness, len_seq, len_t, len_s, jitter;
    double value[3];     /* DC, block/field, noise */
} exp_knobs;

/* An output option's file while the run writes it: PATH.partPID beside PATH, renamed to PATH by exp_close_outputs
 * once the run has succeeded, so that a failed run leaves no partial file and an earlier PATH stays whole. A path that
 * exists and is not a regular file (/dev/stdout, a pipe, a symbolic link) is written in place (part NULL). */
typedef struct {
    FILE **f;         /* the option's FILE * */
    const char *name; /* "--csv" */
    const char *path;
    char *part;
} exp_output;

enum { EXP_MAX_OUTPUTS = 8 };

/* The common options, and what follows from them. */
typedef struct {
    const char *backend;     /* --backend (default "cpu") */
    const char *ref_backend; /* --ref (default: the same backend) */
    int dtype;               /* --dtype f32|f16|bf16: a sparge_dtype */
    FILE *csv, *md;          /* --csv PATH, --md PATH (md is stdout without --md) */
    const char *input;       /* --input FILE.safetensors */
    const char *names[3];    /* --names q,k,v */
    char names_buf[256];
    int bnhd;                /* --layout bhnd|bnhd */
    int quiet;               /* --quiet */
    int seeds;               /* --seeds N (repetitions with seed, seed+1, ...) */
    double topk, hybrid_k;   /* --topk, --hybrid-k: the rules at equal sparsity, for drivers that compare them */
    exp_knobs knobs;
    int families[3];         /* --families (default uniform,sink,video); --input replaces them by EXP_FILE */
    int nfamilies;
    exp_gen_params gen[3];   /* per family: its defaults with the knobs applied (by exp_parse) */
    exp_output outputs[EXP_MAX_OUTPUTS]; /* opened by exp_parse */
    int noutputs;
    const struct exp_driver *driver;
} exp_opts;

/* One input of the driver loop: family o->families[fi], seed index si, with its session open on --backend. */
typedef struct {
    int index; /* inputs started so far */
    int fi, si;
    exp_family family;
    exp_gen_params g;
    exp_qkv x;
    exp_session s;
    exp_rule equal[EXP_RULES]; /* the rules at equal sparsity, where the driver asks for them */
    int open;
} exp_input;

/* A driver: its name (messages, help, the progress tag without "exp_"), what it does (the help's first lines), the
 * common options it accepts but does not use (so that one argument list serves every driver), its own options, its
 * changes to the common defaults, and its work: run once the outputs are open, each for every input (families times
 * seeds, unless it ignores --seeds), done after the last. Each returns 0, or the exit status after a message. A
 * driver with equal set takes --topk and --hybrid-k, and every input comes with its rules at equal sparsity. */
typedef struct exp_driver {
    const char *name;
    const char *about;
    const char *ignores; /* e.g. "--ref --seeds", or NULL */
    const exp_opt *own;
    int nown;
    const char *csv_header; /* the first line of --csv */
    const char *md_header;  /* Markdown before the first input: the head of the table the inputs add rows to */
    int nfamilies;  /* the default --families: the first n of uniform,sink,video (0: all three) */
    int64_t tokens; /* the default --tokens (0: the generators') */
    int equal;      /* compares the rules at equal sparsity */
    int own_only;   /* takes its own options and only --csv, --md, --quiet of the common ones (no synthetic inputs:
                     * a driver of this kind does its work in run) */
    int (*run)(exp_opts *o);
    int (*each)(exp_opts *o, exp_input *in);
    int (*done)(exp_opts *o);
} exp_driver;

/* The common defaults with d's changes. */
void exp_opts_init(exp_opts *o, const exp_driver *d);
/* Reads argv[1..] against the common options and the driver's: every name first (an unknown one, a missing value,
 * or --help / -h ends it there), then the values, then the outputs are opened (two options naming one path are
 * refused). Returns 0; 1 for --help; -1 with a message naming the option in err, and then no output exists. */
int exp_parse(exp_opts *o, int argc, char **argv, char *err, size_t err_len);
/* Closes the outputs exp_parse opened. With ok, each is flushed and renamed to its path; a write that failed is
 * reported and then, as without ok, every output's partial file is removed. Returns 0, or -1 after a message on
 * stderr. */
int exp_close_outputs(exp_opts *o, int ok);
/* The driver's help: what it does, then every option (its own first) with its current value as the default. */
void exp_usage(FILE *out, exp_opts *o);
/* A driver's whole main: options, outputs, run, the inputs, done. Returns the exit status: 0; 2 for a bad command
 * line; 1 or what the driver returned after an error. */
int exp_main(const exp_driver *d, int argc, char **argv);

/* The input of family f: Q/K/V loaded from o->input for EXP_FILE, otherwise generated from o->gen[f] with its seed
 * advanced by seed_offset. *g receives the parameters (for a file, the uniform family's: they give the block sizes).
 * Returns 0, or -1 with a message printed. */
int exp_family_input(const exp_opts *o, exp_family f, uint64_t seed_offset, exp_gen_params *g, exp_qkv *x);

/* ---------------------------------------------------------------- output */

/* Progress to stderr ("[table1] uniform N=32768 seed 1: ..."), unless --quiet. */
void exp_progress(const exp_opts *o, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Seconds of wall clock (monotonic). */
double exp_now(void);
/* Prints "what: sparge message" and returns -1 when s != OK. */
int exp_check(sparge_status s, const char *what);
/* Formats a message into err (when err_len > 0) and returns -1: the error path of the functions that report into
 * their caller's buffer (safetensors, trainer, the option parser). */
int exp_fail(char *err, size_t err_len, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#endif
