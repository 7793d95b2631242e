#include "engine/weights.h"

#include <cstring>
#include <set>
#include <type_traits>

#include "absl/strings/str_join.h"
#include "common/bf16.h"
#include "engine/tensor_names.h"

namespace k3 {
namespace {

class Loader {
 public:
  Loader(const Checkpoint& ckpt, ModelWeights& out) : ckpt_(ckpt), out_(out), layout_(CheckpointLayout(ckpt)) {}
  names::Layout layout() const { return layout_; }

  // Checks name, shape and dtype; returns the tensor if present and well-formed.
  absl::StatusOr<const TensorInfo*> Check(const TensorSpec& spec, bool is_u8) {
    const std::string& name = spec.name;
    const std::vector<int64_t>& shape = spec.shape;
    const TensorInfo* t = ckpt_.Find(name);
    if (t == nullptr && ckpt_.Find(name + names::kPackedSuffix) != nullptr)
      return absl::InvalidArgumentError(absl::StrCat(ckpt_.dir(), ": tensor \"", name, "\" is stored as MXFP4 (",
                                                     name, names::kPackedSuffix,
                                                     "), but config.json has no quantization_config"));
    if (t == nullptr)
      return absl::NotFoundError(absl::StrCat(ckpt_.dir(), ": missing tensor \"", name, "\" (expected shape [",
                                              absl::StrJoin(shape, ", "), "])"));
    expected_.insert(name);
    const bool shape_ok = spec.at_least ? t->shape.size() == 1 && t->shape[0] >= shape[0] : t->shape == shape;
    if (!shape_ok)
      return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor \"", name, "\" has shape ", t->ShapeString(),
                                                     ", expected [", absl::StrJoin(shape, ", "), "]",
                                                     spec.at_least ? " or longer" : ""));
    if (is_u8 && t->dtype != DType::kU8)
      return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor \"", name, "\" has dtype ",
                                                     DTypeName(t->dtype), "; MXFP4 codes and scales are U8"));
    if (!is_u8 && t->dtype != DType::kF32 && t->dtype != DType::kBF16)
      return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor \"", name, "\" has dtype ",
                                                     DTypeName(t->dtype), "; only F32 and BF16 are supported"));
    return t;
  }

  // Checks the tensor; returns fp32 data if `load`, else nullptr.
  absl::StatusOr<const float*> Get(const TensorSpec& spec, bool load) {
    K3_ASSIGN_OR_RETURN(const TensorInfo* t, Check(spec, false));
    if (!load) return nullptr;
    const int64_t n = t->numel();
    // fp32 files are used in place (when the engine's scalar is the file's: not in tools/fp64_check.sh's build).
    if (std::is_same_v<float, F32> && t->dtype == DType::kF32 && reinterpret_cast<uintptr_t>(t->data) % 4 == 0)
      return reinterpret_cast<const float*>(t->data);
    auto buf = std::make_unique<float[]>(n);
    if (t->dtype == DType::kF32) {
      for (int64_t i = 0; i < n; ++i) buf[i] = LoadF32(t->data + 4 * i);
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

  // An MXFP4 half, used in place from the mapping; scales are screened for 255 (NaN) when loaded.
  absl::StatusOr<const uint8_t*> GetU8(const TensorSpec& spec, bool load) {
    K3_ASSIGN_OR_RETURN(const TensorInfo* t, Check(spec, true));
    if (!load) return nullptr;
    const auto* data = reinterpret_cast<const uint8_t*>(t->data);
    if (spec.role == TensorRole::kMxfp4Scale) {
      const int64_t n = t->numel(), cols = spec.shape[1];
      for (int64_t i = 0; i < n; ++i)
        if (data[i] == cpu::kE8M0Nan)
          return absl::InvalidArgumentError(absl::StrCat(t->file, ": tensor \"", spec.name, "\" has scale 0xFF (NaN) at [",
                                                         i / cols, ", ", i % cols, "]"));
    }
    return data;
  }

  // Every tensor in the checkpoint must be one the config implies.
  absl::Status CheckNoExtra() const {
    for (const auto& [name, t] : ckpt_.tensors())
      if (!expected_.count(name) && !(layout_ == names::Layout::kK3Release && names::SkippedInRelease(name)))
        return absl::InvalidArgumentError(
            absl::StrCat(t.file, ": unexpected tensor \"", name, "\" (not used by this config)"));
    return absl::OkStatus();
  }

 private:
  const Checkpoint& ckpt_;
  ModelWeights& out_;
  const names::Layout layout_;
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

names::Layout CheckpointLayout(const Checkpoint& checkpoint) {
  return checkpoint.Find(names::InLayout(names::kEmbed, names::Layout::kK3Release)) != nullptr ? names::Layout::kK3Release
                                                                                              : names::Layout::kHub;
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c, ModelWeights* bind, names::Layout layout) {
  namespace n = names;
  using R = TensorRole;
  const int64_t d = c.hidden_size, V = c.vocab_size;
  ModelWeights unbound;  // stands in for the slots when nothing is bound; never read
  ModelWeights& w = bind != nullptr ? *bind : unbound;
  w.layers.assign(c.num_layers, LayerWeights{});
  std::vector<TensorSpec> specs;
  int64_t layer = -1, expert = -1;
  // A tensor whose slot is a 2-D view (mat) or a plain pointer (vec); slots are null when unbound.
  auto add = [&](const std::string& hub, std::vector<int64_t> shape, R role) -> TensorSpec& {
    const std::string name = names::InLayout(hub, layout);
    TensorSpec t;
    t.name = name;
    t.shape = std::move(shape);
    t.role = role;
    t.layer = layer;
    t.expert = expert;
    t.value_name = hub;
    specs.push_back(std::move(t));
    return specs.back();
  };
  auto mat = [&](const std::string& name, int64_t rows, int64_t cols, Mat* slot, R role = R::kLinear) {
    add(name, {rows, cols}, role).mat = bind ? slot : nullptr;
  };
  auto vec = [&](const std::string& name, std::vector<int64_t> shape, const float** slot, R role) {
    add(name, std::move(shape), role).vec = bind ? slot : nullptr;
  };
  // A routed expert's matrix [rows, cols]: float, or the two U8 halves of its MXFP4 form.
  auto expert_mat = [&](const std::string& name, int64_t rows, int64_t cols, cpu::ExpertMatrix* slot) {
    if (c.expert_format == ExpertFormat::kFloat) {
      vec(name, {rows, cols}, &slot->f32, R::kLinear);
      return;
    }
    const std::string value_name = name;
    add(name + names::kPackedSuffix, {rows, cols / 2}, R::kMxfp4Packed).u8 = bind ? &slot->mxfp4.packed : nullptr;
    specs.back().value_name = value_name;
    add(name + names::kScaleSuffix, {rows, cols / cpu::kMxfp4Group}, R::kMxfp4Scale).u8 =
        bind ? &slot->mxfp4.scale : nullptr;
    specs.back().value_name = value_name;
  };

  mat(n::kEmbed, V, d, &w.embed, R::kEmbedding);
  if (!c.tie_word_embeddings) mat(n::kLmHead, V, d, &w.lm_head);
  vec(n::kFinalNorm, {d}, &w.final_norm, R::kNorm);
  if (c.attn_res_block > 0) {
    vec(n::kOutResProj, {1, d}, &w.out_res.proj, R::kAttnResQuery);
    vec(n::kOutResNorm, {d}, &w.out_res.norm, R::kNorm);
  }

  for (layer = 0; layer < c.num_layers; ++layer) {
    const int64_t l = layer;
    auto name = [l](const char* suffix) { return n::Layer(l, suffix); };
    LayerWeights& lw = w.layers[l];
    vec(name(n::kInputNorm), {d}, &lw.input_norm, R::kNorm);
    vec(name(n::kPostNorm), {d}, &lw.post_norm, R::kNorm);
    if (c.attn_res_block > 0) {
      vec(name(n::kAttnResProj), {1, d}, &lw.attn_res.proj, R::kAttnResQuery);
      vec(name(n::kAttnResNorm), {d}, &lw.attn_res.norm, R::kNorm);
      vec(name(n::kMlpResProj), {1, d}, &lw.mlp_res.proj, R::kAttnResQuery);
      vec(name(n::kMlpResNorm), {d}, &lw.mlp_res.norm, R::kNorm);
    }

    if (c.mixer[l] == Mixer::kKda) {
      KdaWeights& k = lw.kda;
      const int64_t H = c.kda_heads, dk = c.kda_head_dim, HD = H * dk, K = c.conv_kernel;
      mat(name(n::kKdaQ), HD, d, &k.q);
      mat(name(n::kKdaK), HD, d, &k.k);
      mat(name(n::kKdaV), HD, d, &k.v);
      vec(name(n::kKdaQConv), {HD, 1, K}, &k.q_conv, R::kConv);
      vec(name(n::kKdaKConv), {HD, 1, K}, &k.k_conv, R::kConv);
      vec(name(n::kKdaVConv), {HD, 1, K}, &k.v_conv, R::kConv);
      if (layout == names::Layout::kK3Release) {
        vec(name(n::kKdaALog), {H}, &k.A_log, R::kALog);
        specs.back().at_least = true;
      } else {
        vec(name(n::kKdaALog), {1, 1, H, 1}, &k.A_log, R::kALog);
      }
      vec(name(n::kKdaDtBias), {HD}, &k.dt_bias, R::kDtBias);
      mat(name(n::kKdaFA), dk, d, &k.f_a);
      mat(name(n::kKdaFB), HD, dk, &k.f_b);
      if (c.kda_full_rank_gate) {
        mat(name(n::kKdaG), HD, d, &k.g);
      } else {
        mat(name(n::kKdaGA), dk, d, &k.g_a);
        mat(name(n::kKdaGB), HD, dk, &k.g_b);
      }
      mat(name(n::kKdaB), H, d, &k.b);
      vec(name(n::kKdaONorm), {dk}, &k.o_norm, R::kNorm);
      mat(name(n::kKdaO), d, HD, &k.o);
    } else {
      MlaWeights& m = lw.mla;
      const int64_t nh = c.mla_heads, dqk = c.qk_nope_dim + c.qk_rope_dim;
      if (c.q_lora_rank > 0) {
        mat(name(n::kMlaQA), c.q_lora_rank, d, &m.q_a);
        vec(name(n::kMlaQANorm), {c.q_lora_rank}, &m.q_a_norm, R::kNorm);
        mat(name(n::kMlaQB), nh * dqk, c.q_lora_rank, &m.q_b);
      } else {
        mat(name(n::kMlaQ), nh * dqk, d, &m.q);
      }
      mat(name(n::kMlaKvA), c.kv_lora_rank + c.qk_rope_dim, d, &m.kv_a);
      vec(name(n::kMlaKvANorm), {c.kv_lora_rank}, &m.kv_a_norm, R::kNorm);
      mat(name(n::kMlaKvB), nh * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank, &m.kv_b);
      mat(name(n::kMlaO), d, nh * c.v_head_dim, &m.o);
      if (c.mla_output_gate) mat(name(n::kMlaG), nh * c.v_head_dim, d, &m.g);
    }

    if (c.mlp[l] == Mlp::kDense) {
      const int64_t I = c.intermediate_size;
      mat(name(n::kDenseGate), I, d, &lw.dense.gate);
      mat(name(n::kDenseUp), I, d, &lw.dense.up);
      mat(name(n::kDenseDown), d, I, &lw.dense.down);
    } else {
      MoeWeights& m = lw.moe;
      const int64_t E = c.num_experts, I = c.moe_intermediate_size, X = c.expert_width();
      mat(name(n::kRouter), E, d, &m.router);
      vec(name(n::kRouterBias), {E}, &m.bias, R::kRouterBias);
      if (c.num_shared_experts > 0) {
        const int64_t Is = I * c.num_shared_experts;
        mat(name(n::kSharedGate), Is, d, &m.shared.gate);
        mat(name(n::kSharedUp), Is, d, &m.shared.up);
        mat(name(n::kSharedDown), d, Is, &m.shared.down);
      }
      if (c.latent_dim > 0) {
        mat(name(n::kLatentDown), X, d, &m.latent_down);
        mat(name(n::kLatentUp), d, X, &m.latent_up);
        if (c.latent_norm) vec(name(n::kLatentNorm), {X}, &m.latent_norm, R::kNorm);
      }
      m.experts.resize(E);
      for (expert = 0; expert < E; ++expert) {
        cpu::ExpertWeights& ew = m.experts[expert];
        expert_mat(n::Expert(l, expert, n::kExpertW1), I, X, &ew.w1);
        expert_mat(n::Expert(l, expert, n::kExpertW2), X, I, &ew.w2);
        expert_mat(n::Expert(l, expert, n::kExpertW3), I, X, &ew.w3);
      }
      expert = -1;
    }
  }
  return specs;
}

absl::StatusOr<std::unique_ptr<ModelWeights>> LoadWeights(const ModelConfig& c,
                                                          std::shared_ptr<const Checkpoint> checkpoint,
                                                          const WeightFilter& filter) {
  auto w = std::make_unique<ModelWeights>();
  w->checkpoint = checkpoint;
  Loader L(*checkpoint, *w);
  for (const TensorSpec& t : ExpectedTensors(c, w.get(), L.layout())) {
    const bool load = t.expert >= 0 ? filter.expert(t.layer, t.expert) : filter.non_expert;
    if (t.u8 != nullptr) {
      K3_ASSIGN_OR_RETURN(*t.u8, L.GetU8(t, load));
      continue;
    }
    K3_ASSIGN_OR_RETURN(const float* data, L.Get(t, load));
    if (t.mat != nullptr) {
      *t.mat = Mat{data, t.shape[0], t.shape[1]};
    } else {
      *t.vec = data;
    }
  }
  if (c.tie_word_embeddings) w->lm_head = w->embed;
  K3_RETURN_IF_ERROR(L.CheckNoExtra());
  return w;
}

}  // namespace k3
