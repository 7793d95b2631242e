#include "kernels/cpu/attnres.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace k3::cpu {

void AttnResRead(int64_t N, int64_t d, const float* const* sources, int64_t m, const float* w, const float* n,
                 float eps, float* out) {
  std::vector<float> q(d), logit(m);
  for (int64_t i = 0; i < d; ++i) q[i] = n[i] * w[i];
  for (int64_t t = 0; t < N; ++t) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < m; ++j) {
      const float* v = sources[j] + t * d;
      float ss = 0, dot = 0;
      for (int64_t i = 0; i < d; ++i) {
        ss += v[i] * v[i];
        dot += q[i] * v[i];
      }
      logit[j] = dot / std::sqrt(ss / static_cast<float>(d) + eps);
      mx = std::max(mx, logit[j]);
    }
    float sum = 0;
    for (int64_t j = 0; j < m; ++j) sum += (logit[j] = std::exp(logit[j] - mx));
    float* o = out + t * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t j = 0; j < m; ++j) {
      const float p = logit[j] / sum;
      const float* v = sources[j] + t * d;
      for (int64_t i = 0; i < d; ++i) o[i] += p * v[i];
    }
  }
}

}  // namespace k3::cpu
