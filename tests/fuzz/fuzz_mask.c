/* libFuzzer target for masks and attention on "cpu" and "cpu-ref" (docs/RELIABILITY.md, "Fuzzing").
 *
 * The input bytes decode into a mask shape (B, H, Nq, Nk, blocks, causal, packed sequences, some empty; now and
 * then an invalid or overflowing one), then a sequence of operations on one mask per device: selections from a
 * pooled map (any floats, strided views, k and p from a table of edge values), imports of dense masks (rows
 * possibly empty), inspections (get_csr with or without the transpose, get_dense, get_stats), small forwards and
 * backwards (D, dtype, layout, scale, deterministic, dense or masked, NaN/Inf injected) and misuse (NULLs, the
 * other device's mask).
 * A missing byte reads as 0, so every input is valid.
 *
 * Every call runs on both devices. An accepted call is checked against an oracle: the selection rule of
 * docs/DESIGN.md §1.5–1.6 written here again, the CSR, transpose, dense view and statistics derived from
 * it, an fp64 forward, and cpu against cpu-ref within sparge_dtype_tolerance(). A refused call must say why
 * ("file:line: what: why", naming the function, freshly written) and leave every output and the mask as they
 * were (poisoned buffers). Both devices must return the same status. Any violation aborts. */
#include <ctype.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparge.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* ------------------------------------------------------------------ input and violations */

typedef struct {
    const uint8_t *p;
    size_t n;
} input;

static unsigned u8(input *in)
{
    if (!in->n)
        return 0;
    in->n--;
    return *in->p++;
}

static uint32_t u32(input *in)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v = v << 8 | u8(in);
    return v;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static char step[160]; /* the operation under way, printed with a violation */

static void violation(int line, const char *cond, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "\nfuzz_mask.c:%d: oracle violated during %s: %s\n  ", line, step, cond);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    abort();
}
#define CHECK(cond, ...)                                                                                               \
    do {                                                                                                               \
        if (!(cond))                                                                                                   \
            violation(__LINE__, #cond, __VA_ARGS__);                                                                   \
    } while (0)

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        abort();
    return p;
}

/* ------------------------------------------------------------------ devices, statuses, messages */

enum { FAST, REF, NDEV };
static const char *const dev_names[NDEV] = {"cpu", "cpu-ref"};
static sparge_device *dev[NDEV];

#define BIT(s) (1u << (s))

/* A refusal must write its own message: a known one is planted before every call. */
static char planted[1024];
static void plant(void)
{
    (void)sparge_mask_get_shape(NULL, NULL);
    snprintf(planted, sizeof planted, "%s", sparge_last_error());
}

/* "file:line: what: why" */
static int well_formed(const char *msg)
{
    const char *colon = strchr(msg, ':');
    if (!colon || colon == msg || memchr(msg, ' ', (size_t)(colon - msg)))
        return 0;
    const char *p = colon + 1;
    if (!isdigit((unsigned char)*p))
        return 0;
    while (isdigit((unsigned char)*p))
        p++;
    if (strncmp(p, ": ", 2) != 0)
        return 0;
    const char *why = strstr(p + 2, ": ");
    return why && why > p + 2 && why[2] != 0;
}

/* s must be one of `allowed`; a refusal must explain itself. */
static void outcome(sparge_status s, unsigned allowed, const char *fn, const char *who)
{
    CHECK(allowed & BIT(s), "%s on %s returned %s (%s); allowed mask 0x%x", fn, who, sparge_status_name(s),
          s ? sparge_last_error() : "", allowed);
    if (s == SPARGE_OK)
        return;
    const char *msg = sparge_last_error();
    CHECK(strcmp(msg, planted) != 0, "%s on %s refused with %s without a message of its own", fn, who,
          sparge_status_name(s));
    CHECK(well_formed(msg), "%s on %s: message \"%s\" is not \"file:line: what: why\"", fn, who, msg);
    CHECK(strstr(msg, fn) != NULL, "%s on %s: message \"%s\" does not name the function", fn, who, msg);
}

/* ------------------------------------------------------------------ edge values */

static double param_value(unsigned c)
{
    static const double table[] = {0.0,  -0.0, 1.0,   0.5,   0.03,   0.2,     1e-300, 5e-324, 0.29,  1.0 / 3.0,
                                   NAN,  -NAN, INFINITY, -INFINITY, -0.1, 1.0000001, 0.9999999, 1e-6, 2.0, 0.1,
                                   0.16, 0.4,  0.05,  0.999, 0.75,  0.25,    0.01,   0.9};
    enum { N = sizeof table / sizeof table[0] };
    return c < N ? table[c] : (double)(c - N) / (double)(256 - N); /* [0, 1) */
}

static float scale_value(unsigned c)
{
    static const float table[] = {0.0f,  1.0f,  -1.0f, 0.125f, 0.5f,      2.0f,      1e-30f, -1e-30f,
                                  NAN,   INFINITY, -INFINITY, 1e30f, FLT_MIN, 4.0f,  0.35f,  -0.0f};
    return table[c % (sizeof table / sizeof table[0])];
}

/* A pooled-map entry: edge values, ties and tiny/huge magnitudes. */
static float map_entry(unsigned c)
{
    static const float table[] = {0.0f,    -0.0f,  1.0f,  0.5f,      0.25f,     0.125f,   1.0f / 3.0f, 0.1f,
                                  0.2f,    0.7f,   NAN,   INFINITY,  -INFINITY, -1.0f,    -0.5f,       FLT_MIN,
                                  1e-45f,  FLT_MAX, -FLT_MAX, 1e-8f, 0.03f,     0.97f,    2.0f,        1e30f};
    enum { N = sizeof table / sizeof table[0] };
    return c < N ? table[c] : (float)(c - N) / 64.0f; /* many ties */
}

/* ------------------------------------------------------------------ shapes and the mask pair */

typedef struct {
    int64_t B, H, Nq, Nk; /* packed varlen: Nq, Nk are the totals */
    int bq, bk;
    int causal;             /* a block-causal mask (DESIGN §1.12) */
    int varlen;             /* B packed sequences of their own lengths, cu_q and cu_k their offsets */
    int32_t cu_q[3], cu_k[3];
    int64_t maxq, maxk;     /* the longest sequence's tokens (Nq, Nk without varlen) */
    int64_t Nqb, Nkb, rows, cells;
} shape;

typedef struct {
    shape s;
    sparge_mask *m[NDEV];
    int filled;
    uint8_t *dense;          /* the selection the oracle expects, [rows × Nkb] */
    double *mass[NDEV];      /* its row masses on each device (NaN for an imported mask; a prediction's come from
                              * the device's own pooled map) */
    double *mass_abs[NDEV];  /* sums of the magnitudes of the kept entries: the scale of a mass's rounding */
    float *map[NDEV];        /* a predicted mask's pooled map as the device returned it; NULL otherwise */
} mask_pair;

static const int block_codes[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 17, 31, 32, 64, 128, 1000, 3};

/* a·b saturating at 2^100: sizes large enough to overflow int64 stay recognisable. */
static unsigned __int128 sat_mul(unsigned __int128 a, unsigned __int128 b)
{
    const unsigned __int128 cap = (unsigned __int128)1 << 100;
    if (a == 0 || b == 0)
        return 0;
    return a > cap / b ? cap : a * b;
}

enum { MAX_MASK_BYTES = 16 << 20 };

/* The status sparge_mask_create must return, or 0 with *skip set where the call would legitimately ask for
 * more memory than a fuzzing run may take. */
static unsigned create_expectation(const shape *s, int *skip)
{
    *skip = 0;
    if (s->B <= 0 || s->H <= 0 || s->Nq <= 0 || s->Nk <= 0 || s->bq <= 0 || s->bk <= 0)
        return BIT(SPARGE_ERR_INVALID);
    if (s->Nq > INT32_MAX || s->Nk > INT32_MAX)
        return BIT(SPARGE_ERR_OVERFLOW);
    for (int64_t b = 0; b < (s->varlen ? s->B : 1); b++) { /* queries need keys; causal, no more than keys */
        const int64_t nq = s->varlen ? s->cu_q[b + 1] - s->cu_q[b] : s->Nq,
                      nk = s->varlen ? s->cu_k[b + 1] - s->cu_k[b] : s->Nk;
        if ((nq > 0 && nk == 0) || (s->causal && nq > nk))
            return BIT(SPARGE_ERR_SHAPE);
    }
    const int64_t Nqb = (s->maxq + s->bq - 1) / s->bq, Nkb = (s->maxk + s->bk - 1) / s->bk;
    unsigned __int128 cells = sat_mul(sat_mul(sat_mul((uint64_t)s->B, (uint64_t)s->H), (uint64_t)Nqb), (uint64_t)Nkb);
    if (sat_mul(cells, 4) > (unsigned __int128)INT64_MAX)
        return BIT(SPARGE_ERR_OVERFLOW); /* the indices alone take more bytes than int64 counts */
    if (sat_mul(cells, 16) > MAX_MASK_BYTES) {
        *skip = 1;
        return 0;
    }
    return BIT(SPARGE_OK);
}

static shape decode_shape(input *in)
{
    const unsigned kind = u8(in);
    shape s = {0};
    s.B = 1 + u8(in) % 2;
    s.H = 1 + u8(in) % 2;
    s.Nq = 1 + u8(in) % 48;
    s.Nk = 1 + u8(in) % 48;
    s.bq = block_codes[u8(in) % 20];
    s.bk = block_codes[u8(in) % 20];
    s.causal = kind < 224 && (kind & 1);
    if (s.causal && s.Nq > s.Nk && (kind & 2)) { /* mostly a valid causal shape: Nq <= Nk */
        const int64_t t = s.Nq;
        s.Nq = s.Nk, s.Nk = t;
    }
    s.varlen = kind < 224 && (kind & 4);
    s.maxq = s.maxk = 0;
    for (int64_t b = 0; s.varlen && b < s.B; b++) { /* sequences of 1..24 tokens each, now and then of none */
        const unsigned cq = u8(in), ck = u8(in);
        int32_t nq = cq >= 232 ? 0 : 1 + (int32_t)(cq % 24), nk = ck >= 232 ? 0 : 1 + (int32_t)(ck % 24);
        if (s.causal && nq > nk && (kind & 2)) {
            const int32_t t = nq;
            nq = nk, nk = t;
        }
        s.cu_q[b + 1] = s.cu_q[b] + nq, s.cu_k[b + 1] = s.cu_k[b] + nk;
        s.maxq = nq > s.maxq ? nq : s.maxq, s.maxk = nk > s.maxk ? nk : s.maxk;
        s.Nq = s.cu_q[b + 1], s.Nk = s.cu_k[b + 1];
    }
    if (kind >= 224) { /* one field replaced by an invalid, huge or overflowing value */
        static const int64_t dims[] = {0, -1, -7, INT64_MIN, (int64_t)INT32_MAX + 1, INT64_MAX, INT32_MAX,
                                       (int64_t)1 << 40};
        static const int blocks[] = {0, -1, INT32_MIN, INT32_MAX};
        const unsigned c = u8(in);
        switch (kind % 6) {
        case 0: s.B = dims[c % 8]; break;
        case 1: s.H = dims[c % 8]; break;
        case 2: s.Nq = dims[c % 8]; break;
        case 3: s.Nk = dims[c % 8]; break;
        case 4: s.bq = blocks[c % 4]; break;
        default: s.bk = blocks[c % 4]; break;
        }
    }
    if (!s.varlen)
        s.maxq = s.Nq, s.maxk = s.Nk;
    return s;
}

