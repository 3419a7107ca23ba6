/* The fp64 reference: one (batch, head) at a time on contiguous double
 * arrays. It is the oracle every other backend is tested against, and the
 * finite-difference tests call it directly. */
#ifndef SPARGE_REF_H
#define SPARGE_REF_H

#include <stdint.h>

/* q [Nq×D], k, v [Nk×D] row-major; keep [Nqb rows of keep_stride] (NULL: dense); causal: key u attended by
 * query t only when u <= t + Nk − Nq; o [Nq×D]; lse [Nq]. */
void sparge_ref_head_forward(const double *q, const double *k, const double *v, int64_t Nq, int64_t Nk, int64_t D,
                             double scale, int bq, int bk, int causal, const uint8_t *keep, int64_t keep_stride,
                             double *o, double *lse);
/* Gradients of the forward above, given dO, O and LSE: dq is written, dk and dv are added to (a group of query
 * heads shares them). */
void sparge_ref_head_backward(const double *q, const double *k, const double *v, const double *o, const double *d_o,
                              const double *lse, int64_t Nq, int64_t Nk, int64_t D, double scale, int bq, int bk,
                              int causal, const uint8_t *keep, int64_t keep_stride, double *dq, double *dk, double *dv);

#endif
