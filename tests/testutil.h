/* Helpers shared by the CMocka tests: seeded random data, device tensors with
 * host mirrors, poisoning, fp64 comparison, and the shared test vectors. */
#ifndef SPARGE_TESTUTIL_H
#define SPARGE_TESTUTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "sparge.h"

#define TU_SKIP 77

/* splitmix64-seeded xoshiro-like generator: reproducible across platforms. */
typedef struct {
    uint64_t s;
} tu_rng;
uint64_t tu_next(tu_rng *r);
double tu_uniform(tu_rng *r);  /* [0,1) */
double tu_normal(tu_rng *r);

typedef enum { TU_BHND, TU_BNHD } tu_layout;

/* A [B,H,N,D] tensor on dev with a host copy of its storage. */
typedef struct {
    sparge_device *dev;
    sparge_tensor t; /* data points to device memory */
    void *host;      /* storage mirror, same layout */
    size_t bytes;
} tu_tensor;

tu_tensor tu_alloc(sparge_device *dev, sparge_dtype dt, tu_layout lay, int64_t B, int64_t H, int64_t N, int64_t D);
void tu_free(tu_tensor *x);
/* Normal(0, sd) values rounded to the dtype, uploaded. */
void tu_fill_normal(tu_tensor *x, tu_rng *r, double sd);
/* Set from logical fp64 values [B,H,N,D] (rounded to the dtype), uploaded. */
void tu_set(tu_tensor *x, const double *vals);
/* Fill device storage with 0xFF bytes (NaN in f32, f16 and bf16). */
void tu_poison(tu_tensor *x);
/* Download and convert to logical fp64 [B,H,N,D]; returns malloc'd array. */
double *tu_get(tu_tensor *x);
/* 1 if the device storage still holds the 0xFF poison everywhere. */
int tu_still_poisoned(tu_tensor *x);
int64_t tu_numel(const tu_tensor *x);

/* Open a device or skip: returns NULL and the caller exits 77. */
sparge_device *tu_open_or_null(const char *name);

/* ---- shared test vectors (tests/data, copied from shared/testdata) ---- */
typedef struct {
    int n;
    double *row;
    double k, p;
    int nkeep;
    int *keep;
    double margin; /* NaN for hand-made cases (exact) */
    char note[160];
} tu_mask_case;
/* Parse mask_rows.jsonl; returns the count, *out malloc'd. */
int tu_load_mask_cases(tu_mask_case **out);
void tu_free_mask_cases(tu_mask_case *c, int n);

typedef struct {
    int Nq, Nk, D, bq, bk, Nqb, Nkb;
    double k, p, scale;
    double *Q, *K;                /* [Nq×D], [Nk×D] */
    double *pooled_q, *pooled_k;  /* [Nqb×D], [Nkb×D] */
    double *map;                  /* [Nqb×Nkb] */
    int *keep_count, *keep;       /* per query block; keep [Nqb×Nkb] packed */
} tu_pooled_case;
int tu_load_pooled_cases(tu_pooled_case **out);
void tu_free_pooled_cases(tu_pooled_case *c, int n);

/* causal_cases.json: block-causal, grouped-head and varlen layouts (tests/data/README.md). */
typedef struct {
    char name[64];
    int B, H, Hkv, D, Nq, Nk, bq, bk, causal, Nqb, Nkb; /* varlen: B sequences, Nq, Nk the packed totals */
    int32_t *cu_q, *cu_k;   /* B+1 token offsets, or NULL (fixed length) */
    double k, p, scale;
    double *Q, *K;          /* [tb,H,Nq,D], [tb,Hkv,Nk,D]; tb = 1 when varlen, else B */
    double *map;            /* [B,H,Nqb,Nkb], 0 outside each row's allowed blocks */
    int *keep_count, *keep; /* per row of [B,H,Nqb]; keep [rows×Nkb] packed */
} tu_causal_case;
int tu_load_causal_cases(tu_causal_case **out);
void tu_free_causal_cases(tu_causal_case *c, int n);

#endif
