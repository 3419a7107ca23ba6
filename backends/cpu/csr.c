/* The mask's index lists from its dense view, for both tiers: the CSR rows and the transpose. */
#include "cpu.h"

/* Per head, each line of dense (a query-block row of Nkb flags, or with by_key a key-block column of Nqb) as the
 * ascending positions it keeps, -1 past its count: the CSR rows, or the transpose. */
static void index_lines(void *impl, const sparge_mask_view *m, int by_key)
{
    const int64_t lines = by_key ? m->Nkb : m->Nqb, len = by_key ? m->Nqb : m->Nkb;
    const int64_t line_step = by_key ? 1 : m->Nkb, flag_step = by_key ? m->Nkb : 1, bh_n = m->B * m->H;
    int32_t *counts = by_key ? m->t_counts : m->counts, *indices = by_key ? m->t_indices : m->indices;
    (void)impl; /* read by the OpenMP pragma alone */
#pragma omp parallel for schedule(static) if (impl != NULL)
    for (int64_t bh = 0; bh < bh_n; bh++)
        for (int64_t l = 0; l < lines; l++) {
            const uint8_t *flags = m->dense + bh * m->Nqb * m->Nkb + l * line_step;
            int32_t *idx = indices + (bh * lines + l) * len, c = 0;
            for (int64_t p = 0; p < len; p++)
                if (flags[p * flag_step])
                    idx[c++] = (int32_t)p;
            counts[bh * lines + l] = c;
            for (int64_t p = c; p < len; p++)
                idx[p] = -1;
        }
}

sparge_status sparge_cpu_mask_from_dense(void *impl, const sparge_mask_view *m)
{
    index_lines(impl, m, 0);
    return SPARGE_OK;
}

sparge_status sparge_cpu_mask_transpose(void *impl, const sparge_mask_view *m)
{
    index_lines(impl, m, 1);
    return SPARGE_OK;
}
