/* The conformance harness: the case table, and its test, grad and perf modes over every available device
 * (check.h; the rules are docs/DESIGN.md §2). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ---------------------------------------------------------------- the table */

enum { F32 = 1 << SPARGE_F32, F16 = 1 << SPARGE_F16, BF16 = 1 << SPARGE_BF16, ALL_DT = F32 | F16 | BF16 };
enum { BHND = 1 << CHECK_BHND, BNHD = 1 << CHECK_BNHD, BOTH = BHND | BNHD };
enum { ALL = CHECK_MASK | CHECK_FWD | CHECK_BWD, FB = CHECK_FWD | CHECK_BWD, FWD = CHECK_FWD, BWD = CHECK_BWD,
       MASK = CHECK_MASK };

/* A row of the table: one shape, mask and option set over a set of dtypes and layouts. */
typedef struct {
    const char *label;
    unsigned ops;
    int64_t B, H, Nq, Nk, D;
    int bq, bk;
    unsigned dtypes, layouts;
    double topk, topp;
    double tol; /* 0: the dtype's */
    const char *options;
    int quick;        /* 1: every expansion is in the quick grid; QUICK(dts, lays): those expansions only */
    int64_t kv_heads; /* 0: as many as Q */
    int causal;
    const char *seqs; /* varlen: "100,257,40" (Q and K alike) or "90,300/150,260" (Q's, then K's); B, Nq and Nk
                       * are then the count and the totals */
} row;

#define QUICK(dts, lays) (2 | (dts) << 2 | (lays) << 5)

#define ROW(label, ops, B, H, Nq, Nk, D, bq, bk, dts, lays, k, p, opts, quick)                                       \
    {label, ops, B, H, Nq, Nk, D, bq, bk, dts, lays, k, p, 0.0, opts, quick, 0, 0, NULL}
/* A shape masked (hybrid k = 0.1, p = 0.5: a few blocks per row) and dense. */
#define PAIR(label, ops, B, H, Nq, Nk, D, bq, bk, dts, lays, opts, quick)                                            \
    ROW(label, ops, B, H, Nq, Nk, D, bq, bk, dts, lays, 0.1, 0.5, opts, quick),                                        \
        ROW(label "-dense", (ops) & FB, B, H, Nq, Nk, D, bq, bk, dts, lays, 0.0, 0.0, opts, quick)
/* Grouped K/V heads (hkv), block-causal masks and packed variable-length sequences (sparge_mask_layout). */
#define LROW(label, ops, B, H, hkv, Nq, Nk, D, bq, bk, dts, lays, k, p, causal, seqs, quick)                           \
    {label, ops, B, H, Nq, Nk, D, bq, bk, dts, lays, k, p, 0.0, NULL, quick, hkv, causal, seqs}
/* ... with device options */
#define LROW_OPTS(label, ops, B, H, hkv, Nq, Nk, D, bq, bk, dts, lays, k, p, causal, seqs, opts)                        \
    {label, ops, B, H, Nq, Nk, D, bq, bk, dts, lays, k, p, 0.0, opts, 0, hkv, causal, seqs}
/* Such a fixed-length shape masked and dense (varlen needs a mask, so a varlen row has no dense twin). */
#define LPAIR(label, ops, B, H, hkv, Nq, Nk, D, bq, bk, dts, lays, causal, quick, dense_quick)                         \
    LROW(label, ops, B, H, hkv, Nq, Nk, D, bq, bk, dts, lays, 0.1, 0.5, causal, NULL, quick),                          \
        LROW(label "-dense", (ops) & FB, B, H, hkv, Nq, Nk, D, bq, bk, dts, lays, 0.0, 0.0, causal, NULL, dense_quick)
/* The tensor-core shapes of the grid (D 64 and 128, blocks 128 x 64 and 128 x 128) under one option set. */
#define TC_SHAPES(label, ops, opts)                                                                                    \
    PAIR(label "-300", ops, 2, 3, 300, 300, 64, 128, 64, F16 | BF16, BHND, opts, 0),                                   \
        PAIR(label "-520", ops, 1, 2, 520, 390, 128, 128, 128, F16 | BF16, BHND, opts, 0),                             \
        PAIR(label "-77", ops, 2, 1, 77, 200, 128, 128, 128, F16 | BF16, BHND, opts, 0)

