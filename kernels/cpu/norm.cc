#include "kernels/cpu/norm.h"

#include <cmath>

namespace k3::cpu {

void RmsNorm(int64_t M, int64_t D, const float* x, const float* w, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    float ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    if (w != nullptr) {
      for (int64_t i = 0; i < D; ++i) yr[i] = w[i] * (xr[i] * r);
    } else {
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * r;
    }
  }
}

void RmsNormRef(int64_t M, int64_t D, const float* x, const float* w, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[m * D + i]) * x[m * D + i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
    for (int64_t i = 0; i < D; ++i)
      y[m * D + i] = static_cast<float>((w ? w[i] : 1.0) * x[m * D + i] * r);
  }
}

void GatedRmsNorm(int64_t M, int64_t D, const float* x, const float* gate, const float* w, float eps, float* y) {
  RmsNorm(M, D, x, w, eps, y);
  for (int64_t i = 0; i < M * D; ++i) y[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
}

void GatedRmsNormRef(int64_t M, int64_t D, const float* x, const float* gate, const float* w, float eps, float* y) {
  RmsNormRef(M, D, x, w, eps, y);
  for (int64_t i = 0; i < M * D; ++i) y[i] = static_cast<float>(y[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))));
}

void L2Norm(int64_t M, int64_t D, float* x, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    float* xr = x + m * D;
    float ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss + eps);
    for (int64_t i = 0; i < D; ++i) xr[i] *= r;
  }
}

}  // namespace k3::cpu
