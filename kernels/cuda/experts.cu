// Routed experts over ragged tokens per expert (DESIGN §1.4, §1.5). Reference: k3::cpu::MoeExperts.
//
//   permute   counting sort of the (token, expert) pairs into per-expert slot segments (stable)
//   gate/up   h[s] = act(W1_e x, W3_e x) for the slots s of expert e          [P, I] bf16
//   down      y[s] = W2_e h[s]                                              [P, D] bf16
//   combine   out[n] = Σ_j w[n, j] · y[slot of (n, j)], j in order           [N, D] bf16
//
// The tiled path: at a few tokens per expert the experts are bound by reading their weights once, so a CTA
// streams 16·kWarps weight rows (gate/up: half of them from W1, the same rows of W3) through a cp.async ring
// and multiplies them with up to kTokens of the expert's tokens on mma.sync (weights as A, tokens as B: the
// token count only sets how many 8-wide n-tiles run). The gate/up CTA applies the activation to its fp32
// accumulators before rounding h to bf16. Tokens are read through the slot → token map, so x is never
// gathered. CTAs: weight row tiles (fastest) × the (expert, token tile) list that the permutation writes.
//
// The cuBLAS path: per expert, its rows gathered, W1 and W3 as one two-problem cublasGemmBatchedEx into an
// [n, 2I] buffer, the activation over its rows, and W2 (cublasGemmEx); each expert's chain runs on one of
// kBlasStreams side streams, largest experts first, each to the stream with the fewest tokens so far, so
// that the small GEMMs of the Zipf tail run side by side. cuBLAS picks its kernel per shape.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/ptx.cuh"

namespace k3::cuda {

using bf16 = __nv_bfloat16;

struct MoeWorkspace::Buffers {
  int64_t max_pairs = 0, D = 0, I = 0, E = 0;
  int32_t* counts = nullptr;     // [E]
  int32_t* offsets = nullptr;    // [E + 1]
  int32_t* slot_pair = nullptr;  // [P]
  int32_t* pair_slot = nullptr;  // [P]
  int2* tiles = nullptr;         // [E + P / 8]: {expert, first slot}
  int32_t* tile_done = nullptr;  // [E + P / 8]: gate/up CTAs finished, per tile
  int32_t* num_tiles = nullptr;  // [1]
  bf16* h = nullptr;             // [P, I]
  bf16* y = nullptr;             // [P, D]
  // The cuBLAS path, allocated on its first use.
  static constexpr int kBlasStreams = 4;
  cudaStream_t side[kBlasStreams] = {};
  cublasHandle_t blas[kBlasStreams] = {};  // one per side stream
  cudaEvent_t fork = nullptr, join[kBlasStreams] = {};
  int32_t* counts_host = nullptr;   // pinned [E]
  const bf16** w2_host = nullptr;   // pinned [E]: the W2 pointers
  bf16* xs = nullptr;               // [P, D] gathered x
  bf16* gu = nullptr;               // [P, 2I]: gate | up
  const void** gate_up = nullptr;   // [3][2E]: A, B, C of the (W1, W3) problem pair of each expert
  void FreeCublas();
  void Free();
};

namespace {

constexpr int kBK = 64;  // reduction slice per stage: 128 bytes per row
constexpr int kPackRows = 128;  // weight rows of a tiled CTA, and of a packed tile

// A CTA: kWarps warps of 16 weight rows each, up to kTokens tokens, a kStages-deep ring.
template <int kWarps_, int kTokens_, int kStages_>
struct TileShape {
  static constexpr int kWarps = kWarps_, kTokens = kTokens_, kStages = kStages_;
  static constexpr int kThreads = 32 * kWarps, kRows = 16 * kWarps;
  static constexpr int kStageElems = (kRows + kTokens) * kBK;
  static constexpr int kSmem = kStages * kStageElems * static_cast<int>(sizeof(bf16));
  static_assert(kTokens % 16 == 0 && ((kTokens * 8) % kThreads == 0 || kTokens * 8 < kThreads), "token tile");
};

constexpr int kPermuteThreads = 256;
constexpr int64_t kMaxPermuteExperts = 8192;  // the permutation's histogram: 32 KB of shared memory

// ------------------------------------------------------------------------------------------ permutation

// Sum over the block (kPermuteThreads), returned to every thread.
__device__ int BlockSum(int v, int* red) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kPermuteThreads / 32; ++w) total += red[w];
  __syncthreads();
  return total;
}

// Exclusive prefix sum over the block in thread order; *total gets the block's sum.
__device__ int BlockExclusiveScan(int v, int* red, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) red[warp] = x;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < kPermuteThreads / 32; ++w) {
    before += w < warp ? red[w] : 0;
    sum += red[w];
  }
  __syncthreads();
  *total = sum;
  return before + x - v;
}

// The slots a tile of an expert with `count` pairs holds, and its tiles.
__device__ __forceinline__ int TileTokens(int count, int tile_tokens, int wide_tokens) {
  return wide_tokens > 0 && count > tile_tokens ? wide_tokens : tile_tokens;
}
__device__ __forceinline__ int TileCount(int count, int tile_tokens, int wide_tokens) {
  const int t = TileTokens(count, tile_tokens, wide_tokens);
  return (count + t - 1) / t;
}

