// KDA chunked prefill, chunk C = 64 (Kimi Linear report Eqs. 2–9; FLA's chunk_kda computes the same).
// Reference: k3::cpu::KdaRecurrent over each sequence (after the gate, the L2 norms and β).
//
// Within a chunk, with G the inclusive cumulative sum of the log decays from the chunk start
// (Γ_r = e^{G_r} per channel) and S₀ the state entering the chunk:
//   A[r,s]   = β_r Σ_i k_ri k_si e^{G_ri − G_si}   (s < r)        Aqk[r,s] = Σ_i q_ri k_si e^{G_ri − G_si}   (s ≤ r)
//   M        = (I + A)⁻¹                                        (UT transform: u_r depends on u_{s<r})
//   W        = M (β ⊙ K ⊙ Γ),   Ũ = M (β ⊙ V)                  (WY representation)
//   U        = Ũ − W S₀,   O = (Q ⊙ Γ) S₀ + Aqk U,   S ← Diag(Γ_C) S₀ + (K ⊙ Γ_C/Γ)ᵀ U
// Two kernels:
//   intra (one CTA per chunk and head, all chunks in parallel): everything that does not depend on S₀ —
//          gate, norms, β, A, Aqk, M, W, Ũ, Q⊙Γ, K⊙Γ_C/Γ, Γ_C — written as bf16 tiles to the workspace;
//   inter (one CTA per sequence, head and BV columns of S, sequential over the chunks): the three products
//          with S₀, S held in fp32 registers, its bf16 copy in shared memory as the MMA operand.
// The chunk products (A, Aqk, W, Ũ and the three with S₀) run on the tensor cores (mma.sync m16n8k16, bf16
// in, fp32 accumulate); the triangular inverse stays fp32 (16×16 blocks: forward substitution on the
// diagonal, then one block diagonal at a time).
//
// A and Aqk are products with a decay inside the sum. They are computed as K_l K_rᵀ over 16×16 sub-blocks
// with a reference row (the block row's first token, G_ref): K_l = k e^{G_r − G_ref} ≤ k and
// K_r = k e^{G_ref − G_s}. Off the diagonal both factors are ≤ 1. In a diagonal block e^{G_ref − G_s}
// grows with the gate's sum over ≤ 15 tokens; when it would pass 2^112 (a gate below ≈ −5.2 per token on
// average) that block is recomputed elementwise in fp32. The bounded gate with lower_bound ≥ −5 never does.
#include <algorithm>
#include <limits>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/kda.cuh"
#include "kernels/cuda/kda_common.cuh"
#include "kernels/cuda/ptx.cuh"

namespace k3::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kKdaChunk;
constexpr int kThreads = 256;
constexpr float kMaxExp2 = 112.0f;  // largest e^{G_ref − G_s} of a factored diagonal block, as a power of 2

// Per-(chunk, head) tiles passed from the intra to the inter kernel.
struct Workspace {
  bf16* W;    // [chunk][H][C][D]  M (β ⊙ K ⊙ Γ)
  bf16* U;    // [chunk][H][C][D]  Ũ = M (β ⊙ V)
  bf16* Qg;   // [chunk][H][C][D]  Q ⊙ Γ (q normalized and scaled)
  bf16* Kd;   // [chunk][H][C][D]  K ⊙ Γ_C / Γ
  bf16* A;    // [chunk][H][C][C]  Aqk, lower triangle of 16×16 blocks (blocks above it are not written)
  float* Gc;  // [chunk][H][D]     Γ_C, the decay over the whole chunk
};

Workspace CarveWorkspace(void* base, int64_t num_chunks, int64_t H, int64_t D) {
  const int64_t tile = num_chunks * H * C * D;
  Workspace ws;
  ws.W = static_cast<bf16*>(base);
  ws.U = ws.W + tile;
  ws.Qg = ws.U + tile;
  ws.Kd = ws.Qg + tile;
  ws.A = ws.Kd + tile;
  ws.Gc = reinterpret_cast<float*>(ws.A + num_chunks * H * C * C);
  return ws;
}

__device__ __forceinline__ float2 Bf2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 Ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }

struct ChunkPos {
  int n;    // sequence
  int t0;   // first token (row of q, k, ...)
  int len;  // tokens in this chunk, 1..C
};

