#include "attention_service/inference_service.h"

#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_server.h"

namespace k3 {
namespace {

v1::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStop: return v1::FINISH_REASON_STOP;
    default: return v1::FINISH_REASON_UNSPECIFIED;
  }
}

grpc::Status Invalid(const std::string& msg) { return {grpc::StatusCode::INVALID_ARGUMENT, msg}; }

// IsCancelled() is true both when the client cancels and when its deadline passes; the status
// (and k3serve_requests_total's code) tells them apart. The client cancels the stream at its
// deadline, which the server's copy (taken on arrival, so later by the request's transit) may not
// have reached yet: a cancellation that close to the deadline is the deadline's.
grpc::Status ClientGone(const grpc::ServerContext& ctx, const char* what) {
  constexpr auto kTransitSlack = std::chrono::milliseconds(500);
  if (ctx.deadline() <= std::chrono::system_clock::now() + kTransitSlack)
    return {grpc::StatusCode::DEADLINE_EXCEEDED, "the client's deadline passed"};
  return {grpc::StatusCode::CANCELLED, what};
}

}  // namespace

InferenceService::InferenceService(InferenceOptions options, metrics::Registry& reg) : options_(std::move(options)) {
  const auto latency = metrics::ExponentialBuckets(1e-4, 2, 18);  // 0.1 ms .. 13 s
  m_requests_ = metrics::Must(reg.AddCounter("k3serve_requests_total", "Generate requests by final gRPC status.", {"code"}));
  m_ttft_ = &metrics::Must(reg.AddHistogram("k3serve_time_to_first_token_seconds", "From request arrival to its first token.", latency))->WithLabels();
  m_itl_ = &metrics::Must(reg.AddHistogram("k3serve_inter_token_latency_seconds", "Between consecutive tokens of a request.", latency))->WithLabels();
  m_e2e_ = &metrics::Must(reg.AddHistogram("k3serve_request_duration_seconds", "From request arrival to its end.", latency))->WithLabels();
  m_prompt_tokens_ = &metrics::Must(reg.AddCounter("k3serve_prompt_tokens_total", "Prompt tokens of admitted requests."))->WithLabels();
  m_generated_tokens_ = &metrics::Must(reg.AddCounter("k3serve_generation_tokens_total", "Generated tokens."))->WithLabels();
}

void InferenceService::Attach(const ModelConfig& config, EngineLoop& loop) {
  loop_ = &loop;  // first: GetModelInfo reads the loop once it sees the config
  config_ = &config;
}