static void free_pair(mask_pair *mp)
{
    for (int d = 0; d < NDEV; d++)
        sparge_mask_destroy(mp->m[d]);
    free(mp->dense);
    for (int d = 0; d < NDEV; d++) {
        free(mp->mass[d]);
        free(mp->mass_abs[d]);
        free(mp->map[d]);
    }
}

/* The masks now hold a selection made here or imported, not a prediction: the same masses on both devices. */
static void selection_made(mask_pair *mp)
{
    memcpy(mp->mass[FAST], mp->mass[REF], (size_t)mp->s.rows * sizeof(double));
    memcpy(mp->mass_abs[FAST], mp->mass_abs[REF], (size_t)mp->s.rows * sizeof(double));
    for (int d = 0; d < NDEV; d++) {
        free(mp->map[d]);
        mp->map[d] = NULL;
    }
    mp->filled = 1;
}

/* ------------------------------------------------------------------ the selection oracle (§1.5–1.6) */

/* Kept count of one row and its flags: rank every entry by counting those ordered before it (larger, or
 * IEEE-equal with a lower index), no sort; a row holding NaN keeps everything. */
static int64_t oracle_row(const float *row, int64_t n, double k, double p, uint8_t *keep, double *mass,
                          double *mass_abs, int64_t *order)
{
    *mass_abs = 0.0;
    for (int64_t j = 0; j < n; j++)
        if (isnan(row[j])) {
            memset(keep, 1, (size_t)n);
            *mass = NAN;
            return n;
        }
    for (int64_t j = 0; j < n; j++) {
        int64_t rank = 0;
        for (int64_t i = 0; i < n; i++)
            rank += row[i] > row[j] || (row[i] == row[j] && i < j);
        order[rank] = j;
    }
    int64_t nk = 0, np = 0;
    if (k != 0.0) {
        nk = (int64_t)floor(k * (double)n + 1e-6);
        nk = nk < 1 ? 1 : nk > n ? n : nk;
    }
    if (p != 0.0) {
        double c = 0.0;
        np = n;
        for (int64_t t = 0; t < n; t++)
            if ((c += (double)row[order[t]]) >= p) {
                np = t + 1;
                break;
            }
    }
    int64_t kept = nk > np ? nk : np;
    kept = kept < 1 ? 1 : kept;
    memset(keep, 0, (size_t)n);
    double sum = 0.0;
    for (int64_t t = 0; t < kept; t++) {
        keep[order[t]] = 1;
        sum += (double)row[order[t]];
        *mass_abs += fabs((double)row[order[t]]);
    }
    *mass = sum;
    return kept;
}

/* ------------------------------------------------------------------ inspection of a mask */

static int64_t block_len(int64_t i, int64_t block, int64_t n) { return (i + 1) * block <= n ? block : n - i * block; }

/* Sequence b: its query tokens [*q0, *q0 + *nq) and key tokens [*k0, *k0 + *nk) in tensor batch *tb (packed
 * varlen tensors have one). */
static void seq_of(const shape *s, int64_t b, int64_t *tb, int64_t *q0, int64_t *nq, int64_t *k0, int64_t *nk)
{
    if (!s->varlen) {
        *tb = b, *q0 = *k0 = 0, *nq = s->Nq, *nk = s->Nk;
        return;
    }
    *tb = 0, *q0 = s->cu_q[b], *nq = s->cu_q[b + 1] - s->cu_q[b], *k0 = s->cu_k[b], *nk = s->cu_k[b + 1] - s->cu_k[b];
}

/* Whether query t may attend key u of a sequence of nq queries and nk keys (bottom-right causal alignment). */
static int attendable(const shape *s, int64_t nq, int64_t nk, int64_t t, int64_t u)
{
    return !s->causal || u <= t + nk - nq;
}

/* Query block i of sequence b: it may keep key blocks [0, *allowed), those holding a key some query of it may
 * attend, and must keep [*diag0, *allowed), those holding a query's last attendable key (none without causal).
 * A row past the sequence's query blocks may keep nothing. */
static void row_rule(const shape *s, int64_t b, int64_t i, int64_t *allowed, int64_t *diag0)
{
    int64_t tb, q0, nq, k0, nk;
    seq_of(s, b, &tb, &q0, &nq, &k0, &nk);
    *allowed = 0;
    *diag0 = s->Nkb;
    for (int64_t t = i * s->bq; t < nq && t < (i + 1) * s->bq; t++)
        for (int64_t j = 0; j * s->bk < nk; j++)
            if (attendable(s, nq, nk, t, j * s->bk)) {
                *allowed = j + 1 > *allowed ? j + 1 : *allowed;
                if (s->causal && (j + 1) * s->bk > t + nk - nq) /* holds t's last attendable key */
                    *diag0 = j < *diag0 ? j : *diag0;
            }
}

/* The (query, key) pairs of block pair (i, j) of sequence b that may attend. */
static double attendable_pairs(const shape *s, int64_t b, int64_t i, int64_t j)
{
    int64_t tb, q0, nq, k0, nk;
    seq_of(s, b, &tb, &q0, &nq, &k0, &nk);
    double n = 0.0;
    for (int64_t t = i * s->bq; t < nq && t < (i + 1) * s->bq; t++)
        for (int64_t u = j * s->bk; u < nk && u < (j + 1) * s->bk; u++)
            n += attendable(s, nq, nk, t, u);
    return n;
}

/* The selection of row i of sequence b of a map: the rule on its allowed blocks, then every diagonal block (mass
 * included); nothing (mass 0) for a row past its sequence. */
static void oracle_select(const shape *s, int64_t b, int64_t i, const float *row, double k, double p,
                          uint8_t *keep, double *mass, double *mass_abs, int64_t *order)
{
    int64_t allowed, diag0;
    row_rule(s, b, i, &allowed, &diag0);
    *mass = *mass_abs = 0.0;
    if (allowed)
        oracle_row(row, allowed, k, p, keep, mass, mass_abs, order);
    memset(keep + allowed, 0, (size_t)(s->Nkb - allowed));
    for (int64_t j = diag0; j < allowed; j++)
        if (!keep[j]) {
            keep[j] = 1;
            *mass += (double)row[j];
            *mass_abs += fabs((double)row[j]);
        }
}

static int close_to(double got, double want, double rel)
{
    if (isnan(want))
        return isnan(got);
    if (isinf(want))
        return got == want;
    return fabs(got - want) <= rel * fmax(1.0, fabs(want));
}

/* A stored f32 row mass against the oracle's fp64 sum. The rule fixes which entries are summed, not the order
 * of the sum: allow the f32 rounding plus an fp64 reordering of the kept magnitudes. */
static int mass_ok(float got, double want, double abs)
{
    if (isnan(want))
        return isnan(got);
    if (isinf((float)want) && got == (float)want) /* a sum past FLT_MAX, stored as Inf */
        return 1;
    return fabs((double)got - want) <= 1e-7 * fabs(want) + 1e-12 * abs + 1e-45;
}

enum { POISON_I32 = 0x5a5a5a5a };

/* Every getter on both devices against the expected selection; on an empty mask, SPARGE_ERR_MASK with the
 * outputs untouched. `transpose` asks get_csr for t_counts/t_indices (building the transpose if needed). */