// Run by one warp: the sequence that holds global chunk c (chunks are numbered sequence by sequence).
__device__ ChunkPos LocateChunk(const int32_t* cu_seqlens, int num_seqs, int64_t c, int lane) {
  int64_t base = 0;
  for (int n0 = 0; n0 < num_seqs; n0 += 32) {
    const int n = n0 + lane;
    const int bos = n < num_seqs ? cu_seqlens[n] : 0;
    const int len = n < num_seqs ? cu_seqlens[n + 1] - bos : 0;
    const int nc = (len + C - 1) / C;
    int incl = nc;
    for (int off = 1; off < 32; off <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += t;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, c < base + incl);
    if (hit) {
      const int l = __ffs(hit) - 1;
      const int j = static_cast<int>(c - base - __shfl_sync(0xffffffffu, incl - nc, l));
      const int sbos = __shfl_sync(0xffffffffu, bos, l), slen = __shfl_sync(0xffffffffu, len, l);
      return {n0 + l, sbos + j * C, min(C, slen - j * C)};
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return {0, 0, 0};  // c ≥ the batch's chunk count: an inconsistent num_chunks; the CTA writes nothing
}

// Run by one warp: the number of chunks of the sequences before n.
__device__ int64_t FirstChunk(const int32_t* cu_seqlens, int n, int lane) {
  int64_t sum = 0;
  for (int n0 = 0; n0 < n; n0 += 32) {
    const int m = n0 + lane;
    int nc = m < n ? (cu_seqlens[m + 1] - cu_seqlens[m] + C - 1) / C : 0;
    for (int off = 16; off > 0; off >>= 1) nc += __shfl_xor_sync(0xffffffffu, nc, off);
    sum += nc;
  }
  return sum;
}

// ---------------------------------------------------------------------------------------------------------
// Intra-chunk kernel.

template <int D>
struct IntraLayout {
  static constexpr int LDX = D + 8;  // bf16 [C][D] rows (padded: conflict-free fragment reads)
  static constexpr int LDG = D + 8;  // fp32 [C][D] rows
  static constexpr int LDA = C + 4;  // fp32 [C][C] rows
  static constexpr int LDM = C + 8;  // bf16 [C][C] rows
  // Regions and what they hold over the phases.
  static constexpr int kQ = 0;                         // raw q → β ⊙ V
  static constexpr int kK = kQ + C * LDX * 2;          // raw k → β ⊙ K ⊙ Γ
  static constexpr int kG = kK + C * LDX * 2;          // G (log2 units) → block-inverse scratch → W, Ũ staging
  static constexpr int kAkk = kG + C * LDG * 4;        // scan totals → A → bf16 M
  static constexpr int kM = kAkk + C * LDA * 4;        // raw g (bf16) → M = (I + A)⁻¹, fp32
  static constexpr int kRq = kM + C * LDA * 4;         // 1/|q| · D^-½ per row
  static constexpr int kRk = kRq + C * 4;              // 1/|k| per row
  static constexpr int kBeta = kRk + C * 4;            // β per row (0 past the chunk's end)
  static constexpr int kBytes = kBeta + C * 4;
  static_assert(2 * C * LDX * 2 <= C * LDG * 4, "W and Ũ staging must fit in the G region");
  static_assert(C * D * 2 <= C * LDA * 4, "raw g must fit in the M region");
};

template <int D>
__global__ __launch_bounds__(kThreads, 2) void KdaChunkIntraKernel(KdaArgs a, KdaPrefillBatch batch, Workspace ws) {
  PdlEnter();
  using L = IntraLayout<D>;
  constexpr int LDX = L::LDX, LDG = L::LDG, LDA = L::LDA, LDM = L::LDM;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::kQ);
  bf16* sK = reinterpret_cast<bf16*>(smem + L::kK);
  float* sG = reinterpret_cast<float*>(smem + L::kG);
  float* sAkk = reinterpret_cast<float*>(smem + L::kAkk);
  float* sM = reinterpret_cast<float*>(smem + L::kM);
  float* sRq = reinterpret_cast<float*>(smem + L::kRq);
  float* sRk = reinterpret_cast<float*>(smem + L::kRk);
  float* sBeta = reinterpret_cast<float*>(smem + L::kBeta);
  __shared__ ChunkPos spos;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int64_t c = blockIdx.x, H = a.H;
  const int h = blockIdx.y;
  // Gate parameters: thread (pair, part) owns channels ch, ch + 1 of the 16 rows of block `part`.
  constexpr int kGateThreads = 2 * D;  // D/2 channel pairs × 4 row blocks
  const int ch = 2 * (tid % (D / 2)), part = tid / (D / 2);
  const float Ah = expf(a.A_log[h]);
  const float2 bias = tid < kGateThreads ? Ld2(a.dt_bias + h * D + ch) : make_float2(0.0f, 0.0f);
  if (warp == 0) {
    const ChunkPos p = LocateChunk(batch.cu_seqlens, static_cast<int>(batch.num_seqs), c, lane);
    if (lane == 0) spos = p;
  }
  __syncthreads();
  const int t0 = spos.t0, len = spos.len;
  if (len == 0) return;
  const int64_t tile = c * H + h;

  // ---- Raw q, k and g rows → shared in one round trip (zeros past the chunk's end), β.
  bf16* sGraw = reinterpret_cast<bf16*>(smem + L::kM);  // [C][D], until the gate is computed
  for (int idx = tid; idx < C * D / 8; idx += kThreads) {
    const int r = idx / (D / 8), col = idx % (D / 8) * 8;
    const bool in = r < len;
    const int64_t off = in ? ((t0 + r) * H + h) * D + col : 0;
    ptx::CpAsync16(sQ + r * LDX + col, a.q + off, in ? 16 : 0);
    ptx::CpAsync16(sK + r * LDX + col, a.k + off, in ? 16 : 0);
    ptx::CpAsync16(sGraw + r * D + col, a.g_raw + off, in ? 16 : 0);
  }
  ptx::CpAsyncCommit();
  const int64_t ldb = a.ldb ? a.ldb : H;
  if (tid < C) sBeta[tid] = tid < len ? kda::Sigmoid(__bfloat162float(a.b[(t0 + tid) * ldb + h])) : 0.0f;
  ptx::CpAsyncWaitAll();
  __syncthreads();

  // ---- Gate → cumulative sum within each 16-row block (log2 units), joined across blocks below; row norms.
  float* sTot = sAkk;  // [4][D]: each block's sum
  float2 gcum[16];
  if (tid < kGateThreads) {
    float2 run = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int r = 16 * part + j;
      if (r < len) {  // rows past the end decay by nothing
        const float2 x = Bf2(sGraw + r * D + ch);
        run.x += kda::Gate(a.gate, x.x + bias.x, Ah, a.lower_bound) * kda::kLog2e;
        run.y += kda::Gate(a.gate, x.y + bias.y, Ah, a.lower_bound) * kda::kLog2e;
      }
      gcum[j] = run;
    }
    *reinterpret_cast<float2*>(sTot + part * D + ch) = run;
  }
  {  // warp w takes rows 8w..8w+7
    constexpr int kPer = D / 32;
    const float scale = 1.0f / sqrtf(static_cast<float>(D));
    for (int j = 0; j < 8; ++j) {
      const int r = warp * 8 + j;
      float qq = 0.0f, kk = 0.0f;
#pragma unroll
      for (int e = 0; e < kPer; e += 2) {
        const float2 q = Bf2(sQ + r * LDX + lane * kPer + e), k = Bf2(sK + r * LDX + lane * kPer + e);
        qq += q.x * q.x + q.y * q.y;
        kk += k.x * k.x + k.y * k.y;
      }
      for (int off = 16; off > 0; off >>= 1) {
        qq += __shfl_xor_sync(0xffffffffu, qq, off);
        kk += __shfl_xor_sync(0xffffffffu, kk, off);
      }
      if (lane == 0) sRq[r] = rsqrtf(qq + 1e-6f) * scale, sRk[r] = rsqrtf(kk + 1e-6f);
    }
  }
  __syncthreads();
  if (tid < kGateThreads) {
    float2 off = {0.0f, 0.0f};
    for (int p = 0; p < part; ++p) {
      const float2 t = Ld2(sTot + p * D + ch);
      off.x += t.x, off.y += t.y;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<float2*>(sG + (16 * part + j) * LDG + ch) = make_float2(gcum[j].x + off.x, gcum[j].y + off.y);
  }
  __syncthreads();

  // ---- A (fp32, shared) and Aqk (bf16, workspace) on the tensor cores, 16×16 blocks (R, S ≤ R).
  // Warp (R, p) computes blocks S = p, p + 2 of block row R; its A operands (K_l, Q_l) are built once per
  // k-step and shared by both blocks and both products, the B operand K_r is shared by both products.
  {
    const int R = warp >> 1, p = warp & 1;
    const int rlo = 16 * R + gid, rhi = rlo + 8;
    const float rklo = sRk[rlo], rkhi = sRk[rhi], rqlo = sRq[rlo], rqhi = sRq[rhi];
    const float* Gref = sG + 16 * R * LDG;
    float accK[2][2][4] = {}, accQ[2][2][4] = {};
    bool clamped = false;
    for (int kk = 0; kk < D / 16; ++kk) {
      const int i0 = kk * 16 + 2 * tig;  // channels i0, i0 + 1 (a0, a1, b0) and i0 + 8, i0 + 9 (a2, a3, b1)
      const float2 ref0 = Ld2(Gref + i0), ref1 = Ld2(Gref + i0 + 8);
      uint32_t aK[4], aQ[4];
      auto left = [&](int r, int i, float2 ref, float rk, float rq, uint32_t& outK, uint32_t& outQ) {
        const float2 g = Ld2(sG + r * LDG + i);
        const float e0 = exp2f(g.x - ref.x), e1 = exp2f(g.y - ref.y);
        const float2 k = Bf2(sK + r * LDX + i), q = Bf2(sQ + r * LDX + i);
        outK = ptx::PackBf16(k.x * rk * e0, k.y * rk * e1);
        outQ = ptx::PackBf16(q.x * rq * e0, q.y * rq * e1);
      };
      left(rlo, i0, ref0, rklo, rqlo, aK[0], aQ[0]);
      left(rhi, i0, ref0, rkhi, rqhi, aK[1], aQ[1]);
      left(rlo, i0 + 8, ref1, rklo, rqlo, aK[2], aQ[2]);
      left(rhi, i0 + 8, ref1, rkhi, rqhi, aK[3], aQ[3]);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int S = p + 2 * t;
        if (S > R) continue;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int s = 16 * S + 8 * nt + gid;
          const float rks = sRk[s];
          const float2 g0 = Ld2(sG + s * LDG + i0), g1 = Ld2(sG + s * LDG + i0 + 8);
          float x[4] = {ref0.x - g0.x, ref0.y - g0.y, ref1.x - g1.x, ref1.y - g1.y};  // ≤ 0 off the diagonal
          if (S == R) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              clamped |= x[e] > kMaxExp2;
              x[e] = fminf(x[e], kMaxExp2);
            }
          }
          const float2 k0 = Bf2(sK + s * LDX + i0), k1 = Bf2(sK + s * LDX + i0 + 8);
          const uint32_t b0 = ptx::PackBf16(k0.x * rks * exp2f(x[0]), k0.y * rks * exp2f(x[1]));
          const uint32_t b1 = ptx::PackBf16(k1.x * rks * exp2f(x[2]), k1.y * rks * exp2f(x[3]));
          ptx::Mma(accK[t][nt], aK, b0, b1);
          ptx::Mma(accQ[t][nt], aQ, b0, b1);
        }
      }
    }
    // Only a diagonal block can clamp; when it did, the block is recomputed below instead.
    const bool unsafe = __any_sync(0xffffffffu, clamped);
    bf16* gA = ws.A + tile * C * C;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int S = p + 2 * t;
      if (S > R || (S == R && unsafe)) continue;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int s = 16 * S + 8 * nt + 2 * tig;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = half ? rhi : rlo;
          const float br = sBeta[r];
          const float* kv = accK[t][nt] + 2 * half;
          const float* qv = accQ[t][nt] + 2 * half;
          *reinterpret_cast<float2*>(sAkk + r * LDA + s) =
              make_float2(s < r ? br * kv[0] : 0.0f, s + 1 < r ? br * kv[1] : 0.0f);
          *reinterpret_cast<uint32_t*>(gA + r * C + s) =
              ptx::PackBf16(s <= r ? qv[0] : 0.0f, s + 1 <= r ? qv[1] : 0.0f);
        }
      }
    }
    if (unsafe) {  // this warp holds the diagonal block R
      for (int e = lane; e < 256; e += 32) {
        const int r = 16 * R + e / 16, s = 16 * R + e % 16;
        float kk = 0.0f, qk = 0.0f;
        if (s <= r) {
          for (int i = 0; i < D; ++i) {
            const float w = __bfloat162float(sK[s * LDX + i]) * exp2f(sG[r * LDG + i] - sG[s * LDG + i]);
            kk += __bfloat162float(sK[r * LDX + i]) * w;
            qk += __bfloat162float(sQ[r * LDX + i]) * w;
          }
        }
        sAkk[r * LDA + s] = s < r ? sBeta[r] * sRk[r] * sRk[s] * kk : 0.0f;
        gA[r * C + s] = __float2bfloat16(sRq[r] * sRk[s] * qk);
      }
    }
  }
  __syncthreads();

  // ---- Diagonal blocks of M = (I + A)⁻¹ by forward substitution (warps 0-3, lane c: column c), while
  // every thread writes the elementwise outputs and turns raw k into β ⊙ K ⊙ Γ in place.
  constexpr int kItems = C * D / 8 / kThreads;  // 8-channel row pieces per thread
  uint4 vraw[kItems];                           // V for Ũ, loaded now to overlap its latency
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int idx = tid + j * kThreads, r = idx / (D / 8), col = idx % (D / 8) * 8;
    vraw[j] = r < len ? *reinterpret_cast<const uint4*>(a.v + ((t0 + r) * H + h) * D + col) : make_uint4(0, 0, 0, 0);
  }
  if (warp < 4) {
    const int R = warp, cc = lane & 15;
    const float* Ab = sAkk + 16 * R * LDA + 16 * R;
    float m[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float acc = r == cc ? 1.0f : 0.0f;
#pragma unroll
      for (int s = 0; s < r; ++s) acc -= Ab[r * LDA + s] * m[s];
      m[r] = acc;
    }
    if (lane < 16)
#pragma unroll
      for (int r = 0; r < 16; ++r) sM[(16 * R + r) * LDA + 16 * R + cc] = m[r];
  }
  {
    const float* Glast = sG + (C - 1) * LDG;
    bf16* gQg = ws.Qg + tile * C * D;
    bf16* gKd = ws.Kd + tile * C * D;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int idx = tid + j * kThreads, r = idx / (D / 8), col = idx % (D / 8) * 8;
      const float rq = sRq[r], rk = sRk[r], br = sBeta[r];
      uint32_t qg[4], kd[4], kb[4];
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const float2 q = Bf2(sQ + r * LDX + col + e), k = Bf2(sK + r * LDX + col + e);
        const float2 g = Ld2(sG + r * LDG + col + e), gl = Ld2(Glast + col + e);
        const float ex = exp2f(g.x), ey = exp2f(g.y);
        qg[e / 2] = ptx::PackBf16(q.x * rq * ex, q.y * rq * ey);
        kd[e / 2] = ptx::PackBf16(k.x * rk * exp2f(gl.x - g.x), k.y * rk * exp2f(gl.y - g.y));
        kb[e / 2] = ptx::PackBf16(br * k.x * rk * ex, br * k.y * rk * ey);
      }
      *reinterpret_cast<uint4*>(gQg + r * D + col) = make_uint4(qg[0], qg[1], qg[2], qg[3]);
      *reinterpret_cast<uint4*>(gKd + r * D + col) = make_uint4(kd[0], kd[1], kd[2], kd[3]);
      *reinterpret_cast<uint4*>(sK + r * LDX + col) = make_uint4(kb[0], kb[1], kb[2], kb[3]);
    }
    if (tid < D) ws.Gc[tile * D + tid] = exp2f(Glast[tid]);
  }
  __syncthreads();

  // ---- β ⊙ V into the q region; the off-diagonal blocks of M, one block diagonal at a time:
  // M_RS = −M_RR Σ_{k=S}^{R−1} A_Rk M_kS.
  bf16* sV = sQ;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int idx = tid + j * kThreads, r = idx / (D / 8), col = idx % (D / 8) * 8;
    const float br = sBeta[r];
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&vraw[j]);
    uint32_t out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
      out[e] = ptx::PackBf16(br * v.x, br * v.y);
    }
    *reinterpret_cast<uint4*>(sV + r * LDX + col) = make_uint4(out[0], out[1], out[2], out[3]);
  }
  {
    float* sX = sG;  // [3][16][16]
    const int rr = tid >> 4, cc = tid & 15;
    for (int d = 1; d < 4; ++d) {
      for (int t = 0; t < 4 - d; ++t) {
        const int R = d + t, S = R - d;
        float x = 0.0f;
        for (int k = S; k < R; ++k)
#pragma unroll
          for (int j = 0; j < 16; ++j) x += sAkk[(16 * R + rr) * LDA + 16 * k + j] * sM[(16 * k + j) * LDA + 16 * S + cc];
        sX[t * 256 + rr * 16 + cc] = x;
      }
      __syncthreads();
      for (int t = 0; t < 4 - d; ++t) {
        const int R = d + t, S = R - d;
        float y = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) y -= sM[(16 * R + rr) * LDA + 16 * R + j] * sX[t * 256 + j * 16 + cc];
        sM[(16 * R + rr) * LDA + 16 * S + cc] = y;
      }
      __syncthreads();
    }
  }
  bf16* sMb = reinterpret_cast<bf16*>(smem + L::kAkk);
  for (int idx = tid; idx < C * C; idx += kThreads) {
    const int r = idx / C, s = idx % C;
    if (s / 16 <= r / 16) sMb[r * LDM + s] = __float2bfloat16(sM[r * LDA + s]);
  }
  __syncthreads();

  // ---- W = M (β ⊙ K ⊙ Γ) (warps 0-3) and Ũ = M (β ⊙ V) (warps 4-7), D/4 columns per warp, M lower
  // block-triangular; staged through shared memory for coalesced stores.
  {
    constexpr int kSlab = D / 4, NT = kSlab / 8;
    const bf16* B = warp < 4 ? sK : sV;
    const int n0 = (warp & 3) * kSlab;
    bf16* stage = reinterpret_cast<bf16*>(smem + L::kG) + (warp < 4 ? 0 : C * LDX);
#pragma unroll
    for (int R = 0; R < 4; ++R) {
      float acc[NT][4] = {};
      for (int j = 0; j <= R; ++j) {
        uint32_t af[4];
        ptx::LdMatrixX4(af, ptx::FragA(sMb, LDM, 16 * R, 16 * j, lane));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bfr[4];
          ptx::LdMatrixX4Trans(bfr, ptx::FragBT(B, LDX, 16 * j, n0 + 16 * np, lane));
          ptx::Mma(acc[2 * np], af, bfr[0], bfr[1]);
          ptx::Mma(acc[2 * np + 1], af, bfr[2], bfr[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = n0 + 8 * nt + 2 * tig, r = 16 * R + gid;
        *reinterpret_cast<uint32_t*>(stage + r * LDX + col) = ptx::PackBf16(acc[nt][0], acc[nt][1]);
        *reinterpret_cast<uint32_t*>(stage + (r + 8) * LDX + col) = ptx::PackBf16(acc[nt][2], acc[nt][3]);
      }
    }
  }
  __syncthreads();
  {
    const bf16* stage = reinterpret_cast<const bf16*>(smem + L::kG);
    for (int idx = tid; idx < 2 * C * D / 8; idx += kThreads) {
      const int m = idx / (C * D / 8), rem = idx % (C * D / 8), r = rem / (D / 8), col = rem % (D / 8) * 8;
      bf16* dst = (m == 0 ? ws.W : ws.U) + tile * C * D;
      *reinterpret_cast<uint4*>(dst + r * D + col) = *reinterpret_cast<const uint4*>(stage + (m * C + r) * LDX + col);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Inter-chunk kernel.

template <int D, int BV, int kStages>
struct InterLayout {
  static constexpr int LDX = D + 8, LDV = BV + 8, LDM = C + 8;
  // One stage: the chunk's tiles from the workspace (a ring of kStages, filled by cp.async).
  static constexpr int kW = 0;
  static constexpr int kQg = kW + C * LDX * 2;
  static constexpr int kKd = kQg + C * LDX * 2;
  static constexpr int kU0 = kKd + C * LDX * 2;  // Ũ, this CTA's BV columns
  static constexpr int kA = kU0 + C * LDV * 2;
  static constexpr int kGc = kA + C * LDM * 2;
  static constexpr int kStage = kGc + D * 4;
  static constexpr int kSb = kStages * kStage;  // bf16 S [D][BV]: the MMA operand
  static constexpr int kUb = kSb + D * LDV * 2;  // bf16 U [C][BV]
  static constexpr int kBytes = kUb + C * LDV * 2;
};

// As many stages as fit (up to 4): a narrow CTA computes a chunk in less than a load's latency.
template <int D, int BV>
__host__ __device__ constexpr int InterStages() {
  constexpr int kMaxBytes = 227 * 1024;
  if (InterLayout<D, BV, 4>::kBytes <= kMaxBytes) return 4;
  if (InterLayout<D, BV, 3>::kBytes <= kMaxBytes) return 3;
  return 2;
}

template <int D, int BV>
__global__ __launch_bounds__(kThreads, 1) void KdaChunkInterKernel(KdaArgs a, KdaPrefillBatch batch, Workspace ws) {
  PdlEnter();
  constexpr int kStages = InterStages<D, BV>();
  using L = InterLayout<D, BV, kStages>;
  constexpr int LDX = L::LDX, LDV = L::LDV, LDM = L::LDM;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sSb = reinterpret_cast<bf16*>(smem + L::kSb);
  bf16* sUb = reinterpret_cast<bf16*>(smem + L::kUb);
  __shared__ int64_t sfirst;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int vb = blockIdx.x, h = blockIdx.y, n = blockIdx.z;
  const int64_t H = a.H;
  if (warp == 0) {
    const int64_t f = FirstChunk(batch.cu_seqlens, n, lane);
    if (lane == 0) sfirst = f;
  }
  const int bos = batch.cu_seqlens[n], T = batch.cu_seqlens[n + 1] - bos, nch = (T + C - 1) / C;
  const bool init = batch.has_initial_state != nullptr && batch.has_initial_state[n] != 0;

  // S [D][BV] in registers: warp → rows m0..m0+15, columns cs0.. (NTS n-tiles of 8).
  constexpr int kRowTiles = D / 16, kColParts = 8 / kRowTiles, NTS = BV / 8 / kColParts;
  const int m0 = 16 * (warp % kRowTiles), cs0 = warp / kRowTiles * (BV / kColParts);
  float* Sg = a.state + (static_cast<int64_t>(a.state_idx[n]) * H + h) * D * D + vb * BV;
  float accS[NTS][4];
#pragma unroll
  for (int nt = 0; nt < NTS; ++nt) {
    const int col = cs0 + 8 * nt + 2 * tig;
    const float2 lo = init ? Ld2(Sg + (m0 + gid) * D + col) : make_float2(0.0f, 0.0f);
    const float2 hi = init ? Ld2(Sg + (m0 + gid + 8) * D + col) : make_float2(0.0f, 0.0f);
    accS[nt][0] = lo.x, accS[nt][1] = lo.y, accS[nt][2] = hi.x, accS[nt][3] = hi.y;
  }
  auto store_sb = [&] {
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt) {
      const int col = cs0 + 8 * nt + 2 * tig;
      *reinterpret_cast<uint32_t*>(sSb + (m0 + gid) * LDV + col) = ptx::PackBf16(accS[nt][0], accS[nt][1]);
      *reinterpret_cast<uint32_t*>(sSb + (m0 + gid + 8) * LDV + col) = ptx::PackBf16(accS[nt][2], accS[nt][3]);
    }
  };
  store_sb();
  __syncthreads();
  const int64_t first = sfirst;

  auto prefetch = [&](int j) {
    unsigned char* st = smem + (j % kStages) * L::kStage;
    const int64_t tile = (first + j) * H + h;
    const bf16* src[3] = {ws.W + tile * C * D, ws.Qg + tile * C * D, ws.Kd + tile * C * D};
    const int dst[3] = {L::kW, L::kQg, L::kKd};
#pragma unroll
    for (int m = 0; m < 3; ++m)
      for (int idx = tid; idx < C * D / 8; idx += kThreads) {
        const int r = idx / (D / 8), col = idx % (D / 8) * 8;
        ptx::CpAsync16(reinterpret_cast<bf16*>(st + dst[m]) + r * LDX + col, src[m] + r * D + col);
      }
    const bf16* gU = ws.U + tile * C * D + vb * BV;
    for (int idx = tid; idx < C * BV / 8; idx += kThreads) {
      const int r = idx / (BV / 8), col = idx % (BV / 8) * 8;
      ptx::CpAsync16(reinterpret_cast<bf16*>(st + L::kU0) + r * LDV + col, gU + r * D + col);
    }
    const bf16* gA = ws.A + tile * C * C;
    for (int idx = tid; idx < C * C / 8; idx += kThreads) {
      const int r = idx / (C / 8), col = idx % (C / 8) * 8;
      ptx::CpAsync16(reinterpret_cast<bf16*>(st + L::kA) + r * LDM + col, gA + r * C + col);
    }
    for (int idx = tid; idx < D / 4; idx += kThreads)
      ptx::CpAsync16(reinterpret_cast<float*>(st + L::kGc) + 4 * idx, ws.Gc + tile * D + 4 * idx);
  };
  // One commit group per chunk (empty past the end), so chunk j is complete when ≤ kStages − 2 groups remain.
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < nch) prefetch(j);
    ptx::CpAsyncCommit();
  }

  // U and O: warp → token rows 16·rb.., columns cu0.. (NTU n-tiles of 8).
  constexpr int NTU = BV / 16;
  const int rb = warp & 3, cu0 = (warp >> 2) * (BV / 2);
  for (int j = 0; j < nch; ++j) {
    ptx::CpAsyncWaitGroup<kStages - 2>();
    __syncthreads();
    if (j + kStages - 1 < nch) prefetch(j + kStages - 1);
    ptx::CpAsyncCommit();
    const unsigned char* st = smem + (j % kStages) * L::kStage;
    const bf16* sW = reinterpret_cast<const bf16*>(st + L::kW);
    const bf16* sQg = reinterpret_cast<const bf16*>(st + L::kQg);
    const bf16* sKd = reinterpret_cast<const bf16*>(st + L::kKd);
    const bf16* sU0 = reinterpret_cast<const bf16*>(st + L::kU0);
    const bf16* sA = reinterpret_cast<const bf16*>(st + L::kA);
    const float* sGc = reinterpret_cast<const float*>(st + L::kGc);

    // W S₀ and (Q ⊙ Γ) S₀ share the B operand.
    float accU[NTU][4] = {}, accO[NTU][4] = {};
#pragma unroll 2
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aW[4], aQ[4];
      ptx::LdMatrixX4(aW, ptx::FragA(sW, LDX, 16 * rb, 16 * kk, lane));
      ptx::LdMatrixX4(aQ, ptx::FragA(sQg, LDX, 16 * rb, 16 * kk, lane));
#pragma unroll
      for (int np = 0; np < NTU / 2; ++np) {
        uint32_t b[4];
        ptx::LdMatrixX4Trans(b, ptx::FragBT(sSb, LDV, 16 * kk, cu0 + 16 * np, lane));
        ptx::Mma(accU[2 * np], aW, b[0], b[1]);
        ptx::Mma(accU[2 * np + 1], aW, b[2], b[3]);
        ptx::Mma(accO[2 * np], aQ, b[0], b[1]);
        ptx::Mma(accO[2 * np + 1], aQ, b[2], b[3]);
      }
    }
    // U = Ũ − W S₀, as bf16: the operand of both products that follow.
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt) {
      const int col = cu0 + 8 * nt + 2 * tig;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * rb + gid + 8 * half;
        const float2 u0 = Bf2(sU0 + r * LDV + col);
        *reinterpret_cast<uint32_t*>(sUb + r * LDV + col) =
            ptx::PackBf16(u0.x - accU[nt][2 * half], u0.y - accU[nt][2 * half + 1]);
      }
    }
    __syncthreads();

    // O += Aqk U over the blocks up to the diagonal.
    for (int jj = 0; jj <= rb; ++jj) {
      uint32_t aA[4];
      ptx::LdMatrixX4(aA, ptx::FragA(sA, LDM, 16 * rb, 16 * jj, lane));
#pragma unroll
      for (int np = 0; np < NTU / 2; ++np) {
        uint32_t b[4];
        ptx::LdMatrixX4Trans(b, ptx::FragBT(sUb, LDV, 16 * jj, cu0 + 16 * np, lane));
        ptx::Mma(accO[2 * np], aA, b[0], b[1]);
        ptx::Mma(accO[2 * np + 1], aA, b[2], b[3]);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = C * j + 16 * rb + gid + 8 * half;
      if (t < T) {
        bf16* o = a.o + ((bos + t) * H + h) * D + vb * BV;
#pragma unroll
        for (int nt = 0; nt < NTU; ++nt)
          *reinterpret_cast<uint32_t*>(o + cu0 + 8 * nt + 2 * tig) =
              ptx::PackBf16(accO[nt][2 * half], accO[nt][2 * half + 1]);
      }
    }

    // S ← Diag(Γ_C) S + Kdᵀ U.
    const float gclo = sGc[m0 + gid], gchi = sGc[m0 + gid + 8];
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt) accS[nt][0] *= gclo, accS[nt][1] *= gclo, accS[nt][2] *= gchi, accS[nt][3] *= gchi;
#pragma unroll
    for (int jj = 0; jj < C / 16; ++jj) {
      uint32_t aK[4];
      ptx::LdMatrixX4Trans(aK, ptx::FragAT(sKd, LDX, 16 * jj, m0, lane));
#pragma unroll
      for (int np = 0; np < NTS / 2; ++np) {
        uint32_t b[4];
        ptx::LdMatrixX4Trans(b, ptx::FragBT(sUb, LDV, 16 * jj, cs0 + 16 * np, lane));
        ptx::Mma(accS[2 * np], aK, b[0], b[1]);
        ptx::Mma(accS[2 * np + 1], aK, b[2], b[3]);
      }
    }
    store_sb();
  }

