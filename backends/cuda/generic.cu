/* Portable attention tier: block-sparse forward and backward for f32/f16/bf16,
 * any D <= 256, any bq/bk, ragged tails, strided views; mask == NULL is dense.
 *
 * Plain CUDA/HIP C++ (no inline PTX, no tensor-core instructions): the same
 * code is the "hip" backend and the "cuda-generic" one, so the H200 runs and
 * tests exactly what hipcc compiles. FlashAttention-2 structure on fp32
 * shared-memory tiles with fp32 accumulation:
 *   forward    one block per (b,h, query tile); online softmax over the kept
 *              key blocks (CSR row), O and LSE at the end;
 *   backward   delta = rowsum(dO∘O); dK,dV per key tile over the query blocks
 *              that keep it (transposed mask); dQ per query tile over its kept
 *              key blocks. Each output has one writer: no atomics, bitwise
 *              deterministic.
 * 256 threads form a 16×16 grid. In score tiles thread (ty,tx) owns rows
 * ty+16a and columns tx+16b; in output tiles rows ty+16a and the 4-wide column
 * groups tx*4 + 64c. Row reductions are xor-shuffles over the 16 lanes of a
 * row group, which stay inside a warp for warp sizes 32 and 64.
 * Shared-memory tiles are row-major with a row pitch ≡ 4 (mod 32) words, so the
 * float4 reads of a warp hit distinct banks. */
#include <math.h>
#include <stdint.h>

#include "gpu.h"

namespace {

constexpr int THREADS = 256;
constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

struct tensor {
    const void *data;
    int64_t sb, sh, sn, sd;
};

struct attn_params {
    tensor q, k, v, o, d_o, dq, dk, dv;
    const float *lse_in; /* backward */
    float *lse_out;      /* forward, may be NULL */
    float *delta;        /* backward scratch, indexed like the LSE */
    int64_t BH, H, Nq, Nk, D, Nqb, Nkb; /* Nq, Nk: the tensors' tokens; Nqb, Nkb: the mask's (or dense) blocks */
    int64_t group;       /* query heads per K/V head */
    int64_t q_rows;      /* the tensors' query rows, B·H·Nq (the LSE's and delta's entries) */
    int bq, bk;
    int causal;
    const int32_t *seq_q, *seq_k; /* varlen token offsets, or NULL */
    int q_tiles, k_tiles; /* tiles per query / key block */
    float scale, scale_log2;
    const int32_t *counts, *indices, *t_counts, *t_indices; /* NULL: dense */
    int vec;                                                /* 16-byte loads are valid on every input */
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Sequence b: the tensors' batch index tb (0 for packed varlen views), its first query and key tokens and counts. */
struct seq_span {
    int64_t tb, q0, nq, k0, nk;
};
__device__ __forceinline__ seq_span seq_of(const attn_params &p, int64_t b)
{
    if (p.seq_q)
        return {0, p.seq_q[b], p.seq_q[b + 1] - p.seq_q[b], p.seq_k[b], p.seq_k[b + 1] - p.seq_k[b]};
    return {b, 0, p.Nq, 0, p.Nk};
}

/* The LSE's (and delta's) index of token t of sequence s, query head h. */
__device__ __forceinline__ int64_t lse_at(const attn_params &p, const seq_span &s, int64_t h, int64_t t)
{
    return (s.tb * p.H + h) * p.Nq + s.q0 + t;
}

/* Key blocks a query block may attend when dense: all of them, or with causal those up to its diagonal. */
__device__ __forceinline__ int64_t dense_blocks(const attn_params &p, const seq_span &s, int64_t i)
{
    int64_t allowed, d0, d1;
    sparge_row_rule(i, s.nq, s.nk, p.bq, p.bk, p.causal, &allowed, &d0, &d1);
    return allowed;
}

template <typename T> __device__ __forceinline__ const T *head_ptr(const tensor &t, int64_t b, int64_t h)
{
    return (const T *)t.data + b * t.sb + h * t.sh;
}

/* dst[ROWS][DT+4] = rows row0.. of a head, fp32, zero past `rows` and past D. */
template <typename T, int ROWS, int DT>
__device__ void load_tile(float *dst, const T *src, int64_t sn, int64_t sd, int64_t row0, int rows, int64_t D, int vec)
{
    constexpr int LD = DT + 4;
    if (vec) {
        constexpr int V = vec16<T>::n, CH = DT / V;
        for (int e = threadIdx.x; e < ROWS * CH; e += THREADS) {
            const int r = e / CH, c = e % CH;
            float v[V];
            if (r < rows && c * V < D)
                load_vec16<T>(src + (row0 + r) * sn + c * V, v);
            else
                for (int u = 0; u < V; u++)
                    v[u] = 0.0f;
            for (int u = 0; u < V; u += 4)
                *(float4 *)&dst[r * LD + c * V + u] = make_float4(v[u], v[u + 1], v[u + 2], v[u + 3]);
        }
    } else {
        for (int e = threadIdx.x; e < ROWS * DT; e += THREADS) {
            const int r = e / DT, d = e % DT;
            dst[r * LD + d] = r < rows && d < D ? to_f32<T>(src[(row0 + r) * sn + d * sd]) : 0.0f;
        }
    }
}

/* acc[a][b] += A[ty+16a] · B[tx+16b] over DT, A and B with pitch DT+4. */
template <int RA, int RB, int DT>
__device__ __forceinline__ void dot_tile(float (&acc)[RA][RB], const float *A, const float *B, int ty, int tx)
{
    constexpr int LD = DT + 4;
#pragma unroll 1
    for (int d = 0; d < DT; d += 4) {
        float4 a[RA], b[RB];
#pragma unroll
        for (int i = 0; i < RA; i++)
            a[i] = *(const float4 *)&A[(ty + 16 * i) * LD + d];
#pragma unroll
        for (int j = 0; j < RB; j++)
            b[j] = *(const float4 *)&B[(tx + 16 * j) * LD + d];
#pragma unroll
        for (int i = 0; i < RA; i++)
#pragma unroll
            for (int j = 0; j < RB; j++) {
                acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]);
                acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
                acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]);
                acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
            }
    }
}

