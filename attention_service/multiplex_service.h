// TokenStreams: the gateway's many Generate streams over one call. The tokens of one engine step
// for all of the call's streams go out in one message, so the node and the gateway pay gRPC's
// per-message cost once per step, not once per token and stream.
#pragma once

#include "attention_service/inference_service.h"
#include "k3serve/v1/gateway.grpc.pb.h"

namespace k3 {

// Asynchronous, on the inference service's completion queue and thread: woken with its Generate
// streams once per engine step.
class MultiplexService final : public v1::TokenStreams::WithAsyncMethod_Multiplex<v1::TokenStreams::Service> {
 public:
  // The requests are InferenceService's: the same checks, metrics, drain and Abort.
  explicit MultiplexService(InferenceService& inference) : inference_(inference) {}
  // Starts taking calls (after the inference service's Serve).
  void Start();

 private:
  class Call;
  InferenceService& inference_;
};

}  // namespace k3