static const row rows[] = {
    /* The quick grid: ragged shapes (N not a multiple of the blocks, Nq ≠ Nk) in every dtype and layout; D = 96,
     * which the tensor-core tier runs padded to 128 (f32 runs on a chained device's next tier); Top-k alone and
     * dense at a size the grad mode takes. */
    PAIR("ragged", ALL, 1, 2, 300, 300, 64, 128, 64, ALL_DT, BOTH, NULL, 1),
    ROW("bk128", ALL, 2, 1, 260, 190, 128, 128, 128, ALL_DT, BOTH, 0.1, 0.5, NULL, 1),
    ROW("d96", ALL, 1, 2, 200, 333, 96, 128, 64, ALL_DT, BOTH, 0.1, 0.5, NULL, 1),
    ROW("topk-small", ALL, 1, 2, 200, 150, 64, 128, 64, ALL_DT, BOTH, 0.5, 0.0, NULL, 1),
    ROW("small-dense", FB, 1, 2, 200, 150, 64, 128, 64, ALL_DT, BOTH, 0.0, 0.0, NULL, 1),
    /* Grouped K/V heads, causal and varlen at sizes the grad mode takes, one dtype and layout of each in the quick
     * grid: GQA 4/2 and MQA 4/1; causal with Nq < Nk (bottom-right) and bq != bk, masked and dense; three packed
     * sequences, one shorter than a block; the three together. */
    LROW("gqa-small", ALL, 1, 4, 2, 200, 150, 64, 128, 64, ALL_DT, BOTH, 0.1, 0.5, 0, NULL, QUICK(BF16, BHND)),
    LROW("mqa-small", ALL, 1, 4, 1, 200, 150, 64, 128, 64, ALL_DT, BOTH, 0.5, 0.0, 0, NULL, QUICK(F16, BNHD)),
    LPAIR("causal-small", ALL, 1, 2, 0, 150, 260, 64, 64, 32, ALL_DT, BOTH, 1, QUICK(F32, BNHD), QUICK(BF16, BHND)),
    LROW("varlen-small", ALL, 0, 2, 0, 0, 0, 64, 64, 32, ALL_DT, BOTH, 0.2, 0.5, 0, "90,30,70", QUICK(F16, BHND)),
    LROW("varlen-causal-gqa-small", ALL, 0, 4, 2, 0, 0, 64, 64, 32, ALL_DT, BOTH, 0.2, 0.4, 1, "80,40,50/100,50,60",
         QUICK(BF16, BNHD)),
    /* Empty sequences among them: without queries (their keys, kept by no query block, get dK = dV = 0) and
     * without any token. */
    LROW("varlen-empty-small", ALL, 0, 2, 0, 0, 0, 64, 64, 32, ALL_DT, BOTH, 0.2, 0.5, 0, "0,90,0,70/0,130,40,70",
         QUICK(F32, BNHD)),
    LROW("varlen-empty-causal-gqa-small", ALL, 0, 4, 2, 0, 0, 64, 64, 32, ALL_DT, BOTH, 0.2, 0.4, 1,
         "0,80,0,50/30,100,0,60", QUICK(BF16, BHND)),
    LROW("varlen-empty", ALL, 0, 2, 0, 0, 0, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 0, "0,200,0,131/0,333,64,131",
         QUICK(F16, BHND)),

    /* The full grid: several B·H, ragged tails, Nq ≠ Nk, D from 32 to 256, masked and dense. */
    PAIR("one-tile", ALL, 1, 1, 128, 128, 64, 128, 64, ALL_DT, BOTH, NULL, 0),
    PAIR("b2h3", ALL, 2, 3, 300, 300, 64, 128, 64, ALL_DT, BOTH, NULL, 0),
    PAIR("long", ALL, 1, 2, 1000, 700, 128, 128, 64, ALL_DT, BOTH, NULL, 0),
    PAIR("short-q", ALL, 2, 1, 77, 200, 128, 128, 128, ALL_DT, BOTH, NULL, 0),
    PAIR("bk128-d128", ALL, 1, 2, 520, 390, 128, 128, 128, ALL_DT, BOTH, NULL, 0),
    PAIR("d32", ALL, 1, 3, 260, 190, 32, 64, 32, ALL_DT, BOTH, NULL, 0),
    PAIR("d256", ALL, 1, 1, 150, 333, 256, 128, 64, ALL_DT, BOTH, NULL, 0),
    PAIR("b3h2", ALL, 3, 2, 129, 65, 64, 128, 64, ALL_DT, BOTH, NULL, 0),
    PAIR("bk128-d64", ALL, 2, 1, 200, 270, 64, 128, 128, ALL_DT, BOTH, NULL, 0),
    ROW("d96-dense", FB, 1, 2, 200, 333, 96, 128, 64, ALL_DT, BOTH, 0.0, 0.0, NULL, 0),
    /* head dims the tensor-core tier pads to 64 or 128 (zero columns past D), and 256 */
    PAIR("tc-d32", ALL, 1, 2, 300, 270, 32, 128, 64, F16 | BF16, BOTH, NULL, 0),
    PAIR("tc-d72", ALL, 2, 1, 260, 333, 72, 128, 64, F16 | BF16, BNHD, NULL, QUICK(BF16, BNHD)),
    PAIR("tc-d80", ALL, 1, 2, 200, 190, 80, 128, 128, F16 | BF16, BHND, NULL, 0),
    PAIR("tc-d256", ALL, 1, 2, 300, 270, 256, 128, 64, F16 | BF16, BOTH, NULL, QUICK(F16, BHND)),
    /* small blocks and the grad mode's sizes at D = 96 and 256 */
    PAIR("small-d256", ALL, 1, 1, 40, 70, 256, 16, 16, ALL_DT, BHND, NULL, 0),
    PAIR("small-d96", ALL, 2, 1, 100, 90, 96, 32, 32, ALL_DT, BNHD, NULL, 0),
    /* the other selection arms through the attention: Top-p alone, the paper's hybrid */
    ROW("topp", ALL, 1, 2, 520, 390, 64, 128, 64, F32 | BF16, BHND, 0.0, 0.4, NULL, 0),
    ROW("paper", ALL, 2, 2, 640, 640, 128, 128, 64, F16 | BF16, BNHD, 0.03, 0.2, NULL, 0),

    /* strict=on: the device's first tier alone. On a chained device ("cuda:0") the calls its first tier cannot
     * run (f32, D = 136) must be refused cleanly; elsewhere the cases run as usual. */
    ROW("strict", ALL, 1, 2, 300, 300, 64, 128, 64, ALL_DT, BHND, 0.1, 0.5, "strict=on", 0),
    ROW("strict-d136", ALL, 1, 1, 128, 200, 136, 128, 64, BF16, BHND, 0.1, 0.5, "strict=on", 0),

    /* the cpu tier's SIMD kernels below the widest (a tier the CPU cannot run falls back to the widest it can) */
    PAIR("simd-generic", ALL, 1, 2, 300, 270, 64, 128, 64, ALL_DT, BNHD, "simd=generic", 0),
    ROW("simd-generic-d96", ALL, 1, 2, 200, 333, 96, 64, 32, ALL_DT, BHND, 0.1, 0.5, "simd=generic", 0),
    PAIR("simd-avx2", ALL, 1, 2, 300, 270, 64, 128, 64, ALL_DT, BNHD, "simd=avx2", 0),

    /* The cuda tier's kernel variants. The forward's launch order: as stored (natural) and each head's rows
     * heaviest first (head), the latter also at 360 query blocks of 60 per head (more rows than CTAs resident,
     * several 32-row sorting rounds per head, several waves); an order that drops or repeats a work item leaves
     * poisoned rows. */
    TC_SHAPES("fwd-natural", ALL, "fwd_order=natural"),
    PAIR("fwd-natural-1000", ALL, 1, 2, 1000, 700, 128, 128, 64, F16 | BF16, BHND, "fwd_order=natural", 0),
    ROW("many-rows", FWD, 2, 3, 128 * 60 - 5, 64 * 6 + 9, 128, 128, 64, BF16, BOTH, 0.1, 0.6, "fwd_order=head", 0),
    ROW("many-rows-dense", FWD, 2, 3, 128 * 60 - 5, 64 * 6 + 9, 128, 128, 64, BF16, BOTH, 0.0, 0.0,
        "fwd_order=head", 0),
    ROW("many-rows-natural", FWD, 2, 3, 128 * 60 - 5, 64 * 6 + 9, 128, 128, 64, BF16, BHND, 0.1, 0.6,
        "fwd_order=natural", 0),
    /* forward kernels and mma.sync tiles */
    TC_SHAPES("fwd-mma", FWD, "fwd_kernel=mma"),
    TC_SHAPES("fwd-wgmma", FWD, "fwd_kernel=wgmma"),
    TC_SHAPES("fwd-tile-4x3", FWD, "fwd_kernel=mma fwd_tile=4,3"),
    TC_SHAPES("fwd-tile-8x2-split", FWD, "fwd_kernel=mma fwd_tile=8,2,1"),
    PAIR("fwd-mma-d96", FWD, 1, 2, 300, 333, 96, 128, 64, F16 | BF16, BOTH, "fwd_kernel=mma", 0),
    PAIR("fwd-wgmma-d96", FWD, 1, 2, 300, 333, 96, 128, 64, F16 | BF16, BOTH, "fwd_kernel=wgmma", 0),
    PAIR("fwd-wgmma-d40", FWD, 2, 1, 200, 270, 40, 128, 128, F16 | BF16, BNHD, "fwd_kernel=wgmma", 0),
    PAIR("fwd-mma-d256", FWD, 1, 2, 300, 270, 256, 128, 64, F16 | BF16, BHND, "fwd_kernel=mma", 0),
    /* the warp-specialized wgmma forward: the shapes above, rows long enough to wrap its 4-stage ring many times
     * (32 tiles) and with more rows than CTAs resident, causal (dense: the tile count cut at the diagonal), packed
     * sequences (some empty: rows without tiles) and grouped heads */
    TC_SHAPES("fwd-wgmma-ws", FWD, "fwd_kernel=wgmma-ws"),
    PAIR("fwd-wgmma-ws-d96", FWD, 1, 2, 300, 333, 96, 128, 64, F16 | BF16, BOTH, "fwd_kernel=wgmma-ws", 0),
    PAIR("fwd-wgmma-ws-d40", FWD, 2, 1, 200, 270, 40, 128, 128, F16 | BF16, BNHD, "fwd_kernel=wgmma-ws", 0),
    PAIR("fwd-wgmma-ws-long", FWD, 1, 2, 300, 2048, 128, 128, 64, F16 | BF16, BHND, "fwd_kernel=wgmma-ws", 0),
    /* rows of one and two key tiles: the producer's signals after its loop alone */
    PAIR("fwd-wgmma-ws-1tile", FWD, 1, 2, 150, 50, 128, 128, 64, F16 | BF16, BHND, "fwd_kernel=wgmma-ws", 0),
    PAIR("fwd-wgmma-ws-2tiles", FWD, 1, 2, 150, 120, 64, 128, 64, F16 | BF16, BNHD, "fwd_kernel=wgmma-ws", 0),
    ROW("fwd-wgmma-ws-many-rows", FWD, 2, 3, 128 * 60 - 5, 64 * 6 + 9, 64, 128, 64, BF16, BOTH, 0.1, 0.6,
        "fwd_kernel=wgmma-ws", 0),
    LROW_OPTS("fwd-wgmma-ws-causal-dense", FWD, 1, 2, 0, 390, 520, 128, 128, 64, F16 | BF16, BHND, 0.0, 0.0, 1, NULL,
              "fwd_kernel=wgmma-ws"),
    LROW_OPTS("fwd-wgmma-ws-causal-gqa-d128", FWD, 1, 4, 2, 260, 260, 128, 128, 128, F16 | BF16, BNHD, 0.1, 0.5, 1,
              NULL, "fwd_kernel=wgmma-ws"),
    LROW_OPTS("fwd-wgmma-ws-varlen-causal-gqa", FWD, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BHND, 0.1, 0.5, 1,
              "200,129,40,300/260,129,64,300", "fwd_kernel=wgmma-ws"),
    LROW_OPTS("fwd-wgmma-ws-varlen-mqa-d128", FWD, 0, 3, 1, 0, 0, 128, 128, 128, F16 | BF16, BOTH, 0.2, 0.5, 0,
              "90,300,50/150,260,120", "fwd_kernel=wgmma-ws"),
    LROW_OPTS("fwd-wgmma-ws-varlen-empty", FWD, 0, 2, 0, 0, 0, 64, 128, 64, F16 | BF16, BNHD, 0.1, 0.5, 1,
              "0,200,0,131/0,333,64,131", "fwd_kernel=wgmma-ws"),
    LROW_OPTS("fwd-wgmma-ws-causal-mqa", FWD, 1, 4, 1, 260, 260, 128, 128, 128, F16 | BF16, BNHD, 0.1, 0.5, 1, NULL,
              "fwd_kernel=wgmma-ws"),
    LROW_OPTS("fwd-wgmma-ws-varlen-empty-d128", FWD, 0, 2, 0, 0, 0, 128, 128, 128, F16 | BF16, BNHD, 0.1, 0.5, 1,
              "0,200,0,131/0,333,64,131", "fwd_kernel=wgmma-ws"),
    /* backward kernels, keys per CTA, dQ by a pass or by atomics, the dK/dV pass's overlap */
    TC_SHAPES("bwd-mma", BWD, "bwd_kernel=mma"),
    TC_SHAPES("bwd-wgmma", BWD, "bwd_kernel=wgmma"),
    PAIR("bwd-mma-d72", BWD, 2, 1, 260, 333, 72, 128, 64, F16 | BF16, BNHD, "bwd_kernel=mma", 0),
    PAIR("bwd-wgmma-d40", BWD, 1, 2, 200, 270, 40, 128, 128, F16 | BF16, BHND, "bwd_kernel=wgmma", 0),
    TC_SHAPES("bwd-keys-64", BWD, "bwd_kernel=wgmma bwd_keys=64"),
    TC_SHAPES("bwd-keys-128", BWD, "bwd_kernel=wgmma bwd_keys=128"),
    TC_SHAPES("dq-pass", BWD, "dq=pass"),
    TC_SHAPES("dq-atomic", BWD, "dq=atomic"),
    TC_SHAPES("bwd-no-overlap", BWD, "bwd_overlap=off"),
    /* grouped heads, causal masks and packed sequences on each backward kernel, dQ by a pass and by atomics */
    LROW_OPTS("bwd-mma-varlen-causal-gqa", BWD, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BHND, 0.1, 0.5, 1,
              "200,129,40,300/260,129,64,300", "bwd_kernel=mma"),
    LROW_OPTS("bwd-wgmma-varlen-causal-gqa-atomic", BWD, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BNHD, 0.1, 0.5, 1,
              "200,129,40,300/260,129,64,300", "bwd_kernel=wgmma dq=atomic"),
    LROW_OPTS("bwd-wgmma-causal-dense-wide", BWD, 1, 2, 0, 390, 520, 128, 128, 64, F16 | BF16, BHND, 0.0, 0.0, 1, NULL,
              "bwd_kernel=wgmma bwd_keys=128"),
    LROW_OPTS("bwd-wgmma-varlen-d128-bk128", BWD, 0, 3, 1, 0, 0, 128, 128, 128, F16 | BF16, BHND, 0.2, 0.5, 0,
              "90,300,50/150,260,120", "bwd_kernel=wgmma bwd_keys=128"),
    /* the wgmma dQ pass on causal masks and packed sequences: masked causal with Nq < Nk, bk 64 and 128 (grouped
     * heads); dense causal with Nq < Nk (rows cut at their last diagonal) on both dK/dV widths; packed sequences
     * with empty ones (first, between, last: query blocks past their sequence still write their padded rows and
     * count themselves) and one shorter than a block, causal with grouped heads, bk 64 and 128, without the
     * overlap */
    LROW_OPTS("bwd-wgmma-dq-pass-causal", BWD, 1, 2, 0, 200, 333, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 1, NULL,
              "bwd_kernel=wgmma dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-causal-gqa-bk128", BWD, 1, 4, 2, 260, 330, 128, 128, 128, F16 | BF16, BNHD, 0.1,
              0.5, 1, NULL, "bwd_kernel=wgmma dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-causal-dense", BWD, 2, 2, 0, 390, 520, 128, 128, 64, F16 | BF16, BHND, 0.0, 0.0, 1,
              NULL, "bwd_kernel=wgmma bwd_keys=64 dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-causal-dense-wide", BWD, 1, 2, 0, 200, 333, 64, 128, 64, F16 | BF16, BNHD, 0.0, 0.0,
              1, NULL, "bwd_kernel=wgmma bwd_keys=128 dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-varlen-empty", BWD, 0, 2, 0, 0, 0, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 0,
              "0,200,0,131,40/0,333,64,131,50", "bwd_kernel=wgmma dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-varlen-empty-last-mqa", BWD, 0, 3, 1, 0, 0, 128, 128, 128, F16 | BF16, BNHD, 0.2, 0.5,
              0, "131,0,260,0/190,50,260,70", "bwd_kernel=wgmma dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-varlen-causal-gqa", BWD, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BNHD, 0.1, 0.5, 1,
              "200,129,40,300/260,129,64,300", "bwd_kernel=wgmma dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-varlen-causal-gqa-bk128", BWD, 0, 4, 2, 0, 0, 128, 128, 128, F16 | BF16, BHND, 0.2,
              0.5, 1, "0,200,40,0,129/40,260,64,0,200", "bwd_kernel=wgmma dq=pass"),
    LROW_OPTS("bwd-wgmma-dq-pass-varlen-causal-no-overlap", BWD, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BHND, 0.1,
              0.5, 1, "0,200,0,131,40/0,333,64,131,50", "bwd_kernel=wgmma dq=pass bwd_overlap=off"),
    /* the warp-specialized dK/dV kernel where it runs (dense and bk = 128 masks, 128 keys a CTA; bk = 64 masks run
     * wgmma): more query steps than ring stages, ragged keys, D padded, causal masks and packed sequences with grouped
     * heads, dQ by atomics and by the pass (the dK/dV pass as its dependent, and without the overlap) */
    TC_SHAPES("bwd-wgmma-ws", BWD, "bwd_kernel=wgmma-ws"),
    PAIR("bwd-wgmma-ws-d40", BWD, 1, 2, 200, 270, 40, 128, 128, F16 | BF16, BHND, "bwd_kernel=wgmma-ws", 0),
    PAIR("bwd-wgmma-ws-long", BWD, 1, 2, 2048, 300, 128, 128, 128, BF16, BNHD, "bwd_kernel=wgmma-ws", 0),
    LROW_OPTS("bwd-wgmma-ws-causal-dense", BWD, 1, 2, 0, 390, 520, 128, 128, 64, F16 | BF16, BHND, 0.0, 0.0, 1, NULL,
              "bwd_kernel=wgmma-ws"),
    LROW_OPTS("bwd-wgmma-ws-causal-gqa-bk128", BWD, 1, 4, 2, 260, 330, 128, 128, 128, F16 | BF16, BNHD, 0.1, 0.5, 1,
              NULL, "bwd_kernel=wgmma-ws"),
    LROW_OPTS("bwd-wgmma-ws-varlen-d128-bk128", BWD, 0, 3, 1, 0, 0, 128, 128, 128, F16 | BF16, BHND, 0.2, 0.5, 0,
              "90,300,50/150,260,120", "bwd_kernel=wgmma-ws"),
    LROW_OPTS("bwd-wgmma-ws-dq-pass-causal-dense", BWD, 1, 2, 0, 200, 333, 64, 128, 64, F16 | BF16, BNHD, 0.0, 0.0, 1,
              NULL, "bwd_kernel=wgmma-ws dq=pass"),
    LROW_OPTS("bwd-wgmma-ws-dq-pass-varlen-causal-gqa-bk128", BWD, 0, 4, 2, 0, 0, 128, 128, 128, F16 | BF16, BHND, 0.2,
              0.5, 1, "0,200,40,0,129/40,260,64,0,200", "bwd_kernel=wgmma-ws dq=pass"),
    LROW_OPTS("bwd-wgmma-ws-dq-pass-no-overlap", BWD, 1, 2, 0, 390, 520, 128, 128, 128, F16 | BF16, BHND, 0.1, 0.5, 0,
              NULL, "bwd_kernel=wgmma-ws dq=pass bwd_overlap=off"),
    /* The pooled map's logits kernels: fp32 tiles of 128x64 and 64x64, f16x3 on tensor cores (the "cuda" tier
     * only: elsewhere a clean refusal), D a multiple of 16 and not. */
    ROW("map-128x64", MASK, 1, 3, 1000, 1000, 128, 128, 64, F32 | BF16, BOTH, 0.03, 0.2, "map_tile=128x64", 0),
    ROW("map-128x64-d36", MASK, 1, 3, 1000, 1000, 36, 128, 64, F32, BOTH, 0.03, 0.2, "map_tile=128x64", 0),
    ROW("map-64x64", MASK, 1, 3, 1000, 1000, 128, 128, 64, F32 | BF16, BOTH, 0.03, 0.2, "map_tile=64x64", 0),
    ROW("map-64x64-d36", MASK, 1, 3, 1000, 1000, 36, 128, 64, F32, BOTH, 0.03, 0.2, "map_tile=64x64", 0),
    ROW("map-f16x3", MASK, 1, 3, 1000, 1000, 128, 128, 64, F32 | BF16, BOTH, 0.03, 0.2, "map_tile=f16x3", 0),
    ROW("map-f16x3-d36", MASK, 1, 3, 1000, 1000, 36, 128, 64, F32, BOTH, 0.03, 0.2, "map_tile=f16x3", 0),

    /* Grouped K/V heads: GQA 4/2 and MQA 4/1 at the tensor-core shapes, masked and dense (f32: the small rows). */
    LPAIR("gqa", ALL, 2, 4, 2, 300, 300, 64, 128, 64, F16 | BF16, BOTH, 0, 0, 0),
    LPAIR("mqa-d128", ALL, 1, 4, 1, 260, 390, 128, 128, 128, F16 | BF16, BOTH, 0, 0, 0),
    /* Block-causal: Nq = Nk ragged, Nq < Nk (bottom-right), bq < bk (several query blocks on one diagonal key
     * block) and bq > bk (several diagonal key blocks per row), D 64 and 128, masked and dense, with grouped heads. */
    LPAIR("causal", ALL, 1, 2, 0, 300, 300, 64, 128, 64, F16 | BF16, BOTH, 1, 0, 0),
    LPAIR("causal-bottom-right", ALL, 1, 2, 0, 200, 333, 64, 128, 64, F16 | BF16, BOTH, 1, 0, 0),
    LROW("causal-64x128", ALL, 1, 2, 0, 260, 390, 64, 64, 128, F16 | BF16, BOTH, 0.1, 0.5, 1, NULL, 0),
    LPAIR("causal-d128", ALL, 2, 2, 0, 390, 520, 128, 128, 64, F16 | BF16, BHND, 1, 0, 0),
    LPAIR("causal-gqa-d128", ALL, 1, 4, 2, 260, 260, 128, 128, 128, F16 | BF16, BNHD, 1, 0, 0),
    /* Packed sequences (one shorter than a block): Q and K alike, K's own lengths with MQA at D = 128, causal with
     * GQA, and causal with MQA at D = 96 (the tensor-core tier's refusal, the next tier's run). */
    LROW("varlen", ALL, 0, 2, 0, 0, 0, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 0, "100,257,40,190", 0),
    LROW("varlen-qk-mqa", ALL, 0, 3, 1, 0, 0, 128, 128, 128, F16 | BF16, BOTH, 0.2, 0.5, 0, "90,300,50/150,260,120",
         0),
    LROW("varlen-causal-gqa", ALL, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 1,
         "200,129,40,300/260,129,64,300", 0),
    LROW("varlen-causal-d96", ALL, 0, 2, 1, 0, 0, 96, 128, 64, ALL_DT, BHND, 0.1, 0.5, 1, "100,257,40,190", 0),
    /* Edges of these layouts: sequences of one token (alone in their blocks, causal with one key or a few), blocks
     * longer than every sequence (one block per row, causal rows that are all diagonal) with one K/V head, and the
     * selection arms on causal rows (Top-p = 1 keeps every allowed block, Top-k alone). */
    LROW("varlen-one-token", ALL, 0, 4, 1, 0, 0, 32, 64, 32, ALL_DT, BOTH, 0.2, 0.5, 1, "1,100,1,64/1,130,5,64", 0),
    LROW("varlen-big-blocks", ALL, 0, 2, 2, 0, 0, 64, 256, 128, F32 | BF16, BHND, 0.3, 0.3, 0, "3,200,1/50,7,2", 0),
    /* Empty sequences first, between and last: without queries but with keys (which get dK = dV = 0), without any
     * token; causal, grouped heads, D = 128 with 128-key blocks, and D = 96 (the next tier) in every dtype. */
    LROW("varlen-empty-causal", ALL, 0, 2, 0, 0, 0, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 1,
         "0,200,0,131/0,333,64,131", 0),
    LROW("varlen-empty-last-gqa", ALL, 0, 4, 2, 0, 0, 128, 128, 128, F16 | BF16, BOTH, 0.2, 0.5, 0,
         "131,0,260,0/190,50,260,70", 0),
    LROW("varlen-empty-causal-mqa-last", ALL, 0, 4, 1, 0, 0, 64, 128, 64, F16 | BF16, BNHD, 0.1, 0.5, 1,
         "200,0,129,0/260,0,129,0", 0),
    LROW("varlen-empty-d96", ALL, 0, 2, 1, 0, 0, 96, 128, 64, ALL_DT, BHND, 0.1, 0.5, 1, "0,200,0,131/0,333,64,131",
         0),
    LPAIR("causal-mqa-big-blocks", ALL, 2, 3, 1, 90, 200, 64, 256, 512, F32 | BF16, BNHD, 1, 0, 0),
    LROW("causal-topp1", ALL, 1, 4, 2, 150, 260, 64, 64, 32, F32 | BF16, BHND, 0.0, 1.0, 1, NULL, 0),
    LROW("causal-topk", ALL, 2, 2, 1, 190, 190, 64, 32, 64, F32 | F16, BNHD, 0.3, 0.0, 1, NULL, 0),
    /* strict=on: a chained device whose first tier does not take these must refuse them cleanly */
    {"strict-causal-gqa", ALL, 1, 4, 300, 300, 64, 128, 64, BF16, BHND, 0.1, 0.5, 0.0, "strict=on", 0, 2, 1, NULL},
    /* the tensor-core backwards of these (staged copies for grouped heads and padded head dims, the mma.sync
     * kernels' token mask for causal and sequence frames for varlen) */
    LROW("tc-gqa", BWD, 2, 4, 2, 300, 300, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 0, NULL, QUICK(BF16, BHND)),
    LROW("tc-gqa-d72", BWD, 1, 6, 2, 260, 333, 72, 128, 128, F16 | BF16, BNHD, 0.1, 0.5, 0, NULL, 0),
    LROW("tc-mqa-dense", BWD, 1, 4, 1, 390, 300, 128, 128, 64, F16 | BF16, BHND, 0.0, 0.0, 0, NULL, 0),
    LROW("tc-causal", BWD, 1, 2, 0, 200, 333, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 1, NULL, QUICK(F16, BNHD)),
    LROW("tc-causal-dense", BWD, 2, 2, 0, 390, 520, 128, 128, 64, F16 | BF16, BHND, 0.0, 0.0, 1, NULL, 0),
    LROW("tc-causal-gqa-d128", BWD, 1, 4, 2, 260, 260, 128, 128, 128, F16 | BF16, BNHD, 0.1, 0.5, 1, NULL, 0),
    LROW("tc-varlen-causal-gqa", BWD, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 1,
         "200,129,40,300/260,129,64,300", QUICK(BF16, BNHD)),
    LROW("tc-varlen-qk-mqa", BWD, 0, 3, 1, 0, 0, 128, 128, 128, F16 | BF16, BOTH, 0.2, 0.5, 0, "90,300,50/150,260,120",
         0),
    LROW("tc-varlen-d72", ALL, 0, 2, 0, 0, 0, 72, 128, 64, F16 | BF16, BNHD, 0.1, 0.5, 0, "100,257,40,190",
         QUICK(F16, BNHD)),
    /* D = 256 with grouped heads, causal and packed sequences */
    LPAIR("tc-causal-gqa-d256", ALL, 1, 4, 2, 260, 333, 256, 128, 64, F16 | BF16, BNHD, 1, 0, 0),
    LROW("tc-varlen-causal-mqa-d256", ALL, 0, 3, 1, 0, 0, 256, 128, 64, F16 | BF16, BHND, 0.1, 0.5, 1,
         "200,129,40/260,129,64", 0),
    /* The D = 256 backward (64 keys per dK/dV CTA, halves of 128-key blocks; the dQ pass in 32-key steps): 128-key
     * blocks with a ragged last half and with a last half wholly past Nk, Nq > Nk, dQ by the pass and by atomics,
     * causal dense and masked with grouped heads, packed sequences with one shorter than a block and empty ones, and
     * the wgmma kernels' refusal. */
    PAIR("tc-d256-bk128", BWD, 1, 2, 330, 200, 256, 128, 128, F16 | BF16, BHND, NULL, 0),
    PAIR("tc-d256-bk128-dq-pass", BWD, 2, 1, 200, 330, 256, 128, 128, F16 | BF16, BNHD, "dq=pass", 0),
    PAIR("tc-d256-bk128-half-past", BWD, 1, 2, 257, 150, 256, 128, 128, F16 | BF16, BHND, NULL, 0),
    PAIR("tc-d256-dq-atomic", BWD, 1, 2, 260, 200, 256, 128, 64, F16 | BF16, BHND, "dq=atomic", 0),
    LROW_OPTS("tc-causal-d256-dq-pass", BWD, 1, 2, 0, 200, 333, 256, 128, 64, F16 | BF16, BHND, 0.0, 0.0, 1, NULL,
              "dq=pass"),
    LROW("tc-causal-gqa-d256-bk128", BWD, 1, 4, 2, 260, 330, 256, 128, 128, F16 | BF16, BHND, 0.1, 0.5, 1, NULL, 0),
    LROW("tc-varlen-causal-gqa-d256-bk128", BWD, 0, 4, 2, 0, 0, 256, 128, 128, F16 | BF16, BNHD, 0.2, 0.5, 1,
         "0,200,40,0,129/40,260,64,0,200", 0),
    LROW("tc-varlen-gqa-d256", BWD, 0, 4, 2, 0, 0, 256, 128, 64, F16 | BF16, BHND, 0.2, 0.5, 0, "90,200,40/150,70,200",
         0),
    LROW_OPTS("tc-varlen-gqa-d256-dq-pass", BWD, 0, 4, 2, 0, 0, 256, 128, 64, F16 | BF16, BHND, 0.2, 0.5, 0,
              "90,200,40/150,70,200", "dq=pass"),
    PAIR("bwd-wgmma-d256", BWD, 1, 1, 150, 200, 256, 128, 64, F16 | BF16, BHND, "bwd_kernel=wgmma", 0),
    LROW("tc-varlen-empty-causal-gqa", BWD, 0, 4, 2, 0, 0, 64, 128, 64, F16 | BF16, BOTH, 0.1, 0.5, 1,
         "0,200,0,131,0/0,333,64,131,40", QUICK(BF16, BHND)),
    LROW("tc-varlen-empty-last", ALL, 0, 2, 0, 0, 0, 128, 128, 128, F16 | BF16, BHND, 0.2, 0.5, 0,
         "131,0,260,0/190,50,260,70", 0),
    LROW("tc-causal-d40", ALL, 1, 2, 1, 300, 300, 40, 128, 64, F16 | BF16, BHND, 0.1, 0.5, 1, NULL, 0),
};
enum { ROWS = sizeof rows / sizeof rows[0] };

