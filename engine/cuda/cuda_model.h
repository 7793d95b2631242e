// The whole model on one GPU (DESIGN §1, §2): bf16 weights, split-bf16 activations into every product
// (kernels/cuda/split.cuh), an fp32 residual stream and fp32 recurrent state. CudaModel::Forward runs a ragged
// batch of sequence chunks — prefill chunks and decode tokens of different sequences together — as
// k3::Model::Forward does, over per-sequence state held on the device in pools indexed by slot: the KDA state
// and conv state of every KDA layer, the MLA latent cache of every MLA layer.
//
// Every MoE layer is cut where DESIGN §8 cuts it: the router, top-k and latent down-projection before, the
// latent norm, up-projection and shared experts after, and a CudaExpertExecutor in between (in-process grouped
// products by default; a remote one plugs in through SetExpertExecutor).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/model.h"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {

struct CudaModelOptions {
  int64_t max_seqs = 64;            // state slots
  int64_t max_context = 4096;       // tokens per sequence (the rows of a slot's MLA latent cache)
  int64_t max_batch_tokens = 4096;  // tokens per Forward
  int device = 0;
  // false: the routed experts stay on expert nodes (an attention node); a CudaExpertExecutor must be
  // set before the first Forward.
  bool routed_experts = true;
  // Benchmarks of models larger than the GPU (k3-mini): every MoE layer uses the first MoE layer's routed
  // experts. Each layer still streams its experts from HBM (a layer's bank, tens of GB, is far larger than L2),
  // so decode time is that of distinct weights; the logits are not those of any checkpoint.
  bool share_routed_experts = false;
  // Decode-only batches run as CUDA graphs, one per (tokens, logit rows), captured on first use.
  bool cuda_graphs = true;
};

// One sequence's tokens in a batch (as k3::SeqChunk); its state is the slot's.
struct GpuChunk {
  int32_t slot = -1;
  std::span<const int32_t> tokens;
  LogitsMode logits = LogitsMode::kLast;
};

// The rows of one MoE layer for the routed experts (device pointers, valid during Run).
struct CudaExpertRequest {
  int64_t layer = 0;
  int64_t rows = 0;
  int64_t width = 0;  // ℓ (latent) or d
  int64_t top_k = 0;
  Split x;                        // [rows, width]
  const int32_t* idx = nullptr;   // [rows, top_k]; −1: not routed
  const float* w = nullptr;       // [rows, top_k]
  bool decode = false;            // every row a sequence's one new token (ExpertRequest::decode)
};

class CudaExpertExecutor {
 public:
  virtual ~CudaExpertExecutor() = default;
  // Enqueues out [rows, width] (fp32, device) = Σ_j w[n, j] · E_idx[n, j](x[n]) on stream.
  virtual absl::Status Run(const CudaExpertRequest& request, float* out, cudaStream_t stream) = 0;
};

class TensorSource;  // where the weights come from (cuda_model.cc)

class CudaModel {
 public:
  // Loads config.json and the checkpoint (fp32 or bf16; names and shapes checked by k3::LoadWeights) onto
  // the device in bf16, and sizes the state pools and work buffers from the options.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Load(const std::string& dir, const CudaModelOptions& options = {});
  // The config's shapes with random weights drawn on the device (benchmarks without a checkpoint).
  static absl::StatusOr<std::unique_ptr<CudaModel>> CreateRandom(const ModelConfig& config, uint64_t seed,
                                                                 const CudaModelOptions& options = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const ModelConfig& config() const;
  const CudaModelOptions& options() const;

  // A free slot, its state zeroed (position 0). RESOURCE_EXHAUSTED when all max_seqs are taken.
  absl::StatusOr<int32_t> AllocSlot();
  absl::Status FreeSlot(int32_t slot);
  int64_t position(int32_t slot) const;

  // Runs the batch; logits holds, chunk by chunk, 0, 1 or n rows of vocab_size (host fp32).
  absl::Status Forward(std::span<const GpuChunk> chunks, std::vector<float>* logits);
  // Same, with the argmax of each logits row taken on the device (greedy decoding).
  absl::Status ForwardGreedy(std::span<const GpuChunk> chunks, std::vector<int32_t>* ids);

  // Greedy decoding with the host off the GPU's critical path (the overlap scheduling of SGLang and vLLM, for a
  // fixed batch). After a ForwardGreedy of a decode-only batch (one token a sequence, each with its row kept),
  // NextGreedy enqueues the next step of the same sequences — its tokens the last step's greedy ids, taken on
  // the device, its positions one further — and then returns those tokens (the last step's ids) once they reach
  // the host, which is while the new step runs: the GPU does not wait between steps for the host to read the
  // ids and launch the next one. LastGreedy waits for the newest step and returns its ids. The ids are the ones
  // ForwardGreedy step by step would give. FAILED_PRECONDITION without such a batch to continue (another forward,
  // a freed slot, profiling, remote experts or CUDA graphs off end it); RESOURCE_EXHAUSTED at max_context.
  absl::Status NextGreedy(std::vector<int32_t>* prev_ids);
  absl::Status LastGreedy(std::vector<int32_t>* ids);

  // Replaces the in-process routed experts (not owned; null restores them).
  void SetExpertExecutor(CudaExpertExecutor* experts);
  // The in-process routed experts (what an expert process serves over NCCL: router/nccl_transport.h), for
  // requests of up to max_batch_tokens rows on this model's device; null when they are not loaded.
  CudaExpertExecutor* local_experts();

  // Bytes of weights held on the device, and of one routed expert among them (bf16, or MXFP4's codes and scales).
  int64_t weight_bytes() const;
  int64_t expert_bytes() const;
  // Bytes of weights the last forward had to read: all but the embedding table (its gathered rows aside),
  // with the routed experts it hit (in-process experts only).
  absl::StatusOr<int64_t> LastForwardWeightBytes() const;

  // Per-stage device time (CUDA events around each stage of every forward while on), in ms since the last
  // call: where a decode step goes.
  void SetProfiling(bool on);
  std::vector<std::pair<std::string, double>> TakeProfile();

  struct Impl;

 private:
  explicit CudaModel(std::unique_ptr<Impl> impl);
  static absl::StatusOr<std::unique_ptr<CudaModel>> Create(const ModelConfig& config, TensorSource& source,
                                                           const CudaModelOptions& options);
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::cuda
