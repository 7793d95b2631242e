// y = x · Wᵀ (see linear.cuh). One CTA: 4 warps × 16 weight rows (a GLU CTA: 32 gate rows and the 32 matching
// up rows), one group, passes of up to 64 tokens (16 for small grids, Launch).
//
// Operand layout. Each thread loads 16 consecutive k of its two weight rows (gid, gid + 8) per 64-wide k-block
// (two 16-byte cp.async per row), and 16 consecutive k of its token (gid) from x. A dot product does not care
// in which order k is summed, so the MMA's logical k is mapped onto those physical runs — the same map for the
// A (weights) and B (tokens) fragments: logical (2·tig + c, 2·tig + 8 + c) of MMA step s ↔ physical
// 16·tig + 4s + (c, 2 + c). Weights then arrive with 16-byte loads and no shuffles or ldmatrix.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/ptx.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRowsPerCta = 64;
constexpr int kTokens = 64;  // tokens per pass: 8 n-tiles of 8 (16 when the grid would be small, below)
constexpr int kStages = 6;   // weight k-blocks in flight per thread
constexpr int kKBlock = 64;
constexpr int kStagePitch = kTokens + 1;  // GLU staging row pitch (floats), for passes of up to kTokens
constexpr size_t kPipeBytes = size_t{kStages} * 4 * kThreads * 16;
static_assert(2 * 32 * kStagePitch * sizeof(float) <= kPipeBytes, "the GLU staging reuses the weight ring");

__device__ __forceinline__ void Load16(uint32_t* dst, const __nv_bfloat16* p) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
}

__device__ __forceinline__ uint2 Load8(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }

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

template <bool kSplitX, int kPass>
__global__ __launch_bounds__(kThreads, 4) void LinearKernel(const LinearArgs a) {
  PdlEnter();
  constexpr int kNTiles = kPass / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [kStages][4][kThreads]: conflict-free 16-byte slots
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
  const int64_t g = blockIdx.y, count = a.M;

  const bool glu = a.glu;
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

  for (int64_t base = int64_t{blockIdx.z} * kPass; base < count; base += int64_t{gridDim.z} * kPass) {
    const int T = static_cast<int>(min(int64_t{kPass}, count - base));
    const int nt = (T + 7) / 8;
    const __nv_bfloat16* xr[kNTiles];  // this thread's B row (token base + 8j + gid) per n-tile
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const int64_t i = base + 8 * j + gid;
      xr[j] = nullptr;
      if (i < count) xr[j] = X + i * a.x.ld;
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
          if (j < nt && lr < left && i < count) Store(a, g, i, wrow + lr, acc[j][e]);
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
      const float h = Glu(a.act, gate[lr * kStagePitch + t], gate[(32 + lr) * kStagePitch + t], a.situ_beta,
                          a.situ_linear_beta);
      const int64_t i = base + t;
      Store(a, g, i, col, h);
    }
    __syncthreads();  // the next pass refills the ring
  }
}

template <bool kSplitX, int kPass>
cudaError_t LaunchPass(const LinearArgs& a, dim3 grid, cudaStream_t stream) {
  static const cudaError_t attr = cudaFuncSetAttribute(
      LinearKernel<kSplitX, kPass>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kPipeBytes));
  if (attr != cudaSuccess) return attr;
  grid.z = static_cast<unsigned>(std::min<int64_t>((a.M + kPass - 1) / kPass, 65535));
  K3_CUDA_TRY(LaunchKernel(LinearKernel<kSplitX, kPass>, grid, kThreads, kPipeBytes, stream, a));
  return cudaGetLastError();
}

