/* safetensors: 8-byte little-endian header length, a JSON header mapping
 * tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
 * relative to the data section that follows), optional "__metadata__", then
 * the raw little-endian data. Reads F32/F16/BF16, writes them too. */
#define _POSIX_C_SOURCE 200809L
#define _FILE_OFFSET_BITS 64
#include <sys/types.h>
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "exp.h"

/* Header sizes above this are refused (the format's reference reader uses 100 MB). */
#define ST_MAX_HEADER (100u << 20)

static int little_endian(void)
{
    const uint16_t one = 1;
    return *(const uint8_t *)&one == 1;
}

/* ---------------------------------------------------------------- a minimal JSON reader */

typedef struct {
    const char *p, *end;
} js;

static void ws(js *j)
{
    while (j->p < j->end && isspace((unsigned char)*j->p))
        j->p++;
}

static int expect(js *j, char c)
{
    ws(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return 0;
    }
    return -1;
}

/* String into out (escapes other than \" and \\ kept verbatim; names are ASCII in practice). */
static int str(js *j, char *out, size_t cap)
{
    if (expect(j, '"'))
        return -1;
    size_t n = 0;
    while (j->p < j->end && *j->p != '"') {
        char c = *j->p++;
        if (c == '\\' && j->p < j->end)
            c = *j->p++;
        if (out && n + 1 < cap)
            out[n++] = c;
    }
    if (out && cap)
        out[n] = 0;
    return j->p < j->end ? (j->p++, 0) : -1;
}

static int integer(js *j, int64_t *out)
{
    ws(j);
    char *e;
    errno = 0;
    long long v = strtoll(j->p, &e, 10);
    if (e == j->p || e > j->end || errno == ERANGE)
        return -1;
    j->p = e;
    *out = v;
    return 0;
}

static int skip_value(js *j, int depth)
{
    ws(j);
    if (j->p >= j->end || depth > 32)
        return -1;
    char c = *j->p;
    if (c == '"')
        return str(j, NULL, 0);
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        j->p++;
        ws(j);
        if (j->p < j->end && *j->p == close)
            return j->p++, 0;
        for (;;) {
            if (c == '{' && (str(j, NULL, 0) || expect(j, ':')))
                return -1;
            if (skip_value(j, depth + 1))
                return -1;
            ws(j);
            if (j->p < j->end && *j->p == ',') {
                j->p++;
                continue;
            }
            return expect(j, close);
        }
    }
    while (j->p < j->end && (isalnum((unsigned char)*j->p) || strchr("+-.", *j->p)))
        j->p++;
    return 0;
}

static int int_array(js *j, int64_t *out, int cap, int *count)
{
    *count = 0;
    if (expect(j, '['))
        return -1;
    ws(j);
    if (j->p < j->end && *j->p == ']')
        return j->p++, 0;
    for (;;) {
        int64_t v;
        if (*count >= cap || integer(j, &v))
            return -1;
        out[(*count)++] = v;
        ws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        return expect(j, ']');
    }
}

static int tensor_entry(js *j, exp_st_tensor *t)
{
    int have = 0;
    if (expect(j, '{'))
        return -1;
    ws(j);
    if (j->p < j->end && *j->p == '}')
        return -1;
    for (;;) {
        char key[32];
        if (str(j, key, sizeof key) || expect(j, ':'))
            return -1;
        if (!strcmp(key, "dtype")) {
            if (str(j, t->dtype, sizeof t->dtype))
                return -1;
            have |= 1;
        } else if (!strcmp(key, "shape")) {
            if (int_array(j, t->shape, 8, &t->ndim))
                return -1;
            have |= 2;
        } else if (!strcmp(key, "data_offsets")) {
            int64_t off[2];
            int n;
            if (int_array(j, off, 2, &n) || n != 2 || off[0] < 0 || off[1] < off[0])
                return -1;
            t->begin = (uint64_t)off[0];
            t->end = (uint64_t)off[1];
            have |= 4;
        } else if (skip_value(j, 1)) {
            return -1;
        }
        ws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        return expect(j, '}') || have != 7 ? -1 : 0;
    }
}

static size_t dtype_bytes(const char *d)
{
    if (!strcmp(d, "F32"))
        return 4;
    if (!strcmp(d, "F16") || !strcmp(d, "BF16"))
        return 2;
    return 0;
}

/* ---------------------------------------------------------------- reading */

void exp_st_close(exp_st_file *f)
{
    free(f->tensors);
    free(f->metadata);
    memset(f, 0, sizeof *f);
}

