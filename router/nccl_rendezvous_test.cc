// The NCCL data plane's control plane over real gRPC on 127.0.0.1: the unique id reaches the
// expert node intact, errors come back to the opener, and each side learns when the other's
// stream goes away. No GPU: the id is opaque bytes here.
#include "router/nccl_rendezvous.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>

#include <gtest/gtest.h>

#include "tools/local_cluster.h"

namespace k3::dataplane {
namespace {

std::string Id(char fill) {
  std::string id(kNcclUniqueIdBytes, fill);
  id[0] = '\0';  // bytes, not a C string
  id[127] = '\xff';
  return id;
}

// Waits up to 5 s for pred.
template <class F>
bool Eventually(F pred) {
  for (int i = 0; i < 500; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

struct Recorder {
  std::mutex mu;
  std::vector<NcclOpenRequest> opened;
  std::vector<std::pair<uint64_t, absl::Status>> closed;
  std::atomic<uint64_t> next{1};
  absl::Status refuse = absl::OkStatus();

  NcclRendezvousServer::OnOpen OnOpen() {
    return [this](const NcclOpenRequest& r) -> absl::StatusOr<NcclAccepted> {
      std::lock_guard<std::mutex> lock(mu);
      if (!refuse.ok()) return refuse;
      opened.push_back(r);
      return NcclAccepted{"expert-a", 1, next++, 512};
    };
  }
  NcclRendezvousServer::OnClosed OnClosed() {
    return [this](uint64_t s, const absl::Status& why) {
      std::lock_guard<std::mutex> lock(mu);
      closed.emplace_back(s, why);
    };
  }
  size_t n_closed() {
    std::lock_guard<std::mutex> lock(mu);
    return closed.size();
  }
};

TEST(NcclRendezvous, ExchangesTheIdAndClosesWithTheClient) {
  Recorder rec;
  auto server = NcclRendezvousServer::Start("127.0.0.1:0", rec.OnOpen(), rec.OnClosed());
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_NE((*server)->address(), "127.0.0.1:0");
  std::atomic<int> lost{0};
  {
    auto a = NcclRendezvousClient::Open((*server)->address(), {Id('a'), "attn-0", 0}, absl::Seconds(5),
                                        [&](absl::Status) { ++lost; });
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = NcclRendezvousClient::Open((*server)->address(), {Id('b'), "attn-1", 2}, absl::Seconds(5),
                                        [&](absl::Status) { ++lost; });
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*a)->accepted().node_id, "expert-a");
    EXPECT_EQ((*a)->accepted().device, 1);
    EXPECT_EQ((*a)->accepted().max_rows, 512);
    EXPECT_NE((*a)->accepted().session, (*b)->accepted().session);
    {
      std::lock_guard<std::mutex> lock(rec.mu);
      ASSERT_EQ(rec.opened.size(), 2u);
      EXPECT_EQ(rec.opened[0].unique_id, Id('a'));  // all 128 bytes, the NULs too
      EXPECT_EQ(rec.opened[1].unique_id, Id('b'));
      EXPECT_EQ(rec.opened[1].client_id, "attn-1");
      EXPECT_EQ(rec.opened[1].client_device, 2);
    }
    EXPECT_EQ(rec.n_closed(), 0u);  // the streams stay open while the sessions live
    a->reset();
    ASSERT_TRUE(Eventually([&] { return rec.n_closed() == 1; }));
    {
      std::lock_guard<std::mutex> lock(rec.mu);
      EXPECT_EQ(rec.closed[0].first, 1u);
      EXPECT_EQ(rec.closed[0].second.code(), absl::StatusCode::kUnavailable);
    }
  }
  ASSERT_TRUE(Eventually([&] { return rec.n_closed() == 2; }));
  EXPECT_EQ(lost.load(), 0);  // closing from the client's side is not a loss
}

TEST(NcclRendezvous, ClientLearnsOfCloseAndShutdown) {
  Recorder rec;
  auto server = NcclRendezvousServer::Start("127.0.0.1:0", rec.OnOpen(), rec.OnClosed());
  ASSERT_TRUE(server.ok()) << server.status();
  std::mutex mu;
  std::vector<absl::Status> lost;
  auto on_lost = [&](absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    lost.push_back(s);
  };
  auto n_lost = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return lost.size();
  };
  auto a = NcclRendezvousClient::Open((*server)->address(), {Id('a'), "attn-0", 0}, absl::Seconds(5), on_lost);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = NcclRendezvousClient::Open((*server)->address(), {Id('b'), "attn-1", 0}, absl::Seconds(5), on_lost);
  ASSERT_TRUE(b.ok()) << b.status();
  // The expert node ends one session (its communicator failed): that client alone hears why.
  (*server)->Close((*a)->accepted().session, absl::DataLossError("frame.rows: 0 not in [1, 64]"));
  ASSERT_TRUE(Eventually([&] { return n_lost() == 1; }));
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(lost[0].code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(lost[0].message().find("frame.rows"), std::string::npos) << lost[0];
    EXPECT_NE(lost[0].message().find("expert-a"), std::string::npos) << lost[0];
  }
  // The expert node goes away: the other client hears it too.
  server->reset();
  ASSERT_TRUE(Eventually([&] { return n_lost() == 2; }));
  EXPECT_EQ(rec.n_closed(), 2u);
}

TEST(NcclRendezvous, ErrorsReachTheOpener) {
  Recorder rec;
  rec.refuse = absl::ResourceExhaustedError("max_rows: the expert node serves at most 4 sessions");
  auto server = NcclRendezvousServer::Start("127.0.0.1:0", rec.OnOpen(), rec.OnClosed());
  ASSERT_TRUE(server.ok()) << server.status();
  auto refused = NcclRendezvousClient::Open((*server)->address(), {Id('a'), "attn", 0}, absl::Seconds(5), nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("max_rows"), std::string::npos) << refused.status();
  // A malformed id is refused by the client before it sends anything ...
  auto short_id = NcclRendezvousClient::Open((*server)->address(), {"abc", "attn", 0}, absl::Seconds(5), nullptr);
  ASSERT_FALSE(short_id.ok());
  EXPECT_EQ(short_id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(short_id.status().message().find("unique_id"), std::string::npos);
  // ... and by the server from any other sender.
  auto stub = ::k3serve::v1::NcclBootstrap::NewStub(
      grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
  for (auto [id, device, field] : {std::tuple{std::string(127, 'x'), 0, "unique_id"},
                                   std::tuple{Id('c'), -1, "client_device"}}) {
    grpc::ClientContext ctx;
    ::k3serve::v1::NcclOpenRequest req;
    req.set_unique_id(id);
    req.set_client_device(device);
    auto reader = stub->Open(&ctx, req);
    ::k3serve::v1::NcclOpenEvent ev;
    EXPECT_FALSE(reader->Read(&ev));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find(field), std::string::npos) << s.error_message();
  }
  std::lock_guard<std::mutex> lock(rec.mu);
  EXPECT_TRUE(rec.opened.empty());
}

TEST(NcclRendezvous, UnreachableAndSilentServersTimeOut) {
  // Nothing listens on a port just released.
  std::string dead;
  {
    Recorder rec;
    auto s = NcclRendezvousServer::Start("127.0.0.1:0", rec.OnOpen(), rec.OnClosed());
    ASSERT_TRUE(s.ok());
    dead = (*s)->address();
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto c = NcclRendezvousClient::Open(dead, {Id('a'), "attn", 0}, absl::Milliseconds(300), nullptr);
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // A server that never answers (its join hangs): the opener gives up at its timeout.
  std::atomic<bool> release{false};
  auto hang = NcclRendezvousServer::Start(
      "127.0.0.1:0",
      [&](const NcclOpenRequest&) -> absl::StatusOr<NcclAccepted> {
        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return absl::UnavailableError("released");
      },
      [](uint64_t, const absl::Status&) {});
  ASSERT_TRUE(hang.ok());
  auto late = NcclRendezvousClient::Open((*hang)->address(), {Id('a'), "attn", 0}, absl::Milliseconds(300), nullptr);
  release = true;
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
}

// A k3serve-nccl-rendezvous-peer process and the value of the first log line starting with prefix.
std::pair<std::unique_ptr<Process>, std::string> StartPeer(const std::string& name, const std::string& mode,
                                                           const std::string& address, const std::string& prefix) {
  const std::string log = (std::filesystem::temp_directory_path() / ("k3_" + name + ".log")).string();
  auto p = Process::Spawn(name, {K3SERVE_NCCL_PEER, mode, address}, log);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return {};
  std::string value;
  for (int i = 0; i < 500 && value.empty() && (*p)->alive(); ++i) {
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);)
      if (line.rfind(prefix, 0) == 0) value = line.substr(prefix.size());
    if (value.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_FALSE(value.empty()) << name << " did not start; see " << log;
  return {std::move(*p), value};
}

// The expert node's process is SIGKILLed: the attention node hears of it from the broken stream, at
// once rather than at a timeout (NCCL itself would wait on the dead peer).
TEST(NcclRendezvous, SigkilledServerProcessIsLostAtOnce) {
  auto [peer, address] = StartPeer("nccl-peer-server", "--listen", "127.0.0.1:0", "listening on ");
  ASSERT_FALSE(address.empty());
  std::mutex mu;
  std::optional<absl::Status> lost;
  auto c = NcclRendezvousClient::Open(address, {Id('k'), "attn", 0}, absl::Seconds(5), [&](absl::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    lost = s;
  });
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->accepted().max_rows, 64);
  const auto t0 = std::chrono::steady_clock::now();
  peer->Signal(SIGKILL);
  ASSERT_TRUE(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return lost.has_value();
  }));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("SIGKILLed expert-side peer lost after %.1f ms\n", ms);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(lost->code(), absl::StatusCode::kUnavailable) << *lost;
  EXPECT_NE(lost->message().find("peer"), std::string::npos) << *lost;  // names the node
}

// The attention node's process is SIGKILLed: the expert node closes that session.
TEST(NcclRendezvous, SigkilledClientProcessClosesItsSession) {
  Recorder rec;
  auto server = NcclRendezvousServer::Start("127.0.0.1:0", rec.OnOpen(), rec.OnClosed());
  ASSERT_TRUE(server.ok()) << server.status();
  auto [peer, session] = StartPeer("nccl-peer-client", "--connect", (*server)->address(), "open ");
  ASSERT_EQ(session, "1");
  EXPECT_EQ(rec.n_closed(), 0u);
  peer->Signal(SIGKILL);
  ASSERT_TRUE(Eventually([&] { return rec.n_closed() == 1; }));
  std::lock_guard<std::mutex> lock(rec.mu);
  EXPECT_EQ(rec.closed[0].first, 1u);
  EXPECT_EQ(rec.opened[0].unique_id, std::string(kNcclUniqueIdBytes, 'p'));
}

}  // namespace
}  // namespace k3::dataplane
