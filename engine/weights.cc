#include "engine/weights.h"

#include <cstring>
#include <set>

#include "absl/strings/str_join.h"
#include "common/bf16.h"
#include "engine/tensor_names.h"

namespace k3 {
namespace {

class Loader {
 public:
  Loader(const Checkpoint& ckpt, ModelWeights& out) : ckpt_(ckpt), out_(out) {}

  // Checks name and shape; returns fp32 data if `load`, else nullptr.
  absl::StatusOr<const float*> Get(const std::string& name, std::vector<int64_t> shape, bool load) {
    const TensorInfo* t = ckpt_.Find(name);
    if (t == nullptr)
      return absl::NotFoundError(absl::StrCat(ckpt_.dir(), ": missing tensor \"", name, "\" (expected shape [",
                                              absl::StrJoin(shape, ", "), "])"));
    expected_.insert(name);
    if (t->shape != shape)
      return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor \"", name, "\" has shape ", t->ShapeString(),
                                                     ", expected [", absl::StrJoin(shape, ", "), "]"));
    if (t->dtype != DType::kF32 && t->dtype != DType::kBF16)
      return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor \"", name, "\" has dtype ",
                                                     DTypeName(t->dtype), "; only F32 and BF16 are supported"));
    if (!load) return nullptr;
    const int64_t n = t->numel();
    if (t->dtype == DType::kF32 && reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0)
      return reinterpret_cast<const float*>(t->data);
    auto buf = std::make_unique<float[]>(n);
    if (t->dtype == DType::kF32) {
      std::memcpy(buf.get(), t->data, n * sizeof(float));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, t->data + 2 * i, 2);
        buf[i] = Bf16ToFloat(h);
      }
    }
    out_.owned.push_back(std::move(buf));
    return out_.owned.back().get();
  }

  absl::StatusOr<Mat> GetMat(const std::string& name, int64_t rows, int64_t cols, bool load) {
    K3_ASSIGN_OR_RETURN(const float* p, Get(name, {rows, cols}, load));
    return Mat{p, rows, cols};
  }

  // Every tensor in the checkpoint must be one the config implies.
  absl::Status CheckNoExtra() const {
    for (const auto& [name, t] : ckpt_.tensors())
      if (!expected_.count(name))
        return absl::InvalidArgumentError(
            absl::StrCat(t.file, ": unexpected tensor \"", name, "\" (not used by this config)"));
    return absl::OkStatus();
  }

 private:
  const Checkpoint& ckpt_;
  ModelWeights& out_;
  std::set<std::string> expected_;
};

}  // namespace

WeightFilter WeightFilter::AttentionOnly() {
  WeightFilter f;
  f.expert = [](int64_t, int64_t) { return false; };
  return f;
}

WeightFilter WeightFilter::ExpertsOnly(std::function<bool(int64_t, int64_t)> slots) {
  WeightFilter f;
  f.non_expert = false;
  f.expert = std::move(slots);
  return f;
}

