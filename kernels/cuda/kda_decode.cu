// KDA decode: one step of the recurrence for each of N sequences, in place on the state pool.
// Reference: k3::cpu::KdaRecurrent with T = 1 (after KdaGate*, KdaNormalizeQK and β = sigmoid(b)).
//
// The step is bound by the state: S is read once and written once (2·D²·4 bytes per head), everything
// else is O(D). With the decayed state S' = Diag(e^g) S,
//   u = β (v − S'ᵀk),   S ← S' + k uᵀ,   o = Sᵀq = S'ᵀq + u (k·q),
// so both reductions over the key dim happen in the same pass over S', and S stays in registers between
// the read and the write.
#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/kda.cuh"
#include "kernels/cuda/kda_common.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

constexpr int kBV = 64;  // value columns of S per block: two blocks per head at D = 128
constexpr int kThreads = 128;
constexpr int kColThreads = kBV / 4;                // threads across a row, 4 columns (16 bytes) each
constexpr int kRowGroups = kThreads / kColThreads;  // thread rows; rows rg, rg + 8, ... belong to row group rg

__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float WarpSum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <int D>
__global__ __launch_bounds__(kThreads) void KdaDecodeKernel(KdaArgs a) {
  PdlEnter();
  constexpr int kRows = D / kRowGroups;  // rows of S per thread
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int vb = blockIdx.x % (D / kBV);
  const int h = static_cast<int>((blockIdx.x / (D / kBV)) % a.H);
  const int64_t n = blockIdx.x / (D / kBV) / a.H;
  const int slot = a.state_idx[n];
  if (slot < 0) return;  // padding row

  // Issue the state loads first: they are the bulk of the traffic and need nothing else.
  const int c4 = tid % kColThreads, rg = tid / kColThreads;
  float* S = a.state + (static_cast<int64_t>(slot) * a.H + h) * D * D + vb * kBV + 4 * c4;
  float4 s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = *reinterpret_cast<const float4*>(S + (rg + kRowGroups * r) * D);

  __shared__ float sq[D], sk[D], sdecay[D], su[kBV];
  __shared__ float4 spart[2][kRowGroups][kColThreads];  // per row group: partial S'ᵀk and S'ᵀq
  __shared__ float sred[kThreads / 32][3];

  const int64_t row = n * a.H + h;  // token row of q, k, v, g_raw, o
  float qi = 0.0f, ki = 0.0f;
  if (tid < D) {
    qi = ToFloat(a.q[row * D + tid]);
    ki = ToFloat(a.k[row * D + tid]);
    const float g_raw = a.g_sums.p ? ToFloat(__float2bfloat16_rn(a.g_sums.At(n, int64_t{h} * D + tid)))
                                   : ToFloat(a.g_raw[row * D + tid]);
    const float x = g_raw + a.dt_bias[h * D + tid];
    sdecay[tid] = __expf(kda::Gate(a.gate, x, expf(a.A_log[h]), a.lower_bound));
  }
  const float vj = tid < kBV ? ToFloat(a.v[row * D + vb * kBV + tid]) : 0.0f;
  const float beta = kda::Sigmoid(ToFloat(a.b[n * (a.ldb ? a.ldb : a.H) + h]));

  // |q|², |k|² and q·k over the block.
  float qq = WarpSum(qi * qi), kk = WarpSum(ki * ki), qk = WarpSum(qi * ki);
  if (lane == 0) sred[warp][0] = qq, sred[warp][1] = kk, sred[warp][2] = qk;
  __syncthreads();
  qq = kk = qk = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) qq += sred[w][0], kk += sred[w][1], qk += sred[w][2];
  const float rq = rsqrtf(qq + 1e-6f) * (1.0f / sqrtf(static_cast<float>(D))), rk = rsqrtf(kk + 1e-6f);
  const float kq = qk * rq * rk;
  if (tid < D) sq[tid] = qi * rq, sk[tid] = ki * rk;
  __syncthreads();

  float4 pk = {0.0f, 0.0f, 0.0f, 0.0f}, pq = pk;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = rg + kRowGroups * r;
    const float d = sdecay[i], ki_ = sk[i], qi_ = sq[i];
    s[r].x *= d, s[r].y *= d, s[r].z *= d, s[r].w *= d;
    pk.x += s[r].x * ki_, pk.y += s[r].y * ki_, pk.z += s[r].z * ki_, pk.w += s[r].w * ki_;
    pq.x += s[r].x * qi_, pq.y += s[r].y * qi_, pq.z += s[r].z * qi_, pq.w += s[r].w * qi_;
  }
  spart[0][rg][c4] = pk;
  spart[1][rg][c4] = pq;
  __syncthreads();

  if (tid < kBV) {
    const float* pk_ = reinterpret_cast<const float*>(spart[0]);
    const float* pq_ = reinterpret_cast<const float*>(spart[1]);
    float Sk = 0.0f, Sq = 0.0f;
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) Sk += pk_[g * kBV + tid], Sq += pq_[g * kBV + tid];
    const float u = beta * (vj - Sk);
    su[tid] = u;
    a.o[row * D + vb * kBV + tid] = __float2bfloat16(Sq + u * kq);
  }
  __syncthreads();

  const float4 u4 = *reinterpret_cast<const float4*>(su + 4 * c4);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = rg + kRowGroups * r;
    const float ki_ = sk[i];
    s[r].x += ki_ * u4.x, s[r].y += ki_ * u4.y, s[r].z += ki_ * u4.z, s[r].w += ki_ * u4.w;
    *reinterpret_cast<float4*>(S + i * D) = s[r];
  }
}

}  // namespace

cudaError_t KdaDecode(const KdaArgs& a, int64_t N, cudaStream_t stream) {
  if (N < 0 || !kda::ValidArgs(a)) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const int64_t blocks = N * a.H * (a.D / kBV);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  if (a.D == 128)
    K3_CUDA_TRY(LaunchKernel(KdaDecodeKernel<128>, static_cast<unsigned>(blocks), kThreads, 0, stream, a));
  else
    K3_CUDA_TRY(LaunchKernel(KdaDecodeKernel<64>, static_cast<unsigned>(blocks), kThreads, 0, stream, a));
  return cudaGetLastError();
}

}  // namespace k3::cuda
