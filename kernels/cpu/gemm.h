// y = x · Wᵀ (PyTorch Linear layout: W is [N, K] row-major), fp32.
#pragma once

#include <cstdint>

namespace k3::cpu {

// x [M, K], W [N, K], y [M, N]. beta = 0 overwrites y, beta = 1 accumulates into y.
//
// Our own kernel, not OpenBLAS's sgemm: sgemm packs W on every call, which at the few rows of a decode step (an
// expert's tokens, a micro-batch's) costs several times the products themselves. Here W streams once per chunk of
// rows of x. Each output is summed over K in one fixed order whatever M and the rows beside it, so a token's
// result does not depend on the batch it came in; at prefill's hundreds of rows it runs at 0.6-0.9x sgemm.
void Linear(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta = 0.0f);
// Linear with y's rows ldy apart.
void LinearStrided(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, int64_t ldy,
                   float beta = 0.0f);
// The same sums, bit for bit, without AVX2: what Linear runs on machines that lack it.
void LinearPlain(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, int64_t ldy,
                 float beta = 0.0f);
// Naive reference of Linear (double accumulation).
void LinearRef(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta = 0.0f);

// General row-major C[M,N] = alpha·op(A)·op(B) + beta·C with explicit leading dimensions (OpenBLAS); for the
// attention kernels that multiply strided views.
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace k3::cpu