static check_case table[ROWS * 6];
static int table_len = -1;

/* Parses a comma-separated list of sequence lengths (0 allowed: an empty sequence) into cu (offsets from 0); returns
 * the count, or 0 if malformed or longer than CHECK_MAX_SEQ. *end points past the list. */
static int parse_lengths(const char *s, int32_t *cu, const char **end)
{
    int n = 0;
    cu[0] = 0;
    for (;;) {
        char *e;
        const long v = strtol(s, &e, 10);
        if (e == s || v < 0 || n == CHECK_MAX_SEQ)
            return 0;
        cu[n + 1] = cu[n] + (int32_t)v;
        n++;
        s = e;
        if (*s != ',')
            break;
        s++;
    }
    *end = s;
    return n;
}

/* A row's varlen sequences into c (B, Nq, Nk the count and totals). 0 if malformed. */
static int expand_seqs(const row *w, check_case *c)
{
    const char *end;
    c->nseq = parse_lengths(w->seqs, c->cu_q, &end);
    if (!c->nseq)
        return 0;
    if (*end == '/') {
        if (parse_lengths(end + 1, c->cu_k, &end) != c->nseq)
            return 0;
    } else {
        memcpy(c->cu_k, c->cu_q, sizeof c->cu_q);
    }
    c->B = c->nseq, c->Nq = c->cu_q[c->nseq], c->Nk = c->cu_k[c->nseq];
    return *end == 0;
}

static void expand_table(void)
{
    if (table_len >= 0)
        return;
    table_len = 0;
    for (int r = 0; r < ROWS; r++)
        for (int dt = 0; dt < 3; dt++)
            for (int lay = 0; lay < 2; lay++) {
                const row *w = &rows[r];
                if (!(w->dtypes & (1u << dt)) || !(w->layouts & (1u << lay)))
                    continue;
                check_case *c = &table[table_len++];
                memset(c, 0, sizeof *c);
                snprintf(c->name, sizeof c->name, "%s/%s/%s", w->label, sparge_dtype_name((sparge_dtype)dt),
                         lay ? "bnhd" : "bhnd");
                c->ops = w->ops;
                c->B = w->B, c->H = w->H, c->Nq = w->Nq, c->Nk = w->Nk, c->D = w->D;
                c->bq = w->bq, c->bk = w->bk;
                c->dtype = (sparge_dtype)dt;
                c->layout = (check_layout)lay;
                c->topk = w->topk, c->topp = w->topp;
                c->tol = w->tol;
                c->options = w->options;
                c->quick = w->quick == 1 ||
                           ((w->quick & 2) && (w->quick >> 2 & (1 << dt)) && (w->quick >> 5 & (1 << lay)));
                c->kv_heads = w->kv_heads == w->H ? 0 : w->kv_heads;
                c->causal = w->causal;
                if (w->seqs && !expand_seqs(w, c)) { /* a mistake in the table: the case fails at once */
                    c->B = 0;
                    c->nseq = 0;
                }
            }
}

int check_case_count(void)
{
    expand_table();
    return table_len;
}

const check_case *check_case_get(int i)
{
    expand_table();
    return i >= 0 && i < table_len ? &table[i] : NULL;
}

static int is_dense(const check_case *c) { return c->topk == 0.0 && c->topp == 0.0; }
static double tolerance(const check_case *c) { return c->tol > 0.0 ? c->tol : sparge_dtype_tolerance(c->dtype); }
static int64_t hkv(const check_case *c) { return c->kv_heads > 0 ? c->kv_heads : c->H; }
/* The tensors' batch: one packed batch when varlen. */
static int64_t tbatch(const check_case *c) { return c->nseq ? 1 : c->B; }

/* Sequence b: its first query and key tokens in the tensors' N and its lengths (fixed length: batch b). */
static void seq_of(const check_case *c, int64_t b, int64_t *q0, int64_t *nq, int64_t *k0, int64_t *nk)
{
    if (c->nseq) {
        *q0 = c->cu_q[b], *nq = c->cu_q[b + 1] - c->cu_q[b];
        *k0 = c->cu_k[b], *nk = c->cu_k[b + 1] - c->cu_k[b];
    } else {
        *q0 = *k0 = 0, *nq = c->Nq, *nk = c->Nk;
    }
}

/* The longest sequence's tokens (fixed length: Nq, Nk): what the mask's rows are laid out for. */
static int64_t longest(const check_case *c, int keys)
{
    int64_t n = 0, q0, nq, k0, nk;
    for (int64_t b = 0; b < (c->nseq ? c->nseq : 1); b++) {
        seq_of(c, b, &q0, &nq, &k0, &nk);
        n = (keys ? nk : nq) > n ? (keys ? nk : nq) : n;
    }
    return n;
}

/* The mask's query and key blocks per row and column (varlen: the longest sequence's). */
static int64_t nqb(const check_case *c) { return (longest(c, 0) + c->bq - 1) / c->bq; }
static int64_t nkb(const check_case *c) { return (longest(c, 1) + c->bk - 1) / c->bk; }

/* The row rule, written here from its definition (sparge.h, sparge_mask_layout): query block i of sequence b may
 * attend key blocks [0, *allowed); causal, bottom-right aligned: the key blocks holding key t + nk − nq for one of
 * its queries t, *d0..*d1, are always kept and none after them is allowed. 0 for a row past its sequence's query
 * blocks (it keeps nothing). */
static int row_rule(const check_case *c, int64_t b, int64_t i, int64_t *allowed, int64_t *d0, int64_t *d1)
{
    int64_t q0, nq, k0, nk;
    seq_of(c, b, &q0, &nq, &k0, &nk);
    *d0 = 1, *d1 = 0, *allowed = (nk + c->bk - 1) / c->bk;
    if (i * c->bq >= nq)
        return 0;
    if (c->causal) {
        const int64_t first = i * c->bq, last = (first + c->bq < nq ? first + c->bq : nq) - 1;
        *d0 = (first + nk - nq) / c->bk;
        *d1 = (last + nk - nq) / c->bk;
        *allowed = *d1 + 1;
    }
    return 1;
}

/* sparge_mask_create_ex's layout of c (cu_seqlens point into c). */
static sparge_mask_layout layout_of(const check_case *c)
{
    return (sparge_mask_layout){.B = c->B, .H = c->H, .Nq = c->Nq, .Nk = c->Nk, .block_q = c->bq, .block_k = c->bk,
                                .causal = c->causal, .cu_seqlens_q = c->nseq ? c->cu_q : NULL,
                                .cu_seqlens_k = c->nseq ? c->cu_k : NULL};
}

static sparge_status create_mask(sparge_device *dev, const check_case *c, sparge_mask **m)
{
    const sparge_mask_layout l = layout_of(c);
    return sparge_mask_create_ex(dev, &l, m);
}

/* ---------------------------------------------------------------- random inputs */