/* acc[a][4c+u] += Σ_k L[ty+16a][k] · R[k][tx*4 + 64c + u] for k < K;
 * L has pitch K+4, R pitch DT+4. */
template <int RA, int K, int DT>
__device__ __forceinline__ void mul_tile(float (&acc)[RA][DT / 16], const float *L, const float *R, int ty, int tx)
{
    constexpr int LLD = K + 4, RLD = DT + 4, NC = DT / 64;
#pragma unroll 1
    for (int k = 0; k < K; k += 4) {
        float4 l[RA];
#pragma unroll
        for (int i = 0; i < RA; i++)
            l[i] = *(const float4 *)&L[(ty + 16 * i) * LLD + k];
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int c = 0; c < NC; c++) {
                const float4 r = *(const float4 *)&R[(k + kk) * RLD + tx * 4 + 64 * c];
#pragma unroll
                for (int i = 0; i < RA; i++) {
                    const float lv = kk == 0 ? l[i].x : kk == 1 ? l[i].y : kk == 2 ? l[i].z : l[i].w;
                    acc[i][4 * c + 0] = fmaf(lv, r.x, acc[i][4 * c + 0]);
                    acc[i][4 * c + 1] = fmaf(lv, r.y, acc[i][4 * c + 1]);
                    acc[i][4 * c + 2] = fmaf(lv, r.z, acc[i][4 * c + 2]);
                    acc[i][4 * c + 3] = fmaf(lv, r.w, acc[i][4 * c + 3]);
                }
            }
    }
}

/* Column of accumulator entry e of thread tx in an output tile. */
__device__ __forceinline__ int out_col(int tx, int e) { return tx * 4 + 64 * (e / 4) + e % 4; }

template <typename T, int RA, int DT>
__device__ void store_rows(const tensor &t, int64_t b, int64_t h, int64_t row0, int rows, int64_t D,
                           const float (&acc)[RA][DT / 16], float scale, int ty, int tx)
{
    T *dst = (T *)t.data + b * t.sb + h * t.sh;
    for (int i = 0; i < RA; i++) {
        const int r = ty + 16 * i;
        if (r >= rows)
            continue;
        for (int e = 0; e < DT / 16; e++) {
            const int d = out_col(tx, e);
            if (d < D)
                dst[(row0 + r) * t.sn + d * t.sd] = from_f32<T>(acc[i][e] * scale);
        }
    }
}

__device__ __forceinline__ float group16_max(float x)
{
    for (int o = 8; o > 0; o >>= 1)
        x = fmaxf(x, sparge_shfl_xor(x, o));
    return x;
}
__device__ __forceinline__ float group16_sum(float x)
{
    for (int o = 8; o > 0; o >>= 1)
        x += sparge_shfl_xor(x, o);
    return x;
}

