/* exp_discrim: can the mask rules of the training tables differ on a model's own attention?
 *
 * Reads the Q/K/V that `sparge-train mode=dump` wrote for every layer at every diffusion time (DIR/manifest.csv)
 * and, at the parameters of the three arms (Top-k k; Top-p p; hybrid k, p — each p as given, or calibrated over all
 * the dumped layers and times together so that the arm keeps as many blocks as Top-k, as the arms are calibrated on
 * the model), reports per layer, time and head:
 *   - the rows' flatness on the pooled map: normalized entropy (1 = flat), the top-1 mass, the mass of the top n
 *     blocks (n = Top-k's count) and the share of the head's sink (the key block with the most mean mass);
 *   - for each arm: sparsity, kept pooled mass and the relative L1 error of the output;
 *   - how far the arms' masks are apart: the Jaccard distance |A Δ B| / |A ∪ B| of their kept blocks, the share of
 *     rows where Top-p keeps fewer blocks than Top-k, and the share of rows where the hybrid's Top-k floor binds
 *     (Top-p at the hybrid's p alone keeps fewer blocks than the floor).
 * CSV (--csv) has a row per layer, time and head; Markdown (--md) summarizes by layer and by time with verdicts;
 * --masks writes the pooled map and the three masks of one head at one time for every layer, as gnuplot matrices
 * (paper-repro/plots/discrim_masks.gp). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"

enum { MAX_ENTRIES = 512 };

typedef struct {
    char file[256];
    int layer;
    double t;
    int block_q, block_k;
    exp_qkv x;
    exp_session s;
} entry;

static const char *dump_dir, *backend = "cpu";
static int dtype = SPARGE_F32, mask_head, mask_batch;
static double arm_topk = 0.05, arm_topp, arm_hybrid[2] = {0.035, 0.0}, mask_time = -1;
static FILE *masks_out;

static const char csv_header[] =
    "layer,t,head,rows,key_blocks,entropy,top1_mass,topn_mass,sink_share,topk_blocks,topk_sparsity,topk_mass,"
    "topk_rel_l1,topp_sparsity,topp_mass,topp_rel_l1,hybrid_sparsity,hybrid_mass,hybrid_rel_l1,topp_rows_fewer,"
    "hybrid_floor_binds,distance_topk_topp,distance_hybrid_topp,distance_hybrid_topk\n";

static int read_manifest(entry **out, int *count)
{
    char path[600], line[1024];
    snprintf(path, sizeof path, "%s/manifest.csv", dump_dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "exp_discrim: cannot open %s (written by sparge-train mode=dump)\n", path);
        return -1;
    }
    entry *e = calloc(MAX_ENTRIES, sizeof *e);
    int n = 0, rc = -1;
    if (!e || !fgets(line, sizeof line, f) || strncmp(line, "file,layer,t,", 13)) {
        fprintf(stderr, "exp_discrim: %s: not a dump manifest\n", path);
        goto out;
    }
    while (fgets(line, sizeof line, f)) {
        int B, H, N, D;
        if (n == MAX_ENTRIES) {
            fprintf(stderr, "exp_discrim: more than %d files in %s\n", MAX_ENTRIES, path);
            goto out;
        }
        entry *x = &e[n];
        if (sscanf(line, "%255[^,],%d,%lf,%d,%d,%d,%d,%d,%d", x->file, &x->layer, &x->t, &B, &H, &N, &D, &x->block_q,
                   &x->block_k) != 9) {
            fprintf(stderr, "exp_discrim: %s: bad line '%s'\n", path, line);
            goto out;
        }
        n++;
    }
    rc = n ? 0 : -1;
    if (!n)
        fprintf(stderr, "exp_discrim: %s lists no files\n", path);
out:
    fclose(f);
    if (rc)
        free(e);
    else
        *out = e, *count = n;
    return rc;
}

/* The Top-k count of fraction k in a row of nkb blocks (docs/DESIGN.md §1: floor(k·Nkb + 1e-6), at least 1 when
 * k > 0, at most Nkb). */
static int64_t count_of(double k, int64_t nkb)
{
    if (k <= 0.0)
        return 0;
    int64_t n = (int64_t)floor(k * (double)nkb + 1e-6);
    return n < 1 ? 1 : n > nkb ? nkb : n;
}

/* Total kept block pairs over every entry at (k, p); -1 on error. */
static int64_t kept_total(entry *e, int n, double k, double p)
{
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        int64_t kept = exp_select(&e[i].s, k, p);
        if (kept < 0)
            return -1;
        total += kept;
    }
    return total;
}

