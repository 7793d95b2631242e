// Per-sequence state: KDA recurrent state + conv state per KDA layer, latent cache per MLA layer.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config.h"

namespace k3 {

struct KdaState {
  std::vector<float> conv_q, conv_k, conv_v;  // [K-1, H·dk]: the last K-1 conv inputs
  std::vector<float> S;                       // [H, dk, dv]
};

struct MlaCache {
  std::vector<float> rows;  // [len, kv_lora_rank + dr]: normalized c_kv then k_r
  int64_t len = 0;
};

struct SequenceState {
  int64_t position = 0;             // tokens consumed so far
  std::vector<KdaState> kda;        // indexed by layer (empty for MLA layers)
  std::vector<MlaCache> mla;        // indexed by layer (empty for KDA layers)

  explicit SequenceState(const ModelConfig& c);
  int64_t bytes() const;            // memory held, for accounting
};

}  // namespace k3
