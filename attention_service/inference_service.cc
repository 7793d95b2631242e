#include "attention_service/inference_service.h"

#include <chrono>
#include <optional>
#include <vector>

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

}  // namespace

InferenceService::InferenceService(InferenceOptions options, metrics::Registry& reg)
    : options_(std::move(options)), wake_(std::make_unique<CqOn<InferenceService>>(this, &InferenceService::Wake)) {
  // Rung by the engine thread after a step that gave a Generate stream output: one alarm wakes
  // the loop, however many streams got tokens.
  bell_ = std::make_shared<Bell>([this] {
    std::lock_guard<std::mutex> lock(alarm_mu_);
    if (alarm_set_ || stopped_ || cq_ == nullptr) return;
    alarm_set_ = true;
    alarm_.Set(cq_.get(), gpr_time_0(GPR_CLOCK_REALTIME), wake_.get());
  });
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

// IsCancelled() is true both when the client cancels and when its deadline passes; the status
// (and k3serve_requests_total's code) tells them apart. The client cancels the stream at its
// deadline, which the server's copy (taken on arrival, so later by the request's transit) may not
// have reached yet: a cancellation that close to the deadline is the deadline's.
grpc::Status InferenceService::ClientGone(absl::Time deadline, const char* what) {
  constexpr absl::Duration kTransitSlack = absl::Milliseconds(500);
  if (deadline <= absl::Now() + kTransitSlack) return {grpc::StatusCode::DEADLINE_EXCEEDED, "the client's deadline passed"};
  return {grpc::StatusCode::CANCELLED, what};
}

InferenceService::Request::~Request() {
  service->outstanding_tokens_ -= outstanding;
  --service->inflight_;
  if (name.empty()) return;
  std::lock_guard<std::mutex> lock(service->mu_);
  service->by_request_id_.erase(name);
}

absl::StatusOr<std::unique_ptr<InferenceService::Request>> InferenceService::Admit(const v1::GenerateRequest& req,
                                                                                   absl::Time arrival, absl::Time deadline,
                                                                                   std::shared_ptr<Bell> bell) {
  EngineLoop* loop = loop_.load();
  if (loop == nullptr) return absl::UnavailableError("the model is still loading");
  if (!req.model().empty() && req.model() != options_.model_name)
    return absl::InvalidArgumentError(
        absl::StrCat("model: unknown model \"", req.model(), "\"; this server serves \"", options_.model_name, "\""));
  if (req.max_tokens() <= 0) return absl::InvalidArgumentError(absl::StrCat("max_tokens must be > 0, got ", req.max_tokens()));
  if (req.max_tokens() > options_.max_tokens_limit)
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens = ", req.max_tokens(), " exceeds the limit ", options_.max_tokens_limit));
  SamplingParams p;
  const auto& s = req.sampling();
  p.max_new_tokens = req.max_tokens();
  p.temperature = s.temperature();
  p.top_k = s.top_k();
  p.top_p = s.top_p() == 0.0f ? 1.0f : s.top_p();
  p.has_seed = s.has_seed();
  p.seed = s.seed().value();
  p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  p.ignore_eos = s.ignore_eos();
  p.deadline = deadline;
  if (!options_.ready()) return absl::UnavailableError("experts are not placed yet (no complete placement)");
  if (draining_) {
    ++refused_draining_;
    return absl::UnavailableError("attention node is draining (takes no new requests)");
  }

  auto r = std::make_unique<Request>();
  r->service = this;
  r->id = next_id_++;
  r->prompt_tokens = req.prompt_ids_size();
  r->arrival = r->last = arrival;
  r->deadline = deadline;
  // Outstanding work, for the gateway's choice of node: what is left of this request.
  r->outstanding = req.prompt_ids_size() + req.max_tokens();
  outstanding_tokens_ += r->outstanding;
  ++inflight_;
  if (!req.request_id().empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!by_request_id_.emplace(req.request_id(), r->id).second)
      return absl::AlreadyExistsError(absl::StrCat("request_id \"", req.request_id(), "\" is already live"));
    r->name = req.request_id();
  }
  r->stream = loop->Add(r->id, {req.prompt_ids().begin(), req.prompt_ids().end()}, p, std::move(bell));
  return r;
}