/* The p whose total kept count over all entries is closest to target (k fixed), as exp_calibrate_p does for one. */
static int calibrate(entry *e, int n, double k, int64_t target, double *p_out)
{
    double lo = 0.0, hi = 1.0;
    int64_t kept_hi = kept_total(e, n, k, hi);
    if (kept_hi < 0)
        return -1;
    for (int it = 0; it < 60 && hi - lo > 1e-12 && kept_hi >= target; it++) {
        double mid = 0.5 * (lo + hi);
        int64_t kept = kept_total(e, n, k, mid);
        if (kept < 0)
            return -1;
        if (kept >= target)
            hi = mid, kept_hi = kept;
        else
            lo = mid;
    }
    int64_t kept_lo = kept_total(e, n, k, lo);
    if (kept_lo < 0)
        return -1;
    *p_out = kept_lo >= 0 && target - kept_lo < kept_hi - target ? lo : hi;
    return 0;
}

/* Per arm and entry: each row's kept count and mass, the dense mask, and the output. */
typedef struct {
    int32_t *count;
    float *mass;
    uint8_t *dense;
    float *out;
    double sparsity, rel_l1;
} arm_result;

static int measure(exp_session *s, double k, double p, arm_result *a)
{
    exp_point pt;
    size_t n = (size_t)(s->x->B * s->x->H * s->x->N * s->x->D);
    if (exp_measure(s, k, p, &pt) || exp_row_stats(s) ||
        exp_check(sparge_mask_get_dense(s->mask, a->dense), "sparge_mask_get_dense"))
        return -1;
    memcpy(a->count, s->row_count, sizeof(int32_t) * (size_t)s->rows);
    memcpy(a->mass, s->row_mass, sizeof(float) * (size_t)s->rows);
    memcpy(a->out, s->o_sparse, sizeof(float) * n);
    a->sparsity = pt.sparsity, a->rel_l1 = pt.rel_l1;
    return 0;
}

/* Jaccard distance of two masks over the rows of head h. */
static double distance(const exp_session *s, const uint8_t *a, const uint8_t *b, int h)
{
    int64_t diff = 0, either = 0;
    for (int64_t r = 0; r < s->rows; r++) {
        if ((r / s->Nqb) % s->x->H != h)
            continue;
        for (int64_t j = 0; j < s->Nkb; j++) {
            int x = a[r * s->Nkb + j] != 0, y = b[r * s->Nkb + j] != 0;
            diff += x != y, either += x || y;
        }
    }
    return either ? (double)diff / (double)either : 0.0;
}

/* Relative L1 of out against the dense reference over head h. */
static double head_l1(const exp_session *s, const float *out, int h)
{
    const exp_qkv *x = s->x;
    double num = 0.0, den = 0.0;
    for (int64_t b = 0; b < x->B; b++) {
        size_t base = (size_t)((b * x->H + h) * x->N * x->D), len = (size_t)(x->N * x->D);
        for (size_t i = base; i < base + len; i++) {
            num += fabs((double)out[i] - s->o_ref[i]);
            den += fabs((double)s->o_ref[i]);
        }
    }
    return den > 0 ? num / den : 0.0;
}

/* Sums over (layer or time) groups for the Markdown, each a mean of its heads. */
enum { F_ENTROPY, F_TOP1, F_TOPN, F_SINK, F_SP_TOPP, F_SP_HYB, F_FEWER, F_BINDS, F_D_KP, F_D_HP, F_D_HK, F_L1_K,
       F_L1_P, F_L1_H, F_MASS_K, F_MASS_P, F_MASS_H, NF };
typedef struct {
    double sum[NF];
    int n;
    double key; /* the layer or the time */
} group;

static group *group_of(group *g, int *ng, double key)
{
    for (int i = 0; i < *ng; i++)
        if (g[i].key == key)
            return &g[i];
    memset(&g[*ng], 0, sizeof g[0]);
    g[*ng].key = key;
    return &g[(*ng)++];
}

