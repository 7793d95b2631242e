#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "kernels/cpu/attnres.h"
#include "kernels/cpu/conv.h"
#include "kernels/cpu/experts.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/mla.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/router.h"

namespace k3 {
namespace {

// The MLA LoRA norms use the reference RMSNorm's default eps, not rms_norm_eps (DESIGN §1.3).
constexpr float kLoraNormEps = 1e-6f;
// The absorbed MLA form costs per head T·L·(2(r+dr) − (dn+dr) − dv) more multiply-adds than the
// expanded one in its attention products, and saves expanding the L cached tokens through kv_b,
// L·(dn+dv)·r: it wins while T stays below the ratio (≈150 at Kimi-Linear shapes).
bool MlaAbsorbedIsCheaper(int64_t T, const cpu::MlaShape& s) {
  const int64_t extra = 2 * (s.r + s.dr) - (s.dn + s.dr) - s.dv;
  return extra <= 0 || T * extra <= (s.dn + s.dv) * s.r;
}
// From this many tokens the chunked KDA form beats the recurrence.
constexpr int64_t kKdaChunkedMinTokens = 16;

void KdaChunked(int64_t T, int64_t H, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                const float* g, const float* beta, float* S, float* o) {
  cpu::KdaChunked(T, H, dk, dv, q, k, v, g, beta, S, o);
}

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void Linear(int64_t M, const Mat& W, const float* x, float* y, float beta = 0.0f) {
  cpu::Linear(M, W.rows, W.cols, x, W.data, y, beta);
}

cpu::GluParams Glu(const ModelConfig& c) {
  return {c.act == Activation::kSitu ? cpu::GluAct::kSitu : cpu::GluAct::kSilu, c.situ_beta, c.situ_linear_beta};
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir, const WeightFilter& filter) {
  K3_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  K3_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(dir));
  K3_ASSIGN_OR_RETURN(auto weights, LoadWeights(config, std::make_shared<const Checkpoint>(std::move(ckpt)), filter));
  return std::make_unique<Model>(std::move(config), std::move(weights));
}

Model::Model(ModelConfig config, std::unique_ptr<ModelWeights> weights)
    : config_(std::move(config)), weights_(std::move(weights)) {}

absl::Status Model::Forward(std::span<const SeqChunk> chunks, ExpertExecutor& experts,
                            std::vector<float>* logits) const {
  ForwardPass pass(*this, chunks);
  ForwardPass* passes[] = {&pass};
  K3_RETURN_IF_ERROR(RunPasses(passes, experts));
  *logits = std::move(pass.logits());
  return absl::OkStatus();
}

ForwardPass::ForwardPass(const Model& model, std::span<const SeqChunk> chunks)
    : c_(model.config()), w_(model.weights()), chunks_(chunks.begin(), chunks.end()) {
  offset_.push_back(0);
  for (const auto& ch : chunks_) offset_.push_back(offset_.back() + static_cast<int64_t>(ch.tokens.size()));
  N_ = offset_.back();
}

absl::StatusOr<const ExpertRequest*> ForwardPass::RunToDispatch() {
  if (done_) return absl::FailedPreconditionError("forward pass already finished");
  const int64_t d = c_.hidden_size;
  if (layer_ == 0 && !awaiting_experts_ && x_.empty()) {
    for (size_t i = 0; i < chunks_.size(); ++i) {
      if (chunks_[i].tokens.empty()) return absl::InvalidArgumentError(absl::StrCat("chunk ", i, " has no tokens"));
      for (int32_t t : chunks_[i].tokens)
        if (t < 0 || t >= c_.vocab_size)
          return absl::InvalidArgumentError(absl::StrCat("token id ", t, " outside the vocabulary [0, ", c_.vocab_size, ")"));
    }
    x_.resize(N_ * d);
    for (int64_t i = 0, t = 0; i < static_cast<int64_t>(chunks_.size()); ++i)
      for (int32_t tok : chunks_[i].tokens) std::copy_n(w_.embed.data + tok * d, d, x_.data() + (t++) * d);
    read_.resize(N_ * d);
    a_.resize(N_ * d);
    y_.resize(N_ * d);
    m_.resize(N_ * d);
    if (c_.attn_res_block > 0) BuildBlockReads(0, 0);  // layer 0's first read: an empty bank
  }
  while (layer_ < c_.num_layers) {
    const int64_t l = layer_;
    if (awaiting_experts_) {
      MoeBack(l);
      awaiting_experts_ = false;
      ++layer_;
      continue;
    }
    BeginLayer(l);  // mixer, residual, and m_ = the MLP's normalized input
    if (c_.mlp[l] == Mlp::kDense) {
      const GluWeights& g = w_.layers[l].dense;
      cpu::GluMlp(N_, d, g.gate.rows, m_.data(), g.gate.data, g.up.data, g.down.data, Glu(c_), x_.data(), 1.0f);
      ++layer_;
      continue;
    }
    MoeFront(l);
    awaiting_experts_ = true;
    if (N_ == 0) continue;  // nothing to dispatch
    return &request_;
  }
  Finish();
  done_ = true;
  return nullptr;
}

const float* ForwardPass::ResidualRead(int64_t read) {
  if (c_.attn_res_block == 0) return x_.data();
  block_reads_.Merge(read - first_read_, x_.data(), read_.data());
  return read_.data();
}

void ForwardPass::BuildBlockReads(int64_t first, int64_t last) {
  const int64_t L = c_.num_layers;
  std::vector<cpu::AttnResQuery> reads;
  for (int64_t r = first; r <= last; ++r) {
    const AttnResWeights& rw = r == 2 * L   ? w_.out_res
                               : r % 2 == 0 ? w_.layers[r / 2].attn_res
                                            : w_.layers[r / 2].mlp_res;
    reads.push_back({rw.proj, rw.norm});
  }
  std::vector<const float*> bank;
  for (const auto& b : bank_) bank.push_back(b.data());
  block_reads_.Build(N_, c_.hidden_size, bank.data(), static_cast<int64_t>(bank.size()), reads.data(),
                     static_cast<int64_t>(reads.size()), c_.rms_norm_eps);
  first_read_ = first;
}

void ForwardPass::BeginLayer(int64_t l) {
  const int64_t d = c_.hidden_size;
  const LayerWeights& lw = w_.layers[l];
  const float* h = ResidualRead(2 * l);
  cpu::RmsNorm(N_, d, h, lw.input_norm, c_.rms_norm_eps, a_.data());
  if (c_.attn_res_block > 0 && l % c_.attn_res_block == 0) {  // the partial sum closes a block
    bank_.push_back(x_);
    std::fill(x_.begin(), x_.end(), 0.0f);
    // The bank now stays fixed up to the next block's first read (or the final read).
    BuildBlockReads(2 * l + 1, std::min(2 * (l + c_.attn_res_block), 2 * c_.num_layers));
  }
  Mixer(l, a_.data(), y_.data());
  for (int64_t i = 0; i < N_ * d; ++i) x_[i] += y_[i];
  h = ResidualRead(2 * l + 1);
  cpu::RmsNorm(N_, d, h, lw.post_norm, c_.rms_norm_eps, m_.data());
}

void ForwardPass::Mixer(int64_t l, const float* a, float* y) {
  if (N_ == 0) return;
  if (c_.mixer[l] == Mixer::kKda) {
    Kda(l, a, y);
  } else {
    Mla(l, a, y);
  }
}

void ForwardPass::Kda(int64_t l, const float* a, float* y) {
  const KdaWeights& w = w_.layers[l].kda;
  const int64_t H = c_.kda_heads, dk = c_.kda_head_dim, HD = H * dk, K = c_.conv_kernel, N = N_;
  std::vector<float> q(N * HD), k(N * HD), v(N * HD), qc(N * HD), kc(N * HD), vc(N * HD);
  Linear(N, w.q, a, q.data());
  Linear(N, w.k, a, k.data());
  Linear(N, w.v, a, v.data());
  for (size_t i = 0; i < chunks_.size(); ++i) {
    KdaState& s = chunks_[i].state->kda[l];
    const int64_t o = offset_[i] * HD, T = offset_[i + 1] - offset_[i];
    cpu::CausalConv1dSilu(T, HD, K, q.data() + o, w.q_conv, s.conv_q.data(), qc.data() + o);
    cpu::CausalConv1dSilu(T, HD, K, k.data() + o, w.k_conv, s.conv_k.data(), kc.data() + o);
    cpu::CausalConv1dSilu(T, HD, K, v.data() + o, w.v_conv, s.conv_v.data(), vc.data() + o);
  }
  cpu::KdaNormalizeQK(N, H, dk, qc.data(), kc.data());

  // Forget gate g [N, HD] and beta [N, H].
  std::vector<float> f(N * dk), g(N * HD), beta(N * H);
  Linear(N, w.f_a, a, f.data());
  Linear(N, w.f_b, f.data(), g.data());
  if (c_.kda_gate_bounded) {
    cpu::KdaGateBounded(N, H, dk, g.data(), w.A_log, w.dt_bias, c_.kda_gate_lower_bound, g.data());
  } else {
    cpu::KdaGateSoftplus(N, H, dk, g.data(), w.A_log, w.dt_bias, g.data());
  }
  Linear(N, w.b, a, beta.data());
  for (float& b : beta) b = Sigmoid(b);

  // Per sequence: the chunked form for prefill chunks, the recurrence for decode. o reuses q's buffer.
  float* o = q.data();
  for (size_t i = 0; i < chunks_.size(); ++i) {
    KdaState& s = chunks_[i].state->kda[l];
    const int64_t t0 = offset_[i], T = offset_[i + 1] - offset_[i];
    auto kda = T >= kKdaChunkedMinTokens ? KdaChunked : cpu::KdaRecurrent;
    kda(T, H, dk, dk, qc.data() + t0 * HD, kc.data() + t0 * HD, vc.data() + t0 * HD,
                      g.data() + t0 * HD, beta.data() + t0 * H, s.S.data(), o + t0 * HD);
  }

  // Output gate, per-head gated norm, output projection.
  float* gate = k.data();
  if (c_.kda_full_rank_gate) {
    Linear(N, w.g, a, gate);
  } else {
    Linear(N, w.g_a, a, f.data());
    Linear(N, w.g_b, f.data(), gate);
  }
  cpu::GatedRmsNorm(N * H, dk, o, gate, w.o_norm, c_.rms_norm_eps, o);
  Linear(N, w.o, o, y);
}

void ForwardPass::Mla(int64_t l, const float* a, float* y) {
  const MlaWeights& w = w_.layers[l].mla;
  const cpu::MlaShape s{c_.mla_heads, c_.qk_nope_dim, c_.qk_rope_dim, c_.v_head_dim, c_.kv_lora_rank};
  const int64_t N = N_, dqk = s.dn + s.dr, cw = s.r + s.dr;
  std::vector<float> q(N * s.nh * dqk), c(N * cw), o(N * s.nh * s.dv);
  if (w.q) {
    Linear(N, w.q, a, q.data());
  } else {
    std::vector<float> qa(N * w.q_a.rows);
    Linear(N, w.q_a, a, qa.data());
    cpu::RmsNorm(N, w.q_a.rows, qa.data(), w.q_a_norm, kLoraNormEps, qa.data());
    Linear(N, w.q_b, qa.data(), q.data());
  }
  Linear(N, w.kv_a, a, c.data());
  for (int64_t t = 0; t < N; ++t) cpu::RmsNorm(1, s.r, c.data() + t * cw, w.kv_a_norm, kLoraNormEps, c.data() + t * cw);

  const float scale = 1.0f / std::sqrt(static_cast<float>(dqk));
  for (size_t i = 0; i < chunks_.size(); ++i) {
    MlaCache& cache = chunks_[i].state->mla[l];
    const int64_t t0 = offset_[i], T = offset_[i + 1] - offset_[i], P = cache.len;
    cache.rows.insert(cache.rows.end(), c.begin() + t0 * cw, c.begin() + (t0 + T) * cw);
    cache.len += T;
    auto attend = MlaAbsorbedIsCheaper(T, s) ? cpu::MlaAttentionAbsorbed : cpu::MlaAttentionExpanded;
    attend(T, P, s, q.data() + t0 * s.nh * dqk, cache.rows.data(), w.kv_b.data, scale, o.data() + t0 * s.nh * s.dv);
  }
  if (w.g) {
    std::vector<float> gate(N * s.nh * s.dv);
    Linear(N, w.g, a, gate.data());
    for (size_t i = 0; i < o.size(); ++i) o[i] *= Sigmoid(gate[i]);
  }
  Linear(N, w.o, o.data(), y);
}

void ForwardPass::MoeFront(int64_t l) {
  const MoeWeights& w = w_.layers[l].moe;
  const int64_t E = c_.num_experts, k = c_.top_k, N = N_;
  router_logits_.resize(N * E);
  idx_.resize(N * k);
  wt_.resize(N * k);
  Linear(N, w.router, m_.data(), router_logits_.data());
  const cpu::RouterParams rp{E, k, c_.num_expert_group, c_.topk_group, c_.moe_renormalize, c_.routed_scaling_factor};
  cpu::RouteTopK(N, router_logits_.data(), w.bias, rp, idx_.data(), wt_.data());
  const float* rows = m_.data();
  if (w.latent_down) {
    z_.resize(N * c_.latent_dim);
    Linear(N, w.latent_down, m_.data(), z_.data());
    rows = z_.data();
  }
  moe_out_.assign(N * c_.expert_width(), 0.0f);
  request_ = ExpertRequest{l, N, c_.expert_width(), k, rows, idx_.data(), wt_.data(), router_logits_.data(), w.bias};
  request_.decode = N == static_cast<int64_t>(chunks_.size());
}

void ForwardPass::MoeBack(int64_t l) {
  const MoeWeights& w = w_.layers[l].moe;
  const int64_t d = c_.hidden_size, N = N_;
  if (N == 0) return;
  if (w.latent_up) {
    if (w.latent_norm) cpu::RmsNorm(N, c_.latent_dim, moe_out_.data(), w.latent_norm, c_.rms_norm_eps, moe_out_.data());
    Linear(N, w.latent_up, moe_out_.data(), x_.data(), 1.0f);
  } else {
    for (int64_t i = 0; i < N * d; ++i) x_[i] += moe_out_[i];
  }
  if (w.shared.gate)
    cpu::GluMlp(N, d, w.shared.gate.rows, m_.data(), w.shared.gate.data, w.shared.up.data, w.shared.down.data, Glu(c_),
                x_.data(), 1.0f);
}

void ForwardPass::Finish() {
  const int64_t d = c_.hidden_size, V = c_.vocab_size;
  const float* f = ResidualRead(2 * c_.num_layers);
  std::vector<int64_t> rows;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i].logits == LogitsMode::kAll) {
      for (int64_t t = offset_[i]; t < offset_[i + 1]; ++t) rows.push_back(t);
    } else if (chunks_[i].logits == LogitsMode::kLast) {
      rows.push_back(offset_[i + 1] - 1);
    }
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  std::vector<float> hn(R * d);
  for (int64_t r = 0; r < R; ++r) std::copy_n(f + rows[r] * d, d, hn.data() + r * d);
  cpu::RmsNorm(R, d, hn.data(), w_.final_norm, c_.rms_norm_eps, hn.data());
  logits_.resize(R * V);
  Linear(R, w_.lm_head, hn.data(), logits_.data());
  for (size_t i = 0; i < chunks_.size(); ++i) chunks_[i].state->position += static_cast<int64_t>(chunks_[i].tokens.size());
}