/* Decode a query-tile block: (b,h,i), its sequence, and the tile's first row (in the sequence) and row count. */
struct q_tile {
    int64_t bh, b, h, i, row0;
    int rows;
    seq_span s;
};
__device__ __forceinline__ bool decode_q_tile(const attn_params &p, int BM, q_tile *t)
{
    int64_t blk = blockIdx.x;
    const int sub = (int)(blk % p.q_tiles);
    blk /= p.q_tiles;
    t->i = blk % p.Nqb;
    t->bh = blk / p.Nqb;
    t->b = t->bh / p.H;
    t->h = t->bh % p.H;
    t->s = seq_of(p, t->b);
    const int64_t end = min64((t->i + 1) * p.bq, t->s.nq);
    t->row0 = t->i * p.bq + (int64_t)sub * BM;
    t->rows = (int)min64(BM, end - t->row0);
    return t->row0 < end;
}

/* Every kept key block of query tile qt, in tiles of BN keys: the tile's K and V loaded into ks and vs,
 * then body(k0, kr) with the tile's first key k0 (in the sequence) and its kr valid keys. */
template <typename T, int BN, int DT, typename Body>
__device__ __forceinline__ void for_each_kv_tile(const attn_params &p, const q_tile &qt, float *ks, float *vs,
                                                 Body &&body)
{
    const seq_span &sq = qt.s;
    const T *kh = head_ptr<T>(p.k, sq.tb, qt.h / p.group) + sq.k0 * p.k.sn,
            *vh = head_ptr<T>(p.v, sq.tb, qt.h / p.group) + sq.k0 * p.v.sn;
    const int64_t row = qt.bh * p.Nqb + qt.i;
    const int64_t nblocks = p.counts ? p.counts[row] : dense_blocks(p, sq, qt.i);
    const int32_t *list = p.counts ? p.indices + row * p.Nkb : nullptr;
    for (int64_t t = 0; t < nblocks; t++) {
        const int64_t j = list ? list[t] : t, kend = min64((j + 1) * p.bk, sq.nk);
        for (int64_t k0 = j * p.bk; k0 < kend; k0 += BN) {
            const int kr = (int)min64(BN, kend - k0);
            __syncthreads(); /* the previous tile's readers are done */
            load_tile<T, BN, DT>(ks, kh, p.k.sn, p.k.sd, k0, kr, p.D, p.vec);
            load_tile<T, BN, DT>(vs, vh, p.v.sn, p.v.sd, k0, kr, p.D, p.vec);
            __syncthreads();
            body(k0, kr);
        }
    }
}

/* Scores of keys past a query's causal diagonal are masked: key k0 + tx + 16c against query row0 + ty + 16a. */
__device__ __forceinline__ bool causal_ok(const attn_params &p, const seq_span &s, int64_t row, int64_t key)
{
    return !p.causal || key <= row + s.nk - s.nq;
}

/* ---------------------------------------------------------------- forward */

constexpr size_t fwd_smem(int DT, int BM, int BN)
{
    return sizeof(float) * ((size_t)BM * (DT + 4) + 2 * (size_t)BN * (DT + 4) + (size_t)BM * (BN + 4));
}