static void inspect(mask_pair *mp, int transpose)
{
    const shape *s = &mp->s;
    const int64_t bh = s->B * s->H, tcells = bh * s->Nkb;
    int32_t *counts = xmalloc((size_t)s->rows * 4), *indices = xmalloc((size_t)s->cells * 4);
    int32_t *tc = xmalloc((size_t)tcells * 4), *ti = xmalloc((size_t)s->cells * 4);
    uint8_t *dense = xmalloc((size_t)s->cells);
    double *head_sp = xmalloc((size_t)bh * sizeof(double));
    float *row_mass = xmalloc((size_t)s->rows * sizeof(float)), *map = xmalloc((size_t)s->cells * sizeof(float));
    const unsigned want = mp->filled ? BIT(SPARGE_OK) : BIT(SPARGE_ERR_MASK);
    for (int d = 0; d < NDEV; d++) {
        sparge_mask *m = mp->m[d];
        memset(counts, 0x5a, (size_t)s->rows * 4);
        memset(indices, 0x5a, (size_t)s->cells * 4);
        memset(tc, 0x5a, (size_t)tcells * 4);
        memset(ti, 0x5a, (size_t)s->cells * 4);
        snprintf(step, sizeof step, "sparge_mask_get_csr on %s (transpose %d)", dev_names[d], transpose);
        plant();
        sparge_status st = sparge_mask_get_csr(m, counts, indices, transpose ? tc : NULL, transpose ? ti : NULL);
        outcome(st, want, "sparge_mask_get_csr", dev_names[d]);
        if (st) {
            for (int64_t i = 0; i < s->rows; i++)
                CHECK(counts[i] == POISON_I32, "refused get_csr wrote counts[%lld]", (long long)i);
            for (int64_t i = 0; i < s->cells; i++)
                CHECK(indices[i] == POISON_I32 && ti[i] == POISON_I32, "refused get_csr wrote indices");
            for (int64_t i = 0; i < tcells; i++)
                CHECK(tc[i] == POISON_I32, "refused get_csr wrote t_counts");
        } else {
            for (int64_t r = 0; r < s->rows; r++) {
                const uint8_t *keep = mp->dense + r * s->Nkb;
                const int32_t *idx = indices + r * s->Nkb;
                int64_t n = 0, allowed, diag0;
                row_rule(s, r / (s->H * s->Nqb), r % s->Nqb, &allowed, &diag0);
                for (int64_t j = 0; j < s->Nkb; j++)
                    n += keep[j];
                CHECK(counts[r] == n && n >= (allowed > 0), "row %lld: count %d, the oracle keeps %lld", (long long)r,
                      counts[r], (long long)n);
                for (int64_t c = 0; c < s->Nkb; c++) {
                    if (c < n) {
                        CHECK(idx[c] >= 0 && idx[c] < s->Nkb && keep[idx[c]] && (c == 0 || idx[c] > idx[c - 1]),
                              "row %lld entry %lld = %d: not the kept blocks ascending", (long long)r, (long long)c,
                              idx[c]);
                    } else {
                        CHECK(idx[c] == -1, "row %lld entry %lld = %d past the count %lld", (long long)r,
                              (long long)c, idx[c], (long long)n);
                    }
                }
            }
            if (transpose)
                for (int64_t h = 0; h < bh; h++)
                    for (int64_t j = 0; j < s->Nkb; j++) {
                        const int32_t *col = ti + (h * s->Nkb + j) * s->Nqb;
                        int64_t c = 0;
                        for (int64_t i = 0; i < s->Nqb; i++)
                            if (mp->dense[(h * s->Nqb + i) * s->Nkb + j]) {
                                CHECK(c < s->Nqb && col[c] == i, "transpose of head %lld key block %lld: entry %lld "
                                      "is %d, expected query block %lld", (long long)h, (long long)j, (long long)c,
                                      col[c], (long long)i);
                                c++;
                            }
                        CHECK(tc[h * s->Nkb + j] == c, "t_counts[%lld,%lld] = %d, expected %lld", (long long)h,
                              (long long)j, tc[h * s->Nkb + j], (long long)c);
                        for (int64_t i = c; i < s->Nqb; i++)
                            CHECK(col[i] == -1, "transpose entry past the count is %d", col[i]);
                    }
        }

        memset(dense, 0xab, (size_t)s->cells);
        snprintf(step, sizeof step, "sparge_mask_get_dense on %s", dev_names[d]);
        plant();
        st = sparge_mask_get_dense(m, dense);
        outcome(st, want, "sparge_mask_get_dense", dev_names[d]);
        for (int64_t i = 0; i < s->cells; i++)
            CHECK(st ? dense[i] == 0xab : dense[i] == mp->dense[i], "dense[%lld] = %u (status %s, expected %u)",
                  (long long)i, dense[i], sparge_status_name(st), st ? 0xab : mp->dense[i]);

        sparge_mask_stats stats;
        memset(&stats, 0x5a, sizeof stats);
        memset(head_sp, 0x5a, (size_t)bh * sizeof(double));
        memset(row_mass, 0x5a, (size_t)s->rows * sizeof(float));
        snprintf(step, sizeof step, "sparge_mask_get_stats on %s", dev_names[d]);
        plant();
        st = sparge_mask_get_stats(m, &stats, head_sp, row_mass);
        outcome(st, want, "sparge_mask_get_stats", dev_names[d]);
        if (st) {
            const unsigned char *b = (const unsigned char *)&stats;
            for (size_t i = 0; i < sizeof stats; i++)
                CHECK(b[i] == 0x5a, "refused get_stats wrote its result");
            for (int64_t i = 0; i < s->rows; i++)
                CHECK(((uint32_t *)row_mass)[i] == POISON_I32, "refused get_stats wrote row_mass");
        } else {
            int64_t kept = 0, total = 0, mn = INT64_MAX, mx = 0, real_rows = 0;
            double pairs = 0.0, all_pairs = 0.0, mass_sum = 0.0;
            for (int64_t h = 0; h < bh; h++) {
                int64_t head_kept = 0, head_allowed = 0;
                for (int64_t i = 0; i < s->Nqb; i++) {
                    const int64_t r = h * s->Nqb + i;
                    int64_t n = 0, allowed, diag0;
                    row_rule(s, h / s->H, i, &allowed, &diag0);
                    for (int64_t j = 0; j < allowed; j++) {
                        const double ap = attendable_pairs(s, h / s->H, i, j);
                        all_pairs += ap;
                        if (mp->dense[r * s->Nkb + j]) {
                            n++;
                            pairs += ap;
                        }
                    }
                    CHECK(mass_ok(row_mass[r], mp->mass[d][r], mp->mass_abs[d][r]),
                          "row %lld: mass %.9g, expected %.9g", (long long)r, row_mass[r], mp->mass[d][r]);
                    if (!allowed) /* past its sequence: in no statistic */
                        continue;
                    real_rows++;
                    head_allowed += allowed;
                    head_kept += n;
                    mn = n < mn ? n : mn;
                    mx = n > mx ? n : mx;
                    mass_sum += row_mass[r];
                }
                kept += head_kept;
                total += head_allowed;
                /* a sequence without queries drops nothing: 0 */
                CHECK(close_to(head_sp[h], head_allowed ? 1.0 - (double)head_kept / (double)head_allowed : 0.0, 1e-12),
                      "head %lld sparsity %.17g", (long long)h, head_sp[h]);
            }
            CHECK(stats.kept_blocks == kept && stats.total_blocks == total, "kept %lld of %lld, expected %lld of %lld",
                  (long long)stats.kept_blocks, (long long)stats.total_blocks, (long long)kept, (long long)total);
            CHECK(stats.min_row_blocks == mn && stats.max_row_blocks == mx, "rows keep %d..%d, expected %lld..%lld",
                  stats.min_row_blocks, stats.max_row_blocks, (long long)mn, (long long)mx);
            CHECK(close_to(stats.sparsity, 1.0 - (double)kept / (double)total, 1e-12), "sparsity %.17g",
                  stats.sparsity);
            CHECK(close_to(stats.token_density, pairs / all_pairs, 1e-9), "token density %.17g", stats.token_density);
            CHECK(close_to(stats.mean_row_mass, mass_sum / (double)real_rows, 1e-12),
                  "mean row mass %.9g, but the row masses average %.9g", stats.mean_row_mass,
                  mass_sum / (double)s->rows);
        }

        /* only a prediction has a pooled map */
        memset(map, 0x5a, (size_t)s->cells * sizeof(float));
        snprintf(step, sizeof step, "sparge_mask_get_pooled_map on %s", dev_names[d]);
        plant();
        st = sparge_mask_get_pooled_map(m, map);
        outcome(st, mp->map[d] ? BIT(SPARGE_OK) : BIT(SPARGE_ERR_MASK), "sparge_mask_get_pooled_map", dev_names[d]);
        if (st)
            for (int64_t i = 0; i < s->cells; i++)
                CHECK(((uint32_t *)map)[i] == POISON_I32, "refused get_pooled_map wrote the map");
        else
            CHECK(memcmp(map, mp->map[d], (size_t)s->cells * sizeof(float)) == 0,
                  "get_pooled_map differs from the map the prediction returned");
    }
    free(counts);
    free(indices);
    free(tc);
    free(ti);
    free(dense);
    free(head_sp);
    free(row_mass);
    free(map);
}

/* ------------------------------------------------------------------ selection from a pooled map */

static void op_select(input *in, mask_pair *mp)
{
    const shape *s = &mp->s;
    sparge_mask_params params = {0};
    params.topk = param_value(u8(in));
    params.topp = param_value(u8(in));
    const unsigned blocks = u8(in), view = u8(in), fill = u8(in), misuse = u8(in) % 16;
    params.scale = scale_value(blocks >> 4);
    const int bqs[4] = {0, s->bq, s->bq > 1 ? s->bq - 1 : 2, -1}, bks[4] = {0, s->bk, s->bk > 2 ? s->bk - 2 : 3, -3};
    params.block_q = bqs[blocks & 3];
    params.block_k = bks[blocks >> 2 & 3];

    /* the map's view: contiguous, padded rows, column-major, or rows/entries broadcast by zero strides */
    int64_t st[4] = {s->H * s->Nqb * s->Nkb, s->Nqb * s->Nkb, s->Nkb, 1};
    switch (view % 8) {
    case 4: st[2] = s->Nkb + 3, st[1] = s->Nqb * st[2], st[0] = s->H * st[1]; break;
    case 5: st[3] = s->Nqb, st[2] = 1; break;
    case 6: st[2] = 0; break;
    case 7: st[3] = 0; break;
    default: break;
    }
    const int64_t span = 1 + (s->B - 1) * st[0] + (s->H - 1) * st[1] + (s->Nqb - 1) * st[2] + (s->Nkb - 1) * st[3];
    float *storage = xmalloc((size_t)span * sizeof(float));
    for (int64_t i = 0; i < span; i++) {
        switch (fill % 4) {
        case 0: storage[i] = map_entry(u8(in)); break;
        case 1: storage[i] = bits_f32(u32(in)); break; /* any float */
        case 2: storage[i] = (float)u8(in) / 255.0f; break;
        default: storage[i] = (float)(u8(in) + 1); break; /* normalised per row below */
        }
    }
    if (fill % 4 == 3 && view % 8 < 5) /* probability rows: exact Top-p boundaries */
        for (int64_t r = 0; r < s->rows; r++) {
            float *row = storage + (r / (s->H * s->Nqb)) * st[0] + (r / s->Nqb % s->H) * st[1] + (r % s->Nqb) * st[2];
            float sum = 0.0f;
            for (int64_t j = 0; j < s->Nkb; j++)
                sum += row[j];
            for (int64_t j = 0; j < s->Nkb; j++)
                row[j] /= sum;
        }
    float *saved = xmalloc((size_t)span * sizeof(float));
    memcpy(saved, storage, (size_t)span * sizeof(float));
    sparge_tensor map = {storage, SPARGE_F32, {s->B, s->H, s->Nqb, s->Nkb}, {st[0], st[1], st[2], st[3]}};

    /* what the core must refuse: with several faults, any of their statuses */
    unsigned bad = 0;
    const int other_device = misuse == 7, null_params = misuse == 6, null_mask = misuse == 8;
    const double k = params.topk, p = params.topp;
    if (!null_params && (!(k >= 0.0 && k <= 1.0) || !(p >= 0.0 && p <= 1.0) || (k == 0.0 && p == 0.0) ||
                         params.block_q < 0 || params.block_k < 0))
        bad |= BIT(SPARGE_ERR_INVALID);
    switch (misuse) {
    case 1: map.dtype = SPARGE_F16, bad |= BIT(SPARGE_ERR_DTYPE); break;
    case 2: map.shape[3] = s->Nkb + 1, map.stride[3] = 0, bad |= BIT(SPARGE_ERR_MASK) | BIT(SPARGE_ERR_SHAPE); break;
    case 3: map.data = NULL, bad |= BIT(SPARGE_ERR_NULL); break;
    case 4: map.stride[2] = -1, bad |= BIT(SPARGE_ERR_INVALID); break;
    case 5: map.shape[0] = 0, bad |= BIT(SPARGE_ERR_INVALID); break;
    case 6: bad |= BIT(SPARGE_ERR_NULL); break;
    case 7: bad |= BIT(SPARGE_ERR_MASK); break;
    case 8: bad |= BIT(SPARGE_ERR_NULL); break;
    default: break;
    }
    /* Blocks other than the mask's are refused, as in the prediction; a selection does not use the scale of its
     * params, so refusing a non-finite one is allowed, not required. */
    if (!null_params &&
        ((params.block_q > 0 && params.block_q != s->bq) || (params.block_k > 0 && params.block_k != s->bk)))
        bad |= BIT(SPARGE_ERR_MASK);
    const unsigned maybe = isfinite(params.scale) || null_params ? 0 : BIT(SPARGE_ERR_INVALID);
    const unsigned allowed = (bad ? bad : BIT(SPARGE_OK)) | maybe;

    sparge_status got[NDEV];
    for (int d = 0; d < NDEV; d++) {
        snprintf(step, sizeof step, "sparge_mask_select on %s (k %g, p %g, view %u, fill %u, misuse %u)",
                 dev_names[d], k, p, view % 8, fill % 4, misuse);
        sparge_mask *m = null_mask ? NULL : mp->m[other_device ? 1 - d : d];
        plant();
        got[d] = sparge_mask_select(dev[d], &map, null_params ? NULL : &params, m);
        outcome(got[d], allowed, "sparge_mask_select", dev_names[d]);
        CHECK(memcmp(saved, storage, (size_t)span * sizeof(float)) == 0, "the selection wrote into its map");
    }
    CHECK(got[FAST] == got[REF], "cpu returned %s, cpu-ref %s", sparge_status_name(got[FAST]),
          sparge_status_name(got[REF]));
    if (got[FAST] == SPARGE_OK) {
        float *row = xmalloc((size_t)s->Nkb * sizeof(float));
        int64_t *order = xmalloc((size_t)s->Nkb * sizeof(int64_t));
        for (int64_t r = 0; r < s->rows; r++) {
            const int64_t b = r / (s->H * s->Nqb), h = r / s->Nqb % s->H, i = r % s->Nqb;
            for (int64_t j = 0; j < s->Nkb; j++)
                row[j] = storage[b * st[0] + h * st[1] + i * st[2] + j * st[3]];
            oracle_select(s, b, i, row, k, p, mp->dense + r * s->Nkb, &mp->mass[REF][r], &mp->mass_abs[REF][r],
                          order);
        }
        selection_made(mp);
        free(row);
        free(order);
    }
    inspect(mp, view >> 7); /* the selection, or the mask as it was before a refusal */
    free(storage);
    free(saved);
}

