/* sparge-train: a tiny video DiT trained with sparge attention in the loop.
 *
 * llm.c-style plain C11: one float array holds every parameter (and its gradient and AdamW
 * moments in the same layout), one float array holds every activation the backward needs.
 * Forward and backward are written by hand; GEMMs go through CBLAS on the host or cuBLAS on a
 * CUDA device (ops.h), attention through libsparge's public API on a sparge_device. README.md
 * beside this file documents the model, the losses, the data and the configuration keys. */
#ifndef SPARGE_TRAINER_H
#define SPARGE_TRAINER_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"
#include "sparge.h"

/* ---------------------------------------------------------------- configuration */

typedef enum { TR_ATTN_DENSE = 0, TR_ATTN_HYBRID, TR_ATTN_TOPK, TR_ATTN_TOPP } tr_attn_mode;
typedef enum { TR_LOSS_DIFFUSION = 0, TR_LOSS_VD } tr_loss_kind;
/* train; eval: held-out metrics of init=; calibrate: the Top-p of attn= (topp, or hybrid with its topk) that gives
 * target_sparsity on held-out inputs; dump: the model's Q/K/V per layer at dump_times into dump_dir */
typedef enum { TR_MODE_TRAIN = 0, TR_MODE_EVAL, TR_MODE_CALIBRATE, TR_MODE_DUMP } tr_mode;
typedef enum { TR_SCENE_SIMPLE = 0, TR_SCENE_RICH } tr_scene;

typedef struct {
    /* model */
    int frames, height, width, channels; /* video [T, H, W, C], patches 1x2x2 */
    int dim, heads, depth, classes, mlp_ratio;
    int adaln_single; /* adaln=single: every block's adaLN modulation shares one weight and keeps its own bias
                       * (PixArt-α's adaLN-single); adaln=block (0): a weight per block, as DiT */
    /* attention */
    tr_attn_mode attn;
    double topk, topp;
    int block_q, block_k;
    char device[64];
    int stage_attention; /* copy Q/K/V, O, LSE, dO through separate sparge_malloc buffers even on a host
                          * device, the path GPU devices take with device_ops=0 (lets CPU tests cover it) */
    int device_ops;      /* on a CUDA device: run the whole model there (ops_cuda.cu); 0: on the host, with the
                          * attention staged through device buffers */
    int tf32;            /* device ops: cuBLAS may use TF32 tensor cores (default 0: strict fp32) */
    char attn_dtype[8];  /* "f32", or "bf16": Q/K/V, O and dO cast to bf16 for the attention calls (sparge's
                          * tuned cuda kernels need it); the rest of the model stays f32 */
    /* training */
    tr_loss_kind loss;
    char data[8]; /* "A" or "B" */
    tr_scene scene; /* scene=simple (one disc over a static texture) or rich (several objects, camera pan) */
    int steps, batch, log_every, ckpt_every, warmup; /* warmup: linear LR warm-up steps */
    double lr, beta1, beta2, adam_eps, weight_decay, grad_clip;
    uint64_t seed;      /* init, noise and timesteps */
    uint64_t data_seed; /* the video stream (the same across seeds by default) */
    char init[512];    /* checkpoint to start from (weights only); "" = fresh init */
    char teacher[512]; /* frozen full-attention teacher for loss=vd; "" = the init weights */
    char resume[512];  /* checkpoint to resume (weights, AdamW moments, step) */
    char out[512];     /* checkpoint written every ckpt_every steps and at the end; "" = none */
    char log[512];     /* CSV log; "" = none */
    double time_limit;     /* seconds: training stops at the first step boundary past it, checkpoint written (0: none) */
    double ckpt_shard_mib; /* checkpoints above this size are split into shards of at most it (0: one file) */
    int save_optimizer;    /* 1 (default): checkpoints hold the AdamW moments and step (resume=); 0: weights only */
    char tag[256];         /* free text (e.g. the commit) printed with the configuration and kept in checkpoints */
    /* evaluation, calibration and dumps */
    tr_mode mode;
    int sample_steps;  /* Euler steps */
    int eval_batches;  /* held-out batches of `batch` videos */
    double target_sparsity; /* mode=calibrate */
    int calib_iters;        /* mode=calibrate: bisection steps */
    char dump_dir[512];     /* mode=dump: where the files go */
    char dump_times[128];   /* mode=dump: comma-separated diffusion times in [0, 1] */
} tr_config;