template <typename T, int DT, int BM, int BN> __global__ void __launch_bounds__(THREADS) fwd_kernel(attn_params p)
{
    constexpr int RM = BM / 16, RN = BN / 16, LD = DT + 4, DPT = DT / 16;
    extern __shared__ __align__(16) float smem[];
    float *qs = smem, *ks = qs + BM * LD, *vs = ks + BN * LD, *ps = vs + BN * LD;
    q_tile qt;
    if (!decode_q_tile(p, BM, &qt))
        return;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const seq_span &sq = qt.s;
    load_tile<T, BM, DT>(qs, head_ptr<T>(p.q, sq.tb, qt.h) + sq.q0 * p.q.sn, p.q.sn, p.q.sd, qt.row0, qt.rows, p.D,
                         p.vec);

    float m[RM], l[RM] = {}, o[RM][DPT] = {};
    for (int a = 0; a < RM; a++)
        m[a] = -INFINITY;
    for_each_kv_tile<T, BN, DT>(p, qt, ks, vs, [&](int64_t k0, int kr) {
        float s[RM][RN] = {};
        dot_tile<RM, RN, DT>(s, qs, ks, ty, tx);
        for (int a = 0; a < RM; a++) {
            float mx = -INFINITY;
            for (int c = 0; c < RN; c++) {
                const bool ok = tx + 16 * c < kr && causal_ok(p, sq, qt.row0 + ty + 16 * a, k0 + tx + 16 * c);
                s[a][c] = ok ? s[a][c] * p.scale_log2 : -INFINITY;
                mx = fmaxf(mx, s[a][c]);
            }
            const float mnew = fmaxf(m[a], group16_max(mx)), mref = mnew == -INFINITY ? 0.0f : mnew;
            const float alpha = exp2f(m[a] - mref);
            float sum = 0.0f;
            for (int c = 0; c < RN; c++) {
                const float pv = exp2f(s[a][c] - mref);
                sum += pv;
                ps[(ty + 16 * a) * (BN + 4) + tx + 16 * c] = pv;
            }
            l[a] = l[a] * alpha + group16_sum(sum);
            m[a] = mnew;
            for (int e = 0; e < DPT; e++)
                o[a][e] *= alpha;
        }
        __syncthreads();
        mul_tile<RM, BN, DT>(o, ps, vs, ty, tx);
    });
    T *oh = (T *)p.o.data + sq.tb * p.o.sb + qt.h * p.o.sh + sq.q0 * p.o.sn;
    for (int a = 0; a < RM; a++) {
        const int r = ty + 16 * a;
        if (r >= qt.rows)
            continue;
        const float inv = 1.0f / l[a];
        for (int e = 0; e < DPT; e++) {
            const int d = out_col(tx, e);
            if (d < p.D)
                oh[(qt.row0 + r) * p.o.sn + d * p.o.sd] = from_f32<T>(o[a][e] * inv);
        }
        if (tx == 0 && p.lse_out)
            p.lse_out[lse_at(p, sq, qt.h, qt.row0 + r)] = (m[a] + log2f(l[a])) * LN2;
    }
}

/* ---------------------------------------------------------------- backward */

/* delta[t] = Σ_d dO[t,d]·O[t,d], 16 lanes per row. */
template <typename T> __global__ void __launch_bounds__(THREADS) delta_kernel(attn_params p, int64_t rows)
{
    const int64_t row = (int64_t)blockIdx.x * (THREADS / 16) + threadIdx.x / 16;
    const int lane = threadIdx.x % 16;
    float sum = 0.0f;
    if (row < rows) {
        const int64_t bh = row / p.Nq, t = row % p.Nq, b = bh / p.H, h = bh % p.H;
        const T *o = head_ptr<T>(p.o, b, h) + t * p.o.sn, *g = head_ptr<T>(p.d_o, b, h) + t * p.d_o.sn;
        for (int64_t d = lane; d < p.D; d += 16)
            sum += to_f32<T>(o[d * p.o.sd]) * to_f32<T>(g[d * p.d_o.sd]);
    }
    sum = group16_sum(sum);
    if (row < rows && lane == 0)
        p.delta[row] = sum;
}

constexpr size_t bwd_smem(int DT, int BQ, int BK)
{
    return sizeof(float) * (2 * (size_t)(BQ + BK) * (DT + 4) +
                            ((size_t)BK * (BQ + 4) > (size_t)BQ * (BK + 4) ? (size_t)BK * (BQ + 4) : (size_t)BQ * (BK + 4)) +
                            2 * (size_t)BQ);
}

/* Scores of a (query tile × key tile) pair: P = exp(s·QKᵀ − LSE) and dS = P∘(dO Vᵀ − delta), zero outside the
 * valid rows and columns and past the causal diagonal (queries from q_row0, keys from k_row0 of sequence s). */
template <int RQ, int RK, int DT>
__device__ __forceinline__ void probs_and_grads(float (&pr)[RQ][RK], float (&ds)[RQ][RK], const float *qs,
                                                const float *dos, const float *ks, const float *vs, const float *lse_s,
                                                const float *dl_s, int qr, int kr, const attn_params &p,
                                                const seq_span &sq, int64_t q_row0, int64_t k_row0, int ty, int tx)
{
    float s[RQ][RK] = {}, dp[RQ][RK] = {};
    dot_tile<RQ, RK, DT>(s, qs, ks, ty, tx);
    dot_tile<RQ, RK, DT>(dp, dos, vs, ty, tx);
    for (int a = 0; a < RQ; a++) {
        const int r = ty + 16 * a;
        for (int c = 0; c < RK; c++) {
            const bool valid = r < qr && tx + 16 * c < kr && causal_ok(p, sq, q_row0 + r, k_row0 + tx + 16 * c);
            const float pv = valid ? exp2f(s[a][c] * p.scale_log2 - lse_s[r]) : 0.0f;
            pr[a][c] = pv;
            ds[a][c] = valid ? pv * (dp[a][c] - dl_s[r]) : 0.0f;
        }
    }
}

