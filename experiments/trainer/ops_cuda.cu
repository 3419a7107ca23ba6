/* The CUDA table of ops.h: GEMMs through cuBLAS (strict fp32 unless tf32 is asked for), one kernel
 * for each other operation, every tensor resident on the device. Kernels follow ops_cpu.c's
 * arithmetic (double where it accumulates in double, the same GELU/SiLU formulas) and every
 * reduction runs in a fixed order, so a run is reproducible and stays close to the host path.
 * Work is queued on the legacy default stream, which sparge's attention also uses (the trainer
 * never sets a stream on its device). Built without --use_fast_math: agreement with the host
 * matters more than the last few percent. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" {
#include "ops.h"
}

namespace {

enum { REDUCE_BLOCKS = 256, THREADS = 256 };

struct cuda_ops {
    tr_ops ops;
    cublasHandle_t blas;
    int failed;
    char message[512];
    double *partials; /* [REDUCE_BLOCKS][2] per-block sums of the reductions */
    double *sums;     /* [2] their totals */
    /* timers: events at every change of part; part[i] is what runs between event i and i + 1 */
    cudaEvent_t *events;
    tr_part *parts;
    int nevents, created, capacity;
};

cuda_ops *self(tr_ops *o) { return reinterpret_cast<cuda_ops *>(o); }

bool fail(cuda_ops *c, const char *what, const char *why, int line)
{
    if (!c->failed)
        snprintf(c->message, sizeof c->message, "CUDA ops: %s failed: %s (ops_cuda.cu:%d)", what, why, line);
    c->failed = 1;
    return false;
}

bool check(cuda_ops *c, cudaError_t e, const char *what, int line)
{
    if (e == cudaSuccess)
        return !c->failed;
    (void)cudaGetLastError(); /* clear a non-sticky error */
    return fail(c, what, cudaGetErrorString(e), line);
}

bool check_blas(cuda_ops *c, cublasStatus_t s, const char *what, int line)
{
    return s == CUBLAS_STATUS_SUCCESS ? !c->failed : fail(c, what, cublasGetStatusString(s), line);
}

#define CHECK(c, call) check((c), (call), #call, __LINE__)
#define CHECK_BLAS(c, call) check_blas((c), (call), #call, __LINE__)
#define LAUNCHED(c) CHECK(c, cudaGetLastError())

unsigned blocks_for(size_t n, unsigned threads = THREADS)
{
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 65535u * 32u ? (b ? b : 1) : 65535u * 32u);
}

/* ---------------------------------------------------------------- kernels */

__device__ double warp_sum(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* One warp per row. */
__global__ void layernorm_forward_kernel(float *xhat, float *rstd, const float *x, int rows, int d)
{
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows)
        return;
    const float *xr = x + (size_t)row * d;
    double mean = 0.0, var = 0.0;
    for (int i = lane; i < d; i += 32)
        mean += xr[i];
    mean = warp_sum(mean) / d;
    for (int i = lane; i < d; i += 32)
        var += (xr[i] - mean) * (xr[i] - mean);
    var = warp_sum(var) / d;
    float rs = (float)(1.0 / sqrt(var + 1e-6));
    for (int i = lane; i < d; i += 32)
        xhat[(size_t)row * d + i] = (float)((xr[i] - mean) * rs);
    if (lane == 0)
        rstd[row] = rs;
}

__global__ void layernorm_backward_kernel(float *dx, const float *dxhat, const float *xhat, const float *rstd,
                                          int rows, int d)
{
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows)
        return;
    const float *g = dxhat + (size_t)row * d, *xh = xhat + (size_t)row * d;
    double mean_g = 0.0, mean_gx = 0.0;
    for (int i = lane; i < d; i += 32) {
        mean_g += g[i];
        mean_gx += (double)g[i] * xh[i];
    }
    mean_g = warp_sum(mean_g) / d;
    mean_gx = warp_sum(mean_gx) / d;
    for (int i = lane; i < d; i += 32)
        dx[(size_t)row * d + i] += (float)(rstd[row] * (g[i] - mean_g - xh[i] * mean_gx));
}

__global__ void bias_add_kernel(float *out, const float *b, size_t rows, int cols)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * cols; i += (size_t)gridDim.x * blockDim.x)
        out[i] += b[i % cols];
}

