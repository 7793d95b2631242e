// Attention and experts in two processes on one GPU, over CUDA IPC: the rows, top-k ids, weights and partial
// sums stay in device memory that both processes map (cudaIpcMemHandle_t); the two streams are ordered by
// interprocess events (cudaIpcEventHandle_t); a Unix socket carries one small frame a MoE layer each way and is
// the liveness signal. NCCL cannot put two ranks on one GPU, and HostExpertBridge copies every layer's rows
// through the host; here no row leaves the device.
//
// Per MoE layer, on the attention side's stream: copy x (hi and lo planes), idx and w into the shared input
// buffer, record event A, send the frame (sequence number, layer, rows, width, top_k). The expert side makes its
// stream wait for A, enqueues its experts (CudaModel::local_experts()) and records B, and replies once that is
// enqueued (not run); the attention side makes its stream wait for B and copies the sums into the engine's
// buffer. One set of buffers is enough: the next layer's input is copied after B (the experts have read this
// one), and the next layer's sums are written after its A (the attention stream has copied these out).
//
// Each wait is either on the GPU (cudaStreamWaitEvent: the host runs ahead) or on the host (cudaEventQuery until
// done, then enqueue): IpcOptions. Without MPS two processes' contexts share the GPU by time slices, and a stream
// blocked on the other process's event for long keeps its slices; the default waits on both hosts (measured in
// engine/cuda/README.md).
//
// The attention side owns every buffer and both events; the expert process only maps them, so the attention
// process never touches memory of a process that may die. A dead expert process (EOF, or no reply within
// dispatch_timeout) makes Run return UNAVAILABLE naming it, then and ever after; the engine keeps serving
// with a new IpcRemoteExperts. A kill between steps is seen at the next dispatch before anything is enqueued;
// with the attention side's wait on the GPU, a process killed after it queued record(B) and before its GPU work
// ran would leave the attention stream waiting on B (with the default host wait, the spin sees the EOF).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/status.h"
#include "engine/config.h"
#include "engine/cuda/cuda_model.h"

namespace k3::cuda {

// What the expert process builds: the attention side's model again (so its experts are bitwise the same), with
// its routed experts.
struct IpcModelSpec {
  std::string model_dir;    // a checkpoint (CudaModel::Load), or
  std::string config_json;  // config.json's text, random weights (CudaModel::CreateRandom)
  uint64_t seed = 1;
  bool experts_mxfp4 = false;         // ModelConfig::expert_format = kMxfp4 (random weights)
  bool share_routed_experts = false;  // CudaModelOptions::share_routed_experts
};

struct IpcOptions {
  int device = 0;
  int64_t max_rows = 4096;  // rows a dispatch may carry (the engine's max_batch_tokens)
  absl::Duration setup_timeout = absl::Seconds(180);  // the expert process builds its model in this time
  absl::Duration dispatch_timeout = absl::Seconds(10);
  absl::Duration spin = absl::Microseconds(30);  // poll the socket busily this long before sleeping in poll(2)
  // How each side waits for the other's event. false: on the GPU (cudaStreamWaitEvent), so that the host runs
  // ahead. true: on the host (cudaEventQuery until it is done), then enqueue, so that this side's context does not
  // hold the GPU with a stream blocked on the other's event. Two processes' contexts on one GPU share it by time
  // slices, and a context whose stream waits on an event can keep its slice: measured on an H200 with both waits
  // on the GPU, a dispatch took 0.3–2.2 ms more than the experts' compute (README).
  bool attention_host_waits = true;  // for the sums (B)
  bool expert_host_waits = true;     // for the rows (A)
};

// Where a dispatch's time goes, summed over the dispatches of one MoE layer (SetTiming on).
struct IpcStageStats {
  int64_t dispatches = 0;
  double pack_ms = 0;        // attention GPU: x, idx, w into the shared buffer
  double wait_ms = 0;        // attention GPU: event A recorded → wait(B) passed (the experts and the switch of contexts)
  double unpack_ms = 0;      // attention GPU: the sums into the engine's buffer
  double round_trip_ms = 0;  // attention host: frame sent → reply read
  double expert_ms = 0;      // expert GPU: its experts (events in the expert process)
  double expert_host_ms = 0; // expert host: frame read → reply sent (waiting for A too, expert_host_waits)
  double sums_host_ms = 0;   // attention host: reply read → B seen done (attention_host_waits)
};

// Set in the environment of a process started as the expert process: the socket's file descriptor.
inline constexpr char kIpcExpertFdEnv[] = "K3SERVE_IPC_EXPERT_FD";

// The attention side: a CudaExpertExecutor whose experts run in an expert process it starts (this executable
// again, which must call ServeIpcExpertsIfChild first thing in main).
class IpcRemoteExperts final : public CudaExpertExecutor {
 public:
  // Starts the expert process with spec, maps the buffers and events there; config gives the shapes.
  // UNAVAILABLE / DEADLINE_EXCEEDED when it does not come up; the expert's own error when its model fails.
  static absl::StatusOr<std::unique_ptr<IpcRemoteExperts>> Spawn(const ModelConfig& config, const IpcModelSpec& spec,
                                                                 const IpcOptions& options = {});
  // Hangs up (the expert process exits), waits for it a few seconds, then kills it.
  ~IpcRemoteExperts() override;

  // Enqueues the dispatch on stream (every dispatch of one IpcRemoteExperts on one stream); returns once the
  // experts are queued in the expert process. INVALID_ARGUMENT for a request of another shape or more rows than
  // max_rows; UNAVAILABLE once the expert process is gone.
  absl::Status Run(const CudaExpertRequest& request, float* out, cudaStream_t stream) override;
  absl::Status status() const;

  // Records events around every stage of the dispatches that follow (off: none).
  void SetTiming(bool on);
  // The stages of the timed dispatches since the last call, per layer; waits for their events on both sides.
  absl::StatusOr<std::map<int64_t, IpcStageStats>> TakeStats();

  int pid() const;
  const std::string& peer() const;  // "expert process <pid>"

  struct Impl;

 private:
  explicit IpcRemoteExperts(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// In a process started by IpcRemoteExperts::Spawn (kIpcExpertFdEnv set): builds the model, serves its experts
// until the attention side hangs up, and returns the exit status for main. Elsewhere returns −1 at once.
int ServeIpcExpertsIfChild();

}  // namespace k3::cuda
