/* VBench-like metrics of sparge-train (README.md, "Evaluation"): a fixed motion/class
 * recognizer for distribution A, a fixed per-video feature vector, the Fréchet distance between
 * two feature sets (matrix square roots through LAPACK's dsyevd, or cuSOLVER's in a build for CUDA devices without
 * a host LAPACK), and the imaging-quality and temporal-consistency
 * scores. Nothing here is learned; everything is a pure function of the videos. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "trainer.h"

#if defined(SPARGE_TRAINER_LAPACKE)
#include <lapacke.h>
#elif defined(SPARGE_TRAINER_CUSOLVER)
#include <cuda_runtime_api.h>
#include <cusolverDn.h>
#else
/* LAPACK's Fortran interface (m4/sparge_blas.m4 found it without LAPACKE): column-major, arguments by reference,
 * the hidden lengths of the two CHARACTER arguments last. */
void dsyevd_(const char *jobz, const char *uplo, const int *n, double *a, const int *lda, double *w, double *work,
             const int *lwork, int *iwork, const int *liwork, int *info, size_t jobz_len, size_t uplo_len);
#endif

static const double TWO_PI = 6.283185307179586;

static int wrap_index(int i, int n)
{
    i %= n;
    return i < 0 ? i + n : i;
}

/* Frame difference t+1 − t of channel c at pixel (y, x), coordinates wrapped on the torus. */
static double frame_diff(const float *v, int t, int y, int x, int c, int H, int W, int C)
{
    size_t frame = (size_t)H * W * C;
    size_t i = ((size_t)t * H + wrap_index(y, H)) * W * C + (size_t)wrap_index(x, W) * C + c;
    return (double)v[i + frame] - v[i];
}

/* Parabola through (−1, lo), (0, mid), (+1, hi): offset of its vertex, clamped to ±0.5. */
static double parabola_offset(double lo, double mid, double hi)
{
    double curvature = lo - 2 * mid + hi;
    if (curvature >= 0)
        return 0;
    double off = 0.5 * (lo - hi) / curvature;
    return off < -0.5 ? -0.5 : off > 0.5 ? 0.5 : off;
}

/* Value of D_t (frame difference t+1 − t) at the real position (y, x), bilinear on the torus. */
static double diff_bilinear(const float *v, int t, double y, double x, int c, int H, int W, int C)
{
    int y0 = (int)floor(y), x0 = (int)floor(x);
    double wy = y - y0, wx = x - x0;
    double row0 = (1 - wx) * frame_diff(v, t, y0, x0, c, H, W, C) + wx * frame_diff(v, t, y0, x0 + 1, c, H, W, C);
    double row1 =
        (1 - wx) * frame_diff(v, t, y0 + 1, x0, c, H, W, C) + wx * frame_diff(v, t, y0 + 1, x0 + 1, c, H, W, C);
    return (1 - wy) * row0 + wy * row1;
}

/* Gauss–Newton refinement of the global motion: the v that minimises Σ_t ‖D_t+1(x) − D_t(x − v)‖²
 * (sub-pixel, where the correlation peak is only resolved to the pixel grid). */
static void refine_motion(const float *v, int T, int H, int W, int C, double *vx, double *vy)
{
    for (int iter = 0; iter < 6; iter++) {
        double gxx = 0, gxy = 0, gyy = 0, bx = 0, by = 0;
        for (int t = 0; t + 2 < T; t++)
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++)
                    for (int c = 0; c < C; c++) {
                        double py = y - *vy, px = x - *vx, p = diff_bilinear(v, t, py, px, c, H, W, C);
                        double gx = diff_bilinear(v, t, py, px + 0.5, c, H, W, C) -
                                    diff_bilinear(v, t, py, px - 0.5, c, H, W, C);
                        double gy = diff_bilinear(v, t, py + 0.5, px, c, H, W, C) -
                                    diff_bilinear(v, t, py - 0.5, px, c, H, W, C);
                        double r = frame_diff(v, t + 1, y, x, c, H, W, C) - p; /* ≈ −δ·∇ */
                        gxx += gx * gx, gxy += gx * gy, gyy += gy * gy, bx -= r * gx, by -= r * gy;
                    }
        double det = gxx * gyy - gxy * gxy;
        if (!(det > 1e-12 * (gxx + gyy) * (gxx + gyy)))
            return;
        double dx = (gyy * bx - gxy * by) / det, dy = (gxx * by - gxy * bx) / det;
        double step = hypot(dx, dy);
        if (step > 0.5)
            dx *= 0.5 / step, dy *= 0.5 / step;
        *vx += dx, *vy += dy;
        if (step < 1e-3)
            return;
    }
}

