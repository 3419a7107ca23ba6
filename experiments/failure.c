/* exp_failure: the paper's Fig. 1 failure analysis.
 *
 * Part 1, the paper's toy rows, selected by the library from a given pooled
 * map: a sink row [0.6, 0.2, 0.1, rest flat] and a flat row, under Top-k,
 * Top-p and hybrid.
 * Part 2, per query-block row of each input family: kept block count, kept
 * pooled mass and the row's relative L1 output error, for the paper's arms
 * (Top-k 0.05, Top-p 0.4, hybrid 0.03/0.2) and for the three rules at equal
 * sparsity (as in Table 1). --rows-csv writes every row; --csv the summary. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

static void usage(void)
{
    fputs("usage: exp_failure [--families uniform,sink,video] [--rows-csv PATH] [options]\n", stderr);
    exp_opts_usage(stderr);
}

/* Part 1: two hand-made pooled rows over 64 key blocks. */
static int toy_rows(const exp_opts *o, FILE *md)
{
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
        return -1;
    if (exp_check(sparge_mask_create(dev, 1, 1, 2 * 128, NKB * 64, 128, 64, &mask), "sparge_mask_create") ||
        exp_check(sparge_malloc(dev, sizeof map, &dmap), "sparge_malloc") ||
        exp_check(sparge_memcpy_to_device(dev, dmap, map, sizeof map), "sparge_memcpy_to_device"))
        return -1;
    sparge_tensor t = sparge_tensor_bhnd(dmap, SPARGE_F32, 1, 1, 2, NKB);
    static const exp_rule toy[] = {{"Top-k", 0.05, 0.0}, {"Top-p", 0.0, 0.6}, {"hybrid", 0.05, 0.6}};
    fprintf(md, "Toy rows (64 key blocks), selected by sparge_mask_select:\n\n"
                "| row | rule | k | p | kept blocks | kept mass | paper |\n|---|---|---|---|---|---|---|\n");
    for (int r = 0; r < 3; r++) {
        sparge_mask_params mp = {128, 64, toy[r].k, toy[r].p, 0.0f};
        int32_t counts[2];
        float mass[2];
        sparge_mask_stats st;
        if (exp_check(sparge_mask_select(dev, &t, &mp, mask), "sparge_mask_select") ||
            exp_check(sparge_mask_get_csr(mask, counts, NULL, NULL, NULL), "sparge_mask_get_csr") ||
            exp_check(sparge_mask_get_stats(mask, &st, NULL, mass), "sparge_mask_get_stats"))
            return -1;
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

int main(int argc, char **argv)
{
    exp_opts o;
    exp_opts_init(&o);
    const char *rows_csv_path = NULL;
    double topk = 0.05, hybrid_k = 0.03;
    for (int i = 1; i < argc; i++) {
        int r = exp_opts_parse(&o, argc, argv, &i);
        if (r < 0)
            return 2;
        if (r)
            continue;
        if (!strcmp(argv[i], "--rows-csv") && i + 1 < argc)
            rows_csv_path = argv[++i];
        else {
            usage();
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    FILE *csv = exp_open_out(o.csv), *rows_csv = exp_open_out(rows_csv_path), *md = exp_open_md(o.md);
    if ((o.csv && !csv) || (rows_csv_path && !rows_csv) || !md)
        return 1;
    if (toy_rows(&o, md))
        return 1;
    if (csv)
        fprintf(csv, "family,setting,rule,k,p,sparsity,blocks_mean,blocks_min,blocks_max,mass_mean,mass_min,"
                     "one_block_rows,rel_l1,kind_a,rel_l1_a,kind_b,rel_l1_b\n");
    if (rows_csv)
        fprintf(rows_csv, "family,setting,rule,head,row,kind,sink_share,kept_blocks,kept_mass,row_rel_l1\n");
    fprintf(md, "Per-row statistics on each family (kept pooled mass from the mask; rel. L1 of the output):\n\n"
                "| input | setting | rule | k | p | sparsity | kept blocks mean [min, max] | kept mass mean (min) "
                "| rows with 1 block | rel. L1 | rel. L1 by row kind |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int fi = 0; fi < o.nfamilies; fi++) {
        exp_family f = (exp_family)o.families[fi];
        exp_qkv x;
        exp_gen_params g;
        if (exp_family_input(&o, f, 0, &g, &x))
            return 1;
        exp_session s;
        double t0 = exp_now();
        if (exp_session_open(&s, o.backend, o.ref_backend, &x, o.dtype, g.block_q, g.block_k))
            return 1;
        exp_progress(&o, "fig1", "%s: dense reference on %s done (%.1fs)", x.label, sparge_device_name(s.dev),
                     exp_now() - t0);
        exp_rule equal[EXP_RULES];
        if (exp_equal_sparsity_rules(&s, topk, hybrid_k, equal))
            return 1;
        int32_t *counts = malloc(sizeof(int32_t) * (size_t)s.rows);
        float *mass = malloc(sizeof(float) * (size_t)s.rows);
        double *err = malloc(sizeof(double) * (size_t)s.rows);
        if (!counts || !mass || !err)
            return 1;
        for (int setting = 0; setting < 2; setting++)
            for (int rule = 0; rule < EXP_RULES; rule++) {
                const exp_rule *ru = setting ? &equal[rule] : &exp_paper_arms[rule];
                const char *sname = setting ? "equal-sparsity" : "paper-arms";
                exp_point pt;
                if (exp_measure(&s, ru->k, ru->p, &pt) || exp_row_stats(&s, counts, mass, err))
                    return 1;
                double bmean = 0.0, mmean = 0.0, mmin = INFINITY;
                int32_t bmin = INT32_MAX, bmax = 0;
                int64_t ones = 0;
                const char *ka = f == EXP_UNIFORM ? "flat" : f == EXP_SINK ? "strong-sink" : "all";
                const char *kb = f == EXP_UNIFORM ? "hub" : f == EXP_SINK ? "weak-sink" : "";
                kind_err ke = {{0, 0}, {0, 0}};
                for (int64_t r = 0; r < s.rows; r++) {
                    bmean += (double)counts[r] / (double)s.rows;
                    mmean += mass[r] / (double)s.rows;
                    mmin = mass[r] < mmin ? mass[r] : mmin;
                    bmin = counts[r] < bmin ? counts[r] : bmin;
                    bmax = counts[r] > bmax ? counts[r] : bmax;
                    ones += counts[r] == 1;
                    const char *kind = f == EXP_FILE ? "all" : row_kind(&x, f, r);
                    /* row error weighted back to the global L1 normalization */
                    int64_t bh = r / s.Nqb, i = r % s.Nqb, t0r = i * s.block_q;
                    int64_t t1r = t0r + s.block_q < x.N ? t0r + s.block_q : x.N;
                    double den = 0.0;
                    for (int64_t e = (bh * x.N + t0r) * x.D; e < (bh * x.N + t1r) * x.D; e++)
                        den += fabs((double)s.o_ref[e]);
                    int slot = strcmp(kind, ka) == 0 ? 0 : 1;
                    ke.err_num[slot] += err[r] * den;
                    ke.err_den[slot] += den;
                    if (rows_csv)
                        fprintf(rows_csv, "%s,%s,%s,%lld,%lld,%s,%.4f,%d,%.6f,%.6f\n", exp_family_name(f), sname,
                                ru->name, (long long)bh, (long long)i, kind,
                                x.sink_share ? x.sink_share[r] : -1.0, counts[r], mass[r], err[r]);
                }
                double ea = ke.err_den[0] > 0 ? ke.err_num[0] / ke.err_den[0] : NAN;
                double eb = ke.err_den[1] > 0 ? ke.err_num[1] / ke.err_den[1] : NAN;
                char kinds[96] = "—";
                if (*kb)
                    snprintf(kinds, sizeof kinds, "%s %.4f, %s %.4f", ka, ea, kb, eb);
                fprintf(md, "| %s | %s | %s | %.4f | %.4f | %.2f %% | %.2f [%d, %d] | %.3f (%.3f) | %.1f %% | %.4f "
                            "| %s |\n",
                        x.label, sname, ru->name, ru->k, ru->p, 100.0 * pt.sparsity, bmean, bmin, bmax, mmean, mmin,
                        100.0 * (double)ones / (double)s.rows, pt.rel_l1, kinds);
                if (csv)
                    fprintf(csv, "%s,%s,%s,%.6f,%.6f,%.6f,%.4f,%d,%d,%.6f,%.6f,%.6f,%.6f,%s,%.6f,%s,%.6f\n",
                            exp_family_name(f), sname, ru->name, ru->k, ru->p, pt.sparsity, bmean, bmin, bmax, mmean,
                            mmin, (double)ones / (double)s.rows, pt.rel_l1, ka, ea, *kb ? kb : "-", eb);
                exp_progress(&o, "fig1", "  %-14s %-6s sparsity %.4f kept mass %.3f rel.L1 %.4f", sname, ru->name,
                             pt.sparsity, mmean, pt.rel_l1);
            }
        free(counts);
        free(mass);
        free(err);
        exp_session_close(&s);
        exp_qkv_free(&x);
    }
    exp_close_out(csv);
    exp_close_out(rows_csv);
    exp_close_out(md);
    return 0;
}
