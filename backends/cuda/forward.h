/* The tensor-core forward's kernel parameters and the entry of its Hopper tier (CUDA only):
 * forward.cu validates the call, fills fwd_params (and the heavy-first launch order) once and
 * hands them either to its mma.sync kernel or to forward_sm90.cu's wgmma kernel. */
#ifndef SPARGE_CUDA_FORWARD_H
#define SPARGE_CUDA_FORWARD_H

#include <stdint.h>

#include "gpu.h"

constexpr int FWD_BLOCK_Q = 128; /* query rows per CTA (= the mask's bq) */
constexpr int FWD_TILE_K = 64;   /* keys per compute tile */

struct fwd_params {
    const void *q, *k, *v;
    void *o;
    int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn;
    int H, Nq, Nk;
    int Nqb;       /* query blocks per (b, h) */
    int Nkb;       /* row stride of the CSR indices (mask) or 64-key tiles per row (dense) */
    int sub_shift; /* log2(bk / 64): compute tiles per kept block */
    const int32_t *counts, *indices; /* NULL: dense */
    const int32_t *order;            /* launch order of (bh, i) work items; NULL: identity */
    float *lse;
    float scale_log2; /* softmax scale · log2(e): scores are exponentiated with exp2 */
};

/* 1 when this build holds the sm_90a wgmma kernel (configure with 90 in --with-cuda-arch)
 * and its image loads on the device of ctx. */
int sparge_cuda_wgmma_forward_available(const gpu_ctx *ctx);
/* Runs the wgmma forward (f16 or bf16, D = 64 or 128) over n_items query blocks. */
sparge_status sparge_cuda_wgmma_forward(gpu_ctx *ctx, const fwd_params &p, int64_t n_items, sparge_dtype dt, int D);

#endif
