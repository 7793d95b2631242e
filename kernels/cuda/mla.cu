#include "kernels/cuda/mla.cuh"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 128;
constexpr float kNegInf = -INFINITY;

__device__ __forceinline__ float WarpSum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

size_t Round256(size_t n) { return (n + 255) / 256 * 256; }

// Token n's cache row from its [c_kv | k_r] values v(i), by a block of kThreads: RMSNorm of c_kv (fp32), then bf16.
template <class Value>
__device__ void AppendRow(const MlaDims& s, int64_t n, Value v, const float* norm_w, float eps, const int32_t* tok_slot,
                          const int32_t* tok_pos, __nv_bfloat16* cache, int64_t max_ctx) {
  __shared__ float part[kThreads / 32];
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < s.r; i += kThreads) {
    const float x = v(i);
    ss += x * x;
  }
  ss = WarpSum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  ss = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) ss += part[w];
  const float rinv = rsqrtf(ss / static_cast<float>(s.r) + eps);
  __nv_bfloat16* dst = cache + (int64_t{tok_slot[n]} * max_ctx + tok_pos[n]) * s.cw();
  for (int64_t i = threadIdx.x; i < s.cw(); i += kThreads) {
    const float x = v(i);
    dst[i] = __float2bfloat16_rn(i < s.r ? norm_w[i] * (x * rinv) : x);
  }
}

// One CTA per token: its cache row from c (split [N, cw]).
__global__ __launch_bounds__(kThreads) void AppendKernel(MlaDims s, Split c, const float* norm_w, float eps,
                                                          const int32_t* tok_slot, const int32_t* tok_pos,
                                                          __nv_bfloat16* cache, int64_t max_ctx) {
  PdlEnter();
  const int64_t n = blockIdx.x;
  const __nv_bfloat16* src = c.p + n * c.ld;
  AppendRow(s, n, [&](int64_t i) { return LoadSplit(src + i, c.lo); }, norm_w, eps, tok_slot, tok_pos, cache, max_ctx);
}

__global__ void TransposeUkKernel(MlaDims s, const __nv_bfloat16* kv_b, __nv_bfloat16* w_ukt) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (i >= s.nh * s.r * s.dn) return;
  const int64_t h = i / (s.r * s.dn), c = i / s.dn % s.r, d = i % s.dn;
  w_ukt[i] = kv_b[(h * s.dkv() + d) * s.r + c];
}

// The query taken apart: its rope part into the absorbed query [q_nope·W_UK | q_r] (qa[n, h, r:] = q_r of token n,
// head h), its nope part into qn [N, nh·dn] (both planes, lo N·nh·dn on: one strided batch of the heads reads it in
// place, whatever else is in the batch). Where query column d of token n, head h goes; *lo: its lo plane's offset.
__device__ __forceinline__ __nv_bfloat16* QueryDst(const MlaDims& s, int64_t n, int64_t h, int64_t d, Split qa,
                                                   Split qn, int64_t* lo) {
  *lo = d < s.dn ? qn.lo : qa.lo;
  return d < s.dn ? qn.p + n * qn.ld + h * s.dn + d : qa.p + (n * s.nh + h) * s.cw() + s.r + d - s.dn;
}

__global__ void SplitQueryKernel(int64_t N, MlaDims s, Split q, Split qa, Split qn) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (i >= N * s.nh * s.dqk()) return;
  const int64_t n = i / (s.nh * s.dqk()), h = i / s.dqk() % s.nh, d = i % s.dqk();
  const __nv_bfloat16* src = q.p + n * q.ld + h * s.dqk() + d;
  int64_t dst_lo;
  __nv_bfloat16* dst = QueryDst(s, n, h, d, qa, qn, &dst_lo);
  dst[0] = src[0];
  dst[dst_lo] = src[q.lo];
}

// MlaDecodeSums's first pass, from the input product's unfolded sums x (row n: [q | c_kv | k_r]), each value split
// as the fold would store it (RoundSplit is what the readers of the fold's split get): block (n, 0) appends token
// n's cache row as AppendKernel does; blocks (n, 1..) take kThreads query columns each, as SplitQueryKernel does.
__global__ __launch_bounds__(kThreads) void PrepKernel(MlaDims s, Sums x, const float* norm_w, float eps,
                                                        const int32_t* tok_slot, const int32_t* tok_pos,
                                                        __nv_bfloat16* cache, int64_t max_ctx, Split qa, Split qn) {
  PdlEnter();
  const int64_t n = blockIdx.x, qw = s.nh * s.dqk();
  if (blockIdx.y == 0) {
    Sums c = x;  // [c_kv | k_r]
    c.p += qw;
    AppendRow(s, n, [&](int64_t i) { return RoundSplit(c.At(n, i)); }, norm_w, eps, tok_slot, tok_pos, cache, max_ctx);
    return;
  }
  const int64_t i = (blockIdx.y - 1) * int64_t{kThreads} + threadIdx.x;
  if (i >= qw) return;
  int64_t lo;
  __nv_bfloat16* dst = QueryDst(s, n, i / s.dqk(), i % s.dqk(), qa, qn, &lo);
  StoreSplit(dst, lo, x.At(n, i));
}