// Passes of 64 tokens; of 16 when that grid would not give every SM two CTAs (MLA's per-head products at a
// decode batch: 64 CTAs of 8 k-blocks each were bound by the latency of their token loads). A token's sums do
// not depend on its pass (same k order, its own accumulators), so the choice keeps rows batch invariant.
template <bool kSplitX>
cudaError_t Launch(const LinearArgs& a, cudaStream_t stream) {
  const bool glu = a.glu;
  const int64_t tiles = glu ? (a.N / 2 + 31) / 32 : (a.N + kRowsPerCta - 1) / kRowsPerCta;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.groups), 1);
  const int64_t ctas = tiles * a.groups * ((a.M + kTokens - 1) / kTokens);
  int sms = 0;
  K3_CUDA_TRY(SmCount(&sms));
  return ctas < 2 * sms ? LaunchPass<kSplitX, 16>(a, grid, stream) : LaunchPass<kSplitX, kTokens>(a, grid, stream);
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// with_y: the output is written (all but LinearBlas::RunUnfolded).
cudaError_t Check(const LinearArgs& a, bool with_y = true) {
  const bool glu = a.glu;
  if (a.N <= 0 || a.K <= 0 || a.K % 16 != 0 || a.w == nullptr || a.x.p == nullptr || (with_y && !a.y) ||
      a.groups < 1 || a.groups > 65535 || (glu && a.N % 2 != 0) || a.M < 0)
    return cudaErrorInvalidValue;
  // 16-byte operand loads: every row and group of x and W must start on 16 bytes.
  if (!Aligned(a.w, 16) || a.w_group_stride % 8 != 0 || !Aligned(a.x.p, 16) || a.x.ld % 8 != 0 ||
      a.x.lo % 8 != 0 || a.x_group_stride % 8 != 0 || (with_y && a.out == LinearOut::kSplit && a.y_lo == 0))
    return cudaErrorMisalignedAddress;
  return cudaSuccess;
}

// ------------------------------------------------------------------------------------------- cuBLASLt path

constexpr int64_t kRefRows = 128;  // the stacked rows the algorithm is chosen for (64 split tokens)
constexpr size_t kLtWorkspace = size_t{32} << 20;
constexpr int kTuneCandidates = 16;  // asked of the heuristic
constexpr int kMaxCandidates = 96;   // with their split-K variants
constexpr int kTimedReps = 3;
constexpr float kCloseness = 1.08f;  // candidates this near the best are timed again
constexpr int kMaxClose = 6;
constexpr int kRounds = 4;
constexpr int kWarmMemsets = 200;  // ≈ 5 ms of a busy GPU before the first timing

int64_t Ldc(int64_t N) { return (N + 7) / 8 * 8; }  // 32-byte rows of C
size_t Align256(size_t b) { return (b + 255) / 256 * 256; }

// y[group, row, col0 .. col0 + 3] in a's output mode (the four on 16 bytes (fp32) or 8 (bf16)).
__device__ __forceinline__ void Store4(const LinearArgs& a, int64_t group, int64_t row, int64_t col0,
                                       const float (&v)[4]) {
  const int64_t off = group * a.y_group_stride + row * a.ldy + col0;
  if (a.out == LinearOut::kF32 || a.out == LinearOut::kF32Add) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(a.y) + off);
    float4 o = make_float4(v[0], v[1], v[2], v[3]);
    if (a.out == LinearOut::kF32Add) {
      const float4 y = *p;
      o.x += y.x, o.y += y.y, o.z += y.z, o.w += y.w;
    }
    *p = o;
    return;
  }
  StoreSplit4(static_cast<__nv_bfloat16*>(a.y) + off, a.out == LinearOut::kSplit ? a.y_lo : 0, v);
}

constexpr int kFoldCols = 4;

constexpr int kFoldThreads = 256;

