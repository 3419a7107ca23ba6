/* Two seeded procedural video distributions (README.md, "Data"), in two kinds of scene.
 *
 * A ("pretraining"): one sharp disc over a static texture of two colour gratings, moving on
 * a torus in the class's direction (angle 2πk/K) with a smooth class-specific lateral wobble.
 * B ("fine-tuning", deliberately off A): the same scenes, but the motion stutters and jitters,
 * frames are blurred (two passes of a [1 2 1]/4 filter), the colours shifted and scaled, and
 * pixel noise added.
 * Rich scenes (scene=rich): the texture (gratings and soft blobs) pans in the class's direction
 * with the class's wobble, and three objects of their own sizes, colours and velocities move over
 * it; B applies the same distortions. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "trainer.h"

static const double TWO_PI = 6.283185307179586;

/* Shortest signed distance on a circle of length len. */
static double wrap(double delta, double len)
{
    delta = fmod(delta, len);
    if (delta > len / 2)
        delta -= len;
    if (delta < -len / 2)
        delta += len;
    return delta;
}

/* One [1 2 1]/4 pass along x and y of frame f [H, W, C], edges clamped. */
static void blur_frame(float *f, float *tmp, int H, int W, int C)
{
    for (int pass = 0; pass < 2; pass++) {
        int dx = pass == 0, dy = pass == 1;
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                int x0 = x - dx < 0 ? 0 : x - dx, x1 = x + dx >= W ? W - 1 : x + dx;
                int y0 = y - dy < 0 ? 0 : y - dy, y1 = y + dy >= H ? H - 1 : y + dy;
                for (int c = 0; c < C; c++)
                    tmp[((size_t)y * W + x) * C + c] =
                        0.25f * f[((size_t)y0 * W + x0) * C + c] + 0.5f * f[((size_t)y * W + x) * C + c] +
                        0.25f * f[((size_t)y1 * W + x1) * C + c];
            }
        memcpy(f, tmp, (size_t)H * W * C * sizeof(float));
    }
}

/* B's distortions of one frame: blur, colour scale and shift, pixel noise. */
static void distort_frame(float *frame, float *tmp, int H, int W, int C, const double *shift, uint64_t *s)
{
    blur_frame(frame, tmp, H, W, C);
    for (size_t i = 0; i < (size_t)H * W * C; i++)
        frame[i] = (float)(0.8 * frame[i] + shift[i % C < 8 ? i % C : 7] + 0.1 * tr_normal(s));
}

/* Antialiased coverage of a disc of radius r centred at (cx, cy), at pixel (x, y) of a W×H torus. */
static double disc_alpha(int x, int y, double cx, double cy, double r, int W, int H)
{
    double a = r + 0.5 - hypot(wrap(x + 0.5 - cx, W), wrap(y + 0.5 - cy, H));
    return a < 0 ? 0 : a > 1 ? 1 : a;
}

static void simple_scene(int is_b, uint64_t s, int k, int T, int H, int W, int C, int classes, float *video)
{
    double scale = (H < W ? H : W) / 16.0; /* motion and sizes are given for 16x16 frames */
    /* background: base colour and two gratings */
    double base[8], gain[2][8], fx[2], fy[2], phase[2];
    for (int c = 0; c < C && c < 8; c++)
        base[c] = -0.6 + 0.8 * tr_uniform(&s);
    for (int g = 0; g < 2; g++) {
        fx[g] = (1 + (int)(3 * tr_uniform(&s))) * TWO_PI / W * (tr_uniform(&s) < 0.5 ? 1 : -1);
        fy[g] = (1 + (int)(3 * tr_uniform(&s))) * TWO_PI / H;
        phase[g] = TWO_PI * tr_uniform(&s);
        for (int c = 0; c < C && c < 8; c++)
            gain[g][c] = 0.25 * (2 * tr_uniform(&s) - 1);
    }
    /* object: radius, colour, start, class motion */
    double radius = scale * (2.5 + 1.5 * tr_uniform(&s)), colour[8];
    for (int c = 0; c < C && c < 8; c++)
        colour[c] = tr_uniform(&s) < 0.5 ? -0.9 + 0.2 * tr_uniform(&s) : 0.7 + 0.3 * tr_uniform(&s);
    double px = W * tr_uniform(&s), py = H * tr_uniform(&s);
    double angle = TWO_PI * k / classes + 0.3 * (tr_uniform(&s) - 0.5);
    double speed = scale * (0.9 + 0.4 * tr_uniform(&s));
    double wobble = 0.6 * scale, omega = 0.5 + 0.35 * (k % 4), wphase = TWO_PI * tr_uniform(&s);
    /* B's distortions */
    double shift[8], jitter_x = 0, jitter_y = 0, progress = 0;
    for (int c = 0; c < C && c < 8; c++)
        shift[c] = 0.25 * cos(TWO_PI * c / C + 1.0) + 0.05 * tr_normal(&s);
    float *tmp = is_b ? malloc((size_t)H * W * C * sizeof(float)) : NULL;
    for (int t = 0; t < T; t++) {
        if (is_b) { /* stuttering progress and a random walk around the path */
            progress += tr_uniform(&s) * 2.0;
            jitter_x += 0.8 * scale * tr_normal(&s);
            jitter_y += 0.8 * scale * tr_normal(&s);
        } else
            progress = t;
        double lateral = wobble * sin(omega * t + wphase);
        double cx = px + speed * progress * cos(angle) - lateral * sin(angle) + jitter_x;
        double cy = py + speed * progress * sin(angle) + lateral * cos(angle) + jitter_y;
        float *frame = video + (size_t)t * H * W * C;
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                double alpha = disc_alpha(x, y, cx, cy, radius, W, H);
                for (int c = 0; c < C; c++) {
                    int cc = c < 8 ? c : 7;
                    double bg = base[cc];
                    for (int g = 0; g < 2; g++)
                        bg += gain[g][cc] * sin(fx[g] * x + fy[g] * y + phase[g]);
                    frame[((size_t)y * W + x) * C + c] = (float)(bg * (1 - alpha) + colour[cc] * alpha);
                }
            }
        if (is_b)
            distort_frame(frame, tmp, H, W, C, shift, &s);
    }
    free(tmp);
}