// Block e counts every expert's pairs itself (a histogram in shared memory: the pairs are read once per block
// anyway, and there are no counters to zero nor a count kernel before it), then takes its segment start (the
// counts before it) and its tiles, then compacts its pairs stably: thread t of a 4·256-pair window owns pairs
// 4t..4t+3, so an exclusive scan in thread order keeps pair order. Block 0 marks the pairs routed nowhere; the
// last block, which sums every count before its own, writes the totals (tiles, experts hit). An expert's tiles hold
// tile_tokens slots each, or wide_tokens where it has more than tile_tokens pairs (wide_tokens > 0: the kernels'
// Wide shape; TileTokens).
__global__ __launch_bounds__(kPermuteThreads) void FillSlotsKernel(int64_t P, const int32_t* idx, int E,
                                                                   int32_t* counts, int32_t* offsets,
                                                                   int32_t* slot_pair, int32_t* pair_slot,
                                                                   int tile_tokens, int wide_tokens, int2* tiles,
                                                                   int32_t* tile_done, int32_t* num_tiles,
                                                                   int32_t* experts_hit) {
  PdlEnter();
  extern __shared__ int hist[];  // [E]
  __shared__ int red[kPermuteThreads / 32];
  const int e = blockIdx.x, tid = threadIdx.x;
  for (int i = tid; i < E; i += kPermuteThreads) hist[i] = 0;
  __syncthreads();
  for (int64_t p = tid; p < P; p += kPermuteThreads) {
    const int ep = idx[p];
    if (ep >= 0 && ep < E) {
      atomicAdd(hist + ep, 1);
    } else if (e == 0) {
      pair_slot[p] = -1;
    }
  }
  __syncthreads();
  int before = 0, tiles_before = 0, hit_before = 0;
  for (int i = tid; i < e; i += kPermuteThreads) {
    const int c = hist[i];
    before += c;
    tiles_before += TileCount(c, tile_tokens, wide_tokens);
    hit_before += c > 0;
  }
  const int start = BlockSum(before, red);
  const int tile0 = BlockSum(tiles_before, red);
  const int count = hist[e], my_tiles = TileCount(count, tile_tokens, wide_tokens);
  const int my_tile_tokens = TileTokens(count, tile_tokens, wide_tokens);
  const bool last = e == E - 1;
  const int hit0 = last && experts_hit ? BlockSum(hit_before, red) : 0;  // uniform over the block
  if (tid == 0) {
    counts[e] = count;
    offsets[e] = start;
    if (last) {
      offsets[E] = start + count;
      if (num_tiles) *num_tiles = tile0 + my_tiles;
      if (experts_hit) *experts_hit = hit0 + (count > 0);
    }
  }
  if (tiles)
    for (int t = tid; t < my_tiles; t += kPermuteThreads) {
      tiles[tile0 + t] = make_int2(e, start + t * my_tile_tokens);
      if (tile_done) tile_done[tile0 + t] = 0;
    }

  int base = start;
  for (int64_t p0 = 0; p0 < P && base < start + count; p0 += 4 * kPermuteThreads) {
    bool hit[4];
    int n_hit = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int64_t p = p0 + 4 * tid + q;
      hit[q] = p < P && idx[p] == e;
      n_hit += hit[q];
    }
    int total;
    int s = base + BlockExclusiveScan(n_hit, red, &total);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (hit[q]) {
        const int64_t p = p0 + 4 * tid + q;
        slot_pair[s] = static_cast<int32_t>(p);
        pair_slot[p] = s++;
      }
    base += total;
  }
}

cudaError_t Permute(int64_t P, const int32_t* idx, int64_t E, int32_t* counts, int32_t* offsets, int32_t* slot_pair,
                    int32_t* pair_slot, int tile_tokens, int wide_tokens, int2* tiles, int32_t* tile_done,
                    int32_t* num_tiles, int32_t* experts_hit, cudaStream_t stream) {
  if (E > kMaxPermuteExperts) return cudaErrorInvalidValue;
  K3_CUDA_TRY(LaunchKernel(FillSlotsKernel, static_cast<unsigned>(E), kPermuteThreads, E * sizeof(int), stream, P, idx,
                           static_cast<int>(E), counts, offsets, slot_pair, pair_slot, tile_tokens, wide_tokens, tiles,
                           tile_done, num_tiles, experts_hit));
  return cudaGetLastError();
}

// ------------------------------------------------------------------------------------------ tiled GEMMs

struct TileArgs {
  int K;                        // reduction width: D (gate/up) or I (down)
  int M;                        // output features: I (gate/up) or D (down)
  const bf16* const* wa;        // W1 (gate/up) or W2 (down), [M, K] per expert
  const bf16* const* wb;        // W3 (gate/up)
  const bf16* src;              // x [N, K] (gate/up) or h [P, K] (down)
  int64_t src_lo;               // split src: offset of its lo plane (elements); 0: plain bf16
  const int32_t* slot_pair;     // gate/up: row of slot s is slot_pair[s] / top_k; down: null, row = s
  int top_k;
  const int2* tiles;
  int32_t* tile_done;           // gate/up: counts its CTAs per tile; down: waits for all of them (done_target)
  int done_target;
  const int32_t* num_tiles;
  const int32_t* offsets;
  bf16* dst;                    // [P, M]
  int64_t dst_lo;               // split dst: offset of its lo plane; 0: plain bf16
  GluAct act;
  float beta1, beta2;
  bool packed;                  // gate/up: wa holds MoePackGateUp's tiles (kPackRows rows a tile)
  // MXFP4 weights (the wgmma kernels only): codes and scales of W1 (or W2) and W3 instead of wa, wb.
  const uint8_t* const* qa;
  const uint8_t* const* sa;
  const uint8_t* const* qb;
  const uint8_t* const* sb;
};

// Element (row, 16-byte chunk c) of a [rows][kBK] stage tile, chunks XOR-swizzled by row: ldmatrix's
// eight rows at one logical chunk hit eight different bank groups.
__device__ __forceinline__ int Swz(int row, int c) { return row * kBK + ((c ^ (row & 7)) << 3); }

// Gate/up CTA row r: rows 0–7 of each warp's 16 are W1's rows of eight features, rows 8–15 W3's rows of the same
// features, so that one thread's accumulators hold a feature's gate and up values (the GLU in registers).
__device__ __forceinline__ int GluFeature(int r) { return 8 * (r / 16) + r % 8; }

