/* Per-architecture tile table of the tensor-core forward (forward.cu).
 *
 * Fixed for every entry: a CTA owns one query block of 128 rows (bq = 128) and
 * walks the kept key blocks in compute tiles of 64 keys (a bk = 128 block is two
 * tiles). Its warps split the 128 rows: 4 warps → 32 rows (two m16 tiles) each,
 * 8 warps → 16 rows each. K and V tiles go through a ring of `stages` shared-memory
 * buffers filled by cp.async; Q stays in shared memory (128 × D × 2 bytes).
 * Shared memory per CTA = 128·D·2 + stages · 2 · 64·D·2 bytes:
 *   D = 64:  16 KB + stages · 16 KB        D = 128: 32 KB + stages · 32 KB
 *
 * Why 4 warps × 32 rows is the default: every warp reads the whole K and V tile
 * from shared memory per 64 keys, so two m16 tiles per warp halve that traffic
 * against 8 warps × 16 rows (the ldmatrix bandwidth, not the tensor cores, limits
 * the 8-warp layout on sm_80/sm_90). It costs registers: at D = 128 the O
 * accumulator is 128 floats and S 64 floats per thread, hence Q is re-read from
 * shared memory for each tile instead of living in registers.
 *
 * Compiled tiles (forward.cu's dispatch_tile; change both together): D = 128 with 4 warps ×
 * 2 stages (with and without split scores) or 8 warps × 2 stages; D = 64 with 4 warps × 2 or
 * 3 stages; D = 256 with 8 warps × 2 stages. Head dims between run on the next width with the
 * columns past D zero-filled (fwd_tile_dim), 4 warps × 2 stages. The device option
 * fwd_tile="warps,stages[,split]" picks another one for benchmarks.
 *
 * Measured on an H200 (sm_90, 2026-11-30, B=1 H=12 N=32760 D=128 bf16, dense, see
 * experiments/BENCHMARKS.md): 4 warps × 2 stages 330 TFLOP/s (255 registers, ≈ 110 bytes
 * spilled); the same with split scores 305 (4 bytes spilled: the second K pass costs more
 * than the spills); 8 warps × 2 stages 296 (an earlier build, against 309 for 4 warps then).
 * The D = 64 tiles are correct on the H200 but their speed was not measured. */
#ifndef SPARGE_CUDA_TILES_H
#define SPARGE_CUDA_TILES_H

typedef struct {
    int warps;        /* 4 (32 query rows per warp) or 8 (16 rows per warp) */
    int stages;       /* K/V shared-memory ring depth, ≥ 2 */
    int split_scores; /* 1: a 4-warp tile computes the scores of its two m16 tiles one after the
                       * other (32 fp32 score registers live instead of 64, K read twice) */
} fwd_tile;

/* The tile for a device of compute capability major.minor and tile width D (64, 128 or 256). */
static inline fwd_tile fwd_tile_for(int cc_major, int cc_minor, int D)
{
    (void)cc_minor;
    /* D = 256: 8 warps × 16 rows keep the O accumulator at 128 registers a thread; Q (64 KB) and two stages of K
     * and V (128 KB) fit sm_90's shared memory only, one CTA per SM. */
    if (D == 256)
        return (fwd_tile){8, 2, 0};
    if (cc_major >= 12) {
        /* sm_120 (RTX 5090): about 100 KB of shared memory per CTA and per SM, 64 K registers.
         * GUESSES — no sm_120 device was reachable, none of this was measured.
         * D = 128: 4 warps × 2 stages (96 KB) would leave one 4-warp CTA per SM, too few warps
         * to hide latency; 8 warps × 2 stages fits the same 96 KB with twice the warps, and
         * 16 rows per warp keep Q in registers (ldmatrix traffic is the price).
         * D = 64: 4 warps × 2 stages = 48 KB, two CTAs per SM. */
        if (D == 128)
            return (fwd_tile){8, 2, 0};
        return (fwd_tile){4, 2, 0};
    }
    /* sm_80 (A100: 164 KB per SM) and sm_90 (H100/H200: 228 KB per SM), same mma.sync path.
     * D = 128: 4 warps × 2 stages = 96 KB, two CTAs (8 warps) per SM on either chip — the
     *   register file (≈ 230 registers × 128 threads per CTA) also allows two, not three.
     *   FlashAttention-2 uses the same 128 × 64, 4-warp shape on these chips.
     * D = 64: registers drop to ≈ 150, so depth is cheap: 3 stages = 64 KB, two CTAs per SM
     *   on sm_80 and three on sm_90; the third stage hides L2 latency of scattered kept blocks. */
    if (D == 128)
        return (fwd_tile){4, 2, 0};
    return (fwd_tile){4, 3, 0};
}

/* 1: run forward_sm90.cu's wgmma kernel (when the build has its sm_90a image) instead of the
 * mma.sync tile above. Only sm_90 (H100/H200) has wgmma; sm_100/sm_120 have none of it (sm_120
 * keeps mma.sync, sm_100's tcgen05 is not written). Two 64-row warpgroups per CTA (bq = 128), 64-key
 * tiles, one 2-stage K/V ring, 128 registers (D = 128: 8 bytes spilled; D = 64: 113), two CTAs per
 * SM (D = 256: 218 registers and 193 KB of shared memory, one CTA per SM, P·V as two n128 halves).
 * The mma.sync kernel is issue-bound on sm_90 (ldmatrix + 16×8 MMAs, tensor pipe 47.5 % busy);
 * wgmma reads Q, K and V from shared memory itself. Measured on the H200 (B=1 H=12 N=32760 bf16,
 * experiments/BENCHMARKS.md, wgmma section):
 *   D = 128: dense 448 TFLOP/s (mma.sync 328), 95 % Top-k 0.795 ms (1.060)
 *   D = 64:  dense 320 TFLOP/s (mma.sync 292), 95 % 0.558 ms (0.618)
 * Variants measured and dropped (commit f06752c): separate K/V rings with P(t)·V(t) before S(t+1)
 * 428 TFLOP/s at D = 128; S(t+1) and P(t)·V(t) in flight during the softmax (FA3's intra-warpgroup
 * overlap) needs > 128 registers at D = 128 (ptxas serializes the wgmma and spills), so one CTA per
 * SM: 340; the same with Q in registers (S reads only K from shared memory): 346; at D = 64 both
 * fit two CTAs per SM and tie with this kernel (±2 %). */
static inline int fwd_use_wgmma(int cc_major, int cc_minor, int D)
{
    return cc_major == 9 && cc_minor == 0 && (D == 64 || D == 128 || D == 256);
}

/* Of the sm_90 kernels, the warp-specialized one (fwd_kernel=wgmma-ws: a loading warpgroup, Q in registers) for
 * head dims padded to the 128-wide tile (64 < D < 128) and for unmasked calls at D = 128. Measured on an H100
 * against the wgmma kernel in alternating rounds (B=1 H=12 N=32760 bf16, experiments/BENCHMARKS.md):
 *   D = 96:  2-14 % faster at every level (dense, 80-97 %, hybrid);
 *   D = 128: dense 2-5 %, 80-90 % and hybrid 2-5 % faster, but 95 % 1 % and 97 % 6 % slower, so masks stay
 *            on the wgmma kernel (the host does not know a mask's density);
 *   D = 64:  3-9 % slower at every level. */
static inline int fwd_use_ws(int D, int masked)
{
    return (D > 64 && D < 128) || (D == 128 && !masked);
}

#endif
