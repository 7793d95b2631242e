#include "attention_service/multiplex_service.h"

#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_server.h"

namespace k3 {
namespace {

void SetEnd(v1::StreamChunk* c, const grpc::Status& s) {
  c->set_end(true);
  c->set_code(static_cast<int32_t>(s.error_code()));
  c->set_message(s.error_message());
}

}  // namespace

// One Multiplex call: reads the gateway's opens and cancels, and after each engine step writes
// what all its streams got in one message (what arrives while a write is in flight goes in the
// next). Loop thread only; it deletes itself once the call is done and its operations are through.
class MultiplexService::Call final : public InferenceService::Pumped {
 public:
  // Waits for the next call.
  explicit Call(MultiplexService* m) : m_(m), s_(m->inference_) {
    s_.CallStarted();
    ctx_.AsyncNotifyWhenDone(&done_);
    m_->RequestMultiplex(&ctx_, &rw_, s_.cq(), s_.cq(), &arrived_);
  }
  ~Call() override { s_.CallEnded(); }

  void Pump() override {
    const std::string* drain_end = s_.ended();
    for (auto it = streams_.begin(); it != streams_.end();) {
      InferenceService::Request& r = *it->second;
      if (drain_end != nullptr) {  // the drain timed out
        v1::StreamChunk* c = out_.pending.add_chunks();
        c->set_stream(it->first);
        SetEnd(c, s_.End(r, {grpc::StatusCode::UNAVAILABLE, *drain_end}, true));
        it = streams_.erase(it);
        continue;
      }
      std::vector<StepOutput> outputs = r.stream->Take();
      if (outputs.empty()) {
        ++it;
        continue;
      }
      v1::StreamChunk* c = out_.pending.add_chunks();
      c->set_stream(it->first);
      bool last = false;
      for (StepOutput& o : outputs) {
        grpc::Status end;
        if (!s_.Take(r, o, c->mutable_response(), &end)) continue;
        SetEnd(c, s_.End(r, end, false));
        last = true;
        break;
      }
      it = last ? streams_.erase(it) : std::next(it);
    }
    Flush();
  }

 private:
  void Arrived(bool ok) {
    if (!ok) {  // the server is shutting down: no call came
      delete this;
      return;
    }
    new Call(m_);  // for the next one
    arrived_ok_ = true;
    s_.AddPumped(this);
    reading_ = true;
    rw_.Read(&up_, &read_);
  }

  void ReadDone(bool ok) {
    reading_ = false;
    if (!ok) {  // the gateway is gone, or sends nothing more
      Close("the gateway went away");
      MaybeDelete();
      return;
    }
    for (v1::StreamOpen& o : *up_.mutable_open()) Open(o);
    for (uint64_t id : up_.cancel()) {
      auto it = streams_.find(id);
      if (it == streams_.end()) continue;  // it ended meanwhile
      s_.End(*it->second, InferenceService::ClientGone(it->second->deadline, "cancelled by the client"), true);
      streams_.erase(it);
    }
    Flush();
    reading_ = true;
    rw_.Read(&up_, &read_);
  }

  void Open(const v1::StreamOpen& o) {
    const absl::Time arrival = absl::Now();
    grpc::Status refused = auth::CheckApiKey(o.authorization());
    if (refused.ok() && streams_.count(o.stream()))
      refused = {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("stream ", o.stream(), " is already open on this call")};
    if (refused.ok()) {
      const absl::Time deadline =
          o.deadline_unix_micros() > 0 ? absl::FromUnixMicros(o.deadline_unix_micros()) : absl::InfiniteFuture();
      auto r = s_.Admit(o.request(), arrival, deadline, s_.bell());
      if (r.ok()) {
        streams_[o.stream()] = *std::move(r);
        return;
      }
      refused = ToGrpc(r.status());
    }
    v1::StreamChunk* c = out_.pending.add_chunks();
    c->set_stream(o.stream());
    SetEnd(c, s_.Finish(refused));
  }

  void WriteDone(bool ok) {
    out_.writing = false;
    if (!ok) Close("the gateway went away");
    Flush();
    MaybeDelete();
  }

  void FinishDone(bool) {
    finish_done_ = true;
    MaybeDelete();
  }

  void CallDone(bool) {
    call_done_ = true;
    if (ctx_.IsCancelled()) Close("the gateway went away");
    MaybeDelete();
  }

  // The gateway is gone: its streams' requests are freed, the call ends.
  void Close(const char* why) {
    if (closed_) return;
    closed_ = true;
    for (auto& [id, r] : streams_) s_.End(*r, InferenceService::ClientGone(r->deadline, why), true);
    streams_.clear();
    out_.pending.Clear();
    s_.RemovePumped(this);
    Flush();
  }

  void Flush() {
    out_.has_pending = out_.pending.chunks_size() > 0;
    if (closed_ && arrived_ok_ && !out_.end) out_.end = grpc::Status::OK;
    out_.Flush(rw_, !closed_, &wrote_, &finished_);
  }

  void MaybeDelete() {
    if (!call_done_ || out_.writing || reading_ || (arrived_ok_ && !finish_done_)) return;
    s_.RemovePumped(this);
    delete this;
  }

  MultiplexService* const m_;
  InferenceService& s_;
  grpc::ServerContext ctx_;
  grpc::ServerAsyncReaderWriter<v1::MultiplexDown, v1::MultiplexUp> rw_{&ctx_};
  using On = CqOn<Call>;
  On arrived_{this, &Call::Arrived}, read_{this, &Call::ReadDone}, wrote_{this, &Call::WriteDone},
      finished_{this, &Call::FinishDone}, done_{this, &Call::CallDone};
  bool arrived_ok_ = false, call_done_ = false, finish_done_ = false;
  bool reading_ = false, closed_ = false;
  v1::MultiplexUp up_;
  CoalescedWrites<v1::MultiplexDown> out_;
  std::map<uint64_t, std::unique_ptr<InferenceService::Request>> streams_;  // by the gateway's stream id
};

void MultiplexService::Start() { new Call(this); }

}  // namespace k3
