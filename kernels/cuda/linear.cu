// y = x · Wᵀ (see linear.cuh). One CTA: 4 warps × 16 weight rows (a GLU CTA: 32 gate rows and the 32 matching
// up rows), one group, passes of up to 64 tokens.
//
// Operand layout. Each thread loads 16 consecutive k of its two weight rows (gid, gid + 8) per 64-wide k-block
// (two 16-byte cp.async per row), and 16 consecutive k of its token (gid) from x. A dot product does not care
// in which order k is summed, so the MMA's logical k is mapped onto those physical runs — the same map for the
// A (weights) and B (tokens) fragments: logical (2·tig + c, 2·tig + 8 + c) of MMA step s ↔ physical
// 16·tig + 4s + (c, 2 + c). Weights then arrive with 16-byte loads and no shuffles or ldmatrix.
#include <algorithm>

#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/ptx.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRowsPerCta = 64;
constexpr int kTokens = 64;  // tokens per pass: 8 n-tiles of 8
constexpr int kNTiles = kTokens / 8;
constexpr int kStages = 6;   // weight k-blocks in flight per thread
constexpr int kKBlock = 64;
constexpr int kStagePitch = kTokens + 1;  // GLU staging row pitch (floats)
constexpr size_t kPipeBytes = size_t{kStages} * 4 * kThreads * 16;
static_assert(2 * 32 * kStagePitch * sizeof(float) <= kPipeBytes, "the GLU staging reuses the weight ring");

__device__ __forceinline__ void Load16(uint32_t* dst, const __nv_bfloat16* p) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
}

__device__ __forceinline__ uint2 Load8(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }

__device__ __forceinline__ float Act(LinearAct act, float g, float u, float b1, float b2) {
  const float sig = 1.0f / (1.0f + expf(-g));
  if (act == LinearAct::kSilu) return g * sig * u;
  return b1 * tanhf(g / b1) * sig * (b2 * tanhf(u / b2));
}

__device__ __forceinline__ void Store(const LinearArgs& a, int64_t group, int64_t row, int64_t col, float v) {
  const int64_t off = group * a.y_group_stride + row * a.ldy + col;
  switch (a.out) {
    case LinearOut::kF32:
      static_cast<float*>(a.y)[off] = v;
      break;
    case LinearOut::kF32Add:
      static_cast<float*>(a.y)[off] += v;
      break;
    case LinearOut::kBf16:
      static_cast<__nv_bfloat16*>(a.y)[off] = __float2bfloat16_rn(v);
      break;
    case LinearOut::kSplit:
      StoreSplit(static_cast<__nv_bfloat16*>(a.y) + off, a.y_lo, v);
      break;
  }
}

