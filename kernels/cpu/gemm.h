// y = x · Wᵀ (PyTorch Linear layout: W is [N, K] row-major), fp32.
#pragma once

#include <cstdint>

namespace k3::cpu {

// x [M, K], W [N, K], y [M, N]. beta = 0 overwrites y, beta = 1 accumulates into y.
void Linear(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta = 0.0f);
// Naive reference of Linear (double accumulation).
void LinearRef(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta = 0.0f);

// General row-major C[M,N] = alpha·op(A)·op(B) + beta·C with explicit leading dimensions; for the
// attention kernels that multiply strided views.
void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace k3::cpu