int tr_motion_estimate(const float *video, int T, int H, int W, int C, int classes, tr_motion *out)
{
    memset(out, 0, sizeof *out);
    out->label = -1;
    if (T < 3 || H < 2 || W < 2 || C < 1 || classes < 1)
        return -1;
    /* shifts up to a quarter of the frame (A moves ≈ size/16 px per frame, ≤ size/7 with wobble),
     * plus one ring for the sub-pixel fit */
    int radius = (H < W ? H : W) / 4, span = radius + 1;
    if (radius < 1)
        radius = 1, span = 1;
    int side = 2 * span + 1;
    double *corr = calloc((size_t)side * side, sizeof(double));
    if (!corr)
        return -1;
    double energy = 0;
    for (int t = 0; t + 2 < T; t++) {
        double e0 = 0, e1 = 0;
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++)
                for (int c = 0; c < C; c++) {
                    double a = frame_diff(video, t, y, x, c, H, W, C), b = frame_diff(video, t + 1, y, x, c, H, W, C);
                    e0 += a * a, e1 += b * b;
                    if (a == 0)
                        continue;
                    for (int sy = -span; sy <= span; sy++)
                        for (int sx = -span; sx <= span; sx++)
                            corr[(sy + span) * side + sx + span] +=
                                a * frame_diff(video, t + 1, y + sy, x + sx, c, H, W, C);
                }
        energy += sqrt(e0 * e1);
    }
    /* integer peak inside the disc of the radius (a circle, not a square, so no direction is favoured) */
    int best_x = 0, best_y = 0;
    double best = -INFINITY;
    for (int sy = -radius; sy <= radius; sy++)
        for (int sx = -radius; sx <= radius; sx++) {
            double r = corr[(sy + span) * side + sx + span];
            if (sx * sx + sy * sy <= radius * radius && (sx || sy) && r > best)
                best = r, best_x = sx, best_y = sy;
        }
    double *at = corr + (best_y + span) * side + best_x + span;
    double fx = abs(best_x) < span ? parabola_offset(at[-1], at[0], at[1]) : 0;
    double fy = abs(best_y) < span ? parabola_offset(at[-side], at[0], at[side]) : 0;
    free(corr);
    out->vx = best_x + fx, out->vy = best_y + fy;
    refine_motion(video, T, H, W, C, &out->vx, &out->vy);
    out->speed = hypot(out->vx, out->vy);
    out->angle = atan2(out->vy, out->vx);
    if (out->angle < 0)
        out->angle += TWO_PI;
    out->strength = energy > 0 ? best / energy : 0;
    if (energy > 0) {
        int k = (int)floor(out->angle / (TWO_PI / classes) + 0.5);
        out->label = k % classes;
    }
    return out->label < 0 ? -1 : 0;
}

/* ---------------------------------------------------------------- features */

const char *const tr_feature_names[TR_FEATURES] = {
    "mean_c0",        "mean_c1",         "mean_c2",         "std_c0",       "std_c1",
    "std_c2",         "sharpness",       "temporal_change", "temporal_jitter", "motion_speed",
    "motion_strength", "log_spatial_variance", "low_band",  "high_band",    "noise_sigma",
    "gradient_rms",   "temporal_consistency"};

/* Immerkær's noise estimate of one frame channel: the mask [1 −2 1; −2 4 −2; 1 −2 1] cancels
 * smooth content, sqrt(π/2)/6 · mean |response| is the std of white noise. Needs H, W ≥ 3. */
static double noise_sigma(const float *frame, int H, int W, int C, int c)
{
    static const int mask[3][3] = {{1, -2, 1}, {-2, 4, -2}, {1, -2, 1}};
    double sum = 0;
    for (int y = 1; y + 1 < H; y++)
        for (int x = 1; x + 1 < W; x++) {
            double r = 0;
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++)
                    r += mask[i][j] * (double)frame[((size_t)(y + i - 1) * W + x + j - 1) * C + c];
            sum += fabs(r);
        }
    return sqrt(TWO_PI / 4) / 6 * sum / ((double)(H - 2) * (W - 2));
}

/* Power spectrum of one mean-removed frame channel by a separable DFT: total AC power and its
 * shares below 1/8 and from 1/4 cycles per pixel (radial frequency). work holds 2·H·W + 2·(H + W)
 * doubles; the twiddles are tables indexed by (frequency · position) mod length. */