/* Per batch b and feature i, over the N token rows of [B, N, d]: scaled = a·(one + vec[b·ms + i]) when
 * scaled is set, sum_a[b·ms + i] += Σ_n a and sum_ax[b·ms + i] += Σ_n a·x (either may be NULL).
 * Block (32, 32): 32 features × 32 row slices, partial sums in double combined in a fixed order. */
__global__ void token_sums_kernel(float *scaled, float *sum_a, float *sum_ax, const float *a, const float *x,
                                  const float *vec, float one, int ms, int N, int d)
{
    __shared__ double part[2][32][33];
    int i = blockIdx.x * 32 + threadIdx.x, b = blockIdx.y;
    double sa = 0.0, sax = 0.0;
    if (i < d) {
        float factor = scaled ? one + vec[(size_t)b * ms + i] : 0.0f;
        for (int n = threadIdx.y; n < N; n += 32) {
            size_t r = ((size_t)b * N + n) * d + i;
            float g = a[r];
            if (scaled)
                scaled[r] = g * factor;
            sa += g;
            if (sum_ax)
                sax += g * x[r];
        }
    }
    part[0][threadIdx.y][threadIdx.x] = sa;
    part[1][threadIdx.y][threadIdx.x] = sax;
    __syncthreads();
    if (threadIdx.y == 0 && i < d) {
        for (int k = 1; k < 32; k++)
            sa += part[0][k][threadIdx.x], sax += part[1][k][threadIdx.x];
        if (sum_a)
            sum_a[(size_t)b * ms + i] += (float)sa;
        if (sum_ax)
            sum_ax[(size_t)b * ms + i] += (float)sax;
    }
}

__global__ void modulate_forward_kernel(float *h, const float *xhat, const float *shift, const float *scale, int ms,
                                        int N, int d, size_t total)
{
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t b = e / ((size_t)N * d), i = e % d;
        h[e] = xhat[e] * (1.0f + scale[b * ms + i]) + shift[b * ms + i];
    }
}

__global__ void gated_add_kernel(float *out, const float *in, const float *gate, const float *y, int ms, int N, int d,
                                 size_t total)
{
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t b = e / ((size_t)N * d), i = e % d;
        out[e] = in[e] + gate[b * ms + i] * y[e];
    }
}

__device__ float fast_tanh(float z) { return 1.0f - 2.0f / (expf(2.0f * z) + 1.0f); }

__device__ float gelu(float x)
{
    const float c = 0.7978845608028654f;
    return 0.5f * x * (1.0f + fast_tanh(c * (x + 0.044715f * x * x * x)));
}

__device__ float gelu_grad(float x)
{
    const float c = 0.7978845608028654f;
    float th = fast_tanh(c * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

__device__ float silu(float x) { return x / (1.0f + expf(-x)); }

__device__ float silu_grad(float x)
{
    float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
}

enum unary_op { GELU, GELU_GRAD, SILU, SILU_GRAD };

/* GELU/SILU: out = f(x); *_GRAD: out *= f'(x) */
template <unary_op F> __global__ void unary_kernel(float *out, const float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        if (F == GELU)
            out[i] = gelu(x[i]);
        else if (F == GELU_GRAD)
            out[i] *= gelu_grad(x[i]);
        else if (F == SILU)
            out[i] = silu(x[i]);
        else
            out[i] *= silu_grad(x[i]);
    }
}

/* One thread per token value: token tok, pixel q = 2·py + px, channel ch. */
template <bool TO_TOKENS>
__global__ void patch_kernel(float *tokens, float *video, int H, int W, int C, size_t total)
{
    size_t Wp = W / 2, Hp = H / 2;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t tok = e / (4 * (size_t)C), q = e / C % 4, ch = e % C;
        size_t x = tok % Wp, y = tok / Wp % Hp, bt = tok / (Wp * Hp);
        size_t v = ((bt * H + 2 * y + q / 2) * W + 2 * x + q % 2) * C + ch;
        if (TO_TOKENS)
            tokens[e] = video[v];
        else
            video[v] = tokens[e];
    }
}

__global__ void add_positional_kernel(float *x, const float *pos, size_t n, size_t total)
{
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x)
        x[e] += pos[e % n];
}

__global__ void timestep_kernel(float *out, const float *t, int B, int F)
{
    int half = F / 2, e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= B * half)
        return;
    int b = e / half, i = e % half;
    double arg = 1000.0 * t[b] * exp(-log(10000.0) * i / half);
    out[(size_t)b * F + i] = (float)cos(arg);
    out[(size_t)b * F + half + i] = (float)sin(arg);
}