/* Q, dO tile rows (from row0 of sequence s, head h), their LSE (base 2) and delta into shared memory. */
template <typename T, int BQ, int DT>
__device__ void load_query_side(const attn_params &p, const seq_span &s, int64_t h, int64_t row0, int rows, float *qs,
                                float *dos, float *lse_s, float *dl_s)
{
    load_tile<T, BQ, DT>(qs, head_ptr<T>(p.q, s.tb, h) + s.q0 * p.q.sn, p.q.sn, p.q.sd, row0, rows, p.D, p.vec);
    load_tile<T, BQ, DT>(dos, head_ptr<T>(p.d_o, s.tb, h) + s.q0 * p.d_o.sn, p.d_o.sn, p.d_o.sd, row0, rows, p.D,
                         p.vec);
    for (int r = threadIdx.x; r < BQ; r += THREADS) {
        lse_s[r] = r < rows ? p.lse_in[lse_at(p, s, h, row0 + r)] * LOG2E : 0.0f;
        dl_s[r] = r < rows ? p.delta[lse_at(p, s, h, row0 + r)] : 0.0f;
    }
}

template <typename T, int DT, int BQ, int BK> __global__ void __launch_bounds__(THREADS) dkdv_kernel(attn_params p)
{
    constexpr int RQ = BQ / 16, RK = BK / 16, LD = DT + 4, DPT = DT / 16, PLD = BQ + 4;
    extern __shared__ __align__(16) float smem[];
    float *ks = smem, *vs = ks + BK * LD, *qs = vs + BK * LD, *dos = qs + BQ * LD, *pt = dos + BQ * LD;
    float *lse_s = pt + BK * PLD, *dl_s = lse_s + BQ;

    /* A block per key tile of (b, K head hk): the dK, dV of the group's query heads, summed in head order. */
    int64_t blk = blockIdx.x;
    const int sub = (int)(blk % p.k_tiles);
    blk /= p.k_tiles;
    const int64_t hkv = p.H / p.group, j = blk % p.Nkb, bhk = blk / p.Nkb, b = bhk / hkv, hk = bhk % hkv;
    const seq_span sq = seq_of(p, b);
    const int64_t kend = min64((j + 1) * p.bk, sq.nk), k0 = j * p.bk + (int64_t)sub * BK;
    if (k0 >= kend)
        return;
    const int kr = (int)min64(BK, kend - k0);
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    load_tile<T, BK, DT>(ks, head_ptr<T>(p.k, sq.tb, hk) + sq.k0 * p.k.sn, p.k.sn, p.k.sd, k0, kr, p.D, p.vec);
    load_tile<T, BK, DT>(vs, head_ptr<T>(p.v, sq.tb, hk) + sq.k0 * p.v.sn, p.v.sn, p.v.sd, k0, kr, p.D, p.vec);

    float dk[RK][DPT] = {}, dv[RK][DPT] = {};
    const int64_t nqb = (sq.nq + p.bq - 1) / p.bq;
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; h++) {
    const int64_t col = (b * p.H + h) * p.Nkb + j;
    const int64_t nblocks = p.t_counts ? p.t_counts[col] : nqb;
    const int32_t *list = p.t_counts ? p.t_indices + col * p.Nqb : nullptr;
    for (int64_t t = 0; t < nblocks; t++) {
        const int64_t i = list ? list[t] : t, qend = min64((i + 1) * p.bq, sq.nq);
        if (!list && j >= dense_blocks(p, sq, i)) /* dense causal: this query block stops before key block j */
            continue;
        for (int64_t q0 = i * p.bq; q0 < qend; q0 += BQ) {
            const int qr = (int)min64(BQ, qend - q0);
            __syncthreads();
            load_query_side<T, BQ, DT>(p, sq, h, q0, qr, qs, dos, lse_s, dl_s);
            __syncthreads();
            float pr[RQ][RK], ds[RQ][RK];
            probs_and_grads<RQ, RK, DT>(pr, ds, qs, dos, ks, vs, lse_s, dl_s, qr, kr, p, sq, q0, k0, ty, tx);
            for (int a = 0; a < RQ; a++)
                for (int c = 0; c < RK; c++)
                    pt[(tx + 16 * c) * PLD + ty + 16 * a] = pr[a][c];
            __syncthreads();
            mul_tile<RK, BQ, DT>(dv, pt, dos, ty, tx); /* dV += Pᵀ dO */
            __syncthreads();
            for (int a = 0; a < RQ; a++)
                for (int c = 0; c < RK; c++)
                    pt[(tx + 16 * c) * PLD + ty + 16 * a] = ds[a][c];
            __syncthreads();
            mul_tile<RK, BQ, DT>(dk, pt, qs, ty, tx); /* dK += dSᵀ Q (scaled at the end) */
        }
    }
    }
    store_rows<T, RK, DT>(p.dk, sq.tb, hk, sq.k0 + k0, kr, p.D, dk, p.scale, ty, tx);
    store_rows<T, RK, DT>(p.dv, sq.tb, hk, sq.k0 + k0, kr, p.D, dv, 1.0f, ty, tx);
}

