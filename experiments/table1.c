/* exp_table1: the paper's Table 1 analogue — relative L1 error of the
 * attention output for Top-k, Top-p and hybrid masks at EQUAL sparsity.
 *
 * Top-k keeps n = floor(k·Nkb) blocks in every row (k = --topk, default the
 * paper's Top-k arm 0.05); Top-p's p and the hybrid's p (with the hybrid's k
 * fixed at --hybrid-k, default the paper's 0.03) are calibrated by bisection
 * so that their masks keep the same number of block pairs. Errors are against
 * dense attention (mask NULL) on the same backend, or on --ref. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

enum { RULES = EXP_RULES };
static const char *const rule_name[RULES] = {"Top-k", "Top-p", "hybrid"};

/* The paper's Table 1 (relative L1 at equal sparsity). */
static double paper_value(exp_family f, int rule)
{
    static const double uniform[RULES] = {0.4150, 0.3726, 0.3707}, skewed[RULES] = {0.1664, 0.2160, 0.1671};
    return f == EXP_UNIFORM ? uniform[rule] : f == EXP_SINK ? skewed[rule] : NAN;
}

typedef struct {
    exp_point pt[RULES];
} result;

/* "Top-p < hybrid < Top-k"; "≈" joins values within 0.5 % of each other, or, where pval is given (the p of each pair of
 * rules' test over seeds), neighbours whose difference is not significant (p ≥ 0.05). */
static const char *ordering(const double *v, const double (*pval)[RULES], char *buf, size_t len)
{
    int idx[RULES] = {0, 1, 2};
    for (int a = 0; a < RULES; a++)
        for (int b = a + 1; b < RULES; b++)
            if (v[idx[b]] < v[idx[a]]) {
                int t = idx[a];
                idx[a] = idx[b];
                idx[b] = t;
            }
    const char *sep[2];
    for (int i = 0; i < 2; i++)
        sep[i] = pval ? (pval[idx[i]][idx[i + 1]] < 0.05 ? "<" : "≈")
                      : v[idx[i + 1]] - v[idx[i]] <= 0.005 * v[idx[i + 1]] ? "≈" : "<";
    snprintf(buf, len, "%s %s %s %s %s", rule_name[idx[0]], sep[0], rule_name[idx[1]], sep[1], rule_name[idx[2]]);
    return buf;
}

static const char *row_label;
/* per family and seed, in the order of the inputs */
static result *res;
static char label[3][96];
static double sparsity_target[3];

static const char csv_header[] =
    "family,seed,rule,k,p,kept_blocks,sparsity,token_density,mean_row_mass,rel_l1,rel_l2,paper_rel_l1\n";

static int run(exp_opts *o)
{
    res = calloc((size_t)(o->nfamilies * o->seeds), sizeof *res);
    return res ? 0 : 1;
}

static int each(exp_opts *o, exp_input *in)
{
    snprintf(label[in->fi], sizeof label[in->fi], "%s", in->x.label);
    result *r = &res[in->fi * o->seeds + in->si];
    for (int rule = 0; rule < RULES; rule++)
        if (exp_measure(&in->s, in->equal[rule].k, in->equal[rule].p, &r->pt[rule]))
            return 1;
    sparsity_target[in->fi] = r->pt[EXP_TOPK].sparsity;
    for (int rule = 0; rule < RULES; rule++) {
        const exp_point *pt = &r->pt[rule];
        exp_progress(o, "  %-6s k=%.4f p=%.4f sparsity %.4f rel.L1 %.4f", rule_name[rule], pt->k, pt->p, pt->sparsity,
                     pt->rel_l1);
        if (o->csv)
            fprintf(o->csv, "%s,%llu,%s,%.6f,%.6f,%lld,%.6f,%.6f,%.6f,%.6f,%.6f,%.4f\n", in->x.name,
                    (unsigned long long)in->g.seed, rule_name[rule], pt->k, pt->p, (long long)pt->kept, pt->sparsity,
                    pt->token_density, pt->mean_row_mass, pt->rel_l1, pt->rel_l2, paper_value(in->family, rule));
    }
    return 0;
}

