// A small blocking client of the public API (CLI, benchmarks, tests).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "engine/sampler.h"
#include "k3serve/v1/inference.grpc.pb.h"

namespace k3 {

struct GenerateResult {
  std::vector<int32_t> tokens;
  std::string finish_reason;  // "length", "stop"
  int prompt_tokens = 0;
  int completion_tokens = 0;
};

class InferenceClient {
 public:
  explicit InferenceClient(const std::string& address);
  // Over any channel (TLS: common/tls.h); a non-empty api_key goes out as authorization: Bearer.
  InferenceClient(std::shared_ptr<grpc::Channel> channel, std::string api_key);
  // Streams a generation; on_tokens sees each chunk as it arrives. The error names the gRPC code.
  absl::StatusOr<GenerateResult> Generate(const std::vector<int32_t>& prompt, const SamplingParams& p,
                                          absl::Duration timeout,
                                          const std::function<void(const std::vector<int32_t>&)>& on_tokens = nullptr,
                                          const std::string& model = "", const std::string& request_id = "");
  k3serve::v1::Inference::Stub& stub() { return *stub_; }

 private:
  std::unique_ptr<k3serve::v1::Inference::Stub> stub_;
  std::string api_key_;
};

// The request message for these arguments (also for tests that need to send odd ones).
k3serve::v1::GenerateRequest MakeGenerateRequest(const std::vector<int32_t>& prompt, const SamplingParams& p,
                                                 const std::string& model = "", const std::string& request_id = "");

}  // namespace k3