/* ------------------------------------------------------------------ import of a dense mask */

static void op_set_dense(input *in, mask_pair *mp)
{
    const shape *s = &mp->s;
    const unsigned fill = u8(in), misuse = u8(in) % 16;
    uint8_t *host = xmalloc((size_t)s->cells), *saved = xmalloc((size_t)s->cells);
    unsigned bits = 0;
    for (int64_t i = 0; i < s->cells; i++) {
        if (fill % 2 == 0) {
            host[i] = (uint8_t)u8(in); /* any byte, nonzero = keep */
        } else {
            bits = i % 8 ? bits >> 1 : u8(in); /* one bit per block */
            host[i] = bits & 1;
        }
    }
    if ((s->causal || s->varlen) && fill & 0x40) /* mostly following the rule: every diagonal block kept */
        for (int64_t r = 0; r < s->rows; r++) {
            int64_t allowed, diag0;
            row_rule(s, r / (s->H * s->Nqb), r % s->Nqb, &allowed, &diag0);
            for (int64_t j = diag0; j < allowed; j++)
                host[r * s->Nkb + j] = 1;
            if (fill & 0x20)
                memset(host + r * s->Nkb + allowed, 0, (size_t)(s->Nkb - allowed));
        }
    memcpy(saved, host, (size_t)s->cells);
    int bad_row = 0; /* empty (but past its sequence), a block past the allowed ones, or a diagonal block dropped */
    for (int64_t r = 0; r < s->rows; r++) {
        int64_t allowed, diag0, any = 0;
        row_rule(s, r / (s->H * s->Nqb), r % s->Nqb, &allowed, &diag0);
        for (int64_t j = 0; j < s->Nkb; j++) {
            const int keep = host[r * s->Nkb + j] != 0;
            any |= keep;
            bad_row |= (keep && j >= allowed) || (!keep && j >= diag0 && j < allowed);
        }
        bad_row |= !any && allowed;
    }
    const unsigned allowed = misuse == 1 || misuse == 2 ? BIT(SPARGE_ERR_NULL)
                             : bad_row                  ? BIT(SPARGE_ERR_INVALID)
                                                        : BIT(SPARGE_OK);
    sparge_status got[NDEV];
    for (int d = 0; d < NDEV; d++) {
        snprintf(step, sizeof step, "sparge_mask_set_dense on %s (fill %u, misuse %u)", dev_names[d], fill % 2,
                 misuse);
        plant();
        got[d] = sparge_mask_set_dense(misuse == 1 ? NULL : mp->m[d], misuse == 2 ? NULL : host);
        outcome(got[d], allowed, "sparge_mask_set_dense", dev_names[d]);
        CHECK(memcmp(saved, host, (size_t)s->cells) == 0, "set_dense wrote into its input");
    }
    CHECK(got[FAST] == got[REF], "cpu returned %s, cpu-ref %s", sparge_status_name(got[FAST]),
          sparge_status_name(got[REF]));
    if (got[FAST] == SPARGE_OK) {
        for (int64_t i = 0; i < s->cells; i++)
            mp->dense[i] = host[i] != 0;
        for (int64_t r = 0; r < s->rows; r++)
            mp->mass[REF][r] = NAN, mp->mass_abs[REF][r] = 0.0;
        selection_made(mp);
    }
    inspect(mp, fill >> 7);
    free(host);
    free(saved);
}

/* ------------------------------------------------------------------ misuse of the mask getters */

static void op_misuse(input *in, mask_pair *mp)
{
    const unsigned which = u8(in) % 6;
    for (int d = 0; d < NDEV; d++) {
        sparge_mask *m = mp->m[d];
        sparge_status st = SPARGE_OK;
        sparge_mask_shape sh;
        const char *fn = "";
        snprintf(step, sizeof step, "misuse %u on %s", which, dev_names[d]);
        plant();
        switch (which) {
        case 0: st = sparge_mask_get_dense(m, NULL), fn = "sparge_mask_get_dense"; break;
        case 1: st = sparge_mask_get_stats(m, NULL, NULL, NULL), fn = "sparge_mask_get_stats"; break;
        case 2: st = sparge_mask_get_csr(NULL, NULL, NULL, NULL, NULL), fn = "sparge_mask_get_csr"; break;
        case 3: st = sparge_mask_get_shape(m, NULL), fn = "sparge_mask_get_shape"; break;
        case 4: st = sparge_mask_get_pooled_map(NULL, NULL), fn = "sparge_mask_get_pooled_map"; break;
        default: {
            memset(&sh, 0, sizeof sh);
            st = sparge_mask_get_shape(m, &sh);
            outcome(st, BIT(SPARGE_OK), "sparge_mask_get_shape", dev_names[d]);
            const shape *s = &mp->s;
            CHECK(sh.B == s->B && sh.H == s->H && sh.Nq == s->maxq && sh.Nk == s->maxk && sh.block_q == s->bq &&
                      sh.block_k == s->bk && sh.Nqb == s->Nqb && sh.Nkb == s->Nkb && sh.causal == s->causal &&
                      sh.varlen == s->varlen,
                  "get_shape disagrees with the mask's creation");
            continue;
        }
        }
        /* get_dense/get_stats on an empty mask may name either problem */
        unsigned allowed = BIT(SPARGE_ERR_NULL) | (which < 2 && !mp->filled ? BIT(SPARGE_ERR_MASK) : 0);
        outcome(st, allowed, fn, dev_names[d]);
    }
    inspect(mp, 0); /* nothing changed */
}

/* ------------------------------------------------------------------ attention */

/* A contiguous [B,H,N,D] tensor (BHND or BNHD) with its storage and the logical fp64 values it holds. */
typedef struct {
    sparge_tensor t;
    size_t bytes;
    int64_t n;
} tens;

static tens tens_make(sparge_dtype dt, int bnhd, int64_t B, int64_t H, int64_t N, int64_t D)
{
    tens x = {bnhd ? sparge_tensor_bnhd(NULL, dt, B, H, N, D) : sparge_tensor_bhnd(NULL, dt, B, H, N, D), 0,
              B * H * N * D};
    x.bytes = (size_t)x.n * sparge_dtype_size(dt);
    x.t.data = xmalloc(x.bytes);
    return x;
}

static int64_t tens_off(const tens *x, int64_t i) /* logical index [B,H,N,D] to storage */
{
    const int64_t *sh = x->t.shape, *st = x->t.stride;
    const int64_t d = i % sh[3], n = i / sh[3] % sh[2], h = i / (sh[3] * sh[2]) % sh[1], b = i / (sh[3] * sh[2] * sh[1]);
    return b * st[0] + h * st[1] + n * st[2] + d * st[3];
}

static void tens_set(tens *x, int64_t i, float v)
{
    const int64_t o = tens_off(x, i);
    switch (x->t.dtype) {
    case SPARGE_F16: ((uint16_t *)x->t.data)[o] = sparge_f32_to_f16(v); break;
    case SPARGE_BF16: ((uint16_t *)x->t.data)[o] = sparge_f32_to_bf16(v); break;
    default: ((float *)x->t.data)[o] = v; break;
    }
}

static double tens_get(const tens *x, int64_t i)
{
    const int64_t o = tens_off(x, i);
    switch (x->t.dtype) {
    case SPARGE_F16: return sparge_f16_to_f32(((const uint16_t *)x->t.data)[o]);
    case SPARGE_BF16: return sparge_bf16_to_f32(((const uint16_t *)x->t.data)[o]);
    default: return ((const float *)x->t.data)[o];
    }
}

static double *tens_values(const tens *x)
{
    double *v = xmalloc((size_t)x->n * sizeof(double));
    for (int64_t i = 0; i < x->n; i++)
        v[i] = tens_get(x, i);
    return v;
}

/* 0xFF bytes: NaN in every dtype, with a payload no computation produces from these inputs. */
static void poison(void *p, size_t bytes) { memset(p, 0xff, bytes); }

