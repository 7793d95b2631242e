// Kernel launches with programmatic dependent launch (PDL, sm_90). A decode step is ~100 kernels of a few
// microseconds each; launched plainly, each waits for the one before it to drain before its CTAs are even
// scheduled. Launched through LaunchKernel(), a kernel's CTAs are scheduled once every CTA of the kernel before it
// has passed its own PdlEnter(), and then wait in theirs until that kernel has finished and its writes are
// visible: the launch latency hides behind the previous kernel's work. Stream order and CUDA graph capture
// (programmatic edges) are kept.
//
// The contract: a kernel launched with LaunchKernel() calls PdlEnter() before its first global memory access
// (reads of the model's weights, which no kernel writes, may come first), or PdlTrigger() and its own finer wait on
// flags that the kernel before it sets (it may only read what the kernels before that one wrote: those finished
// before the previous kernel passed its PdlEnter()).
// Kernels launched otherwise (cuBLAS, memsets) wait for full completion as usual; PdlEnter() in a kernel
// that was not launched with the attribute returns at once.
//
// K3SERVE_PDL=0 in the environment launches plainly (the same kernels), for side-by-side measurements.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace k3::cuda {

__device__ __forceinline__ void PdlTrigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void PdlEnter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  PdlTrigger();
}

inline bool PdlEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("K3SERVE_PDL");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute; returns the launch's error.
template <class... Params, class... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  cfg.attrs = attr, cfg.numAttrs = PdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace k3::cuda
