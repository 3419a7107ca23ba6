/* Block mean-pooling (placeholder until the kernel lands). */
#include "gpu.h"

sparge_status SPARGE_GPU_FN(pool)(gpu_ctx *ctx, const sparge_pool_args *a)
{
    (void)ctx;
    (void)a;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "pool: GPU kernel not implemented yet");
}