static void group_table(FILE *md, const char *what, const group *g, int ng, int is_time)
{
    fprintf(md, "| %s | entropy | top-1 mass | top-n mass | sink share | Top-p rows below n | hybrid floor binds | "
                "distance Top-k/Top-p | hybrid/Top-p | hybrid/Top-k | sparsity Top-p | sparsity hybrid | "
                "kept mass Top-k / Top-p / hybrid | rel. L1 Top-k / Top-p / hybrid |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            what);
    for (int i = 0; i < ng; i++) {
        const double *s = g[i].sum;
        double n = g[i].n;
        char key[32];
        if (g[i].key < 0)
            snprintf(key, sizeof key, "**all**");
        else if (is_time)
            snprintf(key, sizeof key, "%.3g", g[i].key);
        else
            snprintf(key, sizeof key, "%d", (int)g[i].key);
        fprintf(md,
                "| %s | %.3f | %.3f | %.3f | %.3f | %.1f %% | %.1f %% | %.3f | %.3f | %.3f | %.1f %% | %.1f %% | "
                "%.3f / %.3f / %.3f | %.3f / %.3f / %.3f |\n",
                key, s[F_ENTROPY] / n, s[F_TOP1] / n, s[F_TOPN] / n, s[F_SINK] / n, 100 * s[F_FEWER] / n,
                100 * s[F_BINDS] / n, s[F_D_KP] / n, s[F_D_HP] / n, s[F_D_HK] / n, 100 * s[F_SP_TOPP] / n,
                100 * s[F_SP_HYB] / n, s[F_MASS_K] / n, s[F_MASS_P] / n, s[F_MASS_H] / n, s[F_L1_K] / n,
                s[F_L1_P] / n, s[F_L1_H] / n);
    }
}

/* The pooled map and the three masks of (mask_batch, mask_head) of entry e, as four gnuplot matrices. */
static void write_masks(const entry *e, arm_result *arms)
{
    const exp_session *s = &e->s;
    fprintf(masks_out, "# layer %d t %.3g head %d batch %d: pooled map, Top-k, Top-p, hybrid masks (%lld x %lld)\n",
            e->layer, e->t, mask_head, mask_batch, (long long)s->Nqb, (long long)s->Nkb);
    int64_t r0 = ((int64_t)mask_batch * s->x->H + mask_head) * s->Nqb;
    for (int m = 0; m < 4; m++) {
        for (int64_t i = 0; i < s->Nqb; i++) {
            for (int64_t j = 0; j < s->Nkb; j++) {
                int64_t at = (r0 + i) * s->Nkb + j;
                if (m == 0)
                    fprintf(masks_out, "%s%.5g", j ? " " : "", s->map_host[at]);
                else
                    fprintf(masks_out, "%s%d", j ? " " : "", arms[m - 1].dense[at] != 0);
            }
            fputc('\n', masks_out);
        }
        fputs("\n\n", masks_out);
    }
}

static int run(exp_opts *o)
{
    if (!dump_dir) {
        fprintf(stderr, "exp_discrim: --dump DIR is needed\n");
        return 2;
    }
    entry *e = NULL;
    int n = 0, rc = 1, opened = 0;
    arm_result arms[3] = {{0}}, alone = {0};
    if (read_manifest(&e, &n))
        return 1;
    const char *names[3] = {"q", "k", "v"};
    size_t max_rows = 0, max_map = 0, max_out = 0;
    for (int i = 0; i < n; i++, opened++) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s", dump_dir, e[i].file);
        if (exp_load_qkv(path, names, 0, &e[i].x))
            goto out;
        if (exp_session_open(&e[i].s, backend, NULL, &e[i].x, dtype, e[i].block_q, e[i].block_k)) {
            exp_qkv_free(&e[i].x);
            goto out;
        }
        exp_session *s = &e[i].s;
        max_rows = (size_t)s->rows > max_rows ? (size_t)s->rows : max_rows;
        max_map = (size_t)(s->rows * s->Nkb) > max_map ? (size_t)(s->rows * s->Nkb) : max_map;
        size_t outn = (size_t)(e[i].x.B * e[i].x.H * e[i].x.N * e[i].x.D);
        max_out = outn > max_out ? outn : max_out;
        exp_progress(o, "%s: layer %d, t %.3g, %lldx%lld block map per head", e[i].file, e[i].layer, e[i].t,
                     (long long)s->Nqb, (long long)s->Nkb);
    }
    for (int a = 0; a < 4; a++) {
        arm_result *r = a < 3 ? &arms[a] : &alone;
        r->count = malloc(sizeof(int32_t) * max_rows);
        r->mass = malloc(sizeof(float) * max_rows);
        r->dense = malloc(max_map);
        r->out = malloc(sizeof(float) * max_out);
        if (!r->count || !r->mass || !r->dense || !r->out) {
            fprintf(stderr, "exp_discrim: out of host memory\n");
            goto out;
        }
    }
    /* the arms: Top-k's count per row sets the kept total the calibrated p's match */
    int64_t target = 0;
    for (int i = 0; i < n; i++) {
        target += e[i].s.rows * count_of(arm_topk, e[i].s.Nkb);
    }
    double p_topp = arm_topp, k_h = arm_hybrid[0], p_h = arm_hybrid[1];
    int cal_topp = p_topp == 0.0, cal_hyb = p_h == 0.0;
    if ((cal_topp && calibrate(e, n, 0.0, target, &p_topp)) || (cal_hyb && calibrate(e, n, k_h, target, &p_h)))
        goto out;
    double k_arm[3] = {arm_topk, 0.0, k_h}, p_arm[3] = {0.0, p_topp, p_h};
    static const char *const arm_name[3] = {"Top-k", "Top-p", "hybrid"};
    int64_t kept[3] = {0}, pairs = 0;
    for (int a = 0; a < 3; a++) {
        for (int i = 0; i < n; i++) {
            int64_t k = exp_select(&e[i].s, k_arm[a], p_arm[a]);
            if (k < 0)
                goto out;
            kept[a] += k;
            pairs += a == 0 ? e[i].s.rows * e[i].s.Nkb : 0;
        }
        exp_progress(o, "%s k %.4f p %.6f: sparsity %.4f over every layer and time", arm_name[a], k_arm[a], p_arm[a],
                     1.0 - (double)kept[a] / (double)pairs);
    }
    group layers[MAX_ENTRIES + 1], times[MAX_ENTRIES], all = {{0}, 0, -1.0};
    int nl = 0, nt = 0;
    double mtime = mask_time;
    if (mtime < 0) /* the middle one of the dumped times */
        mtime = e[0].t;
    {
        double ts[MAX_ENTRIES];
        int nts = 0;
        for (int i = 0; i < n; i++) {
            int seen = 0;
            for (int j = 0; j < nts; j++)
                seen |= ts[j] == e[i].t;
            if (!seen)
                ts[nts++] = e[i].t;
        }
        if (mask_time < 0)
            mtime = ts[nts / 2];
    }
    for (int i = 0; i < n; i++) {
        exp_session *s = &e[i].s;
        for (int a = 0; a < 3; a++)
            if (measure(s, k_arm[a], p_arm[a], &arms[a]))
                goto out;
        if (exp_select(s, 0.0, p_h) < 0 ||
            exp_check(sparge_mask_get_csr(s->mask, alone.count, NULL, NULL, NULL), "sparge_mask_get_csr"))
            goto out;
        int64_t n_topk = count_of(arm_topk, s->Nkb), n_h = count_of(k_h, s->Nkb);
        if (masks_out && e[i].t == mtime && mask_head < s->x->H && mask_batch < s->x->B)
            write_masks(&e[i], arms);
        for (int h = 0; h < s->x->H; h++) {
            double f[NF] = {0}, sink_col = 0.0;
            int64_t rows = 0, sink = 0;
            /* the head's sink: the key block with the most mean pooled mass over its rows */
            double *colsum = calloc((size_t)s->Nkb, sizeof(double));
            if (!colsum)
                goto out;
            for (int64_t r = 0; r < s->rows; r++)
                if ((r / s->Nqb) % s->x->H == h)
                    for (int64_t j = 0; j < s->Nkb; j++)
                        colsum[j] += s->map_host[r * s->Nkb + j];
            for (int64_t j = 1; j < s->Nkb; j++)
                sink = colsum[j] > colsum[sink] ? j : sink;
            free(colsum);
            double *row = malloc(sizeof(double) * (size_t)s->Nkb);
            if (!row)
                goto out;
            for (int64_t r = 0; r < s->rows; r++) {
                if ((r / s->Nqb) % s->x->H != h)
                    continue;
                const float *m = s->map_host + r * s->Nkb;
                double ent = 0.0, total = 0.0;
                for (int64_t j = 0; j < s->Nkb; j++) {
                    row[j] = m[j];
                    total += m[j];
                    ent -= m[j] > 0 ? m[j] * log(m[j]) : 0.0;
                }
                /* the top n entries by partial selection (n is small) */
                double topn = 0.0, top1 = 0.0;
                for (int64_t t = 0; t < n_topk; t++) {
                    int64_t best = t;
                    for (int64_t j = t + 1; j < s->Nkb; j++)
                        best = row[j] > row[best] ? j : best;
                    double tmp = row[t];
                    row[t] = row[best], row[best] = tmp;
                    topn += row[t];
                    top1 = t == 0 ? row[t] : top1;
                }
                f[F_ENTROPY] += s->Nkb > 1 ? ent / log((double)s->Nkb) : 1.0;
                f[F_TOP1] += top1 / total, f[F_TOPN] += topn / total;
                sink_col += m[sink] / total;
                f[F_FEWER] += arms[1].count[r] < n_topk;
                f[F_BINDS] += alone.count[r] < n_h;
                f[F_MASS_K] += arms[0].mass[r], f[F_MASS_P] += arms[1].mass[r], f[F_MASS_H] += arms[2].mass[r];
                f[F_SP_TOPP] += 1.0 - (double)arms[1].count[r] / (double)s->Nkb;
                f[F_SP_HYB] += 1.0 - (double)arms[2].count[r] / (double)s->Nkb;
                rows++;
            }
            free(row);
            for (int k = 0; k < NF; k++)
                f[k] /= (double)rows;
            f[F_SINK] = sink_col / (double)rows;
            f[F_D_KP] = distance(s, arms[0].dense, arms[1].dense, h);
            f[F_D_HP] = distance(s, arms[2].dense, arms[1].dense, h);
            f[F_D_HK] = distance(s, arms[2].dense, arms[0].dense, h);
            f[F_L1_K] = head_l1(s, arms[0].out, h), f[F_L1_P] = head_l1(s, arms[1].out, h);
            f[F_L1_H] = head_l1(s, arms[2].out, h);
            double topk_sp = 1.0 - (double)n_topk / (double)s->Nkb;
            if (o->csv)
                fprintf(o->csv,
                        "%d,%.6g,%d,%lld,%lld,%.6f,%.6f,%.6f,%.6f,%lld,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,"
                        "%.6f,%.6f,%.6f,%.6f,%.6f\n",
                        e[i].layer, e[i].t, h, (long long)rows, (long long)s->Nkb, f[F_ENTROPY], f[F_TOP1], f[F_TOPN],
                        f[F_SINK], (long long)n_topk, topk_sp, f[F_MASS_K], f[F_L1_K], f[F_SP_TOPP], f[F_MASS_P],
                        f[F_L1_P], f[F_SP_HYB], f[F_MASS_H], f[F_L1_H], f[F_FEWER], f[F_BINDS], f[F_D_KP], f[F_D_HP],
                        f[F_D_HK]);
            group *g[3] = {group_of(layers, &nl, e[i].layer), group_of(times, &nt, e[i].t), &all};
            for (int gi = 0; gi < 3; gi++) {
                for (int k = 0; k < NF; k++)
                    g[gi]->sum[k] += f[k];
                g[gi]->n++;
            }
        }
        exp_progress(o, "layer %d t %.3g: rel. L1 Top-k %.4f, Top-p %.4f, hybrid %.4f", e[i].layer, e[i].t,
                     arms[0].rel_l1, arms[1].rel_l1, arms[2].rel_l1);
    }
    /* Markdown */
    FILE *md = o->md;
    const exp_session *s0 = &e[0].s;
    int64_t n0 = count_of(arm_topk, s0->Nkb), nh0 = count_of(k_h, s0->Nkb);
    fprintf(md, "Inputs: %d files of `%s` (%d layers × %d times), %lld×%lld block map per head (blocks %d×%d), "
                "%lld heads, batch %lld.\n\n",
            n, dump_dir, nl, nt, (long long)s0->Nqb, (long long)s0->Nkb, e[0].block_q, e[0].block_k,
            (long long)e[0].x.H, (long long)e[0].x.B);
    fprintf(md, "Arms (each p %s): Top-k k = %.4g (n = %lld blocks a row), Top-p p = %.6g%s, hybrid k = %.4g "
                "(%lld blocks) with p = %.6g%s. Sparsity over every layer and time: Top-k %.2f %%, Top-p %.2f %%, "
                "hybrid %.2f %%.\n\n",
            cal_topp || cal_hyb ? "calibrated over every layer and time to Top-k's kept count where marked, else given"
                                : "as given",
            arm_topk, (long long)n0, p_topp, cal_topp ? " (calibrated)" : "", k_h, (long long)nh0, p_h,
            cal_hyb ? " (calibrated)" : "", 100.0 * (1.0 - (double)kept[0] / (double)pairs),
            100.0 * (1.0 - (double)kept[1] / (double)pairs), 100.0 * (1.0 - (double)kept[2] / (double)pairs));
    fprintf(md, "Means over heads (and times, or layers); entropy is normalized (1 = a flat row); top-n mass is the "
                "share of a row's pooled mass in its n = %lld largest blocks (a flat row: %.3f); distances are Jaccard "
                "distances between kept-block sets (0 = the same mask).\n\n",
            (long long)n0, (double)n0 / (double)s0->Nkb);
    layers[nl] = all; /* the last row of the layer table */
    group_table(md, "layer", layers, nl + 1, 0);
    fprintf(md, "\n");
    group_table(md, "time", times, nt, 1);
    double binds = all.sum[F_BINDS] / all.n, d_hp = all.sum[F_D_HP] / all.n, d_kp = all.sum[F_D_KP] / all.n;
    double d_hk = all.sum[F_D_HK] / all.n, topn = all.sum[F_TOPN] / all.n;
    fprintf(md, "\nVerdicts (thresholds: masks within a Jaccard distance of 0.05 are the same rule in practice; "
                "0.05–0.2 close; above 0.2 different):\n\n");
    fprintf(md, "- The hybrid's Top-k floor binds on %.1f %% of rows; its masks are %.3f from Top-p's: %s\n",
            100 * binds, d_hp,
            d_hp < 0.05 ? "**the hybrid and Top-p arms train with practically the same masks**, so they cannot differ."
            : d_hp < 0.2 ? "close; a difference between the two arms can only come from the rows where the floor binds."
                         : "different masks.");
    fprintf(md, "- Top-k and Top-p masks are %.3f apart (Top-p keeps fewer than n blocks on %.1f %% of rows): %s\n", d_kp,
            100 * all.sum[F_FEWER] / all.n,
            d_kp < 0.05 ? "**the same rule in practice**." : d_kp < 0.2 ? "close." : "different masks.");
    fprintf(md, "- The hybrid's masks are %.3f from Top-k's.\n", d_hk);
    fprintf(md, "- Rows are %s: the n = %lld largest blocks hold %.3f of a row's pooled mass (a flat row: %.3f), "
                "normalized entropy %.3f.\n",
            topn < 2.0 * (double)n0 / (double)s0->Nkb ? "nearly flat" : "concentrated", (long long)n0, topn,
            (double)n0 / (double)s0->Nkb, all.sum[F_ENTROPY] / all.n);
    rc = 0;
out:
    for (int a = 0; a < 4; a++) {
        arm_result *r = a < 3 ? &arms[a] : &alone;
        free(r->count), free(r->mass), free(r->dense), free(r->out);
    }
    for (int i = 0; i < opened; i++) {
        exp_session_close(&e[i].s);
        exp_qkv_free(&e[i].x);
    }
    free(e);
    return rc;
}

