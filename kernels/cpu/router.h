// Sigmoid router with score-correction bias and group-limited top-k (DESIGN §1.4), fp32.
#pragma once

#include <cstdint>

namespace k3::cpu {

struct RouterParams {
  int64_t num_experts = 0;   // E
  int64_t top_k = 0;         // k
  int64_t num_groups = 1;    // num_expert_group
  int64_t topk_groups = 1;   // topk_group
  bool renormalize = false;  // moe_renormalize
  float scale = 1.0f;        // routed_scaling_factor
};

// logits [N, E] = m · W_gateᵀ; bias [E] (e_score_correction_bias) or null.
// s = sigmoid(logits), s' = s + bias; groups keep the topk_groups best by the sum of their top-2 s';
// idx = top-k(s') among kept experts (ties: lower expert id first); w = s[idx], renormalized
// (w /= Σw + 1e-20) if asked, times scale. idx, w [N, k], in descending s' order.
void RouteTopK(int64_t N, const float* logits, const float* bias, const RouterParams& p, int32_t* idx, float* w);
// Reference: full sorts, double arithmetic.
void RouteTopKRef(int64_t N, const float* logits, const float* bias, const RouterParams& p, int32_t* idx, float* w);

// Quantile-Balancing histogram (DESIGN §1.5) over [rmin, rmax] in `bins` bins.
struct QbHistParams {
  int64_t bins = 0;
  float rmin = 0.0f;
  float rmax = 0.0f;
};
// With s' as RouteTopKRef computes it (float(sigmoid in double) + bias): α_n = token n's (k+1)-th largest s'
// among the experts of its kept groups (ranked as RouteTopKRef ranks them; k + 1 must not exceed them), and
// for every expert e, r = α_n − s'_e (fp32) adds 1 to hist[b·E + e],
// b = clamp(floor((r − rmin) · (bins / (rmax − rmin))), 0, bins − 1), all in fp32. hist [bins, E] accumulates
// (int32_t or int64_t counts): N·E increments, so a caller adds into its running histogram directly.
template <class Count>
void QbHistogram(int64_t N, const float* logits, const float* bias, const RouterParams& p, const QbHistParams& h,
                 Count* hist);
// Reference: α from RouteTopKRef's full ranking.
void QbHistogramRef(int64_t N, const float* logits, const float* bias, const RouterParams& p, const QbHistParams& h,
                    int32_t* hist);

}  // namespace k3::cpu
