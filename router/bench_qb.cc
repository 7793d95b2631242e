// k3serve-bench-qb: the quantile-balancing estimator on synthetic router scores (DESIGN §1.5).
//   k3serve-bench-qb [--experts 896 --top-k 16 --tokens 100000 --zipf 1.0,1.5 --bins 56,256,1000 --steps 3]
// Scores follow a Zipf popularity: logit_ij = T·(log p_j + G_ij) + c with p_j ∝ 1/j^S and G Gumbel
// noise, so that top-k picks experts like sampling without replacement ∝ p. For each exponent and
// bin count it prints max/mean expert load before and after the estimated bias (one solve, then
// re-solved on the same tokens as training re-solves per batch), and how far the histogram
// estimate is from the exact quantiles (by selection) in bin widths; "exact 1" is max/mean after
// one solve with the exact quantiles, the limit of a single solve whatever the bin count.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "router/qb.h"

namespace {

using k3::router::QbHistogram;

struct Args {
  int64_t experts = 896, top_k = 16, tokens = 100000, steps = 3;
  std::vector<double> zipf = {1.0, 1.5};
  std::vector<int64_t> bins = {56, 256, 1000};
};

// "1,2.5,3" → {1, 2.5, 3}; empty if any entry is not a number.
template <typename T>
std::vector<T> List(const char* s) {
  std::vector<T> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const double v = std::strtod(p, &end);
    if (end == p || (*end != ',' && *end != '\0')) return {};
    out.push_back(static_cast<T>(v));
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// s [N, E] = sigmoid(logits), as the router kernels compute it.
std::vector<float> Scores(const Args& a, double S) {
  const int64_t N = a.tokens, E = a.experts;
  std::vector<double> logp(E);
  double h = 0;
  for (int64_t j = 0; j < E; ++j) h += std::pow(static_cast<double>(j + 1), -S);
  for (int64_t j = 0; j < E; ++j) logp[j] = -S * std::log(static_cast<double>(j + 1)) - std::log(h);
  std::vector<float> s(N * E);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < E; ++j) {
      const double u = (static_cast<double>(Mix(static_cast<uint64_t>(i) * 1000003u + j) >> 11) + 0.5) * 0x1.0p-53;
      const double g = -std::log(-std::log(u));
      const double logit = 0.3 * (logp[j] + g) + 1.0;
      s[i * E + j] = static_cast<float>(1.0 / (1.0 + std::exp(-logit)));
    }
  return s;
}

struct Pass {
  std::vector<int64_t> load;  // tokens per expert
  QbHistogram hist;
  double max_over_mean = 0;
};

// One pass over the tokens with bias b: top-k loads, α, and the histogram of r = α − s'.
Pass Run(const Args& a, const std::vector<float>& s, const std::vector<float>& b, int64_t bins,
         std::vector<float>* alpha_out = nullptr) {
  const int64_t N = a.tokens, E = a.experts, k = a.top_k;
  Pass p;
  p.load.assign(E, 0);
  p.hist.bins = bins;
  p.hist.experts = E;
  k3::router::QbRange(b, &p.hist.rmin, &p.hist.rmax);
  p.hist.counts.assign(bins * E, 0);
  const float scale = static_cast<float>(bins) / (p.hist.rmax - p.hist.rmin);
  std::vector<float> sb(E), top(k + 1);
  if (alpha_out) alpha_out->resize(N);
  for (int64_t i = 0; i < N; ++i) {
    // α = the (k+1)-th largest s': a descending top-(k+1) list, most experts rejected by one compare.
    int64_t filled = 0;
    for (int64_t j = 0; j < E; ++j) {
      const float v = sb[j] = s[i * E + j] + b[j];
      if (filled == k + 1 && v <= top[k]) continue;
      int64_t pos = filled == k + 1 ? k : filled++;
      while (pos > 0 && top[pos - 1] < v) {
        top[pos] = top[pos - 1];
        --pos;
      }
      top[pos] = v;
    }
    const float alpha = top[k];
    if (alpha_out) (*alpha_out)[i] = alpha;
    for (int64_t j = 0; j < E; ++j) {
      if (sb[j] > alpha) p.load[j]++;
      const float pos = (alpha - sb[j] - p.hist.rmin) * scale;
      const int64_t bin = pos < 0.0f ? 0 : (pos >= static_cast<float>(bins) ? bins - 1 : static_cast<int64_t>(pos));
      p.hist.counts[bin * E + j]++;
    }
  }
  const double mean = static_cast<double>(N * k) / static_cast<double>(E);
  p.max_over_mean = static_cast<double>(*std::max_element(p.load.begin(), p.load.end())) / mean;
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "--experts") a.experts = std::atoll(argv[i + 1]);
    else if (f == "--top-k" || f == "--top_k") a.top_k = std::atoll(argv[i + 1]);
    else if (f == "--tokens") a.tokens = std::atoll(argv[i + 1]);
    else if (f == "--steps") a.steps = std::atoll(argv[i + 1]);
    else if (f == "--zipf") a.zipf = List<double>(argv[i + 1]);
    else if (f == "--bins") a.bins = List<int64_t>(argv[i + 1]);
    else {
      std::fprintf(stderr, "k3serve-bench-qb: unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  if (a.experts < 2 || a.top_k < 1 || a.top_k >= a.experts || a.tokens < 1 || a.steps < 1) {
    std::fprintf(stderr, "k3serve-bench-qb: need --experts >= 2, 1 <= --top-k < --experts, --tokens >= 1, --steps >= 1\n");
    return 2;
  }
  if (a.zipf.empty() || a.bins.empty() || *std::min_element(a.bins.begin(), a.bins.end()) < 1) {
    std::fprintf(stderr, "k3serve-bench-qb: --zipf and --bins take comma-separated numbers (bins >= 1)\n");
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::printf("QB estimator: E=%ld k=%ld, %ld tokens; max/mean = most-loaded expert's tokens over N*k/E\n",
              static_cast<long>(a.experts), static_cast<long>(a.top_k), static_cast<long>(a.tokens));
  std::printf("%-5s %5s %10s %9s %9s %10s %10s %9s %9s", "zipf", "bins", "bin width", "before", "exact 1", "max|est-",
              "max|est-", "after 1", "mean|b|");
  for (int64_t t = 2; t <= a.steps; ++t) std::printf(" %8s%ld", "after ", static_cast<long>(t));
  std::printf("\n%-5s %5s %10s %9s %9s %10s %10s %9s %9s\n", "", "", "", "", "", "exact|", "exact|/w", "", "");
  for (double S : a.zipf) {
    const std::vector<float> s = Scores(a, S);
    const std::vector<float> zero(a.experts, 0.0f);
    std::vector<float> alpha;
    const Pass before = Run(a, s, zero, a.bins.front(), &alpha);
    // The exact step, by selection over each expert's column of r = α − s' (b = 0).
    std::vector<float> exact(a.experts), column(a.tokens);
    const double q = static_cast<double>(a.top_k) / static_cast<double>(a.experts);
    double mean = 0;
    for (int64_t j = 0; j < a.experts; ++j) {
      for (int64_t i = 0; i < a.tokens; ++i) column[i] = alpha[i] - s[i * a.experts + j];
      exact[j] = k3::router::QbExactQuantile(column, q);
      mean += exact[j];
    }
    mean /= static_cast<double>(a.experts);
    for (float& v : exact) v -= static_cast<float>(mean);
    const double exact_after = Run(a, s, exact, a.bins.front()).max_over_mean;  // the best one solve can do
    for (int64_t bins : a.bins) {
      Pass p = bins == a.bins.front() ? before : Run(a, s, zero, bins);
      std::vector<float> b(a.experts, 0.0f);
      double dist = 0;
      std::vector<double> after;
      for (int64_t t = 1; t <= a.steps; ++t) {
        auto delta = k3::router::QbEstimate(p.hist, a.top_k);
        if (!delta.ok()) {
          std::fprintf(stderr, "k3serve-bench-qb: %s\n", std::string(delta.status().message()).c_str());
          return 1;
        }
        if (t == 1)
          for (int64_t j = 0; j < a.experts; ++j) dist = std::max(dist, static_cast<double>(std::fabs((*delta)[j] - exact[j])));
        for (int64_t j = 0; j < a.experts; ++j) b[j] += (*delta)[j];
        p = Run(a, s, b, bins);
        after.push_back(p.max_over_mean);
      }
      double mean_abs = 0;
      for (float v : b) mean_abs += std::fabs(v);
      mean_abs /= static_cast<double>(a.experts);
      const double w = 2.0 / static_cast<double>(bins);  // the first solve's range is [-1, 1]
      std::printf("%-5.2f %5ld %10.5f %9.3f %9.3f %10.6f %10.3f %9.3f %9.4f", S, static_cast<long>(bins), w,
                  before.max_over_mean, exact_after, dist, dist / w, after[0], mean_abs);
      for (size_t t = 1; t < after.size(); ++t) std::printf(" %9.3f", after[t]);
      std::printf("\n");
    }
  }
  std::printf("took %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
