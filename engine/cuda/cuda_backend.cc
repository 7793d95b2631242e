#include "engine/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include "common/bf16.h"
#include "engine/cuda/cuda_status.h"

namespace k3::cuda {

int64_t CudaBackend::SequenceBytes(int32_t seq) const {
  const StateBytes fixed = SequenceStateBytes(model_.config(), 4);
  const StateBytes cache = SequenceStateBytes(model_.config(), 2);
  return fixed.fixed + cache.per_token * model_.position(seq);
}

absl::Status CudaBackend::Forward(std::span<const BatchChunk> chunks, std::vector<float>* logits) {
  std::vector<GpuChunk> gc;
  gc.reserve(chunks.size());
  for (const BatchChunk& c : chunks) gc.push_back({c.seq, c.tokens, c.logits});
  return model_.Forward(gc, logits);
}

absl::Status HostExpertBridge::Run(const CudaExpertRequest& r, float* out, cudaStream_t stream) {
  const int64_t n = r.rows * r.width, nk = r.rows * r.top_k;
  if (r.rows == 0) return absl::OkStatus();
  // Split-bf16 rows (x = hi + lo) to fp32 on the host: the wire carries what the engine computed.
  hi_.resize(n);
  lo_.assign(n, 0);
  for (int64_t i = 0; i < r.rows; ++i) {
    K3_CUDA_OK(cudaMemcpyAsync(hi_.data() + i * r.width, r.x.p + i * r.x.ld, r.width * 2, cudaMemcpyDeviceToHost, stream));
    if (r.x.lo != 0)
      K3_CUDA_OK(cudaMemcpyAsync(lo_.data() + i * r.width, r.x.p + i * r.x.ld + r.x.lo, r.width * 2,
                                 cudaMemcpyDeviceToHost, stream));
  }
  idx_.resize(nk);
  w_.resize(nk);
  K3_CUDA_OK(cudaMemcpyAsync(idx_.data(), r.idx, nk * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  K3_CUDA_OK(cudaMemcpyAsync(w_.data(), r.w, nk * sizeof(float), cudaMemcpyDeviceToHost, stream));
  K3_CUDA_OK(cudaStreamSynchronize(stream));
  x_.resize(n);
  for (int64_t i = 0; i < n; ++i) x_[i] = Bf16ToFloat(hi_[i]) + Bf16ToFloat(lo_[i]);
  sums_.resize(n);
  K3_ASSIGN_OR_RETURN(uint64_t ticket,
                      host_.Submit({r.layer, r.rows, r.width, r.top_k, x_.data(), idx_.data(), w_.data()}));
  K3_RETURN_IF_ERROR(host_.Wait(ticket, sums_.data()));
  K3_CUDA_OK(cudaMemcpyAsync(out, sums_.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream));
  // sums_ is reused by the next call: the copy must be done before we return.
  K3_CUDA_OK(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace k3::cuda
