#include "kernels/cuda/mxfp4.cuh"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/mxfp4_fragments.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {

using bf16 = __nv_bfloat16;
using namespace mxfp4;

namespace {

// Z for the 8 bytes D: Z = L⁻¹ D, as 8 tables of 256 (one per byte of D).
struct CodeTables {
  uint64_t t[8][256];
  CodeTables() {
    uint64_t l[64], inv[64];  // row r: output bit r (byte r/8, bit r%8) as a set of Z bits
    for (int j = 0; j < 8; ++j)
      for (int b = 0; b < 8; ++b) {
        uint64_t v = uint64_t{1} << ((kO1[j] + kMBits[b]) % 64);
        if (kO2[j] >= 0) v ^= uint64_t{1} << ((kO2[j] + kMBits[b]) % 64);
        l[8 * j + b] = v, inv[8 * j + b] = uint64_t{1} << (8 * j + b);
      }
    for (int c = 0, r = 0; c < 64; ++c, ++r) {  // Gauss-Jordan: l becomes the identity, inv L⁻¹ (full rank)
      int p = r;
      while (!(l[p] >> c & 1)) ++p;
      std::swap(l[r], l[p]), std::swap(inv[r], inv[p]);
      for (int i = 0; i < 64; ++i)
        if (i != r && (l[i] >> c & 1)) l[i] ^= l[r], inv[i] ^= inv[r];
    }
    // Z bit c = parity(inv[c] & D): the column of D bit i is the set of c with bit i in inv[c].
    uint64_t col[64] = {};
    for (int c = 0; c < 64; ++c)
      for (int i = 0; i < 64; ++i)
        if (inv[c] >> i & 1) col[i] |= uint64_t{1} << c;
    for (int byte = 0; byte < 8; ++byte)
      for (int v = 0; v < 256; ++v) {
        uint64_t z = 0;
        for (int b = 0; b < 8; ++b)
          if (v >> b & 1) z ^= col[8 * byte + b];
        t[byte][v] = z;
      }
  }
};

}  // namespace

int64_t Mxfp4CodeBytes(int64_t rows, int64_t cols) { return rows * cols / 2; }
int64_t Mxfp4ScaleBytes(int64_t rows, int64_t cols) { return rows * cols / 32 + rows; }

// Scales: per (r16, kb) 16 bytes, pairs (row g, row g + 8), each u = s − R + 126 so that a code's bf16 (its value
// times 2^−126) times the bf16 2^(u − 127) is its weight over 2^R, exactly; then one byte R per row (the kernel
// multiplies the row's fp32 sums by 2^R): R = max(0, the row's largest s − 128) keeps u ≤ 254 (a bf16 exponent).
// Exact while every s of a row is ≥ R − 5 (no underflow): a row's scales spanning under 133 binades, which any
// checkpoint's do (real scales sit near 2^−7).
void Mxfp4ToFragments(const uint8_t* packed, const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* codes,
                      uint8_t* scales) {
  static const CodeTables tables;
  const int64_t KB = cols / 32, row_bytes = cols / 2;
  std::vector<int> r_row(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int smax = 0;
    for (int64_t kb = 0; kb < KB; ++kb) smax = std::max<int>(smax, scale[r * KB + kb]);
    r_row[r] = std::max(0, smax - 128);
    scales[rows * KB + r] = static_cast<uint8_t>(r_row[r]);
  }
  for (int64_t r16 = 0; r16 < rows / 16; ++r16) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      uint8_t* c = codes + (r16 * KB + kb) * 256;
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        uint64_t z = 0;
        for (int j = 0; j < 8; ++j) {
          const int64_t row = r16 * 16 + g + 8 * (j & 1), k = kb * 32 + 8 * t + 4 * (j / 4) + 2 * ((j % 4) / 2);
          z ^= tables.t[j][packed[row * row_bytes + k / 2]];
        }
        for (int b = 0; b < 8; ++b) c[lane * 8 + b] = static_cast<uint8_t>(z >> (8 * b));
      }
      uint8_t* s = scales + (r16 * KB + kb) * 16;
      for (int g = 0; g < 16; ++g) {
        const int64_t row = r16 * 16 + g / 2 + 8 * (g % 2);
        s[g] = static_cast<uint8_t>(std::max(1, scale[row * KB + kb] - r_row[row] + 126));
      }
    }
  }
}

