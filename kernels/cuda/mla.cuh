// MLA (NoPE) on the GPU over per-sequence latent caches (DESIGN §1.3). Reference: k3::cpu::MlaAttention*.
//
// A sequence's cache is [max_ctx, cw] bf16, cw = r + dr: per token the RMS-normalized c_kv then k_r.
//   q     split [T, nh·(dn + dr)] (per head: q_nope then q_r)
//   kv_b  bf16 [nh·(dn + dv), r] (per head: dn rows of W_UK, then dv rows of W_UV)
//   out   split [T, nh·dv]
// Decode uses the absorbed form (W_UK folded into the query, W_UV after the latent context: the cache is read
// in its compressed width, on the tensor cores, split over CTAs and merged); prefill the expanded one (keys and values rebuilt through kv_b, then two batched
// products on the tensor cores). The products run through linear.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {

#ifdef __CUDACC__
#define K3_MLA_HD __host__ __device__
#else
#define K3_MLA_HD
#endif

struct MlaDims {
  int64_t nh = 0, dn = 0, dr = 0, dv = 0, r = 0;
  K3_MLA_HD int64_t dqk() const { return dn + dr; }
  K3_MLA_HD int64_t dkv() const { return dn + dv; }
  K3_MLA_HD int64_t cw() const { return r + dr; }
};

// cache[slot[n]][pos[n]] = [RMSNorm(c_kv; norm_w, eps) | k_r] for the N tokens of c (split [N, cw]).
cudaError_t MlaCacheAppend(int64_t N, const MlaDims& s, Split c, const float* norm_w, float eps,
                           const int32_t* tok_slot, const int32_t* tok_pos, __nv_bfloat16* cache, int64_t max_ctx,
                           cudaStream_t stream);

// w_ukt [nh][r][dn] = W_UKᵀ per head, from kv_b: the weight of the absorbed query product.
cudaError_t MlaTransposeUk(const MlaDims& s, const __nv_bfloat16* kv_b, __nv_bfloat16* w_ukt, cudaStream_t stream);

// Decode: token n (of sequence slot[n], at position pos[n], its own row already appended) attends to its
// cache rows 0..pos[n]. Takes cw = r + dr a multiple of 8 up to 576 and r a multiple of 16 up to 512
// (MlaDecodeSupported); other shapes get cudaErrorNotSupported.
bool MlaDecodeSupported(const MlaDims& s);
size_t MlaDecodeWorkspaceBytes(const MlaDims& s, int64_t N);
// The per-head products (the query's with W_UK, the context's with W_UV) run on `blas`, each one strided batch of
// the heads on cuBLASLt (its workspace: LinearBlas::WorkspaceBytes(N, r, dn, nh) at least).
cudaError_t MlaDecode(int64_t N, const MlaDims& s, Split q, const __nv_bfloat16* cache, int64_t max_ctx,
                      const int32_t* tok_slot, const int32_t* tok_pos, const __nv_bfloat16* kv_b,
                      const __nv_bfloat16* w_ukt, float scale, Split out, void* workspace, LinearBlas& blas,
                      cudaStream_t stream);
// MlaDecode from the input product's unfolded sums x (N rows of [q | c_kv | k_r], nh·dqk + cw columns),
// appending the tokens' cache rows first (MlaCacheAppend's): the fold of x, the append and the query's split in
// one pass, with the bits of MlaCacheAppend + MlaDecode on the folded x.
cudaError_t MlaDecodeSums(int64_t N, const MlaDims& s, Sums x, const float* norm_w, float eps,
                          __nv_bfloat16* cache, int64_t max_ctx, const int32_t* tok_slot, const int32_t* tok_pos,
                          const __nv_bfloat16* kv_b, const __nv_bfloat16* w_ukt, float scale, Split out,
                          void* workspace, LinearBlas& blas, cudaStream_t stream);

// Prefill of one sequence: T new tokens at positions P..P+T−1 over cache rows 0..P+T−1 (the new ones
// appended), in query tiles of up to Tq tokens.
size_t MlaPrefillWorkspaceBytes(const MlaDims& s, int64_t L, int64_t Tq);
cudaError_t MlaPrefill(const MlaDims& s, int64_t T, int64_t P, Split q, const __nv_bfloat16* cache,
                       const __nv_bfloat16* kv_b, float scale, Split out, int64_t Tq, void* workspace,
                       cudaStream_t stream);

}  // namespace k3::cuda
