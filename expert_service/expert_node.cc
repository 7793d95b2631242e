#include "expert_service/expert_node.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_server.h"
#include "engine/expert_executor.h"
#include "router/wire.h"
#ifdef K3SERVE_HAVE_CUDA
#include "expert_service/gpu_experts.h"
#endif

namespace k3 {
namespace {

int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

ExpertNode::ExpertNode(ModelConfig config, std::shared_ptr<const Checkpoint> checkpoint, ExpertNodeOptions options,
                       metrics::Registry& reg)
    : config_(std::move(config)), checkpoint_(std::move(checkpoint)), options_(std::move(options)) {
  m_batch_rows_ = &metrics::Must(reg.AddHistogram("k3serve_expert_batch_rows", "Rows per expert batch (all layers).",
                                                  metrics::ExponentialBuckets(1, 2, 14)))->WithLabels();
  m_batch_requests_ = &metrics::Must(reg.AddHistogram("k3serve_expert_batch_requests",
                                                      "Attention-node requests merged into one expert batch.",
                                                      metrics::ExponentialBuckets(1, 2, 8)))->WithLabels();
  m_batch_seconds_ = &metrics::Must(reg.AddHistogram("k3serve_expert_batch_seconds", "Compute time of one expert batch.",
                                                     metrics::ExponentialBuckets(1e-5, 2, 18)))->WithLabels();
  m_rows_ = &metrics::Must(reg.AddCounter("k3serve_expert_rows_total", "Token rows processed (a row may hold several of a token's experts)."))->WithLabels();
  m_busy_seconds_ = &metrics::Must(reg.AddCounter("k3serve_expert_busy_seconds_total",
                                                  "Seconds spent computing; rate() of it is the busy ratio."))->WithLabels();
  m_slots_ = &metrics::Must(reg.AddGauge("k3serve_expert_slots", "(layer, expert) slots loaded on this node."))->WithLabels();
  m_version_ = &metrics::Must(reg.AddGauge("k3serve_placement_version", "Placement version whose slots are loaded."))->WithLabels();
  m_errors_ = metrics::Must(reg.AddCounter("k3serve_expert_errors_total", "Requests answered with an error, by code.", {"code"}));
  worker_ = std::thread([this] { Worker(); });
}

ExpertNode::~ExpertNode() { Stop(); }

absl::Status ExpertNode::Listen(dataplane::Transport& transport, const std::string& address) {
  dataplane::ServerCallbacks cb;
  cb.on_message = [this](dataplane::ConnectionId from, dataplane::Buffer msg) {
    if (!Admit(from, msg)) return;
    const int64_t now = MonotonicNs();
    // Decoded here, on the transport's thread, so that the window knows the layer.
    auto request = wire::DecodeExpertRequest(msg.span(), {static_cast<uint32_t>(config_.num_experts)});
    std::unique_lock<std::mutex> lock(mu_);
    Sender& s = senders_[from];
    s.last_seen_ns = now;
    const uint32_t layer = request.ok() ? request->layer : 0;
    if (request.ok()) s.last_layer = layer;
    queue_.push_back({from, std::move(msg), std::move(request), now});
    // A batch that need not wait runs right here: handing it to the worker would cost a wake-up,
    // which on a busy machine is the longest part of the round trip. Rows that arrive meanwhile
    // wait in the transport, as they would behind the worker.
    if (options_.inline_batches && !busy_ && !stopping_ && WindowCanClose(layer, now)) {
      std::vector<Item> items(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
      queue_.clear();
      Held held = held_;
      busy_ = true;
      lock.unlock();
      RunBatch(items, held);
      lock.lock();
      busy_ = false;
      if (queue_.empty() && !stopping_) return;
    }
    lock.unlock();
    cv_.notify_one();
  };
  cb.on_closed = [this](dataplane::ConnectionId conn, absl::Status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      senders_.erase(conn);
    }
    greeted_.erase(conn);
    cv_.notify_one();
  };
  K3_ASSIGN_OR_RETURN(server_, transport.Listen(address, std::move(cb)));
  return absl::OkStatus();
}

bool ExpertNode::Admit(dataplane::ConnectionId from, const dataplane::Buffer& msg) {
  if (greeted_.count(from) || options_.node_token.empty()) {
    auto type = wire::PeekType(msg.span());
    return !type.ok() || *type != wire::MessageType::kHello;  // a Hello is not work
  }
  const absl::Status s = wire::CheckHello(msg.span(), options_.node_token);
  if (s.ok()) {
    greeted_.insert(from);
  } else {
    // No reply: a client without the token learns nothing but that the connection closed.
    m_errors_->WithLabels({absl::StatusCodeToString(s.code())}).Inc();
    std::fprintf(stderr, "expert node %s: closing a data-plane connection: %s\n", options_.node_id.c_str(),
                 std::string(s.message()).c_str());
    if (server_) server_->Close(from);
  }
  return false;
}

const std::string& ExpertNode::data_address() const { return server_->address(); }

void ExpertNode::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  server_.reset();
}

grpc::Status ExpertNode::LoadSlots(grpc::ServerContext* ctx, const v1::LoadSlotsRequest* req, v1::LoadSlotsResponse* resp) {
  if (auto s = auth::RequireAdmin(*ctx, "LoadSlots"); !s.ok()) return s;
  auto next = std::make_shared<Slots>();
  next->version = req->version();
  for (const auto& s : req->slots()) {
    if (s.layer() < 0 || s.layer() >= config_.num_layers || config_.mlp[s.layer()] != Mlp::kMoe)
      return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("slots.layer = ", s.layer(), " is not a MoE layer")};
    if (s.expert() < 0 || s.expert() >= config_.num_experts)
      return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("slots.expert = ", s.expert(), " is out of range")};
    next->slots.insert({s.layer(), s.expert()});
  }
  if (options_.slot_capacity > 0 && static_cast<int64_t>(next->slots.size()) > options_.slot_capacity)
    return {grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StrCat("slots: ", next->slots.size(), " exceed this node's --slots = ",
                                                               options_.slot_capacity)};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(req->version());
    if (it != held_.end() && it->second->slots == next->slots) {  // a retry of the same change
      resp->set_loaded(static_cast<int32_t>(next->slots.size()));
      return grpc::Status::OK;
    }
  }
  const bool gpu = options_.device == "cuda";
  // Memory-maps just these experts (fp32: views into the file; bf16: converted copies); on the GPU
  // the names and shapes are still checked here, and the weights go to the device as bf16.
  auto weights = LoadWeights(config_, checkpoint_, WeightFilter::ExpertsOnly([&](int64_t l, int64_t e) {
                               return !gpu && next->slots.count({static_cast<int32_t>(l), static_cast<int32_t>(e)}) > 0;
                             }));
  if (!weights.ok()) return ToGrpc(weights.status());
  next->weights = std::move(*weights);