// y rows [r0, r0 + rows) from C: hi rows at C, lo rows `lo_rows` rows further (0: none); group g's C is
// c_group_stride further; K slices' sums (parts) part_stride apart, added in order as Sums::At adds them. A thread
// takes four columns (16-byte loads of C when the columns allow). Block: (columns, rows) threads; grid: (column
// blocks, row blocks, groups). At most 48 registers: five blocks an SM.
__global__ __launch_bounds__(kFoldThreads, 5) void FoldKernel(const LinearArgs a, const float* C, int64_t ldc, int64_t r0,
                                                          int64_t rows, int64_t lo_rows, int64_t c_group_stride,
                                                          int64_t parts, int64_t part_stride) {
  PdlEnter();
  const int64_t group = blockIdx.z;
  C += group * c_group_stride;
  const bool glu = a.glu;
  const int64_t cols = glu ? a.N / 2 : a.N, col0 = kFoldCols * (blockIdx.x * int64_t{blockDim.x} + threadIdx.x);
  const int64_t row_step = int64_t{gridDim.y} * blockDim.y;
  if (col0 >= cols) return;
  // float4 loads need every row, the lo plane and the up half on 16 bytes (LinearBlas's ldc is a multiple of 8;
  // Fold's sums may start anywhere); 4-column stores need y's rows and planes on 16 bytes (fp32) or 8 (bf16).
  const bool vec = col0 + kFoldCols <= cols && (!glu || cols % 4 == 0) && ldc % 4 == 0 && part_stride % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(C) % 16 == 0;
  const bool store4 = a.ldy % 4 == 0 && a.y_lo % 4 == 0 && a.y_group_stride % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
  const Sums sums{C, ldc, lo_rows, parts, part_stride};
  for (int64_t i = blockIdx.y * int64_t{blockDim.y} + threadIdx.y; i < rows; i += row_step) {
    // The parts added in order, as Sums::At adds them; the gate's and the up half's loads together. (Sums::At per
    // column in the scalar path, a loop in a loop, took the kernel to 128 registers: two blocks an SM, and every
    // fold twice as long.)
    float g[kFoldCols], u[kFoldCols] = {};
    for (int64_t k = 0; k < parts; ++k) {
      float tg[kFoldCols], tu[kFoldCols] = {};
      if (vec) {
        const float4 pg = sums.Part4(k, i, col0), pu = glu ? sums.Part4(k, i, col0 + a.N / 2) : float4{};
        tg[0] = pg.x, tg[1] = pg.y, tg[2] = pg.z, tg[3] = pg.w, tu[0] = pu.x, tu[1] = pu.y, tu[2] = pu.z, tu[3] = pu.w;
      } else {
#pragma unroll
        for (int q = 0; q < kFoldCols; ++q) {
          tg[q] = col0 + q < cols ? sums.Part(k, i, col0 + q) : 0.0f;
          if (glu) tu[q] = col0 + q < cols ? sums.Part(k, i, col0 + a.N / 2 + q) : 0.0f;
        }
      }
#pragma unroll
      for (int q = 0; q < kFoldCols; ++q) g[q] = k == 0 ? tg[q] : g[q] + tg[q], u[q] = k == 0 ? tu[q] : u[q] + tu[q];
    }
    if (glu) {
#pragma unroll
      for (int q = 0; q < kFoldCols; ++q) g[q] = Glu(a.act, g[q], u[q], a.situ_beta, a.situ_linear_beta);
    }
    if (vec && store4) {
      Store4(a, group, r0 + i, col0, g);
    } else {
      for (int q = 0; q < kFoldCols; ++q)
        if (col0 + q < cols) Store(a, group, r0 + i, col0 + q, g[q]);
    }
  }
}

// A block of kFoldThreads over (columns, rows): as many threads across as a row's columns need (a warp at least),
// the rest over rows. A block a row left most of its threads idle on narrow products (MLA's per-head ones: 128 or
// 512 columns in 32 groups of 64 rows made 2048 blocks of 256 threads for 32 or 128 columns each).
cudaError_t LaunchFold(const LinearArgs& a, const float* C, int64_t ldc, int64_t r0, int64_t rows, int64_t lo_rows,
                       int64_t c_group_stride, int64_t parts, int64_t part_stride, cudaStream_t stream) {
  const int64_t cols = a.glu ? a.N / 2 : a.N, threads_x = (cols + kFoldCols - 1) / kFoldCols;
  const int tx = static_cast<int>(std::min<int64_t>(kFoldThreads, (threads_x + 31) / 32 * 32)),
            ty = static_cast<int>(std::min<int64_t>(kFoldThreads / tx, rows));
  const dim3 block(tx, ty);
  const dim3 grid(static_cast<unsigned>((threads_x + tx - 1) / tx),
                  static_cast<unsigned>(std::min<int64_t>((rows + ty - 1) / ty, 65535)), static_cast<unsigned>(a.groups));
  K3_CUDA_TRY(LaunchKernel(FoldKernel, grid, block, 0, stream, a, C, ldc, r0, rows, lo_rows, c_group_stride, parts,
                           part_stride));
  return cudaGetLastError();
}

cudaError_t Lt(cublasStatus_t st) { return st == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown; }

}  // namespace

cudaError_t Linear(const LinearArgs& a, cudaStream_t stream) {
  K3_CUDA_TRY(Check(a));
  if (a.M == 0) return cudaSuccess;
  return a.x.lo != 0 ? Launch<true>(a, stream) : Launch<false>(a, stream);
}

struct LinearBlas::State {
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  void* ws = nullptr;  // stacked x, then C
  size_t ws_bytes = 0;
  void* lt_ws = nullptr;

