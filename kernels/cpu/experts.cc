#include "kernels/cpu/experts.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace k3::cpu {
namespace {

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// An expert matrix as fp32: the weights themselves, or the MXFP4 ones dequantized into *buf.
const float* Fp32(const ExpertMatrix& W, int64_t rows, int64_t cols, std::vector<float>* buf) {
  if (W.f32 != nullptr) return W.f32;
  buf->resize(rows * cols);
  DequantizeMxfp4(W.mxfp4, cols, 0, rows, buf->data());
  return buf->data();
}

}  // namespace

void GluActivate(int64_t n, const float* g, const float* u, float* h, const GluParams& p) {
  if (p.act == GluAct::kSilu) {
    for (int64_t i = 0; i < n; ++i) h[i] = g[i] * Sigmoid(g[i]) * u[i];
  } else {
    const float b1 = p.situ_beta, b2 = p.situ_linear_beta;
    for (int64_t i = 0; i < n; ++i)
      h[i] = b1 * std::tanh(g[i] / b1) * Sigmoid(g[i]) * (b2 * std::tanh(u[i] / b2));
  }
}

void GluActivateRef(int64_t n, const float* g, const float* u, float* h, const GluParams& p) {
  for (int64_t i = 0; i < n; ++i) {
    const double gg = g[i], uu = u[i];
    const double sig = 1.0 / (1.0 + std::exp(-gg));
    if (p.act == GluAct::kSilu) {
      h[i] = static_cast<float>(gg * sig * uu);
    } else {
      const double b1 = p.situ_beta, b2 = p.situ_linear_beta;
      h[i] = static_cast<float>(b1 * std::tanh(gg / b1) * sig * b2 * std::tanh(uu / b2));
    }
  }
}

void GluMlp(int64_t M, int64_t D, int64_t I, const float* x, const float* W1, const float* W3, const float* W2,
            const GluParams& p, float* y, float beta) {
  if (M == 0) return;
  std::vector<float> g(M * I), u(M * I);
  Linear(M, I, D, x, W1, g.data());
  Linear(M, I, D, x, W3, u.data());
  GluActivate(M * I, g.data(), u.data(), g.data(), p);
  Linear(M, D, I, g.data(), W2, y, beta);
}

void ExpertLinear(int64_t M, int64_t N, int64_t K, const float* x, const ExpertMatrix& W, float* y, float beta) {
  if (W.f32 != nullptr) {
    Linear(M, N, K, x, W.f32, y, beta);
  } else {
    LinearMxfp4(M, N, K, x, W.mxfp4, y, beta);
  }
}

void GluMlp(int64_t M, int64_t D, int64_t I, const float* x, const ExpertWeights& W, const GluParams& p, float* y,
            float beta) {
  if (M == 0) return;
  std::vector<float> g(M * I), u(M * I);
  ExpertLinear(M, I, D, x, W.w1, g.data());
  ExpertLinear(M, I, D, x, W.w3, u.data());
  GluActivate(M * I, g.data(), u.data(), g.data(), p);
  ExpertLinear(M, D, I, g.data(), W.w2, y, beta);
}

void GluMlpRef(int64_t M, int64_t D, int64_t I, const float* x, const float* W1, const float* W3, const float* W2,
               const GluParams& p, float* y) {
  std::vector<float> g(M * I), u(M * I);
  LinearRef(M, I, D, x, W1, g.data());
  LinearRef(M, I, D, x, W3, u.data());
  GluActivateRef(M * I, g.data(), u.data(), g.data(), p);
  LinearRef(M, D, I, g.data(), W2, y);
}

void MoeExperts(int64_t N, int64_t D, int64_t I, int64_t k, const float* x, const int32_t* idx, const float* w,
                int64_t num_experts, const ExpertWeights* experts, const GluParams& p, float* out) {
  for (int64_t i = 0; i < N * D; ++i) out[i] = 0.0f;
  if (N == 0) return;
  // Bucket the (row, pair) entries by expert: counting sort keeps rows in order inside a bucket.
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t i = 0; i < N * k; ++i)
    if (idx[i] >= 0) count[idx[i] + 1]++;
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];
  std::vector<int64_t> order(count[num_experts]);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < N * k; ++i)
    if (idx[i] >= 0) order[fill[idx[i]]++] = i;

  std::vector<float> xs, ys;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = count[e], m = count[e + 1] - begin;
    if (m == 0) continue;
    xs.resize(m * D);
    ys.resize(m * D);
    for (int64_t r = 0; r < m; ++r) {
      const float* src = x + (order[begin + r] / k) * D;
      std::copy(src, src + D, xs.begin() + r * D);
    }
    GluMlp(m, D, I, xs.data(), experts[e], p, ys.data());
    for (int64_t r = 0; r < m; ++r) {
      const int64_t pair = order[begin + r];
      const float wt = w[pair];
      float* dst = out + (pair / k) * D;
      for (int64_t c = 0; c < D; ++c) dst[c] += wt * ys[r * D + c];
    }
  }
}

void MoeExpertsRef(int64_t N, int64_t D, int64_t I, int64_t k, const float* x, const int32_t* idx, const float* w,
                   const ExpertWeights* experts, const GluParams& p, float* out) {
  std::vector<float> y(D), b1, b3, b2;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < D; ++c) out[n * D + c] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[n * k + j];
      if (e < 0) continue;
      const ExpertWeights& ew = experts[e];
      GluMlpRef(1, D, I, x + n * D, Fp32(ew.w1, I, D, &b1), Fp32(ew.w3, I, D, &b3), Fp32(ew.w2, D, I, &b2), p,
                y.data());
      for (int64_t c = 0; c < D; ++c) out[n * D + c] += w[n * k + j] * y[c];
    }
  }
}

}  // namespace k3::cpu