enum { RICH_OBJECTS = 3, RICH_BLOBS = 4, RICH_GRATINGS = 6 };

static void rich_scene(int is_b, uint64_t s, int k, int T, int H, int W, int C, int classes, float *video)
{
    double scale = (H < W ? H : W) / 16.0;
    /* texture: base colour, gratings of up to 3 cycles per frame (fine enough that the pan dominates every frame
     * difference, coarse enough that a frame's motion stays under a quarter period) and soft blobs, panning with
     * the class's motion */
    double base[8], gain[RICH_GRATINGS][8], fx[RICH_GRATINGS], fy[RICH_GRATINGS], phase[RICH_GRATINGS];
    double bx[RICH_BLOBS], by[RICH_BLOBS], br[RICH_BLOBS], bgain[RICH_BLOBS][8];
    for (int c = 0; c < C && c < 8; c++)
        base[c] = -0.4 + 0.8 * tr_uniform(&s);
    for (int g = 0; g < RICH_GRATINGS; g++) {
        fx[g] = (int)(5 * tr_uniform(&s)) * TWO_PI / W * (tr_uniform(&s) < 0.5 ? 1 : -1);
        fy[g] = (1 + (int)(4 * tr_uniform(&s))) * TWO_PI / H;
        phase[g] = TWO_PI * tr_uniform(&s);
        for (int c = 0; c < C && c < 8; c++)
            gain[g][c] = 0.25 * (2 * tr_uniform(&s) - 1);
    }
    for (int b = 0; b < RICH_BLOBS; b++) {
        bx[b] = W * tr_uniform(&s), by[b] = H * tr_uniform(&s), br[b] = scale * (1.5 + 2.5 * tr_uniform(&s));
        for (int c = 0; c < C && c < 8; c++)
            bgain[b][c] = 0.35 * (2 * tr_uniform(&s) - 1);
    }
    double angle = TWO_PI * k / classes + 0.3 * (tr_uniform(&s) - 0.5);
    double speed = scale * (0.8 + 0.4 * tr_uniform(&s));
    double wobble = 0.5 * scale, omega = 0.5 + 0.35 * (k % 4), wphase = TWO_PI * tr_uniform(&s);
    /* objects: own radius, colour, start and velocity */
    double ox[RICH_OBJECTS], oy[RICH_OBJECTS], ovx[RICH_OBJECTS], ovy[RICH_OBJECTS], orad[RICH_OBJECTS];
    double ocol[RICH_OBJECTS][8];
    for (int o = 0; o < RICH_OBJECTS; o++) {
        ox[o] = W * tr_uniform(&s), oy[o] = H * tr_uniform(&s), orad[o] = scale * (1.2 + 1.3 * tr_uniform(&s));
        double a = TWO_PI * tr_uniform(&s), v = scale * (0.4 + 0.8 * tr_uniform(&s));
        ovx[o] = v * cos(a), ovy[o] = v * sin(a);
        for (int c = 0; c < C && c < 8; c++)
            ocol[o][c] = 0.8 * (2 * tr_uniform(&s) - 1);
    }
    double shift[8], jx[RICH_OBJECTS] = {0}, jy[RICH_OBJECTS] = {0}, progress = 0;
    for (int c = 0; c < C && c < 8; c++)
        shift[c] = 0.25 * cos(TWO_PI * c / C + 1.0) + 0.05 * tr_normal(&s);
    float *tmp = is_b ? malloc((size_t)H * W * C * sizeof(float)) : NULL;
    for (int t = 0; t < T; t++) {
        if (is_b) {
            progress += tr_uniform(&s) * 2.0;
            for (int o = 0; o < RICH_OBJECTS; o++)
                jx[o] += 0.8 * scale * tr_normal(&s), jy[o] += 0.8 * scale * tr_normal(&s);
        } else
            progress = t;
        /* the texture's displacement: class direction plus the class's lateral wobble */
        double lateral = wobble * sin(omega * t + wphase);
        double dx = speed * progress * cos(angle) - lateral * sin(angle);
        double dy = speed * progress * sin(angle) + lateral * cos(angle);
        float *frame = video + (size_t)t * H * W * C;
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                double u = x - dx, v = y - dy, alpha[RICH_OBJECTS], blob[RICH_BLOBS];
                for (int b = 0; b < RICH_BLOBS; b++) {
                    double ex = wrap(u - bx[b], W), ey = wrap(v - by[b], H);
                    blob[b] = exp(-(ex * ex + ey * ey) / (2 * br[b] * br[b]));
                }
                for (int o = 0; o < RICH_OBJECTS; o++)
                    alpha[o] = disc_alpha(x, y, ox[o] + ovx[o] * progress + jx[o], oy[o] + ovy[o] * progress + jy[o],
                                          orad[o], W, H);
                for (int c = 0; c < C; c++) {
                    int cc = c < 8 ? c : 7;
                    double val = base[cc];
                    for (int g = 0; g < RICH_GRATINGS; g++)
                        val += gain[g][cc] * sin(fx[g] * u + fy[g] * v + phase[g]);
                    for (int b = 0; b < RICH_BLOBS; b++)
                        val += bgain[b][cc] * blob[b];
                    for (int o = 0; o < RICH_OBJECTS; o++) /* later objects in front */
                        val = val * (1 - alpha[o]) + ocol[o][cc] * alpha[o];
                    frame[((size_t)y * W + x) * C + c] = (float)val;
                }
            }
        if (is_b)
            distort_frame(frame, tmp, H, W, C, shift, &s);
    }
    free(tmp);
}