namespace {

// Runs the passes, dispatching each one's experts as the others compute; ticket[i] is pass i's
// dispatch still to wait for.
absl::Status RunPassesUntilError(std::span<ForwardPass* const> passes, ExpertExecutor& experts,
                                 std::vector<uint64_t>& ticket) {
  auto advance = [&](size_t i) -> absl::Status {
    K3_ASSIGN_OR_RETURN(const ExpertRequest* req, passes[i]->RunToDispatch());
    if (req != nullptr) {
      K3_ASSIGN_OR_RETURN(ticket[i], experts.Submit(*req));
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < passes.size(); ++i) K3_RETURN_IF_ERROR(advance(i));
  // Round robin: while pass i waits for its experts, the others' requests are in flight.
  for (bool active = true; active;) {
    active = false;
    for (size_t i = 0; i < passes.size(); ++i) {
      if (passes[i]->done()) continue;
      active = true;
      if (ticket[i] != 0) K3_RETURN_IF_ERROR(experts.Wait(std::exchange(ticket[i], 0), passes[i]->expert_output()));
      K3_RETURN_IF_ERROR(advance(i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunPasses(std::span<ForwardPass* const> passes, ExpertExecutor& experts) {
  std::vector<uint64_t> ticket(passes.size(), 0);
  const absl::Status status = RunPassesUntilError(passes, experts, ticket);
  // A failed pass must not leave the others' dispatches behind: the executor would count them in
  // flight for ever (and a placement change waits for them).
  if (!status.ok())
    for (size_t i = 0; i < passes.size(); ++i)
      if (ticket[i] != 0) (void)experts.Wait(ticket[i], passes[i]->expert_output());
  return status;
}


}  // namespace k3