struct Mxfp4Workspace::Buffers {
  int64_t max_pairs = 0, D = 0, I = 0, E = 0;
  bool wgmma = false, dequant_copy = false;  // what Reserve was asked for, so far
  int32_t *counts = nullptr, *offsets = nullptr, *slot_pair = nullptr, *pair_slot = nullptr;
  // The direct kernels' work: each pass as (expert, first slot), and their number (MoePermuteTiles).
  int2* passes = nullptr;
  int32_t* num_passes = nullptr;
  bf16* h = nullptr;  // [2, P, I]: hi plane, then (split x) the lo plane
  bf16* y = nullptr;  // [2, P, D]
  // The dequantizing path (many pairs per expert): bf16 W1, W3, W2 of every expert, pointers into it, and the
  // bf16 grouped experts' workspace.
  bf16* wbf = nullptr;  // [E][W1 I·D, W3 I·D, W2 D·I]
  const bf16** wptr = nullptr;  // [3][E]
  std::unique_ptr<MoeWorkspace> moe;
  void Free() {
    for (void* p : {static_cast<void*>(counts), static_cast<void*>(offsets), static_cast<void*>(slot_pair),
                    static_cast<void*>(pair_slot), static_cast<void*>(h), static_cast<void*>(y),
                    static_cast<void*>(wbf), static_cast<void*>(wptr), static_cast<void*>(passes),
                    static_cast<void*>(num_passes)})
      cudaFree(p);
    counts = offsets = slot_pair = pair_slot = num_passes = nullptr;
    passes = nullptr;
    h = y = wbf = nullptr;
    wptr = nullptr;
    moe.reset();
  }
};

namespace {
// An expert's tokens in one pass up to 16, else passes of 32, so that the experts at the head of a skewed routing
// dequantize their weights once per 32 tokens (MoePermuteTiles' tile_tokens and wide_tokens).
constexpr int kPassTokens = 16, kWidePassTokens = 32;
// At most this many passes over P pairs: each expert that received a pair has one pass with fewer tokens at most.
int64_t MaxPasses(int64_t P, int64_t E) { return std::min(P, E) + (P + kPassTokens - 1) / kPassTokens; }
}  // namespace

Mxfp4Workspace::Mxfp4Workspace() : b_(std::make_unique<Buffers>()) {}
Mxfp4Workspace::~Mxfp4Workspace() { b_->Free(); }

cudaError_t Mxfp4Workspace::Reserve(int64_t max_pairs, int64_t D, int64_t I, int64_t E, bool dequant_copy,
                                    bool wgmma) {
  Buffers& b = *b_;
  const bool copy_missing = dequant_copy && b.wbf == nullptr && max_pairs >= kMxfp4DequantMinPairsPerExpert * E;
  const bool moe_missing = wgmma && b.moe == nullptr && max_pairs >= kMxfp4WgmmaMinPairsPerExpert * E;
  if (max_pairs <= b.max_pairs && D <= b.D && I <= b.I && E <= b.E && !copy_missing && !moe_missing)
    return cudaSuccess;
  b.Free();
  b.max_pairs = std::max(max_pairs, b.max_pairs), b.D = std::max(D, b.D), b.I = std::max(I, b.I);
  b.E = std::max(E, b.E);
  const int64_t P = std::max<int64_t>(b.max_pairs, 1);
  cudaError_t e;
  if ((e = cudaMalloc(&b.counts, b.E * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.offsets, (b.E + 1) * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.slot_pair, P * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.pair_slot, P * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.passes, MaxPasses(P, b.E) * sizeof(int2))) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.num_passes, sizeof(int32_t))) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.h, 2 * P * b.I * 2)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.y, 2 * P * b.D * 2)) != cudaSuccess) return e;
  b.wgmma = b.wgmma || wgmma, b.dequant_copy = b.dequant_copy || dequant_copy;
  const bool copy = b.dequant_copy && b.max_pairs >= kMxfp4DequantMinPairsPerExpert * b.E;
  if (copy || (b.wgmma && b.max_pairs >= kMxfp4WgmmaMinPairsPerExpert * b.E)) {  // the grouped experts' workspace
    b.moe = std::make_unique<MoeWorkspace>();
    if ((e = b.moe->Reserve(b.max_pairs, b.D, b.I, b.E)) != cudaSuccess) return e;
  }
  if (!copy) return cudaSuccess;
  const int64_t per_expert = 3 * b.I * b.D;
  if ((e = cudaMalloc(&b.wbf, b.E * per_expert * 2)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.wptr, 3 * b.E * sizeof(bf16*))) != cudaSuccess) return e;
  std::vector<const bf16*> ptrs(3 * b.E);
  for (int64_t x = 0; x < b.E; ++x)
    for (int m = 0; m < 3; ++m) ptrs[m * b.E + x] = b.wbf + x * per_expert + m * b.I * b.D;
  return cudaMemcpy(b.wptr, ptrs.data(), ptrs.size() * sizeof(bf16*), cudaMemcpyHostToDevice);
}