// Absorbed attention on the tensor cores (flash decoding, wgmma). A CTA takes one token, 32 heads and one of
// Splits(L) contiguous runs of 32-row cache tiles (a merge pass combines the runs); its two warpgroups take the
// first and second half of the run, each with its own two-stage cp.async ring and online softmax, and warpgroup 0
// merges the halves at the end. The split is a function of the token's own length only, so a token's result does
// not depend on the batch: runs of at least kTilesPerSplit tiles, at most kMaxSplits of them (at 64 tokens of 513,
// two runs: one wave of CTAs).
// Per tile and warpgroup:
//   S = Q · Cᵀ (m64n32, k over cw): Q's 64 rows are, per warp w, the hi rows of heads 8w..8w+7 then their lo rows,
//     so a thread holds a head's hi and lo scores of the same cache rows and adds them (scores keep ~16 bits of q);
//   the online softmax of its head over the tile, in registers (a head's 32 scores over a quad);
//   Oᵀ += Cᵀ · Pᵀ (m64n32 per 64 context columns, k over the tile's rows twice: P's hi, then its lo): the cache tile
//     is read in place as the MN-major A operand, P through a 4 KB swizzled tile.
// Both products read Q and the cache from shared memory, so the cache streams from memory once for the 32 heads.
// At kimi-linear-e2e's decode (64 tokens of ~530 rows, 40 MB) it takes 27.6 µs alone, where the mma.sync kernel
// before it took 36. Neither a deeper ring (the query in registers, five stages: 33 µs) nor L2 prefetch of the tiles
// ahead made it faster: what is left is per-tile latency, at one CTA an SM.
constexpr int kCtaHeads = 32;
constexpr int kRows = 32;             // cache rows per tile: the scores' N, the context product's k (hi and lo)
constexpr int kTilesPerSplit = 12;
constexpr int kMaxSplits = 8;         // CTAs per (token, 32 heads)
constexpr int64_t kMaxCw = 576;       // nine 64-column atoms: 226 KB of shared memory, one CTA per SM
constexpr int kMaxAtoms = kMaxCw / 64;
constexpr int kMaxBlocks = 8;         // 64-column blocks of the context: r ≤ 512
constexpr int kDecodeThreads = 256;   // two warpgroups
constexpr int kQAtomBytes = 2 * kCtaHeads * wgmma::kRowBytes;  // Q's atom: 64 rows (hi and lo) of 128 bytes
constexpr int kTileAtomBytes = kRows * wgmma::kRowBytes;       // a cache tile's atom: 32 rows
constexpr int kPBytes = kCtaHeads * wgmma::kRowBytes;         // Pᵀ: 32 heads × (32 hi + 32 lo rows)

__host__ __device__ inline int64_t Splits(int64_t L) {
  const int64_t tiles = (L + kRows - 1) / kRows, runs = (tiles + kTilesPerSplit - 1) / kTilesPerSplit;
  return runs < 1 ? 1 : runs > kMaxSplits ? kMaxSplits : runs;
}

// Shared memory (byte offsets from a 1024-aligned base, the swizzle's period): Q [atoms][64][64], the rings
// [warpgroup][stage][atoms][32][64], Pᵀ [warpgroup][32][64], then corr, m and l [warpgroup][32] (fp32).
struct DecodeLayout {
  int atoms;  // 64-column atoms of a cache row (cw rounded up; the padding is zeros)
  __host__ __device__ explicit DecodeLayout(int64_t cw) : atoms(static_cast<int>((cw + 63) / 64)) {}
  __host__ __device__ int tile_bytes() const { return atoms * kTileAtomBytes; }
  __host__ __device__ int ring() const { return atoms * kQAtomBytes; }
  __host__ __device__ int stage(int wg, int st) const { return ring() + (2 * wg + st) * tile_bytes(); }
  __host__ __device__ int p(int wg) const { return ring() + 4 * tile_bytes() + wg * kPBytes; }
  __host__ __device__ int floats() const { return p(2); }
  __host__ __device__ size_t bytes() const { return 1024 + floats() + 3 * 2 * kCtaHeads * sizeof(float); }
};

// The warpgroup's own barrier (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void WarpgroupSync(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

