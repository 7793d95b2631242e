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

// The same on the special-function unit's approximations (tanh.approx, ex2.approx, rcp.approx: relative errors
// near 2^-11), for outputs rounded to plain bf16 next (2^-9): 4 MUFU operations instead of tanhf / expf / the
// divisions' ~50 FMA-pipe instructions. inv_b1, inv_b2: 1 / b1, 1 / b2.
__device__ __forceinline__ float TanhApprox(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float GluApprox(GluAct act, float g, float u, float b1, float inv_b1, float b2,
                                           float inv_b2) {
  const float sig = __fdividef(1.0f, 1.0f + __expf(-g));
  if (act == GluAct::kSilu) return g * sig * u;
  return b1 * TanhApprox(g * inv_b1) * sig * (b2 * TanhApprox(u * inv_b2));
}
#endif

}  // namespace k3::cuda
