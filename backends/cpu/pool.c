/* Block mean-pooling: block i of `block` tokens (the last one may be partial) becomes the mean of its rows. */
#include <stdio.h>

#include "cpu.h"

/* cpu-ref: each mean summed in fp64, in token order. */
sparge_status sparge_ref_pool(void *impl, const sparge_pool_args *a)
{
    (void)impl;
    const sparge_view *x = &a->x, *o = &a->out;
    for (int64_t b = 0; b < x->B; b++)
        for (int64_t h = 0; h < x->H; h++)
            for (int64_t i = 0; i < o->N; i++) {
                int64_t t0 = i * a->block, t1 = t0 + block_rows(i, a->block, x->N);
                for (int64_t d = 0; d < x->D; d++) {
                    double sum = 0.0;
                    for (int64_t t = t0; t < t1; t++)
                        sum += view_load_f64(x, view_offset(x, b, h, t, d));
                    view_store_f64(o, view_offset(o, b, h, i, d), sum / (double)(t1 - t0));
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
    int64_t D = x->D, heads = fused ? x->H : 1, width = heads * D, groups = x->B * (fused ? 1 : x->H);
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
                int64_t rows = block_rows(i, a->block, x->N);
                memset(acc, 0, (size_t)width * sizeof *acc);
                ctx->simd->sum_rows(row_ptr(x, b, h, i * a->block), x->dtype, x->sn, x->sd, rows, width, acc);
                for (int64_t e = 0; e < width; e++)
                    acc[e] /= (float)rows;
                for (int64_t hh = 0; hh < heads; hh++)
                    ctx->simd->store(acc + hh * D, D, NULL, 1, D, row_ptr(o, b, h + hh, i), o->dtype, o->sn, o->sd);
            }
        }
        free(acc);
    }
    return failed ? SPARGE_FAIL(SPARGE_ERR_OUT_OF_MEMORY, "cpu: out of host memory for pooling") : SPARGE_OK;
}