void tr_data_sample_scene(char dist, tr_scene scene, uint64_t seed, uint64_t index, int T, int H, int W, int C,
                          int classes, float *video, int *label)
{
    int is_b = dist == 'B' || dist == 'b';
    uint64_t s = tr_mix(tr_mix(seed) ^ tr_mix(index + 0x9e3779b97f4a7c15ull) ^ (is_b ? 0xb0b0b0b0ull : 0) ^
                        (scene == TR_SCENE_RICH ? 0x51c4e5ull : 0));
    int k = (int)(tr_uniform(&s) * classes);
    if (k >= classes)
        k = classes - 1;
    *label = k;
    if (scene == TR_SCENE_RICH)
        rich_scene(is_b, s, k, T, H, W, C, classes, video);
    else
        simple_scene(is_b, s, k, T, H, W, C, classes, video);
}

void tr_data_sample(char dist, uint64_t seed, uint64_t index, int T, int H, int W, int C, int classes, float *video,
                    int *label)
{
    tr_data_sample_scene(dist, TR_SCENE_SIMPLE, seed, index, T, H, W, C, classes, video, label);
}

void tr_video_statistics(const float *v, int T, int H, int W, int C, tr_video_stats *out)
{
    double sx = 0, st = 0, sj = 0, c0 = 0;
    size_t nx = 0, nt = 0, nj = 0, n0 = 0;
    for (int t = 0; t < T; t++)
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++)
                for (int c = 0; c < C; c++) {
                    size_t i = (((size_t)t * H + y) * W + x) * C + c, frame = (size_t)H * W * C;
                    if (x + 1 < W)
                        sx += fabs(v[i + C] - v[i]), nx++;
                    if (t + 1 < T)
                        st += fabs(v[i + frame] - v[i]), nt++;
                    if (t > 0 && t + 1 < T)
                        sj += fabs(v[i + frame] - 2 * v[i] + v[i - frame]), nj++;
                    if (c == 0)
                        c0 += v[i], n0++;
                }
    out->sharpness = nx ? sx / nx : 0;
    out->temporal_change = nt ? st / nt : 0;
    out->temporal_jitter = nj ? sj / nj : 0;
    out->mean_c0 = n0 ? c0 / n0 : 0;
}
