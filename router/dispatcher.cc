#include "router/dispatcher.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <tuple>

#include "absl/algorithm/container.h"
#include "absl/strings/str_join.h"

namespace k3::router {
namespace {

// Timed-out parts remembered for their late replies.
constexpr size_t kLateParts = 256;

int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Dispatcher::Dispatcher(const ModelConfig& config, dataplane::Transport& transport, DispatcherOptions options)
    : config_(config), transport_(transport), options_(std::move(options)) {}

Dispatcher::~Dispatcher() {
  std::map<std::string, std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers.swap(peers_);
    pending_.clear();
    parts_.clear();
    late_.clear();
  }
  // Connections close outside the lock: their destructors wait for callbacks that take it.
  for (auto& [id, p] : peers) p->conn.reset();
}

absl::Status Dispatcher::CheckNewer(const PlacementTable& placement) const {
  // Versions only go up (a router restart continues above its predecessor): an older one is
  // stale or forged.
  if (placement_ && placement.version < placement_->version)
    return absl::FailedPreconditionError(absl::StrCat("placement v", placement.version, " is older than v",
                                                      placement_->version, " in use: ignored"));
  return absl::OkStatus();
}

absl::Status Dispatcher::SetPlacement(std::shared_ptr<const PlacementTable> placement) {
  // Connect to the nodes this placement adds before any dispatch may route to them.
  std::map<std::string, std::shared_ptr<Peer>> added;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto s = CheckNewer(*placement); !s.ok()) return s;
    for (const NodeInfo& n : placement->nodes) {
      auto it = peers_.find(n.node_id);
      if (it != peers_.end() && it->second->address == n.ucx_address && !it->second->failed) continue;
      auto p = std::make_shared<Peer>();
      p->node_id = n.node_id;
      p->address = n.ucx_address;
      added[n.node_id] = p;
    }
  }
  absl::Status status;
  for (auto& [id, p] : added) {
    dataplane::ClientCallbacks cb;
    cb.on_message = [this, id = id](dataplane::Buffer msg) { OnMessage(id, std::move(msg)); };
    cb.on_failure = [this, id = id](absl::Status why) { OnFailure(id, why); };
    auto conn = transport_.Connect(p->address, std::move(cb));
    if (!conn.ok()) {
      p->failed = true;
      status.Update(absl::UnavailableError(absl::StrCat("expert node ", id, " at ", p->address, ": ", conn.status().message())));
      continue;
    }
    // The handshake goes first; the transport keeps a connection's messages in order.
    auto hello = wire::Encode<dataplane::Buffer>(wire::Hello{options_.node_token});
    if (!hello.ok()) {
      p->failed = true;
      status.Update(hello.status());
      continue;
    }
    (*conn)->Send(std::move(*hello), [](absl::Status) {});
    std::lock_guard<std::mutex> lock(mu_);
    p->conn = std::move(*conn);
  }
  std::vector<std::shared_ptr<Peer>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto s = CheckNewer(*placement); !s.ok()) return s;  // another placement came meanwhile
    std::map<std::string, std::shared_ptr<Peer>> next;
    for (const NodeInfo& n : placement->nodes) {
      auto a = added.find(n.node_id);
      next[n.node_id] = a != added.end() ? a->second : peers_.at(n.node_id);
    }
    for (auto& [id, p] : peers_)
      if (!next.count(id) || next[id] != p) dropped.push_back(p);
    peers_ = std::move(next);
    placement_ = std::move(placement);
  }
  added.clear();
  // Dropped peers close when their last in-flight part lets go of them (here, if none).
  for (auto& p : dropped) {
    std::unique_ptr<dataplane::Connection> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (p.use_count() == 1) conn = std::move(p->conn);
    }
  }
  cv_.notify_all();
  return status;
}

bool Dispatcher::WaitDrained(uint64_t version, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const absl::Time end = absl::Now() + timeout;
  auto other = [&] { return !in_flight_.empty() && (in_flight_.size() > 1 || in_flight_.begin()->first != version); };
  while (other()) {
    const absl::Duration left = end - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Milliseconds(50))));
  }
  return true;
}

bool Dispatcher::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!placement_ || !placement_->complete()) return false;
  // A suspect node still counts: it is connected and may only have been slow.
  for (const auto& [id, p] : peers_)
    if (!p->connected()) return false;
  return true;
}

