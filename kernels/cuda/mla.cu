#include "kernels/cuda/mla.cuh"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/ptx.cuh"

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

// Absorbed attention on the tensor cores (flash decoding). A CTA takes one token, 32 heads (two 16-row MMA blocks,
// the MMA's M; heads past nh are zero rows) and one of Splits(L) contiguous runs of 32-row cache tiles; a merge pass
// combines the runs. The split is a function of the token's own length only, so a token's result does not depend
// on the batch: runs of at least kTilesPerSplit tiles (a CTA's fixed cost — the query, the partials — is worth a
// few tiles; at 64 tokens of 513 two runs make one wave of CTAs), at most kMaxSplits of them. Per tile: S = Q·Cᵀ
// (warp w: head block w / 4, all 32 cache rows, a quarter of the k-steps — its query fragments stay in registers
// for the whole run, as hi + lo: two MMAs per cache fragment, so scores keep ~16 bits of q; the four quarters are
// added in order by the softmax), an online softmax over the 32 scores of each head, then acc += P·C[:, :r] (P as
// split hi + lo; warp w: its head block, column pairs w % 4, w % 4 + 4, ...). Both head blocks read each cache tile
// from shared memory, so the cache streams from memory once (with 16 heads a CTA it was read twice: 1.7 TB/s of
// it). Tiles arrive through a three-stage cp.async ring (two in flight); rows are padded so that the fragment loads
// are free of bank conflicts. (With each warp taking 8 cache rows and every k-step, the query fragments were read
// from shared memory again on every tile: 2.5× the tile's own traffic, 40 µs a decode at kimi-linear-e2e.)
constexpr int kHeads = 16;              // heads per MMA block: the MMA's M
constexpr int kBlocks = 2;              // MMA head blocks per CTA
constexpr int kCtaHeads = kHeads * kBlocks;
constexpr int kDecodeThreads = 128 * kBlocks;  // four warps per head block
constexpr int kRows = 32;               // cache rows per tile: one 8-row n-tile per warp of a block
constexpr int kStages = 3;              // cache tiles in the ring
constexpr int kTilesPerSplit = 12;
constexpr int kMaxSplits = 8;        // CTAs per (token, 32 heads)
constexpr int kMaxPairs = 8;         // column pairs (16 columns) per warp: r ≤ 4 · 8 · 16 = 512
constexpr int kPld = kRows + 8;      // P row stride (bf16)
constexpr int kSld = kRows + 4;      // S row stride (fp32): the quarters' float2 stores free of bank conflicts
constexpr int64_t kMaxCw = 576;      // smem grows with cw: at 576 it is 204 KB, one CTA (8 warps) per SM
constexpr int kQuarters = 4;         // warps of a head block, each taking a quarter of the score's k-steps
constexpr int kMaxQSteps = kMaxCw / 16 / kQuarters;  // k-steps a warp's query fragments cover

static_assert(kDecodeThreads == kCtaHeads * 8, "the softmax: 8 threads per head");
static_assert(kMaxCw % (16 * kQuarters) == 0, "the query's k-steps split in quarters");

__host__ __device__ inline int64_t Splits(int64_t L) {
  const int64_t tiles = (L + kRows - 1) / kRows, runs = (tiles + kTilesPerSplit - 1) / kTilesPerSplit;
  return runs < 1 ? 1 : runs > kMaxSplits ? kMaxSplits : runs;
}

struct DecodeLayout {
  int cwp, ldc;  // cw rounded up to 16; row stride of Q and cache tiles (bf16), ≡ 8 mod 16
  __host__ __device__ explicit DecodeLayout(int64_t cw) : cwp(static_cast<int>((cw + 15) / 16 * 16)), ldc(cwp + 8) {}
  __host__ __device__ size_t q_elems() const { return size_t{2} * kCtaHeads * ldc; }  // hi, lo
  __host__ __device__ size_t c_elems() const { return size_t{kStages} * kRows * ldc; }
  // Then P (bf16, hi and lo), S's quarters [kQuarters][kCtaHeads][kSld] and m, l, corr (fp32).
  __host__ __device__ size_t bytes() const {
    return (q_elems() + c_elems() + 2 * kCtaHeads * kPld) * sizeof(__nv_bfloat16) +
           (kQuarters * kCtaHeads * kSld + 3 * kCtaHeads) * sizeof(float);
  }
};

