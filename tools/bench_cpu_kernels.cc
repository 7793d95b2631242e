// k3serve-bench-cpu-kernels: the CPU kernels against their plain alternatives — KDA chunked vs
// recurrent prefill, MLA absorbed vs expanded decode, Linear vs the naive GEMM, and at the experts' shapes
// our Linear vs OpenBLAS's sgemm.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/mla.h"

namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double BestMs(const std::function<void()>& run, int reps = 3) {
  double best = INFINITY;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  using namespace k3::cpu;
  {  // KDA prefill
    const int64_t T = 4096, H = 4, D = 128;
    auto q = Random(T * H * D, 1), k = Random(T * H * D, 2), v = Random(T * H * D, 3), raw = Random(T * H * D, 4),
         b = Random(T * H, 5), A_log = Random(H, 6), dt = Random(H * D, 7);
    KdaNormalizeQK(T, H, D, q.data(), k.data());
    std::vector<float> g(T * H * D), o(T * H * D), S(H * D * D);
    KdaGateSoftplus(T, H, D, raw.data(), A_log.data(), dt.data(), g.data());
    for (auto& x : b) x = 1.0f / (1.0f + std::exp(-x));
    const double rec = BestMs([&] {
      std::fill(S.begin(), S.end(), 0.0f);
      KdaRecurrent(T, H, D, D, q.data(), k.data(), v.data(), g.data(), b.data(), S.data(), o.data());
    });
    const double chk = BestMs([&] {
      std::fill(S.begin(), S.end(), 0.0f);
      KdaChunked(T, H, D, D, q.data(), k.data(), v.data(), g.data(), b.data(), S.data(), o.data());
    });
    std::printf("KDA prefill T=%ld H=%ld dk=dv=%ld: recurrent %.1f ms, chunked (C=64) %.1f ms, %.2fx\n", (long)T, (long)H,
                (long)D, rec, chk, rec / chk);
  }
  {  // MLA: T new tokens after P cached, Kimi-Linear-48B head shapes
    const MlaShape s{32, 128, 64, 128, 512};
    const int64_t P = 2048;
    for (int64_t T : {1, 4, 8, 16, 64}) {
      const int64_t L = P + T;
      auto q = Random(T * s.nh * (s.dn + s.dr), 8), cache = Random(L * (s.r + s.dr), 9),
           kv_b = Random(s.nh * (s.dn + s.dv) * s.r, 10);
      std::vector<float> out(T * s.nh * s.dv);
      const double ab = BestMs([&] { MlaAttentionAbsorbed(T, P, s, q.data(), cache.data(), kv_b.data(), 0.07f, out.data()); });
      const double ex = BestMs([&] { MlaAttentionExpanded(T, P, s, q.data(), cache.data(), kv_b.data(), 0.07f, out.data()); });
      std::printf("MLA %ld new tokens after %ld cached: absorbed %.2f ms, expanded %.2f ms\n", (long)T, (long)P, ab, ex);
    }
  }
  {  // GEMM
    const int64_t M = 64, N = 1024, K = 1024;
    auto x = Random(M * K, 11), W = Random(N * K, 12);
    std::vector<float> y(M * N);
    const double ours = BestMs([&] { Linear(M, N, K, x.data(), W.data(), y.data()); });
    const double naive = BestMs([&] { LinearRef(M, N, K, x.data(), W.data(), y.data()); }, 1);
    std::printf("GEMM %ldx%ldx%ld: Linear %.1f GFLOP/s, naive %.2f GFLOP/s\n", (long)M, (long)N, (long)K,
                2e-6 * M * N * K / ours, 2e-6 * M * N * K / naive);
  }
  {  // An expert's products at the few rows a decode step gives it: weights of 16 experts cycled, as in a layer
    std::printf("expert products x[M, K] · W[N, K]ᵀ, 16 experts' weights in turn: "
                "us a product (OpenBLAS sgemm / Linear)\n");
    for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 128}, {256, 1024}, {1024, 256}, {4096, 1024}}) {
      std::vector<std::vector<float>> W;
      for (int e = 0; e < 16; ++e) W.push_back(Random(N * K, 20 + e));
      std::printf("  N %4ld K %4ld:", (long)N, (long)K);
      for (int64_t M : {1, 2, 4, 8, 16, 64, 512}) {
        auto x = Random(M * K, 13);
        std::vector<float> y(M * N);
        const int reps = M * N * K > (int64_t{1} << 26) ? 2 : 64;
        const double blas = BestMs([&] {
          for (int r = 0; r < reps; ++r)
            Gemm(false, true, M, N, K, 1.0f, x.data(), K, W[r % 16].data(), K, 0.0f, y.data(), N);
        });
        const double ours = BestMs([&] {
          for (int r = 0; r < reps; ++r) Linear(M, N, K, x.data(), W[r % 16].data(), y.data());
        });
        std::printf("  M %ld %.1f / %.1f", (long)M, 1e3 * blas / reps, 1e3 * ours / reps);
      }
      std::printf("\n");
    }
  }
  return 0;
}