static void band_energy(const float *frame, int H, int W, int C, int c, double *work, double *total, double *low,
                        double *high)
{
    double *re = work, *im = work + H * W, *cos_w = im + H * W, *sin_w = cos_w + W, *cos_h = sin_w + W;
    double *sin_h = cos_h + H, mean = 0;
    for (int i = 0; i < W; i++)
        cos_w[i] = cos(TWO_PI * i / W), sin_w[i] = sin(TWO_PI * i / W);
    for (int i = 0; i < H; i++)
        cos_h[i] = cos(TWO_PI * i / H), sin_h[i] = sin(TWO_PI * i / H);
    for (int i = 0; i < H * W; i++)
        mean += frame[(size_t)i * C + c];
    mean /= (double)H * W;
    for (int y = 0; y < H; y++) /* rows along x */
        for (int u = 0; u < W; u++) {
            double sr = 0, si = 0;
            for (int x = 0; x < W; x++) {
                double p = frame[((size_t)y * W + x) * C + c] - mean;
                sr += p * cos_w[u * x % W], si -= p * sin_w[u * x % W];
            }
            re[y * W + u] = sr, im[y * W + u] = si;
        }
    for (int u = 0; u < W; u++) /* then columns along y */
        for (int v = 0; v < H; v++) {
            double sr = 0, si = 0;
            for (int y = 0; y < H; y++) {
                double cr = cos_h[v * y % H], ci = -sin_h[v * y % H];
                sr += re[y * W + u] * cr - im[y * W + u] * ci;
                si += re[y * W + u] * ci + im[y * W + u] * cr;
            }
            double fu = (u <= W / 2 ? u : u - W) / (double)W, fv = (v <= H / 2 ? v : v - H) / (double)H;
            double power = sr * sr + si * si, r = hypot(fu, fv);
            *total += power;
            if (r < 0.125)
                *low += power;
            else if (r >= 0.25)
                *high += power;
        }
}

/* Motion-compensated agreement of consecutive frame differences: D_t shifted by the video's one
 * global motion (vx, vy) predicts D_t+1; 2Σ⟨D_t+1, S·D_t⟩ / Σ(‖D_t+1‖² + ‖S·D_t‖²) in [−1, 1].
 * Steady motion gives ≈ 1; stutter, wandering and noise lower it; a static video counts as 1. */
static double temporal_consistency(const float *v, int T, int H, int W, int C, double vx, double vy)
{
    double cross = 0, energy = 0;
    for (int t = 0; t + 2 < T; t++)
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++)
                for (int c = 0; c < C; c++) {
                    double next = frame_diff(v, t + 1, y, x, c, H, W, C);
                    double moved = diff_bilinear(v, t, y - vy, x - vx, c, H, W, C);
                    cross += next * moved, energy += next * next + moved * moved;
                }
    return energy > 0 ? 2 * cross / energy : 1;
}

int tr_video_features(const float *video, int T, int H, int W, int C, double *f)
{
    memset(f, 0, TR_FEATURES * sizeof(double));
    size_t frame = (size_t)H * W * C;
    double *work = malloc((2 * (size_t)H * W + 2 * ((size_t)H + W)) * sizeof(double));
    if (!work)
        return -1;
    double dx2 = 0, total = 0, low = 0, high = 0, sigma = 0;
    size_t ndx = 0;
    for (int c = 0; c < 3; c++) { /* channels 0..2; repeats the last one when C < 3 */
        int cc = c < C ? c : C - 1;
        double s = 0, s2 = 0, n = (double)T * H * W;
        for (size_t i = 0; i < (size_t)T * H * W; i++)
            s += video[i * C + cc], s2 += (double)video[i * C + cc] * video[i * C + cc];
        f[c] = s / n;
        f[3 + c] = sqrt(fmax(0, s2 / n - f[c] * f[c]));
    }
    for (int t = 0; t < T; t++) {
        const float *fr = video + t * frame;
        for (int c = 0; c < C; c++) {
            if (c < 3)
                band_energy(fr, H, W, C, c, work, &total, &low, &high);
            if (H >= 3 && W >= 3)
                sigma += noise_sigma(fr, H, W, C, c) / ((double)T * C);
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++) {
                    double v0 = fr[((size_t)y * W + x) * C + c];
                    if (x + 1 < W)
                        dx2 += pow(fr[((size_t)y * W + x + 1) * C + c] - v0, 2), ndx++;
                    if (y + 1 < H)
                        dx2 += pow(fr[((size_t)(y + 1) * W + x) * C + c] - v0, 2), ndx++;
                }
        }
    }
    free(work);
    tr_video_stats st;
    tr_video_statistics(video, T, H, W, C, &st);
    tr_motion m;
    tr_motion_estimate(video, T, H, W, C, 1, &m);
    f[6] = st.sharpness, f[7] = st.temporal_change, f[8] = st.temporal_jitter;
    f[9] = m.speed, f[10] = m.strength;
    int bands = (C < 3 ? C : 3) * T;
    f[11] = log10(total / ((double)bands * H * W * H * W) + 1e-12); /* Parseval: mean spatial variance */
    f[12] = total > 0 ? low / total : 0;
    f[13] = total > 0 ? high / total : 0;
    f[14] = sigma;
    /* white noise of std σ adds 2σ² to the mean square of a pixel difference */
    f[15] = sqrt(fmax(0, (ndx ? dx2 / ndx : 0) - 2 * sigma * sigma));
    f[16] = temporal_consistency(video, T, H, W, C, m.vx, m.vy);
    return 0;
}

