/* exp_stats: the verdicts of a results table, with their statistics.
 *
 * Reads a CSV of runs (a row per trained or evaluated model: columns table, arm, seed, the metrics, and optionally
 * teacher), keeps the rows of --table, and writes Markdown:
 *   - per arm and metric: mean ± sample std over its rows (seeds × teachers) and the 95 % confidence interval of
 *     the mean;
 *   - the sanity check of the sample metrics (--sanity): a metric is informative when the reference model (the
 *     teacher, --reference) closes at least half of the gap between the null model (an untrained model whose
 *     samples are its noise, --null) and real videos (a column of the reference rows); on a log scale where asked;
 *   - each claim (--claim): the difference of two arms' means with its confidence interval, Welch's t-test (or a
 *     one-sample test where one arm has a single row), and a verdict: "holds", "opposite" (significant the other
 *     way), "within noise", or "uninformative metric" (no verdict).
 * --csv writes the claims' rows. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

enum { MAX_COLS = 64, MAX_ROWS = 4096, MAX_ARMS = 64, MAX_CLAIMS = 32, MAX_SANITY = 8 };

typedef struct {
    char metric[64], a[128], b[128], text[256];
    char rel; /* '<': a lower than b; '>': a higher; '~': a within margin of b */
    double margin; /* '~': relative margin */
} claim;

typedef struct {
    char metric[64], real[64];
    int log;
} sanity;

static const char *in_path, *table_name, *reference_arm, *null_arm, *metric_list = "";
static double level = 0.95;
static claim claims[MAX_CLAIMS];
static int nclaims;
static sanity checks[MAX_SANITY];
static int nchecks;

/* "METRIC|ARM_A|REL|ARM_B|TEXT", REL one of <, >, ~PCT (e.g. ~5%) */
static const char *parse_claim(void *ptr, const char *v)
{
    (void)ptr;
    static const char want[] = "METRIC|ARM_A|REL|ARM_B|TEXT with REL <, > or ~PCT% (e.g. ~5%)";
    if (nclaims == MAX_CLAIMS)
        return "at most 32 claims";
    claim *c = &claims[nclaims];
    char buf[640], *field[5];
    snprintf(buf, sizeof buf, "%s", v);
    char *s = buf;
    for (int i = 0; i < 5; i++) {
        field[i] = s;
        char *bar = i < 4 ? strchr(s, '|') : NULL;
        if (i < 4 && !bar)
            return want;
        if (bar)
            *bar = 0, s = bar + 1;
    }
    if (!*field[0] || !*field[1] || !*field[3] || strlen(field[0]) >= sizeof c->metric ||
        strlen(field[1]) >= sizeof c->a || strlen(field[3]) >= sizeof c->b)
        return want;
    c->rel = field[2][0];
    c->margin = 0.0;
    if (c->rel == '~') {
        char *end;
        c->margin = strtod(field[2] + 1, &end) / 100.0;
        if (end == field[2] + 1 || strcmp(end, "%") || !(c->margin > 0.0))
            return want;
    } else if ((c->rel != '<' && c->rel != '>') || field[2][1])
        return want;
    snprintf(c->metric, sizeof c->metric, "%s", field[0]);
    snprintf(c->a, sizeof c->a, "%s", field[1]);
    snprintf(c->b, sizeof c->b, "%s", field[3]);
    snprintf(c->text, sizeof c->text, "%s", field[4]);
    nclaims++;
    return NULL;
}

static void show_claims(const void *ptr, char *buf, size_t len)
{
    (void)ptr;
    snprintf(buf, len, "none");
}

