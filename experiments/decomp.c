/* exp_decomp: the error decomposition of block-sparse attention, measured.
 *
 * For one query token with kept set S (the key blocks its query block keeps)
 * and dense attention weights P, let α = Σ_{u∈S} P_u (kept mass), μ_kept and
 * μ_dropped the P-weighted means of the values inside and outside S. Then
 *     O − O_s = (1 − α)(μ_dropped − μ_kept)
 *             = (1 − α)μ_dropped   [the dropped tokens' contribution]
 *             − (1 − α)μ_kept      [the renormalization of the kept ones].
 * O and O_s come from the library (dense and sparse forward); α and the means
 * are computed here in double from Q, K, V and the mask, on sampled tokens.
 * The identity's residual checks both the algebra and the library's sparse
 * forward; the two terms' sizes show which part of the error dominates. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

static double l1(const double *a, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += fabs(a[i]);
    return s;
}

/* Host copy of x rounded through dtype, so the host math sees the device's inputs. */
static float *rounded(const float *src, size_t n, sparge_dtype t)
{
    float *o = malloc(n * sizeof(float));
    if (!o)
        return NULL;
    for (size_t i = 0; i < n; i++)
        o[i] = t == SPARGE_F32   ? src[i]
               : t == SPARGE_F16 ? sparge_f16_to_f32(sparge_f32_to_f16(src[i]))
                                 : sparge_bf16_to_f32(sparge_f32_to_bf16(src[i]));
    return o;
}

typedef struct {
    double alpha, pooled, meas, pred, resid, resid_max, dropped, renorm, o;
    int64_t n;
} sums;

static int64_t stride = 64;
static FILE *tokens;

static const char csv_header[] = "family,rule,k,p,sparsity,tokens,alpha_mean,pooled_mass_mean,rel_l1_measured,"
                                 "rel_l1_predicted,identity_residual,identity_residual_max,dropped_rel,renorm_rel\n";
static const char md_header[] = "| input | rule | sparsity | token kept mass α (mean) | pooled kept mass (mean) "
                                "| ‖O−O_s‖₁/‖O‖₁ measured | (1−α)(μ_d−μ_k) predicted | identity residual (max) "
                                "| dropped term ‖(1−α)μ_d‖₁/‖O‖₁ | renorm. term ‖(1−α)μ_k‖₁/‖O‖₁ |\n"
                                "|---|---|---|---|---|---|---|---|---|---|\n";
static const char tokens_header[] =
    "family,rule,head,token,alpha,pooled_mass,err_l1,pred_l1,residual_l1,dropped_l1,renorm_l1,o_l1\n";

/* For every stride-th token t of every head: the dense attention mass m_j and the P-weighted value sum w_j of each
 * key block j, from Q, K, V rounded through dtype (the device's inputs), in double. Returns 0 / -1. */
static int token_sums(const exp_qkv *x, sparge_dtype dtype, int block_k, int64_t nkb, int64_t ntok, double *m,
                      double *w)
{
    int64_t N = x->N, D = x->D, bh_n = x->B * x->H;
    size_t n = (size_t)(bh_n * N * D);
    float *q = rounded(x->q, n, dtype), *k = rounded(x->k, n, dtype), *v = rounded(x->v, n, dtype);
    int rc = q && k && v ? 0 : -1;
    double scale = 1.0 / sqrt((double)D);
    for (int64_t bh = 0; !rc && bh < bh_n; bh++) {
#pragma omp parallel for schedule(dynamic, 4)
        for (int64_t ti = 0; ti < ntok; ti++) {
            int64_t t = ti * stride;
            const float *qt = q + (bh * N + t) * D;
            double *logit = malloc(sizeof(double) * (size_t)N), mx = -INFINITY, z = 0.0;
            double *mt = m + (bh * ntok + ti) * nkb, *wt = w + (bh * ntok + ti) * nkb * D;
            if (!logit) {
#pragma omp atomic write
                rc = -1;
                continue;
            }
            for (int64_t u = 0; u < N; u++) {
                const float *ku = k + (bh * N + u) * D;
                double dot = 0.0;
                for (int64_t d = 0; d < D; d++)
                    dot += (double)qt[d] * ku[d];
                logit[u] = dot * scale;
                mx = logit[u] > mx ? logit[u] : mx;
            }
            for (int64_t u = 0; u < N; u++)
                z += (logit[u] = exp(logit[u] - mx));
            memset(mt, 0, sizeof(double) * (size_t)nkb);
            memset(wt, 0, sizeof(double) * (size_t)(nkb * D));
            for (int64_t u = 0; u < N; u++) {
                double pu = logit[u] / z;
                int64_t j = u / block_k;
                const float *vu = v + (bh * N + u) * D;
                mt[j] += pu;
                for (int64_t d = 0; d < D; d++)
                    wt[j * D + d] += pu * vu[d];
            }
            free(logit);
        }
    }
    free(q);
    free(k);
    free(v);
    return rc;
}