// One tile's CTA of shape S: tokens [s0, s0 + S's tokens) of expert e (all of the CTA's work below the prologue).
template <bool kGlu, class S>
__device__ __forceinline__ void TileBody(const TileArgs& a, int e, int s0, unsigned char* smem_raw) {
  constexpr int kRows = S::kRows, kTokens = S::kTokens, kStages = S::kStages, kThreads = S::kThreads;
  constexpr int kStageElems = S::kStageElems;
  // 16-byte token chunks per thread and stage (a 16-row token tile: the first half of the threads, one each)
  constexpr int kXCopies = (kTokens * 8 + kThreads - 1) / kThreads;
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  // A split src takes two token rows per slot: hi planes in rows [0, half), lo planes in [half, kTokens); the
  // epilogue adds the two accumulators (x·W = hi·W + lo·W) before the activation.
  const bool split = a.src_lo != 0;
  constexpr int half = kTokens / 2;
  const int nt = min(split ? half : kTokens, a.offsets[e + 1] - s0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int K = a.K, M = a.M;
  constexpr int kFeatures = kGlu ? kRows / 2 : kRows;  // output features per CTA
  const int f0 = blockIdx.x * kFeatures;

  // This thread copies 16-byte chunk `ch` of rows tid / 8 + (kThreads / 8)·i: four weight rows, kXCopies
  // token rows.
  const int ch = tid & 7;
  const bf16* wa = a.wa[e];
  const bf16* wb = kGlu && !a.packed ? a.wb[e] : wa;
  // Token rows the MMAs read: the first nt rounded up to 16 (split: in each half).
  const int nrt = (nt + 15) & ~15, span = split ? half : kTokens;
  auto used = [&](int r) { return r < kTokens && r % span < nrt; };
  const int KT = (K + kBK - 1) / kBK;
  // Plain: weight row r's k-tiles 64 elements apart, copied to their swizzled place. Packed: the CTA's tiles back
  // to back, already swizzled, so that a stage is one contiguous 16 KB read (chunk tid + kThreads·i of the tile).
  static_assert(S::kRows == kPackRows, "the packed tiles are kPackRows rows");
  const bool packed = a.packed;
  const int64_t wstep = packed ? kRows * kBK : kBK;
  const bf16* wrow[4];
  int wdst[4];
  const bf16* xrow[kXCopies];
  bool wvalid[4], xvalid[kXCopies];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = tid / 8 + kThreads / 8 * i;
    const int f = f0 + (kGlu ? GluFeature(r) : r);
    wvalid[i] = f < M;
    wrow[i] = packed ? wa + (static_cast<int64_t>(blockIdx.x) * KT * kRows + r) * kBK + ch * 8
                     : (kGlu && r % 16 >= 8 ? wb : wa) + static_cast<int64_t>(wvalid[i] ? f : 0) * K + ch * 8;
    wdst[i] = packed ? r * kBK + ch * 8 : Swz(r, ch);
  }
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int r = tid / 8 + kThreads / 8 * i, t = split ? r % half : r;
    xvalid[i] = t < nt;
    const int64_t src_row = !xvalid[i] ? 0 : a.slot_pair ? a.slot_pair[s0 + t] / a.top_k : s0 + t;
    xrow[i] = a.src + (split && r >= half ? a.src_lo : 0) + src_row * K;
  }
  // The weights are read once a step: first out of L2 (kimi-linear-e2e's three layers alone: 2152 → 2136 µs).
  const uint64_t evict_first = ptx::EvictFirstPolicy();
  auto load = [&](int stage, int kt) {
    bf16* sw = smem + stage * kStageElems;
    bf16* sx = sw + kRows * kBK;
    const int k = kt * kBK + ch * 8;
    const bool k_in = k < K;  // packed tiles are zero past K, but x must not be read there
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool wv = packed || (k_in && wvalid[i]);
      ptx::CpAsync16(sw + wdst[i], wv ? wrow[i] + kt * wstep : wa, wv ? 16 : 0, evict_first);
    }
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int r = tid / 8 + kThreads / 8 * i;
      if (used(r)) {
        const bool xv = k_in && xvalid[i];
        ptx::CpAsync16(sx + Swz(r, ch), xv ? xrow[i] + k : a.src, xv ? 16 : 0);
      }
    }
  };

  float acc[kTokens / 8][4] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load(s, s);
    ptx::CpAsyncCommit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    ptx::CpAsyncWaitGroup<kStages - 2>();
    __syncthreads();
    if (kt + kStages - 1 < KT) load((kt + kStages - 1) % kStages, kt + kStages - 1);
    ptx::CpAsyncCommit();
    const bf16* sw = smem + (kt % kStages) * kStageElems;
    const bf16* sx = sw + kRows * kBK;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t af[4];
      {
        const int r = warp * 16 + (lane & 15);
        ptx::LdMatrixX4(af, sw + Swz(r, 2 * kk + (lane >> 4)));
      }
#pragma unroll
      for (int p = 0; p < kTokens / 16; ++p) {
        if (used(16 * p)) {
          uint32_t bfr[4];
          const int r = 16 * p + (lane & 7) + ((lane >> 4) << 3);
          ptx::LdMatrixX4(bfr, sx + Swz(r, 2 * kk + ((lane >> 3) & 1)));
          ptx::Mma(acc[2 * p], af, bfr[0], bfr[1]);
          ptx::Mma(acc[2 * p + 1], af, bfr[2], bfr[3]);
        }
      }
    }
  }
  // The epilogue from the registers (no pass through shared memory): thread (gid, tig) holds rows gid and gid + 8
  // of its warp's 16 at tokens 8j + 2·tig + {0, 1} of n-tile j — for gate/up the same feature's W1 and W3 rows.
  // A split src's lo token of n-tile j is in n-tile j + half / 8. Every copy the loop waited for has landed; the
  // groups still open are empty.
  {
    const int gid = lane >> 2, tig = lane & 3;
    constexpr int kTiles = kTokens / 8, kLoTiles = half / 8;
    auto store = [&](int t, int f, float v) {
      if (t >= nt || f >= M) return;
      bf16* d = a.dst + static_cast<int64_t>(s0 + t) * M + f;
      const bf16 hi = __float2bfloat16(v);
      d[0] = hi;
      if (a.dst_lo) d[a.dst_lo] = __float2bfloat16(v - __bfloat162float(hi));
    };
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      if (split && j >= kLoTiles) break;
      // x·W = hi·W + lo·W, added before the activation
      auto dot = [&](int c) { return acc[j][c] + (split ? acc[(j + kLoTiles) % kTiles][c] : 0.0f); };
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 8 * j + 2 * tig + e;
        if (kGlu) {
          store(t, f0 + 8 * warp + gid, Glu(a.act, dot(e), dot(2 + e), a.beta1, a.beta2));
        } else {
          store(t, f0 + 16 * warp + gid, dot(e));
          store(t, f0 + 16 * warp + gid + 8, dot(2 + e));
        }
      }
    }
  }
  if (kGlu) {  // this tile's h columns are out
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(a.tile_done + blockIdx.y, 1);
  }
}

