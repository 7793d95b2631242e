// The gated activations of the MLPs and experts (DESIGN §1.4): act(g, u) = SiLU(g)·u, or SiTU-GLU
// b1·tanh(g/b1)·σ(g) · b2·tanh(u/b2). Reference: k3::cpu::GluActivate.
#pragma once

namespace k3::cuda {

enum class GluAct { kSilu, kSitu };

#ifdef __CUDACC__
__device__ __forceinline__ float Glu(GluAct act, float g, float u, float b1, float b2) {
  const float sig = 1.0f / (1.0f + expf(-g));
  if (act == GluAct::kSilu) return g * sig * u;
  return b1 * tanhf(g / b1) * sig * (b2 * tanhf(u / b2));
}
#endif

}  // namespace k3::cuda