// Row `row` of a tile of 64-column atoms atom_bytes apart, 128-byte swizzled as wgmma reads it: this thread's 16-byte
// chunk c8 of each atom from src, zeros where !valid or past the row's `chunks` (src must point somewhere readable).
__device__ __forceinline__ void CopyRow(unsigned char* dst, int atom_bytes, int row, const __nv_bfloat16* src,
                                        bool valid, int chunks, int atoms, int c8) {
  for (int a = 0; a < atoms; ++a) {
    const int ch = 8 * a + c8;
    const bool ok = valid && ch < chunks;
    ptx::CpAsync16(dst + a * atom_bytes + 2 * wgmma::Swz(row, c8), src + (ok ? 8 * ch : 0), ok ? 16 : 0);
  }
}

// Partials of run g of (token n, head h): acc [N][nh][kMaxSplits][r] (unnormalized), ml [N][nh][kMaxSplits]
// {max, sum}. qa: the absorbed query [N][nh][cw], split.
__global__ __launch_bounds__(kDecodeThreads, 1) void DecodeMmaKernel(MlaDims s, Split qa, const __nv_bfloat16* cache,
                                                                      int64_t max_ctx, const int32_t* tok_slot,
                                                                      const int32_t* tok_pos, float scale,
                                                                      float* part_acc, float2* part_ml) {
  PdlEnter();
  using bf16 = __nv_bfloat16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* base =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int tid = threadIdx.x, wg = tid >> 7, t128 = tid & 127, warp = t128 >> 5, lane = tid & 31;
  const int gid = lane >> 2, tig = lane & 3, c8 = tid & 7;  // c8: the 16-byte chunk this thread copies
  const int64_t head_tiles = (s.nh + kCtaHeads - 1) / kCtaHeads;
  const int64_t n = blockIdx.x / head_tiles, h0 = blockIdx.x % head_tiles * kCtaHeads, g = blockIdx.y;
  const int cw = static_cast<int>(s.cw()), r = static_cast<int>(s.r), chunks = cw / 8;
  const DecodeLayout lay(cw);
  const int atoms = lay.atoms, blocks = (r + 63) / 64;
  float* corr_s = reinterpret_cast<float*>(base + lay.floats());  // [2][32]
  float* m_s = corr_s + 2 * kCtaHeads;
  float* l_s = m_s + 2 * kCtaHeads;

  const int64_t L = int64_t{tok_pos[n]} + 1, tiles = (L + kRows - 1) / kRows, splits = Splits(L);
  if (g >= splits) return;
  const int64_t per = (tiles + splits - 1) / splits, t_begin = g * per, t_end = min(tiles, t_begin + per);
  const int64_t mid = t_begin + max(int64_t{0}, t_end - t_begin + 1) / 2;
  const int64_t w_begin = wg == 0 ? t_begin : mid, w_end = wg == 0 ? min(mid, t_end) : t_end;
  const bf16* C = cache + int64_t{tok_slot[n]} * max_ctx * cw;

  // Q: row 16w + i is head 8w + i's hi row (i < 8), row 16w + 8 + i its lo row; heads past nh and the padding
  // columns are zeros. Two rows and every atom per thread.
  for (int row = tid >> 3; row < 2 * kCtaHeads; row += kDecodeThreads / 8) {
    const int head = 8 * (row >> 4) + (row & 7);
    const bool valid = h0 + head < s.nh;
    const bf16* src = qa.p + ((row & 8) ? qa.lo : 0) + (n * s.nh + (valid ? h0 + head : 0)) * cw;
    CopyRow(base, kQAtomBytes, row, src, valid, chunks, atoms, c8);
  }
  ptx::CpAsyncCommit();
  // A tile: rows past L and the padding columns are zeros (so that P's zeros never meet garbage).
  auto load_tile = [&](int64_t t, int st) {
    if (t < w_end) {
      unsigned char* dst = base + lay.stage(wg, st);
      for (int row = t128 >> 3; row < kRows; row += 16) {
        const int64_t j = t * kRows + row;
        CopyRow(dst, kTileAtomBytes, row, C + (j < L ? j : 0) * cw, j < L, chunks, atoms, c8);
      }
    }
    ptx::CpAsyncCommit();
  };
  load_tile(w_begin, 0);
  ptx::CpAsyncWaitGroup<1>();  // this thread's part of Q
  wgmma::FenceProxyAsync();
  __syncthreads();

  const uint32_t q_addr = ptx::SmemAddr(base), p_addr = ptx::SmemAddr(base + lay.p(wg));
  const int head = 8 * warp + gid;  // the head of this thread's scores
  bf16* p_row = reinterpret_cast<bf16*>(base + lay.p(wg)) + head * 64;
  float o[kMaxBlocks][16];  // Oᵀ: context column 64b + 16·warp + gid (+ 8: regs 4j + 2, + 3), head 8j + 2tig (+ 1)
#pragma unroll
  for (int b = 0; b < kMaxBlocks; ++b)
#pragma unroll
    for (int i = 0; i < 16; ++i) o[b][i] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;
  int st = 0;
  for (int64_t t = w_begin; t < w_end; ++t, st ^= 1) {
    load_tile(t + 1, st ^ 1);  // the other stage: its last reader, the previous tile's context product, is done
    ptx::CpAsyncWaitGroup<1>();
    wgmma::FenceProxyAsync();
    WarpgroupSync(wg);
    const uint32_t c_addr = ptx::SmemAddr(base + lay.stage(wg, st));

    float sc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) sc[i] = 0.0f;
    wgmma::FenceRegs(sc);
#pragma unroll
    for (int a = 0; a < kMaxAtoms; ++a)
      if (a == 0 || a < atoms) {  // the first unconditional, so that ptxas sees an MMA before every commit
        wgmma::Fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma::Mma32<0>(sc, wgmma::Desc(q_addr + a * kQAtomBytes + 32 * kk),
                          wgmma::Desc(c_addr + a * kTileAtomBytes + 32 * kk));
      }
    wgmma::Commit();
    wgmma::Wait<0>();
    wgmma::FenceRegs(sc);

    // Online softmax of this thread's head over the tile's rows 8j + 2tig (+ 1) (a tile's first row is valid).
    float v[8], mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = (sc[4 * j + e] + sc[4 * j + 2 + e]) * scale;
        v[2 * j + e] = t * kRows + 8 * j + 2 * tig + e < L ? x : -INFINITY;
        mx = fmaxf(mx, v[2 * j + e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx), corr = expf(m_run - m_new);  // 0 on the first tile (m_run = −inf)
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = expf(v[2 * j] - m_new), p1 = expf(v[2 * j + 1] - m_new);  // masked rows: exp(−inf) = 0
      sum += p0 + p1;
      const bf16 h0b = __float2bfloat16_rn(p0), h1b = __float2bfloat16_rn(p1);
      const uint32_t hi = ptx::PackBf16(__bfloat162float(h0b), __bfloat162float(h1b));
      const uint32_t lo = ptx::PackBf16(p0 - __bfloat162float(h0b), p1 - __bfloat162float(h1b));
      // Pᵀ row `head`, k = 8j + 2tig (hi) and 32 + 8j + 2tig (lo), swizzled.
      *reinterpret_cast<uint32_t*>(p_row + ((j ^ (head & 7)) << 3) + 2 * tig) = hi;
      *reinterpret_cast<uint32_t*>(p_row + (((4 + j) ^ (head & 7)) << 3) + 2 * tig) = lo;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l_run = l_run * corr + sum, m_run = m_new;
    if (tig == 0) corr_s[wg * kCtaHeads + head] = corr;
    wgmma::FenceProxyAsync();
    WarpgroupSync(wg);

    float cr[8];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) cr[2 * j + e] = corr_s[wg * kCtaHeads + 8 * j + 2 * tig + e];
#pragma unroll
    for (int b = 0; b < kMaxBlocks; ++b)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) o[b][4 * j + e] *= cr[2 * j + e], o[b][4 * j + 2 + e] *= cr[2 * j + e];