static int64_t count_poisoned(const void *p, size_t bytes, size_t elem)
{
    int64_t n = 0;
    const unsigned char *b = p;
    for (size_t i = 0; i < bytes; i += elem) {
        size_t k = 0;
        while (k < elem && b[i + k] == 0xff)
            k++;
        n += k == elem;
    }
    return n;
}

static double rms(const double *x, int64_t n)
{
    double s = 0.0;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(x[i]))
            s += x[i] * x[i], m++;
    return m ? sqrt(s / (double)m) : 0.0;
}

/* got against ref: the same NaN and infinite entries (got may also be NaN where may_nan is set); over the others
 * the relative L2 error within tol, measured against max(‖ref‖, 0.1·√n·scale) so that a tensor that cancels to
 * nearly nothing is judged against the size of its terms (scale: their typical magnitude). */
static void compare(const char *what, const double *got, const double *ref, int64_t n, double tol, double scale,
                    const uint8_t *may_nan)
{
    double num = 0.0, den = 0.0;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (may_nan && may_nan[i] && isnan(got[i]))
            continue;
        CHECK(isnan(got[i]) == isnan(ref[i]), "%s[%lld]: %.9g against %.9g (NaN where the other has none)", what,
              (long long)i, got[i], ref[i]);
        if (isnan(ref[i]))
            continue;
        CHECK(isinf(got[i]) == isinf(ref[i]), "%s[%lld]: %.9g against %.9g", what, (long long)i, got[i],
              ref[i]);
        if (isinf(ref[i]) || isinf(got[i]))
            continue;
        num += (got[i] - ref[i]) * (got[i] - ref[i]);
        den += ref[i] * ref[i];
        m++;
    }
    if (m == 0)
        return;
    const double err = sqrt(num) / fmax(sqrt(den), 0.1 * sqrt((double)m) * scale);
    CHECK(err <= tol, "%s: relative L2 error %.3g exceeds %.3g (n %lld)", what, err, tol, (long long)n);
}

/* Whether query t (a token of tensor batch tb) of head h attends key u. Dense (keep NULL): every key, causally
 * over the whole tensors (causal). Masked: a key of t's sequence whose block t's row keeps and, on a causal mask,
 * on or before t's diagonal. *excluded: u is left out by the causal rule alone, though t computes its block. */
static int visible(const shape *s, const uint8_t *keep, int causal, int64_t H, int64_t Nq, int64_t Nk, int64_t tb,
                   int64_t h, int64_t t, int64_t u, int *excluded)
{
    *excluded = 0;
    if (!keep) {
        *excluded = causal && u > t + Nk - Nq;
        return !*excluded;
    }
    int64_t b = tb, q0 = 0, nq = Nq, k0 = 0, nk = Nk;
    if (s->varlen) {
        for (b = 0; t >= s->cu_q[b + 1]; b++)
            ;
        q0 = s->cu_q[b], nq = s->cu_q[b + 1] - q0, k0 = s->cu_k[b], nk = s->cu_k[b + 1] - k0;
        if (u < k0 || u >= k0 + nk)
            return 0;
    }
    if (!keep[((b * H + h) * s->Nqb + (t - q0) / s->bq) * s->Nkb + (u - k0) / s->bk])
        return 0;
    *excluded = s->causal && u - k0 > t - q0 + nk - nq;
    return !*excluded;
}

/* fp64 forward of §1.9 (and §1.12) over logical values [B,H,Nq,D], K and V [B,Hkv,Nk,D]. may_nan (optional):
 * set where a NaN of V at a key the causal rule alone excludes meets the output (DESIGN §1.12). */
static void oracle_forward(const double *q, const double *k, const double *v, int64_t B, int64_t H, int64_t Hkv,
                           int64_t Nq, int64_t Nk, int64_t D, double scale, const shape *s, const uint8_t *keep,
                           int causal, double *o, double *lse, uint8_t *may_nan)
{
    double *sc = xmalloc((size_t)Nk * sizeof(double));
    uint8_t *vis = xmalloc((size_t)Nk);
    for (int64_t bh = 0; bh < B * H; bh++)
        for (int64_t t = 0; t < Nq; t++) {
            const double *qt = q + (bh * Nq + t) * D;
            const int64_t kvh = bh / H * Hkv + bh % H / (H / Hkv); /* the query head's K/V head */
            double m = -INFINITY, sum = 0.0;
            for (int64_t u = 0; u < Nk; u++) {
                int excluded;
                sc[u] = NAN;
                vis[u] = (uint8_t)visible(s, keep, causal, H, Nq, Nk, bh / H, bh % H, t, u, &excluded);
                for (int64_t d = 0; may_nan && excluded && d < D; d++)
                    if (isnan(v[(kvh * Nk + u) * D + d]))
                        may_nan[(bh * Nq + t) * D + d] = 1;
                if (!vis[u])
                    continue;
                double dot = 0.0;
                for (int64_t d = 0; d < D; d++)
                    dot += qt[d] * k[(kvh * Nk + u) * D + d];
                sc[u] = scale * dot;
                m = sc[u] > m ? sc[u] : m;
            }
            double *ot = o + (bh * Nq + t) * D;
            for (int64_t d = 0; d < D; d++)
                ot[d] = 0.0;
            for (int64_t u = 0; u < Nk; u++) {
                if (!vis[u])
                    continue;
                const double e = exp(sc[u] - m);
                sum += e;
                for (int64_t d = 0; d < D; d++)
                    ot[d] += e * v[(kvh * Nk + u) * D + d];
            }
            for (int64_t d = 0; d < D; d++)
                ot[d] /= sum;
            lse[bh * Nq + t] = m + log(sum);
        }
    free(sc);
    free(vis);
}

/* Non-finite values injected into q, k, v, dO: 0 none, 1 only NaN, 2 also ±Inf and huge finite values. With
 * NaN only, the fp64 oracle gives the NaN entries of §1.9 (a NaN in q_t: row t; in a kept k_u: every row that
 * keeps u's block; in v_u[d]: column d of those rows) and nothing else may be NaN. Infinities and huge values
 * make f32 and fp64 underflow differently (0·Inf against tiny·Inf), so they are checked for statuses only. */
static int inject(input *in, tens *x[4])
{
    int kind = 0;
    const unsigned count = u8(in) % 5;
    for (unsigned c = 0; c < count; c++) {
        const unsigned which = u8(in) % 4, v = u8(in) % 4;
        const uint32_t at = u32(in);
        static const float vals[4] = {NAN, INFINITY, -INFINITY, 1e4f};
        tens_set(x[which], (int64_t)(at % (uint32_t)x[which]->n), vals[v]);
        kind = v == 0 && kind < 2 ? 1 : 2;
    }
    return kind;
}

enum { MAX_ATTN_TOKENS = 64 };

