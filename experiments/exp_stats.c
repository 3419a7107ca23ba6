/* Statistics over seeds and models: sample summaries, Student's t distribution, Welch's t-test and the confidence
 * interval of a difference of means. */
#include <math.h>

#include "exp.h"

void exp_summarize(const double *x, int n, exp_summary *out)
{
    out->n = n;
    out->mean = 0.0;
    for (int i = 0; i < n; i++)
        out->mean += x[i] / n;
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += (x[i] - out->mean) * (x[i] - out->mean);
    out->sd = n > 1 ? sqrt(ss / (n - 1)) : NAN;
}

/* The continued fraction of the regularized incomplete beta function I_x(a, b), evaluated by the modified Lentz
 * method; it converges fast for x < (a + 1) / (a + b + 2). Terms: d(2m+1) = −(a+m)(a+b+m)x / ((a+2m)(a+2m+1)),
 * d(2m) = m(b−m)x / ((a+2m−1)(a+2m)). */
static double beta_fraction(double a, double b, double x)
{
    const double tiny = 1e-300;
    double c = 1.0, d = 1.0 - (a + b) * x / (a + 1.0);
    d = 1.0 / (fabs(d) < tiny ? tiny : d);
    double f = d;
    for (int m = 1; m <= 1000; m++) {
        for (int odd = 0; odd < 2; odd++) {
            double num = odd ? -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
                             : m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m));
            d = 1.0 + num * d;
            c = 1.0 + num / c;
            d = 1.0 / (fabs(d) < tiny ? tiny : d);
            c = fabs(c) < tiny ? tiny : c;
            double delta = c * d;
            f *= delta;
            if (odd && fabs(delta - 1.0) < 1e-15)
                return f;
        }
    }
    return f;
}

double exp_incomplete_beta(double a, double b, double x)
{
    if (!(x > 0.0))
        return 0.0;
    if (!(x < 1.0))
        return 1.0;
    double front = exp(lgamma(a + b) - lgamma(a) - lgamma(b) + a * log(x) + b * log1p(-x));
    if (x < (a + 1.0) / (a + b + 2.0))
        return front * beta_fraction(a, b, x) / a;
    return 1.0 - front * beta_fraction(b, a, 1.0 - x) / b; /* I_x(a, b) = 1 − I_(1−x)(b, a) */
}

double exp_t_two_sided_p(double t, double df)
{
    if (isnan(t) || !(df > 0.0))
        return NAN;
    if (isinf(t))
        return 0.0;
    return exp_incomplete_beta(df / 2.0, 0.5, df / (df + t * t)); /* P(|T| ≥ |t|) */
}

double exp_t_quantile(double q, double df)
{
    if (!(q > 0.5 && q < 1.0) || !(df > 0.0))
        return NAN;
    double lo = 0.0, hi = 1.0;
    while (exp_t_two_sided_p(hi, df) > 2.0 * (1.0 - q) && hi < 1e12)
        hi *= 2.0;
    for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; i++) {
        double mid = 0.5 * (lo + hi);
        if (exp_t_two_sided_p(mid, df) > 2.0 * (1.0 - q))
            lo = mid;
        else
            hi = mid;
    }
    return 0.5 * (lo + hi);
}

void exp_welch(const exp_summary *a, const exp_summary *b, double level, exp_test *out)
{
    out->diff = a->mean - b->mean;
    out->t = out->df = out->p = out->lo = out->hi = NAN;
    out->kind = EXP_TEST_NONE;
    /* a group of one (a single model) is a constant: the other group's one-sample test against it */
    double va = a->n > 1 ? a->sd * a->sd / a->n : 0.0, vb = b->n > 1 ? b->sd * b->sd / b->n : 0.0;
    if (a->n < 1 || b->n < 1 || (a->n < 2 && b->n < 2))
        return;
    double se = sqrt(va + vb);
    if (a->n > 1 && b->n > 1) {
        out->kind = EXP_TEST_WELCH;
        out->df = va + vb > 0.0 ? (va + vb) * (va + vb) /
                                      (va * va / (a->n - 1) + vb * vb / (b->n - 1))
                                : (double)(a->n + b->n - 2);
    } else {
        out->kind = EXP_TEST_ONE_SAMPLE;
        out->df = (a->n > 1 ? a->n : b->n) - 1.0;
    }
    out->t = se > 0.0 ? out->diff / se : out->diff == 0.0 ? 0.0 : copysign(INFINITY, out->diff);
    out->p = exp_t_two_sided_p(out->t, out->df);
    double half = exp_t_quantile(0.5 + level / 2.0, out->df) * se;
    out->lo = out->diff - half;
    out->hi = out->diff + half;
}
