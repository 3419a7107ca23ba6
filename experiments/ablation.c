/* exp_ablation: mask-rule ablation without training — output error against
 * achieved sparsity for Top-k, Top-p and hybrid on each input family, plus
 * the paper's operating points (hybrid k = 0.03, p = 0.2; Top-k k = 0.05;
 * Top-p p = 0.4).
 *
 * Sweep: for each target sparsity s, Top-k keeps n = round((1 − s)·Nkb) blocks
 * per row; Top-p is calibrated to the same kept count; the hybrid keeps the
 * paper's ratio between its k and the Top-k arm's (0.03 / 0.05 = 0.6), i.e.
 * k = 0.6·n/Nkb, with p calibrated to the same count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

static double targets[32] = {0.80, 0.83, 0.86, 0.89, 0.92, 0.95, 0.97, 0.98}, ratio = 0.6;
static int ntargets = 8;
static char sweep_md[3][256]; /* the sweep's summary row of each family */
static int nsweep;

static const char csv_header[] =
    "family,kind,rule,k,p,kept_blocks,sparsity,token_density,mean_row_mass,rel_l1,rel_l2\n";
static const char md_header[] = "Paper operating points (each at its own sparsity):\n\n"
                                "| input | arm | k | p | sparsity | kept pooled mass | rel. L1 | rel. L2 |\n"
                                "|---|---|---|---|---|---|---|---|\n";

static int each(exp_opts *o, exp_input *in)
{
    exp_session *s = &in->s;
    const exp_qkv *x = &in->x;
    for (int a = 0; a < EXP_RULES; a++) {
        exp_point pt;
        const exp_rule *ru = &exp_paper_arms[a];
        if (exp_measure(s, ru->k, ru->p, &pt))
            return 1;
        fprintf(o->md, "| %s | %s | %.2f | %.2f | %.2f %% | %.3f | %.4f | %.4f |\n", x->label, ru->name, ru->k,
                ru->p, 100.0 * pt.sparsity, pt.mean_row_mass, pt.rel_l1, pt.rel_l2);
        if (o->csv)
            fprintf(o->csv, "%s,paper-arm,%s,%.6f,%.6f,%lld,%.6f,%.6f,%.6f,%.6f,%.6f\n", x->name,
                    ru->name, ru->k, ru->p, (long long)pt.kept, pt.sparsity, pt.token_density, pt.mean_row_mass,
                    pt.rel_l1, pt.rel_l2);
    }
    /* sweep; mean error over the sweep per rule, and how often each rule is best */
    double mean_err[EXP_RULES] = {0};
    int best[EXP_RULES] = {0}, points = 0;
    int64_t last_n = -1;
    for (int ti = 0; ti < ntargets; ti++) {
        int64_t n = (int64_t)llround((1.0 - targets[ti]) * (double)s->Nkb);
        n = n < 1 ? 1 : n;
        if (n == last_n)
            continue; /* two targets that round to the same count */
        last_n = n;
        int64_t target = s->rows * n;
        double kt = exp_topk_for_count(n, s->Nkb), kh = ratio * kt, pp, ph;
        exp_point pt[EXP_RULES];
        if (exp_measure(s, kt, 0.0, &pt[EXP_TOPK]) || exp_calibrate_p(s, 0.0, target, &pp) < 0 ||
            exp_measure(s, 0.0, pp, &pt[EXP_TOPP]) || exp_calibrate_p(s, kh, target, &ph) < 0 ||
            exp_measure(s, kh, ph, &pt[EXP_HYBRID]))
            return 1;
        int b = 0;
        for (int r = 0; r < EXP_RULES; r++) {
            static const char *const names[] = {"Top-k", "Top-p", "hybrid"};
            mean_err[r] += pt[r].rel_l1;
            b = pt[r].rel_l1 < pt[b].rel_l1 ? r : b;
            if (o->csv)
                fprintf(o->csv, "%s,sweep,%s,%.6f,%.6f,%lld,%.6f,%.6f,%.6f,%.6f,%.6f\n", x->name,
                        names[r], pt[r].k, pt[r].p, (long long)pt[r].kept, pt[r].sparsity, pt[r].token_density,
                        pt[r].mean_row_mass, pt[r].rel_l1, pt[r].rel_l2);
        }
        best[b]++;
        points++;
        exp_progress(o, "  sparsity %.4f: Top-k %.4f  Top-p %.4f (%.4f)  hybrid %.4f (%.4f)",
                     pt[EXP_TOPK].sparsity, pt[EXP_TOPK].rel_l1, pt[EXP_TOPP].rel_l1, pt[EXP_TOPP].sparsity,
                     pt[EXP_HYBRID].rel_l1, pt[EXP_HYBRID].sparsity);
    }
    snprintf(sweep_md[nsweep++], sizeof sweep_md[0], "| %s | %d | %.4f | %.4f | %.4f | %d / %d / %d |", x->label,
             points, mean_err[0] / points, mean_err[1] / points, mean_err[2] / points, best[0], best[1], best[2]);
    return 0;
}

static int done(exp_opts *o)
{
    FILE *md = o->md;
    fprintf(md, "\nSweep at equal sparsity (%.0f–%.0f %%), hybrid k = %.2f × Top-k's k:\n\n"
                "| input | points | mean rel. L1 Top-k | Top-p | hybrid | best at a point (Top-k / Top-p / hybrid) |\n"
                "|---|---|---|---|---|---|\n",
            100.0 * targets[0], 100.0 * targets[ntargets - 1], ratio);
    for (int i = 0; i < nsweep; i++)
        fprintf(md, "%s\n", sweep_md[i]);
    return 0;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_LIST("--sparsities", targets, 32, &ntargets, "S1,S2,...", 0.0, 1.0, "target sparsities of the sweep")},
        {EXP_DBL("--hybrid-ratio", &ratio, "R", 0.0, 1.0, "the hybrid's k as a fraction of the Top-k fraction")},
    };
    static const exp_driver d = {"exp_ablation", "Mask-rule ablation without training: output error against sparsity.",
                                 "--seeds", own, EXP_COUNT(own), csv_header, md_header, .each = each, .done = done};
    return exp_main(&d, argc, argv);
}
