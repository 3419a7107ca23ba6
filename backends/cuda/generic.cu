/* Portable attention tier (placeholder until the kernels land). */
#include "gpu.h"

sparge_status SPARGE_GPU_FN(generic_forward)(gpu_ctx *ctx, const sparge_fwd_args *a)
{
    (void)ctx;
    (void)a;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "generic forward: GPU kernel not implemented yet");
}

sparge_status SPARGE_GPU_FN(generic_backward)(gpu_ctx *ctx, const sparge_bwd_args *a)
{
    (void)ctx;
    (void)a;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "generic backward: GPU kernel not implemented yet");
}
