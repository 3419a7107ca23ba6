/* sparge — trainable block-sparse attention (SpargeAttention2) in portable C.
 *
 * One public header. Every function returns a sparge_status; on failure
 * sparge_last_error() holds "file:line: what failed: why" for the calling
 * thread and no output has been written. Nothing here aborts the process.
 *
 * Tensors are 4-D views [B, H, N, D] with element strides, so BHND and BNHD
 * (the layout diffusion models use) both work without copies. Their data lives
 * on the device they are used with: host memory for "cpu"/"cpu-ref", device
 * memory (sparge_malloc) for "cuda:N"/"hip:N". */
#ifndef SPARGE_H
#define SPARGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SPARGE_VERSION_MAJOR 0
#define SPARGE_VERSION_MINOR 1
#define SPARGE_VERSION_PATCH 0

typedef enum {
    SPARGE_OK = 0,
    SPARGE_ERR_NULL,           /* a required pointer is NULL */
    SPARGE_ERR_INVALID,        /* a value is out of range (k, p, scale, block size, dim ≤ 0) */
    SPARGE_ERR_SHAPE,          /* shapes of the arguments disagree */
    SPARGE_ERR_DTYPE,          /* dtypes of the arguments disagree */
    SPARGE_ERR_OVERFLOW,       /* a size computation overflows */
    SPARGE_ERR_MASK,           /* the mask was built for other shapes or blocks */
    SPARGE_ERR_UNSUPPORTED,    /* valid, but this backend cannot do it (D, dtype, alignment, op) */
    SPARGE_ERR_NO_DEVICE,      /* unknown backend, backend not compiled in, or no such device */
    SPARGE_ERR_OUT_OF_MEMORY,
    SPARGE_ERR_RUNTIME         /* the device runtime failed (message carries its text) */
} sparge_status;

/* Stable name of a status ("SPARGE_ERR_SHAPE"). */
const char *sparge_status_name(sparge_status s);
/* Message of the last failure on this thread ("" if none). */
const char *sparge_last_error(void);

/* ---------------------------------------------------------------- tensors */

/* Storage dtypes (arithmetic is fp32, fp64 in cpu-ref). SPARGE_F64 is for the reference: only "cpu-ref" takes it,
 * so that gradients can be checked against finite differences in double precision. */
typedef enum { SPARGE_F32 = 0, SPARGE_F16 = 1, SPARGE_BF16 = 2, SPARGE_F64 = 3 } sparge_dtype;

size_t sparge_dtype_size(sparge_dtype t);
const char *sparge_dtype_name(sparge_dtype t);

typedef struct {
    void *data;
    sparge_dtype dtype;
    int64_t shape[4];  /* B, H, N, D */
    int64_t stride[4]; /* in elements, per dimension of shape */
} sparge_tensor;

/* Contiguous [B,H,N,D] view. */
sparge_tensor sparge_tensor_bhnd(void *data, sparge_dtype t, int64_t B, int64_t H, int64_t N, int64_t D);
/* View of contiguous [B,N,H,D] memory as [B,H,N,D]. */
sparge_tensor sparge_tensor_bnhd(void *data, sparge_dtype t, int64_t B, int64_t H, int64_t N, int64_t D);
/* Bytes spanned by a view (max offset + 1 element); 0 if invalid. */
size_t sparge_tensor_span_bytes(const sparge_tensor *t);

/* fp16 / bf16 conversion helpers (round to nearest even). */
uint16_t sparge_f32_to_f16(float x);
float sparge_f16_to_f32(uint16_t h);
uint16_t sparge_f32_to_bf16(float x);
float sparge_bf16_to_f32(uint16_t h);

/* ---------------------------------------------------------------- devices */

typedef struct sparge_device sparge_device;

/* Backends compiled into this library: "cpu-ref", "cpu", "cuda", "cuda-generic", "hip". */
int sparge_backend_count(void);
const char *sparge_backend_name(int i);
/* Devices a backend sees now (0 when compiled in but no device is present). */
int sparge_backend_device_count(const char *backend);

/* name: "cpu", "cpu-ref", "cuda[:N]", "cuda-generic[:N]", "hip[:N]", or "auto"
 * (first GPU found, else "cpu"). */
sparge_status sparge_device_open(const char *name, sparge_device **out);
void sparge_device_close(sparge_device *dev);
const char *sparge_device_name(const sparge_device *dev);   /* "cuda:0" */
const char *sparge_device_backend(const sparge_device *dev); /* "cuda" */
/* One-line human description (GPU model, cores and SIMD level, ...). */
const char *sparge_device_description(const sparge_device *dev);

