#include "kernels/cpu/mxfp4.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <vector>

#include "kernels/cpu/experts.h"
#include "kernels/cpu/gemm.h"
#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

// The E2M1 table as the OCP MX spec lists it (sign, 2-bit exponent with bias 1, 1-bit mantissa).
const double kTable[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};

// The reference value of (code, scale), evaluated in double and rounded once to fp32.
float Reference(int code, int s) { return static_cast<float>(kTable[code] * std::ldexp(1.0, s - 127)); }

TEST(Mxfp4, EveryNibbleAndScaleBitForBit) {
  // Every code in both nibbles, at the extreme and the unit scales and a spread of others.
  std::vector<int> scales = {0x00, 0x01, 0x7F, 0xFE};
  for (int s = 3; s < 254; s += 17) scales.push_back(s);
  for (int s : scales) {
    // 16 rows of 32 columns: row r holds byte b = r·16 + j at packed column j (codes b & 15, b >> 4).
    const int rows = 16, cols = 32;
    std::vector<uint8_t> packed(rows * cols / 2), scale(rows, static_cast<uint8_t>(s));
    for (int b = 0; b < 256; ++b) packed[b] = static_cast<uint8_t>(b);
    std::vector<float> out(rows * cols);
    DequantizeMxfp4({packed.data(), scale.data()}, cols, 0, rows, out.data());
    for (int b = 0; b < 256; ++b) {
      const int r = b / 16, j = b % 16;
      EXPECT_EQ(std::bit_cast<uint32_t>(out[r * cols + 2 * j]), std::bit_cast<uint32_t>(Reference(b & 15, s)))
          << "byte " << b << " scale " << s << " (low nibble, even column)";
      EXPECT_EQ(std::bit_cast<uint32_t>(out[r * cols + 2 * j + 1]), std::bit_cast<uint32_t>(Reference(b >> 4, s)))
          << "byte " << b << " scale " << s << " (high nibble, odd column)";
    }
  }
  EXPECT_EQ(E8M0Value(0x7F), 1.0f);
  EXPECT_EQ(E8M0Value(0x00), std::ldexp(1.0f, -127));  // subnormal, not flushed
  EXPECT_TRUE(std::isnan(E8M0Value(0xFF)));
}

TEST(Mxfp4, ScalesApplyPerGroupOf32Columns) {
  const int cols = 96;
  std::vector<uint8_t> packed(cols / 2, 0x22), scale = {126, 127, 130};  // every code 2 (= 1.0)
  std::vector<float> out(cols);
  DequantizeMxfp4({packed.data(), scale.data()}, cols, 0, 1, out.data());
  for (int c = 0; c < cols; ++c) EXPECT_EQ(out[c], c < 32 ? 0.5f : c < 64 ? 1.0f : 8.0f) << c;
}

TEST(Mxfp4, QuantizeFollowsTheOcpRule) {
  // A block whose max is 6·2^k is represented exactly: shared exponent k, codes exact.
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(kTable[j % 16] * 0.25);
  std::vector<uint8_t> packed(16), scale(1);
  QuantizeMxfp4(x.data(), 1, 32, packed.data(), scale.data());
  EXPECT_EQ(scale[0], 127 - 2);  // max 1.5 = 1.5·2^0 → floor(log2) 0, minus E2M1's emax 2
  std::vector<float> back(32);
  DequantizeMxfp4({packed.data(), scale.data()}, 32, 0, 1, back.data());
  for (int j = 0; j < 32; ++j) EXPECT_EQ(back[j], x[j]) << j;

  // Ties round to the even code; values above 6·2^e saturate; a zero block gets scale 0.
  std::vector<float> t(64, 0.0f);
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -0.75f, 4.0f};
  const float want[] = {0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f, -1.0f, 4.0f};
  for (int j = 0; j < 9; ++j) t[j] = ties[j];
  t[9] = 7.9f;  // block max 7.9: floor(log2) 2, shared exponent 0; 7.9 saturates to 6
  std::vector<uint8_t> p2(32), s2(2);
  QuantizeMxfp4(t.data(), 1, 64, p2.data(), s2.data());
  EXPECT_EQ(s2[0], 127);
  EXPECT_EQ(s2[1], 0);
  std::vector<float> b2(64);
  DequantizeMxfp4({p2.data(), s2.data()}, 64, 0, 1, b2.data());
  for (int j = 0; j < 9; ++j) EXPECT_EQ(b2[j], want[j]) << ties[j];
  EXPECT_EQ(b2[9], 6.0f);
  for (int j = 32; j < 64; ++j) EXPECT_EQ(b2[j], 0.0f);

  // Random weights: every value within half a step of its code (E2M1's steps are at most 2 units of
  // the scale, 4 → 6); values between 6 and 8 units (the OCP exponent leaves them) saturate to 6.
  auto w = Random(40 * 64, 3, 0.1f);
  std::vector<uint8_t> p3(40 * 32), s3(40 * 2);
  QuantizeMxfp4(w.data(), 40, 64, p3.data(), s3.data());
  std::vector<float> b3(w.size());
  DequantizeMxfp4({p3.data(), s3.data()}, 64, 0, 40, b3.data());
  for (size_t i = 0; i < w.size(); ++i) {
    const float unit = E8M0Value(s3[i / 32]);
    EXPECT_LE(std::fabs(b3[i] - w[i]), std::fabs(w[i]) > 6 * unit ? 2 * unit : unit) << i;
  }
}