#pragma unroll
    for (int b = 0; b < kMaxBlocks; ++b) wgmma::FenceRegs(o[b]);
#pragma unroll
    for (int b = 0; b < kMaxBlocks; ++b)
      if (b == 0 || b < blocks) {
        wgmma::Fence();  // per block: a fence before the branch leaves ptxas adding its own in each (C7519)
#pragma unroll
        for (int k = 0; k < 4; ++k)  // rows 0–15, 16–31 against P's hi, then again against its lo
          wgmma::Mma32<1>(o[b], wgmma::Desc(c_addr + b * kTileAtomBytes + 2048 * (k & 1)),
                          wgmma::Desc(p_addr + 32 * k));
      }
    wgmma::Commit();
    wgmma::Wait<0>();
#pragma unroll
    for (int b = 0; b < kMaxBlocks; ++b) wgmma::FenceRegs(o[b]);
    WarpgroupSync(wg);  // the stage, Pᵀ and corr are free for the next tile
  }
  ptx::CpAsyncWaitAll();  // nothing in flight (the empty groups past the run)

  // Warpgroup 1 hands its (m, l, Oᵀ) to warpgroup 0 through its ring (blocks · 8 KB ≤ its 2 · atoms · 4 KB).
  if (tig == 0) m_s[wg * kCtaHeads + head] = m_run, l_s[wg * kCtaHeads + head] = l_run;
  float* handoff = reinterpret_cast<float*>(base + lay.stage(1, 0));
  if (wg == 1) {
#pragma unroll
    for (int b = 0; b < kMaxBlocks; ++b)
      if (b < blocks)
#pragma unroll
        for (int i = 0; i < 16; ++i) handoff[(b * 16 + i) * 128 + t128] = o[b][i];
  }
  __syncthreads();
  if (wg == 1) return;
  float w0[8], w1[8];  // the halves' weights for heads 8j + 2tig + e
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int h = 8 * (i >> 1) + 2 * tig + (i & 1);
    const float m0 = m_s[h], m1 = m_s[kCtaHeads + h], M = fmaxf(m0, m1);
    w0[i] = l_s[h] > 0.0f ? expf(m0 - M) : 0.0f;
    w1[i] = l_s[kCtaHeads + h] > 0.0f ? expf(m1 - M) : 0.0f;
  }
  if (t_begin < t_end) {
#pragma unroll
    for (int b = 0; b < kMaxBlocks; ++b)
      if (b < blocks)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int j = i >> 2, e = i & 1, h = 8 * j + 2 * tig + e;
          const int c = 64 * b + 16 * warp + gid + ((i & 2) ? 8 : 0);
          if (c < r && h0 + h < s.nh)
            part_acc[((n * s.nh + h0 + h) * kMaxSplits + g) * r + c] =
                o[b][i] * w0[2 * j + e] + handoff[(b * 16 + i) * 128 + t128] * w1[2 * j + e];
        }
  }
  if (tid < kCtaHeads && h0 + tid < s.nh) {
    const float m0 = m_s[tid], m1 = m_s[kCtaHeads + tid], l0 = l_s[tid], l1 = l_s[kCtaHeads + tid];
    const float M = fmaxf(m0, m1);
    const float l = (l0 > 0.0f ? l0 * expf(m0 - M) : 0.0f) + (l1 > 0.0f ? l1 * expf(m1 - M) : 0.0f);
    part_ml[(n * s.nh + h0 + tid) * kMaxSplits + g] = make_float2(M, l);
  }
}

