// Early return on a CUDA error inside host functions that chain several launches; the current device's SM
// count, which launch shapes are chosen by.
#pragma once

#include <cuda_runtime.h>

#define K3_CUDA_TRY(expr)              \
  do {                                 \
    const cudaError_t k3_e_ = (expr);  \
    if (k3_e_ != cudaSuccess) return k3_e_; \
  } while (0)

namespace k3::cuda {

inline cudaError_t SmCount(int* sms) {
  int dev = 0;
  K3_CUDA_TRY(cudaGetDevice(&dev));
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
}

}  // namespace k3::cuda
