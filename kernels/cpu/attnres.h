// Block Attention Residuals read (DESIGN §1.5), fp32.
//
// For each of N tokens, over sources v_0..v_{m-1} (each [N, d]):
//   key_j = v_j / sqrt(mean(v_j²) + eps);  p = softmax_j((n ⊙ w) · key_j);  out = Σ_j p_j v_j
#pragma once

#include <cstdint>
#include <vector>

namespace k3::cpu {

// The naive read: every source at every read.
void AttnResRead(int64_t N, int64_t d, const float* const* sources, int64_t m, const float* w, const float* n,
                 float eps, float* out);

// One read's parameters: pseudo-query w [d] and key norm weight n [d].
struct AttnResQuery {
  const float* w = nullptr;
  const float* n = nullptr;
};

// The serving schedule (Attention Residuals paper, Algorithm 1). Between two bank appends the
// completed blocks do not change, so all reads of a block share them:
//   phase 1 (Build, once per block): one pass over the bank computes, for every read r and token t,
//     the max of the logits, the sum of their exps and the exp-weighted sum of the sources;
//   phase 2 (Merge, at each read): an online-softmax update folds in the live partial sum.
// An empty bank is allowed: the read then returns the partial sum.
class BlockReads {
 public:
  // bank: m sources of [N, d]; reads: the R reads of the block, in order.
  void Build(int64_t N, int64_t d, const float* const* bank, int64_t m, const AttnResQuery* reads, int64_t R,
             float eps);
  // out [N, d] = read r over the bank and partial [N, d].
  void Merge(int64_t r, const float* partial, float* out) const;
  int64_t num_reads() const { return R_; }

 private:
  int64_t N_ = 0, d_ = 0, R_ = 0;
  float eps_ = 0;
  std::vector<float> q_;       // [R, d]: n ⊙ w
  std::vector<float> max_;     // [R, N]
  std::vector<float> sumexp_;  // [R, N]
  std::vector<float> acc_;     // [R, N, d]: Σ_j exp(logit_j − max) v_j
};

}  // namespace k3::cpu