/* "METRIC:REAL_COLUMN[:log]" */
static const char *parse_sanity(void *ptr, const char *v)
{
    (void)ptr;
    static const char want[] = "METRIC:REAL_COLUMN or METRIC:REAL_COLUMN:log";
    if (nchecks == MAX_SANITY)
        return "at most 8 sanity checks";
    sanity *s = &checks[nchecks];
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    char *colon = strchr(buf, ':');
    if (!colon || colon == buf || !colon[1])
        return want;
    *colon = 0;
    char *mode = strchr(colon + 1, ':');
    s->log = 0;
    if (mode) {
        if (strcmp(mode, ":log"))
            return want;
        *mode = 0, s->log = 1;
    }
    if (strlen(buf) >= sizeof s->metric || strlen(colon + 1) >= sizeof s->real)
        return want;
    memcpy(s->metric, buf, strlen(buf) + 1); /* both fit: checked above */
    memcpy(s->real, colon + 1, strlen(colon + 1) + 1);
    nchecks++;
    return NULL;
}

/* ---------------------------------------------------------------- the table */

typedef struct {
    int ncols, nrows;
    char cols[MAX_COLS][64];
    char arm[MAX_ROWS][128];
    double *v; /* [nrows, ncols], NaN where a cell is not a number */
} runs;

static int column(const runs *r, const char *name)
{
    for (int i = 0; i < r->ncols; i++)
        if (!strcmp(r->cols[i], name))
            return i;
    return -1;
}

/* Splits line at commas in place; returns the field count. */
static int split(char *line, char **fields, int cap)
{
    int n = 0;
    line[strcspn(line, "\r\n")] = 0;
    for (char *s = line; n < cap;) {
        fields[n++] = s;
        char *comma = strchr(s, ',');
        if (!comma)
            break;
        *comma = 0;
        s = comma + 1;
    }
    return n;
}

static int read_runs(runs *r)
{
    FILE *f = fopen(in_path, "r");
    if (!f) {
        fprintf(stderr, "exp_stats: --in %s: cannot open: %s\n", in_path, strerror(errno));
        return -1;
    }
    char line[8192], *fields[MAX_COLS];
    int table_col = -1, arm_col = -1, rc = -1;
    memset(r, 0, sizeof *r);
    if (!fgets(line, sizeof line, f)) {
        fprintf(stderr, "exp_stats: %s is empty\n", in_path);
        goto out;
    }
    r->ncols = split(line, fields, MAX_COLS);
    for (int i = 0; i < r->ncols; i++)
        snprintf(r->cols[i], sizeof r->cols[i], "%s", fields[i]);
    table_col = column(r, "table"), arm_col = column(r, "arm");
    if (arm_col < 0 || (table_name && table_col < 0)) {
        fprintf(stderr, "exp_stats: %s has no 'arm'%s column\n", in_path, table_name ? " or 'table'" : "");
        goto out;
    }
    r->v = malloc(sizeof(double) * MAX_ROWS * MAX_COLS);
    if (!r->v)
        goto out;
    while (fgets(line, sizeof line, f)) {
        int n = split(line, fields, MAX_COLS);
        if (n == 1 && !fields[0][0])
            continue;
        if (n != r->ncols) {
            fprintf(stderr, "exp_stats: %s: a row of %d fields under a header of %d\n", in_path, n, r->ncols);
            goto out;
        }
        if (table_name && strcmp(fields[table_col], table_name))
            continue;
        if (r->nrows == MAX_ROWS) {
            fprintf(stderr, "exp_stats: more than %d rows\n", MAX_ROWS);
            goto out;
        }
        snprintf(r->arm[r->nrows], sizeof r->arm[0], "%s", fields[arm_col]);
        for (int i = 0; i < n; i++) {
            char *end;
            double x = strtod(fields[i], &end);
            r->v[(size_t)r->nrows * MAX_COLS + i] = end != fields[i] && !*end ? x : NAN;
        }
        r->nrows++;
    }
    rc = r->nrows ? 0 : -1;
    if (!r->nrows)
        fprintf(stderr, "exp_stats: no rows%s%s in %s\n", table_name ? " of table " : "", table_name ? table_name : "",
                in_path);
out:
    fclose(f);
    return rc;
}

