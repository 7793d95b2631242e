// k3serve-bench-kernels: the CUDA kernels against their anchors (flash-linear-attention, timed by
// kernels/cuda/anchors/fla_kda_anchor.py in the same run) and against the physical limit: the bytes a case
// must move at the device-to-device copy bandwidth measured here.
//
//   k3serve-bench-kernels [--anchors fla.json] [--json out.json] [--iters N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cuda/kda.cuh"

namespace {

using k3::cuda::KdaArgs;
using k3::cuda::KdaGate;

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#define CHECK(expr) Check((expr), #expr)

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

}  // namespace

int main(int argc, char** argv) {
  std::string anchors_path, json_path;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--anchors" && i + 1 < argc) anchors_path = argv[++i];
    else if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (arg == "--iters" && i + 1 < argc) iters = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--anchors fla.json] [--json out.json] [--iters N]\n", argv[0]);
      return 2;
    }
  }
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

  std::vector<Result> results;
  // KDA decode: one token for each of N sequences; the state is read and written once.
  for (int64_t N : {64, 256}) {
    const int64_t H = 96, D = 128;
    KdaInputs in(N, H, D, N, KdaGate::kSoftplus);
    const double ms = MedianMs([&] { CHECK(k3::cuda::KdaDecode(in.a, N, nullptr)); }, iters * 5);
    results.push_back({"decode_n" + std::to_string(N) + "_h96", ms, 2.0 * N * H * D * D * 4});
  }
  // KDA prefill: one sequence of T tokens from a zero state, final state written.
  for (KdaGate gate : {KdaGate::kSoftplus, KdaGate::kBounded})
    for (int64_t H : {32, 96}) {
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

  nlohmann::json anchors;
  if (!anchors_path.empty()) {
    std::ifstream f(anchors_path);
    if (f) anchors = nlohmann::json::parse(f, nullptr, false);
    if (anchors.is_discarded() || !anchors.contains("times_ms")) {
      std::printf("anchors: %s unreadable or without times_ms; anchor column left empty\n", anchors_path.c_str());
      anchors = nlohmann::json::object();
    }
  }
  std::printf("\n%-28s %10s %10s %9s %10s %9s %9s\n", "case", "ours_us", "fla_us", "fla/ours", "limit_us", "GB/s",
              "%copy_bw");
  nlohmann::json out = {{"device", prop.name}, {"copy_bw_gbs", copy_bw * 1e-9}, {"cases", nlohmann::json::array()}};
  for (const Result& r : results) {
    double fla_ms = NAN;
    if (anchors.contains("times_ms") && anchors["times_ms"].contains(r.name) && anchors["times_ms"][r.name].is_number())
      fla_ms = anchors["times_ms"][r.name].get<double>();
    const double limit_ms = r.bytes / copy_bw * 1e3, gbs = r.bytes / (r.ms * 1e-3) * 1e-9;
    std::printf("%-28s %10.1f %10.1f %9.2f %10.1f %9.0f %8.1f%%\n", r.name.c_str(), r.ms * 1e3, fla_ms * 1e3,
                fla_ms / r.ms, limit_ms * 1e3, gbs, 100.0 * limit_ms / r.ms);
    out["cases"].push_back({{"name", r.name}, {"ours_ms", r.ms}, {"fla_ms", std::isnan(fla_ms) ? nlohmann::json() : nlohmann::json(fla_ms)},
                            {"limit_ms", limit_ms}, {"bytes", r.bytes}});
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