// ctx[n][h] = Σ_g e^{m_g − M} acc_g / Σ_g e^{m_g − M} l_g over the token's runs that had rows (l_g > 0), in g order.
// A thread's columns c, c + kThreads, ... (r ≤ 512) have all their loads issued before the first store: one round
// trip to L2 instead of one per column (stores between them kept the loads from being hoisted).
__global__ __launch_bounds__(kThreads) void DecodeMergeKernel(MlaDims s, const int32_t* __restrict__ tok_pos,
                                                               const float* __restrict__ part_acc,
                                                               const float2* __restrict__ part_ml, Split ctx) {
  PdlEnter();
  constexpr int kCols = 64 * kMaxBlocks / kThreads;
  const int64_t nh_row = blockIdx.x, n = nh_row / s.nh, h = nh_row % s.nh;
  const int splits = static_cast<int>(Splits(int64_t{tok_pos[n]} + 1));
  float2 ml[kMaxSplits];
#pragma unroll
  for (int g = 0; g < kMaxSplits; ++g)
    ml[g] = g < splits ? part_ml[nh_row * kMaxSplits + g] : make_float2(kNegInf, 0.0f);
  float M = kNegInf;
#pragma unroll
  for (int g = 0; g < kMaxSplits; ++g)
    if (ml[g].y > 0.0f) M = fmaxf(M, ml[g].x);
  float w[kMaxSplits], total = 0.0f;
#pragma unroll
  for (int g = 0; g < kMaxSplits; ++g) {
    w[g] = 0.0f;
    if (g < splits) total += (w[g] = ml[g].y > 0.0f ? expf(ml[g].x - M) : 0.0f) * ml[g].y;
  }
  const float inv = 1.0f / total;
  const float* acc = part_acc + nh_row * kMaxSplits * s.r;
  float o[kCols] = {};
#pragma unroll
  for (int g = 0; g < kMaxSplits; ++g) {
    if (!(w[g] > 0.0f)) continue;  // runs without rows, and those past the token's
#pragma unroll
    for (int q = 0; q < kCols; ++q) {
      const int64_t c = threadIdx.x + kThreads * q;
      if (c < s.r) o[q] += w[g] * acc[g * s.r + c];
    }
  }
#pragma unroll
  for (int q = 0; q < kCols; ++q) {
    const int64_t c = threadIdx.x + kThreads * q;
    if (c < s.r) StoreSplit(ctx.p + n * ctx.ld + h * s.r + c, ctx.lo, o[q] * inv);
  }
}

// Expanded keys and values of one sequence, zero-padded to Lp rows:
// Kh [nh][Lp][dqk] = [k_nope | k_r], Vt [nh][dv][Lp] (the value product's weight layout).
__global__ void ExpandKeysKernel(MlaDims s, int64_t L, int64_t Lp, const float* kvx, const __nv_bfloat16* cache,
                                 __nv_bfloat16* Kh) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x, dqk = s.dqk();
  if (i >= s.nh * Lp * dqk) return;
  const int64_t h = i / (Lp * dqk), j = i / dqk % Lp, c = i % dqk;
  float v = 0.0f;
  if (j < L) v = c < s.dn ? kvx[j * s.nh * s.dkv() + h * s.dkv() + c] : __bfloat162float(cache[j * s.cw() + s.r + c - s.dn]);
  Kh[i] = __float2bfloat16_rn(v);
}