uint64_t Dispatcher::placement_version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return placement_ ? placement_->version : 0;
}

absl::StatusOr<uint64_t> Dispatcher::Submit(const ExpertRequest& r) { return SubmitAttempt(r, 0); }

absl::Duration Dispatcher::Timeout() const {
  return options_.timeout > absl::ZeroDuration() ? options_.timeout : options_.timeout_margin + 2 * slowest_;
}

absl::StatusOr<uint64_t> Dispatcher::SubmitAttempt(const ExpertRequest& r, int attempt) {
  const int64_t pack_start = MonotonicNs();
  std::unique_lock<std::mutex> lock(mu_);
  if (!placement_) return absl::UnavailableError("no expert placement yet");
  const PlacementTable& pt = *placement_;
  if (r.layer < 0 || r.layer >= static_cast<int64_t>(pt.replicas.size()) || pt.replicas[r.layer].empty())
    return absl::UnavailableError(absl::StrCat("placement v", pt.version, " has no experts for layer ", r.layer));
  const auto& layer = pt.replicas[r.layer];

  // Replica choice, row by row: the connected replica with the least outstanding work, a suspect
  // one only where no other is left, and never on a retry (it goes to a replica or fails).
  std::vector<std::shared_ptr<Peer>> node_peer(pt.nodes.size());
  std::vector<bool> suspect(pt.nodes.size(), false);
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < pt.nodes.size(); ++i) {
    auto it = peers_.find(pt.nodes[i].node_id);
    if (it == peers_.end() || !it->second->connected()) continue;
    suspect[i] = it->second->suspect(now);
    if (!suspect[i] || attempt == 0) node_peer[i] = it->second;
  }
  // chosen[n * k + j] = node index of pair j of row n (-1: not routed).
  std::vector<int32_t> chosen(r.rows * r.top_k, -1);
  std::vector<int64_t> load(pt.nodes.size(), 0);
  for (size_t i = 0; i < pt.nodes.size(); ++i)
    if (node_peer[i]) load[i] = node_peer[i]->outstanding_rows;
  for (int64_t i = 0; i < r.rows * r.top_k; ++i)
    if (r.idx[i] >= static_cast<int32_t>(layer.size()))
      return absl::InvalidArgumentError(absl::StrCat("expert id ", r.idx[i], " out of range"));
  // One node for the whole dispatch, if a live, unsuspected one hosts all its experts.
  int32_t whole = -1;
  if (r.rows <= options_.one_node_max_rows) {
    for (int32_t n = 0; n < static_cast<int32_t>(pt.nodes.size()); ++n) {
      if (!node_peer[n] || suspect[n] || (whole >= 0 && load[n] >= load[whole])) continue;
      bool all = true;
      for (int64_t i = 0; i < r.rows * r.top_k && all; ++i)
        all = r.idx[i] < 0 || absl::c_linear_search(layer[r.idx[i]], n);
      if (all) whole = n;
    }
  }
  for (int64_t i = 0; i < r.rows * r.top_k; ++i) {
    const int32_t e = r.idx[i];
    if (e < 0) continue;
    if (whole >= 0) {
      chosen[i] = whole;
      continue;
    }
    int32_t best = -1;
    for (int32_t node : layer[e]) {
      if (!node_peer[node]) continue;
      if (best < 0 || (suspect[best] && !suspect[node]) ||
          (suspect[best] == suspect[node] && load[node] < load[best]))
        best = node;
    }
    if (best < 0)
      return absl::UnavailableError(absl::StrCat("expert ", e, " of layer ", r.layer, " has no live replica (placement v",
                                                 pt.version, ")"));
    chosen[i] = best;
    load[best]++;
  }

  const uint64_t version = pt.version;
  lock.unlock();

  // One message per node, built in one pass over the pairs: the rows that node sums, each with the
  // pairs it hosts (pre-summed there). Encoded outside the lock; nothing is registered until all are.
  struct Out {
    wire::ExpertRequest m;
    std::vector<int32_t> rows;
    dataplane::Buffer buf;
  };
  std::vector<Out> out(node_peer.size());
  for (int64_t n = 0; n < r.rows; ++n)
    for (int64_t j = 0; j < r.top_k; ++j) {
      const int32_t node = chosen[n * r.top_k + j];
      if (node < 0) continue;
      Out& o = out[node];
      if (o.rows.empty() || o.rows.back() != n) {
        if (!o.rows.empty()) o.m.row_offsets.push_back(static_cast<uint32_t>(o.m.pairs.size()));
        o.rows.push_back(static_cast<int32_t>(n));
      }
      o.m.pairs.push_back({static_cast<uint32_t>(r.idx[n * r.top_k + j]), r.w[n * r.top_k + j]});
    }
  const size_t row_bytes = r.width * wire::RowDTypeSize(options_.dtype);
  std::vector<std::byte> rows;
  for (Out& o : out) {
    if (o.rows.empty()) continue;
    o.m.row_offsets.push_back(static_cast<uint32_t>(o.m.pairs.size()));
    o.m.layer = static_cast<uint32_t>(r.layer);
    o.m.placement_version = version;
    o.m.dtype = options_.dtype;
    o.m.width = static_cast<uint32_t>(r.width);
    o.m.n_rows = static_cast<uint32_t>(o.rows.size());
    o.m.request_id = next_wire_id_++;
    rows.resize(o.rows.size() * row_bytes);
    for (size_t i = 0; i < o.rows.size(); ++i)
      K3_RETURN_IF_ERROR(wire::FromFloat(std::span<const float>(r.x + o.rows[i] * r.width, r.width), options_.dtype,
                                         std::span<std::byte>(rows.data() + i * row_bytes, row_bytes)));
    o.m.rows = rows;
    K3_ASSIGN_OR_RETURN(o.buf, wire::Encode<dataplane::Buffer>(o.m));
  }

  lock.lock();
  const uint64_t ticket = next_ticket_++;
  Pending& pending = pending_[ticket];
  pending.rows = r.rows;
  pending.width = r.width;
  pending.start = absl::Now();
  pending.request = r;
  pending.attempt = attempt;
  const int64_t sent_ns = MonotonicNs();
  pending.pack_ns = sent_ns - pack_start;
  pending.version = version;
  in_flight_[version]++;
  std::vector<std::tuple<std::shared_ptr<Peer>, uint64_t, dataplane::Buffer>> sends;
  for (size_t node = 0; node < out.size(); ++node) {
    if (out[node].rows.empty()) continue;
    Part part;
    part.peer = node_peer[node];
    part.rows = std::move(out[node].rows);
    part.wire_id = out[node].m.request_id;
    part.bytes_out = out[node].buf.size();
    part.sent_ns = sent_ns;
    part.peer->outstanding_rows += static_cast<int64_t>(part.rows.size());
    parts_[part.wire_id] = {ticket, pending.parts.size()};
    sends.emplace_back(part.peer, part.wire_id, std::move(out[node].buf));
    pending.parts.push_back(std::move(part));
  }
  pending.remaining = static_cast<int>(pending.parts.size());
  lock.unlock();
  for (auto& [peer, wire_id, buf] : sends) {
    peer->conn->Send(std::move(buf), [this, id = wire_id](absl::Status s) {
      if (!s.ok()) FinishPart(id, s, {}, 0);
    });
  }
  return ticket;
}