/* Memory usable as tensor data on dev. Host memory for CPU devices. */
sparge_status sparge_malloc(sparge_device *dev, size_t bytes, void **ptr);
sparge_status sparge_free(sparge_device *dev, void *ptr);
sparge_status sparge_memcpy_to_device(sparge_device *dev, void *dst, const void *src_host, size_t bytes);
sparge_status sparge_memcpy_to_host(sparge_device *dev, void *dst_host, const void *src, size_t bytes);
sparge_status sparge_memset(sparge_device *dev, void *dst, int byte, size_t bytes);
/* Wait for all work queued on dev. GPU ops are asynchronous on the device's stream. */
sparge_status sparge_synchronize(sparge_device *dev);
/* Time the work queued between start and stop, in milliseconds (CUDA/HIP
 * events on GPUs, wall clock after a synchronize on CPUs). stop synchronizes. */
sparge_status sparge_timer_start(sparge_device *dev);
sparge_status sparge_timer_stop(sparge_device *dev, double *ms);
/* Run subsequent work on this stream (cudaStream_t / hipStream_t); NULL = default. Switching to a different
 * stream first waits for the work queued on the old one (the handle's scratch memory serves both). */
sparge_status sparge_set_stream(sparge_device *dev, void *stream);

/* ---------------------------------------------------------------- what runs where */

/* A device is a chain of tiers: "cuda:N" runs each call on the tensor-core tier "cuda" when it supports it and
 * otherwise on the portable tier "cuda-generic" of the same GPU; other devices have one tier. */
typedef enum {
    SPARGE_OP_POOL = 0,
    SPARGE_OP_POOLED_MAP,
    SPARGE_OP_MASK_SELECT,
    SPARGE_OP_MASK_PREDICT,
    SPARGE_OP_FORWARD,
    SPARGE_OP_BACKWARD,
    SPARGE_OP_COUNT
} sparge_op;

const char *sparge_op_name(sparge_op op); /* "forward" */

/* What a tier's limits depend on. Fields that do not apply to an op are ignored. */
typedef struct {
    sparge_op op;
    sparge_dtype dtype;     /* of the input tensors (q, k, v, ... or pool's x); the map and selection: f32 */
    int64_t head_dim;       /* D */
    int block_q, block_k;   /* the mask's blocks; 0 for dense attention */
    int64_t B, H, Nq, Nk;   /* sizes, H the query heads (pool: N in Nq; the map and selection: Nqb, Nkb in Nq, Nk;
                             * varlen: sequences and the longest one's tokens) */
    int rows_aligned;       /* every row of every tensor is contiguous along D and starts 16-byte aligned */
    int deterministic;      /* backward: bitwise reproducible */
    int64_t kv_heads;       /* attention, prediction: K's heads (0: H) */
    int causal, varlen;     /* the mask's layout (or the dense call's causal flag) */
} sparge_op_desc;

/* SPARGE_OK if dev runs the call described by d; *tier (may be NULL) names the tier that would run it.
 * Otherwise SPARGE_ERR_UNSUPPORTED, and sparge_last_error() says why each tier refuses; SPARGE_ERR_INVALID for a
 * description no call can have (an unknown op or dtype, a negative size, kv_heads not dividing H, causal attention
 * with more queries than keys). */
sparge_status sparge_device_supports(sparge_device *dev, const sparge_op_desc *d, const char **tier);

/* ---------------------------------------------------------------- options */

/* Tuning switches of a device (kernel variants for ablations and benchmarks, the CPU's SIMD tier, strict).
 * Each has a name, a value and an environment variable that sets it when the device opens; "auto" is each
 * one's default. Every device has "strict": "on" refuses a call that the device's first tier cannot run
 * instead of running it on the next tier (SPARGE_STRICT). Changing an option affects later calls only. */
int sparge_device_option_count(const sparge_device *dev);
/* Option i (0 ≤ i < count): name, current value, accepted values ("auto|mma|wgmma"), environment variable and
 * help; any output may be NULL. */
sparge_status sparge_device_option(const sparge_device *dev, int i, const char **name, const char **value,
                                   const char **values, const char **env, const char **help);
sparge_status sparge_device_get_option(const sparge_device *dev, const char *name, const char **value);
/* An invalid name or value is refused (SPARGE_ERR_INVALID naming the accepted ones) and changes nothing. */
sparge_status sparge_device_set_option(sparge_device *dev, const char *name, const char *value);

/* Relative L2 error against cpu-ref that every backend is held to for outputs stored in dtype
 * (docs/DESIGN.md, "Conformance"): f32 1e-5, f16 3e-3, bf16 1e-2 (f64 1e-12). 0 for an unknown dtype. */
double sparge_dtype_tolerance(sparge_dtype t);

/* ---------------------------------------------------------------- masks */

