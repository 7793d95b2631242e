// k3serve-bench-mxfp4: the MXFP4 grouped experts at K3 latent shapes (ℓ 3584, I 3072, 56 experts, k = 2,
// Zipf(1.0)-skewed tokens) next to our bf16 grouped experts (MoeExperts, kAuto) on the same routing, the copy
// bandwidth of this GPU, and torch.bmm in bf16 with the same average for every expert (--torch-anchors: the
// JSON of kernels/cuda/anchors/torch_experts_anchor.py, run beside it).
//   k3serve-bench-mxfp4 [--torch-anchors torch.json] [--iters 20]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/mxfp4.cuh"
#include "kernels/cuda/zipf_counts.h"

#define CHECK(expr)                                                                                  \
  do {                                                                                               \
    const cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_));     \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

namespace {

using k3::cuda::ZipfCounts;

template <class T>
T* Alloc(int64_t n) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

__global__ void FillBytes(uint8_t* p, int64_t n, uint32_t seed, int lo, int span) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = static_cast<uint8_t>(span == 0 ? h : lo + h % span);
  }
}
__global__ void FillBf16(__nv_bfloat16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = __float2bfloat16(scale * ((h & 0xFFFF) / 32768.0f - 1.0f));
  }
}

template <class F>
double MedianMs(F&& f, int iters) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaEventRecord(a));
    f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaEventElapsedTime(&ms[i], a, b));
  }
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string torch_path;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--torch-anchors" && i + 1 < argc) torch_path = argv[++i];
    else if (arg == "--iters" && i + 1 < argc) iters = std::max(1, std::atoi(argv[++i]));
  }
  nlohmann::json torch = nlohmann::json::object();
  if (!torch_path.empty()) {
    std::ifstream f(torch_path);
    if (f) torch = nlohmann::json::parse(f, nullptr, false);
    if (torch.is_discarded()) torch = nlohmann::json::object();
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));

  // Copy bandwidth: a 2 GiB device-to-device copy counts its bytes twice (read + write).
  const int64_t copy_bytes = int64_t{2} << 30;
  auto* src = Alloc<uint8_t>(copy_bytes);
  auto* dst = Alloc<uint8_t>(copy_bytes);
  CHECK(cudaMemset(src, 1, copy_bytes));
  const double copy_ms = MedianMs([&] { CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice)); }, 10);
  const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  std::printf("%s: copy bandwidth %.0f GB/s\n", prop.name, copy_gbs);

  const int64_t E = 56, D = 3584, I = 3072, k = 2;
  const int64_t code13 = k3::cuda::Mxfp4CodeBytes(I, D), scale13 = k3::cuda::Mxfp4ScaleBytes(I, D);
  const int64_t code2 = k3::cuda::Mxfp4CodeBytes(D, I), scale2 = k3::cuda::Mxfp4ScaleBytes(D, I);
  auto* q = Alloc<uint8_t>(E * (2 * (code13 + scale13) + code2 + scale2));
  std::vector<const uint8_t*> h1(E), hs1(E), h3(E), hs3(E), h2(E), hs2(E);
  uint8_t* p = q;
  for (int64_t e = 0; e < E; ++e) {
    h1[e] = p, p += code13, hs1[e] = p, p += scale13;
    h3[e] = p, p += code13, hs3[e] = p, p += scale13;
    h2[e] = p, p += code2, hs2[e] = p, p += scale2;
  }
  for (int64_t e = 0; e < E; ++e) {  // random codes; scales 2^−9..2^−6 (weights of a few hundredths)
    for (auto [ptr, n, s] : {std::tuple{h1[e], code13, 0}, {h3[e], code13, 0}, {h2[e], code2, 0}})
      FillBytes<<<1024, 256>>>(const_cast<uint8_t*>(ptr), n, static_cast<uint32_t>(e * 7 + n), 0, s);
    for (auto [ptr, n] : {std::pair{hs1[e], scale13}, {hs3[e], scale13}, {hs2[e], scale2}})
      FillBytes<<<256, 256>>>(const_cast<uint8_t*>(ptr), n, static_cast<uint32_t>(e * 11 + n), 118, 4);
  }
  auto upload = [&](const std::vector<const uint8_t*>& h) {
    auto* d = Alloc<const uint8_t*>(E);
    CHECK(cudaMemcpy(d, h.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    return d;
  };
  auto *p1 = upload(h1), *ps1 = upload(hs1), *p3 = upload(h3), *ps3 = upload(hs3), *p2 = upload(h2), *ps2 = upload(hs2);
  // bf16 weights for our bf16 kernel.
  auto* wb = Alloc<__nv_bfloat16>(3 * E * I * D);
  FillBf16<<<4096, 256>>>(wb, 3 * E * I * D, 41, 0.02f);
  std::vector<const __nv_bfloat16*> b1(E), b3(E), b2(E);
  for (int64_t e = 0; e < E; ++e) b1[e] = wb + 3 * e * I * D, b3[e] = b1[e] + I * D, b2[e] = b3[e] + I * D;
  auto upload_bf = [&](const std::vector<const __nv_bfloat16*>& h) {
    auto* d = Alloc<const __nv_bfloat16*>(E);
    CHECK(cudaMemcpy(d, h.data(), E * sizeof(void*), cudaMemcpyHostToDevice));
    return d;
  };
  auto *pb1 = upload_bf(b1), *pb3 = upload_bf(b3), *pb2 = upload_bf(b2);
  CHECK(cudaDeviceSynchronize());

  const double mx_bytes = E * (2.0 * (code13 + scale13) + code2 + scale2), bf_bytes = 3.0 * E * I * D * 2;
  std::printf("K3 latent experts: l %ld, I %ld, %ld experts, k %ld, Zipf s = 1.0; MXFP4 weights %.3f GB (bf16 %.3f GB)\n",
              static_cast<long>(D), static_cast<long>(I), static_cast<long>(E), static_cast<long>(k), mx_bytes / 1e9,
              bf_bytes / 1e9);
  std::printf("%5s %7s | %9s %8s %7s %8s | %9s %8s | %9s %8s | %9s %7s | %9s %8s | %9s %8s | %8s\n", "avg",
              "max/exp", "direct ms", "GB/s", "%copy", "TFLOP/s", "wgmma ms", "TFLOP/s", "dequant", "TFLOP/s",
              "split ms", "%copy", "bf16 ms", "TFLOP/s", "torch ms", "vs torch", "vs bf16");
  for (int64_t avg : {8, 16, 32, 64, 128, 256, 512}) {
    const auto counts = ZipfCounts(E, avg, 1.0);
    const int64_t P = E * avg, N = P / k;
    std::vector<int32_t> perm(N), idx(N * k);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<uint32_t>(avg)));
    int64_t pi = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < counts[e]; ++c, ++pi) idx[perm[pi % N] * k + pi / N] = static_cast<int32_t>(e);
    std::vector<float> w(N * k);
    std::mt19937 rng(7);
    for (auto& x : w) x = 0.05f + 0.45f * (rng() % 1000) / 1000.0f;
    auto* x = Alloc<__nv_bfloat16>(2 * N * D);  // split x: hi plane, then lo plane
    auto* out = Alloc<__nv_bfloat16>(N * D);
    auto* out_f32 = Alloc<float>(N * D);
    auto* out_bf = Alloc<__nv_bfloat16>(N * D);
    auto* d_idx = Alloc<int32_t>(N * k);
    auto* d_w = Alloc<float>(N * k);
    FillBf16<<<1024, 256>>>(x, N * D, 44, 1.0f);
    FillBf16<<<1024, 256>>>(x + N * D, N * D, 45, 1.0f / 512);
    CHECK(cudaMemcpy(d_idx, idx.data(), N * k * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_w, w.data(), N * k * sizeof(float), cudaMemcpyHostToDevice));

    k3::cuda::Mxfp4Workspace ws;  // with the bf16 copy and the grouped experts' workspace at every average
    CHECK(ws.Reserve(std::max(P, k3::cuda::kMxfp4DequantMinPairsPerExpert * E), D, I, E, true, true));
    k3::cuda::Mxfp4ExpertsArgs a;
    a.N = N, a.D = D, a.I = I, a.top_k = k, a.num_experts = E;
    a.x = x, a.idx = d_idx, a.w = d_w, a.w1 = p1, a.s1 = ps1, a.w3 = p3, a.s3 = ps3, a.w2 = p2, a.s2 = ps2;
    a.act = k3::cuda::GluAct::kSitu, a.out = out;
    a.gemm = k3::cuda::Mxfp4Gemm::kDirect;
    const double direct_ms = MedianMs([&] { CHECK(k3::cuda::Mxfp4Experts(a, ws, nullptr)); }, iters);
    a.gemm = k3::cuda::Mxfp4Gemm::kWgmma;
    const double wgmma_ms = MedianMs([&] { CHECK(k3::cuda::Mxfp4Experts(a, ws, nullptr)); }, iters);
    a.gemm = k3::cuda::Mxfp4Gemm::kDequant;
    const double dequant_ms = MedianMs([&] { CHECK(k3::cuda::Mxfp4Experts(a, ws, nullptr)); }, iters);
    const double mx_ms = avg >= k3::cuda::kMxfp4PlainDequantMinPairsPerExpert ? dequant_ms  // kAuto's
                         : avg >= k3::cuda::kMxfp4WgmmaMinPairsPerExpert      ? wgmma_ms
                                                                              : direct_ms;
    k3::cuda::Mxfp4ExpertsArgs as = a;  // the GPU engine's split x, kAuto
    as.gemm = k3::cuda::Mxfp4Gemm::kAuto, as.x_lo = N * D, as.out = nullptr, as.out_f32 = out_f32;
    const double split_ms = MedianMs([&] { CHECK(k3::cuda::Mxfp4Experts(as, ws, nullptr)); }, iters);

    k3::cuda::MoeWorkspace bws;
    CHECK(bws.Reserve(P, D, I, E));
    k3::cuda::MoeExpertsArgs b;
    b.N = N, b.D = D, b.I = I, b.top_k = k, b.num_experts = E;
    b.x = x, b.idx = d_idx, b.w = d_w, b.w1 = pb1, b.w3 = pb3, b.w2 = pb2, b.out = out_bf;
    b.act = k3::cuda::GluAct::kSitu;
    const double bf_ms = MedianMs([&] { CHECK(k3::cuda::MoeExperts(b, k3::cuda::MoeGemm::kAuto, bws, nullptr)); }, iters);

    const double flops = 2.0 * 3 * D * I * P;
    const double mx_gbs = mx_bytes / (direct_ms * 1e-3) / 1e9;
    const std::string key = "experts_avg" + std::to_string(avg);
    const double torch_ms = torch.contains("times_ms") && torch["times_ms"].contains(key)
                                ? torch["times_ms"][key].get<double>()
                                : NAN;
    const double split_gbs = mx_bytes / (split_ms * 1e-3) / 1e9;
    std::printf("%5ld %7ld | %9.3f %8.0f %6.1f%% %8.1f | %9.3f %8.1f | %9.3f %8.1f | %9.3f %6.1f%% | %9.3f %8.1f | %9.3f "
                "%7.2fx | %7.2fx\n",
                static_cast<long>(avg), static_cast<long>(counts.front()), direct_ms, mx_gbs, 100.0 * mx_gbs / copy_gbs,
                flops / (direct_ms * 1e-3) / 1e12, wgmma_ms, flops / (wgmma_ms * 1e-3) / 1e12, dequant_ms, flops / (dequant_ms * 1e-3) / 1e12, split_ms,
                100.0 * split_gbs / copy_gbs, bf_ms, flops / (bf_ms * 1e-3) / 1e12, torch_ms, torch_ms / mx_ms,
                bf_ms / mx_ms);
    for (void* v : {static_cast<void*>(x), static_cast<void*>(out), static_cast<void*>(out_f32), static_cast<void*>(out_bf),
                    static_cast<void*>(d_idx), static_cast<void*>(d_w)})
      CHECK(cudaFree(v));
  }
  std::printf("direct / wgmma / dequant: the three MXFP4 paths (Mxfp4Gemm); split: x as hi + lo planes, fp32 out (the\n"
              "GPU engine's activations), kAuto. vs torch: torch.bmm bf16 time (equal tokens per expert, the three products\n"
              "only) over MXFP4 kAuto's (direct below %ld pairs per expert, wgmma below %ld, dequant from there); vs bf16:\n"
              "our bf16 grouped experts' (kAuto, the same routing) over MXFP4 kAuto's (= MXFP4 TFLOP/s over bf16 TFLOP/s)\n",
              static_cast<long>(k3::cuda::kMxfp4WgmmaMinPairsPerExpert),
              static_cast<long>(k3::cuda::kMxfp4PlainDequantMinPairsPerExpert));
  return 0;
}
