/* Block-sparse attention forward on tensor cores (mma.sync): work in progress. */
#include "mma.cuh"

sparge_status sparge_cuda_mma_forward(gpu_ctx *ctx, const sparge_fwd_args *a)
{
    (void)ctx;
    (void)a;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: tensor-core forward not built yet; use \"cuda-generic\"");
}
