/* Block mean-pooling: block i of `block` tokens (the last one may be partial) becomes the mean of its rows. With
 * sequence offsets, each packed sequence is pooled on its own (blocks never cross a sequence boundary) and the
 * rows past a sequence's blocks are zero. */
#include <stdio.h>

#include "cpu.h"

/* Pooling unit b of the output: its tensor batch index, first token and tokens. */
static void pool_unit(const sparge_pool_args *a, int64_t b, int64_t *xb, int64_t *t0, int64_t *n)
{
    if (a->seq) {
        *xb = 0, *t0 = a->seq[b], *n = a->seq[b + 1] - a->seq[b];
        return;
    }
    *xb = b, *t0 = 0, *n = a->x.N;
}

/* cpu-ref: each mean summed in fp64, in token order. */
sparge_status sparge_ref_pool(void *impl, const sparge_pool_args *a)
{
    (void)impl;
    const sparge_view *x = &a->x, *o = &a->out;
    for (int64_t b = 0; b < o->B; b++) {
        int64_t xb, first, n;
        pool_unit(a, b, &xb, &first, &n);
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t i = 0; i < o->N; i++) {
                const int64_t rows = i * a->block < n ? block_rows(i, a->block, n) : 0, t0 = first + i * a->block;
                for (int64_t d = 0; d < x->D; d++) {
                    double sum = 0.0;
                    for (int64_t t = t0; t < t0 + rows; t++)
                        sum += view_load_f64(x, view_offset(x, xb, h, t, d));
                    view_store_f64(o, view_offset(o, b, h, i, d), rows ? sum / (double)rows : 0.0);
                }
            }
    }
    return SPARGE_OK;
}

/* cpu: fp32 sums of whole rows. When the heads of a token are adjacent (BNHD: sh = D, sd = 1), a task sums
 * every head of a block at once, as rows of H·D elements, so that the reads are sequential; otherwise a task is
 * one (b, h, block). Tasks go block by block, so a thread's share is one contiguous span of either layout. */
sparge_status sparge_cpu_pool(void *impl, const sparge_pool_args *a)
{
    const cpu_ctx *ctx = impl;
    const sparge_view *x = &a->x, *o = &a->out;
    int fused = x->H > 1 && x->sd == 1 && x->sh == x->D;
    int64_t D = x->D, heads = fused ? x->H : 1, width = heads * D, groups = o->B * (fused ? 1 : x->H);
    int64_t tasks = groups * o->N;
    int failed = 0;
#pragma omp parallel
    {
        float *acc = malloc((size_t)width * sizeof *acc);
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t i = t / groups, g = t % groups, b = fused ? g : g / x->H, h = fused ? 0 : g % x->H;
                int64_t xb, first, n;
                pool_unit(a, b, &xb, &first, &n);
                const int64_t rows = i * a->block < n ? block_rows(i, a->block, n) : 0;
                memset(acc, 0, (size_t)width * sizeof *acc);
                if (rows) {
                    ctx->simd->sum_rows(row_ptr(x, xb, h, first + i * a->block), x->dtype, x->sn, x->sd, rows, width, acc);
                    for (int64_t e = 0; e < width; e++)
                        acc[e] /= (float)rows;
                }
                for (int64_t hh = 0; hh < heads; hh++)
                    ctx->simd->store(acc + hh * D, D, NULL, 1, D, row_ptr(o, b, h + hh, i), o->dtype, o->sn, o->sd);
            }
        }
        free(acc);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for pooling") : SPARGE_OK;
}