// Gate/up (kGlu) then down, back to back. The down CTAs of a token tile start as soon as that tile's gate/up
// CTAs are done (a counter per tile) rather than when all are: the down kernel, launched early (PDL), fills the
// SMs that the gate/up kernel's last wave leaves idle.
// Wide (a shape of as many threads and rows, more tokens and fewer stages; S itself: none) takes the tiles of the
// experts with more pairs than S holds: one CTA streams their weights once instead of one CTA per S-sized tile.
template <bool kGlu, class S, class Wide>
__global__ __launch_bounds__(S::kThreads) void ExpertTileKernel(TileArgs a) {
  static_assert(Wide::kThreads == S::kThreads && Wide::kRows == S::kRows, "one grid for both shapes");
  if (kGlu) {
    PdlEnter();
  } else {
    PdlTrigger();  // what it reads besides h was written before the gate/up kernel started
    if (static_cast<int>(blockIdx.y) < *a.num_tiles && threadIdx.x == 0) {
      const int32_t* done = a.tile_done + blockIdx.y;
      while (*reinterpret_cast<const volatile int32_t*>(done) < a.done_target) __nanosleep(256);
      __threadfence();
    }
    __syncthreads();
  }
  if (static_cast<int>(blockIdx.y) >= *a.num_tiles) return;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int2 tile = a.tiles[blockIdx.y];
  const int tokens = a.src_lo != 0 ? S::kTokens / 2 : S::kTokens;  // S's tokens a tile
  if (!std::is_same_v<S, Wide> && a.offsets[tile.x + 1] - a.offsets[tile.x] > tokens)
    TileBody<kGlu, Wide>(a, tile.x, tile.y, smem_raw);
  else
    TileBody<kGlu, S>(a, tile.x, tile.y, smem_raw);
}

// ------------------------------------------------------------------------------------- packed weights

// Tile (b, kt) of the packed W1 and W3 ([I, D] each) holds gate/up CTA b's kPackRows weight rows (W1's and W3's rows
// of the same features, as GluFeature orders them) at columns kt·kBK.., tiles in (b, kt) order; row r's 16-byte chunk
// c is at chunk c ^ (r & 7) of the row, where Swz puts it in shared memory. Zeros past I or D.
__global__ void PackGateUpKernel(const bf16* w1, const bf16* w3, int64_t I, int64_t D, int4* out, int64_t chunks) {
  const int64_t KT = (D + kBK - 1) / kBK;
  for (int64_t q = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; q < chunks; q += int64_t{gridDim.x} * blockDim.x) {
    const int64_t tile = q / (kPackRows * 8), b = tile / KT, kt = tile % KT;
    const int j = static_cast<int>(q % (kPackRows * 8)), r = j / 8;
    const int64_t k = kt * kBK + ((j % 8) ^ (r & 7)) * 8, f = b * (kPackRows / 2) + GluFeature(r);
    const bf16* w = r % 16 >= 8 ? w3 : w1;
    out[q] = f < I && k < D ? *reinterpret_cast<const int4*>(w + f * D + k) : make_int4(0, 0, 0, 0);
  }
}

// --------------------------------------------------------------------------------- elementwise passes

// xs[s] = x[slot_pair[s] / k] for s < rows, in 16-byte chunks.
// The row loops below take a row per CTA and its 16-byte chunks across the threads: no 64-bit division per
// chunk (the flat index's i / chunks made these passes instruction-bound: 1.25 TB/s for the gather at avg 512).
__global__ void GatherRowsKernel(int64_t rows, int chunks, const int4* x, const int32_t* slot_pair, int top_k,
                                 int4* xs) {
  PdlEnter();
  for (int64_t s = blockIdx.x; s < rows; s += gridDim.x) {
    const int4* src = x + static_cast<int64_t>(slot_pair[s] / top_k) * chunks;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) xs[s * chunks + c] = src[c];
  }
}

__device__ __forceinline__ void Unpack(int4 v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x, f[2 * i + 1] = p.y;
  }
}
__device__ __forceinline__ int4 Pack(const float (&f)[8]) {
  int4 v;
  uint32_t* u = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) u[i] = ptx::PackBf16(f[2 * i], f[2 * i + 1]);
  return v;
}

// h[s, i] = act(gu[s, i], gu[s, I + i]) for the slots s_begin ≤ s < s_begin + rows, 8 features at a time, on
// GluApprox: h is plain bf16 (the cuBLAS path).
__global__ void GluRowsKernel(int64_t s_begin, int64_t rows, int chunks, const int4* gu, GluAct act, float b1,
                              float b2, int4* h) {
  PdlEnter();
  const float inv_b1 = 1.0f / b1, inv_b2 = 1.0f / b2;
  for (int64_t s = s_begin + blockIdx.x; s < s_begin + rows; s += gridDim.x)
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float g[8], u[8], o[8];
      Unpack(gu[s * 2 * chunks + c], g);
      Unpack(gu[s * 2 * chunks + chunks + c], u);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = GluApprox(act, g[j], u[j], b1, inv_b1, b2, inv_b2);
      h[s * chunks + c] = Pack(o);
    }
}

// acc = Σ_j w[n, j] · y[pair_slot[n·k + j]] in j order, columns 8c .. 8c + 7 of y's 16-byte chunks; y_lo_chunks
// ≠ 0: y is split, y_hi + y_lo with the lo plane that many chunks on. Eight pairs at a time: their slots, then
// all their loads, then the sums — one load latency per eight pairs instead of two per pair (the combine is
// latency-bound: 15 µs a layer at decode batch 64 with the loads one after another).
__device__ __forceinline__ void CombineChunk(int64_t n, int64_t c, int chunks, int top_k, const int32_t* pair_slot,
                                             const float* w, const int4* y, int64_t y_lo_chunks, float (&acc)[8]) {
  constexpr int kBatch = 8;
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
  for (int j0 = 0; j0 < top_k; j0 += kBatch) {
    int s[kBatch];
    float wt[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int j = j0 + b;
      s[b] = j < top_k ? pair_slot[n * top_k + j] : -1;
      wt[b] = j < top_k ? w[n * top_k + j] : 0.0f;
    }
    int4 v[kBatch], lo[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t at = static_cast<int64_t>(s[b] < 0 ? 0 : s[b]) * chunks + c;
      v[b] = s[b] < 0 ? make_int4(0, 0, 0, 0) : y[at];
      lo[b] = s[b] < 0 || !y_lo_chunks ? make_int4(0, 0, 0, 0) : y[at + y_lo_chunks];
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (s[b] < 0) continue;
      float hv[8], lv[8];
      Unpack(v[b], hv);
      Unpack(lo[b], lv);  // zeros for a plain y: hv + 0 is hv
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] += wt[b] * (hv[q] + lv[q]);
    }
  }
}

