#include "kernels/cpu/kda.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace k3::cpu {
namespace {

// max|a − ref| / max|ref|: the error on the scale of the reference output. A NaN in a (an output
// never written) counts as infinite.
double RelErr(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i])) return INFINITY;
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - ref[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
  }
  return scale == 0 ? diff : diff / scale;
}

enum class Gate { kSoftplus, kBounded, kStrong };

// One sequence as the KDA layer hands it to the kernel (DESIGN §1.2).
struct Inputs {
  int64_t T, H, dk, dv;
  std::vector<float> q, k, v, g, beta, S;  // S: the initial state
};

Inputs MakeInputs(int64_t T, int64_t H, int64_t dk, int64_t dv, bool initial_state, Gate gate, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  auto randn = [&](int64_t n, float mean, float scale) {
    std::vector<float> x(n);
    for (auto& e : x) e = mean + scale * normal(rng);
    return x;
  };
  Inputs in{T, H, dk, dv, randn(T * H * dk, 0, 1), randn(T * H * dk, 0, 1), randn(T * H * dv, 0, 1), {}, {}, {}};
  KdaNormalizeQK(T, H, dk, in.q.data(), in.k.data());
  // Gate parameters as the model initializes them: exp(A_log) ∈ [1, 16], softplus(dt_bias) ∈ [1e-3, 0.1].
  std::vector<float> A_log(H), dt_bias(H * dk);
  for (auto& a : A_log) a = std::log(1.0f + 15.0f * uniform(rng));
  for (auto& b : dt_bias) {
    const float dt = 1e-3f * std::pow(100.0f, uniform(rng));
    b = dt + std::log(-std::expm1(-dt));
  }
  // Raw gate inputs; kStrong pushes softplus far up, so g reaches −hundreds and the decays underflow.
  in.g = gate == Gate::kStrong ? randn(T * H * dk, 10, 10) : randn(T * H * dk, 0, 1);
  if (gate == Gate::kBounded)
    KdaGateBounded(T, H, dk, in.g.data(), A_log.data(), dt_bias.data(), -5.0f, in.g.data());
  else
    KdaGateSoftplus(T, H, dk, in.g.data(), A_log.data(), dt_bias.data(), in.g.data());
  in.beta = randn(T * H, 0, 1);
  for (auto& b : in.beta) b = 1.0f / (1.0f + std::exp(-b));
  in.S = initial_state ? randn(H * dk * dv, 0, 1) : std::vector<float>(H * dk * dv, 0.0f);
  return in;
}

struct Result {
  std::vector<float> o, S;
};

Result RunRecurrent(const Inputs& in) {
  Result r{std::vector<float>(in.T * in.H * in.dv), in.S};
  KdaRecurrent(in.T, in.H, in.dk, in.dv, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
               r.S.data(), r.o.data());
  return r;
}

Result RunChunked(const Inputs& in, int64_t C) {
  Result r{std::vector<float>(in.T * in.H * in.dv, std::numeric_limits<float>::quiet_NaN()), in.S};
  KdaChunked(in.T, in.H, in.dk, in.dv, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
             r.S.data(), r.o.data(), C);
  return r;
}

struct Case {
  int64_t T, H, dk, dv, C;
  bool initial_state;
  Gate gate;
};

std::string Name(const Case& c) {
  const char* gate = c.gate == Gate::kSoftplus ? "softplus" : c.gate == Gate::kBounded ? "bounded" : "strong";
  return "T" + std::to_string(c.T) + "_H" + std::to_string(c.H) + "_dk" + std::to_string(c.dk) + "_dv" +
         std::to_string(c.dv) + "_C" + std::to_string(c.C) + (c.initial_state ? "_S0_" : "_zero_") + gate;
}
std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return Name(info.param); }
void PrintTo(const Case& c, std::ostream* os) { *os << Name(c); }

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int64_t T : {0, 1, 63, 64, 65, 200, 1000})
    for (bool initial_state : {false, true})
      for (int64_t H : {1, 3})
        for (auto [dk, dv] : {std::pair<int64_t, int64_t>{16, 16}, {32, 32}, {24, 40}})
          for (int64_t C : {64, 16}) cases.push_back({T, H, dk, dv, C, initial_state, Gate::kSoftplus});
  for (int64_t T : {1, 64, 200, 1000})
    for (int64_t C : {64, 16}) cases.push_back({T, 1, 128, 128, C, true, Gate::kSoftplus});
  cases.push_back({200, 3, 128, 128, 64, false, Gate::kSoftplus});
  for (int64_t T : {200, 1000})
    for (int64_t C : {64, 16}) cases.push_back({T, 3, 24, 40, C, true, Gate::kBounded});
  for (int64_t T : {65, 200})
    for (int64_t C : {64, 16}) cases.push_back({T, 3, 24, 40, C, true, Gate::kStrong});
  for (int64_t C : {1, 7, 100}) cases.push_back({200, 3, 24, 40, C, true, Gate::kSoftplus});  // odd chunk sizes
  return cases;
}