absl::Status Dispatcher::Wait(uint64_t ticket, float* out) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(ticket);
  if (it == pending_.end()) return absl::NotFoundError(absl::StrCat("unknown dispatch ticket ", ticket));
  Pending& p = it->second;
  std::vector<std::string> hung;  // nodes that did not answer in time
  const absl::Time poll_until = options_.poll > absl::ZeroDuration() ? absl::Now() + options_.poll : absl::InfinitePast();
  Polled polled;  // connections between BeginPoll and EndPoll
  while (p.remaining > 0 && p.status.ok()) {
    const absl::Duration timeout = Timeout();
    const absl::Duration left = p.start + timeout - absl::Now();
    if (left <= absl::ZeroDuration()) {
      const absl::Time until = absl::Now() + 3 * timeout + absl::Seconds(1);
      for (Part& part : p.parts)
        if (!part.done) {
          part.peer->suspect_until = until;
          hung.push_back(part.peer->node_id);
          late_[part.wire_id] = p.start;
        }
      while (late_.size() > kLateParts) late_.erase(late_.begin());  // ids only grow: the oldest go
      p.status = absl::UnavailableError(absl::StrCat("expert node ", absl::StrJoin(hung, ", "), " did not answer within ",
                                                     absl::FormatDuration(timeout)));
      break;
    }
    if (absl::Now() < poll_until) {
      if (PollParts(p, polled, lock)) continue;
    } else if (!polled.empty()) {
      EndPolls(polled, lock);
      continue;
    }
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Milliseconds(100))));
  }
  EndPolls(polled, lock);  // before the parts let go of their peers
  absl::Status status = p.status;
  std::vector<std::pair<std::string, DispatchStages>> stages;
  if (status.ok()) {
    // Sum the nodes' partials in node order: the same order every time.
    const int64_t sum_start = MonotonicNs();
    std::fill(out, out + p.rows * p.width, 0.0f);
    for (const Part& part : p.parts)
      for (size_t i = 0; i < part.rows.size(); ++i) {
        float* dst = out + part.rows[i] * p.width;
        const float* src = part.sums.data() + i * p.width;
        for (int64_t c = 0; c < p.width; ++c) dst[c] += src[c];
      }
    if (options_.on_stages) {
      const int64_t sum_ns = (MonotonicNs() - sum_start) / static_cast<int64_t>(std::max<size_t>(1, p.parts.size()));
      for (const Part& part : p.parts) {
        const wire::ExpertReply& t = part.timing;
        const int64_t received = static_cast<int64_t>(t.received_at_ns);
        const int64_t replied = received + static_cast<int64_t>(t.queued_ns + t.compute_ns);
        stages.emplace_back(part.peer->node_id,
                            DispatchStages{.pack = absl::Nanoseconds(p.pack_ns),
                                           .out = absl::Nanoseconds(received - part.sent_ns),
                                           .window = absl::Nanoseconds(t.queued_ns),
                                           .compute = absl::Nanoseconds(t.compute_ns),
                                           .back = absl::Nanoseconds(part.arrived_ns - replied),
                                           .unpack = absl::Nanoseconds(part.decode_ns + sum_ns),
                                           .decode = p.request.decode});
      }
    }
  }
  std::vector<std::shared_ptr<Peer>> release;
  for (Part& part : p.parts) {
    if (!part.done) part.peer->outstanding_rows -= static_cast<int64_t>(part.rows.size());
    release.push_back(std::move(part.peer));
  }
  for (const Part& part : p.parts) parts_.erase(part.wire_id);
  if (--in_flight_[p.version] == 0) in_flight_.erase(p.version);
  // A peer that left the placement closes with its last part.
  std::vector<std::unique_ptr<dataplane::Connection>> closing;
  for (auto& peer : release)
    if (peer.use_count() == 1 && peer->conn) closing.push_back(std::move(peer->conn));
  const ExpertRequest request = p.request;
  const int attempt = p.attempt;
  pending_.erase(it);
  lock.unlock();
  cv_.notify_all();  // WaitDrained
  closing.clear();
  for (const auto& [node, st] : stages) options_.on_stages(node, st);
  if (options_.on_node_failure)
    for (const std::string& node : hung) options_.on_node_failure(node, absl::UnavailableError("no reply in time"));
  // A node failed or hung: once more on the replicas that are left, if every expert has one.
  if (status.code() == absl::StatusCode::kUnavailable && attempt == 0) {
    auto retry = SubmitAttempt(request, 1);
    if (retry.ok()) return Wait(*retry, out);
  }
  return status;
}

