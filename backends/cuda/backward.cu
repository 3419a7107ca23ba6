/* Block-sparse attention backward on tensor cores (mma.sync): work in progress. */
#include "gpu.h"

sparge_status sparge_cuda_mma_backward(gpu_ctx *ctx, const sparge_bwd_args *a)
{
    (void)ctx;
    (void)a;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "cuda: tensor-core backward not built yet; use \"cuda-generic\"");
}