__global__ void class_forward_kernel(float *c, float *cs, const float *table, const int *y, int B, int d)
{
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= B * d)
        return;
    int b = e / d, i = e % d;
    c[e] += table[(size_t)y[b] * d + i];
    cs[e] = silu(c[e]);
}

/* One thread per feature, the batch in order: samples of the same class add up without races. */
__global__ void class_backward_kernel(float *dtable, float *dcs, const float *c, const int *y, int B, int d)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d)
        return;
    for (int b = 0; b < B; b++) {
        size_t e = (size_t)b * d + i;
        dcs[e] *= silu_grad(c[e]);
        dtable[(size_t)y[b] * d + i] += dcs[e];
    }
}

enum reduction_op { MSE, ABS_DIFF, SQUARES };

/* Per-block sums (two per block) in double; the gradient of MSE on the way. */
template <reduction_op R>
__global__ void reduce_kernel(double *partials, float *du, const float *a, const float *b, size_t n)
{
    __shared__ double part[2][THREADS];
    double s0 = 0.0, s1 = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        if (R == MSE) {
            double e = (double)a[i] - b[i];
            s0 += e * e;
            if (du)
                du[i] = (float)(2.0 * e / (double)n);
        } else if (R == ABS_DIFF) {
            s0 += fabs((double)a[i] - b[i]);
            s1 += fabs((double)b[i]);
        } else
            s0 += (double)a[i] * a[i];
    }
    part[0][threadIdx.x] = s0, part[1][threadIdx.x] = s1;
    __syncthreads();
    for (int w = THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            part[0][threadIdx.x] += part[0][threadIdx.x + w], part[1][threadIdx.x] += part[1][threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        partials[2 * blockIdx.x] = part[0][0], partials[2 * blockIdx.x + 1] = part[1][0];
}

__global__ void reduce_final_kernel(double *sums, const double *partials, int blocks)
{
    if (threadIdx.x < 2) {
        double s = 0.0;
        for (int i = 0; i < blocks; i++)
            s += partials[2 * i + threadIdx.x];
        sums[threadIdx.x] = s;
    }
}

__global__ void scale_kernel(float *x, size_t n, float s)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

/* sparge_f32_to_bf16's rounding: to nearest even, NaN kept quiet */
__global__ void to_bf16_kernel(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t u = __float_as_uint(src[i]);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            dst[i] = (uint16_t)((u >> 16) | 0x40);
        else
            dst[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

__global__ void from_bf16_kernel(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __uint_as_float((uint32_t)src[i] << 16);
}

__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, size_t n, double lr, double beta1,
                             double beta2, double c1, double c2, double eps, double decay)
{
    for (size_t j = blockIdx.x * (size_t)blockDim.x + threadIdx.x; j < n; j += (size_t)gridDim.x * blockDim.x) {
        m[j] = (float)(beta1 * m[j] + (1 - beta1) * g[j]);
        v[j] = (float)(beta2 * v[j] + (1 - beta2) * (double)g[j] * g[j]);
        double update = (m[j] / c1) / (sqrt(v[j] / c2) + eps);
        p[j] = (float)(p[j] - lr * (update + decay * p[j]));
    }
}

/* ---------------------------------------------------------------- the table */

void mark(tr_ops *o, tr_part part)
{
    cuda_ops *c = self(o);
    if (c->failed || (c->nevents > 0 && c->parts[c->nevents - 1] == part))
        return;
    if (c->nevents + 1 >= c->capacity) { /* + 1: times() records a closing event */
        int cap = c->capacity ? 2 * c->capacity : 64;
        cudaEvent_t *ev = (cudaEvent_t *)realloc(c->events, cap * sizeof *ev);
        if (ev)
            c->events = ev;
        tr_part *parts = (tr_part *)realloc(c->parts, cap * sizeof *parts);
        if (parts)
            c->parts = parts;
        if (!ev || !parts) {
            fail(c, "timer events", "out of host memory", __LINE__);
            return;
        }
        c->capacity = cap;
    }
    while (c->created < c->nevents + 2)
        if (!CHECK(c, cudaEventCreate(&c->events[c->created++])))
            return;
    if (CHECK(c, cudaEventRecord(c->events[c->nevents], 0)))
        c->parts[c->nevents++] = part;
}

void times(tr_ops *o, double ms[TR_PARTS])
{
    cuda_ops *c = self(o);
    for (int i = 0; i < TR_PARTS; i++)
        ms[i] = 0.0;
    if (c->failed || c->nevents == 0)
        return;
    cudaEvent_t last = c->events[c->nevents];
    if (!CHECK(c, cudaEventRecord(last, 0)) || !CHECK(c, cudaEventSynchronize(last)))
        return;
    for (int i = 0; i < c->nevents; i++) {
        float f = 0.0f;
        if (c->parts[i] == TR_PART_IDLE)
            continue;
        if (!CHECK(c, cudaEventElapsedTime(&f, c->events[i], c->events[i + 1])))
            return;
        ms[c->parts[i]] += f;
    }
    c->nevents = 0;
}

void destroy(tr_ops *o)
{
    cuda_ops *c = self(o);
    /* best effort: nothing can be reported from here */
    (void)cudaDeviceSynchronize();
    for (int i = 0; i < c->created; i++)
        (void)cudaEventDestroy(c->events[i]);
    (void)cudaFree(c->partials);
    (void)cudaFree(c->sums);
    if (c->blas)
        (void)cublasDestroy(c->blas);
    free(c->events);
    free(c->parts);
    free(c);
}

int error(tr_ops *o, char *err, size_t err_len)
{
    cuda_ops *c = self(o);
    if (!c->failed)
        return 0;
    snprintf(err, err_len, "%s", c->message);
    return -1;
}

void *alloc(tr_ops *o, size_t bytes)
{
    cuda_ops *c = self(o);
    void *p = NULL;
    if (c->failed)
        return NULL;
    if (!CHECK(c, cudaMalloc(&p, bytes ? bytes : 1)))
        return NULL;
    if (!CHECK(c, cudaMemset(p, 0, bytes))) {
        (void)cudaFree(p);
        return NULL;
    }
    return p;
}

void release(tr_ops *o, void *p) { CHECK(self(o), cudaFree(p)); }

void upload(tr_ops *o, void *dst, const void *src, size_t bytes)
{
    cuda_ops *c = self(o);
    if (!c->failed)
        CHECK(c, cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void download(tr_ops *o, void *dst, const void *src, size_t bytes)
{
    cuda_ops *c = self(o);
    if (!c->failed)
        CHECK(c, cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void zero(tr_ops *o, void *dst, size_t bytes)
{
    cuda_ops *c = self(o);
    mark(o, TR_PART_OTHER);
    if (!c->failed)
        CHECK(c, cudaMemsetAsync(dst, 0, bytes, 0));
}

void copy(tr_ops *o, float *dst, const float *src, size_t n)
{
    cuda_ops *c = self(o);
    mark(o, TR_PART_OTHER);
    if (!c->failed)
        CHECK(c, cudaMemcpyAsync(dst, src, n * sizeof *dst, cudaMemcpyDeviceToDevice, 0));
}

/* Row-major X[r, k] is column-major Xᵀ: out = in·wᵀ becomes outᵀ = w·inᵀ with w read transposed. */
void linear_forward(tr_ops *o, float *out, const float *in, const float *w, const float *b, int rows, int IN, int OUT)
{
    cuda_ops *c = self(o);
    mark(o, TR_PART_GEMM);
    const float one = 1.0f, zero_f = 0.0f;
    if (!CHECK_BLAS(c, cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, OUT, rows, IN, &one, w, IN, in, IN, &zero_f,
                                   out, OUT)))
        return;
    if (b) {
        bias_add_kernel<<<blocks_for((size_t)rows * OUT), THREADS>>>(out, b, (size_t)rows, OUT);
        LAUNCHED(c);
    }
}

void linear_backward(tr_ops *o, float *din, float *dw, float *db, const float *dout, const float *in, const float *w,
                     int rows, int IN, int OUT, int accumulate)
{
    cuda_ops *c = self(o);
    mark(o, TR_PART_GEMM);
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    if (c->failed)
        return;
    if (din && !CHECK_BLAS(c, cublasSgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, IN, rows, OUT, &one, w, IN, dout, OUT,
                                          &beta, din, IN)))
        return;
    if (!CHECK_BLAS(c, cublasSgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_T, IN, OUT, rows, &one, in, IN, dout, OUT, &one,
                                   dw, IN)))
        return;
    if (db) {
        token_sums_kernel<<<dim3((OUT + 31) / 32, 1), dim3(32, 32)>>>(NULL, db, NULL, dout, NULL, NULL, 0.0f, 0,
                                                                       rows, OUT);
        LAUNCHED(c);
    }
}

/* An op of the "other" part that is one kernel: kernel<<<grid, block>>>(args...), unless an earlier call failed. */
template <typename... P, typename... A> void launch(tr_ops *o, void (*kernel)(P...), dim3 grid, dim3 block, A... args)
{
    mark(o, TR_PART_OTHER);
    if (self(o)->failed)
        return;
    kernel<<<grid, block>>>(args...);
    LAUNCHED(self(o));
}

void layernorm_forward(tr_ops *o, float *xhat, float *rstd, const float *x, int rows, int d)
{
    launch(o, layernorm_forward_kernel, (rows + 7) / 8, 256, xhat, rstd, x, rows, d);
}

void layernorm_backward(tr_ops *o, float *dx, const float *dxhat, const float *xhat, const float *rstd, int rows,
                        int d)
{
    launch(o, layernorm_backward_kernel, (rows + 7) / 8, 256, dx, dxhat, xhat, rstd, rows, d);
}

void modulate_forward(tr_ops *o, float *h, const float *xhat, const float *shift, const float *scale, int ms, int B,
                      int N, int d)
{
    size_t total = (size_t)B * N * d;
    launch(o, modulate_forward_kernel, blocks_for(total), THREADS, h, xhat, shift, scale, ms, N, d, total);
}

void modulate_backward(tr_ops *o, float *dxhat, float *dshift, float *dscale, const float *dh, const float *xhat,
                       const float *scale, int ms, int B, int N, int d)
{
    launch(o, token_sums_kernel, dim3((d + 31) / 32, B), dim3(32, 32), dxhat, dshift, dscale, dh, xhat, scale, 1.0f,
           ms, N, d);
}

void gated_add(tr_ops *o, float *out, const float *in, const float *gate, const float *y, int ms, int B, int N, int d)
{
    size_t total = (size_t)B * N * d;
    launch(o, gated_add_kernel, blocks_for(total), THREADS, out, in, gate, y, ms, N, d, total);
}

void gated_add_backward(tr_ops *o, float *dy, float *dgate, const float *dout, const float *gate, const float *y,
                        int ms, int B, int N, int d)
{
    launch(o, token_sums_kernel, dim3((d + 31) / 32, B), dim3(32, 32), dy, nullptr, dgate, dout, y, gate, 0.0f, ms,
           N, d);
}

template <unary_op F> void unary(tr_ops *o, float *out, const float *x, size_t n)
{
    launch(o, unary_kernel<F>, blocks_for(n), THREADS, out, x, n);
}

void gelu_forward(tr_ops *o, float *out, const float *x, size_t n) { unary<GELU>(o, out, x, n); }
void gelu_backward(tr_ops *o, float *g, const float *x, size_t n) { unary<GELU_GRAD>(o, g, x, n); }
void silu_forward(tr_ops *o, float *out, const float *x, size_t n) { unary<SILU>(o, out, x, n); }
void silu_backward(tr_ops *o, float *g, const float *x, size_t n) { unary<SILU_GRAD>(o, g, x, n); }

void patchify(tr_ops *o, float *tokens, const float *video, int B, int T, int H, int W, int C)
{
    size_t total = (size_t)B * T * H * W * C;
    launch(o, patch_kernel<true>, blocks_for(total), THREADS, tokens, (float *)video, H, W, C, total);
}

void unpatchify(tr_ops *o, float *video, const float *tokens, int B, int T, int H, int W, int C)
{
    size_t total = (size_t)B * T * H * W * C;
    launch(o, patch_kernel<false>, blocks_for(total), THREADS, (float *)tokens, video, H, W, C, total);
}

void add_positional(tr_ops *o, float *x, const float *pos, int B, size_t n)
{
    launch(o, add_positional_kernel, blocks_for(B * n), THREADS, x, pos, n, B * n);
}

void timestep_embedding(tr_ops *o, float *out, const float *t, int B, int F)
{
    launch(o, timestep_kernel, blocks_for((size_t)B * (F / 2)), THREADS, out, t, B, F);
}

void class_embedding_forward(tr_ops *o, float *c, float *cs, const float *table, const int *y, int B, int d)
{
    launch(o, class_forward_kernel, blocks_for((size_t)B * d), THREADS, c, cs, table, y, B, d);
}

void class_embedding_backward(tr_ops *o, float *dtable, float *dcs, const float *c, const int *y, int B, int d)
{
    launch(o, class_backward_kernel, blocks_for(d), THREADS, dtable, dcs, c, y, B, d);
}

/* The two sums of reduction R into out[0..1] on the host (waits for the device); zeros on failure. */
template <reduction_op R> void reduce(cuda_ops *c, float *du, const float *a, const float *b, size_t n, double out[2])
{
    out[0] = out[1] = 0.0;
    if (c->failed)
        return;
    reduce_kernel<R><<<REDUCE_BLOCKS, THREADS>>>(c->partials, du, a, b, n);
    if (!LAUNCHED(c))
        return;
    reduce_final_kernel<<<1, 32>>>(c->sums, c->partials, REDUCE_BLOCKS);
    double host[2];
    if (LAUNCHED(c) && CHECK(c, cudaMemcpy(host, c->sums, sizeof host, cudaMemcpyDeviceToHost)))
        out[0] = host[0], out[1] = host[1];
}

void mse(tr_ops *o, float *du, const float *u, const float *target, size_t n, double *loss)
{
    double s[2];
    mark(o, TR_PART_OTHER);
    reduce<MSE>(self(o), du, u, target, n, s);
    *loss = s[0] / (double)n;
}

void abs_diff_sums(tr_ops *o, const float *a, const float *ref, size_t n, double *diff, double *refsum)
{
    double s[2];
    mark(o, TR_PART_OTHER);
    reduce<ABS_DIFF>(self(o), NULL, a, ref, n, s);
    *diff = s[0], *refsum = s[1];
}

void sum_squares(tr_ops *o, const float *x, size_t n, double *out)
{
    double s[2];
    mark(o, TR_PART_OTHER);
    reduce<SQUARES>(self(o), NULL, x, NULL, n, s);
    *out = s[0];
}

void scale(tr_ops *o, float *x, size_t n, float s)
{
    launch(o, scale_kernel, blocks_for(n), THREADS, x, n, s);
}

void to_bf16(tr_ops *o, uint16_t *dst, const float *src, size_t n)
{
    launch(o, to_bf16_kernel, blocks_for(n), THREADS, dst, src, n);
}

void from_bf16(tr_ops *o, float *dst, const uint16_t *src, size_t n)
{
    launch(o, from_bf16_kernel, blocks_for(n), THREADS, dst, src, n);
}

void adamw(tr_ops *o, float *p, const float *g, float *m, float *v, size_t n, double lr, double beta1, double beta2,
           double c1, double c2, double eps, double decay)
{
    launch(o, adamw_kernel, blocks_for(n), THREADS, p, g, m, v, n, lr, beta1, beta2, c1, c2, eps, decay);
}

} // namespace

extern "C" tr_ops *tr_ops_cuda_create(int index, int tf32, char *err, size_t err_len)
{
    cuda_ops *c = (cuda_ops *)calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, err_len, "CUDA ops: out of host memory");
        return NULL;
    }
    c->ops = tr_ops{
        "cuda", destroy, error, alloc, release, upload, download, zero, copy, mark, times, linear_forward,
        linear_backward, layernorm_forward, layernorm_backward, modulate_forward, modulate_backward, gated_add,
        gated_add_backward, gelu_forward, gelu_backward, silu_forward, silu_backward, patchify, unpatchify,
        add_positional, timestep_embedding, class_embedding_forward, class_embedding_backward, mse, abs_diff_sums,
        sum_squares, scale, to_bf16, from_bf16, adamw,
    };
    /* the default math mode computes sgemm in fp32; TF32 only when asked for */
    if (CHECK(c, cudaSetDevice(index)) && CHECK_BLAS(c, cublasCreate(&c->blas)) &&
        CHECK_BLAS(c, cublasSetMathMode(c->blas, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH)) &&
        CHECK_BLAS(c, cublasSetStream(c->blas, 0)) &&
        CHECK(c, cudaMalloc(&c->partials, 2 * REDUCE_BLOCKS * sizeof(double))) &&
        CHECK(c, cudaMalloc(&c->sums, 2 * sizeof(double))))
        return &c->ops;
    error(&c->ops, err, err_len);
    destroy(&c->ops);
    return NULL;
}