absl::StatusOr<std::unique_ptr<ModelWeights>> LoadWeights(const ModelConfig& c,
                                                          std::shared_ptr<const Checkpoint> checkpoint,
                                                          const WeightFilter& filter) {
  auto w = std::make_unique<ModelWeights>();
  w->checkpoint = checkpoint;
  Loader L(*checkpoint, *w);
  const bool ne = filter.non_expert;
  const int64_t d = c.hidden_size, V = c.vocab_size;
  namespace n = names;
  auto layer = [](int64_t l, const char* s) { return n::Layer(l, s); };

  K3_ASSIGN_OR_RETURN(w->embed, L.GetMat(n::kEmbed, V, d, ne));
  if (c.tie_word_embeddings) {
    w->lm_head = w->embed;
  } else {
    K3_ASSIGN_OR_RETURN(w->lm_head, L.GetMat(n::kLmHead, V, d, ne));
  }
  K3_ASSIGN_OR_RETURN(w->final_norm, L.Get(n::kFinalNorm, {d}, ne));
  if (c.attn_res_block > 0) {
    K3_ASSIGN_OR_RETURN(w->out_res.proj, L.Get(n::kOutResProj, {1, d}, ne));
    K3_ASSIGN_OR_RETURN(w->out_res.norm, L.Get(n::kOutResNorm, {d}, ne));
  }

  w->layers.resize(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerWeights& lw = w->layers[l];
    K3_ASSIGN_OR_RETURN(lw.input_norm, L.Get(layer(l, n::kInputNorm), {d}, ne));
    K3_ASSIGN_OR_RETURN(lw.post_norm, L.Get(layer(l, n::kPostNorm), {d}, ne));
    if (c.attn_res_block > 0) {
      K3_ASSIGN_OR_RETURN(lw.attn_res.proj, L.Get(layer(l, n::kAttnResProj), {1, d}, ne));
      K3_ASSIGN_OR_RETURN(lw.attn_res.norm, L.Get(layer(l, n::kAttnResNorm), {d}, ne));
      K3_ASSIGN_OR_RETURN(lw.mlp_res.proj, L.Get(layer(l, n::kMlpResProj), {1, d}, ne));
      K3_ASSIGN_OR_RETURN(lw.mlp_res.norm, L.Get(layer(l, n::kMlpResNorm), {d}, ne));
    }

    if (c.mixer[l] == Mixer::kKda) {
      KdaWeights& k = lw.kda;
      const int64_t H = c.kda_heads, dk = c.kda_head_dim, HD = H * dk, K = c.conv_kernel;
      K3_ASSIGN_OR_RETURN(k.q, L.GetMat(layer(l, n::kKdaQ), HD, d, ne));
      K3_ASSIGN_OR_RETURN(k.k, L.GetMat(layer(l, n::kKdaK), HD, d, ne));
      K3_ASSIGN_OR_RETURN(k.v, L.GetMat(layer(l, n::kKdaV), HD, d, ne));
      K3_ASSIGN_OR_RETURN(k.q_conv, L.Get(layer(l, n::kKdaQConv), {HD, 1, K}, ne));
      K3_ASSIGN_OR_RETURN(k.k_conv, L.Get(layer(l, n::kKdaKConv), {HD, 1, K}, ne));
      K3_ASSIGN_OR_RETURN(k.v_conv, L.Get(layer(l, n::kKdaVConv), {HD, 1, K}, ne));
      K3_ASSIGN_OR_RETURN(k.A_log, L.Get(layer(l, n::kKdaALog), {1, 1, H, 1}, ne));
      K3_ASSIGN_OR_RETURN(k.dt_bias, L.Get(layer(l, n::kKdaDtBias), {HD}, ne));
      K3_ASSIGN_OR_RETURN(k.f_a, L.GetMat(layer(l, n::kKdaFA), dk, d, ne));
      K3_ASSIGN_OR_RETURN(k.f_b, L.GetMat(layer(l, n::kKdaFB), HD, dk, ne));
      if (c.kda_full_rank_gate) {
        K3_ASSIGN_OR_RETURN(k.g, L.GetMat(layer(l, n::kKdaG), HD, d, ne));
      } else {
        K3_ASSIGN_OR_RETURN(k.g_a, L.GetMat(layer(l, n::kKdaGA), dk, d, ne));
        K3_ASSIGN_OR_RETURN(k.g_b, L.GetMat(layer(l, n::kKdaGB), HD, dk, ne));
      }
      K3_ASSIGN_OR_RETURN(k.b, L.GetMat(layer(l, n::kKdaB), H, d, ne));
      K3_ASSIGN_OR_RETURN(k.o_norm, L.Get(layer(l, n::kKdaONorm), {dk}, ne));
      K3_ASSIGN_OR_RETURN(k.o, L.GetMat(layer(l, n::kKdaO), d, HD, ne));
    } else {
      MlaWeights& m = lw.mla;
      const int64_t nh = c.mla_heads, dqk = c.qk_nope_dim + c.qk_rope_dim;
      if (c.q_lora_rank > 0) {
        K3_ASSIGN_OR_RETURN(m.q_a, L.GetMat(layer(l, n::kMlaQA), c.q_lora_rank, d, ne));
        K3_ASSIGN_OR_RETURN(m.q_a_norm, L.Get(layer(l, n::kMlaQANorm), {c.q_lora_rank}, ne));
        K3_ASSIGN_OR_RETURN(m.q_b, L.GetMat(layer(l, n::kMlaQB), nh * dqk, c.q_lora_rank, ne));
      } else {
        K3_ASSIGN_OR_RETURN(m.q, L.GetMat(layer(l, n::kMlaQ), nh * dqk, d, ne));
      }
      K3_ASSIGN_OR_RETURN(m.kv_a, L.GetMat(layer(l, n::kMlaKvA), c.kv_lora_rank + c.qk_rope_dim, d, ne));
      K3_ASSIGN_OR_RETURN(m.kv_a_norm, L.Get(layer(l, n::kMlaKvANorm), {c.kv_lora_rank}, ne));
      K3_ASSIGN_OR_RETURN(m.kv_b, L.GetMat(layer(l, n::kMlaKvB), nh * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank, ne));
      K3_ASSIGN_OR_RETURN(m.o, L.GetMat(layer(l, n::kMlaO), d, nh * c.v_head_dim, ne));
      if (c.mla_output_gate) {
        K3_ASSIGN_OR_RETURN(m.g, L.GetMat(layer(l, n::kMlaG), nh * c.v_head_dim, d, ne));
      }
    }

    if (c.mlp[l] == Mlp::kDense) {
      const int64_t I = c.intermediate_size;
      K3_ASSIGN_OR_RETURN(lw.dense.gate, L.GetMat(layer(l, n::kDenseGate), I, d, ne));
      K3_ASSIGN_OR_RETURN(lw.dense.up, L.GetMat(layer(l, n::kDenseUp), I, d, ne));
      K3_ASSIGN_OR_RETURN(lw.dense.down, L.GetMat(layer(l, n::kDenseDown), d, I, ne));
    } else {
      MoeWeights& m = lw.moe;
      const int64_t E = c.num_experts, I = c.moe_intermediate_size, X = c.expert_width();
      K3_ASSIGN_OR_RETURN(m.router, L.GetMat(layer(l, n::kRouter), E, d, ne));
      K3_ASSIGN_OR_RETURN(m.bias, L.Get(layer(l, n::kRouterBias), {E}, ne));
      if (c.num_shared_experts > 0) {
        const int64_t Is = I * c.num_shared_experts;
        K3_ASSIGN_OR_RETURN(m.shared.gate, L.GetMat(layer(l, n::kSharedGate), Is, d, ne));
        K3_ASSIGN_OR_RETURN(m.shared.up, L.GetMat(layer(l, n::kSharedUp), Is, d, ne));
        K3_ASSIGN_OR_RETURN(m.shared.down, L.GetMat(layer(l, n::kSharedDown), d, Is, ne));
      }
      if (c.latent_dim > 0) {
        K3_ASSIGN_OR_RETURN(m.latent_down, L.GetMat(layer(l, n::kLatentDown), X, d, ne));
        K3_ASSIGN_OR_RETURN(m.latent_up, L.GetMat(layer(l, n::kLatentUp), d, X, ne));
        if (c.latent_norm) {
          K3_ASSIGN_OR_RETURN(m.latent_norm, L.Get(layer(l, n::kLatentNorm), {X}, ne));
        }
      }
      m.experts.resize(E);
      for (int64_t e = 0; e < E; ++e) {
        const bool load = filter.expert(l, e);
        cpu::ExpertWeights& ew = m.experts[e];
        K3_ASSIGN_OR_RETURN(ew.w1, L.Get(n::Expert(l, e, n::kExpertW1), {I, X}, load));
        K3_ASSIGN_OR_RETURN(ew.w2, L.Get(n::Expert(l, e, n::kExpertW2), {X, I}, load));
        K3_ASSIGN_OR_RETURN(ew.w3, L.Get(n::Expert(l, e, n::kExpertW3), {I, X}, load));
      }
    }
  }
  K3_RETURN_IF_ERROR(L.CheckNoExtra());
  return w;
}

}  // namespace k3
