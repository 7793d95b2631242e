#include "router/gateway.h"

#include <algorithm>
#include <cstdio>

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

Gateway::Node::~Node() {
  stop_watch = true;
  {
    std::lock_guard<std::mutex> lock(watch_mu);
    if (watch_ctx != nullptr) watch_ctx->TryCancel();
  }
  if (watcher.joinable()) watcher.join();
}

void Gateway::Node::Watch() {
  auto health = grpc::health::v1::Health::NewStub(channel);
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
            auto channel = grpc::CreateCustomChannel(l.grpc_address(), *tls::ChannelCredentialsFromFlags(), args);
            if (c == 0) n->channel = channel;
            n->stubs.push_back(v1::Inference::NewStub(channel));
          }
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

grpc::Status Gateway::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                               grpc::ServerWriter<v1::GenerateResponse>* writer) {
  if (auto s = auth::RequireApiKey(*ctx); !s.ok()) return Done(s);
  m_inflight_->Inc();
  struct Dec {
    metrics::Gauge* g;
    ~Dec() { g->Dec(); }
  } dec{m_inflight_};
  std::set<std::string> tried;
  grpc::Status last(grpc::StatusCode::UNAVAILABLE, "no attention node is serving");
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    std::shared_ptr<Node> node = Pick(tried, absl::Now());
    if (!node) break;
    tried.insert(node->id);
    if (attempt > 0) m_retries_->Inc();
    if (!req->request_id().empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      by_request_id_[req->request_id()] = node;
    }
    // The client's deadline and cancellation reach the node with the call.
    std::unique_ptr<grpc::ClientContext> up = Upstream(*ctx);
    auto reader = node->stub().Generate(up.get(), *req);
    bool sent = false;  // something reached the client: no retry from here on
    v1::GenerateResponse resp;
    bool client_gone = false;
    while (reader->Read(&resp)) {
      sent = true;
      if (!writer->Write(resp)) {
        client_gone = true;
        up->TryCancel();
        break;
      }
    }
    const grpc::Status s = reader->Finish();
    Release(node);
    if (!req->request_id().empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = by_request_id_.find(req->request_id());
      if (it != by_request_id_.end() && it->second == node) by_request_id_.erase(it);
    }
    if (client_gone) return Done({grpc::StatusCode::CANCELLED, "stream closed by the client"});
    if (s.ok() || ctx->IsCancelled() || !NodeFailure(s.error_code())) return Done(s);
    if (sent)
      return Done({grpc::StatusCode::UNAVAILABLE,
                   absl::StrCat("attention node ", node->id, " (", node->address, ") failed after the first token: ",
                                s.error_message())});
    // Nothing reached the client yet: the request may go to another node.
    std::fprintf(stderr, "k3serve-gateway: %s (%s) failed before the first token: %s; trying another node\n",
                 node->id.c_str(), node->address.c_str(), s.error_message().c_str());
    {
      std::lock_guard<std::mutex> lock(mu_);
      node->down_until = absl::Now() + absl::Seconds(1);
    }
    last = grpc::Status(s.error_code(), absl::StrCat("attention node ", node->id, " (", node->address, "): ", s.error_message()));
  }
  return Done({grpc::StatusCode::UNAVAILABLE,
               tried.empty() ? std::string("no attention node is serving")
                             : absl::StrCat("tried ", tried.size(), " attention node(s); last: ", last.error_message())});
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
    if (n->stub().Abort(up.get(), *req, &r).ok() && r.found()) {
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
    last = node->stub().GetModelInfo(up.get(), *req, resp);
    Release(node);
    if (last.ok() || !NodeFailure(last.error_code())) return last;
  }
  return last;
}

}  // namespace k3::router
