// Multi-head Latent Attention (NoPE) over the latent cache, fp32 (DESIGN §1.3).
//
// One sequence; T new tokens at positions P..P+T-1 (P tokens were cached before).
//   q     [T, nh, dn+dr]   per head: q_nope (dn) then q_r (dr)
//   cache [P+T, r+dr]      per token: RMS-normalized c_kv (r = kv_lora_rank) then k_r (dr);
//                          rows P.. hold the new tokens
//   kv_b  [nh·(dn+dv), r]  per head: dn rows of W_UK then dv rows of W_UV
//   out   [T, nh·dv]
// Token t attends to cache rows 0..P+t, scores scaled by `scale` ((dn+dr)^-½).
#pragma once

#include <cstdint>

namespace k3::cpu {

struct MlaShape {
  int64_t nh = 0, dn = 0, dr = 0, dv = 0, r = 0;
};

// Expanded form: K and V of every cached token rebuilt through kv_b (prefill: T large).
void MlaAttentionExpanded(int64_t T, int64_t P, const MlaShape& s, const float* q, const float* cache,
                          const float* kv_b, float scale, float* out);
// Absorbed form: W_UK folded into the query and W_UV applied after the latent context, so the
// cache is read once per head in its compressed width (decode: T small).
void MlaAttentionAbsorbed(int64_t T, int64_t P, const MlaShape& s, const float* q, const float* cache,
                          const float* kv_b, float scale, float* out);
// Naive reference: explicit loops, double accumulation.
void MlaAttentionRef(int64_t T, int64_t P, const MlaShape& s, const float* q, const float* cache, const float* kv_b,
                     float scale, float* out);

}  // namespace k3::cpu
