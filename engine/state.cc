#include "engine/state.h"

namespace k3 {

SequenceState::SequenceState(const ModelConfig& c) : kda(c.num_layers), mla(c.num_layers) {
  const int64_t HD = c.kda_heads * c.kda_head_dim, K1 = c.conv_kernel - 1;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mixer[l] != Mixer::kKda) continue;
    kda[l].conv_q.assign(K1 * HD, 0.0f);
    kda[l].conv_k.assign(K1 * HD, 0.0f);
    kda[l].conv_v.assign(K1 * HD, 0.0f);
    kda[l].S.assign(c.kda_heads * c.kda_head_dim * c.kda_head_dim, 0.0f);
  }
}

int64_t SequenceState::bytes() const {
  int64_t n = 0;
  for (const auto& k : kda) n += (k.conv_q.size() + k.conv_k.size() + k.conv_v.size() + k.S.size()) * sizeof(float);
  for (const auto& m : mla) n += m.rows.capacity() * sizeof(float);
  return n;
}

}  // namespace k3