/* The values of column col over the rows of arm (NaNs left out). */
static exp_summary arm_summary(const runs *r, const char *arm, int col)
{
    double x[MAX_ROWS];
    int n = 0;
    for (int i = 0; i < r->nrows && col >= 0; i++)
        if (!strcmp(r->arm[i], arm) && !isnan(r->v[(size_t)i * MAX_COLS + col]))
            x[n++] = r->v[(size_t)i * MAX_COLS + col];
    exp_summary s = {0, NAN, NAN};
    if (n)
        exp_summarize(x, n, &s);
    return s;
}

/* ---------------------------------------------------------------- output */

static void fmt(char *buf, size_t len, double x)
{
    if (isnan(x))
        snprintf(buf, len, "—");
    else
        snprintf(buf, len, "%.4g", x);
}

/* Whether metric is one of the sanity-checked ones that failed: 1 uninformative, 0 informative or unchecked. */
static int informative_state[MAX_SANITY];

static int uninformative(const char *metric)
{
    for (int i = 0; i < nchecks; i++)
        if (!strcmp(checks[i].metric, metric))
            return informative_state[i] == 0;
    return 0;
}

static void sanity_section(exp_opts *o, const runs *r)
{
    FILE *md = o->md;
    if (!nchecks)
        return;
    fprintf(md, "\nSanity of the sample metrics on the reference model (`%s`): informative when it closes at least half "
                "of the gap from the null model (`%s`: samples that are the sampler's noise) to real videos, on a log "
                "scale where marked.\n\n",
            reference_arm ? reference_arm : "?", null_arm ? null_arm : "?");
    fprintf(md, "| metric | null model | reference | real videos | share of the gap closed | verdict |\n"
                "|---|---|---|---|---|---|\n");
    for (int i = 0; i < nchecks; i++) {
        const sanity *s = &checks[i];
        int mc = column(r, s->metric), rc = column(r, s->real);
        double ref = reference_arm ? arm_summary(r, reference_arm, mc).mean : NAN;
        double null = null_arm ? arm_summary(r, null_arm, mc).mean : NAN;
        double real = reference_arm ? arm_summary(r, reference_arm, rc).mean : NAN;
        double share = s->log ? (log(ref) - log(null)) / (log(real) - log(null)) : (ref - null) / (real - null);
        informative_state[i] = isfinite(share) && share >= 0.5;
        char a[32], b[32], c[32], d[32];
        fmt(a, sizeof a, null), fmt(b, sizeof b, ref), fmt(c, sizeof c, real), fmt(d, sizeof d, share);
        fprintf(md, "| %s%s | %s | %s | %s | %s | %s |\n", s->metric, s->log ? " (log)" : "", a, b, c, d,
                isfinite(share) ? (informative_state[i] ? "informative" : "**uninformative**: no verdict uses it")
                                : "not checked (a value is missing): no verdict uses it");
    }
}

