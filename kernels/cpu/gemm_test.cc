#include "kernels/cpu/gemm.h"

#include <gtest/gtest.h>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

TEST(Linear, MatchesReferenceOnOddShapes) {
  // M = 1 and odd M (the single-row blocks), N off the blocks of 3 and 4, K off the 8 lanes, K = 1, long K.
  for (auto [M, N, K] : {std::tuple{1, 1, 1}, {1, 4, 8}, {1, 7, 13}, {2, 5, 9}, {3, 7, 13}, {5, 3, 129}, {8, 64, 128},
                         {17, 65, 17}, {33, 65, 17}, {64, 128, 256}, {200, 1, 31}, {4, 256, 1024}, {2, 9, 4099}}) {
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

TEST(Linear, ARowDoesNotDependOnTheRowsBesideIt) {
  // 7 rows: blocks of four and single rows; 30 rows of K 1031: chunks of 28 rows and a last chunk of two.
  for (auto [M, N, K] : {std::tuple{7, 13, 301}, {30, 10, 1031}}) {
    auto x = Random(M * K, 4), W = Random(N * K, 5);
    std::vector<float> all(M * N);
    Linear(M, N, K, x.data(), W.data(), all.data());
    for (int m = 0; m < M; ++m) {
      std::vector<float> one(N);
      Linear(1, N, K, x.data() + m * K, W.data(), one.data());
      for (int n = 0; n < N; ++n) EXPECT_EQ(all[m * N + n], one[n]) << "row " << m << " column " << n;
    }
    // Nor on the columns beside it: a column range of W gives the same bits, written with a row stride.
    std::vector<float> part(M * N, -1.0f);
    LinearStrided(M, 6, K, x.data(), W.data() + 3 * K, part.data() + 3, N);
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) EXPECT_EQ(part[m * N + n], n >= 3 && n < 9 ? all[m * N + n] : -1.0f);
  }
}

TEST(Linear, PlainEqualsTheVectorPathBitForBit) {
  for (auto [M, N, K] : {std::tuple{1, 1, 1}, {3, 7, 13}, {8, 64, 128}, {5, 9, 1031}}) {
    auto x = Random(M * K, 6), W = Random(N * K, 7), y0 = Random(M * N, 8);
    for (float beta : {0.0f, 1.0f}) {
      std::vector<float> y = y0, plain = y0;
      LinearStrided(M, N, K, x.data(), W.data(), y.data(), N, beta);
      LinearPlain(M, N, K, x.data(), W.data(), plain.data(), N, beta);
      EXPECT_EQ(y, plain) << M << "x" << N << "x" << K << " beta " << beta;
    }
  }
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
