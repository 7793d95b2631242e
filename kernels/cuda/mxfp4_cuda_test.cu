// The MXFP4 grouped experts against the CPU reference on the exactly dequantized weights: odd widths,
// T = 1, empty batches, pairs routed elsewhere, experts with more tokens than one pass holds, plain bf16 x and
// split x (hi + lo planes, fp32 out), Kimi-Linear and K3 latent widths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <vector>

#include "common/bf16.h"
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
  bool split = false;    // x as split planes, out_f32
  int scale_base = 120;  // 126: scales on both sides of 2^1, the kernel's two dequantization paths
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "N" << c.N << " D" << c.D << " I" << c.I << " E" << c.E << " k" << c.k << (c.split ? " split" : "")
      << " scales from " << c.scale_base;
}

class Mxfp4ExpertsTest : public ::testing::TestWithParam<Case> {};

TEST_P(Mxfp4ExpertsTest, MatchesCpuReferenceOnDequantizedWeights) {
  REQUIRE_GPU();
  const auto [N, D, I, E, k, split, base] = GetParam();
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
  const auto xb = split ? ToSplitPlanes(x) : ToBf16(x);  // x becomes what the GPU sees
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
  std::vector<float> ref(N * D);
  cpu::MoeExperts(N, D, I, k, x.data(), idx.data(), w.data(), E, cpu_experts.data(), {cpu::GluAct::kSitu, 4.0f, 25.0f},
                  ref.data());
  std::vector<bool> used(E, false);
  for (int32_t e : idx)
    if (e >= 0) used[e] = true;
  // Every path: the direct kernels, the grouped wgmma experts dequantizing on chip (plain x), and the bf16 copy
  // (its workspace reserved for enough pairs per expert) under our bf16 grouped experts.
  for (Mxfp4Gemm gemm : {Mxfp4Gemm::kDirect, Mxfp4Gemm::kWgmma, Mxfp4Gemm::kDequant}) {
    if (gemm == Mxfp4Gemm::kWgmma && split) continue;
    DeviceBuffer<uint16_t> out(N * D);
    DeviceBuffer<float> out_f32(N * D);
    DeviceBuffer<int32_t> hit(1);
    CUDA_OK(cudaMemset(hit.get(), 0xFF, sizeof(int32_t)));
    Mxfp4Workspace ws;
    const bool dequant = gemm == Mxfp4Gemm::kDequant;
    const int64_t min_pairs = dequant                       ? kMxfp4DequantMinPairsPerExpert * E
                              : gemm == Mxfp4Gemm::kWgmma ? kMxfp4WgmmaMinPairsPerExpert * E
                                                          : 0;
    CUDA_OK(ws.Reserve(std::max(N * k, min_pairs), D, I, E, dequant, gemm == Mxfp4Gemm::kWgmma));
    Mxfp4ExpertsArgs a;
    a.gemm = gemm;
    a.N = N, a.D = D, a.I = I, a.top_k = k, a.num_experts = E;
    a.x = dx.bf(), a.idx = didx.get(), a.w = dw.get();
    a.w1 = p1.get(), a.s1 = ps1.get(), a.w3 = p3.get(), a.s3 = ps3.get(), a.w2 = p2.get(), a.s2 = ps2.get();
    a.act = GluAct::kSitu;
    a.experts_hit = hit.get();
    if (split) {
      a.x_lo = N * D, a.out_f32 = out_f32.get();
    } else {
      a.out = out.bf();
    }
    CUDA_OK(Mxfp4Experts(a, ws, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto got_bits = out.ToHost();
    const auto got_f32 = out_f32.ToHost();
    std::vector<float> got(N * D);
    for (int64_t i = 0; i < N * D; ++i) got[i] = split ? got_f32[i] : Bf16ToFloat(got_bits[i]);
    // Plain x: bf16 rounding of h and of each expert's output (2^−9 relative) is all that separates them. Split x:
    // both keep 16 bits, and the rest is fp32 summation order.
    EXPECT_LT(RelDiff(got, ref), split ? 1e-4 : 1e-2) << "N=" << N << " D=" << D << " I=" << I << " E=" << E
                                                      << " k=" << k << " split=" << split << " scales from " << base
                                                      << " gemm=" << static_cast<int>(gemm);
    EXPECT_EQ(hit.ToHost()[0], std::count(used.begin(), used.end(), true)) << "gemm=" << static_cast<int>(gemm);
    // Reproducible run to run.
    CUDA_OK(Mxfp4Experts(a, ws, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(out.ToHost(), got_bits);
    EXPECT_EQ(out_f32.ToHost(), got_f32);
  }
}

// Arguments that cannot run are refused: a split x without out_f32, a lo offset off 8 elements, the dequantizing
// The fragment order as the kernels read it, decoded on the host as Dequant does: lane (g, t)'s 8 bytes of block
// (r16, kb) are 64 bits Z; its register j (k16 step j / 4, fragment register j % 4: row g + 8·(j & 1), inputs
// 8t + 4·(j / 4) + 2·((j % 4) / 2) + {0, 1}) is kM & (Z ror o1 ⊕ Z ror o2), whose bf16 halves are E2M1 values
// times 2^−126; times the block's 2^(u − 127) and the row's 2^R they equal cpu::DequantizeMxfp4 bit for bit, on
// every code byte and on rows of scales near 0x00, 0x7F and 0xFE (runs without a GPU).
TEST(Mxfp4Fragments, DecodeAsTheKernelsReadThem) {
  constexpr uint32_t kM = 0x81C081C0u;
  constexpr int kO1[8] = {0, 32, 3, 6, 35, 10, 13, 38};
  constexpr int kO2[8] = {-1, -1, -1, -1, -1, 36, 37, 42};
  const int64_t rows = 48, cols = 96, KB = cols / 32;
  std::mt19937 rng(17);
  std::vector<uint8_t> packed(rows * cols / 2), scale(rows * KB);
  for (size_t i = 0; i < packed.size(); ++i) packed[i] = static_cast<uint8_t>(i < 256 ? i : rng());
  const int kBase[] = {0x00, 0x7F, 0xFE};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < KB; ++kb) {
      const int base = kBase[r % 3];
      scale[r * KB + kb] = static_cast<uint8_t>(base == 0 ? (r + kb) % 5 : base - (r + kb) % 5);
    }
  std::vector<float> ref(rows * cols), got(rows * cols, NAN);
  cpu::DequantizeMxfp4({packed.data(), scale.data()}, cols, 0, rows, ref.data());
  std::vector<uint8_t> codes(Mxfp4CodeBytes(rows, cols)), scales(Mxfp4ScaleBytes(rows, cols));
  ASSERT_EQ(codes.size(), packed.size());
  ASSERT_EQ(scales.size(), scale.size() + rows);
  Mxfp4ToFragments(packed.data(), scale.data(), rows, cols, codes.data(), scales.data());
  auto ror = [](uint64_t z, int o) { return static_cast<uint32_t>(o == 0 ? z : (z >> o) | (z << (64 - o))); };
  for (int64_t r16 = 0; r16 < rows / 16; ++r16)
    for (int64_t kb = 0; kb < KB; ++kb)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        uint64_t z = 0;
        std::memcpy(&z, &codes[((r16 * KB + kb) * 32 + lane) * 8], 8);
        for (int j = 0; j < 8; ++j) {
          const uint32_t v = kM & (ror(z, kO1[j]) ^ (kO2[j] >= 0 ? ror(z, kO2[j]) : 0u));
          const int64_t row = r16 * 16 + g + 8 * (j & 1);
          const int u = scales[(r16 * KB + kb) * 16 + 2 * g + (j & 1)], R = scales[rows * KB + row];
          for (int h = 0; h < 2; ++h) {
            const int64_t k = kb * 32 + 8 * t + 4 * (j / 4) + 2 * ((j % 4) / 2) + h;
            const double code = Bf16ToFloat(static_cast<uint16_t>(v >> (16 * h)));
            got[row * cols + k] = static_cast<float>(code * std::ldexp(1.0, u - 127) * std::ldexp(1.0, R));
          }
        }
      }
  for (int64_t i = 0; i < rows * cols; ++i)
    ASSERT_EQ(got[i], ref[i]) << "row " << i / cols << " col " << i % cols << " scale " << int{scale[i / 32]};
}

// path without its copy, more pairs than reserved.
TEST(Mxfp4ExpertsCuda, RefusesBadArguments) {
  REQUIRE_GPU();
  Mxfp4Workspace ws;
  CUDA_OK(ws.Reserve(8, 64, 64, 2));
  DeviceBuffer<uint16_t> x(2 * 4 * 64), out(4 * 64);
  DeviceBuffer<int32_t> idx(8);
  DeviceBuffer<float> w(8), out_f32(4 * 64);
  DeviceBuffer<const uint8_t*> ptrs(2);
  Mxfp4ExpertsArgs a;
  a.N = 4, a.D = 64, a.I = 64, a.top_k = 2, a.num_experts = 2;
  a.x = x.bf(), a.idx = idx.get(), a.w = w.get();
  a.w1 = a.s1 = a.w3 = a.s3 = a.w2 = a.s2 = ptrs.get();
  a.x_lo = 4 * 64, a.out = out.bf();
  EXPECT_EQ(Mxfp4Experts(a, ws, nullptr), cudaErrorInvalidValue);  // split x, no out_f32
  a.out_f32 = out_f32.get(), a.x_lo = 257;
  EXPECT_EQ(Mxfp4Experts(a, ws, nullptr), cudaErrorInvalidValue);  // lo offset off 8 elements
  a.x_lo = 4 * 64, a.gemm = Mxfp4Gemm::kDequant;
  EXPECT_EQ(Mxfp4Experts(a, ws, nullptr), cudaErrorInvalidValue);  // no bf16 copy reserved
  a.gemm = Mxfp4Gemm::kWgmma;
  EXPECT_EQ(Mxfp4Experts(a, ws, nullptr), cudaErrorInvalidValue);  // the grouped experts take a plain x only
  a.x_lo = 0, a.out_f32 = nullptr;
  EXPECT_EQ(Mxfp4Experts(a, ws, nullptr), cudaErrorInvalidValue);  // ... and their workspace was not reserved
  a.gemm = Mxfp4Gemm::kAuto, a.N = 5;
  EXPECT_EQ(Mxfp4Experts(a, ws, nullptr), cudaErrorInvalidValue);  // 10 pairs, 8 reserved
}

INSTANTIATE_TEST_SUITE_P(Shapes, Mxfp4ExpertsTest,
                         ::testing::Values(Case{1, 32, 32, 1, 1}, Case{0, 64, 64, 4, 2}, Case{5, 96, 160, 7, 2},
                                           Case{130, 64, 96, 3, 2}, Case{37, 256, 128, 16, 4}, Case{300, 128, 224, 5, 3},
                                           Case{3, 3584, 3072, 2, 2}, Case{21, 128, 96, 4, 2, false, 126},
                                           // split x
                                           Case{1, 32, 32, 1, 1, true}, Case{0, 64, 64, 4, 2, true},
                                           Case{1, 3584, 3072, 3, 2, true}, Case{7, 96, 160, 7, 2, true},
                                           Case{131, 64, 96, 3, 2, true}, Case{37, 256, 128, 16, 4, true},
                                           Case{301, 128, 224, 5, 3, true}, Case{21, 128, 96, 4, 2, true, 126},
                                           Case{19, 2304, 1024, 6, 8, true},  // Kimi-Linear widths, k = 8
                                           Case{19, 2304, 1024, 6, 8},
                                           // K3 latent widths, about 45 pairs on expert 0
                                           Case{45, 3584, 3072, 3, 2, true}));

}  // namespace
}  // namespace k3::cuda