  ~State() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (lt) cublasLtDestroy(lt);
    cudaFree(ws);
    cudaFree(lt_ws);
  }

  // Layouts (column-major): W as K × N (transposed by the op), X as K × n, C as N × n.
  struct Layouts {
    cublasLtMatrixLayout_t w = nullptr, x = nullptr, c = nullptr;
    ~Layouts() {
      if (w) cublasLtMatrixLayoutDestroy(w);
      if (x) cublasLtMatrixLayoutDestroy(x);
      if (c) cublasLtMatrixLayoutDestroy(c);
    }
    // groups > 1: a strided batch (weights w_gs elements apart, x columns x_gs apart, C n · Ldc(N) apart); a
    // weight row is ldw elements long (K, or more for K slices).
    cudaError_t Make(int64_t N, int64_t K, int64_t n, int64_t ldx, int32_t groups, int64_t w_gs, int64_t x_gs,
                     int64_t ldw) {
      K3_CUDA_TRY(Lt(cublasLtMatrixLayoutCreate(&w, CUDA_R_16BF, K, N, ldw)));
      K3_CUDA_TRY(Lt(cublasLtMatrixLayoutCreate(&x, CUDA_R_16BF, K, n, ldx)));
      K3_CUDA_TRY(Lt(cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, N, n, Ldc(N))));
      if (groups == 1) return cudaSuccess;
      const int64_t c_gs = n * Ldc(N);
      for (const auto& [layout, stride] : {std::pair{w, w_gs}, std::pair{x, x_gs}, std::pair{c, c_gs}}) {
        K3_CUDA_TRY(Lt(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &groups,
                                                        sizeof(groups))));
        K3_CUDA_TRY(Lt(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                        sizeof(stride))));
      }
      return cudaSuccess;
    }
  };

  // A product's shape as the algorithm choice sees it: groups > 1 is a strided batch of them (or of K slices:
  // K the slice, ldw the whole).
  struct Shape {
    int64_t N, K, ldx, groups, w_gs, x_gs, ldw;
    auto Key() const { return std::make_tuple(N, K, ldx, groups, w_gs, x_gs, ldw); }
    size_t XElems(int64_t n) const { return size_t((groups - 1) * x_gs + n * ldx); }  // of n stacked rows
    size_t CElems(int64_t n) const { return size_t(groups * n * Ldc(N)); }
    cudaError_t Make(Layouts* l, int64_t n) const {
      return l->Make(N, K, n, ldx, static_cast<int32_t>(groups), w_gs, x_gs, ldw);
    }
    // The product of a, or its K in `parts` slices (one strided batch), over x with row stride ldx.
    static Shape Of(const LinearArgs& a, int64_t ldx, int64_t parts) {
      if (parts > 1) return {a.N, a.K / parts, ldx, parts, a.K / parts, a.K / parts, a.K};
      return {a.N, a.K, ldx, a.groups, a.w_group_stride, a.x_group_stride, a.K};
    }
  };
  struct Choice {
    cublasLtMatmulAlgo_t algo;
    float us = 0.0f;  // its time for kRefRows rows; 0: not timed
  };
  // The choices, made once per process and device for every LinearBlas: two models, or two streams, that run a
  // shape run it alike, so their rows agree bit for bit.
  struct Tuned {
    std::recursive_mutex mu;  // AutoParts holds it across Chosen
    std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>, Choice> algos;
    std::map<std::tuple<int, int64_t, int64_t>, int64_t> k_parts;  // for k_parts = 0, by (device, N, K)
  };
  static Tuned& Cache() {
    static Tuned* t = new Tuned;  // never destroyed: LinearBlas objects may outlive static destruction order
    return *t;
  }
  static int Device() {
    int d = 0;
    return cudaGetDevice(&d) == cudaSuccess ? d : 0;
  }

  cublasStatus_t Matmul(const __nv_bfloat16* w, const Layouts& l, const void* x, float* C,
                        const cublasLtMatmulAlgo_t* algo, cudaStream_t stream) {
    const float one = 1.0f, zero = 0.0f;
    return cublasLtMatmul(lt, desc, &one, w, l.w, x, l.x, &zero, C, l.c, C, l.c, algo, lt_ws, kLtWorkspace, stream);
  }

  struct Candidates {
    cublasLtMatmulAlgo_t a[kMaxCandidates];
    int n = 0;
  };

  // Up to `want` candidates for these layouts, cuBLASLt's first choice first.
  cudaError_t Heuristic(const Layouts& l, int want, Candidates* algos) {
    cublasLtMatmulPreference_t pref = nullptr;
    K3_CUDA_TRY(Lt(cublasLtMatmulPreferenceCreate(&pref)));
    cublasLtMatmulHeuristicResult_t r[kTuneCandidates] = {};
    want = std::min(want, kTuneCandidates);
    int found = 0;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                             &kLtWorkspace, sizeof(kLtWorkspace));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(lt, desc, l.w, l.x, l.c, l.c, pref, want, r, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    K3_CUDA_TRY(Lt(st));
    if (found == 0) return cudaErrorNotSupported;
    algos->n = 0;
    for (int i = 0; i < found; ++i) algos->a[algos->n++] = r[i].algo;
    if (want > 1)
      for (int i = 0; i < found; ++i) AddSplitK(l, r[i].algo, algos);
    return cudaSuccess;
  }

  // Split-K variants of a candidate (the heuristic rarely offers them for 128 stacked rows, where a 64 × 64
  // tile grid covers half the SMs of an H200 for N = 2304). Both reduction schemes used are deterministic.
  void AddSplitK(const Layouts& l, const cublasLtMatmulAlgo_t& base, Candidates* algos) {
    int32_t supported = 0;
    uint32_t schemes = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &supported, sizeof(supported),
                                          &written) != CUBLAS_STATUS_SUCCESS ||
        supported == 0 ||
        cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &schemes,
                                          sizeof(schemes), &written) != CUBLAS_STATUS_SUCCESS)
      return;
    const uint32_t scheme = schemes & CUBLASLT_REDUCTION_SCHEME_INPLACE         ? CUBLASLT_REDUCTION_SCHEME_INPLACE
                            : schemes & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                                                                                : 0;
    if (scheme == 0) return;
    for (int32_t splits : {2, 3, 4, 6, 8, 16}) {
      if (algos->n == kMaxCandidates) return;
      cublasLtMatmulAlgo_t a = base;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits)) ==
              CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme)) ==
              CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoCheck(lt, desc, l.w, l.x, l.c, l.c, &a, &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= kLtWorkspace)
        algos->a[algos->n++] = a;
    }
  }

  // The fastest of the candidates for kRefRows rows of the shape with weight w, timed on the stream: cuBLASLt's
  // first choice for these skinny products is often not its fastest (the MLA query product: 25 µs against 17 on
  // an H200). Each candidate is timed kTimedReps times; those within kCloseness of the best are timed again in
  // kRounds interleaved rounds and scored by their best round, the earlier candidate kept on a tie: one pass left
  // the pick to a few tenths of a µs of noise, and it changed from one process to the next. The GPU is kept busy
  // for a few ms first, so that the first shape is not timed at idle clocks. Scratch x and C are allocated for the
  // timing and freed.
  cudaError_t Fastest(const Shape& sh, const __nv_bfloat16* w, const Layouts& ref, const Candidates& cands,
                      cudaStream_t stream, bool verbose, Choice* best) {
    best->algo = cands.a[0];
    if (cands.n == 1) return cudaSuccess;
    void* x = nullptr;
    float* C = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    cudaError_t err = cudaMalloc(&x, sh.XElems(kRefRows) * 2);
    if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&C), sh.CElems(kRefRows) * 4);
    if (err == cudaSuccess) err = cudaMemsetAsync(x, 0x3c, sh.XElems(kRefRows) * 2, stream);  // ≈ 0.011 each
    int device = 0, l2 = 0;
    if (err == cudaSuccess) err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    const size_t flush_bytes = size_t(2) * l2;
    void* flush = nullptr;
    if (err == cudaSuccess) err = cudaMalloc(&flush, flush_bytes);
    if (err == cudaSuccess) err = cudaEventCreate(&e0);
    if (err == cudaSuccess) err = cudaEventCreate(&e1);
    static bool warm = false;  // under Tuned's lock
    for (int i = 0; i < kWarmMemsets && !warm && err == cudaSuccess; ++i)
      err = cudaMemsetAsync(flush, i, flush_bytes, stream);
    warm = true;
    // kTimedReps runs of candidate i with the weight out of L2 (as in a decode step, where it streams from memory:
    // the flush buffer is written between them), in ms.
    auto time = [&](int i) -> float {
      const cublasLtMatmulAlgo_t* cand = &cands.a[i];
      float ms = 0.0f;
      for (int r = 0; r < kTimedReps && err == cudaSuccess; ++r) {
        err = cudaMemsetAsync(flush, r, flush_bytes, stream);
        if (err == cudaSuccess) err = cudaEventRecord(e0, stream);
        if (err == cudaSuccess) err = Lt(Matmul(w, ref, x, C, cand, stream));
        if (err == cudaSuccess) err = cudaEventRecord(e1, stream);
        if (err == cudaSuccess) err = cudaEventSynchronize(e1);
        float t = 0.0f;
        if (err == cudaSuccess) err = cudaEventElapsedTime(&t, e0, e1);
        ms += t;
      }
      return ms;
    };
    float screened[kMaxCandidates], first_ms = 0.0f, best_ms = 0.0f;
    for (int i = 0; i < cands.n && err == cudaSuccess; ++i) {
      screened[i] = -1.0f;
      if (Matmul(w, ref, x, C, &cands.a[i], stream) != CUBLAS_STATUS_SUCCESS) continue;  // one this problem cannot run
      screened[i] = time(i);
      if (i == 0) first_ms = screened[i];
      if (screened[i] > 0.0f && (best_ms == 0.0f || screened[i] < best_ms)) best_ms = screened[i];
    }
    int close[kMaxClose], n_close = 0;
    for (int i = 0; i < cands.n && n_close < kMaxClose; ++i)
      if (screened[i] > 0.0f && screened[i] <= kCloseness * best_ms) close[n_close++] = i;
    float score[kMaxClose];
    for (int j = 0; j < n_close; ++j) score[j] = screened[close[j]];
    for (int round = 0; round < kRounds && n_close > 1 && err == cudaSuccess; ++round)
      for (int j = 0; j < n_close && err == cudaSuccess; ++j) score[j] = std::min(score[j], time(close[j]));
    int best_i = -1;
    for (int j = 0; j < n_close; ++j)
      if (best_i < 0 || score[j] < score[best_i]) best_i = j;
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaFree(flush);
    cudaFree(x);
    cudaFree(C);
    if (err == cudaSuccess && best_i >= 0) best->algo = cands.a[close[best_i]], best->us = 1e3f * score[best_i] / kTimedReps;
    if (verbose && err == cudaSuccess && best_i >= 0)
      std::fprintf(stderr,
                   "LinearBlas: N %ld K %ld ldx %ld groups %ld: candidate %d of %d (%d close), %.1f us (first choice "
                   "%.1f us)\n",
                   static_cast<long>(sh.N), static_cast<long>(sh.K), static_cast<long>(sh.ldx),
                   static_cast<long>(sh.groups), close[best_i], cands.n, n_close, best->us,
                   1e3f * first_ms / kTimedReps);
    return err;
  }

  // The algorithm of a shape: chosen once for kRefRows rows and kept for every row count — the fastest
  // candidate on this GPU, or cuBLASLt's first choice with K3SERVE_BLAS_TUNE=0 or while the stream is being
  // captured into a graph (nothing can be timed then).
  static const std::string& TuneMode() {
    static const std::string mode = [] {
      const char* e = std::getenv("K3SERVE_BLAS_TUNE");
      return std::string(e ? e : "1");
    }();
    return mode;
  }
  static bool Tuning(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    return TuneMode() != "0" && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
           capture == cudaStreamCaptureStatusNone;
  }

  // The choice for the shape, made at its first use.
  cudaError_t Chosen(const Shape& sh, const __nv_bfloat16* w, cudaStream_t stream, const Choice** choice) {
    Tuned& t = Cache();
    std::lock_guard<std::recursive_mutex> lock(t.mu);
    const auto key = std::tuple_cat(std::make_tuple(Device()), sh.Key());
    auto it = t.algos.find(key);
    if (it == t.algos.end()) {
      Layouts ref;
      K3_CUDA_TRY(sh.Make(&ref, kRefRows));
      Candidates cands;
      K3_CUDA_TRY(Heuristic(ref, Tuning(stream) ? kTuneCandidates : 1, &cands));
      Choice c;
      K3_CUDA_TRY(Fastest(sh, w, ref, cands, stream, TuneMode() == "verbose", &c));
      it = t.algos.emplace(key, c).first;
    }
    *choice = &it->second;  // std::map nodes stay put
    return cudaSuccess;
  }

  cudaError_t Algo(const Shape& sh, const __nv_bfloat16* w, const Layouts& l, cudaStream_t stream,
                   cublasLtMatmulAlgo_t* algo) {
    const Choice* c = nullptr;
    K3_CUDA_TRY(Chosen(sh, w, stream, &c));
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(lt, desc, l.w, l.x, l.c, l.c, &c->algo, &check) == CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= kLtWorkspace) {
      *algo = c->algo;
      return cudaSuccess;
    }
    Candidates first;  // this row count needs another kernel (not met at the engine's shapes)
    K3_CUDA_TRY(Heuristic(l, 1, &first));
    *algo = first.a[0];
    return cudaSuccess;
  }

  // k_parts = 0: the fastest slice count for (N, K), each count with its fastest algorithm, timed for kRefRows
  // stacked rows at the first use; more slices only when 5% and 1 µs faster (their consumers read more sums, and
  // a small product's timings are noise: a choice that flipped with them would flip its model's rounding from one
  // process to the next); 1 when nothing can be timed (a graph capture, K3SERVE_BLAS_TUNE=0).
  cudaError_t AutoParts(const LinearArgs& a, cudaStream_t stream, int64_t* parts) {
    static const int64_t forced = [] {
      const char* e = std::getenv("K3SERVE_BLAS_PARTS");
      return e ? std::atoll(e) : int64_t{0};
    }();
    if (forced > 0) {
      *parts = PartsFit(a.K, forced) ? forced : 1;
      return cudaSuccess;
    }
    Tuned& t = Cache();
    std::lock_guard<std::recursive_mutex> lock(t.mu);
    const auto key = std::make_tuple(Device(), a.N, a.K);
    auto it = t.k_parts.find(key);
    if (it == t.k_parts.end()) {
      int64_t best = 1;
      float best_us = 0.0f, whole_us = 0.0f;
      if (Tuning(stream)) {
        for (int64_t p = 1; p <= kMaxSumParts; ++p) {
          if (!PartsFit(a.K, p)) continue;
          const Choice* c = nullptr;
          K3_CUDA_TRY(Chosen(Shape::Of(a, a.K, p), a.w, stream, &c));
          if (p == 1) whole_us = c->us;
          if (c->us > 0.0f && (best_us == 0.0f || c->us < std::min(0.95f * best_us, best_us - 1.0f)))
            best = p, best_us = c->us;
        }
        if (TuneMode() == "verbose")
          std::fprintf(stderr, "LinearBlas: N %ld K %ld: K in %ld slices, %.1f us (whole K %.1f us)\n",
                       static_cast<long>(a.N), static_cast<long>(a.K), static_cast<long>(best), best_us, whole_us);
      }
      it = t.k_parts.emplace(key, best).first;
    }
    *parts = it->second;
    return cudaSuccess;
  }
};

