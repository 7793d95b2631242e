#include "attention_service/multiplex_service.h"

#include <map>
#include <mutex>
#include <thread>
#include <vector>

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

grpc::Status MultiplexService::Multiplex(grpc::ServerContext* ctx,
                                         grpc::ServerReaderWriter<v1::MultiplexDown, v1::MultiplexUp>* call) {
  // The reader takes the caller's opens and cancels; this thread admits them, and after each
  // engine step (the bell) sends what every stream got, in one message.
  auto bell = std::make_shared<Bell>();
  std::mutex mu;
  std::vector<v1::StreamOpen> opens;
  std::vector<uint64_t> cancels;
  bool closed = false;  // the caller is gone (or half-closed: it sends nothing more)
  std::thread reader([&] {
    v1::MultiplexUp up;
    while (call->Read(&up)) {
      {
        std::lock_guard<std::mutex> lock(mu);
        for (v1::StreamOpen& o : *up.mutable_open()) opens.push_back(std::move(o));
        cancels.insert(cancels.end(), up.cancel().begin(), up.cancel().end());
      }
      bell->Ring();
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      closed = true;
    }
    bell->Ring();
  });

  std::map<uint64_t, std::unique_ptr<InferenceService::Request>> live;  // by the caller's stream id
  uint64_t rung = 0;
  while (true) {
    std::vector<v1::StreamOpen> opened;
    std::vector<uint64_t> cancelled;
    bool done;
    {
      std::lock_guard<std::mutex> lock(mu);
      opened.swap(opens);
      cancelled.swap(cancels);
      done = closed;
    }
    v1::MultiplexDown down;
    for (v1::StreamOpen& o : opened) {
      const absl::Time arrival = absl::Now();
      grpc::Status refused = auth::CheckApiKey(o.authorization());
      if (refused.ok() && live.count(o.stream()))
        refused = {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("stream ", o.stream(), " is already open on this call")};
      const absl::Time deadline =
          o.deadline_unix_micros() > 0 ? absl::FromUnixMicros(o.deadline_unix_micros()) : absl::InfiniteFuture();
      if (refused.ok()) {
        auto r = inference_.Admit(o.request(), arrival, deadline, bell);
        if (r.ok()) {
          live[o.stream()] = *std::move(r);
          continue;
        }
        refused = ToGrpc(r.status());
      }
      v1::StreamChunk* c = down.add_chunks();
      c->set_stream(o.stream());
      SetEnd(c, inference_.Finish(refused));
    }
    for (uint64_t id : cancelled) {
      auto it = live.find(id);
      if (it == live.end()) continue;  // it ended meanwhile
      inference_.End(*it->second, InferenceService::ClientGone(it->second->deadline, "cancelled by the client"), true);
      live.erase(it);
    }
    const std::string* drain_end = inference_.ended();
    for (auto it = live.begin(); it != live.end();) {
      InferenceService::Request& r = *it->second;
      if (drain_end != nullptr) {  // the drain timed out
        v1::StreamChunk* c = down.add_chunks();
        c->set_stream(it->first);
        SetEnd(c, inference_.End(r, {grpc::StatusCode::UNAVAILABLE, *drain_end}, true));
        it = live.erase(it);
        continue;
      }
      std::vector<StepOutput> outputs = r.stream->Next(std::chrono::milliseconds(0));
      if (outputs.empty()) {
        ++it;
        continue;
      }
      v1::StreamChunk* c = down.add_chunks();
      c->set_stream(it->first);
      bool last = false;
      for (StepOutput& o : outputs) {
        grpc::Status end;
        if (!inference_.Take(r, o, c->mutable_response(), &end)) continue;
        SetEnd(c, inference_.End(r, end, false));
        last = true;
        break;
      }
      it = last ? live.erase(it) : std::next(it);
    }
    if (down.chunks_size() > 0 && !call->Write(down)) break;
    if (done || ctx->IsCancelled()) break;
    bell->Wait(&rung, std::chrono::milliseconds(50));
  }
  // The caller is gone: free what it left.
  for (auto& [id, r] : live) inference_.End(*r, InferenceService::ClientGone(r->deadline, "the gateway went away"), true);
  live.clear();
  ctx->TryCancel();  // ends the reader's Read
  reader.join();
  return grpc::Status::OK;
}

}  // namespace k3