/* ---------------------------------------------------------------- scores */

double tr_imaging_quality(const double *f, const double *reference_mean)
{
    double g_ref = reference_mean[TR_FEAT_GRADIENT_RMS], sigma_ref = reference_mean[TR_FEAT_NOISE_SIGMA];
    if (!(g_ref > 0))
        return NAN;
    double sharp = fmin(1, f[TR_FEAT_GRADIENT_RMS] / g_ref);
    return sharp * g_ref / (g_ref + fmax(0, f[TR_FEAT_NOISE_SIGMA] - sigma_ref));
}

void tr_feature_mean(const double *features, int n, int dims, double *mean)
{
    for (int j = 0; j < dims; j++) {
        mean[j] = 0;
        for (int i = 0; i < n; i++)
            mean[j] += features[(size_t)i * dims + j] / n;
    }
}

void tr_feature_scales(const double *reference, int n, int dims, double *scale)
{
    double *mean = malloc((size_t)dims * sizeof(double));
    if (mean)
        tr_feature_mean(reference, n, dims, mean);
    for (int j = 0; j < dims; j++) {
        double s2 = 0;
        for (int i = 0; mean && i < n; i++)
            s2 += pow(reference[(size_t)i * dims + j] - mean[j], 2);
        double sd = n > 1 ? sqrt(s2 / (n - 1)) : 0;
        scale[j] = mean && sd > 1e-12 * (1 + fabs(mean[j])) ? sd : 1; /* a constant feature keeps its units */
    }
    free(mean);
}

/* ---------------------------------------------------------------- Fréchet distance */