bool LinearBlas::PartsFit(int64_t K, int64_t parts) {
  return parts >= 1 && parts <= kMaxSumParts && K % parts == 0 && (K / parts) % 16 == 0;
}

LinearBlas::LinearBlas() : s_(std::make_unique<State>()) {}
LinearBlas::~LinearBlas() = default;

size_t LinearBlas::WorkspaceBytes(int64_t rows, int64_t N, int64_t K, int64_t groups) {
  return Align256(size_t(2 * rows * K) * 2) + Align256(size_t(groups * 2 * rows * Ldc(N)) * 4);
}

cudaError_t LinearBlas::Init(size_t bytes) {
  State& s = *s_;
  if (s.lt) return cudaErrorInvalidValue;  // once
  K3_CUDA_TRY(Lt(cublasLtCreate(&s.lt)));
  K3_CUDA_TRY(Lt(cublasLtMatmulDescCreate(&s.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)));
  const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
  K3_CUDA_TRY(Lt(cublasLtMatmulDescSetAttribute(s.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t))));
  K3_CUDA_TRY(Lt(cublasLtMatmulDescSetAttribute(s.desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n))));
  K3_CUDA_TRY(cudaMalloc(&s.lt_ws, kLtWorkspace));
  K3_CUDA_TRY(cudaMalloc(&s.ws, bytes));
  s.ws_bytes = bytes;
  return cudaSuccess;
}