#ifdef K3SERVE_HAVE_CUDA
  if (gpu) {
    auto g = GpuExperts::Load(config_, *checkpoint_, next->slots);
    if (!g.ok()) return ToGrpc(g.status());
    next->gpu = std::move(*g);
  }
#endif
  int64_t held = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_[next->version] = next;
    held = HeldSlotsLocked();
  }
  m_slots_->Set(static_cast<double>(held));
  m_version_->Set(static_cast<double>(next->version));
  resp->set_loaded(static_cast<int32_t>(next->slots.size()));
  return grpc::Status::OK;
}

grpc::Status ExpertNode::ReleaseSlots(grpc::ServerContext* ctx, const v1::ReleaseSlotsRequest* req, v1::ReleaseSlotsResponse* resp) {
  if (auto s = auth::RequireAdmin(*ctx, "ReleaseSlots"); !s.ok()) return s;
  int64_t held = 0;
  Held released;  // freed outside the lock (unmapping); a batch running on one keeps it alive
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = held_.begin(); it != held_.end();) {
      if (it->first == req->keep_version()) {
        ++it;
      } else {
        released.insert(*it);
        it = held_.erase(it);
      }
    }
    held = HeldSlotsLocked();
  }
  m_slots_->Set(static_cast<double>(held));
  resp->set_slots(static_cast<int32_t>(held));
  return grpc::Status::OK;
}

int64_t ExpertNode::HeldSlotsLocked() const {
  if (held_.size() == 1) return static_cast<int64_t>(held_.begin()->second->slots.size());
  std::set<std::pair<int32_t, int32_t>> all;
  for (const auto& [v, s] : held_) all.insert(s->slots.begin(), s->slots.end());
  return static_cast<int64_t>(all.size());
}

grpc::Status ExpertNode::Drain(grpc::ServerContext* ctx, const v1::DrainRequest*, v1::DrainResponse*) {
  if (auto s = auth::RequireAdmin(*ctx, "Drain"); !s.ok()) return s;
  draining_ = true;
  return grpc::Status::OK;
}

