// k3serve-bench-kernels: the CUDA kernels against their anchors (flash-linear-attention, timed by
// kernels/cuda/anchors/fla_kda_anchor.py, and torch, timed by kernels/cuda/anchors/torch_experts_anchor.py,
// in the same run) and against the physical limits: the bytes a case must move at the device-to-device copy
// bandwidth measured here, and the FLOPs at the dense bf16 GEMM rate (cuBLAS, 8192³) measured here.
//
//   k3serve-bench-kernels [--anchors fla.json] [--torch-anchors torch.json] [--only kda|moe] [--json out.json]
//                         [--iters N]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cuda/kda.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/zipf_counts.h"

namespace {

using k3::cuda::KdaArgs;
using k3::cuda::KdaGate;
using k3::cuda::ZipfCounts;

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#define CHECK(expr) Check((expr), #expr)
void CheckBlas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, static_cast<int>(s));
    std::exit(1);
  }
}
#define CHECK_BLAS(expr) CheckBlas((expr), #expr)

// Every thread reads 16-byte words of an L2-resident buffer `reps` times (ld.global.cg: L2, not L1); the xor
// keeps the loads.
__global__ void L2ReadKernel(const int4* p, int64_t words, int reps, int4* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  for (int r = 0; r < reps; ++r)
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < words;
         i += int64_t{gridDim.x} * blockDim.x) {
      const int4 v = __ldcg(p + i);
      acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
    }
  if ((acc.x & acc.y & acc.z & acc.w) == 0x7fffffff) *sink = acc;
}

// Median time of one call, CUDA events around each call, after warm-up.
double MedianMs(const std::function<void()>& f, int iters) {
  for (int i = 0; i < 3; ++i) f();
  CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(ev[2 * i]));
    f();
    CHECK(cudaEventRecord(ev[2 * i + 1]));
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<double> ms(iters);
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
    ms[i] = t;
  }
  for (auto& e : ev) CHECK(cudaEventDestroy(e));
  std::nth_element(ms.begin(), ms.begin() + iters / 2, ms.end());
  return ms[iters / 2];
}

