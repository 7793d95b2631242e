// Kimi Delta Attention on the CPU, fp32 (DESIGN §1.2).
//
// Layouts for one sequence of T tokens: q, k [T, H, dk]; v, o [T, H, dv]; g [T, H, dk] (log decay,
// ≤ 0); beta [T, H]; state S [H, dk, dv]. q and k arrive L2-normalized, q already scaled by dk^-½.
#pragma once

#include <cstdint>

namespace k3::cpu {

// Forget gate, softplus form: g = −exp(A_log[h]) · softplus(raw + dt_bias)  (softplus(x) = x for x > 20).
// raw [T, H·dk] = f_b(f_a(a)); A_log [H]; dt_bias [H·dk]; g [T, H·dk]. g may alias raw.
void KdaGateSoftplus(int64_t T, int64_t H, int64_t dk, const float* raw, const float* A_log, const float* dt_bias,
                     float* g);
// Forget gate, lower-bounded form (K3): g = lb · sigmoid(exp(A_log[h]) · (raw + dt_bias)).
void KdaGateBounded(int64_t T, int64_t H, int64_t dk, const float* raw, const float* A_log, const float* dt_bias,
                    float lower_bound, float* g);

// q ← q / sqrt(|q|² + 1e-6) · dk^-½ ;  k ← k / sqrt(|k|² + 1e-6), per head, in place.
void KdaNormalizeQK(int64_t T, int64_t H, int64_t dk, float* q, float* k);

// The recurrence, token by token (the reference, and the decode path):
//   S ← Diag(exp(g_t)) S;  u ← β_t (v_t − Sᵀk_t);  S ← S + k_t uᵀ;  o_t = Sᵀ q_t.
void KdaRecurrent(int64_t T, int64_t H, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                  const float* g, const float* beta, float* S, float* o);

// The chunked form (prefill): chunks of C tokens, WY representation + UT transform (Kimi Linear
// report Eqs. 2–9); same result as KdaRecurrent to fp32 rounding, for any T ≥ 0 and initial S.
void KdaChunked(int64_t T, int64_t H, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                const float* g, const float* beta, float* S, float* o, int64_t C = 64);

}  // namespace k3::cpu
