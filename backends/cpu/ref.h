/* The fp64 reference: one (batch, head) at a time on contiguous double
 * arrays. It is the oracle every other backend is tested against, and the
 * finite-difference tests call it directly. */
#ifndef SPARGE_REF_H
#define SPARGE_REF_H

#include <stdint.h>

/* q [Nq×D], k, v [Nk×D] row-major; keep [Nqb×Nkb] (NULL: dense); o [Nq×D]; lse [Nq]. */
void sparge_ref_head_forward(const double *q, const double *k, const double *v, int64_t Nq, int64_t Nk, int64_t D,
                             double scale, int bq, int bk, const uint8_t *keep, double *o, double *lse);
/* Gradients of the forward above, given dO, O and LSE. */
void sparge_ref_head_backward(const double *q, const double *k, const double *v, const double *o, const double *d_o,
                              const double *lse, int64_t Nq, int64_t Nk, int64_t D, double scale, int bq, int bk,
                              const uint8_t *keep, double *dq, double *dk, double *dv);

#endif