__global__ void ExpandValuesKernel(MlaDims s, int64_t L, int64_t Lp, const float* kvx, __nv_bfloat16* Vt) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (i >= s.nh * s.dv * Lp) return;
  const int64_t h = i / (s.dv * Lp), c = i / Lp % s.dv, j = i % Lp;
  Vt[i] = __float2bfloat16_rn(j < L ? kvx[j * s.nh * s.dkv() + h * s.dkv() + s.dn + c] : 0.0f);
}

// One CTA per (query t, head h): causal softmax of scale · S over the visible rows j ≤ P + t, zeros after.
__global__ __launch_bounds__(kThreads) void SoftmaxKernel(int64_t nh, int64_t Lp, int64_t P, float scale,
                                                           const float* S, Split prob) {
  PdlEnter();
  const int64_t row = blockIdx.x, t = row / nh, visible = P + t + 1;
  const float* sr = S + row * Lp;
  __nv_bfloat16* pr = prob.p + row * Lp;
  __shared__ float part[kThreads / 32];
  __shared__ float total;
  float mx = kNegInf;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) mx = fmaxf(mx, sr[j]);
  mx = WarpMax(mx);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = kNegInf;
    for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, part[w]);
    total = m;
  }
  __syncthreads();
  mx = total;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) sum += expf(scale * (sr[j] - mx));
  sum = WarpSum(sum);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) s += part[w];
    total = s;
  }
  __syncthreads();
  const float inv = 1.0f / total;
  for (int64_t j = threadIdx.x; j < Lp; j += kThreads)
    StoreSplit(pr + j, prob.lo, j < visible ? expf(scale * (sr[j] - mx)) * inv : 0.0f);
}

unsigned Blocks256(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace

cudaError_t MlaCacheAppend(int64_t N, const MlaDims& s, Split c, const float* norm_w, float eps,
                           const int32_t* tok_slot, const int32_t* tok_pos, __nv_bfloat16* cache, int64_t max_ctx,
                           cudaStream_t stream) {
  if (N < 0 || !c.p || !norm_w || !tok_slot || !tok_pos || !cache || s.r <= 0) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(AppendKernel, static_cast<unsigned>(N), kThreads, 0, stream, s, c, norm_w, eps, tok_slot,
                           tok_pos, cache, max_ctx));
  return cudaGetLastError();
}

cudaError_t MlaTransposeUk(const MlaDims& s, const __nv_bfloat16* kv_b, __nv_bfloat16* w_ukt, cudaStream_t stream) {
  if (!kv_b || !w_ukt) return cudaErrorInvalidValue;
  K3_CUDA_TRY(LaunchKernel(TransposeUkKernel, Blocks256(s.nh * s.r * s.dn), 256, 0, stream, s, kv_b, w_ukt));
  return cudaGetLastError();
}

// 16-byte cache rows, r in 16-column steps up to eight 64-column blocks, the kernel's smem sized for cw ≤ 576.
bool MlaDecodeSupported(const MlaDims& s) {
  return s.nh > 0 && s.cw() % 8 == 0 && s.cw() <= kMaxCw && s.r % 16 == 0 && s.r <= 64 * kMaxBlocks;
}

size_t MlaDecodeWorkspaceBytes(const MlaDims& s, int64_t N) {
  return Round256(2 * N * s.nh * s.cw() * sizeof(__nv_bfloat16)) + Round256(2 * N * s.nh * s.r * sizeof(__nv_bfloat16)) +
         Round256(N * s.nh * kMaxSplits * s.r * sizeof(float)) + Round256(N * s.nh * kMaxSplits * sizeof(float2)) +
         Round256(2 * N * s.nh * s.dn * sizeof(__nv_bfloat16));
}

