#include "router/gateway.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>

#include <grpcpp/alarm.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace k3::router {
namespace {

const char* CodeName(grpc::StatusCode c) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                                 "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int i = static_cast<int>(c);
  return i >= 0 && i <= 16 ? kNames[i] : "UNKNOWN";
}

// A node that ends a stream with one of these has failed (rather than judged the request).
bool NodeFailure(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::UNKNOWN || c == grpc::StatusCode::INTERNAL;
}

}  // namespace

// Follows a node's grpc.health.v1 Watch, on the loop's completion queue (no thread of its own that would
// poll the sockets), and again 100 ms after each call ends: a drain shows here at once, before the node's
// next report. It deletes itself once stopped and its operations are through.
class Gateway::HealthWatch {
 public:
  HealthWatch(Gateway* gw, const std::shared_ptr<grpc::Channel>& channel)
      : gw_(gw), stub_(grpc::health::v1::Health::NewStub(channel)) {
    ++gw_->live_watches_;
    std::lock_guard<std::mutex> lock(mu_);
    StartLocked();
  }
  ~HealthWatch() { --gw_->live_watches_; }

  // Any thread; the caller forgets this watch.
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    if (waiting_) {
      retry_.Cancel();  // Retry sees it
    } else {
      ctx_->TryCancel();  // the read fails, then Finish
    }
  }

  std::atomic<bool> healthy{false};

 private:
  void StartLocked() {
    reader_.reset();  // it lives in the call that the context holds
    ctx_ = std::make_unique<grpc::ClientContext>();
    reader_ = stub_->PrepareAsyncWatch(ctx_.get(), grpc::health::v1::HealthCheckRequest(), gw_->cq_.get());
    reader_->StartCall(&started_);
  }
  void Started(bool ok) {
    if (!ok) {
      reader_->Finish(&status_, &finished_);
      return;
    }
    reader_->Read(&resp_, &read_);
  }
  void ReadDone(bool ok) {
    if (!ok) {
      healthy = false;
      reader_->Finish(&status_, &finished_);
      return;
    }
    healthy = resp_.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    reader_->Read(&resp_, &read_);
  }
  void FinishDone(bool) {
    healthy = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stopped_) {
        waiting_ = true;
        retry_.Set(gw_->cq_.get(), std::chrono::system_clock::now() + std::chrono::milliseconds(100), &retried_);
        return;
      }
    }
    delete this;
  }
  void Retry(bool) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_ = false;
      if (!stopped_) {
        StartLocked();
        return;
      }
    }
    delete this;
  }

  Gateway* const gw_;
  const std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  std::mutex mu_;  // with Stop, from another thread
  bool stopped_ = false, waiting_ = false;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientAsyncReader<grpc::health::v1::HealthCheckResponse>> reader_;
  grpc::health::v1::HealthCheckResponse resp_;
  grpc::Status status_;
  grpc::Alarm retry_;
  CqOn<HealthWatch> started_{this, &HealthWatch::Started}, read_{this, &HealthWatch::ReadDone},
      finished_{this, &HealthWatch::FinishDone}, retried_{this, &HealthWatch::Retry};
};

Gateway::Node::~Node() {
  if (watch != nullptr) watch->Stop();
}

bool Gateway::Node::healthy() const { return watch != nullptr && watch->healthy; }

Gateway::Gateway(GatewayOptions options, metrics::Registry& reg)
    : options_(std::move(options)),
      board_(v1::AttentionBoard::NewStub(tls::NewChannel(options_.router_address))) {
  m_requests_ = metrics::Must(reg.AddCounter("k3serve_gateway_requests_total", "Generate streams by final gRPC status.", {"code"}));
  m_retries_ = &metrics::Must(reg.AddCounter("k3serve_gateway_retries_total",
                                             "Streams sent to another attention node after one failed before the first token."))->WithLabels();
  m_inflight_ = &metrics::Must(reg.AddGauge("k3serve_gateway_inflight_streams", "Generate streams open through this gateway."))->WithLabels();
  health_.SetServing(v1::Inference::service_full_name(), false);
}

Gateway::~Gateway() { Stop(); }

int Gateway::serving_nodes() {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto& [id, node] : nodes_) n += node->healthy() && !node->draining && now >= node->down_until;
  return n;
}

