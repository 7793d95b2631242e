#include "kernels/cpu/attnres.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace k3::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float Dot(const float* a, const float* b, int64_t d) {
  float s = 0;
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// q · key with key = v / rms(v); the naive and the two-phase read share it, so their logits agree.
float Logit(const float* q, const float* v, float sum_sq, int64_t d, float eps) {
  return Dot(q, v, d) / std::sqrt(sum_sq / static_cast<float>(d) + eps);
}

void Query(int64_t d, const float* w, const float* n, float* q) {
  for (int64_t i = 0; i < d; ++i) q[i] = n[i] * w[i];
}

}  // namespace

void AttnResRead(int64_t N, int64_t d, const float* const* sources, int64_t m, const float* w, const float* n,
                 float eps, float* out) {
  std::vector<float> q(d), logit(m);
  Query(d, w, n, q.data());
  for (int64_t t = 0; t < N; ++t) {
    float mx = kNegInf;
    for (int64_t j = 0; j < m; ++j) {
      const float* v = sources[j] + t * d;
      logit[j] = Logit(q.data(), v, Dot(v, v, d), d, eps);
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

void BlockReads::Build(int64_t N, int64_t d, const float* const* bank, int64_t m, const AttnResQuery* reads,
                       int64_t R, float eps) {
  N_ = N, d_ = d, R_ = R, eps_ = eps;
  q_.resize(R * d);
  for (int64_t r = 0; r < R; ++r) Query(d, reads[r].w, reads[r].n, q_.data() + r * d);
  max_.assign(R * N, kNegInf);
  sumexp_.assign(R * N, 0.0f);
  acc_.assign(R * N * d, 0.0f);
  if (m == 0) return;
  // Token by token, each bank row is read once for all R reads (its sum of squares once too).
  std::vector<float> logit(R * m);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t j = 0; j < m; ++j) {
      const float* v = bank[j] + t * d;
      const float sum_sq = Dot(v, v, d);
      for (int64_t r = 0; r < R; ++r) logit[r * m + j] = Logit(q_.data() + r * d, v, sum_sq, d, eps);
    }
    for (int64_t r = 0; r < R; ++r) {
      float* l = logit.data() + r * m;
      const float mx = *std::max_element(l, l + m);
      float sum = 0;
      for (int64_t j = 0; j < m; ++j) sum += (l[j] = std::exp(l[j] - mx));
      float* acc = acc_.data() + (r * N + t) * d;
      for (int64_t j = 0; j < m; ++j) {
        const float* v = bank[j] + t * d;
        for (int64_t i = 0; i < d; ++i) acc[i] += l[j] * v[i];
      }
      max_[r * N + t] = mx;
      sumexp_[r * N + t] = sum;
    }
  }
}

void BlockReads::Merge(int64_t r, const float* partial, float* out) const {
  const int64_t N = N_, d = d_;
  const float* q = q_.data() + r * d;
  for (int64_t t = 0; t < N; ++t) {
    const float* v = partial + t * d;
    const float l = Logit(q, v, Dot(v, v, d), d, eps_);
    const float bank_max = max_[r * N + t];
    const float mx = std::max(bank_max, l);
    const float a = std::exp(bank_max - mx), b = std::exp(l - mx);  // a = 0 for an empty bank
    const float inv = 1.0f / (sumexp_[r * N + t] * a + b);
    const float* acc = acc_.data() + (r * N + t) * d;
    float* o = out + t * d;
    for (int64_t i = 0; i < d; ++i) o[i] = (a * acc[i] + b * v[i]) * inv;
  }
}

}  // namespace k3::cpu