class KdaChunkedTest : public ::testing::TestWithParam<Case> {};

TEST_P(KdaChunkedTest, MatchesRecurrent) {
  const Case& c = GetParam();
  const Inputs in = MakeInputs(c.T, c.H, c.dk, c.dv, c.initial_state, c.gate, static_cast<uint32_t>(c.T * 7 + c.dk));
  const Result ref = RunRecurrent(in), got = RunChunked(in, c.C);
  EXPECT_LT(RelErr(got.o, ref.o), 1e-5);
  EXPECT_LT(RelErr(got.S, ref.S), 1e-5);
  if (c.T == 0) {
    EXPECT_EQ(got.S, in.S);
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, KdaChunkedTest, ::testing::ValuesIn(Cases()), CaseName);

// A prefill split in two calls, the state carried across, equals one call; so does a chunked prefix
// followed by the recurrence (prefill, then decode).
TEST(KdaChunked, SplitSequenceCarriesState) {
  const int64_t T = 200, H = 3, dk = 24, dv = 40;
  const Inputs in = MakeInputs(T, H, dk, dv, true, Gate::kSoftplus, 5);
  const Result whole = RunChunked(in, 64);
  for (int64_t T1 : {1, 64, 77, 199}) {
    std::vector<float> o(T * H * dv), S = in.S;
    KdaChunked(T1, H, dk, dv, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), S.data(), o.data());
    std::vector<float> o_dec = o, S_dec = S;
    const int64_t tk = T1 * H * dk, tv = T1 * H * dv;
    KdaChunked(T - T1, H, dk, dv, in.q.data() + tk, in.k.data() + tk, in.v.data() + tv, in.g.data() + tk,
               in.beta.data() + T1 * H, S.data(), o.data() + tv);
    KdaRecurrent(T - T1, H, dk, dv, in.q.data() + tk, in.k.data() + tk, in.v.data() + tv, in.g.data() + tk,
                 in.beta.data() + T1 * H, S_dec.data(), o_dec.data() + tv);
    EXPECT_LT(RelErr(o, whole.o), 1e-5) << "split at " << T1;
    EXPECT_LT(RelErr(S, whole.S), 1e-5) << "split at " << T1;
    EXPECT_LT(RelErr(o_dec, whole.o), 1e-5) << "split at " << T1;
    EXPECT_LT(RelErr(S_dec, whole.S), 1e-5) << "split at " << T1;
  }
}

// The comparison can fail: a wrong β for one token of one head, or a wrong gate channel, moves the
// output far beyond the tolerance.
TEST(KdaChunked, DetectsWrongInput) {
  const int64_t H = 3, dk = 32;
  const Inputs in = MakeInputs(200, H, dk, 32, true, Gate::kSoftplus, 9);
  const Result ref = RunRecurrent(in);
  Inputs bad_beta = in;
  bad_beta.beta[100 * H + 1] = 1.0f - bad_beta.beta[100 * H + 1];
  EXPECT_GT(RelErr(RunChunked(bad_beta, 64).o, ref.o), 1e-3);
  Inputs bad_g = in;
  bad_g.g[(199 * H + 1) * dk + 5] -= 1.0f;
  EXPECT_GT(RelErr(RunChunked(bad_g, 64).S, ref.S), 1e-3);
}

// A long prefill (64 chunks): the chunked form still equals the recurrence. Timings of the two are
// printed by k3serve-bench-cpu-kernels, not asserted here.
TEST(KdaChunked, LongPrefill) {
  const Inputs in = MakeInputs(4096, 4, 128, 128, true, Gate::kSoftplus, 11);
  const Result ref = RunRecurrent(in);
  const Result got = RunChunked(in, 64);
  EXPECT_LT(RelErr(got.o, ref.o), 1e-5);
  EXPECT_LT(RelErr(got.S, ref.S), 1e-5);
}