template <typename T, int DT, int BQ, int BK> __global__ void __launch_bounds__(THREADS) dq_kernel(attn_params p)
{
    constexpr int RQ = BQ / 16, RK = BK / 16, LD = DT + 4, DPT = DT / 16, SLD = BK + 4;
    extern __shared__ __align__(16) float smem[];
    float *qs = smem, *dos = qs + BQ * LD, *ks = dos + BQ * LD, *vs = ks + BK * LD, *dss = vs + BK * LD;
    float *lse_s = dss + BQ * SLD, *dl_s = lse_s + BQ;
    q_tile qt;
    if (!decode_q_tile(p, BQ, &qt))
        return;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const seq_span &sq = qt.s;
    load_query_side<T, BQ, DT>(p, sq, qt.h, qt.row0, qt.rows, qs, dos, lse_s, dl_s);

    float dq[RQ][DPT] = {};
    for_each_kv_tile<T, BK, DT>(p, qt, ks, vs, [&](int64_t k0, int kr) {
        float pr[RQ][RK], ds[RQ][RK];
        probs_and_grads<RQ, RK, DT>(pr, ds, qs, dos, ks, vs, lse_s, dl_s, qt.rows, kr, p, sq, qt.row0, k0, ty, tx);
        for (int a = 0; a < RQ; a++)
            for (int c = 0; c < RK; c++)
                dss[(ty + 16 * a) * SLD + tx + 16 * c] = ds[a][c];
        __syncthreads();
        mul_tile<RQ, BK, DT>(dq, dss, ks, ty, tx); /* dQ += dS K (scaled at the end) */
    });
    store_rows<T, RQ, DT>(p.dq, sq.tb, qt.h, sq.q0 + qt.row0, qt.rows, p.D, dq, p.scale, ty, tx);
}

/* ---------------------------------------------------------------- launch */