namespace {

constexpr int kWarps = 8;     // 128 weight rows per CTA
constexpr int kMaxTiles = 4;  // n-tiles of 8 tokens a pass at most

// The n-tiles of 8 tokens a pass of an expert with m pairs covers at most (kPassTokens, kWidePassTokens).
__host__ __device__ __forceinline__ int PassTiles(int m) { return m <= 8 ? 1 : m <= kPassTokens ? 2 : kMaxTiles; }
static_assert(kWidePassTokens == 8 * kMaxTiles);

// A stage of the ring: kBlocks k32 blocks of every warp's 16 rows, codes (256 bytes a block) of W1 (or W2) and,
// gate/up, W3, then their scales (16 bytes a block); then the pass's x over those 32·kBlocks inputs, 64 bytes a block
// per token and plane, block h of an odd token at h ^ 1 (XOffset) so that a quarter warp's 16-byte reads (tokens g,
// g + 1) hit all 32 banks once.
template <bool kGlu, bool kSplit>
struct Ring {
  static constexpr int kMats = kGlu ? 2 : 1, kPlanes = kSplit ? 2 : 1;
  // k32 blocks a stage, and stages in the ring: few barriers a weight (each stage is one __syncthreads), the same
  // bytes in flight (two CTAs an SM). Two blocks a stage in 6 stages ran 12% slower at 8 pairs per expert.
  static constexpr int kBlocks = kGlu ? 4 : 8;
  static constexpr int kStages = kGlu ? 3 : 2;
  static_assert(kBlocks % 2 == 0 && kBlocks <= 8, "a lane copies kBlocks / 2 16-byte chunks of a matrix's codes");
  static constexpr int kCodeBytes = kBlocks * 256, kScaleBytes = kBlocks * 16, kTokenBytes = kBlocks * 64;
  static constexpr int kWarpBytes = kMats * (kCodeBytes + kScaleBytes);
  static constexpr int kXBytes = kPlanes * 8 * kMaxTiles * kTokenBytes;
  static constexpr int kStageBytes = kWarps * kWarpBytes + kXBytes;
  static constexpr int kBytes = kStages * kStageBytes;
  // Inputs 8·c .. 8·c + 7 (c = 4·h + t: k32 block h of the stage, t) of a token.
  static __host__ __device__ constexpr int XOffset(int plane, int token, int c) {
    return kWarps * kWarpBytes + (plane * 8 * kMaxTiles + token) * kTokenBytes + ((c ^ (token & 1) << 2) * 16);
  }
};

struct KernelArgs {
  int64_t rows = 0, K = 0;  // weights [rows, K]
  const uint8_t* const* wa = nullptr;  // W1 (gate/up) or W2 (down)
  const uint8_t* const* sa = nullptr;
  const uint8_t* const* wb = nullptr;  // W3 (gate/up only)
  const uint8_t* const* sb = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* slot_pair = nullptr;
  const int2* passes = nullptr;  // (expert, first slot) of each pass, *num_passes of them
  const int32_t* num_passes = nullptr;
  // The passes and offsets were written before the kernel before this one (the down kernel: by the permutation,
  // before the gate/up kernel): its CTAs read them and start their weights before PdlEnter (launch.cuh).
  bool early = false;
  int top_k = 1;
  const bf16* x = nullptr;  // gate/up: tokens' rows (slot_pair / top_k); down: h, one row per slot
  int64_t x_lo = 0;         // split x: the lo plane at x + x_lo (a multiple of 8); 0: plain bf16
  bf16* out = nullptr;      // [P, rows], one row per slot
  int64_t out_lo = 0;       // split out: the lo plane at out + out_lo; 0: plain bf16
  GluAct act = GluAct::kSilu;
  float b1 = 0, b2 = 0;
};

__device__ __forceinline__ float Pow2(uint32_t r) { return __uint_as_float((r + 127) << 23); }

// A CTA: kWarps warps of 16 weight rows each (blockIdx.y) against one pass of up to 8·kTiles tokens of one expert
// (blockIdx.x, the pass list that MoePermuteTiles made: every pass its own CTA, so a busy expert's passes run side
// by side and read its weights from L2 once, and no CTA exists for an expert without tokens). Weights and x stream through
// the CTA's ring of kStages stages (cp.async: the loads in flight cost no registers, and x, which every warp of
// the CTA reads, lands once); each lane dequantizes its fragments once for all the pass's n-tiles. A split x runs
// its hi and lo planes through the same weight fragments into the same fp32 accumulators (x·W = hi·W + lo·W).
template <int kTiles, bool kGlu, bool kSplit>
__device__ __forceinline__ void Pass(const KernelArgs& a, uint8_t* smem, int e, int begin, int m, int tok0) {
  using R = Ring<kGlu, kSplit>;
  constexpr int kMats = R::kMats, kBlocks = R::kBlocks, kStages = R::kStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t r16 = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
  const bool rows_in = r16 * 16 < a.rows;  // warps past the last rows still copy x and keep the barriers
  const int KB = static_cast<int>(a.K / 32);
  const int NS = (KB + kBlocks - 1) / kBlocks;
  // What this thread copies each stage, as sources advanced a stage at a time and offsets in a slot (shared
  // addresses): its kBlocks / 2 16-byte chunks of each matrix's codes (lane l, chunk j: block (l + 32·j) / 16 of
  // the stage), lanes 0 .. kBlocks·kMats − 1 a block's scales, and up to kMine 16-byte chunks of x (token, plane and
  // part p: block p / 4, inputs 8·(p % 4)). A K that is not a multiple of the stage leaves the last stage's blocks
  // past K: they and x there are zeros, which add nothing.
  const uint8_t* qsrc[kMats];
  const uint8_t* ssrc = nullptr;
  float fa0 = 1.0f, fa1 = 1.0f, fb0 = 1.0f, fb1 = 1.0f;
  const int s_mat = lane / kBlocks, s_block = lane % kBlocks;  // the scales this lane copies (lanes < kBlocks·kMats)
  if (rows_in) {
    qsrc[0] = a.wa[e] + r16 * KB * 256 + lane * 16;
    if (kGlu) qsrc[kMats - 1] = a.wb[e] + r16 * KB * 256 + lane * 16;
    ssrc = (kGlu && s_mat == 1 ? a.sb[e] : a.sa[e]) + r16 * KB * 16 + s_block * 16;
    const uint8_t* ra = a.sa[e] + a.rows * KB + r16 * 16 + g;  // R of rows g, g + 8
    fa0 = Pow2(ra[0]), fa1 = Pow2(ra[8]);
    if (kGlu) {
      const uint8_t* rb = a.sb[e] + a.rows * KB + r16 * 16 + g;
      fb0 = Pow2(rb[0]), fb1 = Pow2(rb[8]);
    }
  }
  const uint32_t base = ptx::SmemAddr(smem);
  const uint32_t cdst = warp * R::kWarpBytes + lane * 16,
                 sdst = warp * R::kWarpBytes + kMats * R::kCodeBytes + s_mat * R::kScaleBytes + s_block * 16;
  const bool copies_scales = rows_in && lane < kBlocks * kMats;
  constexpr int kParts = 4 * kBlocks;  // 16-byte chunks of a token's x a stage
  constexpr int kChunks = R::kPlanes * 8 * kTiles * kParts;
  constexpr int kMine = (kChunks + kWarps * 32 - 1) / (kWarps * 32);
  const bf16* xsrc[kMine];
  uint32_t xdst[kMine];
  bool xmine[kMine], xreal[kMine];
  int xblock[kMine];
#pragma unroll
  for (int i = 0; i < kMine; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kWarps * 32;
    const int plane = c / (8 * kTiles * kParts), token = c / kParts % (8 * kTiles), part = c % kParts,
              tk = tok0 + token;
    xmine[i] = c < kChunks, xblock[i] = part / 4, xreal[i] = xmine[i] && tk < m;
    xdst[i] = R::XOffset(plane, token, part);
    xsrc[i] = a.x;  // a valid address for the zeros
    if (xreal[i]) {
      const int64_t row = kGlu ? a.slot_pair[begin + tk] / a.top_k : begin + tk;
      xsrc[i] = a.x + row * a.K + plane * a.x_lo + part * 8;
    }
  }
  const int last_blocks = KB - (NS - 1) * kBlocks;  // the blocks of the last stage inside K
  // Stage st's weights, then its x, into slot `slot`; the sources advance a stage. The caller commits the group.
  auto issue_w = [&](int st, uint32_t slot) {
    if (st >= NS) return;
    const int blocks = st == NS - 1 ? last_blocks : kBlocks;
    if (rows_in) {
#pragma unroll
      for (int mt = 0; mt < kMats; ++mt) {
#pragma unroll
        for (int j = 0; j < kBlocks / 2; ++j)
          ptx::CpAsync16At(slot + cdst + mt * R::kCodeBytes + j * 512, qsrc[mt] + j * 512,
                           (lane + 32 * j) / 16 < blocks ? 16 : 0);
        qsrc[mt] += R::kCodeBytes;
      }
    }
    if (copies_scales) ptx::CpAsync16At(slot + sdst, ssrc, s_block < blocks ? 16 : 0);
    ssrc += R::kScaleBytes;
  };
  auto issue_x = [&](int st, uint32_t slot) {
    if (st >= NS) return;
    const int blocks = st == NS - 1 ? last_blocks : kBlocks;
#pragma unroll
    for (int i = 0; i < kMine; ++i) {
      if (!xmine[i]) continue;
      const bool in = xreal[i] && xblock[i] < blocks;
      ptx::CpAsync16At(slot + xdst[i], in ? xsrc[i] : a.x, in ? 16 : 0);
      xsrc[i] += 32 * kBlocks;
    }
  };
  // The first stages' weights may come before the kernel before this one has finished (a.early); their x after it.
  // Stage 0's group then holds the weights of every first stage, which only makes the first wait a little longer.
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_w(i, base + i * R::kStageBytes);
  if (a.early) PdlEnter();
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    issue_x(i, base + i * R::kStageBytes);
    ptx::CpAsyncCommit();
  }
  int wr = kStages - 1;  // the slot of the next stage issued
  // This lane's reads in a slot: codes and scales of its warp, x of token g (its two k32 halves swapped on odd g).
  const uint32_t crd = warp * R::kWarpBytes + lane * 8, srd = warp * R::kWarpBytes + kMats * R::kCodeBytes + g * 2;
  // Block h of token g's inputs 8t .. 8t + 7 at xrow + (h·64 ^ xflip): R::XOffset(0, g, 4·h + t).
  const uint32_t xrow = kWarps * R::kWarpBytes + g * R::kTokenBytes + t * 16, xflip = (g & 1) * 64;
  float ca[kTiles][4] = {}, cb[kTiles][4] = {};
  int rd = 0;
  for (int it = 0; it < NS; ++it) {
    ptx::CpAsyncWaitGroup<kStages - 2>();
    __syncthreads();  // stage it landed for every thread, and every thread is done with stage it − 1's slot
    const uint32_t slot_w = base + wr * R::kStageBytes;
    wr = wr == kStages - 1 ? 0 : wr + 1;
    issue_w(it + kStages - 1, slot_w);
    issue_x(it + kStages - 1, slot_w);
    ptx::CpAsyncCommit();
    const uint8_t* slot = smem + rd * R::kStageBytes;
    rd = rd == kStages - 1 ? 0 : rd + 1;
    if (!rows_in) continue;
#pragma unroll
    for (int h = 0; h < kBlocks; ++h) {
      uint32_t A0[4], A1[4], B0[4], B1[4];
      Dequant(*reinterpret_cast<const uint2*>(slot + crd + h * 256),
              *reinterpret_cast<const uint16_t*>(slot + srd + h * 16), A0, A1);
      if (kGlu)
        Dequant(*reinterpret_cast<const uint2*>(slot + crd + R::kCodeBytes + h * 256),
                *reinterpret_cast<const uint16_t*>(slot + srd + R::kScaleBytes + h * 16), B0, B1);
      const uint32_t xh = xrow + ((h * 64) ^ xflip);
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
        const uint4 xv = *reinterpret_cast<const uint4*>(slot + xh + nt * 8 * R::kTokenBytes);  // token g's inputs 8t ..
        ptx::Mma(ca[nt], A0, xv.x, xv.y);
        ptx::Mma(ca[nt], A1, xv.z, xv.w);
        if (kGlu) {
          ptx::Mma(cb[nt], B0, xv.x, xv.y);
          ptx::Mma(cb[nt], B1, xv.z, xv.w);
        }
        if (kSplit) {
          const uint4 xl = *reinterpret_cast<const uint4*>(slot + xh + (8 * kMaxTiles + nt * 8) * R::kTokenBytes);
          ptx::Mma(ca[nt], A0, xl.x, xl.y);
          ptx::Mma(ca[nt], A1, xl.z, xl.w);
          if (kGlu) {
            ptx::Mma(cb[nt], B0, xl.x, xl.y);
            ptx::Mma(cb[nt], B1, xl.z, xl.w);
          }
        }
      }
    }
  }
  ptx::CpAsyncWaitAll();
  if (!rows_in) return;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // c_i: row g + 8·(i / 2), token 2t + i % 2
      const int tk = tok0 + nt * 8 + 2 * t + (i & 1);
      if (tk >= m) continue;
      const int64_t row = r16 * 16 + g + 8 * (i >> 1);
      const float va = ca[nt][i] * (i >> 1 ? fa1 : fa0);
      const float v = kGlu ? Glu(a.act, va, cb[nt][i] * (i >> 1 ? fb1 : fb0), a.b1, a.b2) : va;
      StoreSplit(a.out + static_cast<int64_t>(begin + tk) * a.rows + row, kSplit ? a.out_lo : 0, v);
    }
  }
}