static int each(exp_opts *o, exp_input *in)
{
    exp_session *s = &in->s;
    const exp_qkv *x = &in->x;
    const exp_rule *rules = in->equal;
    int64_t N = x->N, D = x->D, nkb = s->Nkb, bh_n = x->B * x->H, ntok = (N + stride - 1) / stride;
    double *m = malloc(sizeof(double) * (size_t)(bh_n * ntok * nkb));
    double *w = malloc(sizeof(double) * (size_t)(bh_n * ntok * nkb * D));
    double *vecs = malloc(sizeof(double) * (size_t)(5 * D)); /* per token: mk, md_, meas, pred, diff */
    uint8_t *dense = malloc((size_t)(s->rows * nkb));
    if (!m || !w || !vecs || !dense || token_sums(x, (sparge_dtype)o->dtype, s->block_k, nkb, ntok, m, w))
        return 1;
    double *mk = vecs, *md_ = vecs + D, *meas = vecs + 2 * D, *pred = vecs + 3 * D, *diff = vecs + 4 * D;
    const float *row_mass = s->row_mass;
    for (int rule = 0; rule < EXP_RULES; rule++) {
        exp_point pt;
        if (exp_measure(s, rules[rule].k, rules[rule].p, &pt) ||
            exp_check(sparge_mask_get_dense(s->mask, dense), "sparge_mask_get_dense") || exp_row_stats(s))
            return 1;
        sums a = {0};
        for (int64_t bh = 0; bh < bh_n; bh++)
            for (int64_t ti = 0; ti < ntok; ti++) {
                int64_t t = ti * stride, i = t / s->block_q, r = bh * s->Nqb + i;
                const double *mt = m + (bh * ntok + ti) * nkb, *wt = w + (bh * ntok + ti) * nkb * D;
                const uint8_t *keep = dense + r * nkb;
                double alpha = 0.0;
                memset(mk, 0, sizeof(double) * (size_t)D);
                memset(md_, 0, sizeof(double) * (size_t)D);
                for (int64_t j = 0; j < nkb; j++) {
                    double *acc = keep[j] ? mk : md_;
                    alpha += keep[j] ? mt[j] : 0.0;
                    for (int64_t d = 0; d < D; d++)
                        acc[d] += wt[j * D + d];
                }
                /* mk, md_ hold P-weighted sums: (1−α)μ_k = (1−α)/α · mk, (1−α)μ_d = md_ */
                double beta = 1.0 - alpha, renorm_l1 = 0.0, dropped_l1 = l1(md_, D), o_l1 = 0.0;
                for (int64_t d = 0; d < D; d++) {
                    int64_t e = (bh * N + t) * D + d;
                    double renorm = beta / alpha * mk[d];
                    renorm_l1 += fabs(renorm);
                    pred[d] = md_[d] - renorm;
                    meas[d] = (double)s->o_ref[e] - (double)s->o_sparse[e];
                    diff[d] = meas[d] - pred[d];
                    o_l1 += fabs((double)s->o_ref[e]);
                }
                double me = l1(meas, D), pr = l1(pred, D), re = l1(diff, D);
                /* residual relative to the error itself, floored at 1e-6·‖O‖ (rows keeping everything) */
                double rel = re / fmax(me, 1e-6 * o_l1);
                a.alpha += alpha;
                a.pooled += row_mass[r];
                a.meas += me;
                a.pred += pr;
                a.resid += re;
                a.resid_max = rel > a.resid_max ? rel : a.resid_max;
                a.dropped += dropped_l1;
                a.renorm += renorm_l1;
                a.o += o_l1;
                a.n++;
                if (tokens)
                    fprintf(tokens, "%s,%s,%lld,%lld,%.6f,%.6f,%.6e,%.6e,%.3e,%.6e,%.6e,%.6e\n",
                            x->name, rules[rule].name, (long long)bh, (long long)t, alpha,
                            row_mass[r], me, pr, re, dropped_l1, renorm_l1, o_l1);
            }
        double nn = (double)a.n;
        fprintf(o->md, "| %s | %s | %.2f %% | %.3f | %.3f | %.4f | %.4f | %.1e (%.1e) | %.4f | %.4f |\n",
                x->label, rules[rule].name, 100.0 * pt.sparsity, a.alpha / nn, a.pooled / nn, a.meas / a.o,
                a.pred / a.o, a.resid / a.meas, a.resid_max, a.dropped / a.o, a.renorm / a.o);
        if (o->csv)
            fprintf(o->csv, "%s,%s,%.6f,%.6f,%.6f,%lld,%.6f,%.6f,%.6f,%.6f,%.3e,%.3e,%.6f,%.6f\n",
                    x->name, rules[rule].name, rules[rule].k, rules[rule].p, pt.sparsity,
                    (long long)a.n, a.alpha / nn, a.pooled / nn, a.meas / a.o, a.pred / a.o, a.resid / a.meas,
                    a.resid_max, a.dropped / a.o, a.renorm / a.o);
        exp_progress(o, "  %-6s α %.3f (pooled %.3f)  measured %.4f predicted %.4f residual %.1e",
                     rules[rule].name, a.alpha / nn, a.pooled / nn, a.meas / a.o, a.pred / a.o, a.resid / a.meas);
    }
    free(m);
    free(w);
    free(vecs);
    free(dense);
    return 0;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_I64("--stride", &stride, "S", 1, 16777216, "sample every S-th query token")},
        {EXP_OUT("--tokens-csv", &tokens, "write every sampled token's terms as CSV to PATH"), .header = tokens_header},
    };
    static const exp_driver d = {"exp_decomp", "The error decomposition O - O_s = (1-a)(mu_dropped - mu_kept), "
                                 "measured.", "--seeds", own, EXP_COUNT(own), csv_header, md_header, .equal = 1,
                                 .each = each};
    return exp_main(&d, argc, argv);
}
