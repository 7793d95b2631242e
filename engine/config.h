// Model configuration read from a hub-format config.json (Kimi-Linear and Kimi K3).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace k3 {

enum class Mixer { kKda, kMla };
enum class Mlp { kDense, kMoe };
enum class Activation { kSilu, kSitu };
// How the routed experts' w1, w2, w3 are stored: fp32/bf16 ".weight", or MXFP4 (compressed-tensors
// "mxfp4-pack-quantized", group 32: ".weight_packed" + ".weight_scale", DESIGN §2).
enum class ExpertFormat { kFloat, kMxfp4 };

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;        // d
  int64_t num_layers = 0;
  float rms_norm_eps = 0;
  bool tie_word_embeddings = false;
  int64_t max_position = 0;       // model_max_length, 0 if absent
  std::vector<int64_t> eos_token_ids;

  // Per layer (0-based).
  std::vector<Mixer> mixer;
  std::vector<Mlp> mlp;

  // Activation of the dense MLP, shared and routed experts (the KDA conv always uses SiLU).
  Activation act = Activation::kSilu;
  float situ_beta = 4.0f;          // activation_situ_beta
  float situ_linear_beta = 25.0f;  // activation_situ_linear_beta

  // Dense MLP.
  int64_t intermediate_size = 0;

  // KDA.
  int64_t kda_heads = 0;
  int64_t kda_head_dim = 0;  // dk == dv
  int64_t conv_kernel = 0;
  bool kda_gate_bounded = false;   // linear_attn_config.gate_lower_bound present
  float kda_gate_lower_bound = 0;
  bool kda_full_rank_gate = false;  // linear_attn_config.use_full_rank_gate

  // MLA.
  int64_t mla_heads = 0;
  int64_t q_lora_rank = 0;  // 0: plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_dim = 0;
  int64_t qk_rope_dim = 0;
  int64_t v_head_dim = 0;
  bool mla_output_gate = false;

  // MoE.
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t num_shared_experts = 0;
  int64_t moe_intermediate_size = 0;
  float routed_scaling_factor = 1.0f;
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;
  bool moe_renormalize = false;
  int64_t latent_dim = 0;  // routed_expert_hidden_size; 0: experts work at width d
  bool latent_norm = false;
  ExpertFormat expert_format = ExpertFormat::kFloat;  // from quantization_config

  // Block Attention Residuals; 0: plain residual.
  int64_t attn_res_block = 0;

  int64_t expert_width() const { return latent_dim > 0 ? latent_dim : hidden_size; }
  int64_t mla_cache_width() const { return kv_lora_rank + qk_rope_dim; }
  int64_t kda_conv_channels() const { return 3 * kda_heads * kda_head_dim; }
  int num_kda_layers() const;
  int num_mla_layers() const;
  bool has_layer_kind(Mixer m) const;
};

// Parses config.json text. Errors name the key. A config whose text model is nested under
// "text_config" (the released K3 layout) is accepted, and a "quantization_config" that stores the
// routed experts in MXFP4 (anything else it could describe is an error naming the key).
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source = "config.json");
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

// Bytes of per-sequence state held by the engine in fp32: fixed part (KDA state + conv state, all
// layers) and the MLA latent cache per token (all layers).
struct StateBytes {
  int64_t fixed = 0;
  int64_t per_token = 0;
};
StateBytes SequenceStateBytes(const ModelConfig& c, int64_t bytes_per_value = 4);

}  // namespace k3
