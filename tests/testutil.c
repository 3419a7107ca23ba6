#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

uint64_t tu_next(tu_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double tu_uniform(tu_rng *r) { return (double)(tu_next(r) >> 11) * 0x1.0p-53; }

double tu_normal(tu_rng *r)
{
    double u = tu_uniform(r), v = tu_uniform(r);
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

int64_t tu_numel(const tu_tensor *x) { return x->t.shape[0] * x->t.shape[1] * x->t.shape[2] * x->t.shape[3]; }

tu_tensor tu_alloc(sparge_device *dev, sparge_dtype dt, tu_layout lay, int64_t B, int64_t H, int64_t N, int64_t D)
{
    tu_tensor x = {dev, lay == TU_BHND ? sparge_tensor_bhnd(NULL, dt, B, H, N, D) : sparge_tensor_bnhd(NULL, dt, B, H, N, D),
                   NULL, 0};
    x.bytes = (size_t)(B * H * N * D) * sparge_dtype_size(dt);
    assert_int_equal(sparge_malloc(dev, x.bytes, &x.t.data), SPARGE_OK);
    x.host = calloc(1, x.bytes);
    assert_non_null(x.host);
    return x;
}

void tu_free(tu_tensor *x)
{
    if (x->dev)
        sparge_free(x->dev, x->t.data);
    free(x->host);
    memset(x, 0, sizeof *x);
}

static int64_t offset(const sparge_tensor *t, int64_t i)
{
    int64_t d = i % t->shape[3], n = i / t->shape[3] % t->shape[2], h = i / (t->shape[3] * t->shape[2]) % t->shape[1],
            b = i / (t->shape[3] * t->shape[2] * t->shape[1]);
    return b * t->stride[0] + h * t->stride[1] + n * t->stride[2] + d * t->stride[3];
}

static void store(tu_tensor *x, int64_t off, double v)
{
    switch (x->t.dtype) {
    case SPARGE_F16: ((uint16_t *)x->host)[off] = sparge_f32_to_f16((float)v); break;
    case SPARGE_BF16: ((uint16_t *)x->host)[off] = sparge_f32_to_bf16((float)v); break;
    default: ((float *)x->host)[off] = (float)v;
    }
}

static double load(const tu_tensor *x, int64_t off)
{
    switch (x->t.dtype) {
    case SPARGE_F16: return sparge_f16_to_f32(((const uint16_t *)x->host)[off]);
    case SPARGE_BF16: return sparge_bf16_to_f32(((const uint16_t *)x->host)[off]);
    default: return ((const float *)x->host)[off];
    }
}

static void upload(tu_tensor *x) { assert_int_equal(sparge_memcpy_to_device(x->dev, x->t.data, x->host, x->bytes), SPARGE_OK); }
static void download(tu_tensor *x) { assert_int_equal(sparge_memcpy_to_host(x->dev, x->host, x->t.data, x->bytes), SPARGE_OK); }

void tu_fill_normal(tu_tensor *x, tu_rng *r, double sd)
{
    for (int64_t i = 0; i < tu_numel(x); i++)
        store(x, offset(&x->t, i), sd * tu_normal(r));
    upload(x);
}

void tu_set(tu_tensor *x, const double *vals)
{
    for (int64_t i = 0; i < tu_numel(x); i++)
        store(x, offset(&x->t, i), vals[i]);
    upload(x);
}

void tu_poison(tu_tensor *x) { assert_int_equal(sparge_memset(x->dev, x->t.data, 0xff, x->bytes), SPARGE_OK); }

double *tu_get(tu_tensor *x)
{
    download(x);
    double *out = malloc((size_t)tu_numel(x) * sizeof *out);
    assert_non_null(out);
    for (int64_t i = 0; i < tu_numel(x); i++)
        out[i] = load(x, offset(&x->t, i));
    return out;
}

int tu_still_poisoned(tu_tensor *x)
{
    download(x);
    for (size_t i = 0; i < x->bytes; i++)
        if (((unsigned char *)x->host)[i] != 0xff)
            return 0;
    return 1;
}

sparge_device *tu_open_or_null(const char *name)
{
    sparge_device *dev = NULL;
    if (sparge_device_open(name, &dev) != SPARGE_OK) {
        fprintf(stderr, "cannot open device '%s': %s\n", name, sparge_last_error());
        return NULL;
    }
    return dev;
}

/* ---------------------------------------------------------------- test vectors */

static char *slurp(const char *name)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", SPARGE_TESTDATA, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = 0;
    fclose(f);
    return s;
}

/* Position just after "key": in [s, end), or NULL. */
static const char *find_key(const char *s, const char *end, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    for (const char *p = strstr(s, pat); p && p < end; p = strstr(p + 1, pat)) {
        p += strlen(pat);
        while (*p == ' ' || *p == ':')
            p++;
        return p;
    }
    return NULL;
}

/* Parse a (possibly nested) JSON number array at p into a flat malloc'd
 * array; counts inner rows in *rows if given. Returns the number of values. */
static int parse_numbers(const char **pp, double **out, int *rows)
{
    const char *p = *pp;
    int cap = 64, n = 0, depth = 0;
    double *v = malloc((size_t)cap * sizeof *v);
    if (rows)
        *rows = 0;
    do {
        if (*p == '[') {
            depth++;
            if (depth == 2 && rows)
                (*rows)++;
            p++;
        } else if (*p == ']') {
            depth--;
            p++;
        } else if (*p == ',' || *p == ' ' || *p == '\n') {
            p++;
        } else {
            char *end;
            double x = strtod(p, &end);
            if (end == p)
                break;
            if (n == cap)
                v = realloc(v, (size_t)(cap *= 2) * sizeof *v);
            v[n++] = x;
            p = end;
        }
    } while (depth > 0 && *p);
    *pp = p;
    *out = v;
    return n;
}

/* The "keep" lists at p ([[...], [...], ...], one list, maybe empty, per row) into *count [rows] and *keep
 * [rows × nkb] (the listed blocks first, zeros after), both allocated here. */
static void parse_keep_lists(const char *p, int64_t rows, int64_t nkb, int **count, int **keep)
{
    *count = calloc((size_t)rows, sizeof(int));
    *keep = calloc((size_t)(rows * nkb), sizeof(int));
    assert_non_null(p);
    assert_true(*count && *keep);
    p = strchr(p, '[') + 1;
    for (int64_t r = 0; r < rows; r++) {
        p = strchr(p, '[');
        assert_non_null(p);
        double *row;
        const int cnt = parse_numbers(&p, &row, NULL);
        assert_true(cnt <= nkb);
        (*count)[r] = cnt;
        for (int j = 0; j < cnt; j++)
            (*keep)[r * nkb + j] = (int)row[j];
        free(row);
    }
}

static double number_at(const char *s, const char *end, const char *key)
{
    const char *p = find_key(s, end, key);
    if (!p || strncmp(p, "null", 4) == 0)
        return NAN;
    return strtod(p, NULL);
}

int tu_load_mask_cases(tu_mask_case **out)
{
    char *text = slurp("mask_rows.jsonl");
    assert_non_null(text);
    int n = 0, cap = 16;
    tu_mask_case *c = calloc((size_t)cap, sizeof *c);
    for (char *line = text; *line;) {
        char *end = strchr(line, '\n');
        if (!end)
            end = line + strlen(line);
        if (end > line + 2) {
            if (n == cap)
                c = realloc(c, (size_t)(cap *= 2) * sizeof *c);
            tu_mask_case *m = &c[n++];
            memset(m, 0, sizeof *m);
            const char *p = find_key(line, end, "row");
            m->n = parse_numbers(&p, &m->row, NULL);
            m->k = number_at(line, end, "k");
            m->p = number_at(line, end, "p");
            m->margin = number_at(line, end, "margin");
            double *keep;
            p = find_key(line, end, "keep");
            m->nkeep = parse_numbers(&p, &keep, NULL);
            m->keep = malloc((size_t)(m->nkeep + 1) * sizeof *m->keep);
            for (int i = 0; i < m->nkeep; i++)
                m->keep[i] = (int)keep[i];
            free(keep);
            const char *note = find_key(line, end, "note");
            if (note && *note == '"') {
                const char *q = strchr(note + 1, '"');
                snprintf(m->note, sizeof m->note, "%.*s", q ? (int)(q - note - 1) : 0, note + 1);
            }
        }
        line = *end ? end + 1 : end;
    }
    free(text);
    *out = c;
    return n;
}

void tu_free_mask_cases(tu_mask_case *c, int n)
{
    for (int i = 0; i < n; i++) {
        free(c[i].row);
        free(c[i].keep);
    }
    free(c);
}

int tu_load_pooled_cases(tu_pooled_case **out)
{
    char *text = slurp("pooled_cases.json");
    assert_non_null(text);
    int n = 0;
    tu_pooled_case *c = NULL;
    /* Each case is an object starting at "Q". */
    for (const char *s = strstr(text, "\"Q\""); s; s = strstr(s + 1, "\"Q\"")) {
        const char *next = strstr(s + 1, "\"Q\"");
        const char *end = next ? next : s + strlen(s);
        c = realloc(c, (size_t)(n + 1) * sizeof *c);
        tu_pooled_case *pc = &c[n++];
        memset(pc, 0, sizeof *pc);
        const char *p = find_key(s, end, "Q");
        int vals = parse_numbers(&p, &pc->Q, &pc->Nq);
        pc->D = vals / pc->Nq;
        p = find_key(s, end, "K");
        parse_numbers(&p, &pc->K, &pc->Nk);
        pc->bq = (int)number_at(s, end, "bq");
        pc->bk = (int)number_at(s, end, "bk");
        pc->k = number_at(s, end, "k");
        pc->p = number_at(s, end, "p");
        pc->scale = number_at(s, end, "scale");
        p = find_key(s, end, "pooled_q");
        parse_numbers(&p, &pc->pooled_q, &pc->Nqb);
        p = find_key(s, end, "pooled_k");
        parse_numbers(&p, &pc->pooled_k, &pc->Nkb);
        p = find_key(s, end, "pooled_map");
        parse_numbers(&p, &pc->map, NULL);
        parse_keep_lists(find_key(s, end, "keep"), pc->Nqb, pc->Nkb, &pc->keep_count, &pc->keep);
    }
    free(text);
    *out = c;
    return n;
}

void tu_free_pooled_cases(tu_pooled_case *c, int n)
{
    for (int i = 0; i < n; i++) {
        free(c[i].Q);
        free(c[i].K);
        free(c[i].pooled_q);
        free(c[i].pooled_k);
        free(c[i].map);
        free(c[i].keep_count);
        free(c[i].keep);
    }
    free(c);
}

/* Offsets at key (an array of integers, or null). */
static int32_t *offsets_at(const char *s, const char *end, const char *key, int n)
{
    const char *p = find_key(s, end, key);
    if (!p || *p != '[')
        return NULL;
    double *v;
    int32_t *cu = NULL;
    if (parse_numbers(&p, &v, NULL) == n + 1 && (cu = malloc((size_t)(n + 1) * sizeof *cu)))
        for (int i = 0; i <= n; i++)
            cu[i] = (int32_t)v[i];
    free(v);
    return cu;
}

int tu_load_causal_cases(tu_causal_case **out)
{
    char *text = slurp("causal_cases.json");
    assert_non_null(text);
    int n = 0;
    tu_causal_case *c = NULL;
    /* Each case is an object starting at "name". */
    for (const char *s = strstr(text, "\"name\""); s; s = strstr(s + 1, "\"name\"")) {
        const char *next = strstr(s + 1, "\"name\"");
        const char *end = next ? next : s + strlen(s);
        c = realloc(c, (size_t)(n + 1) * sizeof *c);
        assert_non_null(c);
        tu_causal_case *cc = &c[n++];
        memset(cc, 0, sizeof *cc);
        const char *p = find_key(s, end, "name");
        const char *q = p && *p == '"' ? strchr(p + 1, '"') : NULL;
        snprintf(cc->name, sizeof cc->name, "%.*s", q ? (int)(q - p - 1) : 0, q ? p + 1 : "");
        cc->B = (int)number_at(s, end, "B");
        cc->H = (int)number_at(s, end, "H");
        cc->Hkv = (int)number_at(s, end, "Hkv");
        cc->D = (int)number_at(s, end, "D");
        cc->Nq = (int)number_at(s, end, "Nq");
        cc->Nk = (int)number_at(s, end, "Nk");
        cc->bq = (int)number_at(s, end, "bq");
        cc->bk = (int)number_at(s, end, "bk");
        cc->causal = (int)number_at(s, end, "causal");
        cc->Nqb = (int)number_at(s, end, "Nqb");
        cc->Nkb = (int)number_at(s, end, "Nkb");
        cc->k = number_at(s, end, "k");
        cc->p = number_at(s, end, "p");
        cc->scale = number_at(s, end, "scale");
        cc->cu_q = offsets_at(s, end, "cu_seqlens_q", cc->B);
        cc->cu_k = offsets_at(s, end, "cu_seqlens_k", cc->B);
        const int64_t tb = cc->cu_q ? 1 : cc->B, rows = (int64_t)cc->B * cc->H * cc->Nqb;
        p = find_key(s, end, "Q");
        assert_int_equal(parse_numbers(&p, &cc->Q, NULL), tb * cc->H * cc->Nq * cc->D);
        p = find_key(s, end, "K");
        assert_int_equal(parse_numbers(&p, &cc->K, NULL), tb * cc->Hkv * cc->Nk * cc->D);
        p = find_key(s, end, "pooled_map");
        assert_int_equal(parse_numbers(&p, &cc->map, NULL), rows * cc->Nkb);
        parse_keep_lists(find_key(s, end, "keep"), rows, cc->Nkb, &cc->keep_count, &cc->keep);
    }
    free(text);
    *out = c;
    return n;
}

void tu_free_causal_cases(tu_causal_case *c, int n)
{
    for (int i = 0; i < n; i++) {
        free(c[i].cu_q);
        free(c[i].cu_k);
        free(c[i].Q);
        free(c[i].K);
        free(c[i].map);
        free(c[i].keep_count);
        free(c[i].keep);
    }
    free(c);
}
