/* HIP build of the shared GPU glue (see README.md). backend.cu holds host code
 * only; its ops tables must not reach the device pass, where clang would try to
 * emit them (const globals) and fail to resolve the host functions they name. */
#ifndef __HIP_DEVICE_COMPILE__
#include "../cuda/backend.cu"
#endif