void tr_config_defaults(tr_config *c);
/* Apply one "key=value" (also accepts "--key=value"). Returns 0, or -1 with a message in err. */
int tr_config_set(tr_config *c, const char *assignment, char *err, size_t err_len);
/* Read a file of key=value lines ('#' starts a comment). Returns 0, or -1 with a message in err. */
int tr_config_load(tr_config *c, const char *path, char *err, size_t err_len);
/* Shapes must agree (dim % heads, dim even, height/width even, ...). Returns 0, or -1 with a message. */
int tr_config_check(const tr_config *c, char *err, size_t err_len);
/* One line "frames=8 height=16 ..." of the model keys (stored in checkpoints). */
void tr_config_model_string(const tr_config *c, char *out, size_t len);
/* Every key as "key=value" separated by spaces (the run's record in its log). */
void tr_config_string(const tr_config *c, char *out, size_t len);
const char *tr_attn_mode_name(tr_attn_mode m);

/* ---------------------------------------------------------------- model */

#define TR_MAX_DEPTH 64

/* One named parameter tensor inside the flat array. PyTorch conventions: Linear weights are
 * [out, in]. decay: AdamW weight decay applies (matrices, not biases or embeddings). */
typedef struct {
    char name[64];
    int ndim;
    int64_t shape[2];
    size_t offset, size;
    int decay;
} tr_param;

/* Shapes derived from the config. */
typedef struct {
    int B;                 /* batch the activations are sized for */
    int T, H, W, C;        /* video */
    int Hp, Wp, N;         /* token grid (Hp = H/2, Wp = W/2), N = T*Hp*Wp tokens in raster (t, y, x) order */
    int P;                 /* patch vector: 2*2*C values, order (py, px, c) */
    int d, nh, hd, M, F;   /* width, heads, head dim, MLP hidden, timestep frequency dim */
    int L, K;              /* depth, classes */
} tr_dims;

typedef struct tr_model tr_model;

/* Creates a model for batch B with its attention on dev (not owned; kept open by the caller) and
 * its other operations on the ops table the config asks for (device_ops: CUDA's on a CUDA device
 * when built, else the host's). Parameters start at zero: call tr_model_init or load a
 * checkpoint. Returns NULL with a message. */
tr_model *tr_model_create(const tr_config *c, int B, sparge_device *dev, char *err, size_t err_len);
void tr_model_free(tr_model *m);
const tr_dims *tr_model_dims(const tr_model *m);
size_t tr_model_num_params(const tr_model *m);
int tr_model_num_tensors(const tr_model *m);
const tr_param *tr_model_tensor(const tr_model *m, int i);
const tr_param *tr_model_find(const tr_model *m, const char *name);
/* The model's ops table; its name ("host", "cuda") says where the arrays below live. */
tr_ops *tr_model_ops(tr_model *m);
/* Parameters and gradients (one flat array each, tr_param offsets), in the ops table's memory:
 * host arrays only for host ops. tr_model_get_params/set_params copy them from/to the host. */
float *tr_model_params(tr_model *m);
float *tr_model_grads(tr_model *m);
int tr_model_get_params(tr_model *m, float *host, char *err, size_t err_len);
int tr_model_set_params(tr_model *m, const float *host, char *err, size_t err_len);

/* DiT init: Xavier-uniform linears, N(0, 0.02) embeddings and timestep MLP, zero biases, and
 * adaLN-Zero (every adaLN modulation and the final linear start at zero). Seeded. */
int tr_model_init(tr_model *m, uint64_t seed, char *err, size_t err_len);

/* Attention of every block: mode (dense: no mask), Top-k/Top-p parameters, block sizes from
 * the config at creation. The mask is predicted on every forward, unless frozen (then the
 * last predicted masks are reused: the gradient check needs a fixed mask). */
void tr_model_set_attention(tr_model *m, tr_attn_mode mode, double topk, double topp);
void tr_model_freeze_masks(tr_model *m, int frozen);
/* Called on every forward with each block's Q/K/V before its attention: qkv is a host array [B, N, 3, heads, hd]
 * (the model's qkv activation). Returns 0, or -1 with a message (the forward then fails). */
typedef int (*tr_qkv_hook)(void *ctx, int layer, const float *qkv, char *err, size_t err_len);
void tr_model_set_qkv_hook(tr_model *m, tr_qkv_hook hook, void *ctx);
/* The last predicted mask of block `layer` as a host dense uint8 [B, heads, Nqb, Nkb]. */
int tr_model_mask_dense(const tr_model *m, int layer, uint8_t *host, char *err, size_t err_len);
/* Mean block sparsity over the blocks of the last forward (0 for dense). */
double tr_model_last_sparsity(const tr_model *m);
/* When on, every sparse attention call also runs dense attention on the same Q/K/V (the paper's
 * Table 2 measure): tr_model_last_attention_l1 is then the mean over blocks of the relative L1
 * error Σ|O_sparse − O_dense| / Σ|O_dense| of the last forward (0 for dense attention). */