bool InferenceService::Take(Request& r, StepOutput& o, v1::GenerateResponse* resp, grpc::Status* end) {
  const absl::Time now = absl::Now();
  if (!r.prompt_counted && o.finish != FinishReason::kError) {  // the engine took it
    r.prompt_counted = true;
    m_prompt_tokens_->Inc(r.prompt_tokens);
  }
  for (int32_t t : o.tokens) {
    resp->add_token_ids(t);
    const double gap = absl::ToDoubleSeconds(now - r.last);
    if (r.generated++ == 0) {
      m_ttft_->Observe(gap);
      r.outstanding -= r.prompt_tokens;
      outstanding_tokens_ -= r.prompt_tokens;
    } else {
      m_itl_->Observe(gap);
      std::lock_guard<std::mutex> lock(itl_mu_);
      itl_sum_ += gap;
      ++itl_count_;
    }
    --r.outstanding;
    --outstanding_tokens_;
    r.last = now;
  }
  m_generated_tokens_->Inc(static_cast<double>(o.tokens.size()));
  if (o.finish == FinishReason::kError) {
    m_e2e_->Observe(absl::ToDoubleSeconds(now - r.arrival));
    *end = ToGrpc(o.error);
    return true;
  }
  if (o.finish == FinishReason::kAborted) {
    *end = {grpc::StatusCode::CANCELLED, "aborted"};
    return true;
  }
  if (o.finish == FinishReason::kNone) return false;
  resp->set_finish_reason(ToProto(o.finish));
  resp->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(o.prompt_tokens));
  resp->mutable_usage()->set_completion_tokens(static_cast<int32_t>(o.generated_tokens));
  m_e2e_->Observe(absl::ToDoubleSeconds(now - r.arrival));
  *end = grpc::Status::OK;
  return true;
}

grpc::Status InferenceService::End(Request& r, const grpc::Status& s, bool abort) {
  if (EngineLoop* loop = loop_.load(); abort && loop != nullptr) loop->Abort(r.id);
  return Finish(s);
}

// One Generate call. Tokens go out as the engine gives them; those that arrive while a write is in
// flight go out together in the next one. Loop thread only; it deletes itself once the call is
// done and its operations are through.
class InferenceService::Stream final : public InferenceService::Pumped {
 public:
  // Waits for the next Generate.
  explicit Stream(InferenceService* s) : s_(s) {
    s_->CallStarted();
    ctx_.AsyncNotifyWhenDone(&done_);
    s_->RequestGenerate(&ctx_, &req_, &writer_, s_->cq_.get(), s_->cq_.get(), &arrived_);
  }
  ~Stream() override { s_->CallEnded(); }

  // After an engine step: what the request got, or the end the drain's timeout gives it.
  void Pump() override {
    if (const std::string* msg = s_->ended()) {
      EndRequest({grpc::StatusCode::UNAVAILABLE, *msg}, true);
      return;
    }
    for (StepOutput& o : r_->stream->Take()) {
      grpc::Status end;
      const bool last = s_->Take(*r_, o, &out_.pending, &end);
      out_.has_pending = out_.pending.token_ids_size() > 0 || out_.pending.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
      if (last) {
        EndRequest(end, false);
        return;
      }
    }
    Flush();
  }

 private:
  void Arrived(bool ok) {
    if (!ok) {  // the server is shutting down: no call came
      delete this;
      return;
    }
    new Stream(s_);  // for the next one
    arrived_ok_ = true;
    const absl::Time arrival = absl::Now();
    if (auto st = auth::RequireApiKey(ctx_); !st.ok()) {
      EndWith(s_->Finish(st));
      return;
    }
    if (ctx_.deadline() != std::chrono::system_clock::time_point::max()) deadline_ = absl::FromChrono(ctx_.deadline());
    auto admitted = s_->Admit(req_, arrival, deadline_, s_->bell_);
    if (!admitted.ok()) {
      EndWith(s_->Finish(ToGrpc(admitted.status())));
      return;
    }
    r_ = *std::move(admitted);
    s_->live_.insert(this);
  }

