// The transport tests, built twice: over UCX (ucx_transport_test) and over shared memory
// (shm_transport_test, K3SERVE_TEST_SHM).
#include "router/shm_transport.h"
#include "router/ucx_transport.h"
#include "router/wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

extern char** environ;

namespace k3::dataplane {
namespace {

using namespace std::chrono_literals;

#ifdef K3SERVE_TEST_SHM
#define K3_SUITE ShmTransport
constexpr const char* kEchoKind = "shm";
absl::StatusOr<std::unique_ptr<Transport>> MakeTransport() { return NewShmTransport(); }
#else
#define K3_SUITE UcxTransport
constexpr const char* kEchoKind = "ucx";
absl::StatusOr<std::unique_ptr<Transport>> MakeTransport() { return NewUcxTransport(); }
#endif

// Messages carry a u64 tag in their first bytes and a pattern derived from it after.
Buffer Patterned(uint64_t tag, size_t size) {
  Buffer b(size);
  for (size_t i = 0; i < size; ++i) b.data()[i] = static_cast<std::byte>((tag * 131 + i * 7) & 0xff);
  if (size >= 8) std::memcpy(b.data(), &tag, 8);
  return b;
}

uint64_t TagOf(const Buffer& b) {
  uint64_t tag = 0;
  std::memcpy(&tag, b.data(), 8);
  return tag;
}

bool MatchesPattern(const Buffer& b, uint64_t tag, size_t size) {
  if (b.size() != size) return false;
  const Buffer want = Patterned(tag, size);
  return std::memcmp(b.data(), want.data(), size) == 0;
}

// Waits (with a deadline) for a predicate over state guarded by mu.
class Waiter {
 public:
  template <class F>
  void Update(F f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      f();
    }
    cv_.notify_all();
  }
  template <class P>
  bool WaitFor(std::chrono::milliseconds timeout, P pred) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, pred);
  }
  std::mutex& mu() { return mu_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

// An echo server on its own transport, in this process.
class EchoServer {
 public:
  EchoServer() {
    auto t = MakeTransport();
    EXPECT_TRUE(t.ok()) << t.status();
    transport_ = std::move(*t);
    auto s = transport_->Listen("127.0.0.1:0",
                                {.on_message =
                                     [this](ConnectionId from, Buffer msg) {
                                       messages_.fetch_add(1);
                                       server_.load()->Send(from, std::move(msg), [](absl::Status) {});
                                     },
                                 .on_closed =
                                     [this](ConnectionId, absl::Status why) {
                                       closed_.Update([&] { close_reasons_.push_back(why); });
                                     }});
    EXPECT_TRUE(s.ok()) << s.status();
    server_holder_ = std::move(*s);
    server_ = server_holder_.get();
  }
  ~EchoServer() { server_holder_.reset(); }

  const std::string& address() const { return server_holder_->address(); }
  int messages() const { return messages_.load(); }
  bool WaitClosed(size_t n, std::chrono::milliseconds timeout) {
    return closed_.WaitFor(timeout, [&] { return close_reasons_.size() >= n; });
  }

 private:
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Server> server_holder_;
  std::atomic<Server*> server_{nullptr};
  std::atomic<int> messages_{0};
  Waiter closed_;
  std::vector<absl::Status> close_reasons_;
};

// A client connection that records replies by tag and the failure, if any.
class Client {
 public:
  Client(Transport& transport, const std::string& address) {
    auto c = transport.Connect(address, {.on_message =
                                             [this](Buffer msg) {
                                               const uint64_t tag = msg.size() >= 8 ? TagOf(msg) : 0;
                                               state_.Update([&] { replies_[tag] = std::move(msg); });
                                             },
                                         .on_failure =
                                             [this](absl::Status why) {
                                               state_.Update([&] {
                                                 ++failures_;
                                                 failure_ = why;
                                               });
                                             }});
    if (c.ok()) {
      connection_ = std::move(*c);
    } else {
      ADD_FAILURE() << "Connect(" << address << "): " << c.status();
    }
  }

  // Sends and records the completion status under `tag`.
  void Send(uint64_t tag, Buffer msg) {
    if (connection_ == nullptr) return;
    connection_->Send(std::move(msg), [this, tag](absl::Status s) {
      state_.Update([&] { sent_.emplace(tag, s); });
    });
  }
  bool WaitReplies(size_t n, std::chrono::milliseconds timeout = 20s) {
    return state_.WaitFor(timeout, [&] { return replies_.size() >= n; });
  }
  bool WaitSent(size_t n, std::chrono::milliseconds timeout = 20s) {
    return state_.WaitFor(timeout, [&] { return sent_.size() >= n; });
  }
  bool WaitFailure(std::chrono::milliseconds timeout) {
    return state_.WaitFor(timeout, [&] { return failures_ > 0; });
  }
  Buffer TakeReply(uint64_t tag) {
    std::lock_guard<std::mutex> lock(state_.mu());
    return std::move(replies_[tag]);
  }
  std::map<uint64_t, absl::Status> sent() {
    std::lock_guard<std::mutex> lock(state_.mu());
    return sent_;
  }
  size_t n_replies() {
    std::lock_guard<std::mutex> lock(state_.mu());
    return replies_.size();
  }
  int failures() {
    std::lock_guard<std::mutex> lock(state_.mu());
    return failures_;
  }
  absl::Status failure() {
    std::lock_guard<std::mutex> lock(state_.mu());
    return failure_;
  }
  void Close() { connection_.reset(); }

 private:
  Waiter state_;
  std::map<uint64_t, Buffer> replies_;
  std::map<uint64_t, absl::Status> sent_;
  int failures_ = 0;
  absl::Status failure_;
  std::unique_ptr<Connection> connection_;
};

std::unique_ptr<Transport> NewTransport() {
  auto t = MakeTransport();
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(K3_SUITE, RoundTrip) {
  EchoServer server;
  auto transport = NewTransport();
  Client client(*transport, server.address());
  client.Send(1, Patterned(1, 100));
  client.Send(2, Patterned(2, 8));
  ASSERT_TRUE(client.WaitReplies(2));
  EXPECT_TRUE(MatchesPattern(client.TakeReply(1), 1, 100));
  EXPECT_TRUE(MatchesPattern(client.TakeReply(2), 2, 8));
  ASSERT_TRUE(client.WaitSent(2));
  for (const auto& [tag, status] : client.sent()) EXPECT_TRUE(status.ok()) << tag << ": " << status;
  EXPECT_EQ(client.failures(), 0);
}

TEST(K3_SUITE, ServerAddressHasTheBoundPort) {
  EchoServer server;
  std::string address = server.address();
  if (address.starts_with(kShmScheme)) address = address.substr(sizeof(kShmScheme) - 1);
  EXPECT_TRUE(address.starts_with("127.0.0.1:")) << server.address();
  EXPECT_NE(address, "127.0.0.1:0");
}

TEST(K3_SUITE, ManyConcurrentMessagesFromSeveralThreads) {
  EchoServer server;
  auto transport = NewTransport();
  constexpr int kConnections = 2, kThreadsPerConnection = 2, kPerThread = 400;
  std::vector<std::unique_ptr<Client>> clients;
  for (int c = 0; c < kConnections; ++c)
    clients.push_back(std::make_unique<Client>(*transport, server.address()));
  std::vector<std::thread> threads;
  for (int c = 0; c < kConnections; ++c) {
    for (int t = 0; t < kThreadsPerConnection; ++t) {
      threads.emplace_back([&, c, t] {
        for (int i = 0; i < kPerThread; ++i) {
          const uint64_t tag = (uint64_t(t) << 32) | uint64_t(i);
          // Sizes from 8 B to 192 KiB: eager and rendezvous mixed.
          const size_t size = 8 + (tag * 2654435761u) % (i % 16 == 0 ? 192 * 1024 : 2048);
          clients[c]->Send(tag, Patterned(tag, size));
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  for (int c = 0; c < kConnections; ++c) {
    ASSERT_TRUE(clients[c]->WaitReplies(kThreadsPerConnection * kPerThread, 60s))
        << "connection " << c << " got " << clients[c]->n_replies();
    for (int t = 0; t < kThreadsPerConnection; ++t) {
      for (int i = 0; i < kPerThread; ++i) {
        const uint64_t tag = (uint64_t(t) << 32) | uint64_t(i);
        const size_t size = 8 + (tag * 2654435761u) % (i % 16 == 0 ? 192 * 1024 : 2048);
        ASSERT_TRUE(MatchesPattern(clients[c]->TakeReply(tag), tag, size)) << "tag " << tag;
      }
    }
    ASSERT_TRUE(clients[c]->WaitSent(kThreadsPerConnection * kPerThread));
    for (const auto& [tag, status] : clients[c]->sent()) ASSERT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(server.messages(), kConnections * kThreadsPerConnection * kPerThread);
}

TEST(K3_SUITE, SixtyFourMiBMessage) {
  EchoServer server;
  auto transport = NewTransport();
  Client client(*transport, server.address());
  constexpr size_t kSize = 64u << 20;
  client.Send(7, Patterned(7, kSize));
  ASSERT_TRUE(client.WaitReplies(1, 60s));
  EXPECT_TRUE(MatchesPattern(client.TakeReply(7), 7, kSize));
  ASSERT_TRUE(client.WaitSent(1));
  EXPECT_TRUE(client.sent().at(7).ok()) << client.sent().at(7);
}

TEST(K3_SUITE, EmptyMessage) {
  EchoServer server;
  auto transport = NewTransport();
  Client client(*transport, server.address());
  client.Send(0, Buffer());
  ASSERT_TRUE(client.WaitReplies(1));
  EXPECT_EQ(client.TakeReply(0).size(), 0u);
}

TEST(K3_SUITE, ServerLearnsOfClosedConnection) {
  EchoServer server;
  auto transport = NewTransport();
  Client client(*transport, server.address());
  client.Send(1, Patterned(1, 64));
  ASSERT_TRUE(client.WaitReplies(1));
  client.Close();
  EXPECT_TRUE(server.WaitClosed(1, 10s));
}

TEST(K3_SUITE, ConnectToNobodyFails) {
  // A port that was just free: bind, read the port, close.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);

  auto transport = NewTransport();
  Client client(*transport, absl::StrCat("127.0.0.1:", ntohs(a.sin_port)));
  client.Send(1, Patterned(1, 64));
  ASSERT_TRUE(client.WaitFailure(10s));
  EXPECT_TRUE(absl::IsUnavailable(client.failure())) << client.failure();
  ASSERT_TRUE(client.WaitSent(1));
  EXPECT_FALSE(client.sent().at(1).ok());
  client.Send(2, Patterned(2, 64));  // after the failure: fails at once
  ASSERT_TRUE(client.WaitSent(2, 1s));
  EXPECT_TRUE(absl::IsUnavailable(client.sent().at(2))) << client.sent().at(2);
}

TEST(K3_SUITE, BadAddresses) {
  auto transport = NewTransport();
  for (const char* address :
       {"no-port", "127.0.0.1:", "127.0.0.1:99999", ":1234", "no.such.host.invalid:1"}) {
    auto c = transport->Connect(address, {});
    EXPECT_TRUE(absl::IsInvalidArgument(c.status())) << address << ": " << c.status();
  }
  EXPECT_TRUE(absl::IsInvalidArgument(transport->Listen("127.0.0.1:x", {}).status()));
}

TEST(K3_SUITE, ServerSendToUnknownConnection) {
  Waiter w;  // outlives the transport, whose thread notifies it
  absl::Status got;
  bool done = false;
  auto transport = NewTransport();
  auto server = transport->Listen("127.0.0.1:0", {});
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->Send(12345, Buffer(8), [&](absl::Status s) { w.Update([&] { got = s, done = true; }); });
  ASSERT_TRUE(w.WaitFor(5s, [&] { return done; }));
  EXPECT_TRUE(absl::IsNotFound(got)) << got;
}

// ---- a peer in another process ----

std::string EchoBinary() {
  // Next to this test binary's build tree first (build/bin), else the path CMake baked in.
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  const auto sibling = self.parent_path().parent_path() / "bin" / "k3serve-dataplane-echo";
  if (std::filesystem::exists(sibling)) return sibling;
  return K3SERVE_DATAPLANE_ECHO;
}

class EchoProcess {
 public:
  EchoProcess() {
    int out[2];
    EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    const std::string binary = EchoBinary();
    char* argv[] = {const_cast<char*>(binary.c_str()), const_cast<char*>("127.0.0.1:0"),
                    const_cast<char*>(kEchoKind), nullptr};
    EXPECT_EQ(posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv, environ), 0) << binary;
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    // The address line; UCX may print its own lines on stdout too.
    FILE* in = ::fdopen(out[0], "r");
    char line[512];
    while (std::fgets(line, sizeof(line), in) != nullptr) {
      std::string_view text(line);
      constexpr std::string_view kPrefix = "listening on ";
      if (!text.starts_with(kPrefix)) continue;
      text.remove_prefix(kPrefix.size());
      while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.remove_suffix(1);
      address_ = std::string(text);
      break;
    }
    std::fclose(in);
  }
  ~EchoProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  const std::string& address() const { return address_; }
  void Signal(int sig) { ::kill(pid_, sig); }
  void Kill() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  std::string address_;
};

TEST(K3_SUITE, PeerProcessRoundTripThenSigkill) {
  EchoProcess echo;
  ASSERT_FALSE(echo.address().empty());
  auto transport = NewTransport();
  Client client(*transport, echo.address());
  client.Send(1, Patterned(1, 256));
  client.Send(2, Patterned(2, 8u << 20));  // rendezvous across processes
  ASSERT_TRUE(client.WaitReplies(2, 30s));
  EXPECT_TRUE(MatchesPattern(client.TakeReply(1), 1, 256));
  EXPECT_TRUE(MatchesPattern(client.TakeReply(2), 2, 8u << 20));

  // Freeze the peer so that sends stay in flight, then kill it.
  echo.Signal(SIGSTOP);
  client.Send(3, Patterned(3, 16u << 20));
  client.Send(4, Patterned(4, 64));
  std::this_thread::sleep_for(100ms);
  const auto killed = std::chrono::steady_clock::now();
  echo.Kill();
  ASSERT_TRUE(client.WaitFailure(10s)) << "no peer-failure callback";
  const double detect_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("peer failure detected %.3f s after SIGKILL: %s\n", detect_s,
              client.failure().ToString().c_str());
  EXPECT_LT(detect_s, 5.0);
  EXPECT_TRUE(absl::IsUnavailable(client.failure())) << client.failure();
  ASSERT_TRUE(client.WaitSent(4, 5s)) << "in-flight sends did not complete";
  EXPECT_FALSE(client.sent().at(3).ok()) << "the 16 MiB send to a frozen peer cannot have completed";
  client.Send(5, Patterned(5, 64));
  ASSERT_TRUE(client.WaitSent(5, 1s));
  EXPECT_TRUE(absl::IsUnavailable(client.sent().at(5))) << client.sent().at(5);
}

TEST(K3_SUITE, ClosingWithSendsInFlightCompletesThem) {
  EchoProcess echo;
  ASSERT_FALSE(echo.address().empty());
  auto transport = NewTransport();
  Client client(*transport, echo.address());
  client.Send(1, Patterned(1, 64));
  ASSERT_TRUE(client.WaitReplies(1, 30s));
  echo.Signal(SIGSTOP);
  client.Send(2, Patterned(2, 16u << 20));
  std::this_thread::sleep_for(100ms);
  const auto start = std::chrono::steady_clock::now();
  client.Close();  // must not hang on the frozen peer
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  ASSERT_EQ(client.sent().size(), 2u);
  EXPECT_TRUE(absl::IsCancelled(client.sent().at(2))) << client.sent().at(2);
}

TEST(K3_SUITE, IdleProgressThreadSleeps) {
  EchoServer server;
  auto transport = NewTransport();
  Client client(*transport, server.address());
  client.Send(1, Patterned(1, 64));
  ASSERT_TRUE(client.WaitReplies(1));
  std::this_thread::sleep_for(100ms);
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(1s);
  ::getrusage(RUSAGE_SELF, &after);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  const double cpu = seconds(after.ru_utime) - seconds(before.ru_utime) + seconds(after.ru_stime) -
                     seconds(before.ru_stime);
  std::printf("idle CPU with two connected transports: %.2f%% of one core\n", cpu * 100);
  EXPECT_LT(cpu, 0.05);
}

#ifdef K3SERVE_TEST_SHM
// A peer that is not a shared-memory client (garbage, or a hello naming a mapping that does not
// exist) is refused; the server keeps serving.
TEST(ShmTransport, BadHelloIsRefused) {
  EchoServer server;
  const std::string address = server.address().substr(sizeof(kShmScheme) - 1);
  const uint16_t port = static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  auto send_raw = [&](std::span<const std::byte> bytes) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
    char b;
    EXPECT_EQ(::recv(fd, &b, 1, 0), 0) << "the server should close the connection without an ack";
    ::close(fd);
  };
  const std::vector<std::byte> garbage(64, std::byte{0x5a});
  send_raw(garbage);
  auto hello = wire::EncodeShmHello({.ring_bytes = 1 << 20, .name = "/k3serve-dp-no-such-mapping"});
  ASSERT_TRUE(hello.ok());
  send_raw(*hello);

  auto transport = NewTransport();
  Client client(*transport, server.address());
  client.Send(1, Patterned(1, 100));
  ASSERT_TRUE(client.WaitReplies(1));
  EXPECT_TRUE(MatchesPattern(client.TakeReply(1), 1, 100));
}

// A shared-memory client pointed at a server that does not speak it (here UCX) is told so.
TEST(ShmTransport, ConnectToUcxServerFails) {
  auto ucx = NewUcxTransport();
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  auto server = (*ucx)->Listen("127.0.0.1:0", {});
  ASSERT_TRUE(server.ok()) << server.status();
  ShmOptions options;
  options.connect_timeout = 500ms;  // UCX accepts the TCP connection and never acks the hello
  auto transport = NewShmTransport(options);
  ASSERT_TRUE(transport.ok()) << transport.status();
  Client client(**transport, (*server)->address());
  client.Send(1, Patterned(1, 64));
  ASSERT_TRUE(client.WaitFailure(10s));
  EXPECT_TRUE(absl::IsUnavailable(client.failure())) << client.failure();
}

// Between BeginPoll and EndPoll the replies are the polling thread's: Poll delivers them there, and
// EndPoll what is left; afterwards the progress thread delivers them again.
TEST(ShmTransport, PollingTakesRepliesOnTheCallingThread) {
  EchoServer server;
  auto transport = NewTransport();
  std::mutex mu;
  std::vector<std::pair<uint64_t, std::thread::id>> got;  // tag, delivering thread
  auto conn = transport->Connect(server.address(), {.on_message = [&](Buffer msg) {
                                                      std::lock_guard<std::mutex> lock(mu);
                                                      got.emplace_back(TagOf(msg), std::this_thread::get_id());
                                                    }});
  ASSERT_TRUE(conn.ok()) << conn.status();
  Connection& c = **conn;
  ASSERT_TRUE(c.can_poll());
  auto count = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return got.size();
  };
  // The first reply on the progress thread: the connection is open.
  c.Send(Patterned(0, 64), [](absl::Status) {});
  for (auto end = std::chrono::steady_clock::now() + 10s; count() < 1 && std::chrono::steady_clock::now() < end;)
    std::this_thread::sleep_for(1ms);
  ASSERT_EQ(count(), 1u);
  const std::thread::id self = std::this_thread::get_id();
  c.BeginPoll();
  for (uint64_t tag = 1; tag <= 50; ++tag) {
    c.Send(Patterned(tag, 64 + tag), [](absl::Status) {});
    bool delivered = false;
    for (auto end = std::chrono::steady_clock::now() + 10s; !delivered && std::chrono::steady_clock::now() < end;)
      delivered = c.Poll();
    ASSERT_TRUE(delivered) << "reply " << tag;
  }
  c.Send(Patterned(51, 64), [](absl::Status) {});
  std::this_thread::sleep_for(50ms);  // lands while polled, and is not taken by the progress thread
  EXPECT_EQ(count(), 51u);
  c.EndPoll();  // delivers it here
  ASSERT_EQ(count(), 52u);
  c.Send(Patterned(52, 64), [](absl::Status) {});
  for (auto end = std::chrono::steady_clock::now() + 10s; count() < 53 && std::chrono::steady_clock::now() < end;)
    std::this_thread::sleep_for(1ms);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(got.size(), 53u);
  for (uint64_t tag = 0; tag < got.size(); ++tag) {
    EXPECT_EQ(got[tag].first, tag);
    EXPECT_EQ(got[tag].second == self, tag >= 1 && tag <= 51) << "reply " << tag;
  }
}

// The scheme transport hands "shm://" addresses to the shared-memory transport, others to UCX.
TEST(ShmTransport, SchemeTransportPicksByAddress) {
  auto shm = NewShmTransport();
  auto ucx = NewUcxTransport();
  ASSERT_TRUE(shm.ok() && ucx.ok());
  auto both = NewSchemeTransport(std::move(*shm), std::move(*ucx));
  EchoServer shm_server;
  Client shm_client(*both, shm_server.address());
  shm_client.Send(1, Patterned(1, 100));
  ASSERT_TRUE(shm_client.WaitReplies(1));
  EXPECT_TRUE(MatchesPattern(shm_client.TakeReply(1), 1, 100));
  auto listening = both->Listen("127.0.0.1:0", {});
  ASSERT_TRUE(listening.ok()) << listening.status();
  EXPECT_FALSE((*listening)->address().starts_with(kShmScheme)) << (*listening)->address();
}
#endif

}  // namespace
}  // namespace k3::dataplane
