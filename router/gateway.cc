#include "router/gateway.h"

#include <algorithm>
#include <cstdio>
#include <optional>

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

std::atomic<int> live_readers{0};

}  // namespace

int Multiplexed::live() { return live_readers.load(); }

std::shared_ptr<Multiplexed> Multiplexed::Start(const std::shared_ptr<grpc::Channel>& channel) {
  std::shared_ptr<Multiplexed> m(new Multiplexed());
  m->stub_ = v1::TokenStreams::NewStub(channel);
  auth::AddNodeCredentials(&m->ctx_);
  m->call_ = m->stub_->Multiplex(&m->ctx_);
  ++live_readers;
  std::thread([m] { m->Read(); }).detach();  // it holds the call until every sink has heard
  return m;
}

bool Multiplexed::broken() {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

bool Multiplexed::Open(v1::StreamOpen open, std::shared_ptr<StreamSink> sink) {
  std::lock_guard<std::mutex> write_lock(write_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return false;
    sinks_[open.stream()] = std::move(sink);
  }
  v1::MultiplexUp up;
  *up.add_open() = std::move(open);
  call_->Write(up);  // a failure ends the call, and the reader tells the sink
  return true;
}

void Multiplexed::Cancel(uint64_t stream) {
  std::lock_guard<std::mutex> write_lock(write_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    sinks_.erase(stream);
  }
  v1::MultiplexUp up;
  up.add_cancel(stream);
  call_->Write(up);
}

void Multiplexed::Read() {
  v1::MultiplexDown down;
  while (call_->Read(&down)) {
    for (v1::StreamChunk& c : *down.mutable_chunks()) {
      std::shared_ptr<StreamSink> sink;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = sinks_.find(c.stream());
        if (it == sinks_.end()) continue;  // cancelled meanwhile
        sink = it->second;
        if (c.end()) sinks_.erase(it);
      }
      sink->OnChunk(c);
    }
  }
  std::map<uint64_t, std::shared_ptr<StreamSink>> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;
    orphans.swap(sinks_);
  }
  grpc::Status s;
  {
    std::lock_guard<std::mutex> write_lock(write_mu_);  // no write in flight, none to follow
    s = call_->Finish();
  }
  if (s.ok()) s = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the node closed the stream call");
  for (auto& [id, sink] : orphans) sink->OnBroken(s);
  --live_readers;
}

Gateway::Node::~Node() {
  stop_watch = true;
  {
    std::lock_guard<std::mutex> lock(watch_mu);
    if (watch_ctx != nullptr) watch_ctx->TryCancel();
  }
  if (watcher.joinable()) watcher.join();
  std::lock_guard<std::mutex> lock(calls_mu);
  for (auto& c : calls)
    if (c) c->Close();
}

std::shared_ptr<Multiplexed> Gateway::Node::Stream() {
  std::lock_guard<std::mutex> lock(calls_mu);
  const size_t i = next_call++ % calls.size();
  if (!calls[i] || calls[i]->broken()) calls[i] = Multiplexed::Start(channels[i]);
  return calls[i];
}

void Gateway::Node::Watch() {
  auto health = grpc::health::v1::Health::NewStub(channels[0]);
  while (!stop_watch) {
    grpc::ClientContext ctx;
    {
      std::lock_guard<std::mutex> lock(watch_mu);
      if (stop_watch) break;
      watch_ctx = &ctx;
    }
    auto reader = health->Watch(&ctx, grpc::health::v1::HealthCheckRequest());
    grpc::health::v1::HealthCheckResponse resp;
    while (reader->Read(&resp)) healthy = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    reader->Finish();
    healthy = false;
    {
      std::lock_guard<std::mutex> lock(watch_mu);
      watch_ctx = nullptr;
    }
    if (!stop_watch) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

Gateway::Gateway(GatewayOptions options, metrics::Registry& reg)
    : options_(std::move(options)),
      board_(v1::AttentionBoard::NewStub(tls::NewChannel(options_.router_address))) {
  m_requests_ = metrics::Must(reg.AddCounter("k3serve_gateway_requests_total", "Generate streams by final gRPC status.", {"code"}));
  m_retries_ = &metrics::Must(reg.AddCounter("k3serve_gateway_retries_total",
                                             "Streams sent to another attention node after one failed before the first token."))->WithLabels();
  m_inflight_ = &metrics::Must(reg.AddGauge("k3serve_gateway_inflight_streams", "Generate streams open through this gateway."))->WithLabels();
  Refresh();
  refresher_ = std::thread([this] { RefreshLoop(); });
}

Gateway::~Gateway() {
  Stop();
  refresher_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    nodes_.clear();  // closes their calls
  }
  // The calls' readers end once their cancellation is through.
  for (int i = 0; i < 200 && Multiplexed::live() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

void Gateway::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  stopping_ = true;
}

int Gateway::serving_nodes() {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto& [id, node] : nodes_) n += node->healthy && !node->draining && now >= node->down_until;
  return n;
}

void Gateway::RefreshLoop() {
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
    }
    absl::SleepFor(options_.refresh);
    Refresh();
  }
}