static void op_attention(input *in, mask_pair *mp)
{
    const shape *s = &mp->s;
    static const int64_t d_codes[16] = {1, 2, 3, 4, 5, 7, 8, 16, 4, 8, 6, 2, 8, 257, 0, 3};
    const unsigned c_d = u8(in), flags = u8(in), c_scale = u8(in), fwd_misuse = u8(in) % 16,
                   bwd_misuse = u8(in) % 16;
    if (s->Nq > MAX_ATTN_TOKENS || s->Nk > MAX_ATTN_TOKENS)
        return;
    const int64_t B = s->varlen ? 1 : s->B, H = s->H, Nq = s->Nq, Nk = s->Nk, D = d_codes[c_d % 16]; /* varlen: packed */
    const sparge_dtype dt = (sparge_dtype)((flags & 3) % 3);
    const int bnhd = flags >> 2 & 1, det = flags >> 3 & 1, masked = (flags >> 4 & 3) != 0,
              null_params = (flags >> 4 & 3) == 3, other_mask = flags >> 6 & 1;
    sparge_attn_params ap = {scale_value(c_scale), det, (int)(flags >> 7)}; /* causal: a dense call's, or the mask's */
    const int causal = masked ? s->causal : ap.causal && !null_params;
    const int64_t Dt = D > 0 ? D : 1; /* storage for the refused D = 0 */
    const int64_t Hkv = (c_d >> 4 & 1) ? 1 : H; /* grouped K/V heads: one for all */
    tens q = tens_make(dt, bnhd, B, H, Nq, Dt), k = tens_make(dt, bnhd, B, Hkv, Nk, Dt),
         v = tens_make(dt, bnhd, B, Hkv, Nk, Dt), dout = tens_make(dt, bnhd, B, H, Nq, Dt);
    tens *inputs[4] = {&q, &k, &v, &dout};
    uint64_t seed = u32(in);
    for (int t = 0; t < 4; t++)
        for (int64_t i = 0; i < inputs[t]->n; i++) { /* splitmix64 normals */
            uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            z ^= z >> 31;
            const double u1 = ((double)(z >> 11) + 0.5) * 0x1.0p-53, u2 = (double)(z & 0x7ff) / 2048.0;
            tens_set(inputs[t], i, (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2)));
        }
    const int special = inject(in, inputs);
    q.t.shape[3] = k.t.shape[3] = v.t.shape[3] = dout.t.shape[3] = D;
    tens o[NDEV], dq[NDEV], dk[NDEV], dv[NDEV];
    float *lse[NDEV];
    for (int d = 0; d < NDEV; d++) {
        o[d] = tens_make(dt, bnhd, B, H, Nq, Dt);
        o[d].t.shape[3] = D;
        lse[d] = xmalloc((size_t)(B * H * Nq) * sizeof(float));
    }
    void *saved[4];
    for (int i = 0; i < 4; i++) {
        saved[i] = xmalloc(inputs[i]->bytes);
        memcpy(saved[i], inputs[i]->t.data, inputs[i]->bytes);
    }

    /* the forward */
    const sparge_tensor *qp = &q.t, *kp = &k.t, *vp = &v.t;
    sparge_tensor qx = q.t, kx = k.t, vx = v.t;
    unsigned bad = 0;
    if (!isfinite(ap.scale) && !null_params)
        bad |= BIT(SPARGE_ERR_INVALID);
    if (D <= 0)
        bad |= BIT(SPARGE_ERR_INVALID);
    if (masked && !mp->filled)
        bad |= BIT(SPARGE_ERR_MASK);
    if (masked && other_mask)
        bad |= BIT(SPARGE_ERR_MASK);
    if (ap.causal && !null_params && masked && !s->causal)
        bad |= BIT(SPARGE_ERR_MASK);
    if (ap.causal && !null_params && !masked && Nq > Nk)
        bad |= BIT(SPARGE_ERR_SHAPE);
    int lse_null = 0, overlap_o = 0;
    switch (fwd_misuse) {
    case 1: kx.shape[3] = D + 1, kp = &kx, bad |= BIT(SPARGE_ERR_SHAPE); break;
    case 2: vx.dtype = (sparge_dtype)((dt + 1) % 3), vp = &vx, bad |= BIT(SPARGE_ERR_DTYPE); break;
    case 3: qx.data = NULL, qp = &qx, bad |= BIT(SPARGE_ERR_NULL); break;
    case 4: vx.stride[1] = -1, vp = &vx, bad |= BIT(SPARGE_ERR_INVALID); break;
    case 5: qx.shape[0] = 0, qp = &qx, bad |= BIT(SPARGE_ERR_INVALID); break;
    case 6:
        if (D > 1 || Nq > 1)
            overlap_o = 1, bad |= BIT(SPARGE_ERR_INVALID);
        break;
    case 7: lse_null = 1; break; /* valid: the LSE is optional */
    case 8: vx.shape[2] = Nk + 1, vp = &vx, bad |= BIT(SPARGE_ERR_SHAPE); break;
    default: break;
    }
    if (D > 256 && !bad)
        bad = BIT(SPARGE_ERR_UNSUPPORTED);
    const unsigned allowed = bad ? bad : BIT(SPARGE_OK);
    sparge_status got[NDEV];
    for (int d = 0; d < NDEV; d++) {
        snprintf(step, sizeof step,
                 "sparge_attention_forward on %s (%s %s D %lld Hkv %lld scale %g det %d masked %d other %d causal %d "
                 "misuse %u)", dev_names[d], sparge_dtype_name(dt), bnhd ? "bnhd" : "bhnd", (long long)D,
                 (long long)Hkv, (double)ap.scale, det, masked, other_mask, ap.causal, fwd_misuse);
        sparge_tensor ot = o[d].t;
        if (overlap_o)
            ot.stride[D > 1 ? 3 : 2] = 0;
        poison(o[d].t.data, o[d].bytes);
        poison(lse[d], (size_t)(B * H * Nq) * sizeof(float));
        plant();
        got[d] = sparge_attention_forward(dev[d], qp, kp, vp, masked ? mp->m[other_mask ? 1 - d : d] : NULL,
                                          null_params ? NULL : &ap, &ot, lse_null ? NULL : lse[d]);
        outcome(got[d], allowed, "sparge_attention_forward", dev_names[d]);
        for (int i = 0; i < 4; i++)
            CHECK(memcmp(saved[i], inputs[i]->t.data, inputs[i]->bytes) == 0, "the forward wrote into input %d", i);
        const int64_t left = count_poisoned(o[d].t.data, o[d].bytes, sparge_dtype_size(dt)),
                      left_lse = count_poisoned(lse[d], (size_t)(B * H * Nq) * sizeof(float), sizeof(float));
        if (got[d])
            CHECK(left == q.n && left_lse == B * H * Nq, "a refused forward wrote %lld of O, %lld of LSE",
                  (long long)(q.n - left), (long long)(B * H * Nq - left_lse));
        else
            CHECK(left == 0 && (lse_null ? left_lse == B * H * Nq : left_lse == 0),
                  "the forward left %lld of O and %lld of LSE unwritten", (long long)left, (long long)left_lse);
    }
    CHECK(got[FAST] == got[REF], "cpu returned %s, cpu-ref %s", sparge_status_name(got[FAST]),
          sparge_status_name(got[REF]));

    if (got[FAST] == SPARGE_OK) {
        const double scale = ap.scale != 0.0f && !null_params ? ap.scale : 1.0f / sqrtf((float)D);
        const double tol = sparge_dtype_tolerance(dt);
        /* scales that neither overflow f32 scores nor push them into subnormals */
        const int moderate = fabs(scale) <= 4.0 && fabs(scale) >= 1e-3;
        double *qv = tens_values(&q), *kv = tens_values(&k), *vv = tens_values(&v), *dov = tens_values(&dout);
        double *oc = tens_values(&o[FAST]), *orf = tens_values(&o[REF]);
        double *lc = xmalloc((size_t)(B * H * Nq) * sizeof(double)), *lr = xmalloc((size_t)(B * H * Nq) * sizeof(double));
        for (int64_t i = 0; i < B * H * Nq; i++)
            lc[i] = lse[FAST][i], lr[i] = lse[REF][i];
        const uint8_t *keep = masked ? mp->dense : NULL;
        snprintf(step, sizeof step, "forward comparison (%s D %lld scale %g masked %d causal %d special %d)",
                 sparge_dtype_name(dt), (long long)D, scale, masked, causal, special);
        if (moderate && special < 2) {
            double *oo = xmalloc((size_t)q.n * sizeof(double)), *lo = xmalloc((size_t)(B * H * Nq) * sizeof(double));
            /* A NaN in V at a key the causal rule alone excludes may reach O on the tiled tier (P = 0 times NaN),
             * never on cpu-ref (DESIGN §1.12). */
            uint8_t *may_nan = NULL;
            if (causal && special == 1) {
                may_nan = xmalloc((size_t)q.n);
                memset(may_nan, 0, (size_t)q.n);
            }
            oracle_forward(qv, kv, vv, B, H, Hkv, Nq, Nk, D, scale, s, keep, causal, oo, lo, may_nan);
            const double score = fmax(1.0, fabs(scale) * rms(qv, q.n) * rms(kv, k.n) * sqrt((double)D));
            compare("cpu-ref O against the fp64 oracle", orf, oo, q.n, tol, rms(vv, v.n), NULL);
            compare("cpu O against cpu-ref", oc, orf, q.n, tol, rms(vv, v.n), may_nan);
            free(may_nan);
            if (!lse_null) {
                compare("cpu-ref LSE against the fp64 oracle", lr, lo, B * H * Nq, 1e-5, score, NULL);
                compare("cpu LSE against cpu-ref", lc, lr, B * H * Nq, 1e-5, score, NULL);
            }
            free(oo);
            free(lo);
        }

        /* the backward, from cpu-ref's O and LSE on both devices (no compounding) */
        if (!lse_null) {
            const float *lse_in = lse[REF];
            float *lse_saved = xmalloc((size_t)(B * H * Nq) * sizeof(float));
            memcpy(lse_saved, lse_in, (size_t)(B * H * Nq) * sizeof(float));
            void *o_saved = xmalloc(o[REF].bytes);
            memcpy(o_saved, o[REF].t.data, o[REF].bytes);
            unsigned bbad = 0;
            int overlap = 0, no_lse = 0;
            sparge_tensor dox = dout.t;
            const sparge_tensor *dop = &dout.t;
            switch (bwd_misuse) {
            case 1: no_lse = 1, bbad |= BIT(SPARGE_ERR_NULL); break;
            case 2:
                if (Nk > 1 || D > 1)
                    overlap = 1, bbad |= BIT(SPARGE_ERR_INVALID);
                break;
            case 3: dox.dtype = (sparge_dtype)((dt + 2) % 3), dop = &dox, bbad |= BIT(SPARGE_ERR_DTYPE); break;
            case 4: dox.shape[2] = Nq + 1, dop = &dox, bbad |= BIT(SPARGE_ERR_SHAPE); break;
            default: break;
            }
            const unsigned ballowed = bbad ? bbad : BIT(SPARGE_OK);
            for (int d = 0; d < NDEV; d++) {
                dq[d] = tens_make(dt, bnhd, B, H, Nq, D);
                dk[d] = tens_make(dt, bnhd, B, Hkv, Nk, D);
                dv[d] = tens_make(dt, bnhd, B, Hkv, Nk, D);
            }
            for (int d = 0; d < NDEV; d++) {
                snprintf(step, sizeof step, "sparge_attention_backward on %s (%s D %lld scale %g det %d misuse %u)",
                         dev_names[d], sparge_dtype_name(dt), (long long)D, (double)ap.scale, det, bwd_misuse);
                sparge_tensor dkt = dk[d].t;
                if (overlap)
                    dkt.stride[Nk > 1 ? 2 : 3] = 0;
                poison(dq[d].t.data, dq[d].bytes);
                poison(dk[d].t.data, dk[d].bytes);
                poison(dv[d].t.data, dv[d].bytes);
                plant();
                got[d] = sparge_attention_backward(dev[d], &q.t, &k.t, &v.t, &o[REF].t, dop, no_lse ? NULL : lse_in,
                                                   masked ? mp->m[d] : NULL, null_params ? NULL : &ap, &dq[d].t, &dkt,
                                                   &dv[d].t);
                outcome(got[d], ballowed, "sparge_attention_backward", dev_names[d]);
                for (int i = 0; i < 4; i++)
                    CHECK(memcmp(saved[i], inputs[i]->t.data, inputs[i]->bytes) == 0, "the backward wrote into input %d",
                          i);
                CHECK(memcmp(o_saved, o[REF].t.data, o[REF].bytes) == 0 &&
                          memcmp(lse_saved, lse_in, (size_t)(B * H * Nq) * sizeof(float)) == 0,
                      "the backward wrote into O or LSE");
                const size_t es = sparge_dtype_size(dt);
                const int64_t left = count_poisoned(dq[d].t.data, dq[d].bytes, es) +
                                     count_poisoned(dk[d].t.data, dk[d].bytes, es) +
                                     count_poisoned(dv[d].t.data, dv[d].bytes, es);
                CHECK(got[d] ? left == q.n + 2 * k.n : left == 0, "%s backward: %lld gradient entries still poisoned",
                      got[d] ? "a refused" : "the", (long long)left);
            }
            CHECK(got[FAST] == got[REF], "cpu returned %s, cpu-ref %s", sparge_status_name(got[FAST]),
                  sparge_status_name(got[REF]));
            if (got[FAST] == SPARGE_OK && moderate && special == 0) {
                snprintf(step, sizeof step, "backward comparison (%s D %lld scale %g masked %d)", sparge_dtype_name(dt),
                         (long long)D, scale, masked);
                const double g = rms(dov, dout.n) * rms(vv, v.n) * fabs(scale) * sqrt((double)D);
                const char *names[3] = {"dQ", "dK", "dV"};
                tens *fast[3] = {&dq[FAST], &dk[FAST], &dv[FAST]}, *ref[3] = {&dq[REF], &dk[REF], &dv[REF]};
                const double scales[3] = {g * rms(kv, k.n), g * rms(qv, q.n), rms(dov, dout.n)};
                for (int i = 0; i < 3; i++) {
                    double *a = tens_values(fast[i]), *b = tens_values(ref[i]);
                    char what[48];
                    snprintf(what, sizeof what, "cpu %s against cpu-ref", names[i]);
                    compare(what, a, b, fast[i]->n, tol, scales[i], NULL);
                    free(a);
                    free(b);
                }
            }
            if (got[FAST] == SPARGE_OK && det && !null_params) { /* bitwise reproducible */
                snprintf(step, sizeof step, "deterministic backward run twice on cpu");
                tens again[3] = {tens_make(dt, bnhd, B, H, Nq, D), tens_make(dt, bnhd, B, Hkv, Nk, D),
                                 tens_make(dt, bnhd, B, Hkv, Nk, D)};
                sparge_status st = sparge_attention_backward(dev[FAST], &q.t, &k.t, &v.t, &o[REF].t, &dout.t, lse_in,
                                                             masked ? mp->m[FAST] : NULL, &ap, &again[0].t,
                                                             &again[1].t, &again[2].t);
                CHECK(st == SPARGE_OK, "second deterministic backward: %s", sparge_last_error());
                CHECK(memcmp(again[0].t.data, dq[FAST].t.data, dq[FAST].bytes) == 0 &&
                          memcmp(again[1].t.data, dk[FAST].t.data, dk[FAST].bytes) == 0 &&
                          memcmp(again[2].t.data, dv[FAST].t.data, dv[FAST].bytes) == 0,
                      "a deterministic backward gave different bits on a second run");
                for (int i = 0; i < 3; i++)
                    free(again[i].t.data);
            }
            for (int d = 0; d < NDEV; d++) {
                free(dq[d].t.data);
                free(dk[d].t.data);
                free(dv[d].t.data);
            }
            free(lse_saved);
            free(o_saved);
        }
        free(qv);
        free(kv);
        free(vv);
        free(dov);
        free(oc);
        free(orf);
        free(lc);
        free(lr);
    }
    for (int i = 0; i < 4; i++) {
        free(saved[i]);
        free(inputs[i]->t.data);
    }
    for (int d = 0; d < NDEV; d++) {
        free(o[d].t.data);
        free(lse[d]);
    }
}