  // The request is over (counted with `st`); the call ends once what is pending is written.
  void EndRequest(const grpc::Status& st, bool abort) {
    s_->live_.erase(this);
    ended_ = true;
    EndWith(s_->End(*r_, st, abort));
  }

  void WriteDone(bool ok) {
    out_.writing = false;
    if (!ok && !ended_) {  // the client went away: free the sequence
      out_.has_pending = false;
      EndRequest(ClientGone(deadline_, "stream closed by the client"), true);
    }
    Flush();
    MaybeDelete();
  }

  void FinishDone(bool) {
    finish_done_ = true;
    MaybeDelete();
  }

  // The call is over: finished, or cancelled by the client or its deadline.
  void CallDone(bool) {
    call_done_ = true;
    if (ctx_.IsCancelled()) {
      cancelled_ = true;
      out_.has_pending = false;
      if (r_ && !ended_) EndRequest(ClientGone(deadline_, "cancelled by the client"), true);
      Flush();
    }
    MaybeDelete();
  }

  void MaybeDelete() {
    if (!call_done_ || out_.writing || (arrived_ok_ && !finish_done_)) return;
    delete this;  // (the request, if any, has ended: CallDone saw to it)
  }

  void EndWith(const grpc::Status& st) {
    if (out_.end) return;
    out_.end = st;
    Flush();
  }

  void Flush() { out_.Flush(writer_, !cancelled_, &wrote_, &finished_); }

  InferenceService* const s_;
  grpc::ServerContext ctx_;
  v1::GenerateRequest req_;
  grpc::ServerAsyncWriter<v1::GenerateResponse> writer_{&ctx_};
  CqOn<Stream> arrived_{this, &Stream::Arrived}, wrote_{this, &Stream::WriteDone}, finished_{this, &Stream::FinishDone},
      done_{this, &Stream::CallDone};
  bool arrived_ok_ = false, call_done_ = false, finish_done_ = false;
  absl::Time deadline_ = absl::InfiniteFuture();
  std::unique_ptr<Request> r_;  // kept until the call is gone: inflight() counts it
  bool ended_ = false, cancelled_ = false;
  CoalescedWrites<v1::GenerateResponse> out_;
};

void InferenceService::Serve(std::unique_ptr<grpc::ServerCompletionQueue> cq) {
  {
    std::lock_guard<std::mutex> lock(alarm_mu_);
    cq_ = std::move(cq);
  }
  new Stream(this);
  cq_thread_ = std::thread([this] { Loop(); });
}

void InferenceService::Loop() {
  void* tag;
  bool ok;
  while (cq_->Next(&tag, &ok)) static_cast<CqEvent*>(tag)->Done(ok);
}

void InferenceService::Wake(bool) {
  {
    std::lock_guard<std::mutex> lock(alarm_mu_);
    alarm_set_ = false;
  }
  const std::vector<Pumped*> calls(live_.begin(), live_.end());  // Pump may take one out
  for (Pumped* c : calls) c->Pump();
}

void InferenceService::Stop() {
  {
    std::lock_guard<std::mutex> lock(alarm_mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  if (cq_ == nullptr) return;
  // After the server's Shutdown its calls end; the queue goes once they are through.
  for (int i = 0; i < 500 && live_calls_ > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  cq_->Shutdown();
  cq_thread_.join();
}

InferenceService::~InferenceService() { Stop(); }

void InferenceService::SetDraining() { draining_ = true; }

void InferenceService::EndRemaining(std::string message) {
  end_message_ = std::move(message);
  end_remaining_ = true;
  bell_->Ring();  // the Generate streams see it at once
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