// Counter-based normal samples (Box–Muller over a hash): fills gigabytes without the host.
__device__ float HashNormal(uint64_t seed, uint64_t i) {
  auto mix = [](uint64_t x) {
    x ^= x >> 33, x *= 0xff51afd7ed558ccdull, x ^= x >> 33, x *= 0xc4ceb9fe1a85ec53ull, x ^= x >> 33;
    return x;
  };
  const uint64_t h = mix(seed * 0x9e3779b97f4a7c15ull + i);
  const float u1 = ((h >> 40) + 1) * (1.0f / 16777217.0f), u2 = ((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}
template <class T>
__global__ void FillNormal(T* x, int64_t n, uint64_t seed, float scale, float shift) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = static_cast<T>(shift + scale * HashNormal(seed, i));
}
template <class T>
void Fill(T* x, int64_t n, uint64_t seed, float scale = 1.0f, float shift = 0.0f) {
  FillNormal<<<1024, 256>>>(x, n, seed, scale, shift);
  CHECK(cudaGetLastError());
}

template <class T>
T* Alloc(int64_t n) {
  T* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
  return p;
}

// The KDA layer inputs at the trained-model range of the gate (as the anchor script draws them):
// A_log = log U(1, 16); softplus(dt_bias) log-uniform in [1e-3, 1e-1].
struct KdaInputs {
  KdaArgs a;
  explicit KdaInputs(int64_t T, int64_t H, int64_t D, int64_t slots, KdaGate gate) {
    a.H = H, a.D = D, a.gate = gate, a.lower_bound = -5.0f;
    auto* q = Alloc<__nv_bfloat16>(T * H * D);
    auto* k = Alloc<__nv_bfloat16>(T * H * D);
    auto* v = Alloc<__nv_bfloat16>(T * H * D);
    auto* g = Alloc<__nv_bfloat16>(T * H * D);
    auto* b = Alloc<__nv_bfloat16>(T * H);
    Fill(q, T * H * D, 1), Fill(k, T * H * D, 2), Fill(v, T * H * D, 3), Fill(g, T * H * D, 4), Fill(b, T * H, 5);
    std::vector<float> A_log(H), dt_bias(H * D);
    uint64_t s = 12345;
    auto uni = [&] { return ((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 40) * (1.0 / 16777216.0); };
    for (auto& x : A_log) x = static_cast<float>(std::log(1.0 + 15.0 * uni()));
    for (auto& x : dt_bias) x = static_cast<float>(std::log(std::expm1(std::exp(std::log(1e-3) + uni() * std::log(100.0)))));
    float* dA = Alloc<float>(H);
    float* dB = Alloc<float>(H * D);
    CHECK(cudaMemcpy(dA, A_log.data(), H * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dB, dt_bias.data(), H * D * sizeof(float), cudaMemcpyHostToDevice));
    float* state = Alloc<float>(slots * H * D * D);
    Fill(state, slots * H * D * D, 6, 0.3f);
    std::vector<int32_t> idx(slots);
    for (int64_t i = 0; i < slots; ++i) idx[i] = static_cast<int32_t>(i);
    int32_t* didx = Alloc<int32_t>(slots);
    CHECK(cudaMemcpy(didx, idx.data(), slots * sizeof(int32_t), cudaMemcpyHostToDevice));
    a.q = q, a.k = k, a.v = v, a.g_raw = g, a.b = b, a.A_log = dA, a.dt_bias = dB, a.state = state, a.state_idx = didx;
    a.o = Alloc<__nv_bfloat16>(T * H * D);
  }
  ~KdaInputs() {
    for (const void* p : {static_cast<const void*>(a.q), static_cast<const void*>(a.k), static_cast<const void*>(a.v),
                          static_cast<const void*>(a.g_raw), static_cast<const void*>(a.b),
                          static_cast<const void*>(a.A_log), static_cast<const void*>(a.dt_bias),
                          static_cast<const void*>(a.state), static_cast<const void*>(a.state_idx),
                          static_cast<const void*>(a.o)})
      cudaFree(const_cast<void*>(p));
  }
};

struct Result {
  std::string name;
  double ms;     // ours
  double bytes;  // the fewest bytes the case must move
};

// Dense bf16 GEMM rate (TFLOP/s) of cuBLAS at 8192³ on random data: the matrix-bound limit.
double GemmPeakTflops() {
  const int n = 8192;
  auto* A = Alloc<__nv_bfloat16>(int64_t(n) * n);
  auto* B = Alloc<__nv_bfloat16>(int64_t(n) * n);
  auto* C = Alloc<__nv_bfloat16>(int64_t(n) * n);
  Fill(A, int64_t(n) * n, 31), Fill(B, int64_t(n) * n, 32);
  cublasHandle_t blas;
  CHECK_BLAS(cublasCreate(&blas));
  const float one = 1.0f, zero = 0.0f;
  const double ms = MedianMs(
      [&] {
        CHECK_BLAS(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n,
                                &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      },
      10);
  CHECK_BLAS(cublasDestroy(blas));
  for (auto* p : {A, B, C}) CHECK(cudaFree(p));
  return 2.0 * n * n * n / (ms * 1e-3) * 1e-12;
}

struct MoeResult {
  std::string name, anchor;  // anchor: the key in the torch anchors' times_ms
  double ms;
  double bytes;  // experts: the weights, read once; router: the logits
  double flops;  // experts: 2·3·ℓ·I per routed pair
};

constexpr double kZipfS = 1.0;

// The routed experts at K3 latent shapes (ℓ 3584, I 3072, 56 experts on one GPU), bf16, SiTU, weights in
// 3·56 separate matrices passed by pointer. N = 28·avg tokens with k = 2 pairs each over Zipf(1.0) counts;
// tokens are shuffled so that an expert's tokens are scattered through x.
constexpr int64_t kExpertAvgs[] = {8, 16, 32, 64, 128, 256, 512};  // tokens per expert on average

void BenchExperts(int iters, int64_t only_avg, std::vector<MoeResult>& results) {
  const int64_t E = 56, D = 3584, I = 3072, k = 2;
  auto* w1 = Alloc<__nv_bfloat16>(E * I * D);
  auto* w3 = Alloc<__nv_bfloat16>(E * I * D);
  auto* w2 = Alloc<__nv_bfloat16>(E * D * I);
  Fill(w1, E * I * D, 41, 0.02f), Fill(w3, E * I * D, 42, 0.02f), Fill(w2, E * D * I, 43, 0.02f);
  std::vector<const __nv_bfloat16*> h1(E), h3(E), h2(E);
  for (int64_t e = 0; e < E; ++e) h1[e] = w1 + e * I * D, h3[e] = w3 + e * I * D, h2[e] = w2 + e * D * I;
  auto* p1 = Alloc<const __nv_bfloat16*>(E);
  auto* p3 = Alloc<const __nv_bfloat16*>(E);
  auto* p2 = Alloc<const __nv_bfloat16*>(E);
  CHECK(cudaMemcpy(p1, h1.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(p3, h3.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(p2, h2.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
  const double weight_bytes = 3.0 * E * D * I * 2;
  for (int64_t avg : kExpertAvgs) {
    if (only_avg != 0 && avg != only_avg) continue;
    const auto counts = ZipfCounts(E, avg, kZipfS);
    const int64_t P = E * avg, N = P / k;
    std::vector<int32_t> perm(N), idx(N * k);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<uint32_t>(avg)));
    int64_t p = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < counts[e]; ++c, ++p) idx[perm[p % N] * k + p / N] = static_cast<int32_t>(e);
    std::vector<float> w(N * k);
    std::mt19937 rng(7);
    for (auto& x : w) x = 0.05f + 0.45f * (rng() % 1000) / 1000.0f;
    std::printf("experts avg %ld: Zipf s = %.1f, tokens per expert max %ld, min %ld (every expert non-empty)\n",
                static_cast<long>(avg), kZipfS, static_cast<long>(counts.front()), static_cast<long>(counts.back()));
    auto* x = Alloc<__nv_bfloat16>(N * D);
    auto* out = Alloc<__nv_bfloat16>(N * D);
    auto* d_idx = Alloc<int32_t>(N * k);
    auto* d_w = Alloc<float>(N * k);
    Fill(x, N * D, 44);
    CHECK(cudaMemcpy(d_idx, idx.data(), N * k * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_w, w.data(), N * k * sizeof(float), cudaMemcpyHostToDevice));
    k3::cuda::MoeWorkspace ws;
    CHECK(ws.Reserve(P, D, I, E));
    k3::cuda::MoeExpertsArgs a;
    a.N = N, a.D = D, a.I = I, a.top_k = k, a.num_experts = E;
    a.x = x, a.idx = d_idx, a.w = d_w, a.w1 = p1, a.w3 = p3, a.w2 = p2, a.out = out;
    a.act = k3::cuda::GluAct::kSitu;
    for (auto [gemm, tag] : {std::pair{k3::cuda::MoeGemm::kTiled, "tiled"}, {k3::cuda::MoeGemm::kCublas, "cublas"},
                             {k3::cuda::MoeGemm::kWgmma, "wgmma"}}) {
      const double ms = MedianMs([&] { CHECK(k3::cuda::MoeExperts(a, gemm, ws, nullptr)); }, iters);
      const std::string anchor = "experts_avg" + std::to_string(avg);
      results.push_back({anchor + "_" + tag, anchor, ms, weight_bytes, 2.0 * 3 * D * I * P});
    }
    for (void* q : {static_cast<void*>(x), static_cast<void*>(out), static_cast<void*>(d_idx), static_cast<void*>(d_w)})
      CHECK(cudaFree(q));
  }
  for (void* q : {static_cast<void*>(w1), static_cast<void*>(w3), static_cast<void*>(w2), static_cast<void*>(p1),
                  static_cast<void*>(p3), static_cast<void*>(p2)})
    CHECK(cudaFree(q));
}

// The router at K3 (E = 896, k = 16, no groups) on fp32 logits, with and without the QB histogram (56 bins).
void BenchRouter(int iters, std::vector<MoeResult>& results) {
  const int64_t E = 896, k = 16, bins = 56;
  for (int64_t N : {64, 8192}) {
    auto* logits = Alloc<float>(N * E);
    auto* bias = Alloc<float>(E);
    auto* idx = Alloc<int32_t>(N * k);
    auto* w = Alloc<float>(N * k);
    auto* hist = Alloc<int32_t>(bins * E);
    Fill(logits, N * E, 51), Fill(bias, E, 52, 0.05f);
    CHECK(cudaMemset(hist, 0, bins * E * sizeof(int32_t)));
    k3::cuda::RouterArgs a;
    a.N = N, a.num_experts = E, a.top_k = k, a.renormalize = true, a.scale = 2.5f;
    a.logits = k3::cuda::Sums{logits, E}, a.bias = bias, a.idx = idx, a.w = w;
    const std::string anchor = "router_n" + std::to_string(N);
    results.push_back({anchor, anchor, MedianMs([&] { CHECK(k3::cuda::RouteTopK(a, nullptr)); }, iters * 5),
                       4.0 * N * E, 0.0});
    a.qb_hist = hist, a.qb_bins = bins, a.qb_rmin = -0.5f, a.qb_rmax = 1.0f;
    results.push_back({anchor + "_qb", anchor, MedianMs([&] { CHECK(k3::cuda::RouteTopK(a, nullptr)); }, iters * 5),
                       4.0 * N * E, 0.0});
    for (void* q : {static_cast<void*>(logits), static_cast<void*>(bias), static_cast<void*>(idx),
                    static_cast<void*>(w), static_cast<void*>(hist)})
      CHECK(cudaFree(q));
  }
}

nlohmann::json ReadAnchors(const std::string& path) {
  nlohmann::json anchors = nlohmann::json::object();
  if (path.empty()) return anchors;
  std::ifstream f(path);
  if (f) anchors = nlohmann::json::parse(f, nullptr, false);
  if (anchors.is_discarded() || !anchors.contains("times_ms")) {
    std::printf("anchors: %s unreadable or without times_ms; anchor column left empty\n", path.c_str());
    anchors = nlohmann::json::object();
  }
  return anchors;
}
double AnchorMs(const nlohmann::json& anchors, const std::string& name) {
  if (anchors.contains("times_ms") && anchors["times_ms"].contains(name) && anchors["times_ms"][name].is_number())
    return anchors["times_ms"][name].get<double>();
  return NAN;
}

}  // namespace

int main(int argc, char** argv) {
  std::string anchors_path, torch_anchors_path, json_path, only;
  int iters = 20;
  int64_t only_avg = 0;  // experts: one average of tokens per expert (0: all)
  auto family = [](const std::string& name) { return name == "kda" || name == "moe"; };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--anchors" && i + 1 < argc) anchors_path = argv[++i];
    else if (arg == "--torch-anchors" && i + 1 < argc) torch_anchors_path = argv[++i];
    else if (arg == "--only" && i + 1 < argc && family(argv[i + 1])) only = argv[++i];
    else if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (arg == "--iters" && i + 1 < argc) iters = std::max(1, std::atoi(argv[++i]));
    else if (arg == "--avg" && i + 1 < argc && std::count(std::begin(kExpertAvgs), std::end(kExpertAvgs),
                                                            std::atoll(argv[i + 1])) == 1)
      only_avg = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: %s [--anchors fla.json] [--torch-anchors torch.json] [--only kda|moe] [--json out.json] "
                   "[--iters N] [--avg 8|16|32|64|128|256|512]\n",
                   argv[0]);
      return 2;
    }
  }
  const bool run_kda = only.empty() || only == "kda", run_moe = only.empty() || only == "moe";
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);

  // The physical limit: a device-to-device copy of 2 GiB (bytes read + bytes written).
  double copy_bw;
  {
    const size_t n = size_t(2) << 30;
    void *src = Alloc<char>(n), *dst = Alloc<char>(n);
    CHECK(cudaMemset(src, 1, n));
    const double ms = MedianMs([&] { CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice)); }, 10);
    copy_bw = 2.0 * n / (ms * 1e-3);
    std::printf("copy bandwidth: %.0f GB/s (2 GiB device-to-device, read + write)\n", copy_bw * 1e-9);
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
  }
  // What the SMs can read from L2 (a quarter of it, so the lines stay resident), for kernels that re-read tiles.
  double l2_bw;
  {
    const int64_t bytes = int64_t{prop.l2CacheSize} / 4, words = bytes / 16;
    constexpr int kReps = 50;
    auto* p = Alloc<int4>(words);
    auto* sink = Alloc<int4>(1);
    CHECK(cudaMemset(p, 1, bytes));
    const unsigned grid = static_cast<unsigned>(prop.multiProcessorCount) * 4;
    const double ms = MedianMs([&] { L2ReadKernel<<<grid, 256>>>(p, words, kReps, sink); }, 10);
    CHECK(cudaGetLastError());
    l2_bw = double(bytes) * kReps / (ms * 1e-3);
    std::printf("L2 read bandwidth: %.0f GB/s (%ld MB read %d times by %u CTAs)\n", l2_bw * 1e-9,
                static_cast<long>(bytes >> 20), kReps, grid);
    CHECK(cudaFree(p));
    CHECK(cudaFree(sink));
  }

  std::vector<Result> results;
  // KDA decode: one token for each of N sequences; the state is read and written once.
  for (int64_t N : {64, 256}) {
    if (!run_kda) break;
    const int64_t H = 96, D = 128;
    KdaInputs in(N, H, D, N, KdaGate::kSoftplus);
    const double ms = MedianMs([&] { CHECK(k3::cuda::KdaDecode(in.a, N, nullptr)); }, iters * 5);
    results.push_back({"decode_n" + std::to_string(N) + "_h96", ms, 2.0 * N * H * D * D * 4});
  }
  // KDA prefill: one sequence of T tokens from a zero state, final state written.
  for (KdaGate gate : {KdaGate::kSoftplus, KdaGate::kBounded})
    for (int64_t H : {32, 96}) {
      if (!run_kda) break;
      const int64_t T = 8192, D = 128;
      KdaInputs in(T, H, D, 1, gate);
      const int32_t cu_host[2] = {0, static_cast<int32_t>(T)};
      int32_t* cu = Alloc<int32_t>(2);
      CHECK(cudaMemcpy(cu, cu_host, sizeof(cu_host), cudaMemcpyHostToDevice));
      k3::cuda::KdaPrefillBatch batch;
      batch.num_seqs = 1;
      batch.cu_seqlens = cu;
      batch.num_chunks = k3::cuda::KdaNumChunks(cu_host, 1);
      batch.workspace = Alloc<char>(k3::cuda::KdaPrefillWorkspaceBytes(batch.num_chunks, H, D));
      const double ms = MedianMs([&] { CHECK(k3::cuda::KdaPrefill(in.a, batch, nullptr)); }, iters);
      const double bytes = T * H * (4.0 * D * 2 + 2 + D * 2) + H * D * D * 4.0;
      results.push_back({"prefill_t8192_h" + std::to_string(H) + (gate == KdaGate::kSoftplus ? "_softplus" : "_bounded"),
                         ms, bytes});
      CHECK(cudaFree(cu));
      CHECK(cudaFree(batch.workspace));
    }

  // MoE: routed experts and router (torch anchors), against the copy bandwidth and the GEMM peak.
  std::vector<MoeResult> moe_results;
  double gemm_tflops = NAN;
  if (run_moe) {
    gemm_tflops = GemmPeakTflops();
    std::printf("dense bf16 GEMM (cuBLAS 8192^3): %.0f TFLOP/s\n", gemm_tflops);
    BenchExperts(iters, only_avg, moe_results);
    BenchRouter(iters, moe_results);
  }

  const nlohmann::json anchors = ReadAnchors(anchors_path), torch_anchors = ReadAnchors(torch_anchors_path);
  nlohmann::json out = {{"device", prop.name},
                        {"copy_bw_gbs", copy_bw * 1e-9},
                        {"l2_read_gbs", l2_bw * 1e-9},
                        {"cases", nlohmann::json::array()}};
  if (run_kda)
    std::printf("\n%-28s %10s %10s %9s %10s %9s %9s\n", "case", "ours_us", "fla_us", "fla/ours", "limit_us", "GB/s",
                "%copy_bw");
  for (const Result& r : results) {
    const double fla_ms = AnchorMs(anchors, r.name);
    const double limit_ms = r.bytes / copy_bw * 1e3, gbs = r.bytes / (r.ms * 1e-3) * 1e-9;
    std::printf("%-28s %10.1f %10.1f %9.2f %10.1f %9.0f %8.1f%%\n", r.name.c_str(), r.ms * 1e3, fla_ms * 1e3,
                fla_ms / r.ms, limit_ms * 1e3, gbs, 100.0 * limit_ms / r.ms);
    out["cases"].push_back({{"name", r.name}, {"ours_ms", r.ms}, {"fla_ms", std::isnan(fla_ms) ? nlohmann::json() : nlohmann::json(fla_ms)},
                            {"limit_ms", limit_ms}, {"bytes", r.bytes}});
  }
  if (run_moe) {
    // TB/s of the weights, read once (experts) or of the logits (router); TFLOP/s of the experts. torch: the
    // same work, equal tokens per expert for the experts (three torch.bmm), sigmoid + topk for the router.
    std::printf("\n%-24s %10s %10s %11s %9s %9s %9s %9s\n", "case", "ours_us", "torch_us", "torch/ours", "TB/s",
                "TFLOP/s", "%copy_bw", "%gemm");
    out["gemm_peak_tflops"] = gemm_tflops;
    out["zipf_s"] = kZipfS;
    out["moe_cases"] = nlohmann::json::array();
    for (const MoeResult& r : moe_results) {
      const double torch_ms = AnchorMs(torch_anchors, r.anchor);
      const double tbs = r.bytes / (r.ms * 1e-3) * 1e-12, tflops = r.flops / (r.ms * 1e-3) * 1e-12;
      std::printf("%-24s %10.1f %10.1f %11.2f %9.2f %9.0f %8.1f%% %8.1f%%\n", r.name.c_str(), r.ms * 1e3,
                  torch_ms * 1e3, torch_ms / r.ms, tbs, tflops, 100.0 * tbs * 1e12 / copy_bw,
                  100.0 * tflops / gemm_tflops);
      out["moe_cases"].push_back({{"name", r.name}, {"ours_ms", r.ms},
                                  {"torch_ms", std::isnan(torch_ms) ? nlohmann::json() : nlohmann::json(torch_ms)},
                                  {"bytes", r.bytes}, {"flops", r.flops}});
    }
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
