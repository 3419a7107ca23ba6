/* exp_failure: the paper's Fig. 1 failure analysis.
 *
 * Part 1, the paper's toy rows, selected by the library from a given pooled
 * map: a sink row [0.6, 0.2, 0.1, rest flat] and a flat row, under Top-k,
 * Top-p and hybrid.
 * Part 2, per query-block row of each input family: kept block count, kept
 * pooled mass and the row's relative L1 output error, for the paper's arms
 * (Top-k 0.05, Top-p 0.4, hybrid 0.03/0.2) and for the three rules at equal
 * sparsity (as in Table 1: --topk, --hybrid-k). --rows-csv writes every row;
 * --csv the summary. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

/* Part 1: two hand-made pooled rows over 64 key blocks. Returns 0, or 1 after an error. */
static int toy_rows(exp_opts *o)
{
    FILE *md = o->md;
    enum { NKB = 64 };
    float map[2 * NKB];
    map[0] = 0.6f;
    map[1] = 0.2f;
    map[2] = 0.1f;
    for (int j = 3; j < NKB; j++)
        map[j] = 0.1f / (NKB - 3);
    for (int j = 0; j < NKB; j++)
        map[NKB + j] = 1.0f / NKB;
    sparge_device *dev;
    sparge_mask *mask;
    void *dmap;
    if (exp_check(sparge_device_open(o->backend, &dev), "sparge_device_open"))
        return 1;
    if (exp_check(sparge_mask_create(dev, 1, 1, 2 * 128, NKB * 64, 128, 64, &mask), "sparge_mask_create") ||
        exp_check(sparge_malloc(dev, sizeof map, &dmap), "sparge_malloc") ||
        exp_check(sparge_memcpy_to_device(dev, dmap, map, sizeof map), "sparge_memcpy_to_device"))
        return 1;
    sparge_tensor t = sparge_tensor_bhnd(dmap, SPARGE_F32, 1, 1, 2, NKB);
    static const exp_rule toy[] = {{"Top-k", 0.05, 0.0}, {"Top-p", 0.0, 0.6}, {"hybrid", 0.05, 0.6}};
    fprintf(md, "Toy rows (64 key blocks), selected by sparge_mask_select:\n\n"
                "| row | rule | k | p | kept blocks | kept mass | paper |\n|---|---|---|---|---|---|---|\n");
    for (int r = 0; r < 3; r++) {
        sparge_mask_params mp = {128, 64, toy[r].k, toy[r].p, 0.0f, 0};
        int32_t counts[2];
        float mass[2];
        sparge_mask_stats st;
        if (exp_check(sparge_mask_select(dev, &t, &mp, mask), "sparge_mask_select") ||
            exp_check(sparge_mask_get_csr(mask, counts, NULL, NULL, NULL), "sparge_mask_get_csr") ||
            exp_check(sparge_mask_get_stats(mask, &st, NULL, mass), "sparge_mask_get_stats"))
            return 1;
        static const char *const paper_sink[] = {"—", "keeps only the sink (1 block, 0.6)", "—"};
        static const char *const paper_flat[] = {"keeps too little mass", "—", "—"};
        fprintf(md, "| sink [0.6, 0.2, 0.1, flat] | %s | %.2f | %.2f | %d | %.3f | %s |\n", toy[r].name, toy[r].k,
                toy[r].p, counts[0], mass[0], paper_sink[r]);
        fprintf(md, "| flat [1/64 …] | %s | %.2f | %.2f | %d | %.3f | %s |\n", toy[r].name, toy[r].k, toy[r].p,
                counts[1], mass[1], paper_flat[r]);
    }
    fprintf(md, "\n");
    sparge_free(dev, dmap);
    sparge_mask_destroy(mask);
    sparge_device_close(dev);
    return 0;
}

/* Row kind for the summary: the uniform family's rows with the hub overlay,
 * the sink family's strong sinks (share >= 0.55), and the rest. */
static const char *row_kind(const exp_qkv *x, exp_family f, int64_t r)
{
    if (f == EXP_UNIFORM)
        return x->sink_share && x->sink_share[r] >= 0.0 ? "hub" : "flat";
    if (f == EXP_SINK)
        return x->sink_share[r] >= 0.55 ? "strong-sink" : "weak-sink";
    return "all";
}

typedef struct {
    double err_num[2], err_den[2]; /* per kind (0: first kind, 1: second) */
} kind_err;

static FILE *rows;

static const char csv_header[] = "family,setting,rule,k,p,sparsity,blocks_mean,blocks_min,blocks_max,mass_mean,"
                                 "mass_min,one_block_rows,rel_l1,kind_a,rel_l1_a,kind_b,rel_l1_b\n";