int main(int argc, char **argv)
{
    static const exp_opt own[] = {
        {EXP_STR("--dump", &dump_dir, "DIR", "the Q/K/V of sparge-train mode=dump (DIR/manifest.csv)")},
        {EXP_DBL("--topk", &arm_topk, "K", 0.0, 1.0, "the Top-k arm's fraction (its kept count sets the others')"),
         .excl = EXP_EXCL_MIN},
        {EXP_DBL("--topp", &arm_topp, "P", 0.0, 1.0, "the Top-p arm's p; 0: calibrated to Top-k's kept count"),
         .def = "0, calibrated"},
        {EXP_LIST("--hybrid", arm_hybrid, 2, NULL, "K,P", 0.0, 1.0,
                  "the hybrid arm's k and p; p 0: calibrated to Top-k's kept count")},
        {EXP_STR("--backend", &backend, "NAME", "sparge backend of the masks and attention")},
        {EXP_CHOICE("--dtype", &dtype, "f32|f16|bf16", "storage of Q, K, V, O")},
        {EXP_OUT("--masks", &masks_out, "write the pooled map and the three masks of one head, every layer, as "
                                        "gnuplot matrices")},
        {EXP_INT("--mask-head", &mask_head, "H", 0, 4096, "the head of --masks")},
        {EXP_INT("--mask-batch", &mask_batch, "B", 0, 4096, "the batch element of --masks")},
        {EXP_DBL("--mask-time", &mask_time, "T", -1.0, 1.0, "the diffusion time of --masks; -1: the middle dumped one")},
    };
    static const exp_driver d = {"exp_discrim",
                                 "Whether the Top-k, Top-p and hybrid arms can differ on a model's attention: row "
                                 "flatness, the hybrid's floor, mask distances and errors per layer, time and head.",
                                 NULL, own, EXP_COUNT(own), csv_header, .own_only = 1, .run = run};
    return exp_main(&d, argc, argv);
}
