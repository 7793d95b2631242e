// Zipf-skewed token counts per expert, for the expert benchmarks (k3serve-bench-kernels,
// k3serve-bench-mxfp4).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <utility>
#include <vector>

namespace k3::cuda {

// Tokens per expert averaging `avg` over E experts, Zipf-skewed: expert e (rank e + 1) gets ∝ (e + 1)^−s,
// rounded by largest remainder, at least one each.
inline std::vector<int64_t> ZipfCounts(int64_t E, int64_t avg, double s) {
  std::vector<double> q(E);
  for (int64_t e = 0; e < E; ++e) q[e] = std::pow(double(e + 1), -s);
  const double qsum = std::accumulate(q.begin(), q.end(), 0.0);
  const int64_t total = E * avg;
  std::vector<int64_t> c(E);
  std::vector<std::pair<double, int64_t>> rem(E);
  int64_t used = 0;
  for (int64_t e = 0; e < E; ++e) {
    const double x = total * q[e] / qsum;
    c[e] = std::max<int64_t>(1, static_cast<int64_t>(x));
    used += c[e];
    rem[e] = {x - std::floor(x), e};
  }
  std::sort(rem.begin(), rem.end(), std::greater<>());
  for (int64_t i = 0; used < total; ++i, ++used) c[rem[i % E].second]++;
  for (; used > total; --used) c[0]--;
  return c;
}

}  // namespace k3::cuda