// Closed forms in double precision.
double Softplus(double x) { return std::log1p(std::exp(x)); }  // exact, no cut-off
double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Raw gate inputs spanning both sides of softplus's x > 20 cut-off, and far beyond where exp(x)
// overflows in fp32.
const std::vector<float> kRaw = {-30.0f, -5.0f, -0.5f, 0.0f, 0.7f, 3.0f, 19.5f, 20.5f, 30.0f, 100.0f, 500.0f, -2.0f};

TEST(KdaGate, SoftplusMatchesClosedForm) {
  const int64_t T = 2, H = 2, dk = 3;
  const std::vector<float> A_log = {-0.5f, 2.0f}, dt_bias = {0.1f, -0.3f, 0.0f, 0.25f, -1.0f, 0.05f};
  std::vector<float> g(T * H * dk);
  KdaGateSoftplus(T, H, dk, kRaw.data(), A_log.data(), dt_bias.data(), g.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H * dk; ++c) {
      const int64_t i = t * H * dk + c;
      const double ref = -std::exp(static_cast<double>(A_log[c / dk])) * Softplus(double{kRaw[i]} + dt_bias[c]);
      EXPECT_NEAR(g[i], ref, 1e-6 * std::max(1.0, std::fabs(ref))) << "raw " << kRaw[i];
    }
  // g may alias raw.
  std::vector<float> in_place = kRaw;
  KdaGateSoftplus(T, H, dk, in_place.data(), A_log.data(), dt_bias.data(), in_place.data());
  EXPECT_EQ(in_place, g);
}

TEST(KdaGate, BoundedMatchesClosedForm) {
  const int64_t T = 3, H = 2, dk = 2;
  const std::vector<float> A_log = {0.3f, -1.2f}, dt_bias = {0.1f, -0.3f, 0.0f, 0.25f};
  const float lb = -5.0f;
  std::vector<float> g(T * H * dk);
  KdaGateBounded(T, H, dk, kRaw.data(), A_log.data(), dt_bias.data(), lb, g.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H * dk; ++c) {
      const int64_t i = t * H * dk + c;
      const double ref = lb * Sigmoid(std::exp(static_cast<double>(A_log[c / dk])) * (double{kRaw[i]} + dt_bias[c]));
      EXPECT_NEAR(g[i], ref, 1e-6 * std::fabs(lb)) << "raw " << kRaw[i];
      EXPECT_LE(g[i], 0.0f);
      EXPECT_GE(g[i], lb);
    }
}

TEST(KdaNormalizeQK, MatchesClosedForm) {
  const int64_t T = 2, H = 3, dk = 24;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(T * H * dk), k(T * H * dk);
  for (auto& x : q) x = 3.0f * normal(rng);
  for (auto& x : k) x = normal(rng);
  // Special rows: zero, |x|² = 1e-6 (the eps matters), and large.
  std::fill_n(q.begin() + 1 * dk, dk, 0.0f);
  std::fill_n(k.begin() + 2 * dk, dk, 1e-3f / std::sqrt(static_cast<float>(dk)));
  for (int64_t i = 0; i < dk; ++i) q[4 * dk + i] *= 1e3f;
  const std::vector<float> q0 = q, k0 = k;
  KdaNormalizeQK(T, H, dk, q.data(), k.data());
  for (int64_t row = 0; row < T * H; ++row) {
    double qq = 0, kk = 0;
    for (int64_t i = 0; i < dk; ++i) {
      qq += double{q0[row * dk + i]} * q0[row * dk + i];
      kk += double{k0[row * dk + i]} * k0[row * dk + i];
    }
    const double q_scale = 1.0 / std::sqrt(qq + 1e-6) / std::sqrt(static_cast<double>(dk));
    const double k_scale = 1.0 / std::sqrt(kk + 1e-6);
    for (int64_t i = 0; i < dk; ++i) {
      const double q_ref = q0[row * dk + i] * q_scale, k_ref = k0[row * dk + i] * k_scale;
      EXPECT_NEAR(q[row * dk + i], q_ref, 1e-6 * std::fabs(q_ref) + 1e-9) << "row " << row;
      EXPECT_NEAR(k[row * dk + i], k_ref, 1e-6 * std::fabs(k_ref) + 1e-9) << "row " << row;
    }
  }
  EXPECT_NEAR(k[2 * dk] * std::sqrt(static_cast<float>(dk)), 1.0 / std::sqrt(2.0), 1e-5);  // eps halves |k|²
}

}  // namespace
}  // namespace k3::cpu