grpc::Status ExpertNode::Status(grpc::ServerContext* ctx, const v1::StatusRequest*, v1::ExpertStatus* resp) {
  if (auto s = auth::RequireNode(*ctx, "Status"); !s.ok()) return s;
  resp->set_node_id(options_.node_id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    resp->set_placement_version(held_.empty() ? 0 : held_.rbegin()->first);
    resp->set_slots(static_cast<int32_t>(HeldSlotsLocked()));
    for (const auto& [v, s] : held_) resp->add_held_versions(v);
  }
  resp->set_slot_capacity(options_.slot_capacity);
  resp->set_rows_processed(rows_processed_);
  resp->set_batches_processed(batches_processed_);
  resp->set_draining(draining_);
  resp->set_busy_seconds(m_busy_seconds_->Value());
  return grpc::Status::OK;
}

void ExpertNode::Worker() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return (stopping_ && !busy_) || (!queue_.empty() && !busy_); });
    if (queue_.empty()) return;  // stopping, and every queued row answered
    busy_ = true;  // the queue is the worker's until its batch is done
    // The batching window: rows of the same layer from the other attention nodes may join. It
    // closes once none of them still has to send, so a lone attention node never waits.
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.batch_window);
    const uint32_t layer = queue_.front().request.ok() ? queue_.front().request->layer : 0;
    while (!stopping_ && static_cast<int64_t>(queue_.size()) < options_.max_batch_messages &&
           !WindowCanClose(layer, MonotonicNs()) && cv_.wait_until(lock, deadline) != std::cv_status::timeout) {
    }
    std::vector<Item> items(std::make_move_iterator(queue_.begin()), std::make_move_iterator(queue_.end()));
    queue_.clear();
    Held held = held_;
    lock.unlock();
    RunBatch(items, held);
    lock.lock();
    busy_ = false;
  }
}

bool ExpertNode::WindowCanClose(uint32_t layer, int64_t now_ns) const {
  // A sending attention node whose latest rows are for an earlier layer has this layer's on the way.
  for (const auto& [conn, s] : senders_)
    if (now_ns - s.last_seen_ns <= absl::ToInt64Nanoseconds(options_.sending) && s.last_layer < layer) return false;
  return true;
}

void ExpertNode::ReplyError(dataplane::ConnectionId to, uint64_t request_id, const absl::Status& s) {
  m_errors_->WithLabels({absl::StatusCodeToString(s.code())}).Inc();
  auto buf = wire::Encode<dataplane::Buffer>(wire::ErrorReply{request_id, s});
  if (buf.ok() && server_) server_->Send(to, std::move(*buf), [](absl::Status) {});
}

