// The GPU engine's kernels against their CPU references (kernels/cpu), on the same bf16 weights. Activations
// are split bf16 (≈ fp32), so most products agree to fp32 accumulation order; where a kernel rounds to plain
// bf16 on the way (MLA keys and values, bf16 outputs) the tolerance says so.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <optional>
#include <vector>

#include "common/bf16.h"
#include "kernels/cpu/attnres.h"
#include "kernels/cpu/conv.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/mla.h"
#include "kernels/cpu/norm.h"
#include "kernels/cuda/attnres.cuh"
#include "kernels/cuda/conv.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/kda_small.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/lm_head.cuh"
#include "kernels/cuda/mla.cuh"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/sampling.cuh"

#include "kernels/cuda/testing.cuh"

namespace k3::cuda {
namespace {


std::vector<float> Randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}


// Split planes of x [rows, cols]; x becomes hi + lo (what the GPU sees).
std::vector<float> FromSplit(const std::vector<uint16_t>& p, size_t n) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = Bf16ToFloat(p[i]) + Bf16ToFloat(p[n + i]);
  return x;
}

// max |a − b| / max |b|.
double Rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    d = std::max(d, std::fabs(double(a[i]) - b[i]));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return m == 0 ? d : d / m;
}

// ------------------------------------------------------------------------------------------------ Linear

struct LinearCase {
  int64_t M, N, K;
  bool split;
  LinearOut out;
  std::optional<GluAct> act = std::nullopt;  // a GLU product when set
};

