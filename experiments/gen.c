/* exp_gen: generate an input family, print the statistics of its pooled map
 * (flatness, sink share against the requested one, locality), and optionally
 * save Q/K/V as safetensors (the same format the loader reads).
 *
 *   exp_gen --family sink [--out FILE.safetensors] [common options] */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

static int family = EXP_UNIFORM;
static const char *out;

static int run(exp_opts *o)
{
    FILE *md = o->md;
    exp_qkv x;
    exp_gen_params g;
    if (exp_family_input(o, o->input ? EXP_FILE : (exp_family)family, 0, &g, &x))
        return 1;
    int64_t nqb = (x.N + g.block_q - 1) / g.block_q, nkb = (x.N + g.block_k - 1) / g.block_k;
    double *map = malloc(sizeof(double) * (size_t)(x.B * x.H * nqb * nkb));
    if (!map)
        return 1;
    exp_pooled_map_host(&x, g.block_q, g.block_k, 0.0, map);
    exp_map_summary s;
    int video = !o->input && g.family == EXP_VIDEO;
    exp_map_summarize(&x, map, g.block_q, g.block_k, video ? g.grid_t : 0, g.grid_h, g.grid_w, &s);
    fprintf(md, "input: %s  B=%lld H=%lld N=%lld D=%lld  blocks %dx%d -> Nqb=%lld Nkb=%lld\n", x.label, (long long)x.B,
           (long long)x.H, (long long)x.N, (long long)x.D, g.block_q, g.block_k, (long long)nqb, (long long)nkb);
    fprintf(md, "pooled rows: normalized entropy mean %.4f (min %.4f, max %.4f); max/min within a row up to %.3g; "
           "mean top-1 share %.4f\n",
           s.entropy_mean, s.entropy_min, s.entropy_max, s.flat_ratio_max, s.top1_mean);
    if (x.sink_share)
        fprintf(md, "sinks: %d block(s), measured share mean %.4f, max |measured - requested| = %.2e\n", x.sink_blocks,
               s.sink_share_mean, s.sink_err_max);
    if (!isnan(s.locality))
        fprintf(md, "locality: mass-weighted block distance / unweighted = %.4f (1 = none)\n", s.locality);
    /* cumulative mass of the top 1, 2, 4, ... blocks, averaged over rows */
    fprintf(md, "mean cumulative mass of the top-n blocks:");
    float *row = malloc(sizeof(float) * (size_t)nkb);
    for (int64_t n = 1; n <= nkb; n *= 2) {
        double cum = 0.0;
        for (int64_t r = 0; r < x.B * x.H * nqb; r++) {
            for (int64_t j = 0; j < nkb; j++)
                row[j] = (float)map[r * nkb + j];
            /* partial selection: n passes of max (n is small relative to the cost of printing) */
            for (int64_t t = 0; t < n; t++) {
                int64_t best = 0;
                for (int64_t j = 1; j < nkb; j++)
                    best = row[j] > row[best] ? j : best;
                cum += row[best];
                row[best] = -1.0f;
            }
        }
        fprintf(md, " %lld:%.3f", (long long)n, cum / (double)(x.B * x.H * nqb));
    }
    fprintf(md, "\n");
    free(row);
    int rc = 0;
    if (out) {
        char err[640];
        const char *names[3] = {"q", "k", "v"};
        const float *data[3] = {x.q, x.k, x.v};
        int nd[3] = {4, 4, 4};
        int64_t shapes[3][8] = {{x.B, x.H, x.N, x.D}, {x.B, x.H, x.N, x.D}, {x.B, x.H, x.N, x.D}};
        char meta[256];
        snprintf(meta, sizeof meta, "{\"layout\":\"BHND\",\"source\":\"exp_gen %s seed %llu\"}", x.label,
                 (unsigned long long)g.seed);
        rc = exp_st_write(out, 3, names, data, nd, (const int64_t(*)[8])shapes, o->dtype, meta, err, sizeof err);
        if (rc)
            fprintf(stderr, "%s\n", err);
        else
            fprintf(md, "wrote %s\n", out);
    }
    free(map);
    exp_qkv_free(&x);
    return rc ? 1 : 0;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_CHOICE("--family", &family, "uniform|sink|video", "the synthetic family to generate")},
        {EXP_STR("--out", &out, "FILE", "save Q, K, V as safetensors, stored as --dtype")},
    };
    static const exp_driver d = {"exp_gen", "Pooled-map statistics of generated (or --input) Q/K/V; --out saves them.",
                                 "--backend --ref --csv --seeds --families --quiet", own, EXP_COUNT(own), .run = run};
    return exp_main(&d, argc, argv);
}
