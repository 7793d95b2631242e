#include "kernels/cpu/gemm.h"

#include <gtest/gtest.h>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

TEST(Linear, MatchesReferenceOnOddShapes) {
  for (auto [M, N, K] : {std::tuple{1, 1, 1}, {1, 7, 13}, {5, 3, 129}, {33, 65, 17}, {64, 128, 256}, {200, 1, 31}}) {
    auto x = Random(M * K, 1), W = Random(N * K, 2), y0 = Random(M * N, 3);
    for (float beta : {0.0f, 1.0f}) {
      std::vector<float> y = y0, ref = y0;
      Linear(M, N, K, x.data(), W.data(), y.data(), beta);
      LinearRef(M, N, K, x.data(), W.data(), ref.data(), beta);
      EXPECT_LT(RelDiff(y, ref), 1e-5) << M << "x" << N << "x" << K << " beta " << beta;
    }
  }
}

TEST(Linear, EmptyShapes) {
  std::vector<float> y(6, 7.0f);
  Linear(0, 3, 4, nullptr, nullptr, y.data());  // no rows: nothing touched
  EXPECT_EQ(y[0], 7.0f);
  Linear(2, 3, 0, nullptr, nullptr, y.data());  // K = 0: the product is zero
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST(Gemm, TransposedStridedViews) {
  const int M = 5, N = 6, K = 7, lda = 9, ldb = 11, ldc = 8;
  auto A = Random(K * lda, 4), B = Random(K * ldb, 5);
  std::vector<float> C(M * ldc, 0.0f);
  // C = Aᵀ·B with A stored [K, lda] and B [K, ldb].
  Gemm(true, false, M, N, K, 2.0f, A.data(), lda, B.data(), ldb, 0.0f, C.data(), ldc);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += 2.0 * A[k * lda + i] * B[k * ldb + j];
      EXPECT_NEAR(C[i * ldc + j], ref, 1e-4);
    }
}

}  // namespace
}  // namespace k3::cpu