// The pass's n-tiles pick the body: the common one-tile pass keeps its accumulators and x copies few.
template <bool kGlu, bool kSplit>
__global__ __launch_bounds__(kWarps * 32) void Mxfp4Kernel(KernelArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (!a.early) PdlEnter();
  if (static_cast<int>(blockIdx.x) >= *a.num_passes) return;
  const int2 pass = a.passes[blockIdx.x];
  const int e = pass.x, begin = a.offsets[e], m = a.offsets[e + 1] - begin, tok0 = pass.y - begin;
  const int tiles = min(PassTiles(m), (m - tok0 + 7) / 8);
  if (tiles == 1) {
    Pass<1, kGlu, kSplit>(a, smem, e, begin, m, tok0);
  } else if (tiles == 2) {
    Pass<2, kGlu, kSplit>(a, smem, e, begin, m, tok0);
  } else {  // 3 or 4: a fourth n-tile of zeros at most
    Pass<kMaxTiles, kGlu, kSplit>(a, smem, e, begin, m, tok0);
  }
}

template <bool kGlu, bool kSplit>
cudaError_t Launch(const KernelArgs& k, int64_t num_pairs, int64_t num_experts, cudaStream_t stream) {
  // The ring is beyond the default 48 KB of shared memory (set once, as experts.cu does for its kernels).
  static const cudaError_t attr = cudaFuncSetAttribute(
      Mxfp4Kernel<kGlu, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize, Ring<kGlu, kSplit>::kBytes);
  if (attr != cudaSuccess) return attr;
  const dim3 grid(static_cast<unsigned>(MaxPasses(num_pairs, num_experts)),
                  static_cast<unsigned>((k.rows / 16 + kWarps - 1) / kWarps));
  return LaunchKernel(Mxfp4Kernel<kGlu, kSplit>, grid, kWarps * 32, Ring<kGlu, kSplit>::kBytes, stream, k);
}


