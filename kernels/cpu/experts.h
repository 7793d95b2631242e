// GLU MLPs on the CPU, fp32: dense MLP, shared experts, routed experts (DESIGN §1.4, §1.5).
#pragma once

#include <cstdint>

#include "kernels/cpu/mxfp4.h"

namespace k3::cpu {

enum class GluAct { kSilu, kSitu };

struct GluParams {
  GluAct act = GluAct::kSilu;
  float situ_beta = 4.0f;          // β1
  float situ_linear_beta = 25.0f;  // β2
};

// h[i] = act(g[i], u[i]):  SiLU: SiLU(g)·u.   SiTU: β1·tanh(g/β1)·sigmoid(g) · β2·tanh(u/β2).
void GluActivate(int64_t n, const float* g, const float* u, float* h, const GluParams& p);
void GluActivateRef(int64_t n, const float* g, const float* u, float* h, const GluParams& p);

// One GLU MLP: y = W2 · act(W1 x, W3 x); x [M, D], W1, W3 [I, D], W2 [D, I], y [M, D].
// beta = 1 accumulates into y.
void GluMlp(int64_t M, int64_t D, int64_t I, const float* x, const float* W1, const float* W3, const float* W2,
            const GluParams& p, float* y, float beta = 0.0f);
void GluMlpRef(int64_t M, int64_t D, int64_t I, const float* x, const float* W1, const float* W3, const float* W2,
               const GluParams& p, float* y);

// One expert projection [rows, cols]: fp32, or MXFP4 kept packed (dequantized a panel at a time
// inside the product, so an expert costs 4.25 bits per weight in memory).
struct ExpertMatrix {
  const float* f32 = nullptr;
  Mxfp4Matrix mxfp4;
  ExpertMatrix() = default;
  ExpertMatrix(const float* w) : f32(w) {}  // NOLINT: an fp32 matrix converts implicitly
  explicit ExpertMatrix(Mxfp4Matrix w) : mxfp4(w) {}
  bool loaded() const { return f32 != nullptr || mxfp4.packed != nullptr; }
};

// y = x · Wᵀ for an expert matrix W [N, K]; x [M, K], y [M, N].
void ExpertLinear(int64_t M, int64_t N, int64_t K, const float* x, const ExpertMatrix& W, float* y, float beta = 0.0f);

struct ExpertWeights {
  ExpertMatrix w1;  // [I, D]
  ExpertMatrix w3;  // [I, D]
  ExpertMatrix w2;  // [D, I]
};

// GluMlp with expert matrices (fp32 or MXFP4).
void GluMlp(int64_t M, int64_t D, int64_t I, const float* x, const ExpertWeights& W, const GluParams& p, float* y,
            float beta = 0.0f);

// Routed experts for N rows, each with k (expert, weight) pairs:
//   out[n] = Σ_j w[n, j] · E_{idx[n, j]}(x[n])
// experts[e] holds expert e's weights (E = num_experts entries). Pairs whose idx is negative are
// skipped (routed elsewhere). Rows are grouped by expert so each expert runs one GEMM over its rows.
void MoeExperts(int64_t N, int64_t D, int64_t I, int64_t k, const float* x, const int32_t* idx, const float* w,
                int64_t num_experts, const ExpertWeights* experts, const GluParams& p, float* out);
void MoeExpertsRef(int64_t N, int64_t D, int64_t I, int64_t k, const float* x, const int32_t* idx, const float* w,
                   const ExpertWeights* experts, const GluParams& p, float* out);

}  // namespace k3::cpu