#if defined(SPARGE_TRAINER_CUSOLVER)
/* dsyevd on the current CUDA device (the one the trainer's ops use): a[] column-major, as LAPACK's. */
static int column_major_eigen(double *a, int n, double *values)
{
    cusolverDnHandle_t h = NULL;
    cusolverDnParams_t params = NULL;
    double *d_a = NULL, *d_w = NULL;
    void *d_work = NULL, *h_work = NULL;
    int *d_info = NULL, info = -1;
    size_t bytes = (size_t)n * n * sizeof(double), dev_bytes = 0, host_bytes = 0;
    const cusolverEigMode_t jobz = CUSOLVER_EIG_MODE_VECTOR;
    const cublasFillMode_t uplo = CUBLAS_FILL_MODE_UPPER;
    int ok = cusolverDnCreate(&h) == CUSOLVER_STATUS_SUCCESS &&
             cusolverDnCreateParams(&params) == CUSOLVER_STATUS_SUCCESS &&
             cudaMalloc((void **)&d_a, bytes) == cudaSuccess &&
             cudaMalloc((void **)&d_w, (size_t)n * sizeof(double)) == cudaSuccess &&
             cudaMalloc((void **)&d_info, sizeof(int)) == cudaSuccess &&
             cudaMemcpy(d_a, a, bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
             cusolverDnXsyevd_bufferSize(h, params, jobz, uplo, n, CUDA_R_64F, d_a, n, CUDA_R_64F, d_w, CUDA_R_64F,
                                         &dev_bytes, &host_bytes) == CUSOLVER_STATUS_SUCCESS &&
             cudaMalloc(&d_work, dev_bytes ? dev_bytes : 1) == cudaSuccess &&
             (h_work = malloc(host_bytes ? host_bytes : 1)) != NULL &&
             cusolverDnXsyevd(h, params, jobz, uplo, n, CUDA_R_64F, d_a, n, CUDA_R_64F, d_w, CUDA_R_64F, d_work,
                              dev_bytes, h_work, host_bytes, d_info) == CUSOLVER_STATUS_SUCCESS &&
             cudaMemcpy(&info, d_info, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && info == 0 &&
             cudaMemcpy(a, d_a, bytes, cudaMemcpyDeviceToHost) == cudaSuccess &&
             cudaMemcpy(values, d_w, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(d_a);
    cudaFree(d_w);
    cudaFree(d_info);
    cudaFree(d_work);
    free(h_work);
    if (params)
        cusolverDnDestroyParams(params);
    if (h)
        cusolverDnDestroy(h);
    return ok ? 0 : -1;
}
#elif !defined(SPARGE_TRAINER_LAPACKE)
/* LAPACK's dsyevd through its Fortran interface: a[] column-major. */
static int column_major_eigen(double *a, int n, double *values)
{
    int lwork = -1, liwork = -1, iw = 0, info = 0;
    double w = 0;
    dsyevd_("V", "U", &n, a, &n, values, &w, &lwork, &iw, &liwork, &info, 1, 1); /* workspace query */
    if (info)
        return -1;
    lwork = (int)w, liwork = iw;
    double *work = malloc((size_t)lwork * sizeof(double));
    int *iwork = malloc((size_t)liwork * sizeof(int));
    if (work && iwork)
        dsyevd_("V", "U", &n, a, &n, values, work, &lwork, iwork, &liwork, &info, 1, 1);
    int ok = work && iwork && !info;
    free(work);
    free(iwork);
    return ok ? 0 : -1;
}
#endif

const char *tr_eigen_solver(void)
{
#if defined(SPARGE_TRAINER_LAPACKE)
    return "LAPACKE dsyevd";
#elif defined(SPARGE_TRAINER_CUSOLVER)
    return "cuSOLVER dsyevd";
#else
    return "LAPACK dsyevd_";
#endif
}

int tr_symmetric_eigen(double *a, int n, double *values, double *vectors)
{
#ifdef SPARGE_TRAINER_LAPACKE
    /* row-major: on return a[i·n + k] is component i of eigenvector k */
    int info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', n, a, n, values);
    if (info)
        return -1;
    memcpy(vectors, a, (size_t)n * n * sizeof(double));
    return 0;
#else
    /* a is symmetric, so its row-major array is also the column-major one; on return column k of the
     * column-major array (a[k·n + i]) is eigenvector k */
    if (column_major_eigen(a, n, values))
        return -1;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < n; k++)
            vectors[i * n + k] = a[k * n + i];
    return 0;
#endif
}

/* Mean and covariance (n − 1 denominator; zero for one sample) of standardized features. */
static void moments(const double *f, int n, int dims, const double *scale, double *mean, double *cov)
{
    for (int j = 0; j < dims; j++) {
        mean[j] = 0;
        for (int i = 0; i < n; i++)
            mean[j] += f[(size_t)i * dims + j] / scale[j] / n;
    }
    for (int j = 0; j < dims; j++)
        for (int k = 0; k < dims; k++) {
            double s = 0;
            for (int i = 0; i < n; i++)
                s += (f[(size_t)i * dims + j] / scale[j] - mean[j]) * (f[(size_t)i * dims + k] / scale[k] - mean[k]);
            cov[j * dims + k] = n > 1 ? s / (n - 1) : 0;
        }
}

/* out = a·b, n×n row-major */
static void matmul(const double *a, const double *b, double *out, int n)
{
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double sum = 0;
            for (int k = 0; k < n; k++)
                sum += a[i * n + k] * b[k * n + j];
            out[i * n + j] = sum;
        }
}

double tr_frechet_distance(const double *a, int na, const double *b, int nb, int dims, const double *scale)
{
    if (na < 1 || nb < 1 || dims < 1)
        return NAN;
    size_t d2 = (size_t)dims * dims;
    double *buf = malloc((6 * d2 + 4 * (size_t)dims) * sizeof(double));
    if (!buf)
        return NAN;
    double *ca = buf, *cb = ca + d2, *vec = cb + d2, *root = vec + d2, *tmp = root + d2, *prod = tmp + d2;
    double *ma = prod + d2, *mb = ma + dims, *val = mb + dims, *unit = val + dims;
    for (int j = 0; j < dims; j++)
        unit[j] = scale ? scale[j] : 1;
    moments(a, na, dims, unit, ma, ca);
    moments(b, nb, dims, unit, mb, cb);
    double result = 0;
    for (int j = 0; j < dims; j++)
        result += (ma[j] - mb[j]) * (ma[j] - mb[j]) + ca[j * dims + j] + cb[j * dims + j];
    /* Σa^½ = V diag(√λ) Vᵀ (tiny negative eigenvalues of a PSD matrix clamped to 0) */
    memcpy(tmp, ca, d2 * sizeof(double));
    if (tr_symmetric_eigen(tmp, dims, val, vec)) {
        free(buf);
        return NAN;
    }
    for (int i = 0; i < dims; i++)
        for (int j = 0; j < dims; j++) {
            double s = 0;
            for (int k = 0; k < dims; k++)
                s += vec[i * dims + k] * sqrt(fmax(0, val[k])) * vec[j * dims + k];
            root[i * dims + j] = s;
        }
    /* prod = Σa^½ Σb Σa^½, symmetric PSD: Tr((Σa Σb)^½) = Σ √eig(prod) */
    matmul(root, cb, tmp, dims);
    matmul(tmp, root, prod, dims);
    for (int i = 0; i < dims; i++) /* symmetrize the rounding */
        for (int j = 0; j < i; j++)
            prod[i * dims + j] = prod[j * dims + i] = 0.5 * (prod[i * dims + j] + prod[j * dims + i]);
    if (tr_symmetric_eigen(prod, dims, val, vec)) {
        free(buf);
        return NAN;
    }
    for (int j = 0; j < dims; j++)
        result -= 2 * sqrt(fmax(0, val[j]));
    free(buf);
    return fmax(0, result);
}

/* ---------------------------------------------------------------- token-level attention statistics */

/* The value of rank r (0: the largest) among x[0..n), by quickselect; x is reordered. */
static double rank_desc(double *x, int n, int r)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const double pivot = x[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot)
                i++;
            while (x[j] < pivot)
                j--;
            if (i <= j) {
                const double t = x[i];
                x[i++] = x[j];
                x[j--] = t;
            }
        }
        if (r <= j)
            hi = j;
        else if (r >= i)
            lo = i;
        else
            return x[r]; /* between the two parts: equal to the pivot */
    }
    return x[r];
}