bool Dispatcher::PollParts(const Pending& p, Polled& polled, std::unique_lock<std::mutex>& lock) {
  // A part's peer keeps its connection while the part holds it (SetPlacement and Wait close a
  // connection only with its peer's last reference), so the pointers outlive the unlocked polls.
  for (const Part& part : p.parts) {
    dataplane::Connection* c = part.peer->conn.get();
    if (part.done || c == nullptr || !c->can_poll() || absl::c_linear_search(polled, c)) continue;
    c->BeginPoll();
    polled.push_back(c);
  }
  if (polled.empty()) return false;
  lock.unlock();
  bool got = false;
  for (dataplane::Connection* c : polled) got |= c->Poll();
  // Let a thread that shares this CPU go first: on a small host it may be the expert node itself.
  if (!got) std::this_thread::yield();
  lock.lock();
  return true;
}

void Dispatcher::EndPolls(Polled& polled, std::unique_lock<std::mutex>& lock) {
  if (polled.empty()) return;
  lock.unlock();
  for (dataplane::Connection* c : polled) c->EndPoll();
  polled.clear();
  lock.lock();
}

void Dispatcher::OnMessage(const std::string& node_id, dataplane::Buffer msg) {
  const int64_t arrived_ns = MonotonicNs();
  auto type = wire::PeekType(msg.span());
  if (!type.ok()) {
    OnFailure(node_id, absl::DataLossError(absl::StrCat("malformed message from expert node: ", type.status().message())));
    return;
  }
  if (*type == wire::MessageType::kExpertReply) {
    auto reply = wire::DecodeExpertReply(msg.span());
    if (!reply.ok()) {
      OnFailure(node_id, reply.status());
      return;
    }
    FinishPart(reply->request_id, absl::OkStatus(), {&*reply, arrived_ns}, msg.size());
  } else if (*type == wire::MessageType::kErrorReply) {
    auto err = wire::DecodeErrorReply(msg.span());
    if (err.ok()) FinishPart(err->request_id, err->status, {}, msg.size());
  }
}