static const char md_header[] =
    "Per-row statistics on each family (kept pooled mass from the mask; rel. L1 of the output):\n\n"
    "| input | setting | rule | k | p | sparsity | kept blocks mean [min, max] | kept mass mean (min) "
    "| rows with 1 block | rel. L1 | rel. L1 by row kind |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n";
static const char rows_header[] = "family,setting,rule,head,row,kind,sink_share,kept_blocks,kept_mass,row_rel_l1\n";

static int each(exp_opts *o, exp_input *in)
{
    exp_family f = in->family;
    exp_session *s = &in->s;
    const exp_qkv *x = &in->x;
    const int32_t *counts = s->row_count;
    const float *mass = s->row_mass;
    const double *err = s->row_err;
    for (int setting = 0; setting < 2; setting++)
        for (int rule = 0; rule < EXP_RULES; rule++) {
            const exp_rule *ru = setting ? &in->equal[rule] : &exp_paper_arms[rule];
            const char *sname = setting ? "equal-sparsity" : "paper-arms";
            exp_point pt;
            if (exp_measure(s, ru->k, ru->p, &pt) || exp_row_stats(s))
                return 1;
            double bmean = 0.0, mmean = 0.0, mmin = INFINITY;
            int32_t bmin = INT32_MAX, bmax = 0;
            int64_t ones = 0;
            const char *ka = f == EXP_UNIFORM ? "flat" : f == EXP_SINK ? "strong-sink" : "all";
            const char *kb = f == EXP_UNIFORM ? "hub" : f == EXP_SINK ? "weak-sink" : "";
            kind_err ke = {{0, 0}, {0, 0}};
            for (int64_t r = 0; r < s->rows; r++) {
                bmean += (double)counts[r] / (double)s->rows;
                mmean += mass[r] / (double)s->rows;
                mmin = mass[r] < mmin ? mass[r] : mmin;
                bmin = counts[r] < bmin ? counts[r] : bmin;
                bmax = counts[r] > bmax ? counts[r] : bmax;
                ones += counts[r] == 1;
                const char *kind = f == EXP_FILE ? "all" : row_kind(x, f, r);
                /* row error weighted back to the global L1 normalization */
                int slot = strcmp(kind, ka) == 0 ? 0 : 1;
                ke.err_num[slot] += err[r] * s->row_ref_l1[r];
                ke.err_den[slot] += s->row_ref_l1[r];
                if (rows)
                    fprintf(rows, "%s,%s,%s,%lld,%lld,%s,%.4f,%d,%.6f,%.6f\n", x->name, sname,
                            ru->name, (long long)(r / s->Nqb), (long long)(r % s->Nqb), kind,
                            x->sink_share ? x->sink_share[r] : -1.0, counts[r], mass[r], err[r]);
            }
            double ea = ke.err_den[0] > 0 ? ke.err_num[0] / ke.err_den[0] : NAN;
            double eb = ke.err_den[1] > 0 ? ke.err_num[1] / ke.err_den[1] : NAN;
            char kinds[96] = "—";
            if (*kb)
                snprintf(kinds, sizeof kinds, "%s %.4f, %s %.4f", ka, ea, kb, eb);
            fprintf(o->md, "| %s | %s | %s | %.4f | %.4f | %.2f %% | %.2f [%d, %d] | %.3f (%.3f) | %.1f %% | %.4f "
                        "| %s |\n",
                    x->label, sname, ru->name, ru->k, ru->p, 100.0 * pt.sparsity, bmean, bmin, bmax, mmean, mmin,
                    100.0 * (double)ones / (double)s->rows, pt.rel_l1, kinds);
            if (o->csv)
                fprintf(o->csv, "%s,%s,%s,%.6f,%.6f,%.6f,%.4f,%d,%d,%.6f,%.6f,%.6f,%.6f,%s,%.6f,%s,%.6f\n",
                        x->name, sname, ru->name, ru->k, ru->p, pt.sparsity, bmean, bmin, bmax, mmean,
                        mmin, (double)ones / (double)s->rows, pt.rel_l1, ka, ea, *kb ? kb : "-", eb);
            exp_progress(o, "  %-14s %-6s sparsity %.4f kept mass %.3f rel.L1 %.4f", sname, ru->name,
                         pt.sparsity, mmean, pt.rel_l1);
        }
    return 0;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_OUT("--rows-csv", &rows, "write every row's statistics as CSV to PATH"), .header = rows_header},
    };
    static const exp_driver d = {"exp_failure", "Where Top-k and Top-p fail: the paper's Fig. 1 analysis.", "--seeds",
                                 own, EXP_COUNT(own), csv_header, md_header, .equal = 1, .run = toy_rows,
                                 .each = each};
    return exp_main(&d, argc, argv);
}