// The weights of the experts that received a pair, from fragment order to bf16 [rows, K] row-major. A warp takes
// 16 rows × 8 k32 blocks: it loads the 8 blocks' fragments at once (coalesced 256 bytes each), dequantizes each
// lane's 16 weights as Dequant makes them, times 2^R (exact), into a shared tile, and stores the tile a row at a time
// (512 contiguous bytes a store: a scattered 64 bytes per row and block ran at a third of the copy bandwidth).
constexpr int kDequantWarps = 4;
constexpr int kDequantRow = 576;  // bytes of a tile row: 512, padded so that rows g and g + 1 fill all banks
__global__ __launch_bounds__(kDequantWarps * 32) void DequantKernel(const uint8_t* const* w, const uint8_t* const* s,
                                                                    int64_t rows, int64_t K, const int32_t* counts,
                                                                    const bf16* const* out) {
  __shared__ __align__(16) uint8_t tile[kDequantWarps][16 * kDequantRow];
  const int e = blockIdx.y;
  if (counts[e] == 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t KB = K / 32, KG = (KB + 7) / 8;
  const int64_t id = static_cast<int64_t>(blockIdx.x) * kDequantWarps + warp;  // (r16, group of 8 blocks)
  if (id >= rows / 16 * KG) return;
  const int64_t r16 = id / KG, kb0 = id % KG * 8;
  const int nb = KB - kb0 < 8 ? static_cast<int>(KB - kb0) : 8;
  uint2 q[8];
  uint32_t sc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j >= nb) break;
    q[j] = __ldg(reinterpret_cast<const uint2*>(w[e]) + (r16 * KB + kb0 + j) * 32 + lane);
    sc[j] = __ldg(reinterpret_cast<const uint16_t*>(s[e]) + (r16 * KB + kb0 + j) * 8 + g);
  }
  const uint8_t* r = s[e] + rows * KB + r16 * 16 + g;
  const uint32_t f0 = (r[0] + 127u) << 7, f1 = (r[8] + 127u) << 7;  // bf16 2^R
  const uint32_t p0 = f0 | f0 << 16, p1 = f1 | f1 << 16;
  uint8_t* tw = tile[warp];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j >= nb) break;
    uint32_t a0[4], a1[4];
    Dequant(q[j], sc[j], a0, a1);
    *reinterpret_cast<uint4*>(tw + g * kDequantRow + j * 64 + t * 16) =
        make_uint4(Mul(a0[0], p0), Mul(a0[2], p0), Mul(a1[0], p0), Mul(a1[2], p0));
    *reinterpret_cast<uint4*>(tw + (g + 8) * kDequantRow + j * 64 + t * 16) =
        make_uint4(Mul(a0[1], p1), Mul(a0[3], p1), Mul(a1[1], p1), Mul(a1[3], p1));
  }
  __syncwarp();
  if (lane * 8 >= nb * 32) return;
  bf16* o = const_cast<bf16*>(out[e]) + r16 * 16 * K + kb0 * 32 + lane * 8;