int64_t LinearBlas::ChunkRows(const LinearArgs& a, int64_t parts) const {
  int64_t chunk = a.M;  // the stacked x and C (a plane per group or K slice) of a chunk fit the workspace
  while (chunk > 0 && WorkspaceBytes(chunk, a.N, a.K, std::max(a.groups, parts)) > s_->ws_bytes) chunk = chunk / 2;
  return chunk;
}

bool LinearBlas::Unfoldable(const LinearArgs& a) const {
  return !a.glu && a.groups == 1 && a.M > 0 && ChunkRows(a, a.k_parts > 0 ? a.k_parts : kMaxSumParts) == a.M;
}

cudaError_t LinearBlas::Run(const LinearArgs& a, cudaStream_t stream) { return Product(a, stream, nullptr); }

cudaError_t LinearBlas::Fold(const LinearArgs& a, Sums s, cudaStream_t stream) {
  if (a.N <= 0 || a.M < 0 || !a.y || !s.p || a.glu || a.groups != 1 || s.ld < a.N || s.lo_rows < 0 ||
      !s.PartsOk() || (a.out == LinearOut::kSplit && a.y_lo == 0))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  return LaunchFold(a, s.p, s.ld, 0, a.M, s.lo_rows, 0, s.parts, s.part_stride, stream);
}

