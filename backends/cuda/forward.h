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
    int H, Nq, Nk; /* Nq, Nk: the tensors' tokens (varlen: the packed totals) */
    int Nqb;       /* query blocks per (b, h) */
    int Nkb;       /* row stride of the CSR indices (mask) or 64-key tiles per row (dense) */
    int sub_shift; /* log2(bk / 64): compute tiles per kept block */
    const int32_t *counts, *indices; /* NULL: dense */
    const int32_t *order;            /* launch order of (bh, i) work items; NULL: identity */
    float *lse;
    float scale_log2; /* softmax scale · log2(e): scores are exponentiated with exp2 */
    /* Last, so that the fields above keep the offsets the kernels were tuned with (ptxas spilled more otherwise). */
    uint32_t kv_magic; /* K/V head of query head h: gpu_kv_head(h, kv_magic) */
    int causal; /* keys past a query's diagonal (u > t + nk − nq of its sequence) are masked */
    const int32_t *seq_q, *seq_k; /* varlen: token offsets of the sequences, or NULL */
    int d_chunks; /* the tensors' 16-byte chunks per row: fewer than the tile's when D is padded (fwd_tile_dim) */
};

/* The tile width a head dim runs on: 8..64 on 64-wide tiles, 72..128 on 128-wide ones (the columns past D are
 * zero-filled on load and never stored), 256 on its own; 0: none. */
__host__ __device__ constexpr int fwd_tile_dim(int D)
{
    return D % 8 || D <= 0 ? 0 : D <= 64 ? 64 : D <= 128 ? 128 : D == 256 ? 256 : 0;
}

/* The LSE's index of query row `row` of (b, h) = bh: [B, H, Nq], or [H, T] for packed varlen tensors. The fixed-length
 * form from bh alone: forming it from the sequence's fields cost the mma.sync forward 80 bytes of spills (ptxas). */
template <bool VARLEN>
__device__ __forceinline__ int64_t fwd_lse_index(const fwd_params &p, int bh, int h, const gpu_seq &s, int row)
{
    return VARLEN ? (int64_t)h * p.Nq + s.q_off + row : (int64_t)bh * p.Nq + row;
}

/* Dense causal: the 64-key tiles up to the last query's diagonal (of tiles, at most n_tiles). */
__device__ __forceinline__ int fwd_causal_tiles(const fwd_params &p, const gpu_seq &s, int q0, int n_tiles)
{
    const int last = min(q0 + FWD_BLOCK_Q, s.nq) - 1 + s.nk - s.nq;
    return min(n_tiles, last / FWD_TILE_K + 1);
}

/* 1 when this build holds the sm_90a wgmma kernel (configure with 90 in --with-cuda-arch)
 * and its image loads on the device of ctx. */
int sparge_cuda_wgmma_forward_available(const gpu_ctx *ctx);
/* Runs the wgmma forward (f16 or bf16, D up to 128 padded to 64 or 128, or 256) over n_items query blocks; with ws
 * its warp-specialized kernel (fwd_kernel=wgmma-ws; tile widths 64 and 128, D = 256 runs the first). */
sparge_status sparge_cuda_wgmma_forward(gpu_ctx *ctx, const fwd_params &p, int64_t n_items, sparge_dtype dt, int D,
                                        bool ws);

#endif
