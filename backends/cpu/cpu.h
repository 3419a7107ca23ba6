/* The CPU backend's two tiers, one file per op (docs/DESIGN.md, "Architecture"): each of pool.c, map.c,
 * select.c, forward.c and backward.c holds the op's fp64 reference (tier "cpu-ref", scalar, one thread: the
 * oracle every backend is tested against) beside its fast path (tier "cpu": OpenMP, SIMD micro-kernels of
 * simd.c chosen at run time); csr.c builds the CSR rows and the transpose for both; backend.c holds the ops
 * tables, the tiers' limits and the device plumbing. */
#ifndef SPARGE_CPU_H
#define SPARGE_CPU_H

#include <stdlib.h>
#include <string.h>

#include "../../src/backend.h"
#include "simd.h"

/* The "cpu" tier's device state; "cpu-ref" has none (impl NULL). */
typedef struct {
    const sparge_simd_ops *simd;
} cpu_ctx;

/* Forward and backward of both tiers serve head dimensions up to this. */
#define SPARGE_CPU_MAX_D 256

static inline int64_t view_offset(const sparge_view *v, int64_t b, int64_t h, int64_t n, int64_t d)
{
    return b * v->sb + h * v->sh + n * v->sn + d * v->sd;
}

static inline float view_load(const sparge_view *v, int64_t off)
{
    switch (v->dtype) {
    case SPARGE_F16: return sparge_f16_to_f32(((const uint16_t *)v->data)[off]);
    case SPARGE_BF16: return sparge_bf16_to_f32(((const uint16_t *)v->data)[off]);
    default: return ((const float *)v->data)[off];
    }
}

static inline void view_store(const sparge_view *v, int64_t off, float x)
{
    switch (v->dtype) {
    case SPARGE_F16: ((uint16_t *)v->data)[off] = sparge_f32_to_f16(x); break;
    case SPARGE_BF16: ((uint16_t *)v->data)[off] = sparge_f32_to_bf16(x); break;
    default: ((float *)v->data)[off] = x; break;
    }
}

/* The reference's loads and stores: exact for f64 storage. */
static inline double view_load_f64(const sparge_view *v, int64_t off)
{
    return v->dtype == SPARGE_F64 ? ((const double *)v->data)[off] : (double)view_load(v, off);
}

static inline void view_store_f64(const sparge_view *v, int64_t off, double x)
{
    if (v->dtype == SPARGE_F64)
        ((double *)v->data)[off] = x;
    else
        view_store(v, off, (float)x);
}

/* Address of element (b, h, n, 0) of x. */
static inline void *row_ptr(const sparge_view *x, int64_t b, int64_t h, int64_t n)
{
    return (char *)x->data + (size_t)view_offset(x, b, h, n, 0) * sparge_dtype_size(x->dtype);
}

/* Rows of block i of `block` tokens out of n (the last block may be partial). */
static inline int64_t block_rows(int64_t i, int64_t block, int64_t n)
{
    return i * block + block <= n ? block : n - i * block;
}

/* Per-thread scratch of the fast tier: all buffers or none, 64-byte aligned. */
enum { CPU_MAX_SCRATCH = 10 };
typedef struct {
    float *buf[CPU_MAX_SCRATCH];
} cpu_scratch;

static inline int cpu_scratch_alloc(cpu_scratch *s, const size_t *floats, int n)
{
    int ok = 1;
    memset(s, 0, sizeof *s);
    for (int i = 0; i < n; i++)
        ok &= (s->buf[i] = aligned_alloc(64, (floats[i] * sizeof(float) + 63) / 64 * 64)) != NULL;
    return ok;
}

static inline void cpu_scratch_free(cpu_scratch *s)
{
    for (int i = 0; i < CPU_MAX_SCRATCH; i++)
        free(s->buf[i]);
}

/* Query-indexed tiles of the fast tier are padded to whole vectors (and 64-byte rows). */
static inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

/* Rows [n0, n0 + rows) of x as f32 rows: the view itself when it is f32 with unit d-stride (no copy), else
 * converted into buf. Sets *ld to the row stride. */
static inline const float *rows_f32(const sparge_simd_ops *k_, const sparge_view *x, int64_t b, int64_t h, int64_t n0,
                                    int64_t rows, float *buf, int64_t *ld)
{
    if (x->dtype == SPARGE_F32 && x->sd == 1) {
        *ld = x->sn;
        return row_ptr(x, b, h, n0);
    }
    k_->load(row_ptr(x, b, h, n0), x->dtype, x->sn, x->sd, rows, x->D, 1.0f, buf, x->D, 0);
    *ld = x->D;
    return buf;
}

