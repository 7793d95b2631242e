#include "kernels/cpu/gemm.h"

#include <cblas.h>

namespace k3::cpu {

void Linear(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M * N; ++i) y[i] = beta == 0.0f ? 0.0f : y[i] * beta;
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
              1.0f, x, static_cast<int>(K), W, static_cast<int>(K), beta, y, static_cast<int>(N));
}

void LinearRef(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[m * K + k]) * W[n * K + k];
      y[m * N + n] = static_cast<float>(acc + (beta == 0.0f ? 0.0 : static_cast<double>(beta) * y[m * N + n]));
    }
}

void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : C[i * ldc + j] * beta;
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A, static_cast<int>(lda), B,
              static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

}  // namespace k3::cpu