cudaError_t LinearBlas::RunUnfolded(const LinearArgs& a, cudaStream_t stream, Sums* y) {
  if (!y || !Unfoldable(a)) return cudaErrorInvalidValue;
  return Product(a, stream, y);
}

cudaError_t LinearBlas::Product(const LinearArgs& a, cudaStream_t stream, Sums* unfolded) {
  State& s = *s_;
  K3_CUDA_TRY(Check(a, !unfolded));
  if (!s.lt || (unfolded && a.groups != 1)) return cudaErrorInvalidValue;
  if (a.k_parts < 0 || (a.k_parts != 1 && a.groups != 1) ||
      (a.k_parts > 1 && !PartsFit(a.K, a.k_parts)))
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  int64_t parts = a.k_parts;
  if (parts == 0) K3_CUDA_TRY(s.AutoParts(a, stream, &parts));
  const bool split = a.x.lo != 0;
  const int64_t planes = split ? 2 : 1, ldc = Ldc(a.N), chunk = ChunkRows(a, parts);
  if (chunk == 0) return cudaErrorMemoryAllocation;
  // x is used in place when its rows already form the GEMM operand: one chunk, and a split x whose lo plane
  // starts right after its M hi rows (the engine lays its planes out so); else the rows are copied (stacked).
  const bool in_place = chunk == a.M && (!split || a.x.lo == a.M * a.x.ld) && Aligned(a.x.p, 256) &&
                        (a.x.ld * 2) % 16 == 0;
  // Groups run as one strided batch over x in place (the per-head products of MLA): no chunks, no copies.
  if (a.groups > 1 && (!in_place || a.x_group_stride % 8 != 0 || a.w_group_stride % 8 != 0))
    return cudaErrorInvalidValue;
  for (int64_t r0 = 0; r0 < a.M; r0 += chunk) {
    const int64_t rows = std::min(chunk, a.M - r0), n = planes * rows;
    auto* C = reinterpret_cast<float*>(static_cast<char*>(s.ws) + Align256(size_t(2 * chunk * a.K) * 2));
    const __nv_bfloat16* x = a.x.p;
    int64_t ldx = a.x.ld;
    if (!in_place) {
      auto* xs = static_cast<__nv_bfloat16*>(s.ws);
      for (int64_t p = 0; p < planes; ++p)
        K3_CUDA_TRY(cudaMemcpy2DAsync(xs + p * rows * a.K, a.K * 2, a.x.p + r0 * a.x.ld + p * a.x.lo, a.x.ld * 2,
                                      a.K * 2, rows, cudaMemcpyDeviceToDevice, stream));
      x = xs, ldx = a.K;
    }
    const State::Shape shape = State::Shape::Of(a, ldx, parts);
    State::Layouts l;
    K3_CUDA_TRY(shape.Make(&l, n));
    cublasLtMatmulAlgo_t algo;
    K3_CUDA_TRY(s.Algo(shape, a.w, l, stream, &algo));
    K3_CUDA_TRY(Lt(s.Matmul(a.w, l, x, C, &algo, stream)));
    if (unfolded) {  // one chunk
      *unfolded = Sums{C, ldc, split ? rows : 0, parts, n * ldc};
      return cudaSuccess;
    }
    K3_CUDA_TRY(LaunchFold(a, C, ldc, r0, rows, split ? rows : 0, n * ldc, parts, n * ldc, stream));
  }
  return cudaSuccess;
}

}  // namespace k3::cuda