void Dispatcher::FinishPart(uint64_t wire_id, const absl::Status& status, const Arrival& arrival, size_t bytes_in) {
  std::string node;
  size_t bytes_out = 0;
  absl::Duration took;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = parts_.find(wire_id);
    if (it == parts_.end()) {  // a reply for a request that already ended
      auto late = late_.find(wire_id);
      if (late == late_.end()) return;
      if (status.ok()) slowest_ = std::max(slowest_, absl::Now() - late->second);
      late_.erase(late);
      return;
    }
    Pending& p = pending_.at(it->second.first);
    Part& part = p.parts[it->second.second];
    if (part.done) return;
    const wire::ExpertReply* reply = arrival.reply;
    const size_t values = reply ? static_cast<size_t>(reply->n_rows) * reply->width : 0;
    if (status.ok() && values != part.rows.size() * static_cast<size_t>(p.width)) {
      p.status = absl::DataLossError(absl::StrCat("expert node ", part.peer->node_id, " replied with ", values,
                                                  " values, expected ", part.rows.size() * p.width));
    } else if (!status.ok()) {
      p.status = absl::Status(status.code(), absl::StrCat("expert node ", part.peer->node_id, ": ", status.message()));
    } else {
      // Straight from the message into the part: one conversion, no intermediate copy.
      part.sums.resize(values);
      p.status.Update(wire::ToFloat(reply->dtype, reply->sums, part.sums));
      part.timing = *reply;
      part.timing.sums = {};
      part.arrived_ns = arrival.arrived_ns;
      part.decode_ns = MonotonicNs() - arrival.arrived_ns;
    }
    part.done = true;
    part.peer->outstanding_rows -= static_cast<int64_t>(part.rows.size());
    p.remaining--;
    node = part.peer->node_id;
    bytes_out = part.bytes_out;
    took = absl::Now() - p.start;
    if (status.ok()) slowest_ = std::max(took, slowest_ * 0.99);
    parts_.erase(it);
  }
  cv_.notify_all();
  if (options_.on_part && status.ok()) options_.on_part(node, bytes_out, bytes_in, took);
}

void Dispatcher::OnFailure(const std::string& node_id, const absl::Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(node_id);
    if (it != peers_.end()) it->second->failed = true;
    const absl::Status s = absl::UnavailableError(absl::StrCat("expert node ", node_id, " failed: ", why.message()));
    for (auto pit = parts_.begin(); pit != parts_.end();) {
      Pending& p = pending_.at(pit->second.first);
      Part& part = p.parts[pit->second.second];
      if (part.peer->node_id == node_id && !part.done) {
        part.done = true;
        part.peer->outstanding_rows -= static_cast<int64_t>(part.rows.size());
        p.remaining--;
        if (p.status.ok()) p.status = s;
        pit = parts_.erase(pit);
      } else {
        ++pit;
      }
    }
  }
  cv_.notify_all();
  if (options_.on_node_failure) options_.on_node_failure(node_id, why);
}

}  // namespace k3::router