#pragma unroll
  for (int row = 0; row < 16; ++row)
    *reinterpret_cast<uint4*>(o + row * K) = *reinterpret_cast<const uint4*>(tw + row * kDequantRow + lane * 16);
}

cudaError_t Dequantize(const uint8_t* const* w, const uint8_t* const* s, int64_t rows, int64_t K, int64_t E,
                       const int32_t* counts, const bf16* const* out, cudaStream_t stream) {
  const int64_t tiles = rows / 16 * ((K / 32 + 7) / 8);
  DequantKernel<<<dim3(static_cast<unsigned>((tiles + kDequantWarps - 1) / kDequantWarps), static_cast<unsigned>(E)),
                  kDequantWarps * 32, 0, stream>>>(w, s, rows, K, counts, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t Mxfp4Experts(const Mxfp4ExpertsArgs& a, Mxfp4Workspace& ws, cudaStream_t stream) {
  Mxfp4Workspace::Buffers& b = *ws.b_;
  const int64_t P = a.N * a.top_k, E = a.num_experts;
  const bool split = a.x_lo != 0;
  if (a.N < 0 || a.D % 32 != 0 || a.I % 32 != 0 || a.D <= 0 || a.I <= 0 || a.top_k <= 0 || E <= 0 || E > 8192 ||
      a.x_lo % 8 != 0 || reinterpret_cast<uintptr_t>(a.x) % 16 != 0)
    return cudaErrorInvalidValue;
  if (P > b.max_pairs || a.D > b.D || a.I > b.I || E > b.E) return cudaErrorInvalidValue;
  const bool auto_dequant =
      b.wbf != nullptr && P >= (split ? kMxfp4DequantMinPairsPerExpert : kMxfp4PlainDequantMinPairsPerExpert) * E;
  const bool auto_wgmma = !split && !auto_dequant && P >= kMxfp4WgmmaMinPairsPerExpert * E && b.moe != nullptr;
  const bool wgmma = a.gemm == Mxfp4Gemm::kWgmma || (a.gemm == Mxfp4Gemm::kAuto && auto_wgmma);
  const bool dequant = a.gemm == Mxfp4Gemm::kDequant || (a.gemm == Mxfp4Gemm::kAuto && auto_dequant);
  if ((dequant && b.wbf == nullptr) || (wgmma && (split || b.moe == nullptr))) return cudaErrorInvalidValue;
  if (a.N == 0) return a.experts_hit ? cudaMemsetAsync(a.experts_hit, 0, sizeof(int32_t), stream) : cudaSuccess;
  if (!a.x || !a.idx || !a.w || !a.w1 || !a.s1 || !a.w3 || !a.s3 || !a.w2 || !a.s2 || (split ? !a.out_f32 : !a.out))
    return cudaErrorInvalidValue;
  // The grouped experts' arguments (the wgmma path's and the copy's), weights aside.
  MoeExpertsArgs m;
  m.N = a.N, m.D = a.D, m.I = a.I, m.top_k = a.top_k, m.num_experts = E;
  m.x = a.x, m.x_lo = a.x_lo, m.idx = a.idx, m.w = a.w;
  m.act = a.act, m.situ_beta = a.situ_beta, m.situ_linear_beta = a.situ_linear_beta;
  m.out = a.out, m.out_f32 = a.out_f32, m.experts_hit = a.experts_hit;
  if (wgmma) {  // the grouped wgmma experts, each stage's weights dequantized on chip
    m.q1 = a.w1, m.s1 = a.s1, m.q3 = a.w3, m.s3 = a.s3, m.q2 = a.w2, m.s2 = a.s2;
    return MoeExperts(m, MoeGemm::kWgmma, *b.moe, stream);
  }
  cudaError_t e;
  if (dequant) {  // the counts say which experts to dequantize; MoeExperts permutes again for its tiles
    if ((e = MoePermute(P, a.idx, E, b.counts, b.offsets, b.slot_pair, b.pair_slot, stream)) != cudaSuccess) return e;
    const bf16* const* w1 = b.wptr;
    const bf16* const* w3 = b.wptr + b.E;
    const bf16* const* w2 = b.wptr + 2 * b.E;
    if ((e = Dequantize(a.w1, a.s1, a.I, a.D, E, b.counts, w1, stream)) != cudaSuccess) return e;
    if ((e = Dequantize(a.w3, a.s3, a.I, a.D, E, b.counts, w3, stream)) != cudaSuccess) return e;
    if ((e = Dequantize(a.w2, a.s2, a.D, a.I, E, b.counts, w2, stream)) != cudaSuccess) return e;
    m.w1 = w1, m.w3 = w3, m.w2 = w2;
    return MoeExperts(m, split ? MoeGemm::kTiled : MoeGemm::kAuto, *b.moe, stream);
  }
  e = MoePermuteTiles(P, a.idx, E, b.counts, b.offsets, b.slot_pair, b.pair_slot, kPassTokens, kWidePassTokens,
                      b.passes, b.num_passes, a.experts_hit, stream);
  if (e != cudaSuccess) return e;
  KernelArgs k;
  k.offsets = b.offsets, k.slot_pair = b.slot_pair, k.passes = b.passes, k.num_passes = b.num_passes;
  k.top_k = static_cast<int>(a.top_k);
  k.act = a.act, k.b1 = a.situ_beta, k.b2 = a.situ_linear_beta;
  const int64_t h_lo = split ? b.max_pairs * b.I : 0, y_lo = split ? b.max_pairs * b.D : 0;
  k.rows = a.I, k.K = a.D, k.wa = a.w1, k.sa = a.s1, k.wb = a.w3, k.sb = a.s3;
  k.x = a.x, k.x_lo = a.x_lo, k.out = b.h, k.out_lo = h_lo;
  e = split ? Launch<true, true>(k, P, E, stream) : Launch<true, false>(k, P, E, stream);
  if (e != cudaSuccess) return e;
  k.rows = a.D, k.K = a.I, k.wa = a.w2, k.sa = a.s2, k.wb = k.sb = nullptr;
  k.x = b.h, k.x_lo = h_lo, k.out = b.y, k.out_lo = y_lo, k.early = true;
  e = split ? Launch<false, true>(k, P, E, stream) : Launch<false, false>(k, P, E, stream);
  if (e != cudaSuccess) return e;
  return MoeCombine(a.N, a.D, a.top_k, b.pair_slot, a.w, b.y, y_lo, split ? nullptr : a.out,
                    split ? a.out_f32 : nullptr, stream);
}

}  // namespace k3::cuda
