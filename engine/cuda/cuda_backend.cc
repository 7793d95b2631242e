#include "engine/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>

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

HostExpertBridge::~HostExpertBridge() {
  for (void* p : {static_cast<void*>(hi_), static_cast<void*>(lo_), static_cast<void*>(idx_), static_cast<void*>(w_),
                  static_cast<void*>(sums_)})
    cudaFreeHost(p);
}

absl::Status HostExpertBridge::Reserve(int64_t rows, int64_t width, int64_t top_k) {
  if (rows <= rows_ && width <= width_ && top_k <= top_k_) return absl::OkStatus();
  rows_ = std::max(rows, rows_), width_ = std::max(width, width_), top_k_ = std::max(top_k, top_k_);
  const int64_t n = rows_ * width_, nk = rows_ * top_k_;
  for (void** p : {reinterpret_cast<void**>(&hi_), reinterpret_cast<void**>(&lo_), reinterpret_cast<void**>(&idx_),
                   reinterpret_cast<void**>(&w_), reinterpret_cast<void**>(&sums_)}) {
    cudaFreeHost(*p);
    *p = nullptr;
  }
  K3_CUDA_OK(cudaMallocHost(&hi_, n * sizeof(uint16_t)));
  K3_CUDA_OK(cudaMallocHost(&lo_, n * sizeof(uint16_t)));
  K3_CUDA_OK(cudaMallocHost(&idx_, nk * sizeof(int32_t)));
  K3_CUDA_OK(cudaMallocHost(&w_, nk * sizeof(float)));
  K3_CUDA_OK(cudaMallocHost(&sums_, n * sizeof(float)));
  x_.resize(n);
  return absl::OkStatus();
}

absl::Status HostExpertBridge::Run(const CudaExpertRequest& r, float* out, cudaStream_t stream) {
  const int64_t n = r.rows * r.width, nk = r.rows * r.top_k;
  if (r.rows == 0) return absl::OkStatus();
  K3_RETURN_IF_ERROR(Reserve(r.rows, r.width, r.top_k));
  // Split-bf16 rows (x = hi + lo) to fp32 on the host: the wire carries what the engine computed.
  const size_t pitch = r.x.ld * sizeof(uint16_t), row = r.width * sizeof(uint16_t);
  K3_CUDA_OK(cudaMemcpy2DAsync(hi_, row, r.x.p, pitch, row, r.rows, cudaMemcpyDeviceToHost, stream));
  if (r.x.lo != 0)
    K3_CUDA_OK(cudaMemcpy2DAsync(lo_, row, r.x.p + r.x.lo, pitch, row, r.rows, cudaMemcpyDeviceToHost, stream));
  K3_CUDA_OK(cudaMemcpyAsync(idx_, r.idx, nk * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  K3_CUDA_OK(cudaMemcpyAsync(w_, r.w, nk * sizeof(float), cudaMemcpyDeviceToHost, stream));
  K3_CUDA_OK(cudaStreamSynchronize(stream));
  for (int64_t i = 0; i < n; ++i) x_[i] = Bf16ToFloat(hi_[i]) + (r.x.lo != 0 ? Bf16ToFloat(lo_[i]) : 0.0f);
  ExpertRequest host{r.layer, r.rows, r.width, r.top_k, x_.data(), idx_, w_};
  host.decode = r.decode;
  K3_ASSIGN_OR_RETURN(uint64_t ticket, host_.Submit(host));
  K3_RETURN_IF_ERROR(host_.Wait(ticket, sums_));
  K3_CUDA_OK(cudaMemcpyAsync(out, sums_, n * sizeof(float), cudaMemcpyHostToDevice, stream));
  // sums_ is reused by the next call: the copy must be done before we return.
  K3_CUDA_OK(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace k3::cuda
