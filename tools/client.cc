#include "tools/client.h"

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"

namespace k3 {

InferenceClient::InferenceClient(const std::string& address)
    : stub_(k3serve::v1::Inference::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}

InferenceClient::InferenceClient(std::shared_ptr<grpc::Channel> channel, std::string api_key)
    : stub_(k3serve::v1::Inference::NewStub(channel)), api_key_(std::move(api_key)) {}

k3serve::v1::GenerateRequest MakeGenerateRequest(const std::vector<int32_t>& prompt, const SamplingParams& p,
                                                 const std::string& model, const std::string& request_id) {
  k3serve::v1::GenerateRequest req;
  req.set_model(model);
  req.set_request_id(request_id);
  *req.mutable_prompt_ids() = {prompt.begin(), prompt.end()};
  req.set_max_tokens(p.max_new_tokens);
  auto* s = req.mutable_sampling();
  s->set_temperature(p.temperature);
  s->set_top_k(p.top_k);
  s->set_top_p(p.top_p);
  if (p.has_seed) s->mutable_seed()->set_value(p.seed);
  *s->mutable_stop_token_ids() = {p.stop_token_ids.begin(), p.stop_token_ids.end()};
  s->set_ignore_eos(p.ignore_eos);
  return req;
}

absl::StatusOr<GenerateResult> InferenceClient::Generate(const std::vector<int32_t>& prompt, const SamplingParams& p,
                                                         absl::Duration timeout,
                                                         const std::function<void(const std::vector<int32_t>&)>& on_tokens,
                                                         const std::string& model, const std::string& request_id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!api_key_.empty()) ctx.AddMetadata("authorization", "Bearer " + api_key_);
  auto reader = stub_->Generate(&ctx, MakeGenerateRequest(prompt, p, model, request_id));
  GenerateResult r;
  k3serve::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    std::vector<int32_t> chunk(resp.token_ids().begin(), resp.token_ids().end());
    r.tokens.insert(r.tokens.end(), chunk.begin(), chunk.end());
    if (on_tokens && !chunk.empty()) on_tokens(chunk);
    if (resp.finish_reason() != k3serve::v1::FINISH_REASON_UNSPECIFIED) {
      r.finish_reason = resp.finish_reason() == k3serve::v1::FINISH_REASON_STOP ? "stop" : "length";
      r.prompt_tokens = resp.usage().prompt_tokens();
      r.completion_tokens = resp.usage().completion_tokens();
    }
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok())
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), ": ",
                                     s.error_message()));
  return r;
}

}  // namespace k3