void tr_model_measure_attention_error(tr_model *m, int on);
double tr_model_last_attention_l1(const tr_model *m);
/* Milliseconds per part (tr_part: attention = the sparge calls, GEMMs, other) of the model's and
 * its optimizer's work since the last call; clock on the host, CUDA events on the device. */
void tr_model_times(tr_model *m, double ms[TR_PARTS]);

/* u[B,T,H,W,C] = velocity at x[B,T,H,W,C], time t[B] in [0,1] and class y[B] (host arrays, B
 * = the batch of creation; u may be NULL: the velocity stays in the model, tr_model_velocity).
 * Keeps the activations for tr_model_backward. Returns 0, or -1 with a message. */
int tr_model_forward(tr_model *m, const float *x, const float *t, const int *y, float *u, char *err,
                     size_t err_len);
/* The velocity of the last forward, in the ops table's memory. */
const float *tr_model_velocity(const tr_model *m);
/* Loss of the last forward against a host target[B,T,H,W,C], or (target NULL) against the
 * velocity of teacher's last forward (same batch and ops): *loss = mean((u − target)²),
 * accumulated in double, and dLoss/du kept for tr_model_backward(m, NULL, ...). */
int tr_model_loss(tr_model *m, const float *target, const tr_model *teacher, double *loss, char *err,
                  size_t err_len);
/* Adds the gradient of the loss with respect to every parameter, given du = dLoss/du of the
 * last forward (a host array, or NULL for the one tr_model_loss kept), to the gradient array
 * (zero it with tr_model_zero_grad). */
int tr_model_backward(tr_model *m, const float *du, char *err, size_t err_len);
void tr_model_zero_grad(tr_model *m);

/* ---------------------------------------------------------------- data */

/* Procedural videos in [-1, 1]-ish, layout [T, H, W, C]. Sample `index` of distribution
 * 'A' or 'B' under `seed` is a pure function of (dist, seed, index, shape): any sample can
 * be regenerated alone. Its class (the motion pattern) is written to *label. */
void tr_data_sample(char dist, uint64_t seed, uint64_t index, int T, int H, int W, int C, int classes, float *video,
                    int *label);
/* The same in either kind of scene (tr_data_sample is scene=simple). Rich scenes: the texture pans in the class's
 * direction and three objects move over it with their own velocities (README.md, "Data"). */
void tr_data_sample_scene(char dist, tr_scene scene, uint64_t seed, uint64_t index, int T, int H, int W, int C,
                          int classes, float *video, int *label);

/* Statistics used by the tests and the metrics, means over the video: |horizontal pixel
 * difference| (sharpness, raised by noise too), |frame difference| (temporal change),
 * |second temporal difference| (temporal jitter: jerky motion and noise), channel 0 (colour). */
typedef struct {
    double sharpness, temporal_change, temporal_jitter, mean_c0;
} tr_video_stats;
void tr_video_statistics(const float *video, int T, int H, int W, int C, tr_video_stats *out);

/* ---------------------------------------------------------------- metrics (metrics.c) */

/* Global motion of a video [T, H, W, C] (T ≥ 3): the peak of the circular cross-correlation of
 * consecutive frame differences (the static background cancels in a difference), summed over
 * frame pairs and channels, over shifts up to min(H, W)/4 pixels, refined to sub-pixel by a
 * parabola per axis and then by Gauss–Newton on Σ_t ‖D_t+1(x) − D_t(x − v)‖². label: the class
 * whose direction 2πk/classes is nearest to the motion angle (A's classes), -1 when T < 3 or
 * nothing moves. */
typedef struct {
    int label;
    double vx, vy;  /* pixels per frame, x to the right, y down (rows) */
    double speed;   /* hypot(vx, vy) */
    double angle;   /* atan2(vy, vx) in [0, 2π) */
    double strength; /* correlation at the peak / Σ‖D_t‖‖D_t+1‖, in [−1, 1]; ≈ 0 on noise */
} tr_motion;
/* Returns 0, or -1 (label -1) when T < 3, a frame is smaller than 2×2 or the video is static. */
int tr_motion_estimate(const float *video, int T, int H, int W, int C, int classes, tr_motion *out);

/* A fixed per-video feature vector (README.md, "Evaluation", lists each): per-channel mean and
 * std of channels 0..2 (the last channel repeated when C < 3), the tr_video_statistics values
 * (sharpness, temporal change, temporal jitter), the motion speed and peak strength of
 * tr_motion_estimate, log10 of the mean spatial variance of a frame and the share of its power
 * spectrum below 1/8 and from 1/4 cycles per pixel, Immerkær's noise std, the RMS pixel
 * difference with that noise taken out, and the motion-compensated temporal consistency. */