int exp_st_metadata(const exp_st_file *f, const char *key, char *out, size_t cap)
{
    if (!f->metadata)
        return -1;
    js j = {f->metadata, f->metadata + strlen(f->metadata)};
    if (expect(&j, '{'))
        return -1;
    ws(&j);
    if (j.p < j.end && *j.p == '}')
        return -1;
    for (;;) {
        char name[128];
        if (str(&j, name, sizeof name) || expect(&j, ':'))
            return -1;
        ws(&j);
        if (!strcmp(name, key) && j.p < j.end && *j.p == '"')
            return str(&j, out, cap);
        if (skip_value(&j, 1))
            return -1;
        ws(&j);
        if (j.p >= j.end || *j.p != ',')
            return -1;
        j.p++;
    }
}

int exp_st_open(const char *path, exp_st_file *f, char *err, size_t err_len)
{
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s", path);
    if (!little_endian())
        return exp_fail(err, err_len, "%s: this reader needs a little-endian host", path);
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return exp_fail(err, err_len, "%s: cannot open: %s", path, strerror(errno));
    uint8_t len8[8];
    char *hdr = NULL;
    int rc = -1;
    if (fread(len8, 1, 8, fp) != 8) {
        exp_fail(err, err_len, "%s: shorter than the 8-byte header length", path);
        goto out;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len8[i];
    if (hlen < 2 || hlen > ST_MAX_HEADER) {
        exp_fail(err, err_len, "%s: header length %llu is outside [2, %u]", path, (unsigned long long)hlen,
                 ST_MAX_HEADER);
        goto out;
    }
    hdr = malloc(hlen + 1); /* NUL-terminated: the number parser (strtoll) reads up to a non-digit */
    if (!hdr || fread(hdr, 1, hlen, fp) != hlen) {
        exp_fail(err, err_len, "%s: cannot read the %llu-byte header", path, (unsigned long long)hlen);
        goto out;
    }
    if (fseeko(fp, 0, SEEK_END)) {
        exp_fail(err, err_len, "%s: cannot seek", path);
        goto out;
    }
    hdr[hlen] = 0;
    uint64_t file_size = (uint64_t)ftello(fp);
    f->data_start = 8 + hlen;
    js j = {hdr, hdr + hlen};
    if (expect(&j, '{'))
        goto bad;
    int cap = 0;
    ws(&j);
    if (j.p < j.end && *j.p == '}')
        j.p++;
    else
        for (;;) {
            char name[128];
            if (str(&j, name, sizeof name) || expect(&j, ':'))
                goto bad;
            if (!strcmp(name, "__metadata__")) {
                ws(&j);
                const char *from = j.p;
                if (skip_value(&j, 1))
                    goto bad;
                free(f->metadata);
                if (!(f->metadata = malloc((size_t)(j.p - from) + 1))) {
                    exp_fail(err, err_len, "%s: out of memory", path);
                    goto out;
                }
                memcpy(f->metadata, from, (size_t)(j.p - from));
                f->metadata[j.p - from] = 0;
            } else {
                if (f->count == cap) {
                    cap = cap ? 2 * cap : 8;
                    exp_st_tensor *t = realloc(f->tensors, sizeof *t * (size_t)cap);
                    if (!t) {
                        exp_fail(err, err_len, "%s: out of memory", path);
                        goto out;
                    }
                    f->tensors = t;
                }
                exp_st_tensor *t = &f->tensors[f->count];
                memset(t, 0, sizeof *t);
                snprintf(t->name, sizeof t->name, "%s", name);
                if (tensor_entry(&j, t))
                    goto bad;
                uint64_t elems = 1, bytes = 0;
                int bad_shape = 0;
                for (int d = 0; d < t->ndim; d++)
                    bad_shape |= t->shape[d] < 0 || __builtin_mul_overflow(elems, (uint64_t)t->shape[d], &elems);
                size_t es = dtype_bytes(t->dtype);
                if (bad_shape || __builtin_mul_overflow(elems, (uint64_t)es, &bytes)) {
                    exp_fail(err, err_len, "%s: tensor '%s' has a negative dimension or more elements than fit in "
                             "64 bits", path, name);
                    goto out;
                }
                if (es && bytes != t->end - t->begin) {
                    exp_fail(err, err_len, "%s: tensor '%s' has %llu bytes for %llu %s elements", path, name,
                             (unsigned long long)(t->end - t->begin), (unsigned long long)elems, t->dtype);
                    goto out;
                }
                if (f->data_start + t->end > file_size) {
                    exp_fail(err, err_len, "%s: tensor '%s' runs past the end of the file", path, name);
                    goto out;
                }
                f->count++;
            }
            ws(&j);
            if (j.p < j.end && *j.p == ',') {
                j.p++;
                continue;
            }
            if (expect(&j, '}'))
                goto bad;
            break;
        }
    rc = 0;
    goto out;
bad:
    exp_fail(err, err_len, "%s: malformed JSON header near byte %ld", path, (long)(j.p - hdr));
out:
    free(hdr);
    fclose(fp);
    if (rc)
        exp_st_close(f);
    return rc;
}

const exp_st_tensor *exp_st_find(const exp_st_file *f, const char *name)
{
    for (int i = 0; i < f->count; i++)
        if (!strcmp(f->tensors[i].name, name))
            return &f->tensors[i];
    return NULL;
}

float *exp_st_read_f32(const exp_st_file *f, const exp_st_tensor *t, char *err, size_t err_len)
{
    size_t es = dtype_bytes(t->dtype);
    if (!es) {
        exp_fail(err, err_len, "%s: tensor '%s' has dtype %s (F32, F16 and BF16 are supported)", f->path, t->name,
                 t->dtype);
        return NULL;
    }
    size_t n = (size_t)((t->end - t->begin) / es);
    float *out = malloc((n ? n : 1) * sizeof(float));
    void *raw = malloc(n * es + 1);
    FILE *fp = fopen(f->path, "rb");
    int ok = out && raw && fp && !fseeko(fp, (off_t)(f->data_start + t->begin), SEEK_SET) &&
             fread(raw, es, n, fp) == n;
    if (fp)
        fclose(fp);
    if (!ok) {
        free(out);
        free(raw);
        exp_fail(err, err_len, "%s: cannot read tensor '%s'", f->path, t->name);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (es == 4)
            memcpy(&out[i], (const char *)raw + 4 * i, 4);
        else {
            uint16_t h;
            memcpy(&h, (const char *)raw + 2 * i, 2);
            out[i] = !strcmp(t->dtype, "F16") ? sparge_f16_to_f32(h) : sparge_bf16_to_f32(h);
        }
    }
    free(raw);
    return out;
}

/* ---------------------------------------------------------------- writing */

int exp_st_write(const char *path, int n, const char *const *names, const float *const *data, const int *ndims,
                 const int64_t (*shapes)[8], sparge_dtype dtype, const char *metadata_json, char *err, size_t err_len)
{
    if (!little_endian())
        return exp_fail(err, err_len, "%s: this writer needs a little-endian host", path);
    const char *dname = dtype == SPARGE_F32 ? "F32" : dtype == SPARGE_F16 ? "F16" : "BF16";
    size_t es = sparge_dtype_size(dtype), cap = 4096 + (size_t)n * 256, len = 0;
    char *hdr = malloc(cap + 8);
    if (!hdr)
        return exp_fail(err, err_len, "%s: out of memory", path);
    len += (size_t)snprintf(hdr + len, cap - len, "{");
    if (metadata_json)
        len += (size_t)snprintf(hdr + len, cap - len, "\"__metadata__\":%s%s", metadata_json, n ? "," : "");
    uint64_t off = 0;
    for (int t = 0; t < n && len < cap; t++) {
        uint64_t elems = 1;
        len += (size_t)snprintf(hdr + len, cap - len, "\"%s\":{\"dtype\":\"%s\",\"shape\":[", names[t], dname);
        for (int d = 0; d < ndims[t]; d++) {
            elems *= (uint64_t)shapes[t][d];
            len += (size_t)snprintf(hdr + len, cap - len, "%s%lld", d ? "," : "", (long long)shapes[t][d]);
        }
        len += (size_t)snprintf(hdr + len, cap - len, "],\"data_offsets\":[%llu,%llu]}%s", (unsigned long long)off,
                                (unsigned long long)(off + elems * es), t + 1 < n ? "," : "");
        off += elems * es;
    }
    if (len + 1 >= cap) {
        free(hdr);
        return exp_fail(err, err_len, "%s: header too long", path);
    }
    hdr[len++] = '}';
    while (len % 8) /* the data section starts 8-byte aligned; trailing spaces are allowed */
        hdr[len++] = ' ';
    /* written beside path and renamed at the end, so that a failed or interrupted write leaves the file that was
     * there */
    char *part;
    if (exp_part_path(path, &part)) {
        free(hdr);
        return exp_fail(err, err_len, "%s: out of memory", path);
    }
    FILE *fp = fopen(part ? part : path, "wb");
    if (!fp) {
        int e = errno;
        free(hdr);
        free(part);
        return exp_fail(err, err_len, "%s: cannot create: %s", path, strerror(e));
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)len >> (8 * i));
    int ok = fwrite(len8, 1, 8, fp) == 8 && fwrite(hdr, 1, len, fp) == len;
    free(hdr);
    for (int t = 0; t < n && ok; t++) {
        uint64_t elems = 1;
        for (int d = 0; d < ndims[t]; d++)
            elems *= (uint64_t)shapes[t][d];
        for (uint64_t i = 0; i < elems && ok; i++) {
            float x = data[t][i];
            if (dtype == SPARGE_F32)
                ok = fwrite(&x, 4, 1, fp) == 1;
            else {
                uint16_t h = dtype == SPARGE_F16 ? sparge_f32_to_f16(x) : sparge_f32_to_bf16(x);
                ok = fwrite(&h, 2, 1, fp) == 1;
            }
        }
    }
    int e = ok ? 0 : errno;
    if (fclose(fp) && ok)
        ok = 0, e = errno;
    if (ok && part && rename(part, path))
        ok = 0, e = errno;
    if (!ok && part)
        unlink(part);
    free(part);
    if (!ok)
        return exp_fail(err, err_len, "%s: write failed%s%s", path, e ? ": " : "", e ? strerror(e) : "");
    return 0;
}

