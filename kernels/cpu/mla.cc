#include "kernels/cpu/mla.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace k3::cpu {
namespace {

// Causal softmax over rows of scores [T, L]: row t sees columns 0..P+t.
void CausalSoftmax(int64_t T, int64_t P, int64_t L, float* scores) {
  for (int64_t t = 0; t < T; ++t) {
    float* row = scores + t * L;
    const int64_t n = P + t + 1;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - mx));
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    std::fill(row + n, row + L, 0.0f);
  }
}

}  // namespace

void MlaAttentionExpanded(int64_t T, int64_t P, const MlaShape& s, const float* q, const float* cache,
                          const float* kv_b, float scale, float* out) {
  if (T == 0) return;
  const int64_t L = P + T, dqk = s.dn + s.dr, dkv = s.dn + s.dv, cw = s.r + s.dr;
  std::vector<float> kv(L * s.nh * dkv), k(L * dqk), scores(T * L);
  Gemm(false, true, L, s.nh * dkv, s.r, 1.0f, cache, cw, kv_b, s.r, 0.0f, kv.data(), s.nh * dkv);
  for (int64_t h = 0; h < s.nh; ++h) {
    for (int64_t j = 0; j < L; ++j) {
      std::copy_n(kv.data() + j * s.nh * dkv + h * dkv, s.dn, k.data() + j * dqk);
      std::copy_n(cache + j * cw + s.r, s.dr, k.data() + j * dqk + s.dn);
    }
    Gemm(false, true, T, L, dqk, scale, q + h * dqk, s.nh * dqk, k.data(), dqk, 0.0f, scores.data(), L);
    CausalSoftmax(T, P, L, scores.data());
    Gemm(false, false, T, s.dv, L, 1.0f, scores.data(), L, kv.data() + h * dkv + s.dn, s.nh * dkv, 0.0f,
         out + h * s.dv, s.nh * s.dv);
  }
}

void MlaAttentionAbsorbed(int64_t T, int64_t P, const MlaShape& s, const float* q, const float* cache,
                          const float* kv_b, float scale, float* out) {
  if (T == 0) return;
  const int64_t L = P + T, dqk = s.dn + s.dr, dkv = s.dn + s.dv, cw = s.r + s.dr;
  std::vector<float> qlat(T * cw), scores(T * L), ctx(T * s.r);
  for (int64_t h = 0; h < s.nh; ++h) {
    const float* w_uk = kv_b + h * dkv * s.r;  // [dn, r]
    const float* w_uv = w_uk + s.dn * s.r;     // [dv, r]
    // qlat = [q_nope · W_UK | q_r]  [T, r+dr]
    Gemm(false, false, T, s.r, s.dn, 1.0f, q + h * dqk, s.nh * dqk, w_uk, s.r, 0.0f, qlat.data(), cw);
    for (int64_t t = 0; t < T; ++t) std::copy_n(q + t * s.nh * dqk + h * dqk + s.dn, s.dr, qlat.data() + t * cw + s.r);
    Gemm(false, true, T, L, cw, scale, qlat.data(), cw, cache, cw, 0.0f, scores.data(), L);
    CausalSoftmax(T, P, L, scores.data());
    Gemm(false, false, T, s.r, L, 1.0f, scores.data(), L, cache, cw, 0.0f, ctx.data(), s.r);
    Gemm(false, true, T, s.dv, s.r, 1.0f, ctx.data(), s.r, w_uv, s.r, 0.0f, out + h * s.dv, s.nh * s.dv);
  }
}

void MlaAttentionRef(int64_t T, int64_t P, const MlaShape& s, const float* q, const float* cache, const float* kv_b,
                     float scale, float* out) {
  const int64_t L = P + T, dqk = s.dn + s.dr, dkv = s.dn + s.dv, cw = s.r + s.dr;
  // Expand keys and values per head and token.
  std::vector<double> K(L * s.nh * dqk), V(L * s.nh * s.dv);
  for (int64_t j = 0; j < L; ++j)
    for (int64_t h = 0; h < s.nh; ++h) {
      for (int64_t d = 0; d < dkv; ++d) {
        double acc = 0;
        for (int64_t c = 0; c < s.r; ++c) acc += static_cast<double>(kv_b[(h * dkv + d) * s.r + c]) * cache[j * cw + c];
        if (d < s.dn)
          K[(j * s.nh + h) * dqk + d] = acc;
        else
          V[(j * s.nh + h) * s.dv + d - s.dn] = acc;
      }
      for (int64_t d = 0; d < s.dr; ++d) K[(j * s.nh + h) * dqk + s.dn + d] = cache[j * cw + s.r + d];
    }
  std::vector<double> p(L);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < s.nh; ++h) {
      const int64_t n = P + t + 1;
      double mx = -1e300;
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < dqk; ++d) dot += q[(t * s.nh + h) * dqk + d] * K[(j * s.nh + h) * dqk + d];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
      for (int64_t d = 0; d < s.dv; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += p[j] * V[(j * s.nh + h) * s.dv + d];
        out[(t * s.nh + h) * s.dv + d] = static_cast<float>(acc / sum);
      }
    }
}

}  // namespace k3::cpu