// A thread per (row n, chunk c): blockIdx.x · blockDim.x + threadIdx.x is c, rows n = blockIdx.y, + gridDim.y, ….
constexpr int kCombineThreads = 128;
dim3 CombineGrid(int64_t rows, int chunks) {
  return dim3(static_cast<unsigned>((chunks + kCombineThreads - 1) / kCombineThreads),
              static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, 65535))));
}

// out[n] = the combine of token n, 8 columns at a time: bf16 out for a plain y (y_lo_chunks = 0); fp32 out for a
// split y (y_lo_chunks: the lo plane's offset, a whole number of chunks: the planes are [max_pairs, D], D % 8 == 0).
__global__ void CombineKernel(int64_t N, int chunks, int top_k, const int32_t* pair_slot, const float* w,
                              const int4* y, int64_t y_lo_chunks, void* out) {
  PdlEnter();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    float acc[8];
    CombineChunk(n, c, chunks, top_k, pair_slot, w, y, y_lo_chunks, acc);
    const int64_t i = n * chunks + c;
    if (y_lo_chunks) {
      float4* o = static_cast<float4*>(out) + 2 * i;
      o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
      static_cast<int4*>(out)[i] = Pack(acc);
    }
  }
}

// The cuBLAS path's pointer arrays for the (W1, W3) problem pair of each expert: A = the weights, B = its
// gathered rows (twice), C = the gate and up halves of its gu rows.
__global__ void GateUpPointersKernel(int E, const int32_t* offsets, const bf16* const* w1, const bf16* const* w3,
                                     const bf16* xs, bf16* gu, int64_t D, int64_t I, const void** ptrs) {
  PdlEnter();
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const void** A = ptrs;
  const void** B = A + 2 * E;
  const void** C = B + 2 * E;
  const int64_t off = offsets[e];
  A[2 * e] = w1[e], A[2 * e + 1] = w3[e];
  B[2 * e] = B[2 * e + 1] = xs + off * D;
  C[2 * e] = gu + off * 2 * I, C[2 * e + 1] = gu + off * 2 * I + I;
}

// CTAs for a row loop: a row each, up to 16 per SM of an H200.
unsigned RowGrid(int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, 132 * 16)));
}

cudaError_t Blas(cublasStatus_t st) { return st == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown; }

// The gate/up product's arguments (x → h) for the tiled and the wgmma kernels; ToDown turns them into the down
// product's (h → y). A split x keeps h and y in two planes too.
TileArgs GateUpArgs(const MoeExpertsArgs& a, const MoeWorkspace::Buffers& b) {
  TileArgs t{};
  t.top_k = static_cast<int>(a.top_k);
  t.tiles = b.tiles, t.tile_done = b.tile_done, t.num_tiles = b.num_tiles, t.offsets = b.offsets;
  t.act = a.act, t.beta1 = a.situ_beta, t.beta2 = a.situ_linear_beta;
  t.K = static_cast<int>(a.D), t.M = static_cast<int>(a.I);
  t.wa = a.w1, t.wb = a.w3, t.src = a.x, t.slot_pair = b.slot_pair, t.dst = b.h;
  t.src_lo = a.x_lo, t.dst_lo = a.x_lo != 0 ? b.max_pairs * b.I : 0;
  t.packed = a.packed;
  t.qa = a.q1, t.sa = a.s1, t.qb = a.q3, t.sb = a.s3;
  return t;
}
void ToDown(const MoeExpertsArgs& a, const MoeWorkspace::Buffers& b, TileArgs* t) {
  t->K = static_cast<int>(a.I), t->M = static_cast<int>(a.D);
  t->wa = a.w2, t->wb = nullptr, t->src = b.h, t->slot_pair = nullptr, t->dst = b.y;
  t->src_lo = t->dst_lo, t->dst_lo = a.x_lo != 0 ? b.max_pairs * b.D : 0;
  t->packed = false;
  t->qa = a.q2, t->sa = a.s2, t->qb = t->sb = nullptr;
}

}  // namespace
}  // namespace k3::cuda

#include "kernels/cuda/experts_wgmma.cuh"