static int run(exp_opts *o)
{
    if (!in_path) {
        fprintf(stderr, "exp_stats: --in FILE is needed\n");
        return 2;
    }
    runs r;
    if (read_runs(&r)) {
        free(r.v);
        return 1;
    }
    FILE *md = o->md;
    /* arms in the order of their first row */
    char arms[MAX_ARMS][128];
    int narms = 0;
    for (int i = 0; i < r.nrows; i++) {
        int seen = 0;
        for (int a = 0; a < narms; a++)
            seen |= !strcmp(arms[a], r.arm[i]);
        if (!seen && narms < MAX_ARMS)
            snprintf(arms[narms++], sizeof arms[0], "%s", r.arm[i]);
    }
    char list[1024], *metrics[MAX_COLS];
    snprintf(list, sizeof list, "%s", metric_list);
    int nmetrics = 0;
    for (char *m = strtok(list, ","); m && nmetrics < MAX_COLS; m = strtok(NULL, ","))
        if (column(&r, m) < 0) {
            fprintf(stderr, "exp_stats: --metrics: %s has no column '%s'\n", in_path, m);
            free(r.v);
            return 1;
        } else
            metrics[nmetrics++] = m;
    /* the columns that claims and sanity checks name are in the table (an arm may be missing: runs not done yet) */
    for (int i = 0; i < nclaims; i++)
        if (column(&r, claims[i].metric) < 0) {
            fprintf(stderr, "exp_stats: --claim '%s': %s has no column '%s'\n", claims[i].text, in_path,
                    claims[i].metric);
            free(r.v);
            return 1;
        }
    for (int i = 0; i < nchecks; i++)
        for (int k = 0; k < 2; k++)
            if (column(&r, k ? checks[i].real : checks[i].metric) < 0) {
                fprintf(stderr, "exp_stats: --sanity %s:%s: %s has no column '%s'\n", checks[i].metric, checks[i].real,
                        in_path, k ? checks[i].real : checks[i].metric);
                free(r.v);
                return 1;
            }
    int teacher_col = column(&r, "teacher");
    sanity_section(o, &r);
    fprintf(md, "\nMean ± sample std over the runs of each arm (n: seeds%s), 95 %% confidence interval of the mean below "
                "it%s:\n\n| arm | n |",
            teacher_col >= 0 ? " × teachers" : "", nchecks ? "; metrics that failed the sanity check are struck out" : "");
    for (int m = 0; m < nmetrics; m++)
        fprintf(md, " %s |", metrics[m]);
    fprintf(md, "\n|---|---|");
    for (int m = 0; m < nmetrics; m++)
        fprintf(md, "---|");
    fprintf(md, "\n");
    for (int a = 0; a < narms; a++) {
        int n = 0;
        for (int i = 0; i < r.nrows; i++)
            n += !strcmp(r.arm[i], arms[a]);
        fprintf(md, "| %s | %d |", arms[a], n);
        for (int m = 0; m < nmetrics; m++) {
            exp_summary s = arm_summary(&r, arms[a], column(&r, metrics[m]));
            const char *strike = uninformative(metrics[m]) ? "~~" : "";
            if (s.n > 1) {
                double half = exp_t_quantile(0.5 + level / 2.0, s.n - 1) * s.sd / sqrt(s.n);
                fprintf(md, " %s%.4g ± %.2g<br>[%.4g, %.4g]%s |", strike, s.mean, s.sd, s.mean - half, s.mean + half,
                        strike);
            } else if (s.n == 1)
                fprintf(md, " %s%.4g%s |", strike, s.mean, strike);
            else
                fprintf(md, " — |");
        }
        fprintf(md, "\n");
    }
    if (nclaims) {
        fprintf(md, "\nClaims: A − B with its %.0f %% confidence interval; Welch's t-test over the runs (one-sample where "
                    "an arm has one run: conditional on that model); a direction holds at p < %.2g, otherwise it is "
                    "within noise; \"matches\" holds when the interval lies within the margin.\n\n"
                    "| claim | metric | A | B | A − B [CI] | test | p | verdict |\n|---|---|---|---|---|---|---|---|\n",
                100 * level, 1 - level);
        for (int i = 0; i < nclaims; i++) {
            const claim *c = &claims[i];
            int col = column(&r, c->metric);
            exp_summary sa = arm_summary(&r, c->a, col), sb = arm_summary(&r, c->b, col);
            exp_test t;
            exp_welch(&sa, &sb, level, &t);
            const char *verdict;
            char why[160] = "";
            if (col < 0 || !sa.n || !sb.n)
                verdict = "not measured";
            else if (uninformative(c->metric))
                verdict = "uninformative metric: no verdict";
            else if (t.kind == EXP_TEST_NONE)
                verdict = "inconclusive: one run each";
            else if (c->rel == '~') {
                double m = c->margin * fabs(sb.mean);
                verdict = t.lo >= -m && t.hi <= m ? "holds" : t.lo > m || t.hi < -m ? "does not hold" : "inconclusive";
                snprintf(why, sizeof why, " (margin ±%.3g)", m);
            } else {
                int want = c->rel == '<' ? -1 : 1, sign = t.diff < 0 ? -1 : t.diff > 0 ? 1 : 0;
                verdict = !(t.p < 1 - level) ? "within noise" : sign == want ? "holds" : "opposite";
            }
            char ma[48], mb[48], d[96], p[32], mean[32];
            fmt(mean, sizeof mean, sa.mean);
            snprintf(ma, sizeof ma, "%s (n %d)", mean, sa.n);
            fmt(mean, sizeof mean, sb.mean);
            snprintf(mb, sizeof mb, "%s (n %d)", mean, sb.n);
            if (t.kind == EXP_TEST_NONE)
                fmt(d, sizeof d, t.diff);
            else
                snprintf(d, sizeof d, "%.4g [%.4g, %.4g]", t.diff, t.lo, t.hi);
            fmt(p, sizeof p, t.p);
            const char *kind = t.kind == EXP_TEST_WELCH ? "Welch" : t.kind == EXP_TEST_ONE_SAMPLE ? "one-sample" : "—";
            char test[64];
            if (t.kind == EXP_TEST_NONE)
                snprintf(test, sizeof test, "—");
            else
                snprintf(test, sizeof test, "%s t = %.3g, df %.3g", kind, t.t, t.df);
            fprintf(md, "| %s: %s %s %s | %s | %s | %s | %s | %s | %s | %s%s |\n", c->text, c->a,
                    c->rel == '<' ? "<" : c->rel == '>' ? ">" : "≈", c->b, c->metric, ma, mb, d, test, p, verdict,
                    why);
            if (o->csv)
                fprintf(o->csv, "%s,%s,%s,%c,%s,%.6g,%d,%.6g,%d,%.6g,%.6g,%.6g,%s,%.6g,%.6g,%.6g,%s\n", c->text,
                        c->metric, c->a, c->rel, c->b, sa.mean, sa.n, sb.mean, sb.n, t.diff, t.lo, t.hi, kind, t.t,
                        t.df, t.p, verdict);
        }
    }
    free(r.v);
    return 0;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_STR("--in", &in_path, "FILE", "the runs: a CSV with columns arm (and table with --table) and the metrics")},
        {EXP_STR("--table", &table_name, "NAME", "keep the rows whose table column is NAME"), .def = "every row"},
        {EXP_STR("--metrics", &metric_list, "LIST", "comma-separated columns to summarize per arm"), .def = "none"},
        {EXP_CUSTOM("--claim", NULL, "SPEC", parse_claim, show_claims,
                    "a claim to test, METRIC|ARM_A|REL|ARM_B|TEXT with REL < (A lower), > (A higher) or ~PCT% (A "
                    "within PCT % of B); repeat for more")},
        {EXP_STR("--reference", &reference_arm, "ARM", "the arm whose sample metrics are sanity-checked (the teacher)"),
         .def = "none"},
        {EXP_STR("--null", &null_arm, "ARM", "the arm of the null model (an untrained model: its samples are noise)"),
         .def = "none"},
        {EXP_CUSTOM("--sanity", NULL, "M:COL[:log]", parse_sanity, show_claims,
                    "check metric M of --reference against --null and the real videos' column COL; repeat for more")},
        {EXP_DBL("--level", &level, "L", 0.5, 1.0, "confidence level of the intervals; tests at 1 - L"),
         .excl = EXP_EXCL_MIN | EXP_EXCL_MAX},
    };
    static const exp_driver d = {"exp_stats",
                                 "Verdicts of a results table: per-arm means with confidence intervals, the sanity of "
                                 "the sample metrics, and Welch's t-test of each claim.",
                                 NULL, own, EXP_COUNT(own),
                                 "claim,metric,arm_a,relation,arm_b,mean_a,n_a,mean_b,n_b,diff,ci_low,ci_high,test,t,"
                                 "df,p,verdict\n",
                                 .own_only = 1, .run = run};
    return exp_main(&d, argc, argv);
}