enum {
    TR_FEAT_SHARPNESS = 6, TR_FEAT_MOTION_SPEED = 9, TR_FEAT_MOTION_STRENGTH = 10, TR_FEAT_NOISE_SIGMA = 14,
    TR_FEAT_GRADIENT_RMS = 15, TR_FEAT_TEMPORAL_CONSISTENCY = 16, TR_FEATURES = 17
};
extern const char *const tr_feature_names[TR_FEATURES];
/* features[TR_FEATURES]. Returns 0, or -1 when out of memory (features zeroed). */
int tr_video_features(const float *video, int T, int H, int W, int C, double *features);
/* mean[dims] of n feature rows (row-major [n, dims]). */
void tr_feature_mean(const double *features, int n, int dims, double *mean);
/* Per-feature standardization scale: the std over the reference rows (1 for a constant feature). */
void tr_feature_scales(const double *reference, int n, int dims, double *scale);
/* Fréchet distance ‖μa − μb‖² + Tr(Σa + Σb − 2(Σa^½ Σb Σa^½)^½) of two sets of feature rows, each
 * feature divided by scale[j] first (NULL: none); in double, ≥ 0. NaN for an empty set or when the eigen-solver fails. */
double tr_frechet_distance(const double *a, int na, const double *b, int nb, int dims, const double *scale);
/* Eigen-decomposition of the symmetric n×n row-major matrix a (destroyed) by LAPACK's dsyevd (through LAPACKE,
 * or its Fortran interface where configure found no LAPACKE), or by cuSOLVER's on the current CUDA device in a
 * build without a host LAPACK: values[n] ascending, and the eigenvectors as the columns of vectors[n×n].
 * Returns 0, or -1 when the solver reports a failure (no CUDA device, for cuSOLVER) or memory runs out. */
int tr_symmetric_eigen(double *a, int n, double *values, double *vectors);
/* The eigen-solver of this build: "LAPACKE dsyevd", "LAPACK dsyevd_" or "cuSOLVER dsyevd". */
const char *tr_eigen_solver(void);
/* Imaging quality of one video in [0, 1] against the reference set's mean feature vector:
 * min(1, g/g_ref) · g_ref / (g_ref + max(0, σ − σ_ref)), g = TR_FEAT_GRADIENT_RMS (blur lowers
 * it), σ = TR_FEAT_NOISE_SIGMA (noise above the reference's lowers the score). */
double tr_imaging_quality(const double *features, const double *reference_mean);
/* Token-level flatness of the attention of one block's qkv activation [B, N, 3, heads, hd] (the layout of
 * tr_qkv_hook): for query rows 0, s, 2s, … (s = ⌈N / max_rows⌉) of every batch element and head, the exact softmax
 * of q·kᵀ/√hd over all N keys in double; adds each row's entropy normalized by ln N (1: uniform) to *entropy, the
 * mass of its ⌈top_fraction·N⌉ largest weights to *top_mass, and the number of rows to *rows. */
void tr_attention_stats(const float *qkv, int B, int N, int heads, int hd, int max_rows, double top_fraction,
                        double *entropy, double *top_mass, long *rows);

/* ---------------------------------------------------------------- training */

/* A seeded SplitMix64 stream for noise, timesteps and init. */
uint64_t tr_mix(uint64_t x);
double tr_uniform(uint64_t *state);
double tr_normal(uint64_t *state);
/* The state after `draws` calls of tr_uniform from `state` (tr_normal makes two). */
uint64_t tr_rng_skip(uint64_t state, uint64_t draws);

typedef struct {
    float *m, *v; /* AdamW moments, the parameters' layout, in the model's ops memory */
    size_t n;
    int64_t step;  /* optimizer steps taken */
    tr_ops *ops;   /* the model's, which allocated m and v */
} tr_adamw;

/* Zero moments for model m, in its ops memory. Returns 0, or -1 with a message. */
int tr_adamw_init(tr_adamw *opt, tr_model *m, char *err, size_t err_len);
void tr_adamw_free(tr_adamw *opt);
/* One AdamW step with bias correction; decoupled weight decay on tensors with decay set. */
int tr_adamw_step(tr_adamw *opt, tr_model *m, double lr, double beta1, double beta2, double eps, double wd,
                  char *err, size_t err_len);