void tr_attention_stats(const float *qkv, int B, int N, int heads, int hd, int max_rows, double top_fraction,
                        double *entropy, double *top_mass, long *rows)
{
    const int d = heads * hd, stride = N > max_rows ? (N + max_rows - 1) / max_rows : 1;
    const int top = top_fraction * N < 1 ? 1 : (int)ceil(top_fraction * N - 1e-9);
    const double scale = 1.0 / sqrt((double)hd), log_n = log((double)N);
    double ent = 0, mass = 0;
    long count = 0;
#pragma omp parallel reduction(+ : ent, mass, count)
    {
        double *e = malloc(2 * (size_t)N * sizeof(double)), *w = e ? e + N : NULL;
#pragma omp for collapse(2) schedule(static)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < heads; h++)
                for (int i = 0; e && i < N; i += stride) {
                    const float *q = qkv + ((size_t)b * N + i) * 3 * d + h * hd;
                    double mx = -INFINITY;
                    for (int j = 0; j < N; j++) {
                        const float *k = qkv + ((size_t)b * N + j) * 3 * d + d + h * hd;
                        double dot = 0;
                        for (int c = 0; c < hd; c++)
                            dot += (double)q[c] * k[c];
                        e[j] = dot * scale;
                        mx = e[j] > mx ? e[j] : mx;
                    }
                    double z = 0, zs = 0;
                    for (int j = 0; j < N; j++) { /* H = ln Z − Σ p·s, with s shifted by the row's max */
                        const double sj = e[j] - mx;
                        e[j] = exp(sj);
                        z += e[j];
                        zs += e[j] * sj;
                    }
                    ent += N > 1 ? (log(z) - zs / z) / log_n : 0.0;
                    memcpy(w, e, (size_t)N * sizeof(double));
                    const double thr = rank_desc(w, N, top - 1);
                    double above = 0;
                    int n_above = 0;
                    for (int j = 0; j < N; j++)
                        if (e[j] > thr)
                            above += e[j], n_above++;
                    mass += (above + (top - n_above) * thr) / z;
                    count++;
                }
        free(e);
    }
    *entropy += ent;
    *top_mass += mass;
    *rows += count;
}
