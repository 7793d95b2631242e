#include "kernels/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

namespace k3::cpu {
namespace {

// a ranks before b: higher score, then lower id.
inline bool Before(float sa, int32_t a, float sb, int32_t b) { return sa > sb || (sa == sb && a < b); }

// One token, as the reference scores it: s = sigmoid (double), s' = float(float(s) + bias), and the experts
// of the kept groups in descending s' (ties: lower id first).
void RankRef(const float* logits, const float* bias, const RouterParams& p, std::vector<double>& s,
             std::vector<double>& sb, std::vector<int64_t>& cand) {
  const int64_t E = p.num_experts, G = p.num_groups, per_group = E / G;
  s.resize(E);
  sb.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    s[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
    sb[e] = static_cast<float>(static_cast<float>(s[e]) + (bias ? bias[e] : 0.0f));
  }
  std::vector<double> gscore(G);
  for (int64_t g = 0; g < G; ++g) {
    std::vector<double> v(sb.begin() + g * per_group, sb.begin() + (g + 1) * per_group);
    std::sort(v.rbegin(), v.rend());
    gscore[g] = v[0] + (v.size() > 1 ? v[1] : 0.0);
  }
  std::vector<int64_t> gorder(G);
  std::iota(gorder.begin(), gorder.end(), 0);
  std::stable_sort(gorder.begin(), gorder.end(), [&](int64_t a, int64_t b) { return gscore[a] > gscore[b]; });
  std::vector<char> kept(G, 0);
  for (int64_t i = 0; i < std::min(p.topk_groups, G); ++i) kept[gorder[i]] = 1;
  cand.clear();
  for (int64_t e = 0; e < E; ++e)
    if (kept[e / per_group]) cand.push_back(e);
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return sb[a] > sb[b]; });
}

// kept[g] = 1 for the topk_groups groups of highest score (the sum, in T, of a group's two highest s'; a
// one-expert group's own s'), ties to the lower id; every group when none is left out.
template <class T>
void KeepBestGroups(const T* sb, const RouterParams& p, std::vector<T>& score, std::vector<int32_t>& order,
                    std::vector<char>& kept) {
  const int64_t G = p.num_groups, per_group = p.num_experts / G;
  kept.assign(G, 1);
  if (G <= 1 || p.topk_groups >= G) return;
  score.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    T b1 = -std::numeric_limits<T>::infinity(), b2 = b1;
    for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
      if (sb[e] > b1) {
        b2 = b1;
        b1 = sb[e];
      } else if (sb[e] > b2) {
        b2 = sb[e];
      }
    }
    score[g] = b1 + (per_group > 1 ? b2 : T(0));
  }
  order.resize(G);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + p.topk_groups, order.end(), [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  std::fill(kept.begin(), kept.end(), 0);
  for (int64_t i = 0; i < p.topk_groups; ++i) kept[order[i]] = 1;
}

}  // namespace

void RouteTopK(int64_t N, const float* logits, const float* bias, const RouterParams& p, int32_t* idx, float* w) {
  const int64_t E = p.num_experts, k = p.top_k, G = p.num_groups, per_group = E / G;
  std::vector<float> s(E), sb(E), group_score;
  std::vector<char> group_kept;
  std::vector<int32_t> gorder;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) {
      s[e] = 1.0f / (1.0f + std::exp(-logits[n * E + e]));
      sb[e] = s[e] + (bias ? bias[e] : 0.0f);
    }
    KeepBestGroups(sb.data(), p, group_score, gorder, group_kept);
    // Insertion into a sorted top-k list: k is small (≤ 16 in every Kimi config).
    int32_t* ix = idx + n * k;
    int64_t filled = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (!group_kept[e / per_group]) continue;
      if (filled == k && !Before(sb[e], static_cast<int32_t>(e), sb[ix[k - 1]], ix[k - 1])) continue;
      int64_t pos = filled < k ? filled++ : k - 1;
      while (pos > 0 && Before(sb[e], static_cast<int32_t>(e), sb[ix[pos - 1]], ix[pos - 1])) {
        ix[pos] = ix[pos - 1];
        --pos;
      }
      ix[pos] = static_cast<int32_t>(e);
    }
    float* wn = w + n * k;
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += (wn[j] = s[ix[j]]);
    const float norm = p.renormalize ? 1.0f / (sum + 1e-20f) : 1.0f;
    for (int64_t j = 0; j < k; ++j) wn[j] = wn[j] * norm * p.scale;
  }
}