template <bool kSplitX>
__global__ __launch_bounds__(kThreads, 4) void LinearKernel(const LinearArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [kStages][4][kThreads]: conflict-free 16-byte slots
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int64_t g = blockIdx.y;
  int64_t r0 = 0, count = a.M;
  if (a.offsets != nullptr) {
    r0 = a.offsets[g];
    count = a.offsets[g + 1] - r0;
  }
  if (count <= 0) return;

  const bool glu = a.act != LinearAct::kNone;
  int64_t wrow, left;  // the warp's first weight row; its local rows < left exist
  if (glu) {
    const int64_t half = a.N / 2, local = int64_t{blockIdx.x} * 32 + (warp & 1) * 16;
    wrow = (warp < 2 ? 0 : half) + local;
    left = half - local;
  } else {
    wrow = int64_t{blockIdx.x} * kRowsPerCta + warp * 16;
    left = a.N - wrow;
  }
  const bool okA = gid < left, okB = gid + 8 < left;
  const __nv_bfloat16* W = a.w + g * a.w_group_stride;
  const __nv_bfloat16* rowA = W + (okA ? wrow + gid : 0) * a.K;  // a missing row reads row 0, zero-filled
  const __nv_bfloat16* rowB = W + (okB ? wrow + gid + 8 : 0) * a.K;
  const int nA = okA ? 16 : 0, nB = okB ? 16 : 0;
  const __nv_bfloat16* X = a.x.p + g * a.x_group_stride;
  const int64_t nkb = a.K / kKBlock;
  const int tail = static_cast<int>(a.K % kKBlock) / 16;

  for (int64_t base = int64_t{blockIdx.z} * kTokens; base < count; base += int64_t{gridDim.z} * kTokens) {
    const int T = static_cast<int>(min(int64_t{kTokens}, count - base));
    const int nt = (T + 7) / 8;
    const __nv_bfloat16* xr[kNTiles];  // this thread's B row (token base + 8j + gid) per n-tile
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int64_t i = base + 8 * j + gid;
      xr[j] = nullptr;
      if (i < count) xr[j] = X + ((a.rows ? a.rows[r0 + i] : i) / a.x_row_div) * a.x.ld;
    }
    float acc[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    auto issue = [&](int64_t kb) {
      uint4* s = ring + (kb % kStages) * 4 * kThreads + tid;
      const int64_t k = kb * kKBlock + 16 * tig;
      ptx::CpAsync16(s, rowA + k, nA);
      ptx::CpAsync16(s + kThreads, rowA + k + 8, nA);
      ptx::CpAsync16(s + 2 * kThreads, rowB + k, nB);
      ptx::CpAsync16(s + 3 * kThreads, rowB + k + 8, nB);
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < nkb) issue(s);
      ptx::CpAsyncCommit();
    }
    for (int64_t kb = 0; kb < nkb; ++kb) {
      if (kb + kStages - 1 < nkb) issue(kb + kStages - 1);
      ptx::CpAsyncCommit();
      ptx::CpAsyncWaitGroup<kStages - 1>();
      const uint4* s = ring + (kb % kStages) * 4 * kThreads + tid;
      const uint4 a0 = s[0], a1 = s[kThreads], b0 = s[2 * kThreads], b1 = s[3 * kThreads];
      const uint32_t A[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const uint32_t B[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
      const int64_t k = kb * kKBlock + 16 * tig;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        if (j < nt) {
          uint32_t xh[8] = {}, xl[8] = {};
          if (xr[j] != nullptr) {
            Load16(xh, xr[j] + k);
            Load16(xh + 4, xr[j] + k + 8);
            if (kSplitX) {
              Load16(xl, xr[j] + a.x.lo + k);
              Load16(xl + 4, xr[j] + a.x.lo + k + 8);
            }
          }
#pragma unroll
          for (int st = 0; st < 4; ++st) {
            const uint32_t fa[4] = {A[2 * st], B[2 * st], A[2 * st + 1], B[2 * st + 1]};
            ptx::Mma(acc[j], fa, xh[2 * st], xh[2 * st + 1]);
            if (kSplitX) ptx::Mma(acc[j], fa, xl[2 * st], xl[2 * st + 1]);
          }
        }
      }
    }
    // K % 64: 16-wide steps, thread tig holding physical k 4·tig .. 4·tig + 3.
    for (int kt = 0; kt < tail; ++kt) {
      const int64_t k = nkb * kKBlock + 16 * kt + 4 * tig;
      uint32_t fa[4] = {0, 0, 0, 0};
      if (okA) {
        const uint2 v = Load8(rowA + k);
        fa[0] = v.x, fa[2] = v.y;
      }
      if (okB) {
        const uint2 v = Load8(rowB + k);
        fa[1] = v.x, fa[3] = v.y;
      }
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        if (j < nt) {  // uniform across the warp: mma.sync needs every lane, missing tokens multiply zeros
          const uint2 h = xr[j] != nullptr ? Load8(xr[j] + k) : uint2{0, 0};
          ptx::Mma(acc[j], fa, h.x, h.y);
          if (kSplitX) {
            const uint2 l = xr[j] != nullptr ? Load8(xr[j] + a.x.lo + k) : uint2{0, 0};
            ptx::Mma(acc[j], fa, l.x, l.y);
          }
        }
      }
    }

    // Epilogue. C fragment: acc[j][e] = (row gid + 8·(e ≥ 2), token 8j + 2·tig + (e & 1)).
    if (!glu) {
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int lr = gid + (e >= 2 ? 8 : 0);
          const int64_t i = base + 8 * j + 2 * tig + (e & 1);
          if (j < nt && lr < left && i < count) Store(a, g, a.rows ? a.rows[r0 + i] : i, wrow + lr, acc[j][e]);
        }
      }
      continue;
    }
    __syncthreads();  // every thread is done with its ring slots: the staging may overwrite them
    float* gate = reinterpret_cast<float*>(smem);  // [32][kStagePitch], then up likewise
    float* mine = gate + (warp < 2 ? 0 : 32 * kStagePitch);
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int lr = (warp & 1) * 16 + gid + (e >= 2 ? 8 : 0);
        if (j < nt) mine[lr * kStagePitch + 8 * j + 2 * tig + (e & 1)] = acc[j][e];
      }
    }
    __syncthreads();
    const int64_t half = a.N / 2;
    for (int idx = tid; idx < 32 * T; idx += kThreads) {
      const int lr = idx % 32, t = idx / 32;
      const int64_t col = int64_t{blockIdx.x} * 32 + lr;
      if (col >= half) continue;
      const float h = Act(a.act, gate[lr * kStagePitch + t], gate[(32 + lr) * kStagePitch + t], a.situ_beta,
                          a.situ_linear_beta);
      const int64_t i = base + t;
      Store(a, g, a.rows ? a.rows[r0 + i] : i, col, h);
    }
    __syncthreads();  // the next pass refills the ring
  }
}

template <bool kSplitX>
cudaError_t Launch(const LinearArgs& a, cudaStream_t stream) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      LinearKernel<kSplitX>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kPipeBytes));
  if (attr != cudaSuccess) return attr;
  const bool glu = a.act != LinearAct::kNone;
  const int64_t tiles = glu ? (a.N / 2 + 31) / 32 : (a.N + kRowsPerCta - 1) / kRowsPerCta;
  const int64_t passes = a.offsets ? 1 : std::min<int64_t>((a.M + kTokens - 1) / kTokens, 65535);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.groups), static_cast<unsigned>(passes));
  LinearKernel<kSplitX><<<grid, kThreads, kPipeBytes, stream>>>(a);
  return cudaGetLastError();
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

cudaError_t Linear(const LinearArgs& a, cudaStream_t stream) {
  const bool glu = a.act != LinearAct::kNone;
  if (a.N <= 0 || a.K <= 0 || a.K % 16 != 0 || a.w == nullptr || a.x.p == nullptr || a.y == nullptr ||
      a.groups < 1 || a.groups > 65535 || a.x_row_div < 1 || (glu && a.N % 2 != 0) ||
      (a.offsets != nullptr) != (a.rows != nullptr) || a.M < 0)
    return cudaErrorInvalidValue;
  // 16-byte operand loads: every row and group of x and W must start on 16 bytes.
  if (!Aligned(a.w, 16) || a.w_group_stride % 8 != 0 || !Aligned(a.x.p, 16) || a.x.ld % 8 != 0 ||
      a.x.lo % 8 != 0 || a.x_group_stride % 8 != 0 || (a.out == LinearOut::kSplit && a.y_lo == 0))
    return cudaErrorMisalignedAddress;
  if (a.offsets == nullptr && a.M == 0) return cudaSuccess;
  return a.x.lo != 0 ? Launch<true>(a, stream) : Launch<false>(a, stream);
}

}  // namespace k3::cuda