// Weights drawn as MXFP4 (random codes, scales around 2^−4) and their exact fp32 dequantization.
struct Mx {
  std::vector<uint8_t> packed, scale;
  std::vector<float> f32;
  Mx(int64_t rows, int64_t cols, uint64_t seed) : packed(rows * cols / 2), scale(rows * cols / 32), f32(rows * cols) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 1;
    auto next = [&] { return (s = s * 6364136223846793005ULL + 1442695040888963407ULL) >> 33; };
    for (auto& b : packed) b = static_cast<uint8_t>(next());
    for (auto& b : scale) b = static_cast<uint8_t>(121 + next() % 5);
    DequantizeMxfp4(m(), cols, 0, rows, f32.data());
  }
  Mxfp4Matrix m() const { return {packed.data(), scale.data()}; }
};

TEST(LinearMxfp4, MatchesFp32ProductOnManyShapes) {
  for (auto [M, N, K] : {std::tuple{1, 1, 32}, {0, 5, 64}, {7, 13, 96}, {3, 300, 160}, {64, 40, 2048}, {1, 257, 3584}}) {
    Mx W(N, K, N + K);
    auto x = Random(M * K, 5);
    std::vector<float> y(M * N), ref(M * N), acc(M * N, 1.0f), acc_ref(M * N, 1.0f);
    LinearMxfp4(M, N, K, x.data(), W.m(), y.data());
    LinearRef(M, N, K, x.data(), W.f32.data(), ref.data());
    EXPECT_LT(RelDiff(y, ref), 1e-5) << M << "x" << N << "x" << K;
    LinearMxfp4(M, N, K, x.data(), W.m(), acc.data(), 1.0f);
    LinearRef(M, N, K, x.data(), W.f32.data(), acc_ref.data(), 1.0f);
    EXPECT_LT(RelDiff(acc, acc_ref), 1e-5) << "beta 1, " << M << "x" << N << "x" << K;
  }
}

TEST(MoeExperts, PackedExpertsMatchTheirFp32Dequantization) {
  const int64_t E = 7, D = 64, I = 96;
  std::vector<Mx> store;
  for (int64_t e = 0; e < E; ++e) {
    store.emplace_back(I, D, 3 * e + 1);
    store.emplace_back(I, D, 3 * e + 2);
    store.emplace_back(D, I, 3 * e + 3);
  }
  std::vector<ExpertWeights> packed(E), fp32(E);
  for (int64_t e = 0; e < E; ++e) {
    const Mx &a = store[3 * e], &b = store[3 * e + 1], &c = store[3 * e + 2];
    packed[e] = {ExpertMatrix(a.m()), ExpertMatrix(b.m()), ExpertMatrix(c.m())};
    fp32[e] = {a.f32.data(), b.f32.data(), c.f32.data()};
  }
  const GluParams p{GluAct::kSitu, 4.0f, 25.0f};
  for (auto [N, k] : {std::pair{0, 2}, {1, 1}, {9, 3}, {33, 4}}) {
    auto x = Random(N * D, 7), w = Random(N * k, 8);
    std::vector<int32_t> idx(N * k);
    for (int64_t i = 0; i < N * k; ++i) idx[i] = static_cast<int32_t>((i * 5 + i / k) % E);
    if (N * k > 3) idx[1] = -1;
    std::vector<float> out(N * D), want(N * D), ref(N * D);
    MoeExperts(N, D, I, k, x.data(), idx.data(), w.data(), E, packed.data(), p, out.data());
    MoeExperts(N, D, I, k, x.data(), idx.data(), w.data(), E, fp32.data(), p, want.data());
    MoeExpertsRef(N, D, I, k, x.data(), idx.data(), w.data(), packed.data(), p, ref.data());
    EXPECT_LT(RelDiff(out, want), 1e-5) << "N=" << N;
    EXPECT_LT(RelDiff(out, ref), 1e-5) << "N=" << N;
  }
}

}  // namespace
}  // namespace k3::cpu