/* ------------------------------------------------------------------ prediction from Q and K */

/* The pooled map of §1.3–1.4 in fp64 over the logical values (Hkv K heads, each shared by H / Hkv query heads);
 * the block means are rounded to f32 as the specification stores them. err[r]: the scale of row r's rounding
 * on a device, |s|·max_j Σ_d |Q̄_d·K̄_jd|. */
static void oracle_map(const double *q, const double *k, int64_t Hkv, int64_t D, float scale, const shape *s,
                       double *map, double *err)
{
    const int64_t H = s->H, group = H / Hkv;
    double *qm = xmalloc((size_t)D * sizeof(double)), *km = xmalloc((size_t)(s->Nkb * D) * sizeof(double));
    double *z = xmalloc((size_t)s->Nkb * sizeof(double));
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t h = 0; h < H; h++) {
            int64_t tb, q0, nq, k0, nk;
            seq_of(s, b, &tb, &q0, &nq, &k0, &nk);
            const double *kh = k + ((tb * Hkv + h / group) * s->Nk + k0) * D;
            for (int64_t j = 0; j * s->bk < nk; j++) {
                const int64_t n = block_len(j, s->bk, nk);
                for (int64_t d = 0; d < D; d++) {
                    double sum = 0.0;
                    for (int64_t u = j * s->bk; u < j * s->bk + n; u++)
                        sum += kh[u * D + d];
                    km[j * D + d] = (float)(sum / (double)n);
                }
            }
            for (int64_t i = 0; i < s->Nqb; i++) {
                const int64_t r = (b * H + h) * s->Nqb + i;
                int64_t allowed, diag0;
                row_rule(s, b, i, &allowed, &diag0);
                err[r] = 0.0;
                if (!allowed) { /* a row past its sequence: all 0 */
                    for (int64_t j = 0; j < s->Nkb; j++)
                        map[r * s->Nkb + j] = 0.0;
                    continue;
                }
                const int64_t n = block_len(i, s->bq, nq);
                const double *qh = q + ((tb * H + h) * s->Nq + q0) * D;
                for (int64_t d = 0; d < D; d++) {
                    double sum = 0.0;
                    for (int64_t t = i * s->bq; t < i * s->bq + n; t++)
                        sum += qh[t * D + d];
                    qm[d] = (float)(sum / (double)n);
                }
                double m = -INFINITY, mag = 0.0;
                int nan = 0;
                for (int64_t j = 0; j < allowed; j++) {
                    double dot = 0.0, a = 0.0;
                    for (int64_t d = 0; d < D; d++) {
                        dot += qm[d] * km[j * D + d];
                        a += fabs(qm[d] * km[j * D + d]);
                    }
                    z[j] = (double)scale * dot;
                    nan |= isnan(z[j]);
                    m = z[j] > m ? z[j] : m;
                    mag = fmax(mag, fabs((double)scale) * a);
                }
                err[r] = mag;
                double *row = map + r * s->Nkb, sum = 0.0;
                for (int64_t j = 0; j < allowed; j++) {
                    row[j] = nan || isinf(m) ? NAN : exp(z[j] - m);
                    sum += row[j];
                }
                for (int64_t j = 0; j < allowed; j++)
                    row[j] /= sum;
                for (int64_t j = allowed; j < s->Nkb; j++) /* past the row's allowed blocks */
                    row[j] = 0.0;
            }
        }
    free(qm);
    free(km);
    free(z);
}

/* A row where two devices may select differently (DESIGN §2.2): within rounding of the cut on `ref`'s row. */
static int close_call(const float *row, int64_t n, int64_t kept, double p, int64_t *order)
{
    for (int64_t j = 0; j < n; j++) {
        int64_t rank = 0;
        for (int64_t i = 0; i < n; i++)
            rank += row[i] > row[j] || (row[i] == row[j] && i < j);
        order[rank] = j;
    }
    if (kept < n) {
        const double x = row[order[kept - 1]], y = row[order[kept]];
        if (fabs(x - y) <= 1e-5 * fmax(fabs(x), fabs(y)))
            return 1;
    }
    double c = 0.0;
    for (int64_t t = 0; p > 0.0 && t < n; t++)
        if (fabs((c += row[order[t]]) - p) <= 1e-5 * p)
            return 1;
    return 0;
}

enum { MAX_PREDICT_TOKENS = 64 };

/* sparge_mask_predict on both devices from the same Q and K (any D from 1 to 16, f32/f16/bf16, BHND/BNHD, K
 * with H or 1 heads, normal, tied, flat or peaked values, NaN/Inf injected), with misuse. An accepted
 * prediction: each device's mask is the selection rule applied to the pooled map it returns (exactly), that map
 * is the fp64 map of §1.3–1.4 within rounding (NaN rows exactly), and the two devices' masks agree but for rows
 * within rounding of their cut; a refusal leaves the mask as it was. */
