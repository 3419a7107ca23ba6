/* HIP build of the shared GPU source (see README.md). */
#include "../cuda/pool.cu"
