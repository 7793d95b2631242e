// Small model configs of the GPU tests whose KDA head dims take the tuned kernels (64, 128; the goldens' 32
// runs the small-D kernel).
#pragma once

namespace k3::cuda {

// Kimi-Linear layout with the tuned KDA kernels (head dim 128): KDA, KDA, MLA; dense first layer.
inline constexpr const char* kKimiLinearLike = R"({
  "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 3, "rms_norm_eps": 1e-5, "hidden_act": "silu",
  "intermediate_size": 512, "first_k_dense_replace": 1,
  "linear_attn_config": {"num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4, "kda_layers": [1, 2],
                         "full_attn_layers": [3]},
  "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": null, "kv_lora_rank": 64,
  "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
  "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 1, "moe_intermediate_size": 64,
  "routed_scaling_factor": 2.446, "moe_renormalize": true, "num_expert_group": 1, "topk_group": 1
})";

// K3 switches with head dim 64: bounded + full-rank KDA gates, q LoRA and gated MLA, LatentMoE with its norm,
// SiTU, Block AttnRes (block 2), grouped routing.
inline constexpr const char* kK3Like = R"({
  "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 4, "rms_norm_eps": 1e-5, "hidden_act": "situ",
  "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
  "intermediate_size": 384, "first_k_dense_replace": 1,
  "linear_attn_config": {"num_heads": 2, "head_dim": 64, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                         "full_attn_layers": [3], "gate_lower_bound": -5.0, "use_full_rank_gate": true},
  "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
  "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_output_gate": true,
  "num_experts": 32, "num_experts_per_token": 4, "num_shared_experts": 2, "moe_intermediate_size": 48,
  "routed_scaling_factor": 1.0, "moe_renormalize": true, "num_expert_group": 4, "topk_group": 2,
  "routed_expert_hidden_size": 128, "latent_moe_use_norm": true, "attn_res_block_size": 2
})";

}  // namespace k3::cuda