/* One launch of a tiled kernel with its dynamic shared memory, every step checked. */
template <typename Kernel>
sparge_status launch_tiled(gpu_ctx *ctx, Kernel kernel, size_t smem, int64_t blocks, const attn_params &p,
                           const char *what)
{
    if (blocks > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: %lld tiles exceed the grid limit %d", what, (long long)blocks,
                           INT32_MAX);
    sparge_status s = GPU_CHECK(gpuFuncSetAttribute(kernel, gpuFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (s)
        return s;
    kernel<<<(unsigned)blocks, THREADS, smem, ctx->stream>>>(p);
    return GPU_CHECK_LAUNCH(what);
}

template <typename T, int DT, int BM, int BN> sparge_status launch_forward(gpu_ctx *ctx, attn_params p)
{
    p.q_tiles = (p.bq + BM - 1) / BM;
    return launch_tiled(ctx, fwd_kernel<T, DT, BM, BN>, fwd_smem(DT, BM, BN), p.BH * p.Nqb * p.q_tiles, p,
                        "generic forward kernel");
}

template <typename T, int DT, int BQ, int BK> sparge_status launch_dkdv(gpu_ctx *ctx, attn_params p)
{
    p.k_tiles = (p.bk + BK - 1) / BK;
    return launch_tiled(ctx, dkdv_kernel<T, DT, BQ, BK>, bwd_smem(DT, BQ, BK), p.BH / p.group * p.Nkb * p.k_tiles,
                        p, "generic backward dK/dV kernel");
}

template <typename T, int DT, int BQ, int BK> sparge_status launch_dq(gpu_ctx *ctx, attn_params p)
{
    p.q_tiles = (p.bq + BQ - 1) / BQ;
    return launch_tiled(ctx, dq_kernel<T, DT, BQ, BK>, bwd_smem(DT, BQ, BK), p.BH * p.Nqb * p.q_tiles, p,
                        "generic backward dQ kernel");
}

/* Tile shapes per head-dim class, best first, the last one a last resort. The
 * first shape before the last resort that fits twice in a block's shared memory
 * wins (two resident blocks hide the unpipelined tile loads), else the first
 * that fits at all: large tiles on the H200's 227 KiB, small ones on 64 KiB LDS
 * (AMD) or 99 KiB (sm_86/89). */
struct tile_choice {
    size_t smem;
    sparge_status (*launch)(gpu_ctx *, attn_params);
};

template <size_t N>
sparge_status pick(gpu_ctx *ctx, const attn_params &p, const tile_choice (&c)[N], const char *what)
{
    for (size_t k = 0; k + 1 < N; k++)
        if (2 * c[k].smem <= ctx->smem_optin)
            return c[k].launch(ctx, p);
    for (size_t k = 0; k < N; k++)
        if (c[k].smem <= ctx->smem_optin)
            return c[k].launch(ctx, p);
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                       "%s: D = %lld needs %zu bytes of shared memory per block, the device allows %zu", what,
                       (long long)p.D, c[N - 1].smem, ctx->smem_optin);
}

tensor as_tensor(const sparge_view &v) { return {v.data, v.sb, v.sh, v.sn, v.sd}; }

/* 16-byte loads need contiguous rows and 16-byte aligned row starts. */
bool can_vectorize(const sparge_view &x)
{
    const int64_t n = 16 / (int64_t)sparge_dtype_size(x.dtype);
    return x.sd == 1 && x.D % n == 0 && (uintptr_t)x.data % 16 == 0 && x.sb % n == 0 && x.sh % n == 0 &&
           x.sn % n == 0;
}

/* The blocks and batch follow the mask's layout when there is one (varlen: sequences, the longest one's blocks). */
attn_params common_params(const sparge_view &q, const sparge_view &k, float scale, int bq, int bk, int causal,
                          const sparge_mask_view *m)
{
    attn_params p = {};
    p.q = as_tensor(q);
    p.k = as_tensor(k);
    p.BH = (m ? m->B : q.B) * q.H;
    p.q_rows = q.B * q.H * q.N;
    p.H = q.H;
    p.group = q.H / k.H;
    p.Nq = q.N;
    p.Nk = k.N;
    p.D = q.D;
    p.bq = bq;
    p.bk = bk;
    p.causal = causal;
    p.Nqb = m ? m->Nqb : (q.N + bq - 1) / bq;
    p.Nkb = m ? m->Nkb : (k.N + bk - 1) / bk;
    p.scale = scale;
    p.scale_log2 = scale * LOG2E;
    if (m) {
        p.counts = m->counts;
        p.indices = m->indices;
        p.t_counts = m->t_counts;
        p.t_indices = m->t_indices;
        p.seq_q = m->seq_q;
        p.seq_k = m->seq_k;
    }
    return p;
}

template <typename T> sparge_status forward_t(gpu_ctx *ctx, const attn_params &p)
{
    static const char what[] = "generic forward";
    if (p.D <= 64) {
        const tile_choice c[] = {{fwd_smem(64, 64, 64), launch_forward<T, 64, 64, 64>},
                                 {fwd_smem(64, 32, 32), launch_forward<T, 64, 32, 32>}};
        return pick(ctx, p, c, what);
    }
    if (p.D <= 128) {
        const tile_choice c[] = {{fwd_smem(128, 64, 32), launch_forward<T, 128, 64, 32>},
                                 {fwd_smem(128, 32, 32), launch_forward<T, 128, 32, 32>},
                                 {fwd_smem(128, 16, 16), launch_forward<T, 128, 16, 16>}};
        return pick(ctx, p, c, what);
    }
    const tile_choice c[] = {{fwd_smem(256, 32, 32), launch_forward<T, 256, 32, 32>},
                             {fwd_smem(256, 16, 16), launch_forward<T, 256, 16, 16>}};
    return pick(ctx, p, c, what);
}

/* (BQ, BK): dK/dV tiles own BK keys and loop over BQ queries, dQ the reverse. Head dims above 64 take the same
 * tiles, largest first. */
template <typename T, int DT> sparge_status backward_wide_tiles(gpu_ctx *ctx, const attn_params &p, const char *what)
{
    const tile_choice kv[] = {{bwd_smem(DT, 32, 64), launch_dkdv<T, DT, 32, 64>},
                              {bwd_smem(DT, 32, 32), launch_dkdv<T, DT, 32, 32>},
                              {bwd_smem(DT, 16, 16), launch_dkdv<T, DT, 16, 16>}};
    const tile_choice q[] = {{bwd_smem(DT, 64, 32), launch_dq<T, DT, 64, 32>},
                             {bwd_smem(DT, 32, 32), launch_dq<T, DT, 32, 32>},
                             {bwd_smem(DT, 16, 16), launch_dq<T, DT, 16, 16>}};
    sparge_status s = pick(ctx, p, kv, what);
    return s ? s : pick(ctx, p, q, what);
}

template <typename T> sparge_status backward_tiles(gpu_ctx *ctx, const attn_params &p)
{
    static const char what[] = "generic backward";
    if (p.D <= 64) {
        const tile_choice kv[] = {{bwd_smem(64, 64, 64), launch_dkdv<T, 64, 64, 64>},
                                  {bwd_smem(64, 32, 32), launch_dkdv<T, 64, 32, 32>}};
        const tile_choice q[] = {{bwd_smem(64, 64, 64), launch_dq<T, 64, 64, 64>},
                                 {bwd_smem(64, 32, 32), launch_dq<T, 64, 32, 32>}};
        sparge_status s = pick(ctx, p, kv, what);
        return s ? s : pick(ctx, p, q, what);
    }
    return p.D <= 128 ? backward_wide_tiles<T, 128>(ctx, p, what) : backward_wide_tiles<T, 256>(ctx, p, what);
}

template <typename T> sparge_status backward_t(gpu_ctx *ctx, const attn_params &p)
{
    const int64_t rows = p.q_rows, per_block = THREADS / 16, blocks = (rows + per_block - 1) / per_block;
    if (blocks > INT32_MAX)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "generic backward: B*H*Nq = %lld exceeds the grid limit",
                           (long long)rows);
    delta_kernel<T><<<(unsigned)blocks, THREADS, 0, ctx->stream>>>(p, rows);
    sparge_status s = GPU_CHECK_LAUNCH("generic backward delta kernel");
    return s ? s : backward_tiles<T>(ctx, p);
}

} // namespace