namespace k3::cuda {
namespace {

// The wgmma copiers index an expert's weight matrix with 32-bit offsets.
bool WgmmaFits(const MoeExpertsArgs& a) { return a.D * a.I < (int64_t{1} << 31); }

cudaError_t RunWgmma(const MoeExpertsArgs& a, MoeWorkspace::Buffers& b, cudaStream_t stream) {
  if (!WgmmaFits(a)) return cudaErrorInvalidValue;
  static const cudaError_t attr = [] {
    constexpr auto kAttr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    cudaError_t err = cudaFuncSetAttribute(ExpertWgmmaKernel<true, false>, kAttr, wg::kSmem);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(ExpertWgmmaKernel<false, false>, kAttr, wg::kSmem);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(ExpertWgmmaKernel<true, true>, kAttr, wg::kSmemMx);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(ExpertWgmmaKernel<false, true>, kAttr, wg::kSmemMx);
    return err;
  }();
  const bool mx = a.q1 != nullptr;
  const int smem = mx ? wg::kSmemMx : wg::kSmem;
  K3_CUDA_TRY(attr);
  int sms = 0;
  K3_CUDA_TRY(SmCount(&sms));
  const int64_t P = a.N * a.top_k, max_tiles = a.num_experts + P / wg::kBM;
  // gate/up → h: 128 features of W1 and W3 per item; down → y: 256 features of W2 per item
  const int64_t gate_up_items = max_tiles * ((a.I + wg::kBN / 2 - 1) / (wg::kBN / 2)),
                down_items = max_tiles * ((a.D + wg::kBN - 1) / wg::kBN);
  TileArgs t = GateUpArgs(a, b);
  K3_CUDA_TRY(LaunchKernel(mx ? ExpertWgmmaKernel<true, true> : ExpertWgmmaKernel<true, false>,
                           static_cast<unsigned>(std::min<int64_t>(gate_up_items, sms)), wg::kThreads, smem, stream,
                           t));
  ToDown(a, b, &t);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(down_items, sms));
  K3_CUDA_TRY(LaunchKernel(mx ? ExpertWgmmaKernel<false, true> : ExpertWgmmaKernel<false, false>, grid, wg::kThreads,
                           smem, stream, t));
  return cudaGetLastError();
}

// 128 weight rows × 64 tokens, 4 stages (96 KB): 2 CTAs and 16 warps per SM, 128 KB of weights in flight.
// 64 rows with 4 or 6 stages (64 / 96 KB) and 32-token tiles with 6 stages (one CTA per SM) were slower.
using Tile = TileShape<8, 64, 4>;
// Plain bf16 batches with up to 16 pairs per expert (the expert node at decode): 32-token tiles and five
// stages, two CTAs per SM with 160 KB of weights in flight. H200, avg 8 Zipf pairs per expert at K3 shapes,
// same run: 1022 µs (3.62 TB/s) with Tile, 949 with SmallTile (more tiles re-read the big experts), 918
// (4.03 TB/s) with this.
using MidTile = TileShape<8, 32, 5>;
constexpr int64_t kMidTileMaxPairsPerExpert = 16;
// Split batches with few pairs per expert (the GPU engine's decode): 16-row token tiles (8 tokens) and six
// stages fit two CTAs per SM with 160 KB of weights in flight per SM instead of 96 KB (on the H200 the
// experts of a decode step streamed 3.4 TB/s with Tile, 3.65 with 32-row tiles and five stages). The tile shape
// does not change a row's sums (same k order, hi + lo added in the epilogue): the choice keeps batch invariance.
using SmallTile = TileShape<8, 16, 6>;
constexpr int64_t kSmallTileMaxPairsPerExpert = 8;
// SmallTile's Wide shape: the experts with 9 or more pairs (5–7% of the decode step's tiles at kimi-linear-e2e, up
// to 17 pairs on one expert) in 16-token tiles, so that their weights stream once, not once per 8 tokens. At 8 tokens
// a tile the time follows the tiles, not the distinct experts (docs/performance-log.md, b5ac3e3). Five stages fit the
// same shared memory.
using WideTile = TileShape<8, 32, 5>;

template <class S, class Wide = S>
cudaError_t RunTiled(const MoeExpertsArgs& a, MoeWorkspace::Buffers& b, cudaStream_t stream) {
  constexpr int kSmem = std::max(S::kSmem, Wide::kSmem);
  static const cudaError_t attr = [] {
    constexpr auto kAttr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    cudaError_t err = cudaFuncSetAttribute(ExpertTileKernel<true, S, Wide>, kAttr, kSmem);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(ExpertTileKernel<false, S, Wide>, kAttr, kSmem);
    return err;
  }();
  if (attr != cudaSuccess) return attr;
  const int64_t P = a.N * a.top_k, E = a.num_experts;
  const bool split = a.x_lo != 0;
  const int64_t tile_tokens = split ? S::kTokens / 2 : S::kTokens;
  const int64_t max_tiles = E + P / tile_tokens;  // Σ ceil(count / tile_tokens) ≤ E + P / tile_tokens
  if (max_tiles > 65535) return cudaErrorInvalidValue;
  TileArgs t = GateUpArgs(a, b);
  dim3 grid(static_cast<unsigned>((a.I + S::kRows / 2 - 1) / (S::kRows / 2)), static_cast<unsigned>(max_tiles));
  K3_CUDA_TRY(LaunchKernel(ExpertTileKernel<true, S, Wide>, grid, S::kThreads, kSmem, stream, t));
  ToDown(a, b, &t);
  t.done_target = static_cast<int>(grid.x);
  grid.x = static_cast<unsigned>((a.D + S::kRows - 1) / S::kRows);
  K3_CUDA_TRY(LaunchKernel(ExpertTileKernel<false, S, Wide>, grid, S::kThreads, kSmem, stream, t));
  return cudaGetLastError();
}

cudaError_t EnsureCublas(MoeWorkspace::Buffers& b) {
  if (b.blas[0]) return cudaSuccess;
  cudaError_t err = cudaMallocHost(&b.counts_host, b.E * sizeof(int32_t));
  if (err == cudaSuccess) err = cudaMallocHost(&b.w2_host, b.E * sizeof(bf16*));
  if (err == cudaSuccess) err = cudaMalloc(&b.xs, b.max_pairs * b.D * sizeof(bf16));
  if (err == cudaSuccess) err = cudaMalloc(&b.gu, b.max_pairs * 2 * b.I * sizeof(bf16));
  if (err == cudaSuccess) err = cudaMalloc(&b.gate_up, 6 * b.E * sizeof(void*));
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&b.fork, cudaEventDisableTiming);
  for (int i = 0; i < MoeWorkspace::Buffers::kBlasStreams && err == cudaSuccess; ++i) {
    err = cudaStreamCreateWithFlags(&b.side[i], cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&b.join[i], cudaEventDisableTiming);
    if (err == cudaSuccess) err = Blas(cublasCreate(&b.blas[i]));
    if (err == cudaSuccess) err = Blas(cublasSetStream(b.blas[i], b.side[i]));
  }
  if (err != cudaSuccess) b.FreeCublas();
  return err;
}

