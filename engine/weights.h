// Model weights as fp32 views: into the mmap for fp32 checkpoints, into owned buffers for bf16.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "engine/config.h"
#include "engine/tensor_names.h"
#include "kernels/cpu/experts.h"

namespace k3 {

// A row-major matrix [rows, cols] in PyTorch Linear layout (out × in). Empty when absent.
struct Mat {
  const float* data = nullptr;
  int64_t rows = 0, cols = 0;
  explicit operator bool() const { return data != nullptr; }
};

struct KdaWeights {
  Mat q, k, v;                          // [H·dk, d]
  const float *q_conv = nullptr, *k_conv = nullptr, *v_conv = nullptr;  // [H·dk, K]
  const float* A_log = nullptr;         // [H]
  const float* dt_bias = nullptr;       // [H·dk]
  Mat f_a, f_b;                         // forget gate: [dk, d], [H·dk, dk]
  Mat g_a, g_b;                         // low-rank output gate: [dv, d], [H·dv, dv]
  Mat g;                                // full-rank output gate (K3): [H·dv, d]
  Mat b;                                // beta: [H, d]
  const float* o_norm = nullptr;        // [dv]
  Mat o;                                // [d, H·dv]
};

struct MlaWeights {
  Mat q;                                // [nh·(dn+dr), d] when q_lora_rank == 0
  Mat q_a, q_b;                         // [q_lora, d], [nh·(dn+dr), q_lora]
  const float* q_a_norm = nullptr;      // [q_lora]
  Mat kv_a;                             // [r+dr, d]
  const float* kv_a_norm = nullptr;     // [r]
  Mat kv_b;                             // [nh·(dn+dv), r]
  Mat o;                                // [d, nh·dv]
  Mat g;                                // output gate (K3): [nh·dv, d]
};

struct GluWeights {
  Mat gate, up, down;                   // [I, d], [I, d], [d, I]
};

struct MoeWeights {
  Mat router;                           // [E, d]
  const float* bias = nullptr;          // [E] e_score_correction_bias
  GluWeights shared;                    // intermediate = moe_intermediate · num_shared; absent if 0
  Mat latent_down;                      // [ℓ, d]   (Stable LatentMoE)
  const float* latent_norm = nullptr;   // [ℓ]
  Mat latent_up;                        // [d, ℓ]
  std::vector<cpu::ExpertWeights> experts;  // E entries; w1 not loaded() where not loaded
};

struct AttnResWeights {
  const float* proj = nullptr;          // pseudo-query w [d]
  const float* norm = nullptr;          // n [d]
};

struct LayerWeights {
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  AttnResWeights attn_res, mlp_res;     // Block AttnRes reads (K3)
  KdaWeights kda;
  MlaWeights mla;
  GluWeights dense;
  MoeWeights moe;
};

// What a process loads: the attention side loads everything but the routed experts, an expert
// node only its (layer, expert) slots. Every tensor's name and shape is still checked.
struct WeightFilter {
  bool non_expert = true;
  std::function<bool(int64_t layer, int64_t expert)> expert = [](int64_t, int64_t) { return true; };

  static WeightFilter All() { return {}; }
  static WeightFilter AttentionOnly();
  static WeightFilter ExpertsOnly(std::function<bool(int64_t, int64_t)> slots);
};

struct ModelWeights {
  Mat embed;                            // [V, d]
  Mat lm_head;                          // [V, d]
  const float* final_norm = nullptr;
  AttnResWeights out_res;
  std::vector<LayerWeights> layers;

  // Keeps the mapping alive (fp32 views point into it) and the converted bf16 tensors.
  std::shared_ptr<const Checkpoint> checkpoint;
  std::vector<std::unique_ptr<float[]>> owned;
};

// What a checkpoint tensor is, so that a writer of random checkpoints (tools/mkmodel) can pick a
// sensible initialisation for it.
enum class TensorRole {
  kEmbedding,      // [V, d]
  kLinear,         // [out, in] projection
  kNorm,           // RMSNorm weight
  kConv,           // KDA depthwise conv [C, 1, K]
  kALog,           // KDA A_log [1, 1, H, 1]
  kDtBias,         // KDA dt_bias [H·dk]
  kRouterBias,     // e_score_correction_bias [E]
  kAttnResQuery,   // Block AttnRes pseudo-query [1, d]
  kMxfp4Packed,    // an MXFP4 matrix's E2M1 codes, U8 [out, in/2]
  kMxfp4Scale,     // its E8M0 scales, U8 [out, in/32]
};

// One tensor a config implies: hub name, shape, role, and its slot in ModelWeights when bound.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorRole role = TensorRole::kLinear;
  int64_t layer = -1;   // -1: model level
  int64_t expert = -1;  // routed expert index; -1: not a routed expert's tensor
  Mat* mat = nullptr;           // 2-D views (rows, cols from shape)
  const float** vec = nullptr;  // everything else (float)
  const uint8_t** u8 = nullptr;  // MXFP4 codes and scales
  // The hub name of the matrix whose values a writer draws (the same in every layout;
  // "….wK.weight" for both halves of an MXFP4 matrix).
  std::string value_name;
  bool at_least = false;  // 1-D, at least shape[0] values of which the first are read (release A_log)
};

// Every tensor the config implies, in a fixed order, named as `layout` names them; the loader and
// the checkpoint writer both use this list, so they cannot disagree. With `bind`, each spec also
// points at its slot in *bind, whose layers and experts this sizes to the config.
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config, ModelWeights* bind = nullptr,
                                        names::Layout layout = names::Layout::kHub);

// The layout a checkpoint is written in (the released K3's when its embedding is under its prefix).
names::Layout CheckpointLayout(const Checkpoint& checkpoint);

// Loads and checks every tensor the config implies: a missing, extra or mis-shaped tensor, a wrong
// dtype, or an MXFP4 scale of 255 (NaN) in a loaded expert is an error naming the file and the
// tensor. MXFP4 experts stay packed (views into the mapping). The release's vision tower and
// projector are skipped.
absl::StatusOr<std::unique_ptr<ModelWeights>> LoadWeights(const ModelConfig& config,
                                                          std::shared_ptr<const Checkpoint> checkpoint,
                                                          const WeightFilter& filter = WeightFilter::All());

}  // namespace k3