/* Ask for `bytes` at p to be brought towards L2 while the current block is computed: kept key blocks are
 * scattered, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_span(const void *p, size_t bytes)
{
#if defined(__GNUC__)
    for (size_t off = 0; off < bytes; off += 64)
        __builtin_prefetch((const char *)p + off, 0, 2);
#else
    (void)p, (void)bytes;
#endif
}

/* prefetch_span of rows [n0, n0 + rows) of x. */
static inline void prefetch_rows(const sparge_view *x, int64_t b, int64_t h, int64_t n0, int64_t rows)
{
    size_t bytes = (size_t)(x->D * x->sd) * sparge_dtype_size(x->dtype);
    for (int64_t r = 0; r < rows; r++)
        prefetch_span(row_ptr(x, b, h, n0 + r), bytes);
}

/* Where the kept key blocks of one query block come from: K/V head hk of batch b, the sequence's keys from token k0
 * (nks of them, in blocks of bk), staged through kbuf and vbuf when their rows are not f32. */
typedef struct {
    const sparge_simd_ops *k_;
    const sparge_view *kv, *vv;
    int64_t b, hk, k0, bk, nks;
    float *kbuf, *vbuf;
} kv_source;

/* One key block's K and V rows as f32 tiles (leading dimensions ldk, ldv). */
typedef struct {
    const float *k, *v;
    int64_t ldk, ldv, rows;
} kv_tile;

/* The tile of kept key block idx[c] (of cnt), the next kept block's rows prefetched. */
static inline kv_tile kv_block_f32(const kv_source *src, const int32_t *idx, int64_t c, int64_t cnt)
{
    const int64_t j = idx[c], bk = src->bk, nks = src->nks;
    kv_tile t;
    t.rows = block_rows(j, bk, nks);
    if (c + 1 < cnt) {
        const int64_t jn = idx[c + 1], nkn = block_rows(jn, bk, nks);
        prefetch_rows(src->kv, src->b, src->hk, src->k0 + jn * bk, nkn);
        prefetch_rows(src->vv, src->b, src->hk, src->k0 + jn * bk, nkn);
    }
    t.k = rows_f32(src->k_, src->kv, src->b, src->hk, src->k0 + j * bk, t.rows, src->kbuf, &t.ldk);
    t.v = rows_f32(src->k_, src->vv, src->b, src->hk, src->k0 + j * bk, t.rows, src->vbuf, &t.ldv);
    return t;
}

/* cpu-ref: rows [n0, n0 + rows) of (b, h) of x as contiguous doubles [rows×D], and back. */
static inline void ref_gather(const sparge_view *x, int64_t b, int64_t h, int64_t n0, int64_t rows, double *out)
{
    for (int64_t n = 0; n < rows; n++)
        for (int64_t d = 0; d < x->D; d++)
            out[n * x->D + d] = view_load_f64(x, view_offset(x, b, h, n0 + n, d));
}

static inline void ref_scatter(const sparge_view *x, int64_t b, int64_t h, int64_t n0, int64_t rows, const double *src)
{
    for (int64_t n = 0; n < rows; n++)
        for (int64_t d = 0; d < x->D; d++)
            view_store_f64(x, view_offset(x, b, h, n0 + n, d), src[n * x->D + d]);
}

/* cpu-ref: n buffers of the given element counts, all or none. */
static inline int ref_alloc_all(int n, double **bufs, const int64_t *counts)
{
    int ok = 1;
    for (int i = 0; i < n; i++)
        ok &= (bufs[i] = malloc((size_t)counts[i] * sizeof(double))) != NULL;
    if (!ok)
        for (int i = 0; i < n; i++)
            free(bufs[i]);
    return ok;
}

static inline void ref_free_all(int n, double **bufs)
{
    for (int i = 0; i < n; i++)
        free(bufs[i]);
}

/* The head's slice of the dense mask, or NULL for dense attention. */
static inline const uint8_t *ref_head_keep(const sparge_mask_view *m, int64_t b, int64_t h)
{
    return m ? m->dense + (b * m->H + h) * m->Nqb * m->Nkb : NULL;
}

/* The units of an attention call: B·H (sequence, query head) pairs of the mask's layout, or of the views. */
static inline int64_t attn_batches(const sparge_view *q, const sparge_mask_view *m) { return m ? m->B : q->B; }

/* Index of query t of sequence b, head h in the LSE: [B, H, Nq], or [H, T] for packed varlen views. */
static inline int64_t lse_index(const sparge_view *q, int64_t tb, int64_t h, int64_t t)
{
    return (tb * q->H + h) * q->N + t;
}