cudaError_t RunCublas(const MoeExpertsArgs& a, MoeWorkspace::Buffers& b, cudaStream_t stream) {
  constexpr int S = MoeWorkspace::Buffers::kBlasStreams;
  const int64_t E = a.num_experts, D = a.D, I = a.I;
  cudaError_t err = EnsureCublas(b);
  if (err != cudaSuccess) return err;
  // cuBLAS takes the shapes (and here the W2 pointers) on the host.
  K3_CUDA_TRY(LaunchKernel(GateUpPointersKernel, static_cast<unsigned>((E + 127) / 128), 128, 0, stream,
                           static_cast<int>(E), b.offsets, a.w1, a.w3, b.xs, b.gu, D, I, b.gate_up));
  err = cudaMemcpyAsync(b.counts_host, b.counts, E * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaMemcpyAsync(b.w2_host, a.w2, E * sizeof(bf16*), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err == cudaSuccess) err = cudaEventRecord(b.fork, stream);
  for (int i = 0; i < S && err == cudaSuccess; ++i) err = cudaStreamWaitEvent(b.side[i], b.fork);
  if (err != cudaSuccess) return err;

  std::vector<int64_t> order(E), offset(E + 1, 0), load(S, 0);
  for (int64_t e = 0; e < E; ++e) offset[e + 1] = offset[e] + b.counts_host[e], order[e] = e;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return b.counts_host[x] > b.counts_host[y]; });
  const int chunks_d = static_cast<int>(D / 8), chunks_i = static_cast<int>(I / 8);
  const float one = 1.0f, zero = 0.0f;
  const void* const* A = b.gate_up;
  for (int64_t r = 0; r < E && err == cudaSuccess; ++r) {
    const int64_t e = order[r], n = b.counts_host[e], off = offset[e];
    if (n == 0) break;
    const int q = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[q] += n;
    err = LaunchKernel(GatherRowsKernel, RowGrid(n), 256, 0, b.side[q], n, chunks_d,
                       reinterpret_cast<const int4*>(a.x), b.slot_pair + off, static_cast<int>(a.top_k),
                       reinterpret_cast<int4*>(b.xs + off * D));
    if (err != cudaSuccess) break;
    // Column-major: gu_eᵀ [I, n] (two problems: W1, W3) = W ([D, I] col-major)ᵀ · xs_eᵀ ([D, n]).
    err = Blas(cublasGemmBatchedEx(b.blas[q], CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(I), static_cast<int>(n),
                                   static_cast<int>(D), &one, A + 2 * e, CUDA_R_16BF, static_cast<int>(D),
                                   A + 2 * E + 2 * e, CUDA_R_16BF, static_cast<int>(D), &zero,
                                   const_cast<void* const*>(A + 4 * E + 2 * e), CUDA_R_16BF, static_cast<int>(2 * I),
                                   2, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (err != cudaSuccess) break;
    err = LaunchKernel(GluRowsKernel, RowGrid(n), 256, 0, b.side[q], off, n, chunks_i,
                       reinterpret_cast<const int4*>(b.gu), a.act, a.situ_beta, a.situ_linear_beta,
                       reinterpret_cast<int4*>(b.h));
    if (err != cudaSuccess) break;
    // y_eᵀ [D, n] = W2_e ([I, D] col-major)ᵀ · h_eᵀ ([I, n]).
    err = Blas(cublasGemmEx(b.blas[q], CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(D), static_cast<int>(n),
                            static_cast<int>(I), &one, b.w2_host[e], CUDA_R_16BF, static_cast<int>(I), b.h + off * I,
                            CUDA_R_16BF, static_cast<int>(I), &zero, b.y + off * D, CUDA_R_16BF, static_cast<int>(D),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  if (err == cudaSuccess) err = cudaGetLastError();
  // Join even after an error: the caller's stream must not run ahead of work already queued.
  for (int i = 0; i < S; ++i) {
    const cudaError_t e1 = cudaEventRecord(b.join[i], b.side[i]);
    const cudaError_t e2 = e1 == cudaSuccess ? cudaStreamWaitEvent(stream, b.join[i]) : e1;
    if (err == cudaSuccess) err = e2;
  }
  return err;
}

}  // namespace

void MoeWorkspace::Buffers::FreeCublas() {
  for (int i = 0; i < kBlasStreams; ++i) {
    if (blas[i]) cublasDestroy(blas[i]);
    if (side[i]) cudaStreamDestroy(side[i]);
    if (join[i]) cudaEventDestroy(join[i]);
    blas[i] = nullptr, side[i] = nullptr, join[i] = nullptr;
  }
  if (fork) cudaEventDestroy(fork);
  cudaFreeHost(counts_host);
  cudaFreeHost(w2_host);
  cudaFree(xs);
  cudaFree(gu);
  cudaFree(gate_up);
  fork = nullptr, counts_host = nullptr, w2_host = nullptr, xs = nullptr, gu = nullptr, gate_up = nullptr;
}

void MoeWorkspace::Buffers::Free() {
  FreeCublas();
  for (void* p : {static_cast<void*>(counts), static_cast<void*>(offsets), static_cast<void*>(slot_pair),
                  static_cast<void*>(pair_slot), static_cast<void*>(tiles), static_cast<void*>(tile_done),
                  static_cast<void*>(num_tiles), static_cast<void*>(h), static_cast<void*>(y)})
    cudaFree(p);
  *this = Buffers{};
}

MoeWorkspace::MoeWorkspace() : b_(std::make_unique<Buffers>()) {}
MoeWorkspace::~MoeWorkspace() { b_->Free(); }

cudaError_t MoeWorkspace::Reserve(int64_t max_pairs, int64_t D, int64_t I, int64_t num_experts) {
  if (max_pairs < 0 || D < 0 || I < 0 || num_experts < 0) return cudaErrorInvalidValue;
  Buffers& b = *b_;
  if (b.counts && max_pairs <= b.max_pairs && D <= b.D && I <= b.I && num_experts <= b.E) return cudaSuccess;
  const int64_t P = std::max(max_pairs, b.max_pairs), E = std::max(num_experts, b.E);
  D = (std::max(D, b.D) + 7) / 8 * 8, I = std::max(I, b.I);  // D: the split planes start on 16 bytes
  b.Free();
  b.max_pairs = P, b.D = D, b.I = I, b.E = E;
  const int64_t Pc = std::max<int64_t>(P, 1);
  cudaError_t err = cudaMalloc(&b.counts, std::max<int64_t>(E, 1) * sizeof(int32_t));
  if (err == cudaSuccess) err = cudaMalloc(&b.offsets, (E + 1) * sizeof(int32_t));
  if (err == cudaSuccess) err = cudaMalloc(&b.slot_pair, Pc * sizeof(int32_t));
  if (err == cudaSuccess) err = cudaMalloc(&b.pair_slot, Pc * sizeof(int32_t));
  const int64_t max_tiles = E + P / (SmallTile::kTokens / 2) + 1;  // the smallest tiles: the longest list
  if (err == cudaSuccess) err = cudaMalloc(&b.tiles, max_tiles * sizeof(int2));
  if (err == cudaSuccess) err = cudaMalloc(&b.tile_done, max_tiles * sizeof(int32_t));
  if (err == cudaSuccess) err = cudaMalloc(&b.num_tiles, sizeof(int32_t));
  // h and y with a second plane for the split path.
  if (err == cudaSuccess) err = cudaMalloc(&b.h, 2 * Pc * std::max<int64_t>(I, 1) * sizeof(bf16));
  if (err == cudaSuccess) err = cudaMalloc(&b.y, 2 * Pc * std::max<int64_t>(D, 1) * sizeof(bf16));
  if (err != cudaSuccess) b.Free();
  return err;
}

int64_t MoePackedGateUpElems(int64_t D, int64_t I) {
  return (I + kPackRows / 2 - 1) / (kPackRows / 2) * ((D + kBK - 1) / kBK) * kPackRows * kBK;
}
cudaError_t MoePackGateUp(const bf16* w1, const bf16* w3, int64_t D, int64_t I, bf16* out, cudaStream_t stream) {
  if (I < 1 || D < 8 || D % 8 || !w1 || !w3 || !out) return cudaErrorInvalidValue;
  const int64_t chunks = MoePackedGateUpElems(D, I) / 8;
  PackGateUpKernel<<<RowGrid((chunks + 255) / 256), 256, 0, stream>>>(w1, w3, I, D, reinterpret_cast<int4*>(out),
                                                                    chunks);
  return cudaGetLastError();
}

cudaError_t MoePermute(int64_t num_pairs, const int32_t* idx, int64_t num_experts, int32_t* counts, int32_t* offsets,
                       int32_t* slot_pair, int32_t* pair_slot, cudaStream_t stream) {
  if (num_pairs < 0 || num_pairs > 0x7fffffff || num_experts < 1 || num_experts > kMaxPermuteExperts)
    return cudaErrorInvalidValue;
  return Permute(num_pairs, idx, num_experts, counts, offsets, slot_pair, pair_slot, Tile::kTokens, 0, nullptr, nullptr,
                 nullptr, nullptr, stream);
}

cudaError_t MoePermuteTiles(int64_t num_pairs, const int32_t* idx, int64_t num_experts, int32_t* counts,
                            int32_t* offsets, int32_t* slot_pair, int32_t* pair_slot, int tile_tokens, int wide_tokens,
                            int2* tiles, int32_t* num_tiles, int32_t* experts_hit, cudaStream_t stream) {
  if (num_pairs < 0 || num_pairs > 0x7fffffff || num_experts < 1 || num_experts > kMaxPermuteExperts ||
      tile_tokens < 1 || wide_tokens < 0 || !tiles || !num_tiles)
    return cudaErrorInvalidValue;
  return Permute(num_pairs, idx, num_experts, counts, offsets, slot_pair, pair_slot, tile_tokens, wide_tokens, tiles,
                 nullptr, num_tiles, experts_hit, stream);
}

cudaError_t MoeCombine(int64_t N, int64_t D, int64_t top_k, const int32_t* pair_slot, const float* w, const bf16* y,
                       int64_t y_lo, bf16* out, float* out_f32, cudaStream_t stream) {
  if (N < 0 || D < 8 || D % 8 || D / 8 > 0x7fffffff || y_lo % 8 || top_k < 1 || (y_lo ? !out_f32 : !out))
    return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const int chunks = static_cast<int>(D / 8);
  K3_CUDA_TRY(LaunchKernel(CombineKernel, CombineGrid(N, chunks), kCombineThreads, 0, stream, N, chunks,
                           static_cast<int>(top_k), pair_slot, w, reinterpret_cast<const int4*>(y), y_lo / 8,
                           y_lo ? static_cast<void*>(out_f32) : static_cast<void*>(out)));
  return cudaGetLastError();
}

cudaError_t MoeExperts(const MoeExpertsArgs& a, MoeGemm gemm, MoeWorkspace& ws, cudaStream_t stream) {
  MoeWorkspace::Buffers& b = *ws.b_;
  const int64_t P = a.N * a.top_k, E = a.num_experts;
  if (a.N < 0 || a.top_k < 1 || E < 1 || a.D < 8 || a.I < 8 || a.D % 8 || a.I % 8 || a.D > 0x7fffffff ||
      a.I > 0x7fffffff || P > 0x7fffffff)
    return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  const bool split = a.x_lo != 0;
  const bool tiled_only = split || a.packed, mx = a.q1 != nullptr;
  const bool weights = mx ? a.s1 && a.q3 && a.s3 && a.q2 && a.s2 && !split && !a.packed
                          : a.w1 && (a.packed || a.w3) && a.w2;
  if (!a.x || !a.idx || !a.w || !weights || (split ? !a.out_f32 : !a.out) || !b.counts || P > b.max_pairs ||
      a.D > b.D || a.I > b.I || E > b.E || (tiled_only && (gemm == MoeGemm::kCublas || gemm == MoeGemm::kWgmma)) ||
      (mx && ((gemm != MoeGemm::kWgmma && gemm != MoeGemm::kAuto) || a.D % 32 || a.I % 32)))
    return cudaErrorInvalidValue;
  if (gemm == MoeGemm::kAuto && mx) gemm = MoeGemm::kWgmma;
  if (gemm == MoeGemm::kAuto && tiled_only) gemm = MoeGemm::kTiled;
  if (gemm == MoeGemm::kAuto)
    gemm = P <= kMoeWgmmaMaxPairsPerExpert * E && WgmmaFits(a) ? MoeGemm::kWgmma : MoeGemm::kCublas;
  const bool tiled = gemm == MoeGemm::kTiled, wgmma = gemm == MoeGemm::kWgmma,
             small = split && P <= kSmallTileMaxPairsPerExpert * E, mid = !split && P <= kMidTileMaxPairsPerExpert * E;
  const int tile_tokens = wgmma ? wg::kBM
                          : small ? SmallTile::kTokens / 2
                          : mid   ? MidTile::kTokens
                          : split ? Tile::kTokens / 2
                                  : Tile::kTokens;
  const bool listed = tiled || wgmma;  // the kernels that take the tile list
  const int wide_tokens = tiled && small ? WideTile::kTokens / 2 : 0;
  cudaError_t err = Permute(P, a.idx, E, b.counts, b.offsets, b.slot_pair, b.pair_slot, tile_tokens, wide_tokens,
                            listed ? b.tiles : nullptr, b.tile_done, listed ? b.num_tiles : nullptr, a.experts_hit,
                            stream);
  if (err == cudaSuccess)
    err = wgmma   ? RunWgmma(a, b, stream)
          : !tiled ? RunCublas(a, b, stream)
          : small ? RunTiled<SmallTile, WideTile>(a, b, stream)
          : mid   ? RunTiled<MidTile>(a, b, stream)
                  : RunTiled<Tile>(a, b, stream);
  if (err != cudaSuccess) return err;
  return MoeCombine(a.N, a.D, a.top_k, b.pair_slot, a.w, b.y, split ? b.max_pairs * b.D : 0, a.out, a.out_f32, stream);
}

}  // namespace k3::cuda
