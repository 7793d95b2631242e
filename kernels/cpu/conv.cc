#include "kernels/cpu/conv.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace k3::cpu {
namespace {
inline float Silu(float x) { return x / (1.0f + std::exp(-x)); }
}  // namespace

void CausalConv1dSilu(int64_t T, int64_t C, int64_t K, const float* x, const float* w, float* state, float* y) {
  if (T == 0) return;
  const int64_t S = K - 1;
  // Window = [state; x] viewed as rows; row r < S comes from state, r >= S from x.
  auto row = [&](int64_t r) { return r < S ? state + r * C : x + (r - S) * C; };
  for (int64_t t = 0; t < T; ++t) {
    float* yr = y + t * C;
    std::fill(yr, yr + C, 0.0f);
    for (int64_t j = 0; j < K; ++j) {
      const float* in = row(t + j);
      for (int64_t c = 0; c < C; ++c) yr[c] += w[c * K + j] * in[c];
    }
    for (int64_t c = 0; c < C; ++c) yr[c] = Silu(yr[c]);
  }
  // New state: the last S rows of [state; x].
  std::vector<float> next(S * C);
  for (int64_t r = 0; r < S; ++r) std::copy(row(T + r), row(T + r) + C, next.begin() + r * C);
  std::copy(next.begin(), next.end(), state);
}

void CausalConv1dSiluRef(int64_t T, int64_t C, int64_t K, const float* x, const float* w, float* state, float* y) {
  const int64_t S = K - 1;
  std::vector<double> in((S + T) * C);
  for (int64_t i = 0; i < S * C; ++i) in[i] = state[i];
  for (int64_t i = 0; i < T * C; ++i) in[S * C + i] = x[i];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < K; ++j) acc += w[c * K + j] * in[(t + j) * C + c];
      y[t * C + c] = static_cast<float>(acc / (1.0 + std::exp(-acc)));
    }
  for (int64_t i = 0; i < S * C; ++i) state[i] = static_cast<float>(in[T * C + i]);
}

}  // namespace k3::cpu
