// Every checkpoint tensor name in one table (hub naming, as in the golden checkpoints), so a
// naming change of a released checkpoint is one edit here. The released Kimi K3 names the same
// tensors differently (Layout::kK3Release, DESIGN §2); InLayout maps a hub name onto it.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"

namespace k3::names {

// Model level.
inline constexpr const char* kEmbed = "model.embed_tokens.weight";
inline constexpr const char* kFinalNorm = "model.norm.weight";
inline constexpr const char* kLmHead = "lm_head.weight";
inline constexpr const char* kOutResProj = "model.output_attn_res_proj.weight";
inline constexpr const char* kOutResNorm = "model.output_attn_res_norm.weight";

// Per decoder layer: suffixes after "model.layers.N.".
inline constexpr const char* kInputNorm = "input_layernorm.weight";
inline constexpr const char* kPostNorm = "post_attention_layernorm.weight";
inline constexpr const char* kAttnResProj = "self_attention_res_proj.weight";
inline constexpr const char* kAttnResNorm = "self_attention_res_norm.weight";
inline constexpr const char* kMlpResProj = "mlp_res_proj.weight";
inline constexpr const char* kMlpResNorm = "mlp_res_norm.weight";

// KDA (self_attn of a linear_attention layer).
inline constexpr const char* kKdaQ = "self_attn.q_proj.weight";
inline constexpr const char* kKdaK = "self_attn.k_proj.weight";
inline constexpr const char* kKdaV = "self_attn.v_proj.weight";
inline constexpr const char* kKdaQConv = "self_attn.q_conv1d.weight";
inline constexpr const char* kKdaKConv = "self_attn.k_conv1d.weight";
inline constexpr const char* kKdaVConv = "self_attn.v_conv1d.weight";
inline constexpr const char* kKdaALog = "self_attn.A_log";
inline constexpr const char* kKdaDtBias = "self_attn.dt_bias";
inline constexpr const char* kKdaFA = "self_attn.f_a_proj.weight";
inline constexpr const char* kKdaFB = "self_attn.f_b_proj.weight";
inline constexpr const char* kKdaGA = "self_attn.g_a_proj.weight";
inline constexpr const char* kKdaGB = "self_attn.g_b_proj.weight";
inline constexpr const char* kKdaG = "self_attn.g_proj.weight";  // K3 full-rank output gate
inline constexpr const char* kKdaB = "self_attn.b_proj.weight";
inline constexpr const char* kKdaONorm = "self_attn.o_norm.weight";
inline constexpr const char* kKdaO = "self_attn.o_proj.weight";

// MLA (self_attn of a full_attention layer).
inline constexpr const char* kMlaQ = "self_attn.q_proj.weight";
inline constexpr const char* kMlaQA = "self_attn.q_a_proj.weight";
inline constexpr const char* kMlaQANorm = "self_attn.q_a_layernorm.weight";
inline constexpr const char* kMlaQB = "self_attn.q_b_proj.weight";
inline constexpr const char* kMlaKvA = "self_attn.kv_a_proj_with_mqa.weight";
inline constexpr const char* kMlaKvANorm = "self_attn.kv_a_layernorm.weight";
inline constexpr const char* kMlaKvB = "self_attn.kv_b_proj.weight";
inline constexpr const char* kMlaO = "self_attn.o_proj.weight";
inline constexpr const char* kMlaG = "self_attn.g_proj.weight";  // K3 output gate

// Dense MLP (stored under block_sparse_moe in the hub format).
inline constexpr const char* kDenseGate = "block_sparse_moe.gate_proj.weight";
inline constexpr const char* kDenseUp = "block_sparse_moe.up_proj.weight";
inline constexpr const char* kDenseDown = "block_sparse_moe.down_proj.weight";

// MoE.
inline constexpr const char* kRouter = "block_sparse_moe.gate.weight";
inline constexpr const char* kRouterBias = "block_sparse_moe.gate.e_score_correction_bias";
inline constexpr const char* kSharedGate = "block_sparse_moe.shared_experts.gate_proj.weight";
inline constexpr const char* kSharedUp = "block_sparse_moe.shared_experts.up_proj.weight";
inline constexpr const char* kSharedDown = "block_sparse_moe.shared_experts.down_proj.weight";
inline constexpr const char* kLatentDown = "block_sparse_moe.routed_expert_down_proj.weight";
inline constexpr const char* kLatentNorm = "block_sparse_moe.routed_expert_norm.weight";
inline constexpr const char* kLatentUp = "block_sparse_moe.routed_expert_up_proj.weight";
inline constexpr const char* kExpertW1 = "w1.weight";  // after "block_sparse_moe.experts.E."
inline constexpr const char* kExpertW2 = "w2.weight";
inline constexpr const char* kExpertW3 = "w3.weight";
// An MXFP4 expert matrix "….wK.weight" is stored as "….wK.weight_packed" and "….wK.weight_scale".
inline constexpr const char* kPackedSuffix = "_packed";
inline constexpr const char* kScaleSuffix = "_scale";

// The released Kimi K3: the text model under "language_model." beside a vision tower and its
// projector (never read by a text server); the dense MLP as "mlp."; A_log as a 1-D vector of at
// least num_heads entries (the first num_heads are the heads').
enum class Layout { kHub, kK3Release };
inline constexpr const char* kReleasePrefix = "language_model.";
inline constexpr const char* kReleaseDenseGate = "mlp.gate_proj.weight";
inline constexpr const char* kReleaseDenseUp = "mlp.up_proj.weight";
inline constexpr const char* kReleaseDenseDown = "mlp.down_proj.weight";
inline bool SkippedInRelease(std::string_view name) {
  return name.starts_with("vision_tower.") || name.starts_with("mm_projector.");
}

inline std::string Layer(int64_t layer, const char* suffix) { return absl::StrCat("model.layers.", layer, ".", suffix); }
inline std::string Expert(int64_t layer, int64_t expert, const char* which) {
  return absl::StrCat("model.layers.", layer, ".block_sparse_moe.experts.", expert, ".", which);
}

// A hub name as the given layout spells it.
inline std::string InLayout(const std::string& hub, Layout layout) {
  if (layout == Layout::kHub) return hub;
  std::string name = hub;
  for (auto [from, to] : {std::pair{kDenseGate, kReleaseDenseGate}, std::pair{kDenseUp, kReleaseDenseUp},
                          std::pair{kDenseDown, kReleaseDenseDown}}) {
    const std::string_view f(from);
    if (name.size() > f.size() && name.ends_with(f) && name[name.size() - f.size() - 1] == '.') {
      name.replace(name.size() - f.size(), f.size(), to);
      break;
    }
  }
  return kReleasePrefix + name;
}

}  // namespace k3::names