// The board's list every `refresh`, on the loop's completion queue (no thread of its own polling the
// sockets while it waits for the router): an alarm, then the call. It deletes itself once stopped and its
// operations are through.
class Gateway::BoardPoll {
 public:
  explicit BoardPoll(Gateway* gw) : gw_(gw) {
    ++gw_->live_watches_;
    std::lock_guard<std::mutex> lock(mu_);
    WaitLocked();
  }
  ~BoardPoll() { --gw_->live_watches_; }

  // Any thread; the caller forgets this poll.
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    if (waiting_) {
      alarm_.Cancel();  // Waited sees it
    } else {
      ctx_->TryCancel();  // Answered sees it
    }
  }

 private:
  void WaitLocked() {
    waiting_ = true;
    alarm_.Set(gw_->cq_.get(), absl::ToChronoTime(absl::Now() + gw_->options_.refresh), &waited_);
  }
  void Waited(bool) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_ = false;
      if (!stopped_) {
        reader_.reset();  // it lives in the call that the context holds
        ctx_ = std::make_unique<grpc::ClientContext>();
        ctx_->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
        auth::AddNodeCredentials(ctx_.get());
        list_.Clear();
        reader_ = gw_->board_->PrepareAsyncListAttentionNodes(ctx_.get(), v1::ListAttentionNodesRequest(), gw_->cq_.get());
        reader_->StartCall();
        reader_->Finish(&list_, &status_, &answered_);
        return;
      }
    }
    delete this;
  }
  void Answered(bool) {
    gw_->Apply(status_, list_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stopped_) {
        WaitLocked();
        return;
      }
    }
    delete this;
  }

  Gateway* const gw_;
  std::mutex mu_;  // with Stop, from another thread
  bool stopped_ = false, waiting_ = false;
  grpc::Alarm alarm_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::AttentionNodes>> reader_;
  v1::AttentionNodes list_;
  grpc::Status status_;
  CqOn<BoardPoll> waited_{this, &BoardPoll::Waited}, answered_{this, &BoardPoll::Answered};
};

void Gateway::Refresh() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  auth::AddNodeCredentials(&ctx);
  v1::AttentionNodes list;
  const grpc::Status s = board_->ListAttentionNodes(&ctx, v1::ListAttentionNodesRequest(), &list);
  Apply(s, list);
}

void Gateway::Apply(const grpc::Status& s, const v1::AttentionNodes& list) {
  std::map<std::string, std::shared_ptr<Node>> gone;  // their watches end outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (s.ok()) {  // without the router, keep routing to the nodes known last
      std::map<std::string, std::shared_ptr<Node>> next;
      for (const v1::AttentionLoad& l : list.nodes()) {
        std::shared_ptr<Node>& n = next[l.node_id()];
        auto it = nodes_.find(l.node_id());
        if (it != nodes_.end() && it->second->address == l.grpc_address()) {
          n = it->second;
        } else {
          n = std::make_shared<Node>();
          n->id = l.node_id();
          n->address = l.grpc_address();
          for (int c = 0; c < std::max(1, options_.connections); ++c) {
            grpc::ChannelArguments args;
            args.SetInt("k3serve.connection", c);  // distinct arguments: a connection of its own
            n->channels.push_back(grpc::CreateCustomChannel(l.grpc_address(), *tls::ChannelCredentialsFromFlags(), args));
          }
          n->stub = v1::Inference::NewStub(n->channels[0]);
          if (!stopping_) n->watch = new HealthWatch(this, n->channels[0]);
        }
        n->draining = l.draining();
        n->reported_requests = l.running_requests() + l.waiting_requests();
        n->reported_tokens = l.outstanding_tokens();
      }
      nodes_.swap(next);
      gone.swap(next);  // what was in nodes_ before; the kept ones are shared with the new map
    }
  }
}

std::shared_ptr<Gateway::Node> Gateway::Pick(const std::set<std::string>& exclude, absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Node> best;
  int64_t best_work = 0;
  for (auto& [id, n] : nodes_) {
    if (!n->healthy() || n->draining || now < n->down_until || exclude.count(id)) continue;
    while (!n->recent.empty() && now - n->recent.front() > options_.pending_window) n->recent.pop_front();
    // The last report plus what this gateway sent since (which that report may not include).
    const int64_t work = n->reported_requests + static_cast<int64_t>(n->recent.size());
    if (!best || work < best_work || (work == best_work && (n->open < best->open ||
                                                            (n->open == best->open && n->reported_tokens < best->reported_tokens)))) {
      best = n;
      best_work = work;
    }
  }
  if (best) {
    ++best->open;
    best->recent.push_back(now);
  }
  return best;
}

