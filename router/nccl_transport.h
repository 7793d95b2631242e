// The NCCL data plane: GPU to GPU (NVLink on one host), device buffers on both sides, no host copies
// of rows or sums. It does the three jobs of the data plane (DESIGN §3) — send rows to an expert
// node, receive its partial sums, learn of a dead peer — for GPU attention and expert nodes; the
// byte-oriented Transport (router/transport.h, UCX) stays for CPU nodes and for hosts without
// NVLink. It plugs into the GPU engine where the engine's MoE cut is, as a CudaExpertExecutor: the
// attention node's rows, top-k ids and weights never leave the device, and the expert node's sums
// land in the engine's buffer.
//
// One two-rank communicator per (attention node, expert node) pair, set up through the control
// plane (router/nccl_rendezvous.h: the attention node makes the ncclUniqueId and is rank 0). Each
// dispatch is one NCCL group on the engine's stream: a frame (router/nccl_frame.h), x's hi and lo
// planes, idx and w out, the sums back; the expert node reads the frame, receives the arrays, runs
// its experts and sends the sums.
//
// Failure: NCCL does not notice a dead peer on NVLink (its kernels would wait forever), so
// communicators are non-blocking (ncclConfig_t::blocking = 0) and a watchdog aborts one
// (ncclCommAbort, which ends its kernels) when the peer's control stream breaks (a SIGKILLed peer:
// within milliseconds), when a dispatch has not come back within dispatch_timeout, or when NCCL
// reports an asynchronous error. The forward that was in flight then completes with garbage sums,
// so its caller asks status() after each forward: UNAVAILABLE means that step (and the sequences in
// it) is lost; later dispatches fail at once, and the attention node keeps serving with a new
// NcclRemoteExperts once a replacement expert node is there.
//
// NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set for the process (unless already set)
// before the first communicator.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "engine/config.h"
#include "engine/cuda/cuda_model.h"
#include "router/nccl_frame.h"

namespace k3::dataplane {

struct NcclOptions {
  absl::Duration connect_timeout = absl::Seconds(60);  // the rendezvous and the communicator's init
  absl::Duration dispatch_timeout = absl::Seconds(10);  // rows out to sums back; then the link is aborted
};

// Sets NCCL_NVLS_ENABLE=0 unless the environment sets it; every constructor below calls it.
void DisableNvlinkMulticast();

class NcclLink;  // a communicator and its watchdog (nccl_transport.cc)

// The attention node's side: the routed experts of one expert node, over NCCL.
class NcclRemoteExperts final : public cuda::CudaExpertExecutor {
 public:
  // Opens a communicator with the expert node whose NcclBootstrap is at address; this rank on
  // `device` (the engine's). UNAVAILABLE / DEADLINE_EXCEEDED when it cannot be set up in time.
  static absl::StatusOr<std::unique_ptr<NcclRemoteExperts>> Connect(const ModelConfig& config,
                                                                    const std::string& address, int device,
                                                                    const NcclOptions& options = {},
                                                                    const std::string& client_id = "attention");
  // Tells the expert node the session is over, then frees the communicator.
  ~NcclRemoteExperts() override;

  // Enqueues the dispatch on stream (all dispatches of one NcclRemoteExperts on one stream).
  // UNAVAILABLE once the link has failed; INVALID_ARGUMENT for a request the expert node would
  // refuse (its shape, more rows than it takes, a plain bf16 x).
  absl::Status Run(const cuda::CudaExpertRequest& request, float* out, cudaStream_t stream) override;
  // OK while every dispatch so far has come back; else why the link failed (UNAVAILABLE).
  absl::Status status() const;
  // The expert node's timings (all its sessions) since the last call; waits for them.
  absl::StatusOr<NcclExpertStats> TakeExpertStats();

  const std::string& node_id() const;
  int64_t max_rows() const;

  struct Impl;

 private:
  explicit NcclRemoteExperts(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The expert node's side: serves a CudaExpertExecutor on `device` (a CudaModel's local_experts)
// to every attention node that opens a communicator through the NcclBootstrap at `address`. Each
// session has its own thread and stream; the experts run on one compute stream, one dispatch at a
// time, in arrival order.
class NcclExpertServer {
 public:
  struct Config {
    std::string address = "127.0.0.1:0";
    std::string node_id = "expert";
    int device = 0;
    int64_t max_rows = 0;  // what the executor takes (CudaModel: max_batch_tokens)
    NcclOptions options;
  };
  static absl::StatusOr<std::unique_ptr<NcclExpertServer>> Start(const ModelConfig& model,
                                                                 cuda::CudaExpertExecutor& experts,
                                                                 const Config& config);
  // Aborts every session and stops serving.
  ~NcclExpertServer();

  const std::string& address() const;  // the NcclBootstrap's "host:port"
  int sessions() const;                // open sessions

  struct Impl;

 private:
  explicit NcclExpertServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::dataplane