static void op_predict(input *in, mask_pair *mp)
{
    const shape *s = &mp->s;
    static const int64_t d_codes[8] = {1, 2, 3, 4, 5, 7, 8, 16};
    const unsigned c_d = u8(in), flags = u8(in), blocks = u8(in), fill = u8(in) % 4, misuse = u8(in) % 32;
    if (s->Nq > MAX_PREDICT_TOKENS || s->Nk > MAX_PREDICT_TOKENS)
        return;
    sparge_mask_params params = {0};
    params.topk = param_value(u8(in));
    params.topp = param_value(u8(in));
    params.scale = (blocks >> 4) < 12 ? scale_value(blocks >> 4) : 0.0f; /* 0: the default 1/√D */
    /* blocks 0 (the mask's) or the mask's own, now and then another size or a negative one */
    const int bqs[8] = {0, s->bq, 0, s->bq, 0, s->bq, s->bq > 1 ? s->bq - 1 : 2, -1};
    const int bks[8] = {0, s->bk, 0, s->bk, 0, s->bk, s->bk > 2 ? s->bk - 2 : 3, -3};
    params.block_q = bqs[blocks & 7];
    params.block_k = bks[u8(in) & 7];
    const int64_t B = s->varlen ? 1 : s->B, H = s->H, D = d_codes[c_d % 8], Hkv = (flags >> 3 & 1) ? 1 : H;
    const sparge_dtype dt = (sparge_dtype)((flags & 3) % 3);
    const int bnhd = flags >> 2 & 1;
    tens q = tens_make(dt, bnhd, B, H, s->Nq, D), k = tens_make(dt, bnhd, B, Hkv, s->Nk, D);
    tens *inputs[4] = {&q, &k, &q, &k};
    uint64_t seed = u32(in);
    for (int t = 0; t < 2; t++)
        for (int64_t i = 0; i < inputs[t]->n; i++) {
            uint64_t z = (seed += 0x9e3779b97f4a7c15ull); /* splitmix64 */
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            z ^= z >> 31;
            const double u1 = ((double)(z >> 11) + 0.5) * 0x1.0p-53, u2 = (double)(z & 0x7ff) / 2048.0;
            const double normal = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
            switch (fill) {
            case 0: tens_set(inputs[t], i, (float)normal); break;
            case 1: tens_set(inputs[t], i, (float)((int)(z % 3) - 1)); break; /* coarse: ties between blocks */
            case 2: tens_set(inputs[t], i, 0.5f); break;                      /* flat rows: every block ties */
            default: tens_set(inputs[t], i, (float)(8.0 * normal)); break;    /* peaked rows */
            }
        }
    const int special = inject(in, inputs);
    void *saved[2] = {xmalloc(q.bytes), xmalloc(k.bytes)};
    memcpy(saved[0], q.t.data, q.bytes);
    memcpy(saved[1], k.t.data, k.bytes);

    /* what the core must refuse: with several faults, any of their statuses */
    sparge_tensor qx = q.t, kx = k.t;
    unsigned bad = 0;
    const int null_params = misuse == 5, other_device = misuse == 6, null_mask = misuse == 8;
    const double kf = params.topk, pf = params.topp;
    if (!null_params && (!(kf >= 0.0 && kf <= 1.0) || !(pf >= 0.0 && pf <= 1.0) || (kf == 0.0 && pf == 0.0) ||
                         params.block_q < 0 || params.block_k < 0 || !isfinite(params.scale)))
        bad |= BIT(SPARGE_ERR_INVALID);
    if (!null_params &&
        ((params.block_q > 0 && params.block_q != s->bq) || (params.block_k > 0 && params.block_k != s->bk)))
        bad |= BIT(SPARGE_ERR_MASK);
    switch (misuse) {
    case 1: qx.data = NULL, bad |= BIT(SPARGE_ERR_NULL); break;
    case 2: kx.dtype = (sparge_dtype)((dt + 1) % 3), bad |= BIT(SPARGE_ERR_DTYPE); break;
    case 3: kx.shape[3] = D + 1, bad |= BIT(SPARGE_ERR_SHAPE) | BIT(SPARGE_ERR_INVALID); break;
    case 4: qx.shape[2] = s->Nq + 1, bad |= BIT(SPARGE_ERR_MASK) | BIT(SPARGE_ERR_INVALID); break;
    case 5: bad |= BIT(SPARGE_ERR_NULL); break;
    case 6: bad |= BIT(SPARGE_ERR_MASK); break;
    case 7: kx.shape[1] = H + 1, bad |= BIT(SPARGE_ERR_SHAPE) | BIT(SPARGE_ERR_INVALID); break;
    case 8: bad |= BIT(SPARGE_ERR_NULL); break;
    case 9: params.causal = 1, bad |= s->causal ? 0 : BIT(SPARGE_ERR_MASK); break;
    case 10: qx.stride[2] = -qx.stride[2], bad |= BIT(SPARGE_ERR_INVALID); break;
    default: break;
    }
    const unsigned allowed = bad ? bad : BIT(SPARGE_OK);

    sparge_status got[NDEV];
    for (int d = 0; d < NDEV; d++) {
        snprintf(step, sizeof step, "sparge_mask_predict on %s (D %lld %s %s Hkv %lld fill %u k %g p %g scale %g "
                 "misuse %u special %d)", dev_names[d], (long long)D, sparge_dtype_name(dt), bnhd ? "bnhd" : "bhnd",
                 (long long)Hkv, fill, kf, pf, params.scale, misuse, special);
        sparge_mask *m = null_mask ? NULL : mp->m[other_device ? 1 - d : d];
        plant();
        got[d] = sparge_mask_predict(dev[d], &qx, &kx, null_params ? NULL : &params, m);
        outcome(got[d], allowed, "sparge_mask_predict", dev_names[d]);
        CHECK(memcmp(saved[0], q.t.data, q.bytes) == 0 && memcmp(saved[1], k.t.data, k.bytes) == 0,
              "the prediction wrote into q or k");
    }
    CHECK(got[FAST] == got[REF], "cpu returned %s, cpu-ref %s", sparge_status_name(got[FAST]),
          sparge_status_name(got[REF]));
    if (got[FAST] == SPARGE_OK) {
        const float scale = params.scale != 0.0f ? params.scale : 1.0f / sqrtf((float)D);
        double *qv = tens_values(&q), *kv = tens_values(&k);
        double *want = xmalloc((size_t)s->cells * sizeof(double)), *err = xmalloc((size_t)s->rows * sizeof(double));
        oracle_map(qv, kv, Hkv, D, scale, s, want, err);
        uint8_t *sel[NDEV], *dense = xmalloc((size_t)s->cells);
        int64_t *order = xmalloc((size_t)s->Nkb * sizeof(int64_t));
        /* f32 and fp64 overflow differently past moderate scales and with infinities: there only the rule. */
        const int moderate = fabsf(scale) <= 4.0f && special < 2;
        for (int d = 0; d < NDEV; d++) {
            float *map = xmalloc((size_t)s->cells * sizeof(float));
            snprintf(step, sizeof step, "the prediction's map and mask on %s (D %lld %s fill %u k %g p %g scale %g)",
                     dev_names[d], (long long)D, sparge_dtype_name(dt), fill, kf, pf, scale);
            CHECK(sparge_mask_get_pooled_map(mp->m[d], map) == SPARGE_OK, "get_pooled_map: %s", sparge_last_error());
            CHECK(sparge_mask_get_dense(mp->m[d], dense) == SPARGE_OK, "get_dense: %s", sparge_last_error());
            sel[d] = xmalloc((size_t)s->cells);
            for (int64_t r = 0; r < s->rows; r++) {
                const float *row = map + r * s->Nkb;
                const double *w = want + r * s->Nkb;
                oracle_select(s, r / (s->H * s->Nqb), r % s->Nqb, row, kf, pf, sel[d] + r * s->Nkb, &mp->mass[d][r],
                              &mp->mass_abs[d][r], order);
                for (int64_t j = 0; j < s->Nkb; j++) {
                    CHECK(dense[r * s->Nkb + j] == sel[d][r * s->Nkb + j], "row %lld block %lld: kept %u, but the "
                          "rule on the device's own map says %u", (long long)r, (long long)j, dense[r * s->Nkb + j],
                          sel[d][r * s->Nkb + j]);
                    if (moderate)
                        CHECK(isnan(row[j]) == isnan(w[j]), "row %lld entry %lld: %.9g, the fp64 map has %.9g",
                              (long long)r, (long long)j, row[j], w[j]);
                    if (moderate && !isnan(w[j]))
                        CHECK(fabs(row[j] - w[j]) <= (2e-6 * err[r] + 1e-5) * w[j] + 1e-30,
                              "row %lld entry %lld: %.9g, the fp64 map has %.9g (logit scale %.3g)", (long long)r,
                              (long long)j, row[j], w[j], err[r]);
                }
            }
            free(mp->map[d]);
            mp->map[d] = map;
        }
        /* The devices' selections differ only where the reference's decision was within rounding (at moderate
         * scales: past them an f32 logit may overflow where cpu-ref's fp64 one does not, DESIGN §1.4). */
        int same = 1;
        for (int64_t r = 0; r < s->rows; r++)
            if (memcmp(sel[FAST] + r * s->Nkb, sel[REF] + r * s->Nkb, (size_t)s->Nkb)) {
                int64_t allowed, diag0;
                double m1, m2;
                row_rule(s, r / (s->H * s->Nqb), r % s->Nqb, &allowed, &diag0);
                /* the cut is the rule's on the allowed blocks, before the diagonal ones are added */
                const int64_t n = oracle_row(mp->map[REF] + r * s->Nkb, allowed, kf, pf, dense, &m1, &m2, order);
                CHECK(!moderate || close_call(mp->map[REF] + r * s->Nkb, allowed, n, pf, order),
                      "row %lld: cpu and cpu-ref select differently and the row is not within rounding of its cut",
                      (long long)r);
                same = 0;
            }
        memcpy(mp->dense, sel[REF], (size_t)s->cells);
        mp->filled = 1;
        if (!same) { /* keep the pair in step for the next operations: both take cpu-ref's selection */
            for (int d = 0; d < NDEV; d++) {
                snprintf(step, sizeof step, "sparge_mask_set_dense on %s after a close call", dev_names[d]);
                CHECK(sparge_mask_set_dense(mp->m[d], mp->dense) == SPARGE_OK, "%s", sparge_last_error());
            }
            for (int64_t r = 0; r < s->rows; r++)
                mp->mass[REF][r] = NAN, mp->mass_abs[REF][r] = 0.0;
            selection_made(mp);
        }
        free(qv);
        free(kv);
        free(want);
        free(err);
        free(dense);
        free(order);
        for (int d = 0; d < NDEV; d++)
            free(sel[d]);
    }
    inspect(mp, flags >> 7); /* the prediction, or the mask as it was before a refusal */
    free(saved[0]);
    free(saved[1]);
    free(q.t.data);
    free(k.t.data);
}

/* ------------------------------------------------------------------ the target */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    for (int d = 0; d < NDEV; d++)
        if (!dev[d] && sparge_device_open(dev_names[d], &dev[d]) != SPARGE_OK) {
            fprintf(stderr, "fuzz_mask: cannot open %s: %s\n", dev_names[d], sparge_last_error());
            abort();
        }
    input in = {data, size};
    mask_pair mp = {decode_shape(&in), {NULL, NULL}, 0, NULL, {NULL, NULL}, {NULL, NULL}, {NULL, NULL}};
    shape *s = &mp.s;
    int skip;
    const unsigned allowed = create_expectation(s, &skip);
    if (skip)
        return 0;
    sparge_mask *const untouched = (sparge_mask *)&mp; /* any non-NULL address the library cannot have made */
    for (int d = 0; d < NDEV; d++) {
        snprintf(step, sizeof step, "sparge_mask_create on %s (B %lld H %lld Nq %lld Nk %lld bq %d bk %d causal %d "
                 "varlen %d: %d %d %d / %d %d %d)", dev_names[d], (long long)s->B, (long long)s->H, (long long)s->Nq,
                 (long long)s->Nk, s->bq, s->bk, s->causal, s->varlen, s->cu_q[0], s->cu_q[1], s->cu_q[2], s->cu_k[0],
                 s->cu_k[1], s->cu_k[2]);
        mp.m[d] = untouched;
        plant();
        const sparge_mask_layout layout = {s->B, s->H, s->Nq, s->Nk, s->bq, s->bk, s->causal,
                                           s->varlen ? s->cu_q : NULL, s->varlen ? s->cu_k : NULL};
        const sparge_status st = s->causal || s->varlen ? sparge_mask_create_ex(dev[d], &layout, &mp.m[d])
                                           : sparge_mask_create(dev[d], s->B, s->H, s->Nq, s->Nk, s->bq, s->bk, &mp.m[d]);
        outcome(st, allowed, "sparge_mask_create", dev_names[d]);
        CHECK(st ? mp.m[d] == untouched : mp.m[d] != untouched && mp.m[d] != NULL,
              "sparge_mask_create returned %s and %s its output", sparge_status_name(st),
              st ? "changed" : "did not set");
        if (st)
            mp.m[d] = NULL;
    }
    if (!mp.m[FAST] || !mp.m[REF]) {
        CHECK(!mp.m[FAST] && !mp.m[REF], "only one device created the mask");
        return 0;
    }
    s->Nqb = (s->maxq + s->bq - 1) / s->bq;
    s->Nkb = (s->maxk + s->bk - 1) / s->bk;
    s->rows = s->B * s->H * s->Nqb;
    s->cells = s->rows * s->Nkb;
    mp.dense = xmalloc((size_t)s->cells);
    for (int d = 0; d < NDEV; d++) {
        mp.mass[d] = xmalloc((size_t)s->rows * sizeof(double));
        mp.mass_abs[d] = xmalloc((size_t)s->rows * sizeof(double));
    }
    inspect(&mp, 1); /* a fresh mask holds no selection */
    for (int ops = 0; in.n > 0 && ops < 32; ops++) {
        const unsigned op = u8(&in) % 16;
        if (op >= 13) {
            op_predict(&in, &mp);
            continue;
        }
        switch (op % 8) {
        case 0:
        case 1:
        case 7: op_select(&in, &mp); break;
        case 2: op_set_dense(&in, &mp); break;
        case 3: inspect(&mp, u8(&in) & 1); break;
        case 4:
        case 5: op_attention(&in, &mp); break;
        default: op_misuse(&in, &mp); break;
        }
    }
    free_pair(&mp);
    return 0;
}