void Gateway::Release(const std::shared_ptr<Node>& n) {
  std::lock_guard<std::mutex> lock(mu_);
  --n->open;
}

// The client's deadline, cancellation and API key go with the forwarded call.
std::unique_ptr<grpc::ClientContext> Gateway::Upstream(const grpc::ServerContext& ctx) {
  std::unique_ptr<grpc::ClientContext> up = grpc::ClientContext::FromServerContext(ctx);
  const auto& md = ctx.client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) up->AddMetadata("authorization", std::string(it->second.data(), it->second.size()));
  return up;
}

grpc::Status Gateway::Done(const grpc::Status& s) {
  m_requests_->WithLabels({CodeName(s.error_code())}).Inc();
  return s;
}

// One TokenStreams.Multiplex call to a node, carrying many Calls' streams. Broken for good once
// it fails (the next stream to the node opens a new one); it deletes itself once its operations
// are through. Loop thread only.
class Gateway::Mux {
 public:
  Mux(Gateway* gw, std::shared_ptr<Node> node, size_t connection) : gw_(gw), node_(std::move(node)), connection_(connection) {
    ++gw_->live_muxes_;
    auth::AddNodeCredentials(&ctx_);
    rw_ = v1::TokenStreams::NewStub(node_->channels[connection_])->PrepareAsyncMultiplex(&ctx_, gw_->cq_.get());
    rw_->StartCall(&started_);
  }
  ~Mux() { --gw_->live_muxes_; }

  // Queues the stream's request; false when this call is broken.
  bool Open(Call* call, const v1::StreamOpen& open);
  // The node frees the stream; the Call hears nothing more of it.
  void Cancel(uint64_t stream) {
    if (streams_.erase(stream) == 0 || broken_) return;
    queued_.add_cancel(stream);
    Send();
  }
  void Close() { ctx_.TryCancel(); }

 private:
  void Started(bool ok) {
    if (!ok) {  // no call: Finish says why
      Fail();
      rw_->Finish(&status_, &finished_);
      return;
    }
    ready_ = true;
    rw_->Read(&down_, &read_);
    Send();
  }
  void ReadDone(bool ok);
  void WriteDone(bool ok) {
    writing_ = false;
    if (finish_done_) {
      delete this;
      return;
    }
    if (!ok) {  // the read fails too, and then Finish
      Fail();
      ctx_.TryCancel();
    }
    Send();
  }
  void FinishDone(bool);
  // The next write, of everything queued since the last one.
  void Send() {
    if (!ready_ || writing_ || broken_ || (queued_.open_size() == 0 && queued_.cancel_size() == 0)) return;
    sending_.Swap(&queued_);
    queued_.Clear();
    writing_ = true;
    rw_->Write(sending_, &wrote_);
  }
  // No new streams here.
  void Fail() {
    if (broken_) return;
    broken_ = true;
    auto it = gw_->muxes_.find(node_.get());
    if (it != gw_->muxes_.end()) {
      if (it->second[connection_] == this) it->second[connection_] = nullptr;
      if (std::all_of(it->second.begin(), it->second.end(), [](Mux* m) { return m == nullptr; })) gw_->muxes_.erase(it);
    }
  }

  Gateway* const gw_;
  const std::shared_ptr<Node> node_;
  const size_t connection_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientAsyncReaderWriterInterface<v1::MultiplexUp, v1::MultiplexDown>> rw_;
  CqOn<Mux> started_{this, &Mux::Started}, read_{this, &Mux::ReadDone}, wrote_{this, &Mux::WriteDone},
      finished_{this, &Mux::FinishDone};
  bool ready_ = false, writing_ = false, broken_ = false, finish_done_ = false;
  v1::MultiplexUp queued_, sending_;
  v1::MultiplexDown down_;
  grpc::Status status_;
  std::map<uint64_t, Call*> streams_;
};