typedef struct {
    int block_q;  /* query block size bq (0 → 128, or the mask's when a mask is given) */
    int block_k;  /* key block size bk (0 → 64, or the mask's when a mask is given) */
    double topk;  /* Top-k fraction in [0,1]; 0 disables */
    double topp;  /* Top-p mass in [0,1]; 0 disables; topk = topp = 0 is invalid */
    float scale;  /* softmax scale for the pooled map; 0 → 1/sqrt(D) */
    int causal;   /* sparge_attention without a mask: the temporary mask is block-causal (with a mask: 0 or the
                   * mask's) */
} sparge_mask_params;

/* Paper default: hybrid k = 0.03, p = 0.20, bq = 128, bk = 64. */
sparge_mask_params sparge_mask_params_default(void);

/* A block mask for one (B, H, Nq, Nk, bq, bk), stored on its device:
 * per (b,h,i) a count and ascending kept key blocks (CSR, row stride Nkb),
 * a dense uint8 [B,H,Nqb,Nkb] view, the pooled map and kept pooled mass per row
 * when it was predicted, and the transpose per (b,h,j) (row stride Nqb). The
 * transpose is built on first use, once per selection, by the backward or
 * sparge_mask_get_csr, so forward-only use never pays for it.
 * H counts query heads: with grouped K/V heads (k and v with Hkv heads, Hkv dividing H) each query head has its
 * own mask rows. A mask may outlive its device handle (docs/RELIABILITY.md). */
typedef struct sparge_mask sparge_mask;

sparge_status sparge_mask_create(sparge_device *dev, int64_t B, int64_t H, int64_t Nq, int64_t Nk,
                                 int block_q, int block_k, sparge_mask **out);

/* The layout of a mask beyond sparge_mask_create's (docs/DESIGN.md §1.12): block-causal attention, and batches of
 * variable-length sequences packed along N (flash-attn's varlen convention). */
typedef struct {
    int64_t B;           /* batch; with cu_seqlens: the number of sequences */
    int64_t H;           /* query heads */
    int64_t Nq, Nk;      /* tokens per sequence; with cu_seqlens: the packed totals (cu_seqlens_q[B], _k[B]) */
    int block_q, block_k;
    int causal;          /* keys after a query's diagonal (bottom-right aligned: key u ≤ t + Nk − Nq) are never
                          * attended; Nq ≤ Nk per sequence */
    const int32_t *cu_seqlens_q, *cu_seqlens_k; /* NULL, or host arrays of B+1 non-decreasing token offsets
                                                 * from 0: sequence b is tokens [cu[b], cu[b+1]) of the packed
                                                 * tensors ([1, H, Nq, D] views); copied by the call. A sequence
                                                 * may be empty, but one with queries needs keys */
} sparge_mask_layout;
sparge_status sparge_mask_create_ex(sparge_device *dev, const sparge_mask_layout *layout, sparge_mask **out);
void sparge_mask_destroy(sparge_mask *mask);

/* A varlen mask's arrays are laid out as B sequences of the longest one's blocks: Nq, Nk below are the longest
 * sequence's tokens, Nqb, Nkb its blocks; rows and columns past a shorter sequence's blocks hold nothing (count 0,
 * dense 0). */
typedef struct {
    int64_t B, H, Nq, Nk;
    int block_q, block_k;
    int64_t Nqb, Nkb;
    int causal, varlen;
} sparge_mask_shape;
sparge_status sparge_mask_get_shape(const sparge_mask *mask, sparge_mask_shape *out);

/* Pool Q and K, build the pooled map, select per row (hybrid Top-k ∪ Top-p),
 * write CSR, dense view and row masses (not the transpose: see above).
 * params->block_q/k must match the mask's (or be 0). Asynchronous on GPU devices. */
sparge_status sparge_mask_predict(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                  const sparge_mask_params *params, sparge_mask *mask);

/* Select from a given pooled map [B,H,Nqb,Nkb] f32 (a device tensor). params->causal and params->block_q/k, as for
 * sparge_mask_predict, are 0 or the mask's own (a causal mask's rows are selected causally either way). */
sparge_status sparge_mask_select(sparge_device *dev, const sparge_tensor *pooled_map,
                                 const sparge_mask_params *params, sparge_mask *mask);

/* Set the mask from a host dense uint8 [B,H,Nqb,Nkb] (nonzero = keep). Every
 * row must keep at least one block; a causal mask's rows must keep their diagonal blocks and nothing above them,
 * a varlen mask's nothing past a sequence's blocks. Row masses become NaN. */
sparge_status sparge_mask_set_dense(sparge_mask *mask, const uint8_t *dense_host);

/* Copies to host. Any output may be NULL. counts: [B,H,Nqb]; indices: [B,H,Nqb,Nkb]
 * (entries past the count are -1); t_counts [B,H,Nkb]; t_indices [B,H,Nkb,Nqb]
 * (asking for either builds the transpose if this selection has none yet). */