sparge_status SPARGE_GPU_FN(generic_fits)(const gpu_ctx *ctx, int64_t D, bool backward)
{
    const char *what = backward ? "generic backward" : "generic forward";
    if (D > 256)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "%s: D = %lld exceeds the portable tier's limit of 256", what,
                           (long long)D);
    /* The last resort of each list in forward_t and backward_tiles: 32×32 tiles for D ≤ 64, 16×16 above. */
    const int DT = D <= 64 ? 64 : D <= 128 ? 128 : 256, small = DT == 64 ? 32 : 16;
    const size_t need = backward ? bwd_smem(DT, small, small) : fwd_smem(DT, small, small);
    if (need > ctx->smem_optin)
        return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED,
                           "%s: D = %lld needs %zu bytes of shared memory per block, the device allows %zu", what,
                           (long long)D, need, ctx->smem_optin);
    return SPARGE_OK;
}

sparge_status SPARGE_GPU_FN(generic_forward)(gpu_ctx *ctx, const sparge_fwd_args *a)
{
    attn_params p = common_params(a->q, a->k, a->scale, a->bq, a->bk, a->causal, a->mask);
    p.v = as_tensor(a->v);
    p.o = as_tensor(a->o);
    p.lse_out = a->lse;
    p.vec = can_vectorize(a->q) && can_vectorize(a->k) && can_vectorize(a->v);
    switch (a->q.dtype) {
    case SPARGE_F16: return forward_t<gpu_half>(ctx, p);
    case SPARGE_BF16: return forward_t<gpu_bf16>(ctx, p);
    default: return forward_t<float>(ctx, p);
    }
}

sparge_status SPARGE_GPU_FN(generic_backward)(gpu_ctx *ctx, const sparge_bwd_args *a)
{
    sparge_status s;
    attn_params p = common_params(a->q, a->k, a->scale, a->bq, a->bk, a->causal, a->mask);
    p.v = as_tensor(a->v);
    p.o = as_tensor(a->o);
    p.d_o = as_tensor(a->d_o);
    p.dq = as_tensor(a->dq);
    p.dk = as_tensor(a->dk);
    p.dv = as_tensor(a->dv);
    p.lse_in = a->lse;
    p.vec = can_vectorize(a->q) && can_vectorize(a->k) && can_vectorize(a->v) && can_vectorize(a->d_o);
    const int64_t bytes = p.q_rows * (int64_t)sizeof(float);
    void *delta;
    if ((s = gpu_workspace(ctx, (size_t)bytes, &delta)))
        return s;
    p.delta = (float *)delta;
    switch (a->q.dtype) {
    case SPARGE_F16: return backward_t<gpu_half>(ctx, p);
    case SPARGE_BF16: return backward_t<gpu_bf16>(ctx, p);
    default: return backward_t<float>(ctx, p);
    }
}