/* splitmix64: the same stream on every platform */
typedef struct {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_normal(rng *r)
{
    const double u = (double)(rng_next(r) >> 11) * 0x1.0p-53, v = (double)(rng_next(r) >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

/* A case's seed: its name's FNV-1a hash, so its inputs do not depend on which other cases run. */
static uint64_t case_seed(const check_case *c)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = c->name; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    return h;
}

/* ---------------------------------------------------------------- the outcome of one (case, device) */

enum { MAX_MEASURES = 12 };

typedef struct {
    int failed;
    char fail[1024];    /* what failed */
    char refused[512];  /* the ops the device refused, and why */
    char notes[256];    /* other observations */
    char tiers[3][32];  /* the tier that ran the mask prediction, forward, backward ("" if not asked, "-" refused) */
    int measures;
    struct {
        const char *name;
        double worst;
    } measure[MAX_MEASURES]; /* the largest error of each quantity */
} outcome;

static void vappend(char *buf, size_t size, const char *fmt, va_list ap)
{
    size_t n = strlen(buf);
    if (n + 4 >= size)
        return;
    if (n)
        n += (size_t)snprintf(buf + n, size - n, "; ");
    vsnprintf(buf + n, size - n, fmt, ap);
}

#if defined(__GNUC__)
#define PRINTF_LIKE(i, j) __attribute__((format(printf, i, j)))
#else
#define PRINTF_LIKE(i, j)
#endif

static void failf(outcome *o, const char *fmt, ...) PRINTF_LIKE(2, 3);
static void failf(outcome *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vappend(o->fail, sizeof o->fail, fmt, ap);
    va_end(ap);
    o->failed = 1;
}

static void notef(outcome *o, const char *fmt, ...) PRINTF_LIKE(2, 3);
static void notef(outcome *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vappend(o->notes, sizeof o->notes, fmt, ap);
    va_end(ap);
}

/* Keeps the largest error e of quantity name (NaN sticks). */
static void measured(outcome *o, const char *name, double e)
{
    int i = 0;
    while (i < o->measures && strcmp(o->measure[i].name, name))
        i++;
    if (i == MAX_MEASURES)
        return;
    if (i == o->measures)
        o->measure[o->measures++].name = name, o->measure[i].worst = e;
    else if (!(o->measure[i].worst >= e))
        o->measure[i].worst = isnan(o->measure[i].worst) ? o->measure[i].worst : e;
}

/* 1 if s is SPARGE_OK, else records the failure of what. */
static int ok(outcome *o, const char *what, sparge_status s)
{
    if (s == SPARGE_OK)
        return 1;
    failf(o, "%s: %s: %s", what, sparge_status_name(s), sparge_last_error());
    return 0;
}

/* ---------------------------------------------------------------- tensors and their host images */

typedef struct {
    sparge_device *dev; /* NULL: not allocated */
    sparge_tensor t;
    size_t bytes;
} ctensor;

static sparge_tensor view(sparge_dtype dt, check_layout lay, int64_t B, int64_t H, int64_t N, int64_t D)
{
    return lay == CHECK_BNHD ? sparge_tensor_bnhd(NULL, dt, B, H, N, D) : sparge_tensor_bhnd(NULL, dt, B, H, N, D);
}

static int64_t numel(const sparge_tensor *t) { return t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]; }

/* Storage offset of logical element i of [B,H,N,D]. */
static int64_t offset_of(const sparge_tensor *t, int64_t i)
{
    const int64_t d = i % t->shape[3], n = i / t->shape[3] % t->shape[2],
                  h = i / (t->shape[3] * t->shape[2]) % t->shape[1], b = i / (t->shape[3] * t->shape[2] * t->shape[1]);
    return b * t->stride[0] + h * t->stride[1] + n * t->stride[2] + d * t->stride[3];
}

static double load(const void *img, sparge_dtype dt, int64_t off)
{
    switch (dt) {
    case SPARGE_F16: return sparge_f16_to_f32(((const uint16_t *)img)[off]);
    case SPARGE_BF16: return sparge_bf16_to_f32(((const uint16_t *)img)[off]);
    default: return ((const float *)img)[off];
    }
}

static void store(void *img, sparge_dtype dt, int64_t off, double v)
{
    switch (dt) {
    case SPARGE_F16: ((uint16_t *)img)[off] = sparge_f32_to_f16((float)v); break;
    case SPARGE_BF16: ((uint16_t *)img)[off] = sparge_f32_to_bf16((float)v); break;
    default: ((float *)img)[off] = (float)v;
    }
}

static size_t bytes_of(const sparge_tensor *t) { return (size_t)numel(t) * sparge_dtype_size(t->dtype); }

/* The logical values [B,H,N,D] of a storage image of t. */
static double *values_of(const sparge_tensor *t, const void *img)
{
    double *v = malloc((size_t)numel(t) * sizeof *v);
    if (v)
        for (int64_t i = 0; i < numel(t); i++)
            v[i] = load(img, t->dtype, offset_of(t, i));
    return v;
}

/* A storage image of t holding normal values rounded to its dtype, plus 0.8 on the tokens of key block `sink`
 * (−1: none) so that masks are not flat. */
static void *random_image(const sparge_tensor *t, rng *r, int64_t sink, int block)
{
    void *img = malloc(bytes_of(t));
    if (img)
        for (int64_t i = 0; i < numel(t); i++) {
            const int64_t n = i / t->shape[3] % t->shape[2];
            store(img, t->dtype, offset_of(t, i), rng_normal(r) + (n / block == sink ? 0.8 : 0.0));
        }
    return img;
}

static int ct_alloc(outcome *o, ctensor *x, sparge_device *dev, sparge_tensor shape)
{
    void *p = NULL;
    memset(x, 0, sizeof *x);
    if (!ok(o, "sparge_malloc", sparge_malloc(dev, bytes_of(&shape), &p)))
        return 0;
    x->dev = dev;
    x->t = shape;
    x->t.data = p;
    x->bytes = bytes_of(&shape);
    return 1;
}

static void ct_free(ctensor *x)
{
    if (x->dev)
        sparge_free(x->dev, x->t.data);
    memset(x, 0, sizeof *x);
}

static int ct_put(outcome *o, ctensor *x, const void *img)
{
    return ok(o, "sparge_memcpy_to_device", sparge_memcpy_to_device(x->dev, x->t.data, img, x->bytes));
}

/* x's storage, downloaded (malloc'd), or NULL with the failure recorded. */
static void *ct_image(outcome *o, const ctensor *x)
{
    void *img = malloc(x->bytes);
    if (!img)
        failf(o, "out of host memory");
    else if (!ok(o, "sparge_memcpy_to_host", sparge_memcpy_to_host(x->dev, img, x->t.data, x->bytes))) {
        free(img);
        img = NULL;
    }
    return img;
}

static double *ct_values(outcome *o, const ctensor *x)
{
    void *img = ct_image(o, x);
    double *v = img ? values_of(&x->t, img) : NULL;
    if (img && !v)
        failf(o, "out of host memory");
    free(img);
    return v;
}

/* 0xFF bytes: NaN in f32, f16 and bf16, so an element a kernel does not write fails the comparison. */
static int ct_poison(outcome *o, ctensor *x)
{
    return ok(o, "sparge_memset", sparge_memset(x->dev, x->t.data, 0xff, x->bytes));
}

/* 1 if x still holds the poison everywhere. */
static int ct_poisoned(outcome *o, const ctensor *x)
{
    unsigned char *img = ct_image(o, x);
    int all = img != NULL;
    for (size_t i = 0; all && i < x->bytes; i++)
        all = img[i] == 0xff;
    free(img);
    return all;
}

double check_rel_l2(const double *a, const double *ref, int64_t n)
{
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(ref[i]))
            return NAN;
        num += (a[i] - ref[i]) * (a[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

/* Compares got (the device's) with want (cpu-ref's): the error counts for quantity `name`, above tol it fails. */
static void compare(outcome *o, const char *what, const char *name, const ctensor *got, const ctensor *want,
                    double tol)
{
    double *g = ct_values(o, got), *w = g ? ct_values(o, want) : NULL;
    if (w) {
        const double e = check_rel_l2(g, w, numel(&got->t));
        measured(o, name, e);
        if (!(e <= tol))
            failf(o, "%s: relative L2 error %.3g > %.3g", what, e, tol);
    }
    free(g);
    free(w);
}

/* Every row of every tensor contiguous along D and 16-byte aligned (the condition of sparge_op_desc). */
static int rows_aligned(const sparge_tensor *t)
{
    const int64_t n = 16 / (int64_t)sparge_dtype_size(t->dtype);
    return t->stride[3] == 1 && (uintptr_t)t->data % 16 == 0 && t->stride[0] % n == 0 && t->stride[1] % n == 0 &&
           t->stride[2] % n == 0;
}

/* ---------------------------------------------------------------- masks */

/* A mask's selection on the host. */
typedef struct {
    int64_t BH, H, Nqb, Nkb;
    int varlen;
    uint8_t *dense;
    int32_t *cnt, *idx;   /* CSR */
    int32_t *tcnt, *tidx; /* the transpose, or NULL */
} mask_host;

static void mask_host_free(mask_host *h)
{
    free(h->dense);
    free(h->cnt);
    free(h->idx);
    free(h->tcnt);
    free(h->tidx);
    memset(h, 0, sizeof *h);
}

/* Downloads m's dense view and CSR, and its transpose if asked (which builds it if this selection has none). */
static int mask_fetch(outcome *o, const sparge_mask *m, mask_host *h, int transpose)
{
    sparge_mask_shape ms;
    memset(h, 0, sizeof *h);
    if (!ok(o, "sparge_mask_get_shape", sparge_mask_get_shape(m, &ms)))
        return 0;
    h->BH = ms.B * ms.H, h->H = ms.H, h->Nqb = ms.Nqb, h->Nkb = ms.Nkb, h->varlen = ms.varlen;
    const size_t cells = (size_t)(h->BH * h->Nqb * h->Nkb);
    h->dense = malloc(cells);
    h->cnt = malloc((size_t)(h->BH * h->Nqb) * sizeof(int32_t));
    h->idx = malloc(cells * sizeof(int32_t));
    if (transpose) {
        h->tcnt = malloc((size_t)(h->BH * h->Nkb) * sizeof(int32_t));
        h->tidx = malloc(cells * sizeof(int32_t));
    }
    if (!h->dense || !h->cnt || !h->idx || (transpose && (!h->tcnt || !h->tidx))) {
        failf(o, "out of host memory");
    } else if (ok(o, "sparge_mask_get_dense", sparge_mask_get_dense(m, h->dense)) &&
               ok(o, "sparge_mask_get_csr", sparge_mask_get_csr(m, h->cnt, h->idx, h->tcnt, h->tidx))) {
        return 1;
    }
    mask_host_free(h);
    return 0;
}

/* docs/DESIGN.md §2.2's invariants: every row keeps ≥ 1 block, the dense view holds 0 and 1, the CSR lists the
 * dense view's blocks ascending then −1, and the transpose lists exactly the kept pairs the same way. With the case
 * (lay, may be NULL) also its layout's: a row keeps its diagonal blocks and nothing after its allowed blocks, and a
 * row past its sequence keeps nothing (without the case, a varlen mask's rows may be empty). */
static void check_wellformed(outcome *o, const char *what, const mask_host *h, const check_case *lay)
{
    for (int64_t r = 0; r < h->BH * h->Nqb; r++) {
        const uint8_t *d = h->dense + r * h->Nkb;
        const int32_t *list = h->idx + r * h->Nkb;
        int64_t c = 0, allowed = h->Nkb, d0 = 1, d1 = 0;
        const int in_seq = lay ? row_rule(lay, r / (h->H * h->Nqb), r % h->Nqb, &allowed, &d0, &d1) : 1;
        if (!in_seq)
            allowed = 0;
        for (int64_t j = 0; j < h->Nkb; j++) {
            if (d[j] > 1) {
                failf(o, "%s: dense view holds %d at row %lld block %lld", what, d[j], (long long)r, (long long)j);
                return;
            }
            if (d[j] && j >= allowed) {
                failf(o, "%s: row %lld keeps block %lld, %s", what, (long long)r, (long long)j,
                      !in_seq ? "but the row lies past its sequence" : lay->causal ? "after its causal diagonal"
                                                                                   : "past its sequence's keys");
                return;
            }
            if (!d[j] && j >= d0 && j <= d1) {
                failf(o, "%s: row %lld drops block %lld, one of its diagonal blocks %lld..%lld", what, (long long)r,
                      (long long)j, (long long)d0, (long long)d1);
                return;
            }
            if (d[j] && list[c++] != j) {
                failf(o, "%s: row %lld: the CSR disagrees with the dense view at block %lld", what, (long long)r,
                      (long long)j);
                return;
            }
        }
        if (h->cnt[r] != c || (c < 1 && in_seq && !(h->varlen && !lay))) {
            failf(o, "%s: row %lld: count %d, the dense view keeps %lld", what, (long long)r, h->cnt[r], (long long)c);
            return;
        }
        for (; c < h->Nkb; c++)
            if (list[c] != -1) {
                failf(o, "%s: row %lld: CSR entry %lld past the count is %d, not -1", what, (long long)r, (long long)c,
                      list[c]);
                return;
            }
    }
    if (!h->tcnt)
        return;
    for (int64_t bh = 0; bh < h->BH; bh++)
        for (int64_t j = 0; j < h->Nkb; j++) {
            const int32_t *list = h->tidx + (bh * h->Nkb + j) * h->Nqb;
            int64_t c = 0;
            for (int64_t i = 0; i < h->Nqb; i++)
                if (h->dense[(bh * h->Nqb + i) * h->Nkb + j] && list[c++] != i) {
                    failf(o, "%s: transpose of head %lld key block %lld disagrees with the dense view", what,
                          (long long)bh, (long long)j);
                    return;
                }
            if (h->tcnt[bh * h->Nkb + j] != c) {
                failf(o, "%s: transpose count of head %lld key block %lld is %d, the dense view keeps %lld", what,
                      (long long)bh, (long long)j, h->tcnt[bh * h->Nkb + j], (long long)c);
                return;
            }
            for (; c < h->Nqb; c++)
                if (list[c] != -1) {
                    failf(o, "%s: transpose of head %lld key block %lld: entry %lld past the count is not -1", what,
                          (long long)bh, (long long)j, (long long)c);
                    return;
                }
        }
}

typedef struct {
    float v;
    int64_t j;
} ranked;

/* §1.5's order: descending value, equal values by lower index (NaN last, so that the order is total). */
static int by_rank(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (isnan(x->v) != isnan(y->v))
        return isnan(x->v) ? 1 : -1;
    if (x->v != y->v && !isnan(x->v))
        return x->v > y->v ? -1 : 1;
    return (x->j > y->j) - (x->j < y->j);
}

/* §1.6's Top-k count over n blocks. */
static int64_t topk_count(double k, int64_t n)
{
    if (!(k > 0.0))
        return 0;
    const int64_t c = (int64_t)floor(k * (double)n + 1e-6);
    return c < 1 ? 1 : c > n ? n : c;
}

/* docs/DESIGN.md §2.2: a row of the reference's map (its first n blocks: those the row may attend) whose selection
 * (kept blocks) was within rounding of going the other way: the kept-th and next ordered values within 1e-5
 * (relative), or a prefix sum within 1e-5 of p. kept < 0: the count Top-k ∪ Top-p selects with k and p on the
 * row, for a causal row whose kept blocks include diagonal blocks added after the selection. */
static int close_call(const float *map_row, int64_t n, double k, double p, int64_t kept)
{
    ranked *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
    if (!order || n <= 0) {
        free(order);
        return 0;
    }
    for (int64_t j = 0; j < n; j++)
        order[j] = (ranked){map_row[j], j};
    qsort(order, (size_t)n, sizeof *order, by_rank);
    if (kept < 0) {
        int64_t np = 0;
        if (p > 0.0) {
            double sum = 0.0;
            np = n;
            for (int64_t t = 0; t < n; t++)
                if ((sum += order[t].v) >= p) {
                    np = t + 1;
                    break;
                }
        }
        kept = topk_count(k, n);
        kept = kept > np ? kept : np;
        kept = kept > 1 ? kept : 1;
    }
    int close = 0;
    if (kept >= 1 && kept < n) {
        const double x = order[kept - 1].v, y = order[kept].v;
        close |= fabs(x - y) <= 1e-5 * fmax(fabs(x), fabs(y));
    }
    if (p > 0.0) {
        double sum = 0.0;
        for (int64_t t = 0; t < n; t++) {
            sum += order[t].v;
            close |= fabs(sum - p) <= 1e-5 * fmax(p, 1e-30);
        }
    }
    free(order);
    return close;
}

/* Compares the device's selection with cpu-ref's row by row. With map (cpu-ref's pooled map) a differing row is
 * accepted when it was a close call (counted in *close_rows); without, the selections must be identical. With the
 * case (lay, may be NULL) a row's call is judged over the blocks it may attend, and a causal row's at the count its
 * selection (k, p) made before its diagonal blocks were added. */
static void compare_selection(outcome *o, const char *what, const mask_host *got, const mask_host *want,
                              const float *map, double k, double p, int64_t *close_rows, const check_case *lay)
{
    for (int64_t r = 0; r < want->BH * want->Nqb; r++) {
        const uint8_t *g = got->dense + r * want->Nkb, *w = want->dense + r * want->Nkb;
        if (!memcmp(g, w, (size_t)want->Nkb))
            continue;
        int64_t kept = 0, n = want->Nkb, d0, d1;
        for (int64_t j = 0; j < want->Nkb; j++)
            kept += w[j];
        if (lay && !row_rule(lay, r / (want->H * want->Nqb), r % want->Nqb, &n, &d0, &d1))
            n = 0;
        if (lay && lay->causal)
            kept = -1;
        if (!map || !close_call(map + r * want->Nkb, n, k, p, kept)) {
            int64_t gk = 0;
            for (int64_t j = 0; j < want->Nkb; j++)
                gk += g[j];
            failf(o, "%s: row %lld keeps %lld blocks, cpu-ref %lld (or others)%s", what, (long long)r, (long long)gk,
                  (long long)kept, map ? ", and the decision was not close" : "");
            return;
        }
        ++*close_rows;
    }
}

int check_mask(const sparge_mask *m, const sparge_mask *want, const float *map, double p, int64_t *close_rows,
               char *msg, size_t msg_len)
{
    outcome o;
    mask_host got, ref;
    int64_t close = 0;
    memset(&o, 0, sizeof o);
    if (mask_fetch(&o, m, &got, 1)) {
        check_wellformed(&o, "mask", &got, NULL);
        if (want && !o.failed && mask_fetch(&o, want, &ref, 0)) {
            if (ref.BH != got.BH || ref.Nqb != got.Nqb || ref.Nkb != got.Nkb)
                failf(&o, "the masks have different shapes");
            else
                compare_selection(&o, "mask", &got, &ref, map, NAN, p, &close, NULL);
            mask_host_free(&ref);
        }
        mask_host_free(&got);
    }
    if (close_rows)
        *close_rows = close;
    snprintf(msg, msg_len, "%s", o.fail);
    return o.failed ? -1 : 0;
}

/* ---------------------------------------------------------------- one op on the device under test */

/* The device under test as one (case, device) sees it. */
typedef struct {
    sparge_device *dev;
    const char *first;   /* its first tier */
    int strict_case;     /* the case sets strict itself */
    const uint8_t *ones; /* a selection keeping every block the case's layout allows: the poison of a mask a call
                          * writes */
    int64_t cells;       /* its length */
} target;

/* The arguments of any op call. */
typedef struct {
    sparge_device *dev;
    const sparge_tensor *q, *k, *v, *o, *d_o, *map;
    sparge_tensor *out[3];
    float *lse;
    sparge_mask *mask;
    const sparge_mask_params *mp;
    int block, det, causal;
    const int32_t *cu;  /* pool: varlen offsets, each sequence pooled on its own into consecutive rows of out */
    int nseq;
} op_args;

/* A view of tokens [n0, n0 + n) of x. */
static sparge_tensor rows_of(const sparge_tensor *x, int64_t n0, int64_t n)
{
    sparge_tensor v = *x;
    v.data = (char *)x->data + n0 * x->stride[2] * (int64_t)sparge_dtype_size(x->dtype);
    v.shape[2] = n;
    return v;
}

static sparge_status call_pool(const void *p)
{
    const op_args *a = p;
    if (!a->nseq)
        return sparge_pool(a->dev, a->q, a->block, a->out[0]);
    sparge_status s = SPARGE_OK;
    for (int64_t b = 0, r0 = 0; !s && b < a->nseq; b++) {
        const int64_t n = a->cu[b + 1] - a->cu[b], nb = (n + a->block - 1) / a->block;
        if (!n) /* an empty sequence has no block */
            continue;
        sparge_tensor x = rows_of(a->q, a->cu[b], n), out = rows_of(a->out[0], r0, nb);
        s = sparge_pool(a->dev, &x, a->block, &out);
        r0 += nb;
    }
    return s;
}

static sparge_status call_map(const void *p)
{
    const op_args *a = p;
    return sparge_pooled_map(a->dev, a->q, a->k, 0.0f, a->out[0]);
}

static sparge_status call_predict(const void *p)
{
    const op_args *a = p;
    return sparge_mask_predict(a->dev, a->q, a->k, a->mp, a->mask);
}

static sparge_status call_select(const void *p)
{
    const op_args *a = p;
    return sparge_mask_select(a->dev, a->map, a->mp, a->mask);
}

/* A causal case asks for causal attention in the params too (a masked call may repeat its mask's flag). */
static sparge_status call_forward(const void *p)
{
    const op_args *a = p;
    const sparge_attn_params ap = {0.0f, 0, a->causal};
    return sparge_attention_forward(a->dev, a->q, a->k, a->v, a->mask, &ap, a->out[0], a->lse);
}

static sparge_status call_backward(const void *p)
{
    const op_args *a = p;
    const sparge_attn_params ap = {0.0f, a->det, a->causal};
    return sparge_attention_backward(a->dev, a->q, a->k, a->v, a->o, a->d_o, a->lse, a->mask, &ap, a->out[0],
                                     a->out[1], a->out[2]);
}

/* One call to check. */
typedef struct {
    const char *what; /* "forward" */
    int slot;         /* the outcome's tier slot (0 mask, 1 forward, 2 backward), or −1 */
    sparge_op_desc desc;
    sparge_status (*call)(const void *args);
    const op_args *args;
    ctensor *outs[4]; /* poisoned before the call */
    int nouts;
    sparge_mask *mask; /* a mask the call writes (poisoned with every block kept), or NULL */
} op_run;

static int poison(outcome *o, const target *t, const op_run *r)
{
    for (int i = 0; i < r->nouts; i++)
        if (!ct_poison(o, r->outs[i]))
            return 0;
    return !r->mask || ok(o, "sparge_mask_set_dense", sparge_mask_set_dense(r->mask, t->ones));
}

/* After a refusal: a message, the outputs still poisoned and the mask as it was. */
static void check_untouched(outcome *o, const target *t, const op_run *r, const char *when)
{
    if (!sparge_last_error()[0])
        failf(o, "%s refused%s without a message", r->what, when);
    for (int i = 0; i < r->nouts; i++)
        if (!ct_poisoned(o, r->outs[i])) {
            failf(o, "%s refused%s but wrote an output", r->what, when);
            break;
        }
    mask_host h;
    if (r->mask && mask_fetch(o, r->mask, &h, 0)) {
        for (int64_t i = 0; i < h.BH * h.Nqb * h.Nkb && i < t->cells; i++)
            if (h.dense[i] != t->ones[i]) {
                failf(o, "%s refused%s but changed the mask", r->what, when);
                break;
            }
        mask_host_free(&h);
    }
}

/* With strict=on, a call that ran on another tier than the device's first must be refused cleanly. */
static void check_strict_refusal(outcome *o, const target *t, const op_run *r, const char *tier)
{
    const char *v, *strict_tier;
    char saved[32];
    if (!ok(o, "sparge_device_get_option", sparge_device_get_option(t->dev, "strict", &v)))
        return;
    snprintf(saved, sizeof saved, "%s", v);
    if (!ok(o, "sparge_device_set_option", sparge_device_set_option(t->dev, "strict", "on")))
        return;
    if (sparge_device_supports(t->dev, &r->desc, &strict_tier) == SPARGE_OK) {
        failf(o, "%s: with strict=on sparge_device_supports still names tier %s", r->what, strict_tier);
    } else if (poison(o, t, r)) {
        const sparge_status s = r->call(r->args);
        if (s != SPARGE_ERR_UNSUPPORTED) {
            failf(o, "%s with strict=on: %s (%s), not a refusal (%s runs it without)", r->what, sparge_status_name(s),
                  sparge_last_error(), tier);
        } else {
            check_untouched(o, t, r, " with strict=on");
            notef(o, "strict=on refuses the %s", r->what);
        }
    }
    ok(o, "sparge_device_set_option", sparge_device_set_option(t->dev, "strict", saved));
}

/* Runs r: the tier sparge_device_supports names must run it, and a refusal must be SPARGE_ERR_UNSUPPORTED with a
 * message and nothing written. Where that tier is not the device's first, strict=on must refuse the call. Returns
 * 1 when the call ran (its outputs can be compared), 0 when it was refused (noted) or failed. */
static int run_op(outcome *o, const target *t, const op_run *r)
{
    const char *tier = NULL;
    if (sparge_device_supports(t->dev, &r->desc, &tier) != SPARGE_OK)
        tier = NULL;
    if (r->slot >= 0 && !o->tiers[r->slot][0])
        snprintf(o->tiers[r->slot], sizeof o->tiers[r->slot], "%s", tier ? tier : "-");
    if (tier && strcmp(tier, t->first) && !t->strict_case)
        check_strict_refusal(o, t, r, tier);
    if (!poison(o, t, r))
        return 0;
    const sparge_status s = r->call(r->args);
    if (s == SPARGE_OK) {
        if (!tier)
            failf(o, "%s ran although sparge_device_supports refused it", r->what);
        return 1;
    }
    char msg[400];
    snprintf(msg, sizeof msg, "%s", sparge_last_error());
    if (s != SPARGE_ERR_UNSUPPORTED) {
        failf(o, "%s: %s: %s", r->what, sparge_status_name(s), msg);
        return 0;
    }
    if (tier)
        failf(o, "%s refused although sparge_device_supports named tier %s: %s", r->what, tier, msg);
    check_untouched(o, t, r, "");
    if (!strstr(o->refused, r->what)) {
        size_t n = strlen(o->refused);
        snprintf(o->refused + n, sizeof o->refused - n, "%s%s (%s)", n ? "; " : "", r->what, msg);
    }
    return 0;
}

/* The description of an attention call on c with tensors ts (as sparge_op_desc says: varlen, the sequences and
 * the longest one's tokens). */
static sparge_op_desc attention_desc(sparge_op op, const check_case *c, ctensor *const *ts, int n, int masked, int det)
{
    sparge_op_desc d = {.op = op, .dtype = c->dtype, .head_dim = c->D, .B = c->B, .H = c->H, .Nq = longest(c, 0),
                        .Nk = longest(c, 1), .rows_aligned = 1, .deterministic = det, .kv_heads = hkv(c),
                        .causal = c->causal, .varlen = c->nseq > 0};
    if (masked)
        d.block_q = c->bq, d.block_k = c->bk;
    for (int i = 0; i < n; i++)
        d.rows_aligned &= rows_aligned(&ts[i]->t);
    return d;
}

/* ---------------------------------------------------------------- the reference */

enum { Q, K, V, DO, INPUTS };

/* What cpu-ref computes for a case, once for every device that runs it. */
typedef struct {
    int built;
    outcome log;             /* cpu-ref's own failures */
    sparge_tensor shape[INPUTS]; /* views (no data) of q, k, v, dO */
    void *img[INPUTS];       /* their storage images: the same bytes go to cpu-ref and to every device */
    double *x[INPUTS];       /* their values (grad mode) */
    ctensor q, k, v, d_o, o, lse, dq, dk, dv; /* on cpu-ref */
    ctensor pq, pk, map;     /* pooled means, and sparge_pooled_map of them (CHECK_MASK) */
    sparge_mask *mask;       /* the prediction (masked cases) */
    mask_host pred;          /* its selection and transpose */
    float *pred_map;         /* its pooled map */
    mask_host sel;           /* cpu-ref's selection on pred_map through sparge_mask_select (CHECK_MASK) */
} reference;

static void reference_free(reference *R)
{
    for (int i = 0; i < INPUTS; i++) {
        free(R->img[i]);
        free(R->x[i]);
    }
    ctensor *all[] = {&R->q, &R->k, &R->v, &R->d_o, &R->o, &R->lse, &R->dq, &R->dk, &R->dv, &R->pq, &R->pk, &R->map};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        ct_free(all[i]);
    sparge_mask_destroy(R->mask);
    mask_host_free(&R->pred);
    free(R->pred_map);
    mask_host_free(&R->sel);
    memset(R, 0, sizeof *R);
}

static sparge_mask_params mask_params(const check_case *c)
{
    return (sparge_mask_params){c->bq, c->bk, c->topk, c->topp, 0.0f, c->causal};
}

/* Rows of the pooled means (varlen: each sequence's blocks, one after the other). */
static int64_t pooled_rows(const check_case *c, int keys)
{
    const int block = keys ? c->bk : c->bq;
    int64_t n = 0, q0, nq, k0, nk;
    if (!c->nseq)
        return keys ? nkb(c) : nqb(c);
    for (int64_t b = 0; b < c->nseq; b++) {
        seq_of(c, b, &q0, &nq, &k0, &nk);
        n += ((keys ? nk : nq) + block - 1) / block;
    }
    return n;
}

/* The arguments of pooling x (Q or K of c) into out. */
static op_args pool_args(const check_case *c, sparge_device *dev, const sparge_tensor *x, sparge_tensor *out, int keys)
{
    return (op_args){.dev = dev, .q = x, .out = {out}, .block = keys ? c->bk : c->bq,
                     .cu = c->nseq ? (keys ? c->cu_k : c->cu_q) : NULL, .nseq = c->nseq};
}

/* The descriptions of the mask prediction and selection on c (sparge_op_desc: varlen, the sequences and the
 * longest one's tokens or blocks). */
static sparge_op_desc predict_desc(const check_case *c, const sparge_tensor *q, const sparge_tensor *k)
{
    return (sparge_op_desc){.op = SPARGE_OP_MASK_PREDICT, .dtype = c->dtype, .head_dim = c->D, .block_q = c->bq,
                            .block_k = c->bk, .B = c->B, .H = c->H, .Nq = longest(c, 0), .Nk = longest(c, 1),
                            .rows_aligned = rows_aligned(q) && rows_aligned(k), .kv_heads = hkv(c),
                            .causal = c->causal, .varlen = c->nseq > 0};
}

static sparge_op_desc select_desc(const check_case *c, const sparge_tensor *map)
{
    return (sparge_op_desc){.op = SPARGE_OP_MASK_SELECT, .dtype = SPARGE_F32, .B = c->B, .H = c->H, .Nq = nqb(c),
                            .Nk = nkb(c), .rows_aligned = rows_aligned(map), .causal = c->causal,
                            .varlen = c->nseq > 0};
}

/* cpu-ref's selection of c's mask on its own pooled map, through sparge_mask_select. */
static void reference_select(const check_case *c, sparge_device *ref, reference *R)
{
    outcome *o = &R->log;
    const sparge_mask_params mp = mask_params(c);
    ctensor map;
    sparge_mask *m = NULL;
    if (ct_alloc(o, &map, ref, sparge_tensor_bhnd(NULL, SPARGE_F32, c->B, c->H, nqb(c), nkb(c))) &&
        ct_put(o, &map, R->pred_map) && ok(o, "sparge_mask_create_ex", create_mask(ref, c, &m)) &&
        ok(o, "sparge_mask_select", sparge_mask_select(ref, &map.t, &mp, m)))
        mask_fetch(o, m, &R->sel, 0);
    sparge_mask_destroy(m);
    ct_free(&map);
}

/* Inputs for c (fresh values from the case's seed), and what the mode compares against. */
static void reference_build(const check_case *c, check_mode mode, sparge_device *ref, reference *R)
{
    outcome *o = &R->log;
    const int masked = !is_dense(c);
    const sparge_mask_params mp = mask_params(c);
    rng r = {case_seed(c)};
    R->built = 1;
    R->shape[Q] = R->shape[DO] = view(c->dtype, c->layout, tbatch(c), c->H, c->Nq, c->D);
    R->shape[K] = R->shape[V] = view(c->dtype, c->layout, tbatch(c), hkv(c), c->Nk, c->D);
    const int64_t sink = (int64_t)(rng_next(&r) % (uint64_t)nkb(c));
    for (int i = 0; i < INPUTS; i++)
        if (!(R->img[i] = random_image(&R->shape[i], &r, i == K ? sink : -1, c->bk))) {
            failf(o, "out of host memory");
            return;
        }
    if (mode == CHECK_MODE_PERF)
        return;
    if (mode == CHECK_MODE_GRAD)
        for (int i = 0; i < INPUTS; i++)
            if (!(R->x[i] = values_of(&R->shape[i], R->img[i]))) {
                failf(o, "out of host memory");
                return;
            }
    ctensor *in[INPUTS] = {&R->q, &R->k, &R->v, &R->d_o};
    for (int i = 0; i < INPUTS; i++)
        if (!ct_alloc(o, in[i], ref, R->shape[i]) || !ct_put(o, in[i], R->img[i]))
            return;
    if (masked) {
        const size_t cells = (size_t)(c->B * c->H * nqb(c) * nkb(c));
        if (!ok(o, "sparge_mask_create_ex", create_mask(ref, c, &R->mask)) ||
            !ok(o, "sparge_mask_predict", sparge_mask_predict(ref, &R->q.t, &R->k.t, &mp, R->mask)) ||
            !mask_fetch(o, R->mask, &R->pred, 1))
            return;
        if (!(R->pred_map = malloc(cells * sizeof(float)))) {
            failf(o, "out of host memory");
            return;
        }
        if (!ok(o, "sparge_mask_get_pooled_map", sparge_mask_get_pooled_map(R->mask, R->pred_map)))
            return;
    }
    if (mode == CHECK_MODE_GRAD)
        return;
    if (c->ops & CHECK_MASK) {
        const int64_t pq = pooled_rows(c, 0), pk = pooled_rows(c, 1);
        if (!ct_alloc(o, &R->pq, ref, sparge_tensor_bhnd(NULL, SPARGE_F32, tbatch(c), c->H, pq, c->D)) ||
            !ct_alloc(o, &R->pk, ref, sparge_tensor_bhnd(NULL, SPARGE_F32, tbatch(c), hkv(c), pk, c->D)) ||
            !ct_alloc(o, &R->map, ref, sparge_tensor_bhnd(NULL, SPARGE_F32, tbatch(c), c->H, pq, pk)))
            return;
        const op_args aq = pool_args(c, ref, &R->q.t, &R->pq.t, 0), ak = pool_args(c, ref, &R->k.t, &R->pk.t, 1);
        if (!ok(o, "sparge_pool", call_pool(&aq)) || !ok(o, "sparge_pool", call_pool(&ak)) ||
            !ok(o, "sparge_pooled_map", sparge_pooled_map(ref, &R->pq.t, &R->pk.t, 0.0f, &R->map.t)))
            return;
        reference_select(c, ref, R);
    }
    const sparge_attn_params ap = {0.0f, 0, c->causal};
    if (c->ops & (CHECK_FWD | CHECK_BWD)) {
        if (!ct_alloc(o, &R->o, ref, R->shape[Q]) ||
            !ct_alloc(o, &R->lse, ref, sparge_tensor_bhnd(NULL, SPARGE_F32, tbatch(c), c->H, c->Nq, 1)) ||
            !ok(o, "sparge_attention_forward", sparge_attention_forward(ref, &R->q.t, &R->k.t, &R->v.t, R->mask, &ap,
                                                                        &R->o.t, R->lse.t.data)))
            return;
    }
    if (c->ops & CHECK_BWD) {
        if (!ct_alloc(o, &R->dq, ref, R->shape[Q]) || !ct_alloc(o, &R->dk, ref, R->shape[K]) ||
            !ct_alloc(o, &R->dv, ref, R->shape[V]))
            return;
        ok(o, "sparge_attention_backward",
           sparge_attention_backward(ref, &R->q.t, &R->k.t, &R->v.t, &R->o.t, &R->d_o.t, R->lse.t.data, R->mask, &ap,
                                     &R->dq.t, &R->dk.t, &R->dv.t));
    }
}

/* ---------------------------------------------------------------- test mode */

/* The device's tensors for one case. */
typedef struct {
    ctensor q, k, v, d_o, o, lse, dq, dk, dv;
    sparge_mask *mask;
} dev_tensors;

static void dev_tensors_free(dev_tensors *d)
{
    ctensor *all[] = {&d->q, &d->k, &d->v, &d->d_o, &d->o, &d->lse, &d->dq, &d->dk, &d->dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        ct_free(all[i]);
    sparge_mask_destroy(d->mask);
    d->mask = NULL;
}

/* Inputs (cpu-ref's bytes) and outputs of c on dev. */
static int dev_tensors_alloc(outcome *o, const check_case *c, const reference *R, sparge_device *dev, dev_tensors *d)
{
    memset(d, 0, sizeof *d);
    ctensor *in[INPUTS] = {&d->q, &d->k, &d->v, &d->d_o};
    for (int i = 0; i < INPUTS; i++)
        if (!ct_alloc(o, in[i], dev, R->shape[i]) || !ct_put(o, in[i], R->img[i]))
            return 0;
    return ct_alloc(o, &d->o, dev, R->shape[Q]) &&
           ct_alloc(o, &d->lse, dev, sparge_tensor_bhnd(NULL, SPARGE_F32, tbatch(c), c->H, c->Nq, 1)) &&
           ct_alloc(o, &d->dq, dev, R->shape[Q]) && ct_alloc(o, &d->dk, dev, R->shape[K]) &&
           ct_alloc(o, &d->dv, dev, R->shape[V]) && ok(o, "sparge_mask_create_ex", create_mask(dev, c, &d->mask));
}

/* Compares a device's pooled map (host floats) with cpu-ref's. */
static void compare_maps(outcome *o, const char *what, const float *got, const float *want, int64_t n)
{
    double *g = malloc((size_t)n * sizeof *g), *w = malloc((size_t)n * sizeof *w);
    if (g && w) {
        for (int64_t i = 0; i < n; i++)
            g[i] = got[i], w[i] = want[i];
        const double e = check_rel_l2(g, w, n);
        measured(o, "map", e);
        if (!(e <= 1e-5))
            failf(o, "%s: relative L2 error %.3g > 1e-05", what, e);
    } else {
        failf(o, "out of host memory");
    }
    free(g);
    free(w);
}

/* CHECK_MASK: pooling, the pooled map on cpu-ref's pooled means, the prediction (pooled map, and the selection
 * under §2.2's rounding margin) and the selection on cpu-ref's pooled map (identical to cpu-ref's). */
static void test_mask(const check_case *c, const reference *R, const target *t, dev_tensors *d, outcome *o)
{
    const sparge_mask_params mp = mask_params(c);
    const int64_t cells = c->B * c->H * nqb(c) * nkb(c);
    ctensor pq = {0}, pk = {0}, in_q = {0}, in_k = {0}, map = {0}, in_map = {0};
    mask_host h = {0};
    float *got_map = NULL;
    if (!ct_alloc(o, &pq, t->dev, R->pq.t) || !ct_alloc(o, &pk, t->dev, R->pk.t) ||
        !ct_alloc(o, &in_q, t->dev, R->pq.t) || !ct_alloc(o, &in_k, t->dev, R->pk.t) ||
        !ct_alloc(o, &map, t->dev, R->map.t) ||
        !ct_alloc(o, &in_map, t->dev, sparge_tensor_bhnd(NULL, SPARGE_F32, c->B, c->H, nqb(c), nkb(c))))
        goto done;

    /* pooling (varlen: each sequence on its own, into consecutive rows) */
    for (int i = 0; i < 2; i++) {
        ctensor *x = i ? &d->k : &d->q, *out = i ? &pk : &pq;
        const op_args a = pool_args(c, t->dev, &x->t, &out->t, i);
        const op_run r = {"pool", -1,
                          {.op = SPARGE_OP_POOL, .dtype = c->dtype, .head_dim = c->D, .block_q = a.block,
                           .B = x->t.shape[0], .H = x->t.shape[1], .Nq = c->nseq ? longest(c, i) : x->t.shape[2],
                           .rows_aligned = rows_aligned(&x->t) && rows_aligned(&out->t)},
                          call_pool, &a, {out}, 1, NULL};
        if (run_op(o, t, &r))
            compare(o, i ? "pooled K" : "pooled Q", "pool", out, i ? &R->pk : &R->pq, 1e-5);
    }

    /* the pooled map of cpu-ref's pooled means */
    void *img_q = ct_image(o, &R->pq), *img_k = img_q ? ct_image(o, &R->pk) : NULL;
    const int put = img_k && ct_put(o, &in_q, img_q) && ct_put(o, &in_k, img_k);
    free(img_q);
    free(img_k);
    if (!put)
        goto done;
    {
        const op_args a = {.dev = t->dev, .q = &in_q.t, .k = &in_k.t, .out = {&map.t}};
        const op_run r = {"pooled map", -1,
                          {.op = SPARGE_OP_POOLED_MAP, .dtype = SPARGE_F32, .head_dim = c->D, .B = tbatch(c),
                           .H = c->H, .Nq = in_q.t.shape[2], .Nk = in_k.t.shape[2],
                           .rows_aligned = rows_aligned(&in_q.t) && rows_aligned(&in_k.t) && rows_aligned(&map.t)},
                          call_map, &a, {&map}, 1, NULL};
        if (run_op(o, t, &r))
            compare(o, "pooled map", "map", &map, &R->map, 1e-5);
    }

    /* the prediction */
    {
        const op_args a = {.dev = t->dev, .q = &d->q.t, .k = &d->k.t, .mask = d->mask, .mp = &mp};
        const op_run r = {"mask prediction", 0, predict_desc(c, &d->q.t, &d->k.t), call_predict, &a, {NULL}, 0,
                          d->mask};
        if (run_op(o, t, &r)) {
            if (!(got_map = malloc((size_t)cells * sizeof *got_map))) {
                failf(o, "out of host memory");
                goto done;
            }
            if (ok(o, "sparge_mask_get_pooled_map", sparge_mask_get_pooled_map(d->mask, got_map)))
                compare_maps(o, "predicted map", got_map, R->pred_map, cells);
            if (mask_fetch(o, d->mask, &h, 1)) {
                int64_t close_rows = 0;
                check_wellformed(o, "predicted mask", &h, c);
                compare_selection(o, "predicted mask", &h, &R->pred, R->pred_map, c->topk, c->topp, &close_rows, c);
                if (close_rows)
                    notef(o, "%lld mask rows differ within the rounding margin", (long long)close_rows);
                mask_host_free(&h);
            }
        }
    }

    /* the selection on cpu-ref's pooled map: the same f32 values on both sides, so the same kept sets */
    if (!ct_put(o, &in_map, R->pred_map))
        goto done;
    {
        const op_args a = {.dev = t->dev, .map = &in_map.t, .mask = d->mask, .mp = &mp};
        const op_run r = {"mask selection", -1, select_desc(c, &in_map.t), call_select, &a, {NULL}, 0, d->mask};
        if (run_op(o, t, &r) && mask_fetch(o, d->mask, &h, 1)) {
            int64_t none = 0;
            check_wellformed(o, "selected mask", &h, c);
            compare_selection(o, "selected mask", &h, &R->sel, NULL, c->topk, c->topp, &none, c);
            mask_host_free(&h);
        }
    }
done:
    free(got_map);
    ct_free(&pq);
    ct_free(&pk);
    ct_free(&in_q);
    ct_free(&in_k);
    ct_free(&map);
    ct_free(&in_map);
}

/* Imports cpu-ref's selection into the device's mask: its CSR and transpose, rebuilt from the dense view, must be
 * cpu-ref's exactly. */
static int import_selection(const check_case *c, const reference *R, dev_tensors *d, outcome *o)
{
    mask_host h;
    if (!ok(o, "sparge_mask_set_dense", sparge_mask_set_dense(d->mask, R->pred.dense)) ||
        !mask_fetch(o, d->mask, &h, 1))
        return 0;
    int64_t none = 0;
    check_wellformed(o, "imported mask", &h, c);
    compare_selection(o, "imported mask", &h, &R->pred, NULL, 0.0, 0.0, &none, c);
    mask_host_free(&h);
    return 1;
}

/* CHECK_FWD: O and LSE against cpu-ref's. */
static void test_forward(const check_case *c, const reference *R, const target *t, dev_tensors *d, int masked,
                         outcome *o)
{
    const op_args a = {.dev = t->dev, .q = &d->q.t, .k = &d->k.t, .v = &d->v.t, .out = {&d->o.t},
                       .lse = d->lse.t.data, .mask = masked ? d->mask : NULL, .causal = c->causal};
    ctensor *ts[] = {&d->q, &d->k, &d->v, &d->o};
    const op_run r = {"forward", 1, attention_desc(SPARGE_OP_FORWARD, c, ts, 4, masked, 0), call_forward, &a,
                      {&d->o, &d->lse}, 2, NULL};
    if (run_op(o, t, &r)) {
        compare(o, "O", "O", &d->o, &R->o, tolerance(c));
        compare(o, "LSE", "LSE", &d->lse, &R->lse, 1e-5);
    }
}

/* CHECK_BWD: dQ, dK, dV from cpu-ref's O and LSE against cpu-ref's, plain and deterministic; the deterministic
 * backward run twice gives the same bits. */
static void test_backward(const check_case *c, const reference *R, const target *t, dev_tensors *d, int masked,
                          outcome *o)
{
    void *ro = ct_image(o, &R->o), *rlse = ro ? ct_image(o, &R->lse) : NULL;
    const int put = rlse && ct_put(o, &d->o, ro) && ct_put(o, &d->lse, rlse);
    free(ro);
    free(rlse);
    if (!put)
        return;
    ctensor *grads[3] = {&d->dq, &d->dk, &d->dv};
    const ctensor *want[3] = {&R->dq, &R->dk, &R->dv};
    static const char *const names[2][3] = {{"dQ", "dK", "dV"}, {"det dQ", "det dK", "det dV"}};
    ctensor *ts[] = {&d->q, &d->k, &d->v, &d->o, &d->d_o, &d->dq, &d->dk, &d->dv};
    for (int det = 0; det < 2; det++) {
        const op_args a = {.dev = t->dev, .q = &d->q.t, .k = &d->k.t, .v = &d->v.t, .o = &d->o.t, .d_o = &d->d_o.t,
                           .out = {&d->dq.t, &d->dk.t, &d->dv.t}, .lse = d->lse.t.data,
                           .mask = masked ? d->mask : NULL, .det = det, .causal = c->causal};
        const op_run r = {det ? "deterministic backward" : "backward", 2,
                          attention_desc(SPARGE_OP_BACKWARD, c, ts, 8, masked, det), call_backward, &a,
                          {&d->dq, &d->dk, &d->dv}, 3, NULL};
        if (!run_op(o, t, &r))
            continue;
        for (int i = 0; i < 3; i++)
            compare(o, names[det][i], names[0][i], grads[i], want[i], tolerance(c));
        if (!det)
            continue;
        void *first[3] = {NULL, NULL, NULL};
        int same = 1;
        for (int i = 0; i < 3; i++)
            if (!(first[i] = ct_image(o, grads[i])) || !ct_poison(o, grads[i]))
                same = -1;
        if (same > 0 && ok(o, "deterministic backward (again)", call_backward(&a)))
            for (int i = 0; i < 3 && same > 0; i++) {
                void *again = ct_image(o, grads[i]);
                if (!again || memcmp(again, first[i], grads[i]->bytes)) {
                    if (again)
                        failf(o, "deterministic backward: %s differs between two runs", names[0][i]);
                    same = 0;
                }
                free(again);
            }
        for (int i = 0; i < 3; i++)
            free(first[i]);
    }
}

static void run_test(const check_case *c, const reference *R, const target *t, outcome *o)
{
    const int masked = !is_dense(c);
    dev_tensors d;
    if (dev_tensors_alloc(o, c, R, t->dev, &d)) {
        if (c->ops & CHECK_MASK)
            test_mask(c, R, t, &d, o);
        if ((c->ops & (CHECK_FWD | CHECK_BWD)) && (!masked || import_selection(c, R, &d, o))) {
            if (c->ops & CHECK_FWD)
                test_forward(c, R, t, &d, masked, o);
            if (c->ops & CHECK_BWD)
                test_backward(c, R, t, &d, masked, o);
        }
    }
    dev_tensors_free(&d);
}

/* ---------------------------------------------------------------- grad mode */

/* The loss L = Σ w∘O (w = dO) of §1.9's forward in fp64 on the stored input values, a row at a time: each query
 * token over the key tokens of its sequence that its row keeps and, causal, that lie on or before its diagonal;
 * query head h reads K/V head h / (H / Hkv). */
typedef struct {
    const check_case *c;
    double *x[INPUTS]; /* q, k, v, w: logical [B,H,N,D] ([B,Hkv,N,D] for k and v; varlen B = 1) */
    const uint8_t *keep; /* the mask's [B,H,Nqb,Nkb], NULL: dense */
    double scale;
    double *s, *acc;   /* scratch: Nk scores, D sums */
} fd_ctx;

/* The sequence holding packed query (or key) token n. */
static int64_t seq_at(const check_case *c, int64_t n, int keys)
{
    const int32_t *cu = keys ? c->cu_k : c->cu_q;
    int64_t b = 0;
    while (b + 1 < c->nseq && n >= cu[b + 1])
        b++;
    return b;
}

/* Whether query tl of sequence b (its own token index), head h, attends its key ul. */
static int visible(const fd_ctx *f, int64_t b, int64_t h, int64_t tl, int64_t ul, int64_t nq, int64_t nk)
{
    const check_case *c = f->c;
    if (c->causal && ul > tl + nk - nq)
        return 0;
    return !f->keep || f->keep[((b * c->H + h) * nqb(c) + tl / c->bq) * nkb(c) + ul / c->bk];
}

/* Σ_d w_td·O_td of query token t of batch tb, head h. */
static double row_loss(const fd_ctx *f, int64_t tb, int64_t h, int64_t t)
{
    const check_case *c = f->c;
    const int64_t D = c->D, b = c->nseq ? seq_at(c, t, 0) : tb, hk = h / (c->H / hkv(c));
    int64_t q0, nq, k0, nk;
    seq_of(c, b, &q0, &nq, &k0, &nk);
    const int64_t qrow = (tb * c->H + h) * c->Nq + t, krow = (tb * hkv(c) + hk) * c->Nk + k0;
    const double *q = f->x[Q] + qrow * D, *w = f->x[DO] + qrow * D, *k = f->x[K] + krow * D, *v = f->x[V] + krow * D;
    double m = -INFINITY, z = 0.0, loss = 0.0;
    for (int64_t u = 0; u < nk; u++) {
        if (!visible(f, b, h, t - q0, u, nq, nk))
            continue;
        double dot = 0.0;
        for (int64_t e = 0; e < D; e++)
            dot += q[e] * k[u * D + e];
        f->s[u] = f->scale * dot;
        m = fmax(m, f->s[u]);
    }
    for (int64_t e = 0; e < D; e++)
        f->acc[e] = 0.0;
    for (int64_t u = 0; u < nk; u++) {
        if (!visible(f, b, h, t - q0, u, nq, nk))
            continue;
        const double p = exp(f->s[u] - m);
        z += p;
        for (int64_t e = 0; e < D; e++)
            f->acc[e] += p * v[u * D + e];
    }
    for (int64_t e = 0; e < D; e++)
        loss += w[e] * f->acc[e] / z;
    return loss;
}

/* The part of L that element i of input `which` (Q, K or V) enters: its query row, or every row of the query heads
 * reading its K/V head that attends its key token. */
static double rows_loss(const fd_ctx *f, int which, int64_t i)
{
    const check_case *c = f->c;
    const int64_t heads = which == Q ? c->H : hkv(c), N = which == Q ? c->Nq : c->Nk, tb = i / (heads * N * c->D),
                  hh = i / (N * c->D) % heads, n = i / c->D % N;
    if (which == Q)
        return row_loss(f, tb, hh, n);
    const int64_t b = c->nseq ? seq_at(c, n, 1) : tb, group = c->H / heads;
    int64_t q0, nq, k0, nk;
    seq_of(c, b, &q0, &nq, &k0, &nk);
    double sum = 0.0;
    for (int64_t h = hh * group; h < (hh + 1) * group; h++)
        for (int64_t t = 0; t < nq; t++)
            if (visible(f, b, h, t, n - k0, nq, nk))
                sum += row_loss(f, tb, h, q0 + t);
    return sum;
}

/* Central difference of L in element i of input `which`. */
static double finite_difference(fd_ctx *f, int which, int64_t i)
{
    const double h = 1e-5, saved = f->x[which][i];
    f->x[which][i] = saved + h;
    const double up = rows_loss(f, which, i);
    f->x[which][i] = saved - h;
    const double down = rows_loss(f, which, i);
    f->x[which][i] = saved;
    return (up - down) / (2 * h);
}

/* The device's own forward then backward (dO = w), and its dQ, dK, dV against central finite differences of L at
 * 16 random elements each: relative L2 within twice the storage tolerance (docs/DESIGN.md §2.1). */
static void run_grad(const check_case *c, reference *R, const target *t, outcome *o)
{
    const int masked = !is_dense(c);
    dev_tensors d;
    memset(&d, 0, sizeof d);
    fd_ctx f = {c, {R->x[Q], R->x[K], R->x[V], R->x[DO]}, masked ? R->pred.dense : NULL,
                (double)(1.0f / sqrtf((float)c->D)), malloc((size_t)c->Nk * sizeof(double)),
                malloc((size_t)c->D * sizeof(double))};
    if (!f.s || !f.acc)
        failf(o, "out of host memory");
    else if (dev_tensors_alloc(o, c, R, t->dev, &d) && (!masked || import_selection(c, R, &d, o))) {
        ctensor *ts[] = {&d.q, &d.k, &d.v, &d.o, &d.d_o, &d.dq, &d.dk, &d.dv};
        const op_args a = {.dev = t->dev, .q = &d.q.t, .k = &d.k.t, .v = &d.v.t, .o = &d.o.t, .d_o = &d.d_o.t,
                           .out = {&d.o.t}, .lse = d.lse.t.data, .mask = masked ? d.mask : NULL,
                           .causal = c->causal};
        op_args b = a;
        b.out[0] = &d.dq.t, b.out[1] = &d.dk.t, b.out[2] = &d.dv.t;
        const op_run fwd = {"forward", 1, attention_desc(SPARGE_OP_FORWARD, c, ts, 4, masked, 0), call_forward, &a,
                            {&d.o, &d.lse}, 2, NULL};
        const op_run bwd = {"backward", 2, attention_desc(SPARGE_OP_BACKWARD, c, ts, 8, masked, 0), call_backward, &b,
                            {&d.dq, &d.dk, &d.dv}, 3, NULL};
        if (run_op(o, t, &fwd) && run_op(o, t, &bwd)) {
            rng r = {case_seed(c) ^ 0x5eedull};
            ctensor *grads[3] = {&d.dq, &d.dk, &d.dv};
            static const char *const names[3] = {"dQ", "dK", "dV"};
            const double tol = 2.0 * tolerance(c);
            for (int i = 0; i < 3; i++) {
                double *g = ct_values(o, grads[i]), got[16], fd[16];
                if (!g)
                    break;
                for (int p = 0; p < 16; p++) {
                    const int64_t e = (int64_t)(rng_next(&r) % (uint64_t)numel(&grads[i]->t));
                    got[p] = g[e];
                    fd[p] = finite_difference(&f, i, e);
                }
                free(g);
                const double err = check_rel_l2(got, fd, 16);
                measured(o, names[i], err);
                if (!(err <= tol))
                    failf(o, "%s against finite differences: relative L2 error %.3g > %.3g", names[i], err, tol);
            }
        }
    }
    dev_tensors_free(&d);
    free(f.s);
    free(f.acc);
}

/* ---------------------------------------------------------------- perf mode */

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of reps timed calls (after one untimed), each between sparge_timer_start and sparge_timer_stop. */
static int time_op(outcome *o, sparge_device *dev, const char *what, sparge_status (*call)(const void *),
                   const op_args *a, int reps, double *median)
{
    double *ms = malloc((size_t)reps * sizeof *ms);
    int good = ms && ok(o, what, call(a));
    for (int i = 0; good && i < reps; i++)
        good = ok(o, "sparge_timer_start", sparge_timer_start(dev)) && ok(o, what, call(a)) &&
               ok(o, "sparge_timer_stop", sparge_timer_stop(dev, &ms[i]));
    if (good) {
        qsort(ms, (size_t)reps, sizeof *ms, by_value);
        *median = reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
    }
    free(ms);
    return good;
}

/* The (query, key) token pairs per head that a query may attend: causal ones on or before its diagonal, varlen
 * ones within its sequence. */
static double attendable_pairs(const check_case *c)
{
    double pairs = 0.0;
    int64_t q0, nq, k0, nk;
    for (int64_t b = 0; b < c->B; b++) {
        seq_of(c, b, &q0, &nq, &k0, &nk);
        pairs += c->causal ? (double)nq * (double)(nk - nq) + 0.5 * (double)nq * (double)(nq + 1)
                           : (double)nq * (double)nk;
    }
    return pairs;
}

/* Times the case's ops on the device (its own mask prediction); effective TFLOP/s count the kept token pairs
 * only (docs/DESIGN.md §5): 4·H·pairs·D·density per forward (pairs: those a query may attend, B·Nq·Nk without
 * causal or varlen), 2.5 times that per backward. */
static void run_perf(const check_case *c, const reference *R, const target *t, int reps, outcome *o, char *cols,
                     size_t cols_len)
{
    const int masked = !is_dense(c);
    const sparge_mask_params mp = mask_params(c);
    double mask_ms = NAN, fwd_ms = NAN, bwd_ms = NAN, density = 1.0, sparsity = 0.0;
    dev_tensors d;
    if (!dev_tensors_alloc(o, c, R, t->dev, &d))
        goto done;
    ctensor *ts[] = {&d.q, &d.k, &d.v, &d.o, &d.d_o, &d.dq, &d.dk, &d.dv};
    const op_args pa = {.dev = t->dev, .q = &d.q.t, .k = &d.k.t, .mask = d.mask, .mp = &mp};
    const op_args fa = {.dev = t->dev, .q = &d.q.t, .k = &d.k.t, .v = &d.v.t, .out = {&d.o.t}, .lse = d.lse.t.data,
                        .mask = masked ? d.mask : NULL, .causal = c->causal};
    op_args ba = fa;
    ba.o = &d.o.t, ba.d_o = &d.d_o.t, ba.out[0] = &d.dq.t, ba.out[1] = &d.dk.t, ba.out[2] = &d.dv.t;
    const sparge_op_desc descs[3] = {
        predict_desc(c, &d.q.t, &d.k.t),
        attention_desc(SPARGE_OP_FORWARD, c, ts, 4, masked, 0),
        attention_desc(SPARGE_OP_BACKWARD, c, ts, 8, masked, 0)};
    static const char *const what[3] = {"mask prediction", "forward", "backward"};
    for (int i = 0; i < 3; i++) {
        const unsigned uses[3] = {0, CHECK_FWD | CHECK_BWD, CHECK_BWD};
        const int needed = i == 0 ? masked : (c->ops & uses[i]) != 0;
        const char *tier;
        if (!needed)
            continue;
        if (sparge_device_supports(t->dev, &descs[i], &tier)) {
            snprintf(o->tiers[i], sizeof o->tiers[i], "-");
            snprintf(o->refused, sizeof o->refused, "%s (%s)", what[i], sparge_last_error());
            goto done;
        }
        snprintf(o->tiers[i], sizeof o->tiers[i], "%s", tier);
    }
    if (masked) {
        sparge_mask_stats st;
        if (c->ops & CHECK_MASK ? !time_op(o, t->dev, what[0], call_predict, &pa, reps, &mask_ms)
                                : !ok(o, what[0], call_predict(&pa)))
            goto done;
        if (!ok(o, "sparge_mask_get_stats", sparge_mask_get_stats(d.mask, &st, NULL, NULL)))
            goto done;
        density = st.token_density, sparsity = st.sparsity;
    }
    if (c->ops & (CHECK_FWD | CHECK_BWD)) {
        if (c->ops & CHECK_FWD ? !time_op(o, t->dev, what[1], call_forward, &fa, reps, &fwd_ms)
                               : !ok(o, what[1], call_forward(&fa)))
            goto done;
    }
    if (c->ops & CHECK_BWD)
        time_op(o, t->dev, what[2], call_backward, &ba, reps, &bwd_ms);
done:;
    const double flop = 4.0 * (double)c->H * attendable_pairs(c) * (double)c->D * density;
    const double v[6] = {sparsity, mask_ms, fwd_ms, flop / fwd_ms * 1e-9, bwd_ms, 2.5 * flop / bwd_ms * 1e-9};
    cols[0] = 0;
    for (int i = 0; i < 6; i++) { /* "-" for what was not timed */
        if (isnan(v[i]))
            snprintf(cols + strlen(cols), cols_len - strlen(cols), " %9s", "-");
        else
            snprintf(cols + strlen(cols), cols_len - strlen(cols), " %9.3f", v[i]);
    }
    dev_tensors_free(&d);
}

/* ---------------------------------------------------------------- options of the device under test */

enum { MAX_CASE_OPTIONS = 8 };

typedef struct {
    int n;
    char name[MAX_CASE_OPTIONS][32], value[MAX_CASE_OPTIONS][32], saved[MAX_CASE_OPTIONS][32];
} option_set;

/* Parses "name=value ..." into s. 0 if malformed. */
static int parse_options(const char *text, option_set *s)
{
    s->n = 0;
    for (const char *p = text; p && *p;) {
        while (*p == ' ')
            p++;
        if (!*p)
            break;
        const size_t len = strcspn(p, " "), eq = strcspn(p, "=");
        if (s->n == MAX_CASE_OPTIONS || eq >= len || eq == 0 || eq >= 32 || len - eq - 1 >= 32)
            return 0;
        snprintf(s->name[s->n], 32, "%.*s", (int)eq, p);
        snprintf(s->value[s->n], 32, "%.*s", (int)(len - eq - 1), p + eq + 1);
        s->n++;
        p += len;
    }
    return 1;
}

/* Sets c's options on dev, keeping the values they replace. Returns 1 when set, 0 when dev lacks one (missing
 * names it; nothing changed), −1 on a failure (recorded; the options set so far are put back). */
static int apply_options(const check_case *c, sparge_device *dev, option_set *s, char *missing, size_t missing_len,
                         outcome *o)
{
    const char *v;
    if (!parse_options(c->options, s)) {
        failf(o, "malformed option set \"%s\"", c->options);
        return -1;
    }
    for (int i = 0; i < s->n; i++) {
        if (sparge_device_get_option(dev, s->name[i], &v) != SPARGE_OK) {
            snprintf(missing, missing_len, "%s", s->name[i]);
            return 0;
        }
        snprintf(s->saved[i], 32, "%s", v);
    }
    for (int i = 0; i < s->n; i++)
        if (!ok(o, s->name[i], sparge_device_set_option(dev, s->name[i], s->value[i]))) {
            while (i-- > 0)
                sparge_device_set_option(dev, s->name[i], s->saved[i]);
            return -1;
        }
    return 1;
}

static void restore_options(sparge_device *dev, const option_set *s, outcome *o)
{
    for (int i = s->n; i-- > 0;)
        ok(o, "restoring an option", sparge_device_set_option(dev, s->name[i], s->saved[i]));
}

/* ---------------------------------------------------------------- devices and the run */

int check_open_devices(const char *only, sparge_device **devs, int max, char *msg, size_t msg_len)
{
    const size_t len = only ? strcspn(only, ":") : 0;
    char known[256] = "";
    int found = 0, n = 0;
    msg[0] = 0;
    for (int b = 0; b < sparge_backend_count(); b++) {
        const char *name = sparge_backend_name(b);
        snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", b ? ", " : "", name);
        found |= only && strlen(name) == len && !strncmp(name, only, len);
    }
    if (only && (!found || (len == 7 && !strncmp(only, "cpu-ref", 7)))) {
        snprintf(msg, msg_len, found ? "cpu-ref is the reference every device is checked against"
                                     : "no backend '%.*s' in this build (it has: %s)",
                 (int)len, only, known);
        return -2;
    }
    if (only && only[len] == ':') { /* one device */
        sparge_device *dev;
        if (max < 1 || sparge_device_open(only, &dev) != SPARGE_OK) {
            snprintf(msg, msg_len, "cannot open %s: %s", only, max < 1 ? "no room" : sparge_last_error());
            return -1;
        }
        devs[0] = dev;
        return 1;
    }
    for (int b = 0; b < sparge_backend_count(); b++) {
        const char *name = sparge_backend_name(b);
        const int count = sparge_backend_device_count(name);
        if (!strcmp(name, "cpu-ref") || (only && (strlen(name) != len || strncmp(name, only, len))))
            continue;
        if (!count)
            snprintf(msg + strlen(msg), msg_len - strlen(msg), "%s%s", msg[0] ? ", " : "", name);
        for (int i = 0; i < count && n < max; i++) {
            char dn[64];
            snprintf(dn, sizeof dn, strncmp(name, "cpu", 3) ? "%s:%d" : "%s", name, i);
            if (sparge_device_open(dn, &devs[n]) != SPARGE_OK) {
                snprintf(msg, msg_len, "cannot open %s: %s", dn, sparge_last_error());
                while (n-- > 0)
                    sparge_device_close(devs[n]);
                return -1;
            }
            n++;
        }
    }
    return n;
}

static int applies(const check_config *cfg, const check_case *c)
{
    if (!(cfg->full || c->quick) || (cfg->filter && !strstr(c->name, cfg->filter)))
        return 0;
    return cfg->mode != CHECK_MODE_GRAD || ((c->ops & CHECK_BWD) && c->Nq * c->Nk * c->D <= CHECK_GRAD_MAX_HEAD);
}

/* "cuda" when every op ran on one tier, else "mask=cuda fwd=cuda-generic ...". */
static void tier_text(const outcome *o, char *buf, size_t len)
{
    static const char *const slot[3] = {"mask", "fwd", "bwd"};
    const char *one = NULL;
    int same = 1;
    for (int i = 0; i < 3; i++)
        if (o->tiers[i][0]) {
            same &= !one || !strcmp(one, o->tiers[i]);
            one = one ? one : o->tiers[i];
        }
    buf[0] = 0;
    if (!one || same) {
        snprintf(buf, len, "%s", one ? one : "-");
        return;
    }
    for (int i = 0; i < 3; i++)
        if (o->tiers[i][0])
            snprintf(buf + strlen(buf), len - strlen(buf), "%s%s=%s", buf[0] ? " " : "", slot[i], o->tiers[i]);
}

/* The table's shape column of a case: "BxHxNqxNk D bqxbk [kvHkv] [causal] [varlen lengths] mask". */
static void shape_text(const check_case *c, char *shape, size_t n)
{
    snprintf(shape, n, "%lldx%lldx%lldx%lld D%lld %dx%d", (long long)c->B, (long long)c->H,
             (long long)c->Nq, (long long)c->Nk, (long long)c->D, c->bq, c->bk);
    if (c->kv_heads)
        snprintf(shape + strlen(shape), n - strlen(shape), " kv%lld", (long long)c->kv_heads);
    if (c->causal)
        snprintf(shape + strlen(shape), n - strlen(shape), " causal");
    for (int k = 0; k < (c->nseq ? 2 : 0); k++) { /* "varlen 90,40,60": the lengths; K's after a "/" if others */
        const int32_t *cu = k ? c->cu_k : c->cu_q;
        if (k && !memcmp(c->cu_k, c->cu_q, sizeof c->cu_q))
            break;
        snprintf(shape + strlen(shape), n - strlen(shape), "%s", k ? "/" : " varlen ");
        for (int b = 0; b < c->nseq; b++)
            snprintf(shape + strlen(shape), n - strlen(shape), "%s%d", b ? "," : "", cu[b + 1] - cu[b]);
    }
    if (!is_dense(c))
        snprintf(shape + strlen(shape), n - strlen(shape), " k%g p%g", c->topk, c->topp);
    else
        snprintf(shape + strlen(shape), n - strlen(shape), " dense");
}

static const char *const result_names[] = {"PASS", "FAIL", "unsupported", "skipped"};

/* One case on every device. */
static void run_case(const check_config *cfg, const check_case *c, sparge_device **devs, int ndev,
                     sparge_device *ref, check_summary *sum, FILE *out, int name_w, int shape_w)
{
    reference R;
    char shape[192], tiers[96], perf[96] = "", missing[32];
    const int64_t cells = c->B > 0 ? c->B * c->H * nqb(c) * nkb(c) : 1;
    uint8_t *ones = malloc((size_t)cells);
    memset(&R, 0, sizeof R);
    for (int64_t r = 0; ones && r < cells / nkb(c); r++) { /* every block each row may keep */
        int64_t allowed, d0, d1;
        if (!row_rule(c, r / (c->H * nqb(c)), r % nqb(c), &allowed, &d0, &d1))
            allowed = 0;
        for (int64_t j = 0; j < nkb(c); j++)
            ones[r * nkb(c) + j] = j < allowed;
    }
    shape_text(c, shape, sizeof shape);
    for (int i = 0; i < ndev; i++) {
        outcome o;
        option_set opts;
        memset(&o, 0, sizeof o);
        const int set = ones && c->B > 0 ? apply_options(c, devs[i], &opts, missing, sizeof missing, &o) : -1;
        if (!ones)
            failf(&o, "out of host memory");
        else if (c->B <= 0)
            failf(&o, "the case's varlen lengths are malformed");
        if (set > 0) {
            const target t = {devs[i], sparge_device_backend(devs[i]), c->options && strstr(c->options, "strict="),
                              ones, cells};
            if (!R.built)
                reference_build(c, cfg->mode, ref, &R);
            if (R.log.failed)
                failf(&o, "cpu-ref: %s", R.log.fail);
            else if (cfg->mode == CHECK_MODE_TEST)
                run_test(c, &R, &t, &o);
            else if (cfg->mode == CHECK_MODE_GRAD)
                run_grad(c, &R, &t, &o);
            else
                run_perf(c, &R, &t, cfg->reps > 0 ? cfg->reps : 5, &o, perf, sizeof perf);
            restore_options(devs[i], &opts, &o);
        }
        const check_result r = o.failed ? CHECK_FAIL : set == 0 ? CHECK_SKIPPED : o.refused[0] ? CHECK_UNSUPPORTED
                                                                                               : CHECK_PASS;
        tier_text(&o, tiers, sizeof tiers);
        fprintf(out, "%-11s %-15s %-*s %-*s %-22s ", result_names[r], sparge_device_name(devs[i]), name_w, c->name,
                shape_w, shape, tiers);
        if (cfg->mode == CHECK_MODE_PERF && r != CHECK_SKIPPED)
            fprintf(out, "%s ", perf + 1);
        if (c->options)
            fprintf(out, "[%s] ", c->options);
        if (r == CHECK_SKIPPED)
            fprintf(out, "the device has no option %s", missing);
        if (r == CHECK_FAIL)
            fprintf(out, "%s |", o.fail);
        if (r == CHECK_UNSUPPORTED)
            fprintf(out, "refused: %s |", o.refused);
        for (int m = 0; m < o.measures; m++)
            fprintf(out, " %s %.1e", o.measure[m].name, o.measure[m].worst);
        fprintf(out, "%s%s\n", o.notes[0] ? "; " : "", o.notes);
        fflush(out);
        sum->passed += r == CHECK_PASS;
        sum->failed += r == CHECK_FAIL;
        sum->unsupported += r == CHECK_UNSUPPORTED;
        sum->skipped += r == CHECK_SKIPPED;
        if (cfg->on_result) {
            const char *const each[3] = {o.tiers[0], o.tiers[1], o.tiers[2]};
            cfg->on_result(cfg->user, c, sparge_device_name(devs[i]), r, each);
        }
    }
    reference_free(&R);
    free(ones);
}

int check_run(const check_config *cfg, check_summary *sum)
{
    static const char *const modes[] = {"test: against cpu-ref",
                                        "grad: gradients against finite differences of the fp64 forward",
                                        "perf: median times"};
    FILE *out = cfg->out ? cfg->out : stdout;
    check_summary s = {0, 0, 0, 0, 0};
    sparge_device *devs[32], *ref;
    char msg[512];
    const int n = check_open_devices(cfg->backend, devs, 32, msg, sizeof msg);
    if (sum)
        *sum = s;
    if (n < 0) {
        fprintf(stderr, "sparge check: %s\n", msg);
        return n == -2 ? 2 : 1;
    }
    if (n == 0) {
        fprintf(stderr, "sparge check: %s is compiled in but has no device here\n", msg);
        return 1;
    }
    if (sparge_device_open("cpu-ref", &ref) != SPARGE_OK) {
        fprintf(stderr, "sparge check: cannot open cpu-ref: %s\n", sparge_last_error());
        for (int i = 0; i < n; i++)
            sparge_device_close(devs[i]);
        return 1;
    }
    int cases = 0, name_w = 4, shape_w = 50; /* the columns as wide as their longest entry */
    for (int i = 0; i < check_case_count(); i++)
        if (applies(cfg, check_case_get(i))) {
            char shape[192];
            const size_t len = strlen(check_case_get(i)->name);
            shape_text(check_case_get(i), shape, sizeof shape);
            name_w = len > (size_t)name_w ? (int)len : name_w;
            shape_w = strlen(shape) > (size_t)shape_w ? (int)strlen(shape) : shape_w;
            cases++;
        }
    if (!cases) {
        fprintf(stderr, "sparge check: no case of the %s grid matches \"%s\"\n", cfg->full ? "full" : "quick",
                cfg->filter ? cfg->filter : "");
        for (int i = 0; i < n; i++)
            sparge_device_close(devs[i]);
        sparge_device_close(ref);
        return 2;
    }
    fprintf(out, "mode %s; %s grid, %d cases%s%s%s\n", modes[cfg->mode], cfg->full ? "full" : "quick", cases,
            cfg->filter ? " matching \"" : "", cfg->filter ? cfg->filter : "", cfg->filter ? "\"" : "");
    for (int i = 0; i < n; i++) {
        fprintf(out, "device %s: %s; options", sparge_device_name(devs[i]), sparge_device_description(devs[i]));
        for (int j = 0; j < sparge_device_option_count(devs[i]); j++) {
            const char *name, *value;
            if (sparge_device_option(devs[i], j, &name, &value, NULL, NULL, NULL) == SPARGE_OK)
                fprintf(out, " %s=%s", name, value);
        }
        fputc('\n', out);
    }
    if (msg[0])
        fprintf(out, "compiled in, no device present: %s\n", msg);
    fprintf(out, "%-11s %-15s %-*s %-*s %-22s %s\n", "result", "device", name_w, "case", shape_w,
            "shape BxHxNqxNk D bqxbk [kvHkv causal varlen] mask",
            "tier", cfg->mode == CHECK_MODE_PERF ? " sparsity   mask ms    fwd ms   TFLOP/s    bwd ms   TFLOP/s"
                                                 : "errors (relative L2)");
    for (int i = 0; i < check_case_count(); i++)
        if (applies(cfg, check_case_get(i)))
            run_case(cfg, check_case_get(i), devs, n, ref, &s, out, name_w, shape_w);
    s.devices = n;
    fprintf(out, "\n%d passed, %d failed, %d unsupported, %d skipped (cases x devices) on %d device%s\n", s.passed,
            s.failed, s.unsupported, s.skipped, n, n == 1 ? "" : "s");
    for (int i = 0; i < n; i++)
        sparge_device_close(devs[i]);
    sparge_device_close(ref);
    if (sum)
        *sum = s;
    return s.failed ? 1 : 0;
}