namespace {

// The decode's buffers in its workspace.
struct DecodeWorkspace {
  Split qa;   // the absorbed query [N][nh][cw]: [q_nope·W_UK | q_r], split
  Split qn;   // q_nope [N, nh·dn], split
  Split ctx;  // the merged latent context [N, nh·r], split
  float* part_acc;
  float2* part_ml;
  DecodeWorkspace(const MlaDims& s, int64_t N, void* workspace) {
    char* ws = static_cast<char*>(workspace);
    qa = {reinterpret_cast<__nv_bfloat16*>(ws), s.nh * s.cw(), N * s.nh * s.cw()};
    ws += Round256(2 * N * s.nh * s.cw() * sizeof(__nv_bfloat16));
    ctx = {reinterpret_cast<__nv_bfloat16*>(ws), s.nh * s.r, N * s.nh * s.r};
    ws += Round256(2 * N * s.nh * s.r * sizeof(__nv_bfloat16));
    part_acc = reinterpret_cast<float*>(ws);
    ws += Round256(N * s.nh * kMaxSplits * s.r * sizeof(float));
    part_ml = reinterpret_cast<float2*>(ws);
    ws += Round256(N * s.nh * kMaxSplits * sizeof(float2));
    qn = {reinterpret_cast<__nv_bfloat16*>(ws), s.nh * s.dn, N * s.nh * s.dn};
  }
};

// The decode after the query's split (qn and the rope part of qa written): the absorb product, the attention and
// its merge, the value product.
cudaError_t DecodeAbsorbed(int64_t N, const MlaDims& s, const DecodeWorkspace& w, const __nv_bfloat16* cache,
                           int64_t max_ctx, const int32_t* tok_slot, const int32_t* tok_pos, const __nv_bfloat16* kv_b,
                           const __nv_bfloat16* w_ukt, float scale, Split out, LinearBlas& blas, cudaStream_t stream) {
  // qa[:, h, :r] = q_nope[h] · W_UK[h], one group per head.
  LinearArgs la;
  la.N = s.r, la.K = s.dn, la.w = w_ukt, la.w_group_stride = s.r * s.dn;
  la.x = w.qn, la.x_group_stride = s.dn;
  la.y = w.qa.p, la.ldy = w.qa.ld, la.y_lo = w.qa.lo, la.y_group_stride = s.cw(), la.out = LinearOut::kSplit;
  la.groups = s.nh, la.M = N;
  K3_CUDA_TRY(blas.Run(la, stream));

  const size_t smem = DecodeLayout(s.cw()).bytes();
  static const cudaError_t attr = cudaFuncSetAttribute(DecodeMmaKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(DecodeLayout(kMaxCw).bytes()));
  K3_CUDA_TRY(attr);
  const dim3 grid(static_cast<unsigned>(N * ((s.nh + kCtaHeads - 1) / kCtaHeads)), static_cast<unsigned>(Splits(max_ctx)));
  K3_CUDA_TRY(LaunchKernel(DecodeMmaKernel, grid, kDecodeThreads, smem, stream, s, w.qa, cache, max_ctx, tok_slot,
                           tok_pos, scale, w.part_acc, w.part_ml));
  K3_CUDA_TRY(cudaGetLastError());
  K3_CUDA_TRY(LaunchKernel(DecodeMergeKernel, static_cast<unsigned>(N * s.nh), kThreads, 0, stream, s, tok_pos,
                           w.part_acc, w.part_ml, w.ctx));
  K3_CUDA_TRY(cudaGetLastError());

  // out[:, h] = ctx[h] · W_UV[h]ᵀ.
  LinearArgs lo;
  lo.N = s.dv, lo.K = s.r, lo.w = kv_b + s.dn * s.r, lo.w_group_stride = s.dkv() * s.r;
  lo.x = w.ctx, lo.x_group_stride = s.r;
  lo.y = out.p, lo.ldy = out.ld, lo.y_lo = out.lo, lo.y_group_stride = s.dv, lo.out = LinearOut::kSplit;
  lo.groups = s.nh, lo.M = N;
  return blas.Run(lo, stream);
}

}  // namespace

cudaError_t MlaDecode(int64_t N, const MlaDims& s, Split q, const __nv_bfloat16* cache, int64_t max_ctx,
                      const int32_t* tok_slot, const int32_t* tok_pos, const __nv_bfloat16* kv_b,
                      const __nv_bfloat16* w_ukt, float scale, Split out, void* workspace, LinearBlas& blas,
                      cudaStream_t stream) {
  if (!MlaDecodeSupported(s)) return cudaErrorNotSupported;
  if (N < 0 || !workspace) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const DecodeWorkspace w(s, N, workspace);
  K3_CUDA_TRY(LaunchKernel(SplitQueryKernel, Blocks256(N * s.nh * s.dqk()), 256, 0, stream, N, s, q, w.qa, w.qn));
  K3_CUDA_TRY(cudaGetLastError());
  return DecodeAbsorbed(N, s, w, cache, max_ctx, tok_slot, tok_pos, kv_b, w_ukt, scale, out, blas, stream);
}

cudaError_t MlaDecodeSums(int64_t N, const MlaDims& s, Sums x, const float* norm_w, float eps,
                          __nv_bfloat16* cache, int64_t max_ctx, const int32_t* tok_slot, const int32_t* tok_pos,
                          const __nv_bfloat16* kv_b, const __nv_bfloat16* w_ukt, float scale, Split out,
                          void* workspace, LinearBlas& blas, cudaStream_t stream) {
  if (!MlaDecodeSupported(s)) return cudaErrorNotSupported;
  if (N < 0 || !workspace || !x.p || x.ld < s.nh * s.dqk() + s.cw() || !norm_w || !cache) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const DecodeWorkspace w(s, N, workspace);
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(1 + (s.nh * s.dqk() + kThreads - 1) / kThreads));
  K3_CUDA_TRY(LaunchKernel(PrepKernel, grid, kThreads, 0, stream, s, x, norm_w, eps, tok_slot, tok_pos, cache, max_ctx,
                           w.qa, w.qn));
  K3_CUDA_TRY(cudaGetLastError());
  return DecodeAbsorbed(N, s, w, cache, max_ctx, tok_slot, tok_pos, kv_b, w_ukt, scale, out, blas, stream);
}