// One client stream. Its tokens go out as they come; those that arrive while a write to the
// client is in flight go out together in the next one. Loop thread only; it deletes itself once
// the call is done and its operations are through.
class Gateway::Call {
 public:
  // Waits for the next Generate.
  explicit Call(Gateway* gw) : gw_(gw) {
    ++gw_->live_calls_;
    ctx_.AsyncNotifyWhenDone(&done_);
    gw_->RequestGenerate(&ctx_, &req_, &writer_, gw_->cq_.get(), gw_->cq_.get(), &arrived_);
  }
  ~Call() {
    if (arrived_ok_) gw_->m_inflight_->Dec();
    --gw_->live_calls_;
  }

  void OnChunk(const v1::StreamChunk& c) {
    if (c.stream() != stream_) return;
    const v1::GenerateResponse& r = c.response();
    if (r.token_ids_size() > 0 || r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      sent_ = true;
      out_.pending.mutable_token_ids()->Add(r.token_ids().begin(), r.token_ids().end());
      if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        out_.pending.set_finish_reason(r.finish_reason());
        *out_.pending.mutable_usage() = r.usage();
      }
      out_.has_pending = true;
      Flush();
    }
    if (c.end()) Ended(grpc::Status(static_cast<grpc::StatusCode>(c.code()), c.message()), /*broken=*/false);
  }
  // The call carrying the stream failed.
  void OnBroken(const grpc::Status& s) { Ended(s, /*broken=*/true); }

 private:
  void Arrived(bool ok) {
    if (!ok) {  // the server is shutting down: no call came
      delete this;
      return;
    }
    new Call(gw_);  // for the next one
    arrived_ok_ = true;
    gw_->m_inflight_->Inc();
    const auto& md = ctx_.client_metadata();
    if (auto it = md.find("authorization"); it != md.end()) open_.set_authorization(std::string(it->second.data(), it->second.size()));
    if (ctx_.deadline() != std::chrono::system_clock::time_point::max()) {
      deadline_ = absl::FromChrono(ctx_.deadline());
      open_.set_deadline_unix_micros(absl::ToUnixMicros(deadline_));
    }
    open_.mutable_request()->Swap(&req_);
    if (grpc::Status s = auth::CheckApiKey(open_.authorization()); !s.ok()) {
      EndWith(s);
      return;
    }
    Attempt();
  }

  void WriteDone(bool ok) {
    out_.writing = false;
    if (!ok) {  // the client went away: the node frees the request
      out_.has_pending = false;
      Drop();
      EndWith({grpc::StatusCode::CANCELLED, "stream closed by the client"});
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
      Drop();
      if (deadline_ <= absl::Now() + absl::Milliseconds(500)) {
        EndWith({grpc::StatusCode::DEADLINE_EXCEEDED, "the client's deadline passed"});
      } else {
        EndWith({grpc::StatusCode::CANCELLED, "cancelled by the client"});
      }
    }
    MaybeDelete();
  }

  void MaybeDelete() {
    if (!call_done_ || out_.writing) return;
    if (arrived_ok_ && !finish_done_) return;
    if (mux_ != nullptr || node_ != nullptr) Drop();
    delete this;
  }

  // Sends the request to the best node not tried yet; without one, the call ends.
  void Attempt() {
    while (true) {
      std::shared_ptr<Node> node;
      if (attempts_ < gw_->options_.max_attempts && !gw_->closing_ && !cancelled_) node = gw_->Pick(tried_, absl::Now());
      if (!node) {
        EndWith({grpc::StatusCode::UNAVAILABLE,
                 tried_.empty() ? std::string("no attention node is serving")
                                : absl::StrCat("tried ", tried_.size(), " attention node(s); last: ", last_.error_message())});
        return;
      }
      if (attempts_++ > 0) gw_->m_retries_->Inc();
      tried_.insert(node->id);
      const std::string& name = open_.request().request_id();
      if (!name.empty()) {
        std::lock_guard<std::mutex> lock(gw_->mu_);
        gw_->by_request_id_[name] = node;
      }
      Mux* mux = gw_->MuxFor(node);
      stream_ = gw_->next_stream_++;
      open_.set_stream(stream_);
      if (mux->Open(this, open_)) {
        node_ = std::move(node);
        mux_ = mux;
        return;
      }
      Leave(node);
      last_ = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                           absl::StrCat("attention node ", node->id, " (", node->address, "): its stream call failed"));
    }
  }

  // The node ended the stream, or the call carrying it failed (broken): the client gets the status,
  // or, while no token has reached it, another node gets the request.
  void Ended(const grpc::Status& s, bool broken) {
    std::shared_ptr<Node> node = std::move(node_);
    mux_ = nullptr;
    stream_ = 0;
    if (node) Leave(node);
    if (cancelled_ || out_.end || !node) return;
    if (s.ok() || !NodeFailure(s.error_code())) {
      EndWith(s);
      return;
    }
    if (sent_) {
      EndWith({grpc::StatusCode::UNAVAILABLE, absl::StrCat("attention node ", node->id, " (", node->address,
                                                           ") failed after the first token: ", s.error_message())});
      return;
    }
    // Nothing reached the client yet: the request may go to another node.
    std::fprintf(stderr, "k3serve-gateway: %s (%s) failed before the first token: %s; trying another node\n",
                 node->id.c_str(), node->address.c_str(), s.error_message().c_str());
    // Only a node whose call broke is set aside. One that answered UNAVAILABLE itself (an expert
    // node it dispatched to did not answer) still serves the others, and its health says when it
    // cannot: setting it aside would fail every stream for the while when it is the only one.
    if (broken) {
      std::lock_guard<std::mutex> lock(gw_->mu_);
      node->down_until = absl::Now() + absl::Seconds(1);
    }
    last_ = grpc::Status(s.error_code(), absl::StrCat("attention node ", node->id, " (", node->address, "): ", s.error_message()));
    Attempt();
  }

  // The client is gone: the node frees the stream.
  void Drop() {
    if (mux_ != nullptr) mux_->Cancel(stream_);
    mux_ = nullptr;
    stream_ = 0;
    if (node_) Leave(node_);
    node_.reset();
  }

  // The call's status, sent once the writes before it are through.
  void EndWith(const grpc::Status& s) {
    if (out_.end) return;
    out_.end = gw_->Done(s);
    Flush();
  }

  void Flush() { out_.Flush(writer_, !cancelled_, &wrote_, &finished_); }

  // The node no longer carries this stream.
  void Leave(const std::shared_ptr<Node>& node) {
    gw_->Release(node);
    const std::string& name = open_.request().request_id();
    if (name.empty()) return;
    std::lock_guard<std::mutex> lock(gw_->mu_);
    auto it = gw_->by_request_id_.find(name);
    if (it != gw_->by_request_id_.end() && it->second == node) gw_->by_request_id_.erase(it);
  }

  Gateway* const gw_;
  grpc::ServerContext ctx_;
  v1::GenerateRequest req_;
  grpc::ServerAsyncWriter<v1::GenerateResponse> writer_{&ctx_};
  CqOn<Call> arrived_{this, &Call::Arrived}, wrote_{this, &Call::WriteDone}, finished_{this, &Call::FinishDone},
      done_{this, &Call::CallDone};
  bool arrived_ok_ = false, call_done_ = false, finish_done_ = false;

  v1::StreamOpen open_;  // the request as it goes to a node
  absl::Time deadline_ = absl::InfiniteFuture();
  std::set<std::string> tried_;
  int attempts_ = 0;
  grpc::Status last_;
  std::shared_ptr<Node> node_;  // the node of the attempt in flight
  Mux* mux_ = nullptr;          // and the call that carries it
  uint64_t stream_ = 0;         // its stream id on that call
  bool sent_ = false;           // tokens reached the client: no retry from here on
  bool cancelled_ = false;
  CoalescedWrites<v1::GenerateResponse> out_;
};

