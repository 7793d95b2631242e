// Early return on a CUDA error inside host functions that chain several launches.
#pragma once

#include <cuda_runtime.h>

#define K3_CUDA_TRY(expr)              \
  do {                                 \
    const cudaError_t k3_e_ = (expr);  \
    if (k3_e_ != cudaSuccess) return k3_e_; \
  } while (0)