sparge_status sparge_mask_get_csr(const sparge_mask *mask, int32_t *counts, int32_t *indices,
                                  int32_t *t_counts, int32_t *t_indices);
sparge_status sparge_mask_get_dense(const sparge_mask *mask, uint8_t *dense_host);
/* Pooled map [B,H,Nqb,Nkb] f32 of the last prediction. */
sparge_status sparge_mask_get_pooled_map(const sparge_mask *mask, float *map_host);

/* Write the dense view as PREFIX.u8 (uint8 [B,H,Nqb,Nkb]) and its description
 * (shape, blocks, sparsity, the attention's head_dim and dtype, causal and varlen, and a varlen mask's
 * cu_seqlens_q and cu_seqlens_k) as PREFIX.json, the files peer benchmark scripts read. Synchronizes. */
sparge_status sparge_mask_export(const sparge_mask *mask, const char *prefix, int64_t head_dim, sparge_dtype dtype);

typedef struct {
    int64_t kept_blocks, total_blocks; /* total: the block pairs a query may attend (causal: on or below the
                                        * diagonal; varlen: within each sequence) */
    double sparsity;       /* 1 − kept/total block pairs */
    double token_density;  /* kept (query token, key token) pairs / the pairs a query may attend */
    double mean_row_mass;  /* mean kept pooled mass per row (NaN if not predicted) */
    int32_t min_row_blocks, max_row_blocks;
} sparge_mask_stats;

/* Overall statistics; head_sparsity [B*H] (per sequence and head for varlen, 0 for a sequence without queries) and
 * row_mass [B*H*Nqb] optional. Synchronizes. */
sparge_status sparge_mask_get_stats(const sparge_mask *mask, sparge_mask_stats *out,
                                    double *head_sparsity, float *row_mass);

/* ---------------------------------------------------------------- ops */

/* Mean-pool x [B,H,N,D] by blocks of `block` tokens into out [B,H,ceil(N/block),D] f32. */
sparge_status sparge_pool(sparge_device *dev, const sparge_tensor *x, int block, sparge_tensor *out);

/* map[b,h] = row_softmax(qbar kbarᵀ · scale); qbar [B,H,Nqb,D], kbar [B,H,Nkb,D],
 * map [B,H,Nqb,Nkb], all f32. scale 0 → 1/sqrt(D). */
sparge_status sparge_pooled_map(sparge_device *dev, const sparge_tensor *qbar, const sparge_tensor *kbar,
                                float scale, sparge_tensor *map);

typedef struct {
    float scale;       /* 0 → 1/sqrt(D) */
    int deterministic; /* backward: bitwise reproducible (no atomics) */
    int causal;        /* dense (mask NULL): block-causal attention; with a mask: 0 or the mask's */
} sparge_attn_params;

/* O, LSE of block-sparse attention (dense if mask is NULL). q [B,H,Nq,D], k/v [B,Hkv,Nk,D] with Hkv dividing H
 * (query head h reads K/V head h / (H/Hkv)), o like q, lse [B*H*Nq] f32 contiguous (may be NULL). With a varlen
 * mask q, k, v, o are packed [1,H,Nq,D] / [1,Hkv,Nk,D] views and lse is [H, Nq] (query head, packed token). */
sparge_status sparge_attention_forward(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                       const sparge_tensor *v, const sparge_mask *mask,
                                       const sparge_attn_params *params, sparge_tensor *o, float *lse);

/* dQ, dK, dV of the forward with the mask held fixed. lse must come from the forward. dk, dv have K's heads:
 * with grouped heads each sums its query heads' contributions (in a fixed order when deterministic).
 * The first backward of a selection also builds the mask's transpose (queued
 * on the device's stream like the rest). */
sparge_status sparge_attention_backward(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                                        const sparge_tensor *v, const sparge_tensor *o,
                                        const sparge_tensor *d_o, const float *lse, const sparge_mask *mask,
                                        const sparge_attn_params *params, sparge_tensor *dq,
                                        sparge_tensor *dk, sparge_tensor *dv);

/* SpargeAttention2 in one call: predict the hybrid mask, then attend.
 * params NULL: sparge_mask_params_default() with blocks of 0. mask may be NULL (a temporary one is used, blocks of
 * 0 meaning 128 x 64) or a mask created for these shapes (kept afterwards for the backward; blocks of 0 mean the
 * mask's). lse may be NULL. */
sparge_status sparge_attention(sparge_device *dev, const sparge_tensor *q, const sparge_tensor *k,
                               const sparge_tensor *v, const sparge_mask_params *params, sparge_tensor *o,
                               float *lse, sparge_mask *mask);

/* ---------------------------------------------------------------- info */

/* Build configuration and hwloc topology as text (for `sparge info`). */
const char *sparge_build_info(void);
const char *sparge_topology_info(void);

#ifdef __cplusplus
}
#endif
#endif