bool Gateway::Mux::Open(Call* call, const v1::StreamOpen& open) {
  if (broken_) return false;
  streams_[open.stream()] = call;
  *queued_.add_open() = open;
  Send();
  return true;
}

void Gateway::Mux::ReadDone(bool ok) {
  if (!ok) {  // the call is over: Finish says why
    Fail();
    rw_->Finish(&status_, &finished_);
    return;
  }
  for (const v1::StreamChunk& c : down_.chunks()) {
    auto it = streams_.find(c.stream());
    if (it == streams_.end()) continue;  // cancelled meanwhile
    Call* call = it->second;
    if (c.end()) streams_.erase(it);
    call->OnChunk(c);
  }
  rw_->Read(&down_, &read_);  // also once broken: the read then fails, and Finish follows
}

void Gateway::Mux::FinishDone(bool) {
  // Whatever ended the call carrying them, the streams did not end by the node's judgement.
  if (!NodeFailure(status_.error_code()))
    status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                           absl::StrCat("the stream call to the node ended (", CodeName(status_.error_code()), ": ",
                                        status_.error_message(), ")"));
  std::map<uint64_t, Call*> orphans;
  orphans.swap(streams_);
  for (auto& [id, call] : orphans) call->OnBroken(status_);
  finish_done_ = true;
  if (!writing_) delete this;  // else once the write's completion is in
}

