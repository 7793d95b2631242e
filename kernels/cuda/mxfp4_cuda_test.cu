// The MXFP4 grouped experts against the CPU reference on the exactly dequantized weights: odd widths,
// T = 1, empty batches, pairs routed elsewhere, experts with more tokens than one pass holds.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kernels/cpu/experts.h"
#include "kernels/cpu/mxfp4.h"
#include "kernels/cuda/mxfp4.cuh"
#include "kernels/cuda/testing.cuh"
#include "tests/testing.h"

namespace k3::cuda {
namespace {

using k3::testing::RelDiff;

// One expert matrix [rows, cols]: random codes, scales 2^(base−127) .. 2^(base−123), its fp32 dequantization
// and its fragment-order upload.
struct Matrix {
  std::vector<uint8_t> packed, scale;
  std::vector<float> f32;
  std::unique_ptr<DeviceBuffer<uint8_t>> codes, scales;
  Matrix(int64_t rows, int64_t cols, int base, std::mt19937& rng)
      : packed(rows * cols / 2), scale(rows * cols / 32), f32(rows * cols) {
    for (auto& b : packed) b = static_cast<uint8_t>(rng());
    for (auto& s : scale) s = static_cast<uint8_t>(base + rng() % 5);
    cpu::DequantizeMxfp4({packed.data(), scale.data()}, cols, 0, rows, f32.data());
    std::vector<uint8_t> c(Mxfp4CodeBytes(rows, cols)), s(Mxfp4ScaleBytes(rows, cols));
    Mxfp4ToFragments(packed.data(), scale.data(), rows, cols, c.data(), s.data());
    codes = std::make_unique<DeviceBuffer<uint8_t>>(c);
    scales = std::make_unique<DeviceBuffer<uint8_t>>(s);
  }
};

struct Case {
  int64_t N, D, I, E, k;
  int scale_base = 120;  // 126: scales on both sides of 2^1, the kernel's two dequantization paths
};

class Mxfp4ExpertsTest : public ::testing::TestWithParam<Case> {};

TEST_P(Mxfp4ExpertsTest, MatchesCpuReferenceOnDequantizedWeights) {
  REQUIRE_GPU();
  const auto [N, D, I, E, k, base] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(N * 131 + D + I + E));
  std::vector<std::unique_ptr<Matrix>> m1, m3, m2;
  std::vector<const uint8_t*> h1, hs1, h3, hs3, h2, hs2;
  std::vector<cpu::ExpertWeights> cpu_experts(E);
  for (int64_t e = 0; e < E; ++e) {
    m1.push_back(std::make_unique<Matrix>(I, D, base, rng));
    m3.push_back(std::make_unique<Matrix>(I, D, base, rng));
    m2.push_back(std::make_unique<Matrix>(D, I, base - 6, rng));  // keeps the outputs O(1)
    h1.push_back(m1.back()->codes->get()), hs1.push_back(m1.back()->scales->get());
    h3.push_back(m3.back()->codes->get()), hs3.push_back(m3.back()->scales->get());
    h2.push_back(m2.back()->codes->get()), hs2.push_back(m2.back()->scales->get());
    cpu_experts[e] = {m1.back()->f32.data(), m3.back()->f32.data(), m2.back()->f32.data()};
  }
  DeviceBuffer<const uint8_t*> p1(h1), ps1(hs1), p3(h3), ps3(hs3), p2(h2), ps2(hs2);
  auto x = k3::testing::Random(N * D, 5, 1.0f);
  const auto xb = ToBf16(x);
  std::vector<int32_t> idx(N * k);
  std::vector<float> w(N * k);
  for (int64_t i = 0; i < N * k; ++i) {
    // Skewed: expert 0 gets about half the pairs (more than one pass of 64 tokens in the larger cases).
    idx[i] = rng() % 2 == 0 ? 0 : static_cast<int32_t>(rng() % E);
    w[i] = 0.1f + 0.9f * (rng() % 1000) / 1000.0f;
  }
  if (N * k > 3) idx[1] = -1, idx[N * k - 1] = -1;  // routed elsewhere
  DeviceBuffer<uint16_t> dx(xb);
  DeviceBuffer<int32_t> didx(idx);
  DeviceBuffer<float> dw(w);
  DeviceBuffer<uint16_t> out(N * D);
  Mxfp4Workspace ws;
  CUDA_OK(ws.Reserve(N * k, D, I, E));
  Mxfp4ExpertsArgs a;
  a.N = N, a.D = D, a.I = I, a.top_k = k, a.num_experts = E;
  a.x = dx.bf(), a.idx = didx.get(), a.w = dw.get();
  a.w1 = p1.get(), a.s1 = ps1.get(), a.w3 = p3.get(), a.s3 = ps3.get(), a.w2 = p2.get(), a.s2 = ps2.get();
  a.act = GluAct::kSitu;
  a.out = out.bf();
  CUDA_OK(Mxfp4Experts(a, ws, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto got_bits = out.ToHost();
  std::vector<float> got(N * D), ref(N * D);
  for (int64_t i = 0; i < N * D; ++i) got[i] = Bf16ToFloat(got_bits[i]);
  cpu::MoeExperts(N, D, I, k, x.data(), idx.data(), w.data(), E, cpu_experts.data(), {cpu::GluAct::kSitu, 4.0f, 25.0f},
                  ref.data());
  // bf16 rounding of h and of each expert's output (2^−9 relative) is all that separates them.
  EXPECT_LT(RelDiff(got, ref), 1e-2) << "N=" << N << " D=" << D << " I=" << I << " E=" << E << " k=" << k
                                     << " scales from " << base;
  // Reproducible run to run.
  CUDA_OK(Mxfp4Experts(a, ws, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(out.ToHost(), got_bits);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Mxfp4ExpertsTest,
                         ::testing::Values(Case{1, 32, 32, 1, 1}, Case{0, 64, 64, 4, 2}, Case{5, 96, 160, 7, 2},
                                           Case{130, 64, 96, 3, 2}, Case{37, 256, 128, 16, 4}, Case{300, 128, 224, 5, 3},
                                           Case{3, 3584, 3072, 2, 2}, Case{21, 128, 96, 4, 2, 126}));

}  // namespace
}  // namespace k3::cuda