// The 16×16 A fragment at column k0 of a row-major bf16 [16][ld] tile in smem (ptx.cuh's layout): one
// ldmatrix (the QK loop issues two per k-step; eight 32-bit loads made it instruction bound). The row strides
// used here (≡ 8 mod 16) keep rows on 16 bytes and the eight rows of a matrix on distinct banks.
__device__ __forceinline__ void LoadFragA(uint32_t (&a)[4], const __nv_bfloat16* tile, int ld, int k0, int lane) {
  ptx::LdMatrixX4(a, ptx::FragA(tile, ld, 0, k0, lane));
}

// Partials of run g of (token n, head h): acc [N][nh][kMaxSplits][r] (unnormalized), ml [N][nh][kMaxSplits]
// {max, sum}. qa: the absorbed query [N][nh][cw], split.
__global__ __launch_bounds__(kDecodeThreads) void DecodeMmaKernel(MlaDims s, Split qa, const __nv_bfloat16* cache,
                                                                   int64_t max_ctx, const int32_t* tok_slot,
                                                                   const int32_t* tok_pos, float scale, float* part_acc,
                                                                   float2* part_ml) {
  PdlEnter();
  using bf16 = __nv_bfloat16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int hb = warp >> 2, lw = warp & 3;  // this warp's head block, its warp within the block
  const int64_t head_tiles = (s.nh + kCtaHeads - 1) / kCtaHeads;
  const int64_t n = blockIdx.x / head_tiles, h0 = blockIdx.x % head_tiles * kCtaHeads, g = blockIdx.y;
  const int cw = static_cast<int>(s.cw()), r = static_cast<int>(s.r);
  const DecodeLayout lay(cw);
  const int ldc = lay.ldc, cwp = lay.cwp;
  bf16* q_s = reinterpret_cast<bf16*>(smem_raw);    // [2][kCtaHeads][ldc]
  bf16* c_s = q_s + lay.q_elems();                  // [kStages][kRows][ldc]
  bf16* p_s = c_s + lay.c_elems();                  // [2][kCtaHeads][kPld]
  float* s_s = reinterpret_cast<float*>(p_s + 2 * kCtaHeads * kPld);  // [kQuarters][kCtaHeads][kSld]
  float* m_s = s_s + kQuarters * kCtaHeads * kSld;
  float* l_s = m_s + kCtaHeads;
  float* corr_s = l_s + kCtaHeads;

  const int64_t L = int64_t{tok_pos[n]} + 1, tiles = (L + kRows - 1) / kRows, splits = Splits(L);
  if (g >= splits) return;
  const int64_t per = (tiles + splits - 1) / splits, t_begin = g * per, t_end = min(tiles, t_begin + per);
  const bf16* C = cache + int64_t{tok_slot[n]} * max_ctx * cw;
  const int chunks = cw / 8;  // 16-byte chunks per cache row

  // A warp copies rows warp, warp + 8, ...; its lanes the row's 16-byte chunks (no divisions: they were most
  // of this kernel's instructions). One copy group per tile (empty past the run), so a wait for "all but the
  // last two groups" always means this tile.
  auto load_tile = [&](int64_t t, int stage) {
    if (t < t_end) {
      bf16* dst = c_s + stage * kRows * ldc;
      for (int row = warp; row < kRows; row += kDecodeThreads / 32) {
        const int64_t j = t * kRows + row;
        const bool valid = j < L;
        const bf16* src = C + (valid ? j : 0) * cw;
        for (int ch = lane; ch < chunks; ch += 32)
          ptx::CpAsync16(dst + row * ldc + ch * 8, src + ch * 8, valid ? 16 : 0);
      }
    }
    ptx::CpAsyncCommit();
  };
  // The query's hi rows (heads h0..h0+31), then its lo rows, in the first tile's copy group; heads past nh are
  // zeros, and so are the padding columns of Q and of every cache stage.
  if (t_begin < t_end) {
    for (int row = warp; row < 2 * kCtaHeads; row += kDecodeThreads / 32) {
      const int h = row % kCtaHeads;
      const bool valid = h0 + h < s.nh;
      const bf16* src = qa.p + (row >= kCtaHeads ? qa.lo : 0) + (n * s.nh + (valid ? h0 + h : 0)) * cw;
      for (int ch = lane; ch < chunks; ch += 32) ptx::CpAsync16(q_s + row * ldc + ch * 8, src + ch * 8, valid ? 16 : 0);
    }
  }
  load_tile(t_begin, 0);
  load_tile(t_begin + 1, 1);
  for (int i = tid; i < 2 * kCtaHeads * (cwp - cw); i += kDecodeThreads)
    q_s[(i / (cwp - cw)) * ldc + cw + i % (cwp - cw)] = __float2bfloat16_rn(0.0f);
  for (int i = tid; i < kStages * kRows * (cwp - cw); i += kDecodeThreads)
    c_s[(i / (cwp - cw)) * ldc + cw + i % (cwp - cw)] = __float2bfloat16_rn(0.0f);
  if (tid < kCtaHeads) m_s[tid] = kNegInf, l_s[tid] = 0.0f;

  const int pairs = r / 16;
  // This warp's k-steps of the score: [k_first, k_first + k_count).
  const int k_quarter = (cwp / 16 + kQuarters - 1) / kQuarters, k_first = lw * k_quarter;
  const int k_count = max(0, min(cwp / 16 - k_first, k_quarter));
  uint32_t qh[kMaxQSteps][4], ql[kMaxQSteps][4];  // loaded at the first tile, when the query has arrived
  float acc[kMaxPairs][2][4] = {};
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int stage = static_cast<int>((t - t_begin) % kStages);
    load_tile(t + 2, (stage + 2) % kStages);  // into the stage the previous tile used (freed by its last barrier)
    ptx::CpAsyncWaitGroup<2>();
    __syncthreads();
    const bf16* ct = c_s + stage * kRows * ldc;
    if (t == t_begin) {
#pragma unroll
      for (int i = 0; i < kMaxQSteps; ++i)
        if (i < k_count) {
          LoadFragA(qh[i], q_s + hb * kHeads * ldc, ldc, (k_first + i) * 16, lane);
          LoadFragA(ql[i], q_s + (kCtaHeads + hb * kHeads) * ldc, ldc, (k_first + i) * 16, lane);
        }
    }

    // This warp's quarter of S for its 16 heads and the tile's four 8-row n-tiles: c0/c1 = (head 16hb + gid,
    // rows 8nt + 2tig, +1), c2/c3 = head + 8; hi and lo in separate accumulators (eight chains of k_count).
    {
      float sc[4][4] = {}, sc_lo[4][4] = {};
#pragma unroll
      for (int i = 0; i < kMaxQSteps; ++i)
        if (i < k_count) {
          const bf16* bk = ct + gid * ldc + (k_first + i) * 16 + 2 * tig;
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(bk + nt * 8 * ldc);
            const uint32_t b1 = *reinterpret_cast<const uint32_t*>(bk + nt * 8 * ldc + 8);
            ptx::Mma(sc[nt], qh[i], b0, b1);
            ptx::Mma(sc_lo[nt], ql[i], b0, b1);
          }
        }
      float* sq = s_s + (lw * kCtaHeads + hb * kHeads + gid) * kSld + 2 * tig;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        *reinterpret_cast<float2*>(sq + nt * 8) = make_float2(sc[nt][0] + sc_lo[nt][0], sc[nt][1] + sc_lo[nt][1]);
        *reinterpret_cast<float2*>(sq + 8 * kSld + nt * 8) =
            make_float2(sc[nt][2] + sc_lo[nt][2], sc[nt][3] + sc_lo[nt][3]);
      }
    }
    __syncthreads();

    // Online softmax: 8 threads per head, 4 scores each, the quarters added in order (a tile's first row is always
    // valid).
    const int hr = hb * kHeads + gid;
    {
      const int h = tid >> 3, c0 = (tid & 7) * 4;
      const int64_t j0 = t * kRows + c0;
      float4 sq = *reinterpret_cast<const float4*>(s_s + h * kSld + c0);
#pragma unroll
      for (int q = 1; q < kQuarters; ++q) {
        const float4 o = *reinterpret_cast<const float4*>(s_s + (q * kCtaHeads + h) * kSld + c0);
        sq.x += o.x, sq.y += o.y, sq.z += o.z, sq.w += o.w;
      }
      float v[4] = {sq.x, sq.y, sq.z, sq.w}, mx = kNegInf;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = j0 + i < L ? v[i] * scale : kNegInf;
        mx = fmaxf(mx, v[i]);
      }
      for (int off = 1; off < 8; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = m_s[h], m_new = fmaxf(m_old, mx), sum_old = l_s[h];
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = expf(v[i] - m_new);  // masked rows: exp(−inf) = 0
        sum += p;
        const bf16 hi = __float2bfloat16_rn(p);
        p_s[h * kPld + c0 + i] = hi;
        p_s[(kCtaHeads + h) * kPld + c0 + i] = __float2bfloat16_rn(p - __bfloat162float(hi));
      }
      for (int off = 1; off < 8; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if ((tid & 7) == 0) {
        const float c = expf(m_old - m_new);  // 0 on the first tile (m_old = −inf)
        corr_s[h] = c, l_s[h] = sum_old * c + sum, m_s[h] = m_new;
      }
    }
    __syncthreads();

    // acc = acc · corr + P · V over this tile's 32 rows (two k-steps).
    const float cr0 = corr_s[hr], cr1 = corr_s[hr + 8];
