/* The conformance harness (docs/DESIGN.md §2, §4.1): one table of cases run on every available device
 * against cpu-ref, the fp64 oracle. `sparge check` runs it, and so does tests/conformance.c.
 *
 * Internal to the tool and the tests, and written on the public API alone: what it checks is what a caller
 * of libsparge sees. */
#ifndef SPARGE_CHECK_H
#define SPARGE_CHECK_H

#include <stdint.h>
#include <stdio.h>

#include "sparge.h"

/* The ops a case exercises. */
enum {
    CHECK_MASK = 1, /* pooling, pooled map, prediction, selection on cpu-ref's map */
    CHECK_FWD = 2,  /* forward O and LSE */
    CHECK_BWD = 4   /* backward dQ, dK, dV (plain and deterministic) from cpu-ref's O and LSE */
};

typedef enum { CHECK_BHND, CHECK_BNHD } check_layout;

/* The most sequences of a varlen case. */
#define CHECK_MAX_SEQ 8

typedef struct {
    char name[64];          /* "ragged/bf16/bnhd": the row's label, dtype and layout */
    unsigned ops;           /* CHECK_MASK | CHECK_FWD | CHECK_BWD */
    int64_t B, H, Nq, Nk, D; /* varlen: B sequences packed into [1,H,Nq,D] / [1,Hkv,Nk,D] views, Nq and Nk the
                              * totals */
    int64_t kv_heads;       /* K and V's heads (grouped: Hkv divides H); 0 or H: as many as Q */
    int causal;             /* block-causal, bottom-right aligned where Nq < Nk (per sequence when varlen) */
    int nseq;               /* 0: fixed length; else varlen with B = nseq sequences cut by cu_q, cu_k */
    int32_t cu_q[CHECK_MAX_SEQ + 1], cu_k[CHECK_MAX_SEQ + 1]; /* token offsets, from 0 to Nq and Nk */
    int bq, bk;             /* the mask's blocks */
    sparge_dtype dtype;
    check_layout layout;
    double topk, topp;      /* the mask's parameters; both 0: dense attention (no mask) */
    double tol;             /* O, dQ, dK, dV: 0 means sparge_dtype_tolerance(dtype) */
    const char *options;    /* "name=value ..." set on the device under test (NULL: none); a device without
                             * one of these options skips the case */
    int quick;              /* part of the quick grid (`sparge check` without --full) */
} check_case;

/* Relative L2 error ‖a − ref‖ / ‖ref‖ in fp64; NaN if either holds a NaN, so that NaN never passes. */
double check_rel_l2(const double *a, const double *ref, int64_t n);

/* The table, each row expanded over its dtypes and layouts. */
int check_case_count(void);
const check_case *check_case_get(int i);

typedef enum { CHECK_MODE_TEST, CHECK_MODE_GRAD, CHECK_MODE_PERF } check_mode;
typedef enum { CHECK_PASS, CHECK_FAIL, CHECK_UNSUPPORTED, CHECK_SKIPPED } check_result;

typedef struct {
    check_mode mode;     /* test: against cpu-ref; grad: gradients against finite differences of the fp64
                          * forward (the cases with a backward and at most CHECK_GRAD_MAX_HEAD per head);
                          * perf: the median time of each op */
    int full;            /* the whole table; else its quick grid */
    const char *backend; /* a backend ("cuda") or one device ("cuda:1"); NULL: every device but cpu-ref */
    const char *filter;  /* only the cases whose name contains this; NULL: all */
    int reps;            /* perf: timed runs per op; 0 means 5 */
    FILE *out;           /* one line per (case, device), then a summary; NULL means stdout */
    /* Called after each (case, device) unless NULL. tiers: the tier that ran the mask prediction, the forward
     * and the backward ("cuda"; "-" refused; "" not run). */
    void (*on_result)(void *user, const check_case *c, const char *device, check_result r, const char *const *tiers);
    void *user;
} check_config;

/* Per-head size Nq·Nk·D up to which a case takes part in the grad mode. */
#define CHECK_GRAD_MAX_HEAD 2500000

typedef struct {
    int devices; /* devices run */
    int passed, failed, unsupported, skipped; /* (case, device) pairs */
} check_summary;

/* Runs the table as cfg says. Returns 0 when nothing failed, 1 on any failure (or when a device could not be
 * opened, or a named backend has no device), 2 when cfg->backend names no backend of this build (or cpu-ref) or
 * no case matches cfg->filter.
 * sum may be NULL. */
int check_run(const check_config *cfg, check_summary *sum);

/* 0 if m is well formed (docs/DESIGN.md §2.2: every row keeps a block; counts, CSR, dense view and transpose
 * agree; −1 past each count) and, when want is given, keeps what want keeps row by row, except that with map
 * (want's pooled map) a row where want's decision was within rounding of the cut may differ (counted in
 * *close_rows). Else −1 with the reason in msg. Builds m's transpose if its selection has none. */
int check_mask(const sparge_mask *m, const sparge_mask *want, const float *map, double p, int64_t *close_rows,
               char *msg, size_t msg_len);

/* Opens the devices the harness runs on (see check_config.backend) into devs (at most max). Returns how many
 * were opened, -2 for a name that is no backend of this build (or cpu-ref) and -1 when opening one failed,
 * with the reason in msg; on success msg names the backends compiled in without a device ("" if none). */
int check_open_devices(const char *backend, sparge_device **devs, int max, char *msg, size_t msg_len);

#endif