void Gateway::Refresh() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  auth::AddNodeCredentials(&ctx);
  v1::AttentionNodes list;
  const grpc::Status s = board_->ListAttentionNodes(&ctx, v1::ListAttentionNodesRequest(), &list);
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
          n->calls.resize(n->channels.size());
          Node* raw = n.get();
          n->watcher = std::thread([raw] { raw->Watch(); });
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
    if (!n->healthy || n->draining || now < n->down_until || exclude.count(id)) continue;
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

// One client stream: forwarded over a node's multiplexed call; tokens that arrive while a write
// to the client is in flight go out together in the next one.
class Gateway::Call final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                            public StreamSink,
                            public std::enable_shared_from_this<Call> {
 public:
  Call(Gateway* gw, grpc::CallbackServerContext* ctx, const v1::GenerateRequest& req) : gw_(gw) {
    const auto& md = ctx->client_metadata();
    if (auto it = md.find("authorization"); it != md.end()) open_.set_authorization(std::string(it->second.data(), it->second.size()));
    if (ctx->deadline() != std::chrono::system_clock::time_point::max()) {
      deadline_ = absl::FromChrono(ctx->deadline());
      open_.set_deadline_unix_micros(absl::ToUnixMicros(deadline_));
    }
    *open_.mutable_request() = req;
  }

  void Start(std::shared_ptr<Call> self) {
    self_ = std::move(self);
    gw_->m_inflight_->Inc();
    if (grpc::Status s = auth::CheckApiKey(open_.authorization()); !s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      EndWith(s);
      return;
    }
    Attempt();
  }

  void OnChunk(v1::StreamChunk& c) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (c.stream() != stream_) return;
      const v1::GenerateResponse& r = c.response();
      if (r.token_ids_size() > 0 || r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        sent_ = true;
        pending_.mutable_token_ids()->Add(r.token_ids().begin(), r.token_ids().end());
        if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
          pending_.set_finish_reason(r.finish_reason());
          *pending_.mutable_usage() = r.usage();
        }
        has_pending_ = true;
        Flush();
      }
    }
    if (c.end()) Ended(grpc::Status(static_cast<grpc::StatusCode>(c.code()), c.message()), c.stream());
  }

  void OnBroken(const grpc::Status& s) override { Ended(s, 0); }

  void OnWriteDone(bool ok) override {
    std::shared_ptr<Multiplexed> call;
    std::shared_ptr<Node> node;
    uint64_t stream = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_write_ = false;
      if (ok) {
        Flush();
        return;
      }
      // The client went away: the node frees the request.
      has_pending_ = false;
      EndWith({grpc::StatusCode::CANCELLED, "stream closed by the client"});
      call = std::move(call_);
      node = std::move(node_);
      stream = stream_;
    }
    if (call) call->Cancel(stream);
    if (node) Leave(node);
  }

  void OnCancel() override {
    std::shared_ptr<Multiplexed> call;
    std::shared_ptr<Node> node;
    uint64_t stream = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      has_pending_ = false;
      if (deadline_ <= absl::Now() + absl::Milliseconds(500)) {
        EndWith({grpc::StatusCode::DEADLINE_EXCEEDED, "the client's deadline passed"});
      } else {
        EndWith({grpc::StatusCode::CANCELLED, "cancelled by the client"});
      }
      call = std::move(call_);
      node = std::move(node_);
      stream = stream_;
    }
    if (call) call->Cancel(stream);
    if (node) Leave(node);
  }

  void OnDone() override {
    gw_->m_inflight_->Dec();
    std::shared_ptr<Multiplexed> call;
    std::shared_ptr<Node> node;
    std::shared_ptr<Call> self;
    uint64_t stream = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      call = std::move(call_);
      node = std::move(node_);
      stream = stream_;
      self.swap(self_);
    }
    if (call) call->Cancel(stream);
    if (node) Leave(node);
  }  // `self` may free this: the last reference unless a call's reader still holds one

 private:
  // Sends the request to the best node not tried yet; without one, the call ends.
  void Attempt() {
    while (true) {
      std::shared_ptr<Node> node;
      if (attempts_ < gw_->options_.max_attempts) node = gw_->Pick(tried_, absl::Now());
      if (!node) {
        std::lock_guard<std::mutex> lock(mu_);
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
      std::shared_ptr<Multiplexed> call = node->Stream();
      const uint64_t stream = gw_->next_stream_++;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (cancelled_) {  // the call has ended meanwhile
          Leave(node);
          return;
        }
        node_ = node;
        call_ = call;
        stream_ = stream;
      }
      open_.set_stream(stream);
      if (call->Open(open_, shared_from_this())) {
        bool cancelled;
        {
          std::lock_guard<std::mutex> lock(mu_);
          cancelled = cancelled_;
        }
        if (cancelled) call->Cancel(stream);  // the cancel may have gone out before the open
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        node_.reset();
        call_.reset();
      }
      Leave(node);
      last_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("attention node ", node->id, " (", node->address, "): its stream call ended"));
    }
  }

  // The node ended the stream (`stream`), or the call carrying it (0): the client gets the status,
  // or, while no token has reached it, another node gets the request.
  void Ended(const grpc::Status& s, uint64_t stream) {
    std::shared_ptr<Node> node;
    bool sent;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stream != 0 && stream != stream_) return;
      if (cancelled_ || finished_ || end_) return;
      node = std::move(node_);
      call_.reset();
      stream_ = 0;
      sent = sent_;
      if (s.ok() || !NodeFailure(s.error_code())) {
        EndWith(s);
      } else if (sent) {
        EndWith({grpc::StatusCode::UNAVAILABLE, absl::StrCat("attention node ", node->id, " (", node->address,
                                                             ") failed after the first token: ", s.error_message())});
      }
    }
    if (node) Leave(node);
    if (s.ok() || !NodeFailure(s.error_code()) || sent || !node) return;
    // Nothing reached the client yet: the request may go to another node.
    std::fprintf(stderr, "k3serve-gateway: %s (%s) failed before the first token: %s; trying another node\n",
                 node->id.c_str(), node->address.c_str(), s.error_message().c_str());
    {
      std::lock_guard<std::mutex> lock(gw_->mu_);
      node->down_until = absl::Now() + absl::Seconds(1);
    }
    last_ = grpc::Status(s.error_code(), absl::StrCat("attention node ", node->id, " (", node->address, "): ", s.error_message()));
    Attempt();
  }

  // Under mu_: the call's status, sent once the writes before it are through.
  void EndWith(const grpc::Status& s) {
    if (end_ || finished_) return;
    end_ = gw_->Done(s);
    Flush();
  }

  // Under mu_: the next write to the client, or the finish.
  void Flush() {
    if (finished_ || in_write_) return;
    if (has_pending_) {
      writing_.Swap(&pending_);
      pending_.Clear();
      has_pending_ = false;
      in_write_ = true;
      StartWrite(&writing_);
      return;
    }
    if (end_) {
      finished_ = true;
      Finish(*end_);
    }
  }

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
  v1::StreamOpen open_;  // the request as it goes to a node
  absl::Time deadline_ = absl::InfiniteFuture();
  // Attempts run one at a time (the start, then the end of the previous one).
  std::set<std::string> tried_;
  int attempts_ = 0;
  grpc::Status last_;

  std::mutex mu_;
  std::shared_ptr<Call> self_;            // until OnDone
  std::shared_ptr<Node> node_;            // the node of the attempt in flight
  std::shared_ptr<Multiplexed> call_;     // and the call that carries it
  uint64_t stream_ = 0;                   // its stream id on that call
  bool sent_ = false;                     // tokens reached the client: no retry from here on
  bool cancelled_ = false;
  v1::GenerateResponse pending_, writing_;
  bool has_pending_ = false, in_write_ = false, finished_ = false;
  std::optional<grpc::Status> end_;
};

grpc::ServerWriteReactor<v1::GenerateResponse>* Gateway::Generate(grpc::CallbackServerContext* ctx,
                                                                  const v1::GenerateRequest* req) {
  auto call = std::make_shared<Call>(this, ctx, *req);
  call->Start(call);
  return call.get();
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