/* Sequence b of a mask's layout: the tensors' batch index (0 for packed varlen views), the first query and key
 * tokens and their counts. m NULL: the fixed lengths Nq, Nk of batch b. */
static inline void cpu_seq(const sparge_mask_view *m, int64_t b, int64_t Nq, int64_t Nk, int64_t *tb, int64_t *q0,
                           int64_t *nq, int64_t *k0, int64_t *nk)
{
    if (m && m->seq_q) {
        *tb = 0, *q0 = m->seq_q[b], *nq = m->seq_q[b + 1] - m->seq_q[b];
        *k0 = m->seq_k[b], *nk = m->seq_k[b + 1] - m->seq_k[b];
        return;
    }
    *tb = b, *q0 = *k0 = 0, *nq = Nq, *nk = Nk;
}

/* Row i (query block) of sequence b under the layout m: 0 when it lies past the sequence's query blocks, else 1
 * with its allowed key blocks [0, *allowed) and always-kept diagonal blocks *d0..*d1 (sparge_row_rule). */
static inline int cpu_row(const sparge_mask_view *m, int64_t b, int64_t i, int64_t *allowed, int64_t *d0, int64_t *d1)
{
    int64_t tb, q0, nq, k0, nk;
    cpu_seq(m, b, m->Nq, m->Nk, &tb, &q0, &nq, &k0, &nk);
    if (i * m->bq >= nq)
        return 0;
    sparge_row_rule(i, nq, nk, m->bq, m->bk, m->causal, allowed, d0, d1);
    return 1;
}

/* Kept key blocks of query block i of head bh: NULL mask = all. Returns the count; idx points at the row's
 * ascending indices (all: scratch of Nkb filled with 0..nkb-1). */
static inline int64_t kept_blocks(const sparge_mask_view *m, int64_t bh, int64_t i, int64_t nkb, const int32_t **idx,
                                  int32_t *all)
{
    if (!m) {
        for (int64_t j = 0; j < nkb; j++)
            all[j] = (int32_t)j;
        *idx = all;
        return nkb;
    }
    *idx = m->indices + (bh * m->Nqb + i) * m->Nkb;
    return m->counts[bh * m->Nqb + i];
}

/* An entry of a row being ordered: its value and its position. */
typedef struct {
    float value;
    int32_t index;
} cpu_ranked;

/* Hybrid Top-k ∪ Top-p selection of one pooled-map row of n entries (docs/DESIGN.md, "Masks"). order: scratch
 * of n entries. Sets keep[j] to 0/1, returns the kept count and the kept mass. A row holding NaN keeps every
 * block. */
int64_t sparge_select_row(const float *row, int64_t n, double topk, double topp, cpu_ranked *order, uint8_t *keep,
                          double *mass);
/* Number of blocks kept by Top-k alone (0 when topk = 0). */
int64_t sparge_topk_count(double topk, int64_t n);

/* Causal: -inf in Sᵀ [nk keys × nq queries, row stride ldt] where key u0 + r lies past query t0 + c's diagonal
 * (u0 + r > t0 + c + off, off = Nk − Nq of the sequence). */
void sparge_cpu_causal_tile(float *st, int64_t ldt, int64_t nk, int64_t nq, int64_t u0, int64_t t0, int64_t off);

/* Per-op entry points: ref_* of "cpu-ref" (impl NULL), cpu_* of "cpu". */
sparge_status sparge_ref_pool(void *impl, const sparge_pool_args *a);
sparge_status sparge_cpu_pool(void *impl, const sparge_pool_args *a);
sparge_status sparge_ref_pooled_map(void *impl, const sparge_map_args *a);
sparge_status sparge_cpu_pooled_map(void *impl, const sparge_map_args *a);
sparge_status sparge_ref_mask_select(void *impl, const sparge_select_args *a);
sparge_status sparge_cpu_mask_select(void *impl, const sparge_select_args *a);
sparge_status sparge_ref_forward(void *impl, const sparge_fwd_args *a);
sparge_status sparge_cpu_forward(void *impl, const sparge_fwd_args *a);
sparge_status sparge_ref_backward(void *impl, const sparge_bwd_args *a);
sparge_status sparge_cpu_backward(void *impl, const sparge_bwd_args *a);
/* CSR rows (counts, indices) from m->dense, and the transpose (t_counts, t_indices); threaded when impl is
 * the fast tier's. */
sparge_status sparge_cpu_mask_from_dense(void *impl, const sparge_mask_view *m);
sparge_status sparge_cpu_mask_transpose(void *impl, const sparge_mask_view *m);

#endif
