/* The work item of a CTA that owns one query block (the forward kernels, the dQ pass) and the key
 * tiles it walks, shared so that every such kernel decodes its launch order and mask row alike. */
#ifndef SPARGE_CUDA_ROW_TILES_CUH
#define SPARGE_CUDA_ROW_TILES_CUH

#include <stdint.h>

/* CTA blockIdx.x, through the launch order (NULL: identity), owns query block `qblock` of (b, h) and
 * walks n_tiles tiles of TILE keys: all Nkb of them when counts is NULL (dense), else the kept blocks
 * of its CSR row (row stride Nkb, ascending), each split into 2^sub_shift tiles. */
template <int TILE>
struct row_tiles {
    int work, bh, b, h, qblock, n_tiles, sub_shift;
    const int32_t *blocks; /* kept key blocks of the row; NULL: dense */

    __device__ __forceinline__ row_tiles(const int32_t *order, int Nqb, int H, const int32_t *counts,
                                         const int32_t *indices, int Nkb, int shift)
    {
        work = order ? order[blockIdx.x] : (int)blockIdx.x;
        bh = work / Nqb;
        qblock = work - bh * Nqb;
        b = bh / H;
        h = bh - b * H;
        sub_shift = shift;
        blocks = counts ? indices + (int64_t)work * Nkb : nullptr;
        n_tiles = counts ? counts[work] << shift : Nkb;
    }

    /* Whether tile t < n_tiles may reach past key Nk - 1. Only the last kept block can (the indices ascend), so
     * other tiles skip the index load, which would otherwise sit between a tile's S = Q·Kᵀ and its softmax. */
    __device__ __forceinline__ bool ragged(int t, int Nk) const
    {
        return t + (1 << sub_shift) >= n_tiles && key0(t) + TILE > Nk;
    }

    /* The first key of tile t < n_tiles. */
    __device__ __forceinline__ int key0(int t) const
    {
        const int block = blocks ? blocks[t >> sub_shift] : t;
        return ((block << sub_shift) + (t & ((1 << sub_shift) - 1))) * TILE;
    }
};

#endif