/* ---------------------------------------------------------------- Q/K/V dumps */

int exp_load_qkv(const char *path, const char *const names[3], int bnhd, exp_qkv *x)
{
    char err[640];
    exp_st_file f;
    memset(x, 0, sizeof *x);
    if (exp_st_open(path, &f, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    const exp_st_tensor *t[3];
    int rc = 0;
    for (int i = 0; i < 3 && !rc; i++) {
        t[i] = exp_st_find(&f, names[i]);
        if (!t[i]) {
            fprintf(stderr, "%s: no tensor named '%s'\n", path, names[i]);
            rc = -1;
        } else if (t[i]->ndim != 3 && t[i]->ndim != 4) {
            fprintf(stderr, "%s: '%s' is %d-D (need [B,H,N,D], [B,N,H,D] or [H,N,D])\n", path, names[i], t[i]->ndim);
            rc = -1;
        } else if (!t[i]->shape[0] || !t[i]->shape[1] || !t[i]->shape[2] || (t[i]->ndim == 4 && !t[i]->shape[3])) {
            fprintf(stderr, "%s: '%s' has an empty dimension (every one of B, H, N and D must be at least 1)\n", path,
                    names[i]);
            rc = -1;
        } else if (i && (t[i]->ndim != t[0]->ndim || memcmp(t[i]->shape, t[0]->shape, sizeof t[0]->shape))) {
            fprintf(stderr, "%s: '%s' and '%s' differ in shape (self-attention dumps need equal shapes)\n", path,
                    names[0], names[i]);
            rc = -1;
        }
    }
    float *raw[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3 && !rc; i++)
        if (!(raw[i] = exp_st_read_f32(&f, t[i], err, sizeof err))) {
            fprintf(stderr, "%s\n", err);
            rc = -1;
        }
    if (!rc) {
        const int64_t *s = t[0]->shape;
        if (t[0]->ndim == 3) {
            x->B = 1;
            x->H = s[0];
            x->N = s[1];
            x->D = s[2];
        } else {
            x->B = s[0];
            x->H = bnhd ? s[2] : s[1];
            x->N = bnhd ? s[1] : s[2];
            x->D = s[3];
        }
        size_t n = (size_t)(x->B * x->H * x->N * x->D);
        float **dst[3] = {&x->q, &x->k, &x->v};
        for (int i = 0; i < 3; i++) {
            if (!bnhd || t[0]->ndim == 3) {
                *dst[i] = raw[i];
                raw[i] = NULL;
                continue;
            }
            float *o = malloc(n * sizeof(float));
            if (!o) {
                rc = -1;
                break;
            }
            for (int64_t b = 0; b < x->B; b++)
                for (int64_t nn = 0; nn < x->N; nn++)
                    for (int64_t h = 0; h < x->H; h++)
                        memcpy(o + ((b * x->H + h) * x->N + nn) * x->D, raw[i] + ((b * x->N + nn) * x->H + h) * x->D,
                               (size_t)x->D * sizeof(float));
            *dst[i] = o;
        }
        const char *base = strrchr(path, '/');
        snprintf(x->label, sizeof x->label, "file %s", base ? base + 1 : path);
        snprintf(x->name, sizeof x->name, "file");
    }
    for (int i = 0; i < 3; i++)
        free(raw[i]);
    exp_st_close(&f);
    if (rc)
        exp_qkv_free(x);
    return rc;
}