#pragma unroll
  for (int nt = 0; nt < NTS; ++nt) {
    const int col = cs0 + 8 * nt + 2 * tig;
    *reinterpret_cast<float2*>(Sg + (m0 + gid) * D + col) = make_float2(accS[nt][0], accS[nt][1]);
    *reinterpret_cast<float2*>(Sg + (m0 + gid + 8) * D + col) = make_float2(accS[nt][2], accS[nt][3]);
  }
}

// The inter kernel runs one CTA per SM; more CTAs (narrower BV) fill more SMs but repeat the work that
// does not depend on BV. Cost model: waves × (BV + 64).
int ChooseBV(int64_t D, int64_t seq_heads, int sms) {
  int best = static_cast<int>(D);
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  for (int bv = static_cast<int>(D); bv >= 32; bv /= 2) {
    const int64_t ctas = seq_heads * (D / bv), waves = (ctas + sms - 1) / sms;
    const int64_t cost = waves * (bv + 64);
    if (cost < best_cost) best = bv, best_cost = cost;
  }
  return best;
}

template <int D, int BV>
cudaError_t LaunchInter(const KdaArgs& a, const KdaPrefillBatch& b, const Workspace& ws, cudaStream_t stream) {
  constexpr int kBytes = InterLayout<D, BV, InterStages<D, BV>()>::kBytes;
  const cudaError_t e =
      cudaFuncSetAttribute(KdaChunkInterKernel<D, BV>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(D / BV, static_cast<unsigned>(a.H), static_cast<unsigned>(b.num_seqs));
  K3_CUDA_TRY(LaunchKernel(KdaChunkInterKernel<D, BV>, grid, kThreads, kBytes, stream, a, b, ws));
  return cudaGetLastError();
}

template <int D>
cudaError_t Launch(const KdaArgs& a, const KdaPrefillBatch& b, cudaStream_t stream) {
  const Workspace ws = CarveWorkspace(b.workspace, b.num_chunks, a.H, D);
  if (b.num_chunks > 0) {
    constexpr int kBytes = IntraLayout<D>::kBytes;
    const cudaError_t e = cudaFuncSetAttribute(KdaChunkIntraKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (e != cudaSuccess) return e;
    K3_CUDA_TRY(LaunchKernel(KdaChunkIntraKernel<D>,
                             dim3(static_cast<unsigned>(b.num_chunks), static_cast<unsigned>(a.H)), kThreads, kBytes,
                             stream, a, b, ws));
    if (const cudaError_t le = cudaGetLastError(); le != cudaSuccess) return le;
  }
  int sms = 0;
  if (const cudaError_t e = SmCount(&sms); e != cudaSuccess) return e;
  switch (ChooseBV(D, b.num_seqs * a.H, sms)) {
    case 128:
      if constexpr (D == 128) return LaunchInter<D, 128>(a, b, ws, stream);
      break;
    case 64:
      return LaunchInter<D, 64>(a, b, ws, stream);
    default:
      return LaunchInter<D, 32>(a, b, ws, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

int64_t KdaNumChunks(const int32_t* cu_seqlens_host, int64_t num_seqs) {
  int64_t n = 0;
  for (int64_t i = 0; i < num_seqs; ++i) n += (cu_seqlens_host[i + 1] - cu_seqlens_host[i] + C - 1) / C;
  return n;
}

size_t KdaPrefillWorkspaceBytes(int64_t num_chunks, int64_t H, int64_t D) {
  return static_cast<size_t>(num_chunks * H * (4 * C * D * 2 + C * C * 2 + D * 4));
}

cudaError_t KdaPrefill(const KdaArgs& a, const KdaPrefillBatch& b, cudaStream_t stream) {
  if (!kda::ValidArgs(a) || !a.g_raw || b.num_seqs < 0 || b.num_seqs > 65535 || b.num_chunks < 0 ||
      b.num_chunks > 0x7fffffff || a.H > 65535)
    return cudaErrorInvalidValue;
  if (b.num_seqs == 0) return cudaSuccess;
  if (!b.cu_seqlens || (b.num_chunks > 0 && !b.workspace)) return cudaErrorInvalidValue;
  return a.D == 128 ? Launch<128>(a, b, stream) : Launch<64>(a, b, stream);
}

}  // namespace k3::cuda