static int done(exp_opts *o)
{
    FILE *md = o->md;
    if (row_label) {
        for (int fi = 0; fi < o->nfamilies; fi++) {
            double mean[RULES] = {0};
            char a[64];
            for (int rule = 0; rule < RULES; rule++)
                for (int si = 0; si < o->seeds; si++)
                    mean[rule] += res[fi * o->seeds + si].pt[rule].rel_l1 / o->seeds;
            fprintf(md, "| %s | %s | %.2f %% | %.4f | %.4f | %.4f | %s |\n", label[fi], row_label,
                    100.0 * sparsity_target[fi], mean[0], mean[1], mean[2], ordering(mean, NULL, a, sizeof a));
        }
        free(res);
        return 0;
    }
    /* Relative L1 scales with the value model (experiments/README.md); the ratio to Top-k does not. */
    fprintf(md, "| input | rule | k | p | sparsity | kept pooled mass | rel. L1 (ours) | rel. L2 (ours) "
                "| rel. L1 (paper) | ÷ Top-k (ours, per seed) | ÷ Top-k (paper) |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int fi = 0; fi < o->nfamilies; fi++)
        for (int rule = 0; rule < RULES; rule++) {
            double l1 = 0.0, l2 = 0.0, lo = INFINITY, hi = -INFINITY, sp = 0.0, mass = 0.0, k = 0.0, p = 0.0;
            for (int si = 0; si < o->seeds; si++) {
                const exp_point *pt = &res[fi * o->seeds + si].pt[rule];
                l1 += pt->rel_l1 / o->seeds;
                l2 += pt->rel_l2 / o->seeds;
                sp += pt->sparsity / o->seeds;
                mass += pt->mean_row_mass / o->seeds;
                k += pt->k / o->seeds;
                p += pt->p / o->seeds;
                lo = pt->rel_l1 < lo ? pt->rel_l1 : lo;
                hi = pt->rel_l1 > hi ? pt->rel_l1 : hi;
            }
            double paper = paper_value((exp_family)o->families[fi], rule);
            char pbuf[16] = "—", pratio[16] = "—", spread[48] = "";
            if (!isnan(paper)) {
                snprintf(pbuf, sizeof pbuf, "%.4f", paper);
                snprintf(pratio, sizeof pratio, "%.3f", paper / paper_value((exp_family)o->families[fi], EXP_TOPK));
            }
            if (o->seeds > 1)
                snprintf(spread, sizeof spread, " (%.4f–%.4f)", lo, hi);
            /* the ratio to Top-k per seed (the rules see the same input): its mean ± std over seeds */
            double ratio[1000];
            for (int si = 0; si < o->seeds; si++)
                ratio[si] = res[fi * o->seeds + si].pt[rule].rel_l1 / res[fi * o->seeds + si].pt[EXP_TOPK].rel_l1;
            exp_summary rs;
            exp_summarize(ratio, o->seeds, &rs);
            char rbuf[48];
            if (o->seeds > 1 && rule != EXP_TOPK)
                snprintf(rbuf, sizeof rbuf, "%.3f ± %.3f", rs.mean, rs.sd);
            else
                snprintf(rbuf, sizeof rbuf, "%.3f", rule == EXP_TOPK ? 1.0 : rs.mean);
            fprintf(md, "| %s | %s | %.4f | %.4f | %.2f %% | %.3f | %.4f%s | %.4f | %s | %s | %s |\n", label[fi],
                    rule_name[rule], k, p, 100.0 * sp, mass, l1, spread, l2, pbuf, rbuf, pratio);
        }
    fprintf(md, "\nOrderings by mean rel. L1 (lower is better); ÷ Top-k is each seed's ratio to Top-k on the same input, "
                "mean ± std over seeds. Each pair of rules is compared by a one-sample t-test of the per-seed log "
                "ratio: \"<\" where p < 0.05, \"≈\" (within seed noise) otherwise; with one seed, no test.\n\n");
    for (int fi = 0; fi < o->nfamilies; fi++) {
        double ours[RULES] = {0}, paper[RULES];
        int wins[RULES] = {0};
        for (int rule = 0; rule < RULES; rule++) {
            for (int si = 0; si < o->seeds; si++)
                ours[rule] += res[fi * o->seeds + si].pt[rule].rel_l1 / o->seeds;
            paper[rule] = paper_value((exp_family)o->families[fi], rule);
        }
        for (int si = 0; si < o->seeds; si++) {
            const result *r = &res[fi * o->seeds + si];
            int best = 0;
            for (int rule = 1; rule < RULES; rule++)
                best = r->pt[rule].rel_l1 < r->pt[best].rel_l1 ? rule : best;
            wins[best]++;
        }
        char a[64], b[64], tests[256] = "";
        double pv[RULES][RULES] = {{0}};
        static const int pairs[3][2] = {{EXP_TOPP, EXP_TOPK}, {EXP_HYBRID, EXP_TOPK}, {EXP_HYBRID, EXP_TOPP}};
        for (int q = 0; q < 3 && o->seeds > 1; q++) {
            double lr[1000];
            for (int si = 0; si < o->seeds; si++) {
                const result *r = &res[fi * o->seeds + si];
                lr[si] = log(r->pt[pairs[q][0]].rel_l1 / r->pt[pairs[q][1]].rel_l1);
            }
            exp_summary ls, zero = {1, 0.0, NAN};
            exp_summarize(lr, o->seeds, &ls);
            exp_test t;
            exp_welch(&ls, &zero, 0.95, &t);
            const char *rel = !(t.p < 0.05) ? "≈" : ls.mean < 0 ? "<" : ">";
            pv[pairs[q][0]][pairs[q][1]] = pv[pairs[q][1]][pairs[q][0]] = t.p;
            snprintf(tests + strlen(tests), sizeof tests - strlen(tests), "%s%s %s %s (p = %.2g)", q ? "; " : "",
                     rule_name[pairs[q][0]], rel, rule_name[pairs[q][1]], t.p);
        }
        fprintf(md, "- %s at %.2f %% sparsity: ours %s", label[fi], 100.0 * sparsity_target[fi],
                ordering(ours, o->seeds > 1 ? (const double(*)[RULES])pv : NULL, a, sizeof a));
        if (!isnan(paper[0]))
            fprintf(md, "; paper %s", ordering(paper, NULL, b, sizeof b));
        fprintf(md, " (best per seed: Top-k %d, Top-p %d, hybrid %d of %d)%s%s\n", wins[0], wins[1], wins[2], o->seeds,
                o->seeds > 1 ? ". Pairwise: " : "", tests);
    }
    free(res);
    return 0;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_STR("--row", &row_label, "LABEL",
                 "one Markdown row per family (LABEL | Top-k | Top-p | hybrid | ordering) instead of the table "
                 "(sensitivity studies)")},
    };
    static const exp_driver d = {"exp_table1", "Relative L1 error of Top-k, Top-p and hybrid at equal sparsity.", NULL,
                                 own, EXP_COUNT(own), csv_header,
                                 .nfamilies = 2, /* the paper's cases, uniform and sink */
                                 .equal = 1, .run = run, .each = each, .done = done};
    return exp_main(&d, argc, argv);
}