grpc::Status InferenceService::Finish(const grpc::Status& s) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                                 "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int code = static_cast<int>(s.error_code());
  m_requests_->WithLabels({code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN"}).Inc();
  return s;
}

grpc::Status InferenceService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                        grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const absl::Time arrival = absl::Now();
  if (auto s = auth::RequireApiKey(*ctx); !s.ok()) return Finish(s);
  EngineLoop* loop = loop_.load();
  if (loop == nullptr) return Finish({grpc::StatusCode::UNAVAILABLE, "the model is still loading"});
  if (!req->model().empty() && req->model() != options_.model_name)
    return Finish(Invalid(absl::StrCat("model: unknown model \"", req->model(), "\"; this server serves \"",
                                       options_.model_name, "\"")));
  if (req->max_tokens() <= 0) return Finish(Invalid(absl::StrCat("max_tokens must be > 0, got ", req->max_tokens())));
  if (req->max_tokens() > options_.max_tokens_limit)
    return Finish(Invalid(absl::StrCat("max_tokens = ", req->max_tokens(), " exceeds the limit ", options_.max_tokens_limit)));
  SamplingParams p;
  const auto& s = req->sampling();
  p.max_new_tokens = req->max_tokens();
  p.temperature = s.temperature();
  p.top_k = s.top_k();
  p.top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  p.has_seed = s.has_seed();
  p.seed = s.seed().value();
  p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  p.ignore_eos = s.ignore_eos();
  if (ctx->deadline() != std::chrono::system_clock::time_point::max()) p.deadline = absl::FromChrono(ctx->deadline());
  if (!options_.ready()) return Finish({grpc::StatusCode::UNAVAILABLE, "experts are not placed yet (no complete placement)"});
  if (draining_) {
    ++refused_draining_;
    return Finish({grpc::StatusCode::UNAVAILABLE, "attention node is draining (takes no new requests)"});
  }

  const uint64_t id = next_id_++;
  if (!req->request_id().empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!by_request_id_.emplace(req->request_id(), id).second)
      return Finish({grpc::StatusCode::ALREADY_EXISTS, absl::StrCat("request_id \"", req->request_id(), "\" is already live")});
  }
  auto release_name = [&] {
    if (req->request_id().empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    by_request_id_.erase(req->request_id());
  };
  auto stream = loop->Add(id, {req->prompt_ids().begin(), req->prompt_ids().end()}, p);
  if (!stream.ok()) {
    release_name();
    return Finish(ToGrpc(stream.status()));
  }
  m_prompt_tokens_->Inc(req->prompt_ids_size());
  // Outstanding work, for the gateway's choice of node: what is left of this request.
  int64_t outstanding = req->prompt_ids_size() + req->max_tokens();
  outstanding_tokens_ += outstanding;
  ++inflight_;
  struct Live {
    InferenceService* s;
    int64_t& outstanding;
    ~Live() {
      s->outstanding_tokens_ -= outstanding;
      --s->inflight_;
    }
  } live{this, outstanding};

  absl::Time last = arrival;
  int generated = 0;
  while (true) {
    if (end_remaining_) {  // the drain timed out
      loop->Abort(id);
      release_name();
      return Finish({grpc::StatusCode::UNAVAILABLE, end_message_});
    }
    if (ctx->IsCancelled()) {  // client cancel or deadline: free the sequence
      loop->Abort(id);
      release_name();
      return Finish(ClientGone(*ctx, "cancelled by the client"));
    }
    for (StepOutput& o : (*stream)->Next(std::chrono::milliseconds(50))) {
      v1::GenerateResponse resp;
      const absl::Time now = absl::Now();
      for (int32_t t : o.tokens) {
        resp.add_token_ids(t);
        const double gap = absl::ToDoubleSeconds(now - last);
        if (generated++ == 0) {
          m_ttft_->Observe(gap);
          const int64_t prefilled = req->prompt_ids_size();
          outstanding -= prefilled;
          outstanding_tokens_ -= prefilled;
        } else {
          m_itl_->Observe(gap);
          std::lock_guard<std::mutex> lock(itl_mu_);
          itl_sum_ += gap;
          ++itl_count_;
        }
        --outstanding;
        --outstanding_tokens_;
        last = now;
      }
      m_generated_tokens_->Inc(static_cast<double>(o.tokens.size()));
      if (o.finish == FinishReason::kError) {
        release_name();
        m_e2e_->Observe(absl::ToDoubleSeconds(now - arrival));
        return Finish(ToGrpc(o.error));
      }
      if (o.finish == FinishReason::kAborted) {
        release_name();
        return Finish({grpc::StatusCode::CANCELLED, "aborted"});
      }
      if (o.finish != FinishReason::kNone) {
        resp.set_finish_reason(ToProto(o.finish));
        resp.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(o.prompt_tokens));
        resp.mutable_usage()->set_completion_tokens(static_cast<int32_t>(o.generated_tokens));
      }
      if (!writer->Write(resp)) {  // the client went away
        loop->Abort(id);
        release_name();
        return Finish(ClientGone(*ctx, "stream closed by the client"));
      }
      if (o.finish != FinishReason::kNone) {
        release_name();
        m_e2e_->Observe(absl::ToDoubleSeconds(now - arrival));
        return Finish(grpc::Status::OK);
      }
    }
  }
}

void InferenceService::SetDraining() { draining_ = true; }

void InferenceService::EndRemaining(std::string message) {
  end_message_ = std::move(message);
  end_remaining_ = true;
}

double InferenceService::TakeMeanItl() {
  std::lock_guard<std::mutex> lock(itl_mu_);
  const double mean = itl_count_ > 0 ? itl_sum_ / itl_count_ : 0.0;
  itl_sum_ = 0;
  itl_count_ = 0;
  return mean;
}

grpc::Status InferenceService::Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req, v1::AbortResponse* resp) {
  if (auto s = auth::RequireApiKey(*ctx); !s.ok()) return s;
  if (req->request_id().empty()) return Invalid("request_id must not be empty");
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_request_id_.find(req->request_id());
    if (it != by_request_id_.end()) id = it->second;
  }
  resp->set_found(id != 0);
  if (EngineLoop* loop = loop_.load(); id != 0 && loop != nullptr) loop->Abort(id);
  return grpc::Status::OK;
}

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest*, v1::ModelInfo* resp) {
  if (auto s = auth::RequireApiKey(*ctx); !s.ok()) return s;
  const ModelConfig* config = config_.load();
  if (config == nullptr) return {grpc::StatusCode::UNAVAILABLE, "the model is still loading"};
  const ModelConfig& c = *config;
  resp->set_name(options_.model_name);
  resp->set_vocab_size(c.vocab_size);
  resp->set_max_context(loop_.load()->max_context());
  resp->set_max_tokens_limit(options_.max_tokens_limit);
  resp->set_num_layers(c.num_layers);
  resp->set_num_experts(c.num_experts);
  resp->set_experts_per_token(c.top_k);
  for (int64_t e : c.eos_token_ids) resp->add_eos_token_ids(static_cast<int32_t>(e));
  const auto [mode, bias_version] = options_.routing();
  resp->set_routing_mode(mode);
  resp->set_routing_bias_version(bias_version);
  return grpc::Status::OK;
}

}  // namespace k3