size_t MlaPrefillWorkspaceBytes(const MlaDims& s, int64_t L, int64_t Tq) {
  const int64_t Lp = (L + 63) / 64 * 64;
  return Round256(L * s.nh * s.dkv() * sizeof(float)) + Round256(s.nh * Lp * s.dqk() * 2) +
         Round256(s.nh * s.dv * Lp * 2) + Round256(Tq * s.nh * Lp * sizeof(float)) + Round256(2 * Tq * s.nh * Lp * 2);
}

cudaError_t MlaPrefill(const MlaDims& s, int64_t T, int64_t P, Split q, const __nv_bfloat16* cache,
                       const __nv_bfloat16* kv_b, float scale, Split out, int64_t Tq, void* workspace,
                       cudaStream_t stream) {
  if (T < 0 || P < 0 || Tq <= 0 || !cache || !kv_b || !workspace) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const int64_t L = P + T, Lp = (L + 63) / 64 * 64;
  char* ws = static_cast<char*>(workspace);
  float* kvx = reinterpret_cast<float*>(ws);
  ws += Round256(L * s.nh * s.dkv() * sizeof(float));
  __nv_bfloat16* Kh = reinterpret_cast<__nv_bfloat16*>(ws);
  ws += Round256(s.nh * Lp * s.dqk() * 2);
  __nv_bfloat16* Vt = reinterpret_cast<__nv_bfloat16*>(ws);
  ws += Round256(s.nh * s.dv * Lp * 2);
  float* S = reinterpret_cast<float*>(ws);
  ws += Round256(Tq * s.nh * Lp * sizeof(float));
  __nv_bfloat16* prob = reinterpret_cast<__nv_bfloat16*>(ws);

  // kvx [L][nh·dkv] = c_kv · kv_bᵀ over the cache rows (plain bf16 input).
  LinearArgs le;
  le.N = s.nh * s.dkv(), le.K = s.r, le.w = kv_b;
  le.x = Split{const_cast<__nv_bfloat16*>(cache), s.cw(), 0};
  le.y = kvx, le.ldy = s.nh * s.dkv(), le.out = LinearOut::kF32, le.M = L;
  K3_CUDA_TRY(Linear(le, stream));
  K3_CUDA_TRY(LaunchKernel(ExpandKeysKernel, Blocks256(s.nh * Lp * s.dqk()), 256, 0, stream, s, L, Lp, kvx, cache, Kh));
  K3_CUDA_TRY(LaunchKernel(ExpandValuesKernel, Blocks256(s.nh * s.dv * Lp), 256, 0, stream, s, L, Lp, kvx, Vt));
  K3_CUDA_TRY(cudaGetLastError());

  for (int64_t t0 = 0; t0 < T; t0 += Tq) {
    const int64_t tq = std::min(Tq, T - t0);
    // S [tq][nh][Lp] = q_h · K_hᵀ, one group per head.
    LinearArgs ls;
    ls.N = Lp, ls.K = s.dqk(), ls.w = Kh, ls.w_group_stride = Lp * s.dqk();
    ls.x = q.Rows(t0), ls.x_group_stride = s.dqk();
    ls.y = S, ls.ldy = s.nh * Lp, ls.y_group_stride = Lp, ls.out = LinearOut::kF32;
    ls.groups = s.nh, ls.M = tq;
    K3_CUDA_TRY(Linear(ls, stream));
    const Split pr{prob, s.nh * Lp, tq * s.nh * Lp};
    K3_CUDA_TRY(LaunchKernel(SoftmaxKernel, static_cast<unsigned>(tq * s.nh), kThreads, 0, stream, s.nh, Lp, P + t0,
                             scale, S, pr));
    K3_CUDA_TRY(cudaGetLastError());
    // out [tq][nh·dv] = prob_h · V_h, one group per head.
    LinearArgs lv;
    lv.N = s.dv, lv.K = Lp, lv.w = Vt, lv.w_group_stride = s.dv * Lp;
    lv.x = pr, lv.x_group_stride = Lp;
    lv.y = out.Rows(t0).p, lv.ldy = out.ld, lv.y_lo = out.lo, lv.y_group_stride = s.dv, lv.out = LinearOut::kSplit;
    lv.groups = s.nh, lv.M = tq;
    K3_CUDA_TRY(Linear(lv, stream));
  }
  return cudaSuccess;
}

}  // namespace k3::cuda
