#include "kernels/cpu/kda.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/norm.h"

namespace k3::cpu {
namespace {
inline float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace

void KdaGateSoftplus(int64_t T, int64_t H, int64_t dk, const float* raw, const float* A_log, const float* dt_bias,
                     float* g) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float a = -std::exp(A_log[h]);
      for (int64_t i = 0; i < dk; ++i) {
        const int64_t c = h * dk + i;
        g[t * H * dk + c] = a * Softplus(raw[t * H * dk + c] + dt_bias[c]);
      }
    }
}

void KdaGateBounded(int64_t T, int64_t H, int64_t dk, const float* raw, const float* A_log, const float* dt_bias,
                    float lower_bound, float* g) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float a = std::exp(A_log[h]);
      for (int64_t i = 0; i < dk; ++i) {
        const int64_t c = h * dk + i;
        g[t * H * dk + c] = lower_bound * Sigmoid(a * (raw[t * H * dk + c] + dt_bias[c]));
      }
    }
}

void KdaNormalizeQK(int64_t T, int64_t H, int64_t dk, float* q, float* k) {
  L2Norm(T * H, dk, q, 1e-6f);
  L2Norm(T * H, dk, k, 1e-6f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t i = 0; i < T * H * dk; ++i) q[i] *= scale;
}

void KdaRecurrent(int64_t T, int64_t H, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                  const float* g, const float* beta, float* S, float* o) {
  std::vector<float> u(dv);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* Sh = S + h * dk * dv;
      const float* qt = q + (t * H + h) * dk;
      const float* kt = k + (t * H + h) * dk;
      const float* vt = v + (t * H + h) * dv;
      const float* gt = g + (t * H + h) * dk;
      float* ot = o + (t * H + h) * dv;
      const float b = beta[t * H + h];
      // Decay rows, and accumulate Sᵀk with the decayed state in the same pass.
      for (int64_t j = 0; j < dv; ++j) ot[j] = 0.0f;  // temporarily Sᵀk
      for (int64_t i = 0; i < dk; ++i) {
        const float decay = std::exp(gt[i]);
        float* row = Sh + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
          row[j] *= decay;
          ot[j] += row[j] * kt[i];
        }
      }
      for (int64_t j = 0; j < dv; ++j) ot[j] = b * (vt[j] - ot[j]);  // u
      // S += k uᵀ and o = Sᵀq after the update.
      for (int64_t j = 0; j < dv; ++j) u[j] = ot[j], ot[j] = 0.0f;
      for (int64_t i = 0; i < dk; ++i) {
        float* row = Sh + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
          row[j] += kt[i] * u[j];
          ot[j] += row[j] * qt[i];
        }
      }
    }
}

}  // namespace k3::cpu