/* Scales the gradients so that their global L2 norm is at most max_norm (if > 0); *norm = the norm before. */
int tr_clip_grad_norm(tr_model *m, double max_norm, double *norm, char *err, size_t err_len);

/* Builds one batch for `step`, a pure function of (cfg->seed, step): clean videos x0, classes y,
 * times t ~ U(0,1), noise eps and x_t = (1 − t)·x0 + t·eps. Arrays of batch cfg->batch. */
void tr_make_batch(const tr_config *cfg, const tr_dims *dm, int64_t step, float *x0, int *y, float *t, float *eps,
                   float *xt);

/* Mean squared error between u and target over n values (accumulated in double); writes
 * du = dLoss/du when du is non-NULL. */
double tr_mse(const float *u, const float *target, size_t n, float *du);

/* Checkpoint as safetensors: every parameter under its name (F32), with opt != NULL also
 * "adamw.m.<name>", "adamw.v.<name>" and "train.step", and the model keys as metadata. */
int tr_checkpoint_save(const char *path, tr_model *m, const tr_adamw *opt, const tr_config *c, char *err,
                       size_t err_len);
/* Loads the parameters (shapes must match the model), and with opt != NULL the moments and
 * step (which must be present). Returns 0, or -1 with a message; nothing is changed on error. */
int tr_checkpoint_load(const char *path, tr_model *m, tr_adamw *opt, char *err, size_t err_len);

/* Euler ODE sampler of the rectified flow: from x = noise at t = 1 to t = 0 in `steps` equal
 * steps, x ← x − Δt·u(x, t, y). x [B,T,H,W,C] holds the noise on entry and the sample on exit;
 * scratch holds B*T*H*W*C floats. */
int tr_sample_euler(tr_model *m, float *x, const int *y, int steps, float *scratch, char *err, size_t err_len);

/* The whole training loop of sparge-train (progress on stderr, CSV log, checkpoints). */
int tr_train(const tr_config *cfg, char *err, size_t err_len);

/* Held-out evaluation of init= under cfg's attention (README.md, "Evaluation"). */
typedef struct {
    double velocity_mse, velocity_rel_l2; /* to teacher= on held-out A inputs (NaN without a teacher) */
    double diffusion_loss;                /* ‖u − (ε − x0)‖² mean on the same inputs */
    double sparsity;                      /* mean block sparsity of the masks on those inputs */
    double attention_rel_l1;              /* mean relative L1 of sparse vs dense attention output, same Q/K/V */
    /* the model's exact (dense) attention on those inputs, tr_attention_stats over every block (TR_ATTN_STAT_ROWS
     * query rows per video and head): mean normalized token-level entropy, mean mass of a row's top 5 % keys */
    double attention_entropy, attention_top5_mass;
    tr_video_stats sample, reference;     /* means over Euler samples and over real videos of the same classes */
    /* VBench-like scores (README.md, "Evaluation"); "reference_" ones are of the batches' real videos */
    double class_accuracy;           /* tr_motion_estimate on the samples vs their classes (NaN if frames < 3) */
    double reference_class_accuracy; /* the same on the real videos */
    double frechet;                  /* samples vs TR_EVAL_REFERENCE_VIDEOS other real held-out A videos */
    double frechet_floor;            /* the real videos (as many as the samples) vs that set: a perfect model */
    double imaging_quality, reference_imaging_quality;           /* means of tr_imaging_quality */
    double temporal_consistency, reference_temporal_consistency; /* means of TR_FEAT_TEMPORAL_CONSISTENCY */
} tr_eval_result;
/* Size of the fixed reference set of the Fréchet distance and of the imaging-quality reference. */
#define TR_EVAL_REFERENCE_VIDEOS 256
#define TR_ATTN_STAT_ROWS 128
int tr_evaluate(const tr_config *cfg, tr_eval_result *out, char *err, size_t err_len);

/* mode=calibrate: bisection (calib_iters steps, p on a 1e-6 grid) for the p of attn= (topp, or hybrid with its
 * topk) whose mean mask sparsity over the eval_batches held-out batches of mode=eval is target_sparsity; *p_out
 * and the sparsity it gives. Returns 0, or -1 with a message. */
int tr_calibrate(const tr_config *cfg, double *p_out, double *sparsity_out, char *err, size_t err_len);
/* mode=dump: the first held-out batch of mode=eval at each of dump_times, through init= under cfg's attention;
 * every block's Q, K, V before its attention go to dump_dir/Lll_tT.TTT.safetensors (tensors q, k, v, F32
 * [batch, heads, tokens, head_dim], the layout exp_* --input reads), listed in dump_dir/manifest.csv. */
int tr_dump(const tr_config *cfg, char *err, size_t err_len);

#endif