void ExpertNode::RunBatch(std::vector<Item>& items, const Held& held) {
  const absl::Time t0 = absl::Now();
  const int64_t start_ns = MonotonicNs();
  struct Req {
    size_t item;
    wire::ExpertRequest m;
    int64_t first_row = 0;
  };
  const int64_t k = config_.top_k, X = config_.expert_width();
  // Grouped by the slots that serve them and by layer, so each layer runs one grouped GEMM per expert.
  std::map<std::pair<const Slots*, uint32_t>, std::vector<Req>> by_layer;
  // The slots of the request's placement version; while a change is under way, a row may come
  // on a version this node has no slots for (it joined later) and is served by any held version
  // that hosts all its experts.
  auto serving = [&](const wire::ExpertRequest& m) -> const Slots* {
    auto hosts_all = [&](const Slots& s) {
      for (const auto& p : m.pairs)
        if (!s.slots.count({static_cast<int32_t>(m.layer), static_cast<int32_t>(p.expert)})) return false;
      return true;
    };
    auto it = held.find(m.placement_version);
    if (it != held.end() && hosts_all(*it->second)) return it->second.get();
    for (auto r = held.rbegin(); r != held.rend(); ++r)
      if (hosts_all(*r->second)) return r->second.get();
    return nullptr;
  };
  for (size_t i = 0; i < items.size(); ++i) {
    auto& m = items[i].request;
    if (!m.ok()) {
      ReplyError(items[i].from, 0, m.status());
      continue;
    }
    absl::Status bad;
    if (draining_) bad = absl::UnavailableError("expert node is draining");
    else if (m->layer >= config_.num_layers || config_.mlp[m->layer] != Mlp::kMoe)
      bad = absl::InvalidArgumentError(absl::StrCat("layer ", m->layer, " has no routed experts"));
    else if (m->width != X)
      bad = absl::InvalidArgumentError(absl::StrCat("width ", m->width, " != the model's expert width ", X));
    for (uint32_t r = 0; bad.ok() && r < m->n_rows; ++r) {
      if (m->row_offsets[r + 1] - m->row_offsets[r] > k)
        bad = absl::InvalidArgumentError(absl::StrCat("row ", r, " has more than top_k = ", k, " experts"));
    }
    const Slots* slots = bad.ok() ? serving(*m) : nullptr;
    if (bad.ok() && slots == nullptr) {
      std::string versions;
      for (const auto& [v, s] : held) absl::StrAppend(&versions, versions.empty() ? "v" : ", v", v);
      auto it = held.find(m->placement_version);
      uint32_t missing = m->pairs.empty() ? 0 : m->pairs[0].expert;
      for (const auto& p : m->pairs)
        if (it != held.end() && !it->second->slots.count({static_cast<int32_t>(m->layer), static_cast<int32_t>(p.expert)})) {
          missing = p.expert;
          break;
        }
      bad = absl::FailedPreconditionError(absl::StrCat("expert ", missing, " of layer ", m->layer, " is not hosted here (placement v",
                                                       m->placement_version, "; slots held: ", versions.empty() ? "none" : versions, ")"));
    }
    if (!bad.ok()) {
      ReplyError(items[i].from, m->request_id, bad);
      continue;
    }
    by_layer[{slots, m->layer}].push_back({i, std::move(*m)});
  }

  int64_t total_rows = 0;
  for (auto& [key, reqs] : by_layer) {
    const Slots& slots = *key.first;
    const uint32_t layer = key.second;
    LocalExpertExecutor executor(config_, *slots.weights);
    int64_t rows = 0;
    for (auto& r : reqs) {
      r.first_row = rows;
      rows += r.m.n_rows;
    }
    // All requests' rows as one batch, pairs padded to top_k with -1 (not routed here).
    std::vector<float> x(rows * X), out(rows * X);
    std::vector<int32_t> idx(rows * k, -1);
    std::vector<float> w(rows * k, 0.0f);
    absl::Status status;
    for (const auto& r : reqs) {
      status.Update(wire::ToFloat(r.m.dtype, r.m.rows, std::span<float>(x.data() + r.first_row * X, r.m.n_rows * X)));
      for (uint32_t i = 0; i < r.m.n_rows; ++i)
        for (uint32_t p = r.m.row_offsets[i], j = 0; p < r.m.row_offsets[i + 1]; ++p, ++j) {
          idx[(r.first_row + i) * k + j] = static_cast<int32_t>(r.m.pairs[p].expert);
          w[(r.first_row + i) * k + j] = r.m.pairs[p].weight;
        }
    }
    const ExpertRequest request{layer, rows, X, k, x.data(), idx.data(), w.data()};
#ifdef K3SERVE_HAVE_CUDA
    if (status.ok() && slots.gpu) {
      status = slots.gpu->Run(request, out.data());
    } else if (status.ok()) {
      status = executor.Run(request, out.data());
    }
#else
    if (status.ok()) status = executor.Run(request, out.data());
#endif
    for (const auto& r : reqs) {
      const dataplane::ConnectionId to = items[r.item].from;
      if (!status.ok()) {
        ReplyError(to, r.m.request_id, status);
        continue;
      }
      wire::ExpertReply reply;
      reply.request_id = r.m.request_id;
      reply.received_at_ns = static_cast<uint64_t>(items[r.item].received_ns);
      reply.queued_ns = static_cast<uint64_t>(std::max<int64_t>(0, start_ns - items[r.item].received_ns));
      reply.dtype = r.m.dtype;
      reply.width = static_cast<uint32_t>(X);
      reply.n_rows = r.m.n_rows;
      std::vector<std::byte> sums(static_cast<size_t>(r.m.n_rows) * X * wire::RowDTypeSize(r.m.dtype));
      status.Update(wire::FromFloat(std::span<const float>(out.data() + r.first_row * X, r.m.n_rows * X), r.m.dtype, sums));
      reply.sums = sums;
      reply.compute_ns = static_cast<uint64_t>(MonotonicNs() - start_ns);
      auto buf = wire::Encode<dataplane::Buffer>(reply);
      if (!buf.ok()) {
        ReplyError(to, r.m.request_id, buf.status());
        continue;
      }
      server_->Send(to, std::move(*buf), [](absl::Status) {});
    }
    total_rows += rows;
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  m_batch_rows_->Observe(static_cast<double>(total_rows));
  m_batch_requests_->Observe(static_cast<double>(items.size()));
  m_batch_seconds_->Observe(secs);
  m_busy_seconds_->Inc(secs);
  m_rows_->Inc(static_cast<double>(total_rows));
  rows_processed_ += total_rows;
  batches_processed_++;
}

}  // namespace k3
