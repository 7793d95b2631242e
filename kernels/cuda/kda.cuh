// Kimi Delta Attention on the GPU (DESIGN §1.2): decode (the recurrence, one token per sequence) and
// chunked prefill (C = 64, WY representation + UT transform). The CPU references are in kernels/cpu/kda.h.
//
// Both fuse what comes between the short conv and the output norm: the L2 norm of q and k (+ dk^-½ on q),
// the forget gate from its raw projection, and β = sigmoid(b). Layouts, token-major, D = dk = dv ∈ {64, 128}:
//   q, k, v, g_raw  bf16 [T, H, D]     (g_raw = f_b(f_a(a)), before A_log / dt_bias)
//   b               bf16 [T, H]        (β logits)
//   A_log fp32 [H], dt_bias fp32 [H·D]
//   state           fp32 [slots, H, D, D], S[i][j] with i the key dim; a sequence's S is state[state_idx[n]]
//   o               bf16 [T, H, D]     (Sᵀq read after the update; the caller's o_norm follows)
// The state is updated in place.
//
// Precision: the decode is fp32 throughout (bf16 only in o). The prefill runs its chunk products on bf16
// tensor cores with fp32 accumulation and an fp32 state — the trade FLA's chunk_kda makes — and lands
// within ≈5e-3 (relative L2) of the fp32 recurrence, not at fp32 rounding.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/split.cuh"

namespace k3::cuda {

enum class KdaGate {
  kSoftplus,  // g = −exp(A_log[h]) · softplus(g_raw + dt_bias)
  kBounded,   // g = lower_bound · sigmoid(exp(A_log[h]) · (g_raw + dt_bias))   (K3)
};

struct KdaArgs {
  int64_t H = 0;
  int64_t D = 0;
  const __nv_bfloat16* q = nullptr;
  const __nv_bfloat16* k = nullptr;
  const __nv_bfloat16* v = nullptr;
  const __nv_bfloat16* g_raw = nullptr;
  // Decode only, instead of g_raw: the gate product's unfolded sums (LinearBlas::RunUnfolded), token n's
  // g_raw[h, i] at column h·D + i of row n, rounded to bf16 as the fold would have stored it.
  Sums g_sums;
  const __nv_bfloat16* b = nullptr;
  int64_t ldb = 0;  // row stride of b (elements; 0: H): b may be columns of a wider projection output
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  KdaGate gate = KdaGate::kSoftplus;
  float lower_bound = -5.0f;  // kBounded only; ≤ 0
  float* state = nullptr;
  const int32_t* state_idx = nullptr;  // [N], device
  __nv_bfloat16* o = nullptr;
};

// Decode: token n of q..b is the next token of sequence n (T = N). S[state_idx[n]] is read, advanced by
// one step and written back; state_idx[n] < 0 marks a padding row: no state access, o[n] left untouched.
cudaError_t KdaDecode(const KdaArgs& a, int64_t N, cudaStream_t stream);

// Prefill of num_seqs sequences packed along T (cu_seqlens, lengths ≥ 0). Sequence n starts from
// S[state_idx[n]] when has_initial_state[n] != 0, else from zero (has_initial_state == nullptr: all from
// zero), and its final state is written to S[state_idx[n]]. The slots must be distinct.
struct KdaPrefillBatch {
  int64_t num_seqs = 0;
  const int32_t* cu_seqlens = nullptr;        // [num_seqs + 1], device
  const uint8_t* has_initial_state = nullptr;  // [num_seqs], device, or null
  int64_t num_chunks = 0;                      // KdaNumChunks(host copy of cu_seqlens)
  void* workspace = nullptr;                   // KdaPrefillWorkspaceBytes(num_chunks, H, D), device
};

constexpr int kKdaChunk = 64;

// Σ_n ceil(T_n / 64): the prefill grid and its workspace depend on it, so the host must know the lengths.
int64_t KdaNumChunks(const int32_t* cu_seqlens_host, int64_t num_seqs);
size_t KdaPrefillWorkspaceBytes(int64_t num_chunks, int64_t H, int64_t D);
cudaError_t KdaPrefill(const KdaArgs& a, const KdaPrefillBatch& batch, cudaStream_t stream);

}  // namespace k3::cuda