#pragma unroll
    for (int pi = 0; pi < kMaxPairs; ++pi)
#pragma unroll
      for (int u = 0; u < 2; ++u) acc[pi][u][0] *= cr0, acc[pi][u][1] *= cr0, acc[pi][u][2] *= cr1, acc[pi][u][3] *= cr1;
#pragma unroll
    for (int kk = 0; kk < kRows; kk += 16) {
      uint32_t ah[4], al[4];
      LoadFragA(ah, p_s + hb * kHeads * kPld, kPld, kk, lane);
      LoadFragA(al, p_s + (kCtaHeads + hb * kHeads) * kPld, kPld, kk, lane);
#pragma unroll
      for (int pi = 0; pi < kMaxPairs; ++pi) {
        const int pair = lw + 4 * pi;
        if (pair < pairs) {
          uint32_t b[4];
          ptx::LdMatrixX4Trans(b, ptx::FragBT(ct, ldc, kk, pair * 16, lane));
          ptx::Mma(acc[pi][0], ah, b[0], b[1]);
          ptx::Mma(acc[pi][0], al, b[0], b[1]);
          ptx::Mma(acc[pi][1], ah, b[2], b[3]);
          ptx::Mma(acc[pi][1], al, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // before the next tile's loads and scores overwrite this stage, S and P
  }
  ptx::CpAsyncWaitAll();  // nothing in flight at exit (the empty groups past the run)

  // Partials: rows gid / gid + 8 of the warp's block are heads h0 + 16hb + gid / + 8; columns pair·16 + u·8 + 2tig.
  const int64_t base = (n * s.nh + h0 + hb * kHeads) * kMaxSplits + g;
#pragma unroll
  for (int pi = 0; pi < kMaxPairs; ++pi) {
    const int pair = lw + 4 * pi;
    if (pair >= pairs || t_begin >= t_end) continue;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = pair * 16 + u * 8 + 2 * tig;
      if (h0 + hb * kHeads + gid < s.nh)
        *reinterpret_cast<float2*>(part_acc + (base + int64_t{gid} * kMaxSplits) * r + c) =
            make_float2(acc[pi][u][0], acc[pi][u][1]);
      if (h0 + hb * kHeads + gid + 8 < s.nh)
        *reinterpret_cast<float2*>(part_acc + (base + int64_t{gid + 8} * kMaxSplits) * r + c) =
            make_float2(acc[pi][u][2], acc[pi][u][3]);
    }
  }
  if (tid < kCtaHeads && h0 + tid < s.nh)
    part_ml[(n * s.nh + h0 + tid) * kMaxSplits + g] = make_float2(m_s[tid], l_s[tid]);
}

// ctx[n][h] = Σ_g e^{m_g − M} acc_g / Σ_g e^{m_g − M} l_g over the token's runs that had rows (l_g > 0), in g order.
__global__ __launch_bounds__(kThreads) void DecodeMergeKernel(MlaDims s, const int32_t* tok_pos, const float* part_acc,
                                                               const float2* part_ml, Split ctx) {
  PdlEnter();
  const int64_t nh_row = blockIdx.x, n = nh_row / s.nh, h = nh_row % s.nh;
  const int splits = static_cast<int>(Splits(int64_t{tok_pos[n]} + 1));
  const float2* ml = part_ml + nh_row * kMaxSplits;
  float M = kNegInf;
  for (int g = 0; g < splits; ++g)
    if (ml[g].y > 0.0f) M = fmaxf(M, ml[g].x);
  float w[kMaxSplits], total = 0.0f;
  for (int g = 0; g < splits; ++g) total += (w[g] = ml[g].y > 0.0f ? expf(ml[g].x - M) : 0.0f) * ml[g].y;
  const float inv = 1.0f / total;
  for (int64_t c = threadIdx.x; c < s.r; c += kThreads) {
    float o = 0.0f;
    for (int g = 0; g < splits; ++g)
      if (w[g] > 0.0f) o += w[g] * part_acc[(nh_row * kMaxSplits + g) * s.r + c];
    StoreSplit(ctx.p + n * ctx.ld + h * s.r + c, ctx.lo, o * inv);
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

// 16-byte cache rows, 16-column pairs over r, the kernel's smem sized for cw ≤ 576.
bool MlaDecodeSupported(const MlaDims& s) {
  return s.nh > 0 && s.cw() % 8 == 0 && s.cw() <= kMaxCw && s.r % 16 == 0 && s.r <= 4 * kMaxPairs * 16;
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
