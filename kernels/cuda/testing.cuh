// Shared by the CUDA tests: device buffers, CUDA assertions, and skipping where there is no GPU
// (CUDA code is built in CI without one).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/bf16.h"

#define CUDA_OK(expr)                                                                      \
  do {                                                                                     \
    const cudaError_t e_ = (expr);                                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);                 \
  } while (0)

#define REQUIRE_GPU()                                                                         \
  do {                                                                                        \
    int n_ = 0;                                                                               \
    if (cudaGetDeviceCount(&n_) != cudaSuccess || n_ == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace k3::cuda {

// A zero-filled device array of n T, optionally copied from the host.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p_ = nullptr;
    if (p_) cudaMemset(p_, 0, std::max<size_t>(n, 1) * sizeof(T));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) {
    if (p_ && !h.empty()) cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  __nv_bfloat16* bf() const { return reinterpret_cast<__nv_bfloat16*>(p_); }
  std::vector<T> ToHost() const {
    std::vector<T> h(n_);
    if (n_) cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

// The bf16 bits of x; x is rounded to bf16 in place (the values a CPU reference then sees).
inline std::vector<uint16_t> ToBf16(std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    b[i] = FloatToBf16(x[i]);
    x[i] = Bf16ToFloat(b[i]);
  }
  return b;
}

// The split planes (hi then lo, see split.cuh) of x; x becomes exactly hi + lo, the value the GPU sees.
inline std::vector<uint16_t> ToSplitPlanes(std::vector<float>& x) {
  std::vector<uint16_t> p(2 * x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    p[i] = FloatToBf16(x[i]);
    p[x.size() + i] = FloatToBf16(x[i] - Bf16ToFloat(p[i]));
    x[i] = Bf16ToFloat(p[i]) + Bf16ToFloat(p[x.size() + i]);
  }
  return p;
}

}  // namespace k3::cuda
