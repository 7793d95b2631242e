// CUDA errors as absl::Status, for host code that returns one.
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"

#define K3_CUDA_OK(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t k3_err_ = (expr);                                                           \
    if (k3_err_ != cudaSuccess)                                                                   \
      return absl::InternalError(                                                                 \
          absl::StrCat(#expr, " (", __FILE__, ":", __LINE__, "): ", cudaGetErrorString(k3_err_))); \
  } while (0)
