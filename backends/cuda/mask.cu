/* Pooled map and mask selection (placeholder until the kernels land). */
#include "gpu.h"

sparge_status SPARGE_GPU_FN(pooled_map)(gpu_ctx *ctx, const sparge_map_args *a)
{
    (void)ctx;
    (void)a;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "pooled_map: GPU kernel not implemented yet");
}

sparge_status SPARGE_GPU_FN(mask_select)(gpu_ctx *ctx, const sparge_select_args *a)
{
    (void)ctx;
    (void)a;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask_select: GPU kernel not implemented yet");
}

sparge_status SPARGE_GPU_FN(mask_from_dense)(gpu_ctx *ctx, const sparge_mask_view *m)
{
    (void)ctx;
    (void)m;
    return SPARGE_FAIL(SPARGE_ERR_UNSUPPORTED, "mask_from_dense: GPU kernel not implemented yet");
}