// Both implementations (our kernel, cuBLASLt with the stacked split) against a double-precision reference, on
// odd sizes, one row, no rows, every output mode and both GLU activations. `blas_ws` small forces row chunks.
void CheckLinear(const LinearCase& c, bool blas, size_t blas_ws = size_t{64} << 20, int64_t k_parts = 1) {
  const bool glu = c.act.has_value();
  const int64_t cols = glu ? c.N / 2 : c.N;
  std::vector<float> w = Randn(c.N * c.K, 1, 1.0f / std::sqrt(float(c.K))), x = Randn(c.M * c.K, 2);
  const std::vector<uint16_t> wb = ToBf16(w);
  const std::vector<uint16_t> xs = c.split ? ToSplitPlanes(x) : ToBf16(x);
  std::vector<float> y0 = Randn(c.M * cols, 3), ref(c.M * cols);
  for (int64_t m = 0; m < c.M; ++m) {
    std::vector<double> dot(c.N);
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t k = 0; k < c.K; ++k) dot[n] += double(w[n * c.K + k]) * x[m * c.K + k];
    for (int64_t n = 0; n < cols; ++n) {
      double v = dot[n];
      if (glu) {
        const double g = dot[n], u = dot[n + cols], sig = 1.0 / (1.0 + std::exp(-g));
        v = c.act == GluAct::kSilu ? g * sig * u : 4.0 * std::tanh(g / 4.0) * sig * 25.0 * std::tanh(u / 25.0);
      }
      ref[m * cols + n] = static_cast<float>(v + (c.out == LinearOut::kF32Add ? y0[m * cols + n] : 0.0));
    }
  }
  DeviceBuffer<uint16_t> dw(wb), dx(xs), dyb(2 * c.M * cols + 4);
  DeviceBuffer<float> dy(y0);
  LinearArgs a;
  a.N = c.N, a.K = c.K, a.w = dw.bf(), a.glu = glu, a.act = c.act.value_or(GluAct::kSilu), a.k_parts = k_parts;
  a.x = Split{dx.bf(), c.K, c.split ? c.M * c.K : 0};
  const bool f32 = c.out == LinearOut::kF32 || c.out == LinearOut::kF32Add;
  a.y = f32 ? static_cast<void*>(dy.get()) : static_cast<void*>(dyb.get());
  // The lo plane off 16-byte alignment (odd N) or on it: both store paths of the fold.
  a.ldy = cols, a.y_lo = c.M * cols + (c.N % 2 ? 1 : 4), a.out = c.out, a.M = c.M;
  if (blas) {
    LinearBlas lb;
    CUDA_OK(lb.Init(blas_ws));
    CUDA_OK(lb.Run(a, nullptr));
  } else {
    CUDA_OK(Linear(a, nullptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got;
  if (f32) {
    got = dy.ToHost();
  } else {
    const auto h = dyb.ToHost();
    for (int64_t i = 0; i < c.M * cols; ++i)
      got.push_back(Bf16ToFloat(h[i]) + (c.out == LinearOut::kSplit ? Bf16ToFloat(h[a.y_lo + i]) : 0.0f));
  }
  const double tol = c.out == LinearOut::kBf16 ? 8e-3 : c.split ? 2e-5 : 2e-5;
  EXPECT_LT(Rel(got, ref), tol) << (blas ? "LinearBlas" : "Linear") << " M " << c.M << " N " << c.N << " K " << c.K
                                << " act " << (glu ? int(*c.act) : -1) << " k_parts " << k_parts;
}

const LinearCase kLinearCases[] = {
    {1, 64, 64, true, LinearOut::kF32},         {70, 100, 80, true, LinearOut::kF32},
    {9, 37, 48, false, LinearOut::kF32},        {130, 256, 384, true, LinearOut::kF32Add},
    {64, 192, 2304, true, LinearOut::kSplit},   {5, 40, 32, true, LinearOut::kBf16},
    {0, 64, 64, true, LinearOut::kF32},         {33, 96, 160, true, LinearOut::kSplit, GluAct::kSilu},
    {1, 2 * 48, 128, true, LinearOut::kSplit, GluAct::kSitu}, {200, 2 * 40, 64, false, LinearOut::kF32, GluAct::kSitu},
};

TEST(LinearCuda, KernelMatchesReference) {
  REQUIRE_GPU();
  for (const LinearCase& c : kLinearCases) CheckLinear(c, false);
  CheckLinear({600, 3000, 256, true, LinearOut::kSplit}, false);  // a grid large enough for 64-token passes
}

// y = x · Wᵀ (fp32) of the first `rows` rows of the split planes x_all ([M, K], lo plane M·K on) as a batch of
// their own (lo plane rows·K on), through `run` (Linear or a LinearBlas).
template <class Run>
std::vector<float> FirstRowsAlone(const std::vector<uint16_t>& x_all, int64_t M, int64_t K, int64_t rows,
                                  int64_t N, const __nv_bfloat16* w, Run run) {
  std::vector<uint16_t> planes(2 * rows * K);
  std::copy_n(x_all.begin(), rows * K, planes.begin());
  std::copy_n(x_all.begin() + M * K, rows * K, planes.begin() + rows * K);
  DeviceBuffer<uint16_t> xb(planes);
  DeviceBuffer<float> y(rows * N);
  LinearArgs a;
  a.N = N, a.K = K, a.w = w, a.x = Split{xb.bf(), K, rows * K}, a.y = y.get(), a.ldy = N, a.M = rows;
  EXPECT_EQ(run(a), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return y.ToHost();
}

TEST(LinearCuda, BlasMatchesReference) {
  REQUIRE_GPU();
  for (const LinearCase& c : kLinearCases) CheckLinear(c, true);
  for (const int64_t parts : {2, 3, 0})  // K in slices, the fold adding them (and applying the GLU)
    for (const LinearCase& c : kLinearCases)
      if (parts == 0 || (c.K % parts == 0 && c.K / parts % 16 == 0)) CheckLinear(c, true, size_t{64} << 20, parts);
  // A workspace of a few rows: the rows run in chunks.
  CheckLinear({130, 256, 384, true, LinearOut::kF32Add}, true, LinearBlas::WorkspaceBytes(7, 256, 384));
  CheckLinear({45, 2 * 96, 256, true, LinearOut::kSplit, GluAct::kSilu}, true, LinearBlas::WorkspaceBytes(3, 192, 256));
  CheckLinear({45, 2 * 96, 256, true, LinearOut::kSplit, GluAct::kSilu}, true,
              LinearBlas::WorkspaceBytes(3, 192, 256, 2), 2);
}

// RunUnfolded leaves the sums the fold reads: hi row + lo row is the folded kF32 output bit for bit (split x), the
// row itself for a plain x; refused for a GLU or rows that need chunks.
TEST(LinearCuda, BlasUnfoldedSumsAreTheFold) {
  REQUIRE_GPU();
  const int64_t M = 37, N = 100, K = 256;
  std::vector<float> w = Randn(N * K, 50, 0.05f), x = Randn(M * K, 51);
  DeviceBuffer<uint16_t> dw(ToBf16(w)), dx(ToSplitPlanes(x));
  DeviceBuffer<float> dy(M * N);
  for (const bool split : {true, false}) {
    LinearBlas lb;
    CUDA_OK(lb.Init(LinearBlas::WorkspaceBytes(M, N, K)));
    LinearArgs a;
    a.N = N, a.K = K, a.w = dw.bf(), a.x = Split{dx.bf(), K, split ? M * K : 0}, a.M = M;
    a.y = dy.get(), a.ldy = N, a.out = LinearOut::kF32;
    CUDA_OK(lb.Run(a, nullptr));
    a.y = nullptr;
    ASSERT_TRUE(lb.Unfoldable(a));
    Sums sums;
    CUDA_OK(lb.RunUnfolded(a, nullptr, &sums));
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(sums.lo_rows, split ? M : 0);
    ASSERT_GE(sums.ld, N);
    std::vector<float> C((M + sums.lo_rows) * sums.ld);
    CUDA_OK(cudaMemcpy(C.data(), sums.p, C.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const std::vector<float> y = dy.ToHost();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c) {
        const float v = split ? C[r * sums.ld + c] + C[(r + M) * sums.ld + c] : C[r * sums.ld + c];
        ASSERT_EQ(v, y[r * N + c]) << "split " << split << " row " << r << " col " << c;
      }
    // Fold alone, on columns 3.. of the sums (not on 16 bytes: the scalar loads), gives those columns of y.
    DeviceBuffer<float> dcols(M * (N - 3));
    LinearArgs cols;
    cols.N = N - 3, cols.M = M, cols.y = dcols.get(), cols.ldy = N - 3, cols.out = LinearOut::kF32;
    CUDA_OK(LinearBlas::Fold(cols, Sums{sums.p + 3, sums.ld, sums.lo_rows}, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got_cols = dcols.ToHost();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 3; c < N; ++c) ASSERT_EQ(got_cols[r * (N - 3) + c - 3], y[r * N + c]) << "Fold, col " << c;
    cols.glu = true;
    EXPECT_EQ(LinearBlas::Fold(cols, sums, nullptr), cudaErrorInvalidValue);  // the GLU is Run's
    LinearArgs glu = a;
    glu.glu = true;
    EXPECT_FALSE(lb.Unfoldable(glu));
    EXPECT_EQ(lb.RunUnfolded(glu, nullptr, &sums), cudaErrorInvalidValue);
  }
  LinearBlas small;  // room for chunks of 4 rows
  CUDA_OK(small.Init(LinearBlas::WorkspaceBytes(4, N, K)));
  LinearArgs a;
  a.N = N, a.K = K, a.w = dw.bf(), a.x = Split{dx.bf(), K, M * K}, a.M = M;
  Sums sums;
  EXPECT_FALSE(small.Unfoldable(a));
  EXPECT_EQ(small.RunUnfolded(a, nullptr, &sums), cudaErrorInvalidValue);
}

// K in slices (k_parts): each part is its slice's product (double reference), Run's fold and LinearBlas::Fold add
// the parts in order as the sums' consumers do (bit for bit: AddRmsNorm on the parts against AddRmsNorm on the folded
// rows, by the 16-byte and the scalar kernels), for a split and a plain x, odd rows, one row and none; k_parts = 0
// picks a count that divides K; too many, counts that do not divide K into multiples of 16, a GLU or groups are
// refused.
TEST(LinearCuda, BlasKPartsAddUpInOrder) {
  REQUIRE_GPU();
  const int64_t N = 100, K = 384;
  std::vector<float> w = Randn(N * K, 52, 0.05f);
  DeviceBuffer<uint16_t> dw(ToBf16(w));
  for (const int64_t M : {37, 1, 0})
    for (const bool split : {true, false})
      for (const int64_t parts : {2, 3, 4, 0}) {
        const std::string what =
            "M " + std::to_string(M) + " split " + std::to_string(split) + " k_parts " + std::to_string(parts);
        std::vector<float> x = Randn(M * K, 53);
        std::vector<uint16_t> planes = split ? ToSplitPlanes(x) : ToBf16(x);  // x: what the product sees
        planes.resize(std::max<size_t>(planes.size(), 8));
        DeviceBuffer<uint16_t> dx(planes);
        DeviceBuffer<float> dy(std::max<int64_t>(M * N, 1)), dcols(std::max<int64_t>(M * N, 1));
        LinearBlas lb;
        CUDA_OK(lb.Init(LinearBlas::WorkspaceBytes(std::max<int64_t>(M, 1), N, K, kMaxSumParts)));
        LinearArgs a;
        a.N = N, a.K = K, a.w = dw.bf(), a.x = Split{dx.bf(), K, split ? M * K : 0}, a.M = M, a.k_parts = parts;
        a.y = dy.get(), a.ldy = N, a.out = LinearOut::kF32;
        CUDA_OK(lb.Run(a, nullptr));
        ASSERT_EQ(lb.Unfoldable(a), M > 0) << what;
        Sums sums;
        if (M == 0) {
          EXPECT_EQ(lb.RunUnfolded(a, nullptr, &sums), cudaErrorInvalidValue) << what;  // nothing to unfold
          continue;
        }
        CUDA_OK(lb.RunUnfolded(a, nullptr, &sums));
        CUDA_OK(cudaDeviceSynchronize());
        const int64_t P = sums.parts;
        ASSERT_TRUE(parts == 0 ? P >= 1 && K % P == 0 && (K / P) % 16 == 0 : P == parts) << what << " parts " << P;
        ASSERT_EQ(sums.lo_rows, split ? M : 0) << what;
        std::vector<float> C((P - 1) * sums.part_stride + (M + sums.lo_rows) * sums.ld);
        CUDA_OK(cudaMemcpy(C.data(), sums.p, C.size() * sizeof(float), cudaMemcpyDeviceToHost));
        const int64_t Kc = K / P;
        std::vector<float> folded(M * N), got_part(M * N), ref_part(M * N);
        for (int64_t k = 0; k < P; ++k) {
          for (int64_t r = 0; r < M; ++r)
            for (int64_t c = 0; c < N; ++c) {
              const float* q = C.data() + k * sums.part_stride + r * sums.ld + c;
              const float v = split ? q[0] + q[M * sums.ld] : q[0];
              folded[r * N + c] = k == 0 ? v : folded[r * N + c] + v;
              got_part[r * N + c] = v;
              double dot = 0;
              for (int64_t i = k * Kc; i < (k + 1) * Kc; ++i) dot += double(w[c * K + i]) * x[r * K + i];
              ref_part[r * N + c] = static_cast<float>(dot);
            }
          EXPECT_LT(Rel(got_part, ref_part), 2e-5) << what << " part " << k;
        }
        EXPECT_EQ(dy.ToHost(), folded) << "Run's fold, " << what;
        LinearArgs cols;
        cols.N = N, cols.M = M, cols.y = dcols.get(), cols.ldy = N, cols.out = LinearOut::kF32;
        CUDA_OK(LinearBlas::Fold(cols, sums, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        EXPECT_EQ(dcols.ToHost(), folded) << "Fold, " << what;
        // AddRmsNorm over the parts and over the folded rows: D = 100 (16-byte kernel) and 99 (scalar).
        for (const int64_t D : {N, N - 1}) {
          const std::vector<float> x0 = Randn(M * D, 54, 2.0f), g = Randn(D, 55);
          DeviceBuffer<float> dx0(x0), dx1(x0), dg(g), dfold(folded);
          DeviceBuffer<uint16_t> y0(2 * M * D), y1(2 * M * D);
          CUDA_OK(AddRmsNorm(M, D, dx0.get(), D, sums, {}, nullptr, dg.get(), 1e-5f, Split{y0.bf(), D, M * D},
                             nullptr));
          CUDA_OK(AddRmsNorm(M, D, dx1.get(), D, Sums{dfold.get(), N, 0}, {}, nullptr, dg.get(), 1e-5f,
                             Split{y1.bf(), D, M * D}, nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          EXPECT_EQ(dx0.ToHost(), dx1.ToHost()) << "AddRmsNorm's x, D " << D << ", " << what;
          EXPECT_EQ(y0.ToHost(), y1.ToHost()) << "AddRmsNorm's y, D " << D << ", " << what;
        }
      }
  LinearBlas lb;
  CUDA_OK(lb.Init(LinearBlas::WorkspaceBytes(8, N, K, kMaxSumParts)));
  DeviceBuffer<uint16_t> dx(2 * 8 * K);
  DeviceBuffer<float> dy(8 * N);
  LinearArgs a;
  a.N = N, a.K = K, a.w = dw.bf(), a.x = Split{dx.bf(), K, 8 * K}, a.M = 8, a.y = dy.get(), a.ldy = N;
  for (const auto& [k, bad] : {std::pair<int64_t, int64_t>{384, kMaxSumParts + 1}, {384, -1}, {400, 3}, {400, 2}}) {
    a.K = k, a.k_parts = bad;  // more than kMaxSumParts, negative, not dividing K, slices not a multiple of 16
    EXPECT_EQ(lb.Run(a, nullptr), cudaErrorInvalidValue) << "K " << k << " k_parts " << bad;
  }
  a.K = K;
  a.k_parts = 2, a.glu = true;
  Sums sums;
  EXPECT_EQ(lb.RunUnfolded(a, nullptr, &sums), cudaErrorInvalidValue) << "a GLU's sums";
  a.glu = false, a.groups = 2, a.x_group_stride = 0;
  EXPECT_EQ(lb.Run(a, nullptr), cudaErrorInvalidValue) << "groups in parts";
  Sums many{dy.get(), N, 0, kMaxSumParts + 1, N};
  DeviceBuffer<uint16_t> y(2 * N);
  EXPECT_EQ(AddRmsNorm(1, N, dy.get(), N, many, {}, nullptr, nullptr, 1e-5f, Split{y.bf(), N, N}, nullptr),
            cudaErrorInvalidValue);
  LinearBlas small;  // room for 8 rows of two parts, not of kMaxSumParts
  CUDA_OK(small.Init(LinearBlas::WorkspaceBytes(8, N, K, 2)));
  a.groups = 1, a.k_parts = 2;
  EXPECT_TRUE(small.Unfoldable(a));
  a.k_parts = 0;
  EXPECT_FALSE(small.Unfoldable(a));
}

// Groups on LinearBlas (one strided batch: MLA's per-head products) against a double reference: 5 groups of a
// 40 × 96 product over column slices of a split x, plain fp32 and split outputs, odd rows; an x whose lo plane is
// not right after its rows (not usable in place) is refused.
TEST(LinearCuda, BlasGroupsMatchReference) {
  REQUIRE_GPU();
  const int64_t G = 5, N = 40, K = 96, M = 13, xgs = 104, ld = G * xgs;
  std::vector<float> w = Randn(G * N * K, 60, 0.1f), x = Randn(M * ld, 61);
  const std::vector<uint16_t> wb = ToBf16(w), xs = ToSplitPlanes(x);  // x becomes hi + lo
  std::vector<float> ref(M * G * N);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double dot = 0;
        for (int64_t k = 0; k < K; ++k) dot += double(Bf16ToFloat(wb[(g * N + n) * K + k])) * x[m * ld + g * xgs + k];
        ref[m * G * N + g * N + n] = static_cast<float>(dot);
      }
  DeviceBuffer<uint16_t> dw(wb), dx(xs), dys(2 * M * G * N);
  DeviceBuffer<float> dy(M * G * N);
  LinearBlas lb;
  CUDA_OK(lb.Init(LinearBlas::WorkspaceBytes(M, N, K, G)));
  LinearArgs a;
  a.N = N, a.K = K, a.w = dw.bf(), a.w_group_stride = N * K, a.x = Split{dx.bf(), ld, M * ld}, a.x_group_stride = xgs;
  a.y = dy.get(), a.ldy = G * N, a.y_group_stride = N, a.out = LinearOut::kF32, a.groups = G, a.M = M;
  CUDA_OK(lb.Run(a, nullptr));
  LinearArgs as = a;
  as.y = dys.get(), as.y_lo = M * G * N, as.out = LinearOut::kSplit;
  CUDA_OK(lb.Run(as, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(Rel(dy.ToHost(), ref), 2e-5);
  EXPECT_LT(Rel(FromSplit(dys.ToHost(), M * G * N), ref), 2e-5);
  LinearArgs moved = a;
  moved.x.lo = M * ld + 8;
  EXPECT_EQ(lb.Run(moved, nullptr), cudaErrorInvalidValue);
}

// A row's output does not depend on the other rows of the batch (the engine's batched == alone): on Linear,
// whose pass size follows the grid (16 tokens up to a few rows, 64 at M), and on LinearBlas.
TEST(LinearCuda, RowsAreBatchInvariant) {
  REQUIRE_GPU();
  const int64_t N = 3000, K = 4096, M = 600;  // long K: where cuBLASLt's heuristic would vary its split per M
  std::vector<float> w = Randn(N * K, 21, 0.02f), x = Randn(M * K, 22);
  DeviceBuffer<uint16_t> dw(ToBf16(w));
  const std::vector<uint16_t> planes = ToSplitPlanes(x);
  LinearBlas lb;
  CUDA_OK(lb.Init(LinearBlas::WorkspaceBytes(M, N, K)));
  for (const bool blas : {false, true}) {
    auto run = [&](const LinearArgs& a) { return blas ? lb.Run(a, nullptr) : Linear(a, nullptr); };
    std::vector<std::vector<float>> outs;
    for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{64}, M})
      outs.push_back(FirstRowsAlone(planes, M, K, rows, N, dw.bf(), run));
    for (size_t i = 0; i + 1 < outs.size(); ++i)
      for (size_t j = 0; j < outs[i].size(); ++j)
        ASSERT_EQ(outs[i][j], outs.back()[j]) << (blas ? "LinearBlas" : "Linear") << " batch " << i << " element " << j;
  }
}

// ------------------------------------------------------------------------------------------------ LM head

// LmHead against a double-precision reference on plain bf16 x (the hi plane of a split x; its lo plane must not
// be read): odd vocabularies and K (the tensor maps' zero fill), one row, no rows, several 64-row passes; the
// keys' picks are the first maxima of the logits it wrote, and the keys alone give the same picks.
TEST(LmHeadCuda, MatchesReferenceAndPicksTheFirstMax) {
  REQUIRE_GPU();
  struct Case { int64_t V, K, M; };
  for (const Case c : {Case{1000, 64, 1}, Case{257, 200, 17}, Case{300, 2304, 64}, Case{513, 128, 130},
                       Case{40000, 96, 3}, Case{77, 8, 65}, Case{256, 64, 0}}) {
    std::vector<float> w = Randn(c.V * c.K, 31, 1.0f / std::sqrt(float(c.K))), x = Randn(c.M * c.K, 32);
    const std::vector<uint16_t> wb = ToBf16(w), xs = ToSplitPlanes(x);  // x: hi + lo
    std::vector<float> hi(c.M * c.K);
    for (int64_t i = 0; i < c.M * c.K; ++i) hi[i] = Bf16ToFloat(xs[i]);
    std::vector<float> ref(c.M * c.V);
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t v = 0; v < c.V; ++v) {
        double dot = 0;
        for (int64_t k = 0; k < c.K; ++k) dot += double(w[v * c.K + k]) * hi[m * c.K + k];
        ref[m * c.V + v] = static_cast<float>(dot);
      }
    DeviceBuffer<uint16_t> dw(wb), dx(xs);
    DeviceBuffer<float> dl(std::vector<float>(c.M * c.V + 1, NAN));
    DeviceBuffer<uint64_t> keys(std::vector<uint64_t>(std::max<int64_t>(c.M, 1), 0)),
        keys_only(std::vector<uint64_t>(std::max<int64_t>(c.M, 1), 0));
    DeviceBuffer<int32_t> ids(std::max<int64_t>(c.M, 1)), ids_only(std::max<int64_t>(c.M, 1));
    LmHeadArgs a;
    a.V = c.V, a.K = c.K, a.w = dw.bf(), a.x = Split{dx.bf(), c.K, c.M * c.K}, a.M = c.M;
    a.logits = dl.get(), a.ldl = c.V, a.argmax_keys = keys.get();
    CUDA_OK(LmHead(a, nullptr));
    a.logits = nullptr, a.argmax_keys = keys_only.get();
    CUDA_OK(LmHead(a, nullptr));
    CUDA_OK(ArgmaxIds(c.M, keys.get(), ids.get(), nullptr));
    CUDA_OK(ArgmaxIds(c.M, keys_only.get(), ids_only.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got = dl.ToHost();
    got.resize(c.M * c.V);
    EXPECT_LT(Rel(got, ref), 2e-5) << "V " << c.V << " K " << c.K << " M " << c.M;
    const auto picks = ids.ToHost();
    for (int64_t m = 0; m < c.M; ++m) {
      const auto row = got.begin() + m * c.V;
      EXPECT_EQ(picks[m], std::max_element(row, row + c.V) - row) << "row " << m << " V " << c.V;
    }
    if (c.M > 0) EXPECT_EQ(ids_only.ToHost(), picks) << "keys without logits, V " << c.V;
    for (const uint64_t k : keys.ToHost()) EXPECT_EQ(k, 0u) << "ArgmaxIds clears the keys it reads";
  }
  // Rows are batch invariant: the first rows alone give the same logits bit for bit.
  const int64_t V = 5000, K = 2304, M = 130;
  std::vector<float> w = Randn(V * K, 33, 0.02f), x = Randn(M * K, 34);
  DeviceBuffer<uint16_t> dw(ToBf16(w)), dx(ToBf16(x));
  std::vector<std::vector<float>> outs;
  for (const int64_t rows : {int64_t{1}, int64_t{64}, M}) {
    DeviceBuffer<float> dl(rows * V);
    LmHeadArgs a;
    a.V = V, a.K = K, a.w = dw.bf(), a.x = Split{dx.bf(), K, 0}, a.M = rows, a.logits = dl.get(), a.ldl = V;
    CUDA_OK(LmHead(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    outs.push_back(dl.ToHost());
  }
  for (size_t i = 0; i + 1 < outs.size(); ++i)
    for (size_t j = 0; j < outs[i].size(); ++j) ASSERT_EQ(outs[i][j], outs.back()[j]) << "batch " << i << " element " << j;
  // Bad arguments: named errors, nothing launched.
  LmHeadArgs bad;
  bad.V = V, bad.K = 12, bad.w = dw.bf(), bad.x = Split{dx.bf(), 12, 0}, bad.M = 1, bad.logits = nullptr;
  EXPECT_EQ(LmHead(bad, nullptr), cudaErrorInvalidValue);  // K % 8, and no output
  bad.K = K, bad.x.ld = K, bad.argmax_keys = reinterpret_cast<uint64_t*>(dw.get());
  bad.w = dw.bf() + 1;
  EXPECT_EQ(LmHead(bad, nullptr), cudaErrorMisalignedAddress);
}

// ------------------------------------------------------------------------------------------------ norms

// Widths for each register count of the row kernel and one past them (two passes); fp32 rows gathered in
// reverse order, and split-bf16 rows.
TEST(NormCuda, RmsNormAndGatedMatchCpu) {
  REQUIRE_GPU();
  const int64_t M = 33, H = 7, Dh = 128;
  for (const int64_t D : {2304, 1000, 64, 1537, 5000}) {
    const std::vector<float> x = Randn(M * D, 12, 3.0f), w = Randn(D, 13);
    std::vector<float> ref(M * D), rev(M * D);
    cpu::RmsNormRef(M, D, x.data(), w.data(), 1e-5f, ref.data());
    std::vector<int32_t> rows(M);
    for (int64_t i = 0; i < M; ++i) rows[i] = static_cast<int32_t>(M - 1 - i);
    for (int64_t i = 0; i < M; ++i) std::copy_n(ref.data() + rows[i] * D, D, rev.data() + i * D);
    DeviceBuffer<float> dx(x), dw(w);
    DeviceBuffer<int32_t> drows(rows);
    std::vector<float> xs = x;  // becomes hi + lo
    DeviceBuffer<uint16_t> dy(2 * M * D), dys(2 * M * D), dxs(ToSplitPlanes(xs));
    CUDA_OK(RmsNorm(M, D, dx.get(), D, drows.get(), dw.get(), 1e-5f, Split{dy.bf(), D, M * D}, nullptr));
    CUDA_OK(RmsNorm(M, D, Split{dxs.bf(), D, M * D}, dw.get(), 1e-5f, Split{dys.bf(), D, M * D}, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_LT(Rel(FromSplit(dy.ToHost(), M * D), rev), 1e-5) << "D " << D;
    std::vector<float> sref(M * D);
    cpu::RmsNormRef(M, D, xs.data(), w.data(), 1e-5f, sref.data());
    EXPECT_LT(Rel(FromSplit(dys.ToHost(), M * D), sref), 1e-5) << "split D " << D;
  }
  {  // No weight, and a lo plane off 8 bytes.
    const int64_t D = 2304;
    const std::vector<float> x = Randn(M * D, 17, 2.0f), ones(D, 1.0f);
    std::vector<float> ref(M * D);
    cpu::RmsNormRef(M, D, x.data(), ones.data(), 1e-5f, ref.data());
    DeviceBuffer<float> dx(x);
    DeviceBuffer<uint16_t> dy(2 * M * D + 2);
    CUDA_OK(RmsNorm(M, D, dx.get(), D, nullptr, nullptr, 1e-5f, Split{dy.bf(), D, M * D + 2}, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> h = dy.ToHost();
    std::vector<float> got(M * D);
    for (int64_t i = 0; i < M * D; ++i) got[i] = Bf16ToFloat(h[i]) + Bf16ToFloat(h[i + M * D + 2]);
    EXPECT_LT(Rel(got, ref), 1e-5);
  }

  std::vector<float> o = Randn(M * H * Dh, 14), gate = Randn(M * H * Dh, 15), gw = Randn(Dh, 16), gref(M * H * Dh);
  ToBf16(o);
  cpu::GatedRmsNormRef(M * H, Dh, o.data(), gate.data(), gw.data(), 1e-5f, gref.data());
  DeviceBuffer<uint16_t> dob(ToBf16(o)), dg2(2 * M * H * Dh);
  DeviceBuffer<float> dof(o), dg(gate), dgw(gw);
  DeviceBuffer<uint16_t> dgy(2 * M * H * Dh);
  CUDA_OK(GatedRmsNorm(M * H, Dh, dob.bf(), dg.get(), dgw.get(), 1e-5f, Split{dgy.bf(), Dh, M * H * Dh}, nullptr));
  CUDA_OK(GatedRmsNorm(M * H, Dh, dof.get(), dg.get(), dgw.get(), 1e-5f, Split{dg2.bf(), Dh, M * H * Dh}, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(Rel(FromSplit(dgy.ToHost(), M * H * Dh), gref), 1e-5);
  EXPECT_LT(Rel(FromSplit(dg2.ToHost(), M * H * Dh), gref), 1e-5);

  // The gate as a product's unfolded sums (token rows of H·Dh + 4, lo rows M further): the same output, bit for bit,
  // as the fp32 gate hi + lo.
  const int64_t ld = H * Dh + 4;
  std::vector<float> sums(2 * M * ld, NAN), folded(M * H * Dh);
  const std::vector<float> lo = Randn(M * H * Dh, 18, 1e-3f);
  for (int64_t t = 0; t < M; ++t)
    for (int64_t c = 0; c < H * Dh; ++c) {
      sums[t * ld + c] = gate[t * H * Dh + c], sums[(M + t) * ld + c] = lo[t * H * Dh + c];
      folded[t * H * Dh + c] = gate[t * H * Dh + c] + lo[t * H * Dh + c];
    }
  DeviceBuffer<float> dsums(sums), dfolded(folded);
  DeviceBuffer<uint16_t> dys(2 * M * H * Dh), dyf(2 * M * H * Dh);
  CUDA_OK(GatedRmsNorm(M * H, Dh, dob.bf(), Sums{dsums.get(), ld, M}, H, dgw.get(), 1e-5f,
                       Split{dys.bf(), Dh, M * H * Dh}, nullptr));
  CUDA_OK(GatedRmsNorm(M * H, Dh, dob.bf(), dfolded.get(), dgw.get(), 1e-5f, Split{dyf.bf(), Dh, M * H * Dh}, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dys.ToHost(), dyf.ToHost());
  EXPECT_EQ(GatedRmsNorm(M * H, Dh, dob.bf(), Sums{dsums.get(), ld, M}, 5, dgw.get(), 1e-5f,
                         Split{dys.bf(), Dh, M * H * Dh}, nullptr),
            cudaErrorInvalidValue);  // 5 heads do not divide the rows
}

// The gated norm at every width its kernel's register counts split on (odd widths: threads past the row), up to the
// largest (1024) and one past it; one row, many, and none.
TEST(NormCuda, GatedAtEveryWidth) {
  REQUIRE_GPU();
  for (const int64_t D : {16, 64, 100, 128, 200, 256, 300, 1024})
    for (const int64_t M : {1, 13, 2048}) {
      std::vector<float> o = Randn(M * D, 40, 2.0f);
      const std::vector<uint16_t> ob = ToBf16(o);  // o rounded in place
      const std::vector<float> gate = Randn(M * D, 41, 3.0f), gw = Randn(D, 42);
      std::vector<float> ref(M * D);
      cpu::GatedRmsNormRef(M, D, o.data(), gate.data(), gw.data(), 1e-6f, ref.data());
      DeviceBuffer<uint16_t> dob(ob), dy(std::vector<uint16_t>(2 * M * D + 1, 0x7fc1));
      DeviceBuffer<float> dg(gate), dgw(gw);
      CUDA_OK(GatedRmsNorm(M, D, dob.bf(), dg.get(), dgw.get(), 1e-6f, Split{dy.bf(), D, M * D}, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> y = dy.ToHost();
      EXPECT_LT(Rel(FromSplit(y, M * D), ref), 1e-5) << "D " << D << " M " << M;
      EXPECT_EQ(y[2 * M * D], 0x7fc1) << "past the output, D " << D << " M " << M;
    }
  DeviceBuffer<uint16_t> x(16), y(32);
  DeviceBuffer<float> g(16), w(16);
  CUDA_OK(GatedRmsNorm(0, 16, x.bf(), g.get(), w.get(), 1e-6f, Split{y.bf(), 16, 16}, nullptr));
  EXPECT_EQ(GatedRmsNorm(0, 1025, x.bf(), g.get(), w.get(), 1e-6f, Split{y.bf(), 1025, 16}, nullptr),
            cudaErrorInvalidValue);
}

// AddRmsNorm: x += a (a product's unfolded sums: rows of D + 3 or D + 4, lo rows M further) + b (plain fp32),
// rounded as the fold and AddInto2 round them, then the norm; each addend alone, none, no rows, one row, and with a
// row list (x left as it is). Rows of D + 4 and D % 4 == 0 take the 16-byte kernel (up to D = 32768), others the
// scalar one.
TEST(NormCuda, AddRmsNormFoldsTheResidualAdds) {
  REQUIRE_GPU();
  for (const int64_t D : {2304, 1000, 1, 5000, 7168, 33000})
    for (const int64_t M : {0, 1, 33})
      for (const int with : {0, 1, 2, 3})  // bit 0: a, bit 1: b
        for (const int64_t pad : {3, 4}) {
          const int64_t lda = D + pad;
          const std::vector<float> x = Randn(M * D + 1, 40, 3.0f), w = Randn(D, 41), b = Randn(M * D + 1, 42);
          const std::vector<float> a = Randn(2 * M * lda + 1, 43, 0.5f);
          std::vector<float> h(M * D);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t c = 0; c < D; ++c) {
              float v = x[i * D + c];
              if (with & 1) v += a[i * lda + c] + a[(M + i) * lda + c];
              if (with & 2) v += b[i * D + c];
              h[i * D + c] = v;
            }
          std::vector<float> ref(M * D), rev(M * D);
          cpu::RmsNormRef(M, D, h.data(), w.data(), 1e-5f, ref.data());
          std::vector<int32_t> rows(std::max<int64_t>(M, 1));
          for (int64_t i = 0; i < M; ++i) rows[i] = static_cast<int32_t>(M - 1 - i);
          for (int64_t i = 0; i < M; ++i) std::copy_n(ref.data() + rows[i] * D, D, rev.data() + i * D);
          DeviceBuffer<float> dx(x), dx2(x), dw(w), da(a), db(b);
          DeviceBuffer<int32_t> drows(rows);
          DeviceBuffer<uint16_t> dy(2 * M * D + 2), dyr(2 * M * D + 2);
          const Sums sa = with & 1 ? Sums{da.get(), lda, M} : Sums{}, sb = with & 2 ? Sums{db.get(), D, 0} : Sums{};
          CUDA_OK(AddRmsNorm(M, D, dx.get(), D, sa, sb, nullptr, dw.get(), 1e-5f, Split{dy.bf(), D, M * D}, nullptr));
          CUDA_OK(AddRmsNorm(M, D, dx2.get(), D, sa, sb, drows.get(), dw.get(), 1e-5f, Split{dyr.bf(), D, M * D},
                             nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          const std::string what = "D " + std::to_string(D) + " M " + std::to_string(M) + " with " +
                                   std::to_string(with) + " pad " + std::to_string(pad);
          std::vector<float> got_x = dx.ToHost();
          EXPECT_EQ(got_x.back(), x.back()) << what;  // past the rows
          got_x.resize(M * D);
          EXPECT_EQ(got_x, h) << what;
          EXPECT_EQ(dx2.ToHost(), x) << "a row list leaves x, " << what;
          if (M == 0) continue;
          EXPECT_LT(Rel(FromSplit(dy.ToHost(), M * D), ref), 1e-5) << what;
          EXPECT_LT(Rel(FromSplit(dyr.ToHost(), M * D), rev), 1e-5) << "rows, " << what;
        }
  DeviceBuffer<float> buf(64);
  DeviceBuffer<uint16_t> y(128);
  EXPECT_EQ(AddRmsNorm(1, 64, buf.get(), 64, Sums{buf.get(), 32, 0}, {}, nullptr, nullptr, 1e-5f,
                       Split{y.bf(), 64, 64}, nullptr),
            cudaErrorInvalidValue);  // addend rows narrower than D
}

// ------------------------------------------------------------------------------------------------- conv

// Three chunks (a prefill longer than the window, a decode token, a chunk shorter than the state) against
// the CPU conv with the same states.
// Ragged chunks with state; then two decode tokens in front, whose states KdaConv advances itself. Channels
// C / 3 = 40 take the 8-channel kernel (each of its kernel sizes), 37 the scalar one; fp32 and bf16 outputs.
TEST(ConvCuda, RaggedChunksWithStateMatchCpu) {
  REQUIRE_GPU();
  struct Layout {
    std::vector<int32_t> len, slot;
    int64_t decode;
  };
  for (const int64_t C : {3 * 40, 3 * 37})
  for (const int64_t K : {4, 3, 2})
  for (const bool out_bf16 : {false, true})
  for (const Layout& lay : {Layout{{9, 1, 2}, {2, 0, 3}, 0}, Layout{{1, 1, 9, 2}, {3, 0, 1, 4}, 2}}) {
    const int64_t S = K - 1, slots = 5, chunks = static_cast<int64_t>(lay.len.size());
    std::vector<int32_t> start, tok_start, tok_slot;
    for (int64_t c = 0, row = 0; c < chunks; row += lay.len[c++]) start.push_back(static_cast<int32_t>(row));
    for (int64_t c = 0; c < chunks; ++c)
      for (int32_t t = 0; t < lay.len[c]; ++t) tok_start.push_back(start[c]), tok_slot.push_back(lay.slot[c]);
    const int64_t N = static_cast<int64_t>(tok_start.size());
    std::vector<float> x = Randn(N * C, 17), w = Randn(C * K, 18, 0.5f), state = Randn(slots * S * C, 19);
    const std::vector<uint16_t> xs = ToSplitPlanes(x);
    DeviceBuffer<uint16_t> dx(xs);
    DeviceBuffer<float> dw(w), dstate(state), q(N * C / 3), k(N * C / 3), v(N * C / 3);  // bf16 in their first half
    DeviceBuffer<int32_t> dts(tok_start), dtslot(tok_slot), dcs(start), dcl(lay.len), dcslot(lay.slot);
    KdaConvArgs a;
    a.N = N, a.C = C, a.K = K, a.x = Split{dx.bf(), C, N * C}, a.w = dw.get(), a.state = dstate.get();
    a.tok_start = dts.get(), a.tok_slot = dtslot.get(), a.out[0] = q.get(), a.out[1] = k.get(), a.out[2] = v.get();
    a.out_bf16 = out_bf16, a.decode_tokens = lay.decode;
    CUDA_OK(KdaConv(a, nullptr));
    const int64_t d = lay.decode;
    CUDA_OK(KdaConvUpdateState(a, chunks - d, dcs.get() + d, dcl.get() + d, dcslot.get() + d, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> ref(N * C), ref_state = state;
    for (int64_t c = 0; c < chunks; ++c)
      cpu::CausalConv1dSiluRef(lay.len[c], C, K, x.data() + start[c] * C, w.data(),
                               ref_state.data() + lay.slot[c] * S * C, ref.data() + start[c] * C);
    const auto hq = q.ToHost(), hk = k.ToHost(), hv = v.ToHost();
    std::vector<float> got(N * C);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const auto& part = c < C / 3 ? hq : c < 2 * C / 3 ? hk : hv;
        const int64_t i = t * (C / 3) + c % (C / 3);
        uint16_t b;
        std::memcpy(&b, reinterpret_cast<const char*>(part.data()) + 2 * i, 2);
        got[t * C + c] = out_bf16 ? Bf16ToFloat(b) : part[i];
      }
    EXPECT_LT(Rel(got, ref), out_bf16 ? 8e-3 : 1e-5) << "C " << C << " K " << K << " bf16 " << out_bf16
                                                      << " decode tokens " << d;
    EXPECT_LT(Rel(dstate.ToHost(), ref_state), 1e-6) << "decode tokens " << d;
    KdaConvArgs bad = a;
    bad.K = kKdaConvMaxK + 1;
    EXPECT_EQ(KdaConv(bad, nullptr), cudaErrorInvalidValue);
    bad = a;
    bad.decode_tokens = N + 1;
    EXPECT_EQ(KdaConv(bad, nullptr), cudaErrorInvalidValue);
    KdaConvArgs empty = a;  // an empty batch: nothing to do, nothing touched
    empty.N = 0, empty.decode_tokens = 0;
    EXPECT_EQ(KdaConv(empty, nullptr), cudaSuccess);
    EXPECT_EQ(KdaConvUpdateState(empty, 0, dcs.get(), dcl.get(), dcslot.get(), nullptr), cudaSuccess);
  }
}

// The input as a product's unfolded sums (hi rows, lo rows N further, rows of C + 4) gives the conv and the state
// update exactly what the split input split(hi + lo) gives them; the 8-channel kernel (C / 3 = 40) and the scalar
// one (37), decode tokens and a prefill chunk.
TEST(ConvCuda, SumsInputIsTheFoldedInput) {
  REQUIRE_GPU();
  for (const int64_t C : {3 * 40, 3 * 37}) {
    const int64_t K = 4, S = K - 1, slots = 4, ld = C + 4;
    const std::vector<int32_t> len = {1, 1, 9}, slot = {2, 0, 3}, start = {0, 1, 2};
    std::vector<int32_t> tok_start, tok_slot;
    for (size_t c = 0; c < len.size(); ++c)
      for (int32_t t = 0; t < len[c]; ++t) tok_start.push_back(start[c]), tok_slot.push_back(slot[c]);
    const int64_t N = static_cast<int64_t>(tok_start.size()), d = 2;
    const std::vector<float> hi = Randn(N * C, 80), lo = Randn(N * C, 81, 1e-3f), w = Randn(C * K, 82, 0.5f),
                             state = Randn(slots * S * C, 83);
    std::vector<float> sums(2 * N * ld, NAN), v(N * C);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t c = 0; c < C; ++c) {
        sums[t * ld + c] = hi[t * C + c], sums[(N + t) * ld + c] = lo[t * C + c];
        v[t * C + c] = hi[t * C + c] + lo[t * C + c];
      }
    DeviceBuffer<uint16_t> dx(ToSplitPlanes(v));
    DeviceBuffer<float> dsums(sums), dw(w), st1(state), st2(state);
    DeviceBuffer<uint16_t> o1(3 * N * C / 3), o2(3 * N * C / 3);
    DeviceBuffer<int32_t> dts(tok_start), dtslot(tok_slot), dcs(start), dcl(len), dcslot(slot);
    auto run = [&](bool from_sums, DeviceBuffer<float>& st, DeviceBuffer<uint16_t>& o) {
      KdaConvArgs a;
      a.N = N, a.C = C, a.K = K, a.w = dw.get(), a.state = st.get();
      if (from_sums) {
        a.x_sums = Sums{dsums.get(), ld, N};
      } else {
        a.x = Split{dx.bf(), C, N * C};
      }
      a.tok_start = dts.get(), a.tok_slot = dtslot.get(), a.decode_tokens = d;
      for (int p = 0; p < 3; ++p) a.out[p] = o.bf() + p * N * C / 3;
      CUDA_OK(KdaConv(a, nullptr));
      CUDA_OK(KdaConvUpdateState(a, 1, dcs.get() + d, dcl.get() + d, dcslot.get() + d, nullptr));
    };
    run(false, st1, o1);
    run(true, st2, o2);
    KdaConvArgs narrow;  // sums rows narrower than the channels
    narrow.N = N, narrow.C = C, narrow.K = K, narrow.w = dw.get(), narrow.state = st1.get();
    narrow.x_sums = Sums{dsums.get(), C - 1, N}, narrow.tok_start = dts.get(), narrow.tok_slot = dtslot.get();
    for (int p = 0; p < 3; ++p) narrow.out[p] = o1.bf();
    EXPECT_EQ(KdaConv(narrow, nullptr), cudaErrorInvalidValue);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(o1.ToHost(), o2.ToHost()) << "C " << C;
    EXPECT_EQ(st1.ToHost(), st2.ToHost()) << "C " << C;
  }
}

// ------------------------------------------------------------------------------------------------ KDA

TEST(KdaSmallCuda, RecurrenceMatchesCpu) {
  REQUIRE_GPU();
  const int64_t H = 3, D = 32, HD = H * D, slots = 4;
  const std::vector<int32_t> len = {70, 1, 5}, start = {0, 70, 71}, slot = {1, 3, 0};
  const int64_t N = 76;
  for (const KdaGate gate : {KdaGate::kSoftplus, KdaGate::kBounded}) {
    const std::vector<float> q = Randn(N * HD, 20), k = Randn(N * HD, 21), v = Randn(N * HD, 22), g = Randn(N * HD, 23),
                             b = Randn(N * H, 24), state = Randn(slots * H * D * D, 25, 0.3f);
    std::vector<float> A_log(H), dt_bias = Randn(HD, 26, 0.5f);
    for (int64_t h = 0; h < H; ++h) A_log[h] = std::log(1.0f + 3.0f * h);
    DeviceBuffer<float> dq(q), dk(k), dv(v), dg(g), db(b), dA(A_log), ddt(dt_bias), dstate(state), dout(N * HD);
    DeviceBuffer<int32_t> ds(start), dl(len), dslot(slot);
    KdaSmallArgs a;
    a.H = H, a.D = D, a.q = dq.get(), a.k = dk.get(), a.v = dv.get(), a.g_raw = dg.get(), a.b = db.get();
    a.A_log = dA.get(), a.dt_bias = ddt.get(), a.gate = gate, a.lower_bound = -5.0f, a.state = dstate.get();
    a.o = dout.get(), a.num_chunks = 3, a.ch_start = ds.get(), a.ch_len = dl.get(), a.ch_slot = dslot.get();
    CUDA_OK(KdaSmall(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> ref(N * HD), ref_state = state;
    for (int c = 0; c < 3; ++c) {
      const int64_t T = len[c], o0 = start[c];
      std::vector<float> qc(q.begin() + o0 * HD, q.begin() + (o0 + T) * HD), kc(k.begin() + o0 * HD, k.begin() + (o0 + T) * HD);
      std::vector<float> gc(T * HD), bc(b.begin() + o0 * H, b.begin() + (o0 + T) * H);
      if (gate == KdaGate::kSoftplus) {
        cpu::KdaGateSoftplus(T, H, D, g.data() + o0 * HD, A_log.data(), dt_bias.data(), gc.data());
      } else {
        cpu::KdaGateBounded(T, H, D, g.data() + o0 * HD, A_log.data(), dt_bias.data(), -5.0f, gc.data());
      }
      for (auto& x : bc) x = 1.0f / (1.0f + std::exp(-x));
      cpu::KdaNormalizeQK(T, H, D, qc.data(), kc.data());
      cpu::KdaRecurrent(T, H, D, D, qc.data(), kc.data(), v.data() + o0 * HD, gc.data(), bc.data(),
                        ref_state.data() + slot[c] * H * D * D, ref.data() + o0 * HD);
    }
    EXPECT_LT(Rel(dout.ToHost(), ref), 1e-5);
    EXPECT_LT(Rel(dstate.ToHost(), ref_state), 1e-5);
  }
}

// ------------------------------------------------------------------------------------------------- MLA

struct MlaProblem {
  MlaDims s;
  std::vector<float> q, cache, kv_b;  // q [T, nh·dqk] (split-exact), cache [L, cw] (bf16-exact), kv_b bf16-exact
  std::vector<uint16_t> qs, cache_b, kv_bb;
};

MlaProblem MakeMla(const MlaDims& s, int64_t T, int64_t L, uint32_t seed) {
  MlaProblem p;
  p.s = s;
  p.q = Randn(T * s.nh * s.dqk(), seed, 0.3f);
  p.cache = Randn(L * s.cw(), seed + 1);
  p.kv_b = Randn(s.nh * s.dkv() * s.r, seed + 2, 1.0f / std::sqrt(float(s.r)));
  p.qs = ToSplitPlanes(p.q);
  p.cache_b = ToBf16(p.cache);
  p.kv_bb = ToBf16(p.kv_b);
  return p;
}

// Prefill (expanded) of T tokens after P cached ones; decode (absorbed) of one token per sequence.
TEST(MlaCuda, PrefillAndDecodeMatchReference) {
  REQUIRE_GPU();
  // Tiny goldens' shape (decode: one partial 16-head block of a 32-head CTA); 20 heads (a partial second block)
  // with cw = 72 (padded to 80 columns); Kimi's; 40 heads (a second CTA of heads, one partial block).
  for (const MlaDims s : {MlaDims{4, 32, 16, 32, 32}, MlaDims{20, 32, 8, 32, 64}, MlaDims{32, 128, 64, 128, 512},
                          MlaDims{40, 32, 16, 32, 64}}) {
    const int64_t P = 37, T = 90, L = P + T;
    const float scale = 1.0f / std::sqrt(float(s.dqk()));
    const cpu::MlaShape cs{s.nh, s.dn, s.dr, s.dv, s.r};
    MlaProblem p = MakeMla(s, T, L, 30);
    std::vector<float> ref(T * s.nh * s.dv);
    cpu::MlaAttentionRef(T, P, cs, p.q.data(), p.cache.data(), p.kv_b.data(), scale, ref.data());
    DeviceBuffer<uint16_t> dq(p.qs), dcache(p.cache_b), dkv(p.kv_bb), dout(2 * T * s.nh * s.dv);
    const int64_t Tq = 64;  // two query tiles
    DeviceBuffer<char> ws(MlaPrefillWorkspaceBytes(s, L, Tq));
    const cudaError_t pre = MlaPrefill(s, T, P, Split{dq.bf(), s.nh * s.dqk(), T * s.nh * s.dqk()}, dcache.bf(),
                                       dkv.bf(), scale, Split{dout.bf(), s.nh * s.dv, T * s.nh * s.dv}, Tq, ws.get(),
                                       nullptr);
    if (s.dqk() % 16 != 0) {
      EXPECT_EQ(pre, cudaErrorInvalidValue) << "prefill's products take dqk % 16 == 0";
    } else {
      CUDA_OK(pre);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_LT(Rel(FromSplit(dout.ToHost(), T * s.nh * s.dv), ref), 1e-2) << "prefill nh " << s.nh;
    }

    // Decode: four sequences in slots 1, 0, 3, 2 of a pool of max_ctx rows, at positions 0, 20, 600 and Ld − 1
    // of a 3000-row cache (32-row tiles: one partial tile; 2 runs of 10 and 9 tiles; 8 runs, the most, of 12).
    const int64_t Ld = 3000, max_ctx = Ld + 3, N = 4;
    const MlaProblem pc = MakeMla(s, 1, Ld, 31);
    const std::vector<int32_t> slot = {1, 0, 3, 2}, pos = {0, 20, 600, static_cast<int32_t>(Ld - 1)};
    std::vector<uint16_t> pool(4 * max_ctx * s.cw());
    for (int64_t sl = 0; sl < 4; ++sl) std::copy(pc.cache_b.begin(), pc.cache_b.end(), pool.begin() + sl * max_ctx * s.cw());
    MlaProblem d = MakeMla(s, N, 1, 40);
    std::vector<float> dref(N * s.nh * s.dv);
    for (int64_t n = 0; n < N; ++n)
      cpu::MlaAttentionRef(1, pos[n], cs, d.q.data() + n * s.nh * s.dqk(), pc.cache.data(), p.kv_b.data(), scale,
                           dref.data() + n * s.nh * s.dv);
    DeviceBuffer<uint16_t> dqd(d.qs), dpool(pool), dukt(s.nh * s.r * s.dn), dod(2 * N * s.nh * s.dv);
    DeviceBuffer<int32_t> dslot(slot), dpos(pos);
    DeviceBuffer<char> wsd(MlaDecodeWorkspaceBytes(s, N));
    CUDA_OK(MlaTransposeUk(s, dkv.bf(), dukt.bf(), nullptr));
    LinearBlas blas;  // the per-head products: strided batches of the heads on cuBLASLt
    CUDA_OK(blas.Init(LinearBlas::WorkspaceBytes(N, s.r, s.dn, s.nh)));
    CUDA_OK(MlaDecode(N, s, Split{dqd.bf(), s.nh * s.dqk(), N * s.nh * s.dqk()}, dpool.bf(), max_ctx, dslot.get(),
                      dpos.get(), dkv.bf(), dukt.bf(), scale, Split{dod.bf(), s.nh * s.dv, N * s.nh * s.dv}, wsd.get(),
                      blas, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_LT(Rel(FromSplit(dod.ToHost(), N * s.nh * s.dv), dref), 2e-3) << "decode nh " << s.nh;

    // MlaDecodeSums: the input product's unfolded sums (hi rows, then lo rows, a padded row stride) in, against
    // their fold (on the host), MlaCacheAppend and MlaDecode: the same cache rows and output, bit for bit.
    {
      const int64_t W = s.nh * s.dqk() + s.cw(), ld = W + 5;
      const std::vector<float> hs = Randn(N * ld, 60, 2.0f), ls = Randn(N * ld, 61, 0.01f), nw = Randn(s.r, 62);
      std::vector<float> sums(hs), v(N * W);
      sums.insert(sums.end(), ls.begin(), ls.end());
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < W; ++c) v[n * W + c] = hs[n * ld + c] + ls[n * ld + c];
      DeviceBuffer<uint16_t> dfold(ToSplitPlanes(v)), pool_a(pool), pool_b(pool), out_a(2 * N * s.nh * s.dv),
          out_b(2 * N * s.nh * s.dv);
      DeviceBuffer<float> dsums(sums), dnw(nw);
      const Split fold{dfold.bf(), W, N * W};
      CUDA_OK(MlaCacheAppend(N, s, fold.Cols(s.nh * s.dqk()), dnw.get(), 1e-6f, dslot.get(), dpos.get(), pool_a.bf(),
                             max_ctx, nullptr));
      CUDA_OK(MlaDecode(N, s, fold, pool_a.bf(), max_ctx, dslot.get(), dpos.get(), dkv.bf(), dukt.bf(), scale,
                        Split{out_a.bf(), s.nh * s.dv, N * s.nh * s.dv}, wsd.get(), blas, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<uint16_t> got_a = out_a.ToHost(), cache_a = pool_a.ToHost();
      CUDA_OK(MlaDecodeSums(N, s, Sums{dsums.get(), ld, N}, dnw.get(), 1e-6f, pool_b.bf(), max_ctx, dslot.get(),
                            dpos.get(), dkv.bf(), dukt.bf(), scale, Split{out_b.bf(), s.nh * s.dv, N * s.nh * s.dv},
                            wsd.get(), blas, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_EQ(pool_b.ToHost(), cache_a) << "nh " << s.nh << ": the appended cache rows";
      EXPECT_EQ(out_b.ToHost(), got_a) << "nh " << s.nh << ": the decode's output";
      EXPECT_EQ(MlaDecodeSums(N, s, Sums{dsums.get(), W - 1, N}, dnw.get(), 1e-6f, pool_b.bf(), max_ctx, dslot.get(),
                              dpos.get(), dkv.bf(), dukt.bf(), scale, Split{out_b.bf(), s.nh * s.dv, 0}, wsd.get(),
                              blas, nullptr),
                cudaErrorInvalidValue)
          << "rows narrower than [q | c_kv | k_r]";
    }
    EXPECT_EQ(MlaDecode(0, s, Split{dqd.bf(), s.nh * s.dqk(), 0}, dpool.bf(), max_ctx, dslot.get(), dpos.get(),
                        dkv.bf(), dukt.bf(), scale, Split{dod.bf(), s.nh * s.dv, 0}, wsd.get(), blas, nullptr),
              cudaSuccess);  // an empty batch
  }
  EXPECT_FALSE(MlaDecodeSupported(MlaDims{4, 32, 4, 32, 32}));     // cw = 36: rows not 16-byte aligned
  EXPECT_FALSE(MlaDecodeSupported(MlaDims{4, 32, 64, 32, 520}));   // r > 512
  EXPECT_TRUE(MlaDecodeSupported(MlaDims{64, 128, 64, 128, 512}));  // K3
}

TEST(MlaCuda, CacheAppendNormalizes) {
  REQUIRE_GPU();
  const MlaDims s{4, 32, 16, 32, 64};
  const int64_t N = 3, max_ctx = 8;
  std::vector<float> c = Randn(N * s.cw(), 50, 2.0f), w = Randn(s.r, 51);
  const std::vector<uint16_t> cs = ToSplitPlanes(c);
  const std::vector<int32_t> slot = {1, 1, 0}, pos = {4, 5, 0};
  DeviceBuffer<uint16_t> dc(cs), cache(2 * max_ctx * s.cw());
  DeviceBuffer<float> dw(w);
  DeviceBuffer<int32_t> dslot(slot), dpos(pos);
  CUDA_OK(MlaCacheAppend(N, s, Split{dc.bf(), s.cw(), N * s.cw()}, dw.get(), 1e-6f, dslot.get(), dpos.get(), cache.bf(),
                         max_ctx, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto h = cache.ToHost();
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> ref(s.cw()), got(s.cw());
    cpu::RmsNormRef(1, s.r, c.data() + n * s.cw(), w.data(), 1e-6f, ref.data());
    std::copy_n(c.begin() + n * s.cw() + s.r, s.dr, ref.begin() + s.r);
    for (int64_t i = 0; i < s.cw(); ++i) got[i] = Bf16ToFloat(h[(slot[n] * max_ctx + pos[n]) * s.cw() + i]);
    EXPECT_LT(Rel(got, ref), 4e-3);
  }
}

// -------------------------------------------------------------------------------------------- AttnRes

TEST(AttnResCuda, NaiveReadMatchesCpu) {
  REQUIRE_GPU();
  const int64_t N = 5, d = 256;
  for (const int64_t m : {0, 1, 3}) {
    const std::vector<float> bank = Randn(m * N * d + 1, 60), partial = Randn(N * d, 61), w = Randn(d, 62, 0.05f),
                             n = Randn(d, 63);
    std::vector<const float*> src;
    for (int64_t j = 0; j < m; ++j) src.push_back(bank.data() + j * N * d);
    src.push_back(partial.data());
    std::vector<float> ref(N * d);
    cpu::AttnResRead(N, d, src.data(), m + 1, w.data(), n.data(), 1e-5f, ref.data());
    DeviceBuffer<float> db(bank), dp(partial), dw(w), dn(n), out(N * d);
    CUDA_OK(AttnResRead(N, d, db.get(), N * d, m, dp.get(), dw.get(), dn.get(), 1e-5f, out.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_LT(Rel(out.ToHost(), ref), 1e-5) << "m " << m;
  }
}

// ------------------------------------------------------------------------------------ element-wise

// The residual adds: y + x, and (y + x) + x2 rounded as two adds (the engine's routed then shared sum).
TEST(ElementwiseCuda, AddIntoRoundsLikeTwoAdds) {
  REQUIRE_GPU();
  for (const int64_t n : {0, 1, 1000, 4097}) {
    const std::vector<float> x = Randn(n + 1, 70), x2 = Randn(n + 1, 71), y = Randn(n + 1, 72);
    DeviceBuffer<float> dx(x), dx2(x2), dy(y), dy2(y);
    CUDA_OK(AddInto(n, dx.get(), dy.get(), nullptr));
    CUDA_OK(AddInto2(n, dx.get(), dx2.get(), dy2.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto got = dy.ToHost(), got2 = dy2.ToHost();
    for (int64_t i = 0; i <= n; ++i) {
      const float once = i < n ? y[i] + x[i] : y[i];  // the element past n stays
      ASSERT_EQ(got[i], once) << "n " << n << " i " << i;
      ASSERT_EQ(got2[i], i < n ? once + x2[i] : y[i]) << "n " << n << " i " << i;
    }
  }
  EXPECT_EQ(AddInto2(4, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

// ------------------------------------------------------------------------------------------- sampling

// Ties across and within the CTAs that share a row, the last id, NaN, all −inf, a vocabulary that is not a
// multiple of 4 (the scalar path); against the CPU's first-maximum scan.
// The next decode step's inputs from this step's greedy ids (CudaModel::NextGreedy): tok_id = ids, tok_pos + 1, for
// no tokens, one, and more than a CTA's.
TEST(SamplingCuda, FeedGreedyIdsAdvancesTheTokens) {
  REQUIRE_GPU();
  for (const int64_t N : {0, 1, 300}) {
    std::vector<int32_t> ids(N), tok(N), pos(N);
    for (int64_t n = 0; n < N; ++n) ids[n] = static_cast<int32_t>(7 * n + 3), tok[n] = -1, pos[n] = static_cast<int32_t>(n);
    DeviceBuffer<int32_t> di(ids), dt(tok), dp(pos);
    CUDA_OK(FeedGreedyIds(N, di.get(), dt.get(), dp.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> t = dt.ToHost(), p = dp.ToHost();
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_EQ(t[n], ids[n]) << n;
      EXPECT_EQ(p[n], n + 1) << n;
    }
  }
  EXPECT_EQ(FeedGreedyIds(2, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(FeedGreedyIds(-1, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

TEST(SamplingCuda, ArgmaxTakesLowestIdOnTies) {
  REQUIRE_GPU();
  for (const int64_t V : {int64_t{163840}, int64_t{5003}, int64_t{1}}) {
    const int64_t R = 6;
    std::vector<float> l = Randn(R * V, 70);
    if (V > 5000) {
      l[5] = 50.0f, l[4096 + 77] = 50.0f;            // row 0: tie across CTAs → 5
      l[V + V - 1] = 60.0f;                          // row 1: last id
      l[2 * V + 1000] = 9.0f, l[2 * V + 999] = 9.0f;  // row 2: tie within a thread's float4 → 999
      l[3 * V + 7] = NAN, l[3 * V + 8] = 70.0f;      // row 3: NaN is never chosen
      for (int64_t c = 0; c < V; ++c) l[4 * V + c] = -INFINITY;  // row 4: all −inf → 0
    }
    std::vector<int32_t> want(R);
    for (int64_t r = 0; r < R; ++r) {
      int64_t best = 0;
      for (int64_t c = 1; c < V; ++c)
        if (l[r * V + c] > l[r * V + best] || std::isnan(l[r * V + best])) best = c;
      want[r] = static_cast<int32_t>(best);
    }
    DeviceBuffer<float> dl(l);
    DeviceBuffer<int32_t> ids(R);
    DeviceBuffer<uint64_t> keys(R);
    CUDA_OK(Argmax(R, V, dl.get(), keys.get(), ids.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(ids.ToHost(), want) << "V " << V;
    EXPECT_EQ(Argmax(0, V, dl.get(), keys.get(), ids.get(), nullptr), cudaSuccess);  // no rows: nothing written
    EXPECT_EQ(Argmax(R, 0, dl.get(), keys.get(), ids.get(), nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(Argmax(R, V, dl.get(), nullptr, ids.get(), nullptr), cudaErrorInvalidValue);  // no workspace
  }
}

}  // namespace
}  // namespace k3::cuda