void RouteTopKRef(int64_t N, const float* logits, const float* bias, const RouterParams& p, int32_t* idx, float* w) {
  const int64_t E = p.num_experts, k = p.top_k;
  std::vector<double> s, sb;
  std::vector<int64_t> cand;
  for (int64_t n = 0; n < N; ++n) {
    RankRef(logits + n * E, bias, p, s, sb, cand);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += s[cand[j]];
    for (int64_t j = 0; j < k; ++j) {
      idx[n * k + j] = static_cast<int32_t>(cand[j]);
      w[n * k + j] = static_cast<float>(s[cand[j]] * (p.renormalize ? 1.0 / (sum + 1e-20) : 1.0) * p.scale);
    }
  }
}

namespace {

// Token n's r = α − s'_e into its bin, for every expert.
template <class Count>
void AddToBins(int64_t E, float alpha, const double* sb, const QbHistParams& h, Count* hist) {
  const float scale = static_cast<float>(h.bins) / (h.rmax - h.rmin);
  for (int64_t e = 0; e < E; ++e) {
    const float r = alpha - static_cast<float>(sb[e]);
    const float pos = (r - h.rmin) * scale;
    const int64_t b = pos < 0.0f ? 0 : (pos >= static_cast<float>(h.bins) ? h.bins - 1 : static_cast<int64_t>(pos));
    hist[b * E + e]++;
  }
}

}  // namespace

// α is a value: the (k+1)-th largest s' of the kept experts is the same whatever order ties take, so a
// selection gives RankRef's without its sorts. s' and the group scores are computed as RankRef does.
template <class Count>
void QbHistogram(int64_t N, const float* logits, const float* bias, const RouterParams& p, const QbHistParams& h,
                 Count* hist) {
  const int64_t E = p.num_experts, G = p.num_groups, per_group = E / G;
  std::vector<double> sb(E), gscore, cand;
  std::vector<int32_t> gorder;
  std::vector<char> kept;
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * E;
    for (int64_t e = 0; e < E; ++e) {
      const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
      sb[e] = static_cast<float>(static_cast<float>(s) + (bias ? bias[e] : 0.0f));
    }
    KeepBestGroups(sb.data(), p, gscore, gorder, kept);
    cand.clear();
    for (int64_t e = 0; e < E; ++e)
      if (kept[e / per_group]) cand.push_back(sb[e]);
    std::nth_element(cand.begin(), cand.begin() + p.top_k, cand.end(), std::greater<double>());
    AddToBins(E, static_cast<float>(cand[p.top_k]), sb.data(), h, hist);
  }
}

template void QbHistogram(int64_t, const float*, const float*, const RouterParams&, const QbHistParams&, int32_t*);
template void QbHistogram(int64_t, const float*, const float*, const RouterParams&, const QbHistParams&, int64_t*);

void QbHistogramRef(int64_t N, const float* logits, const float* bias, const RouterParams& p, const QbHistParams& h,
                    int32_t* hist) {
  std::vector<double> s, sb;
  std::vector<int64_t> cand;
  for (int64_t n = 0; n < N; ++n) {
    RankRef(logits + n * p.num_experts, bias, p, s, sb, cand);
    AddToBins(p.num_experts, static_cast<float>(sb[cand[p.top_k]]), sb.data(), h, hist);
  }
}

}  // namespace k3::cpu