void Gateway::Serve(std::unique_ptr<grpc::ServerCompletionQueue> cq) {
  cq_ = std::move(cq);
  health_.Serve(cq_.get());
  new Call(this);
  Refresh();
  board_poll_ = new BoardPoll(this);
  loop_ = std::thread([this] { Loop(); });
}

void Gateway::Loop() {
  void* tag;
  bool ok;
  while (cq_->Next(&tag, &ok)) static_cast<CqEvent*>(tag)->Done(ok);
}

Gateway::Mux* Gateway::MuxFor(const std::shared_ptr<Node>& n) {
  std::vector<Mux*>& per_connection = muxes_[n.get()];
  if (per_connection.empty()) per_connection.resize(n->channels.size());
  Mux*& m = per_connection[next_mux_++ % per_connection.size()];
  if (m == nullptr) m = new Mux(this, n, &m - per_connection.data());
  return m;
}

void Gateway::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (cq_ == nullptr) return;
  // On the loop thread: no new calls to the nodes, and those open end.
  struct CloseAll final : CqEvent {
    explicit CloseAll(Gateway* gw) : gw(gw) {}
    void Done(bool) override {
      gw->closing_ = true;
      for (auto& [node, per_connection] : gw->muxes_)
        for (Mux* m : per_connection)
          if (m != nullptr) m->Close();
    }
    Gateway* gw;
  } close_all(this);
  grpc::Alarm alarm;
  alarm.Set(cq_.get(), gpr_now(GPR_CLOCK_REALTIME), &close_all);
  for (int i = 0; i < 500 && (live_muxes_ > 0 || live_calls_ > 0); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  {
    std::lock_guard<std::mutex> lock(mu_);
    board_poll_->Stop();
    board_poll_ = nullptr;
    for (auto& [id, n] : nodes_) {
      if (n->watch != nullptr) n->watch->Stop();
      n->watch = nullptr;
    }
  }
  for (int i = 0; i < 500 && live_watches_ > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  health_.Stop();
  cq_->Shutdown();
  loop_.join();
}

grpc::Status Gateway::Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req, v1::AbortResponse* resp) {
  if (auto s = auth::RequireApiKey(*ctx); !s.ok()) return s;
  if (req->request_id().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "request_id must not be empty"};
  std::vector<std::shared_ptr<Node>> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_request_id_.find(req->request_id());
    if (it != by_request_id_.end()) {
      targets.push_back(it->second);
    } else {
      // Another gateway replica may hold the stream: ask every node.
      for (auto& [id, n] : nodes_) targets.push_back(n);
    }
  }
  resp->set_found(false);
  for (auto& n : targets) {
    auto up = Upstream(*ctx);
    v1::AbortResponse r;
    if (n->stub->Abort(up.get(), *req, &r).ok() && r.found()) {
      resp->set_found(true);
      break;
    }
  }
  return grpc::Status::OK;
}

grpc::Status Gateway::GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req, v1::ModelInfo* resp) {
  if (auto s = auth::RequireApiKey(*ctx); !s.ok()) return s;
  std::set<std::string> tried;
  grpc::Status last(grpc::StatusCode::UNAVAILABLE, "no attention node is serving");
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    std::shared_ptr<Node> node = Pick(tried, absl::Now());
    if (!node) break;
    tried.insert(node->id);
    auto up = Upstream(*ctx);
    last = node->stub->GetModelInfo(up.get(), *req, resp);
    Release(node);
    if (last.ok() || !NodeFailure(last.error_code())) return last;
  }
  return last;
}

}  // namespace k3::router
