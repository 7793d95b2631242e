#include "router/shm_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "router/socket_address.h"
#include "router/wire.h"

namespace k3::dataplane {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kContended = std::chrono::microseconds(50);

// ---- the shared mapping ----

struct alignas(64) Word {
  std::atomic<uint64_t> v;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the rings need address-free atomics");

struct alignas(64) Bell {
  std::atomic<uint32_t> seq;  // a futex word: bumped and woken to wake the ring's consumer
};

// One direction. The producer owns head and producer_waiting, the consumer tail and
// consumer_sleeping; each side reads the other's words. The consumer's progress thread sleeps on
// the bells of its incoming rings.
struct RingCtl {
  Word head;               // bytes written since the start
  Word tail;               // bytes consumed since the start
  Word consumer_sleeping;  // 1: the consumer sleeps; ring its bell after writing
  Word producer_waiting;   // 1: the producer waits for room; ring the other ring's bell after reading
  Bell bell;
};

constexpr uint32_t kSegmentMagic = 0x4D53334B;  // "K3SM"
struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t ring_bytes;
  alignas(64) RingCtl ring[2];  // [0] client to server, [1] server to client
};
static_assert(sizeof(SegmentHeader) % 64 == 0);

size_t SegmentBytes(uint64_t ring_bytes) { return sizeof(SegmentHeader) + 2 * ring_bytes; }

struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (addr != nullptr) ::munmap(addr, size);
  }
  SegmentHeader* header() const { return static_cast<SegmentHeader*>(addr); }
  std::byte* ring_data(int i) const {
    return static_cast<std::byte*>(addr) + sizeof(SegmentHeader) + i * header()->ring_bytes;
  }
};

// One ring as this process sees it.
struct Ring {
  RingCtl* ctl = nullptr;
  std::byte* data = nullptr;
  uint64_t capacity = 0;
};

// ---- sockets ----

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

std::string Errno(absl::string_view what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

std::string StripScheme(const std::string& address) {
  return address.starts_with(kShmScheme) ? address.substr(sizeof(kShmScheme) - 1) : address;
}

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "k3serve shm transport: %s\n", what);
  std::abort();
}

// Wakes the progress thread that consumes `ring`. A futex, not a byte on the socket: a socket
// wake-up is a "sync" one, which puts the woken thread on the waker's CPU, behind a waker that
// goes on computing (the engine after it sent its rows).
void RingBell(RingCtl* ring) {
  ring->bell.seq.fetch_add(1, std::memory_order_seq_cst);
  ::syscall(SYS_futex, &ring->bell.seq, FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// Sleeps until one of the words changes from its value, a wake, or `timeout`.
void WaitAny(std::vector<futex_waitv>& words, std::chrono::microseconds timeout) {
  timespec deadline{};
  ::clock_gettime(CLOCK_MONOTONIC, &deadline);
  const long ns = deadline.tv_nsec + static_cast<long>(timeout.count()) * 1000;
  deadline.tv_sec += ns / 1'000'000'000;
  deadline.tv_nsec = ns % 1'000'000'000;
  if (::syscall(SYS_futex_waitv, words.data(), words.size(), 0, &deadline, CLOCK_MONOTONIC) < 0 && errno == ENOSYS)
    std::this_thread::sleep_for(std::chrono::microseconds(500));  // kernels before 5.16: poll every 0.5 ms
}

// ---- connections ----

enum class State { kConnecting, kAwaitAck, kAwaitHello, kOpen, kDead };

struct OutMsg {
  Buffer msg;
  SendDone done;
  uint64_t written = 0;  // bytes of its frame in the ring
};

struct Listener;

struct Conn {
  uint64_t serial = 0;  // the ConnectionId on the server side
  std::string peer;     // for messages
  ClientCallbacks client;        // client side
  Listener* listener = nullptr;  // server side; progress thread only
  uint64_t listener_serial = 0;  // server side

  // Progress-thread state.
  State state = State::kConnecting;
  Fd sock;
  Clock::time_point deadline;  // for kConnecting, kAwaitAck, kAwaitHello
  std::string shm_name;        // client side until the server has mapped it
  std::vector<std::byte> hello;
  std::unique_ptr<Mapping> map;
  Ring in;

  // The incoming ring's reader: the progress thread, or a client's thread in Connection::Poll.
  std::mutex in_mu;
  bool readable = false;  // open and mapped
  absl::Status in_error;  // the ring was malformed (found by Poll; the progress thread ends it)
  // Threads between BeginPoll and EndPoll: the progress thread leaves the ring to them (it would
  // otherwise be woken by the same bell and, given the poller's yielded CPU, take the message first).
  std::atomic<int> pollers{0};
  uint64_t in_tail = 0;
  std::optional<wire::RingReader> reader;
  Buffer rx;

  // Shared with sending threads.
  std::mutex out_mu;
  bool writable = false;  // open: senders may write the ring
  bool dead = false;      // failed or closed: sends fail at once
  absl::Status dead_status;
  Ring out;
  uint64_t out_head = 0;
  std::deque<OutMsg> out_q;
  std::vector<SendDone> completed;  // sends whose frame is in the ring; run on the progress thread

  // Under out_mu. Moves queued messages into the ring while it has room; true if a byte moved.
  bool WriteQueued();
};

bool Conn::WriteQueued() {
  if (!writable) return false;
  const uint64_t cap = out.capacity, mask = cap - 1;
  bool moved = false;
  while (!out_q.empty()) {
    OutMsg& m = out_q.front();
    const uint32_t len = static_cast<uint32_t>(m.msg.size());
    const uint64_t total = wire::RingFrameBytes(len);
    const uint64_t tail = out.ctl->tail.v.load(std::memory_order_acquire);
    // A tail the peer moved beyond what was written leaves no room: the ring is stuck, not unsafe.
    const uint64_t used = out_head - tail;
    uint64_t room = tail <= out_head && used <= cap ? cap - used : 0;
    if (m.written == 0) {
      if (room < wire::kRingFrameHeader) break;
      std::byte* at = out.data + (out_head & mask);
      std::memcpy(at, &wire::kRingFrameMagic, 4);
      std::memcpy(at + 4, &len, 4);
      out_head += wire::kRingFrameHeader;
      room -= wire::kRingFrameHeader;
      m.written = wire::kRingFrameHeader;
      moved = true;
    }
    while (m.written < wire::kRingFrameHeader + len && room > 0) {
      const uint64_t off = m.written - wire::kRingFrameHeader;
      const uint64_t at = out_head & mask;
      const uint64_t n = std::min({len - off, room, cap - at});
      std::memcpy(out.data + at, m.msg.data() + off, n);
      out_head += n;
      room -= n;
      m.written += n;
      moved = true;
    }
    if (m.written < wire::kRingFrameHeader + len) break;
    const uint64_t pad = total - m.written;
    if (room < pad) break;
    out_head += pad;  // padding is skipped, never read
    moved = true;
    completed.push_back(std::move(m.done));
    out_q.pop_front();
  }
  if (moved) {
    out.ctl->head.v.store(out_head, std::memory_order_seq_cst);
    if (out.ctl->consumer_sleeping.v.load(std::memory_order_seq_cst) != 0) RingBell(out.ctl);
  }
  return moved;
}

struct Listener {
  uint64_t serial = 0;
  Fd sock;
  std::string address;
  ServerCallbacks callbacks;
};

class ShmTransport final : public Transport {
 public:
  static absl::StatusOr<std::unique_ptr<ShmTransport>> Create(const ShmOptions& options);
  ~ShmTransport() override;

  absl::StatusOr<std::unique_ptr<Connection>> Connect(const std::string& address, ClientCallbacks callbacks) override;
  absl::StatusOr<std::unique_ptr<Server>> Listen(const std::string& address, ServerCallbacks callbacks) override;

  void Send(const std::shared_ptr<Conn>& c, Buffer msg, SendDone done);
  bool Poll(const std::shared_ptr<Conn>& c);
  void EndPoll(const std::shared_ptr<Conn>& c);
  void ServerSend(uint64_t listener, ConnectionId to, Buffer msg, SendDone done);
  void CloseClient(const std::shared_ptr<Conn>& c);
  void CloseServer(uint64_t listener);

 private:
  explicit ShmTransport(const ShmOptions& options) : options_(options) {}

  void Post(absl::AnyInvocable<void()> command, bool wake = true);
  template <class F>
  auto RunSync(F f) -> decltype(f());
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  void Loop();
  bool RunCommands();
  bool Progress();
  void Sleep();
  bool PollSockets();
  void OnSocket(const std::shared_ptr<Conn>& c, short revents);
  void Accept(Listener& l);
  void Opened(Conn& c);
  bool ReadIn(const std::shared_ptr<Conn>& conn);
  // Under c.in_mu, c.readable: delivers the complete messages in the ring; true if it moved.
  bool ReadRing(Conn& c);
  // ReadRing on a polling thread: in_mu taken if free (or waited for), a malformed ring left to the
  // progress thread to end.
  bool ReadPolled(Conn& c, bool wait);
  void ServerHello(const std::shared_ptr<Conn>& c);
  // Ends a connection: the ring's complete messages are delivered first, queued sends complete with
  // `why`, and the owner hears of it unless it closed the connection itself.
  void End(const std::shared_ptr<Conn>& c, const absl::Status& why, bool tell_owner);

  const ShmOptions options_;
  std::atomic<uint32_t> wake_seq_{0};  // a futex word: Post wakes the sleeping progress thread
  std::thread thread_;

  std::mutex mu_;
  std::vector<absl::AnyInvocable<void()>> commands_;  // guarded by mu_
  std::vector<absl::AnyInvocable<void()>> running_;   // progress thread: the commands being run
  bool sleeping_ = false;                            // guarded by mu_

  // The server side's open connections, for Server::Send from any thread.
  std::mutex server_conns_mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Conn>> server_conns_;

  // Progress-thread state.
  bool alive_ = true;
  std::atomic<uint64_t> next_serial_{1};
  absl::flat_hash_map<uint64_t, std::shared_ptr<Conn>> conns_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Listener>> listeners_;
  Clock::time_point last_poll_;
  std::vector<futex_waitv> sleep_words_;     // Sleep's scratch
  std::vector<std::shared_ptr<Conn>> open_;  // Progress's scratch, kept for its capacity
  std::vector<SendDone> completed_;
};

class ShmConnection final : public Connection {
 public:
  ShmConnection(ShmTransport* t, std::shared_ptr<Conn> c, std::string address)
      : transport_(t), conn_(std::move(c)), address_(std::move(address)) {}
  ~ShmConnection() override { transport_->CloseClient(conn_); }
  void Send(Buffer msg, SendDone done) override { transport_->Send(conn_, std::move(msg), std::move(done)); }
  bool can_poll() const override { return true; }
  void BeginPoll() override { conn_->pollers.fetch_add(1, std::memory_order_seq_cst); }
  bool Poll() override { return transport_->Poll(conn_); }
  void EndPoll() override { transport_->EndPoll(conn_); }
  const std::string& address() const override { return address_; }

 private:
  ShmTransport* transport_;
  std::shared_ptr<Conn> conn_;
  std::string address_;
};

class ShmServer final : public Server {
 public:
  ShmServer(ShmTransport* t, uint64_t serial, std::string address)
      : transport_(t), serial_(serial), address_(std::move(address)) {}
  ~ShmServer() override { transport_->CloseServer(serial_); }
  void Send(ConnectionId to, Buffer msg, SendDone done) override {
    transport_->ServerSend(serial_, to, std::move(msg), std::move(done));
  }
  const std::string& address() const override { return address_; }

 private:
  ShmTransport* transport_;
  uint64_t serial_;
  std::string address_;
};

// ---- setup and teardown ----

absl::StatusOr<std::unique_ptr<ShmTransport>> ShmTransport::Create(const ShmOptions& options) {
  if (options.ring_bytes < wire::kShmMinRing || options.ring_bytes > wire::kShmMaxRing ||
      !std::has_single_bit(options.ring_bytes))
    return absl::InvalidArgumentError(absl::StrCat("ShmOptions.ring_bytes = ", options.ring_bytes,
                                                   " is not a power of two in [4 KiB, 1 GiB]"));
  ShmOptions o = options;
  if (o.spin.count() < 0) {
    cpu_set_t cpus;
    const int n = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    o.spin = std::chrono::microseconds(n > 4 ? 200 : 0);
  }
  std::unique_ptr<ShmTransport> t(new ShmTransport(o));
  t->thread_ = std::thread([raw = t.get()] { raw->Loop(); });
  return t;
}

ShmTransport::~ShmTransport() {
  if (thread_.joinable()) {
    if (OnProgressThread()) Die("the transport was destroyed from one of its callbacks");
    Post([this] { alive_ = false; });
    thread_.join();
  }
  // Connections and servers are gone by contract; close whatever a caller left behind.
  for (auto& [serial, c] : conns_) End(c, absl::CancelledError("transport destroyed"), false);
}

void ShmTransport::Post(absl::AnyInvocable<void()> command, bool wake) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(command));
    wake = wake && sleeping_;
  }
  if (wake) {
    const uint64_t one = 1;
    wake_seq_.fetch_add(one, std::memory_order_seq_cst);
    ::syscall(SYS_futex, &wake_seq_, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }
}

template <class F>
auto ShmTransport::RunSync(F f) -> decltype(f()) {
  using R = decltype(f());
  std::promise<R> done;
  std::future<R> result = done.get_future();
  Post([&f, &done] {
    if constexpr (std::is_void_v<R>) {
      f();
      done.set_value();
    } else {
      done.set_value(f());
    }
  });
  return result.get();
}

absl::StatusOr<std::unique_ptr<Connection>> ShmTransport::Connect(const std::string& address,
                                                                   ClientCallbacks callbacks) {
  if (OnProgressThread()) return absl::FailedPreconditionError("Connect called from a transport callback");
  K3_ASSIGN_OR_RETURN(sockaddr_storage addr, ResolveAddress(StripScheme(address), false));
  auto c = std::make_shared<Conn>();
  c->serial = next_serial_++;
  c->peer = address;
  c->client = std::move(callbacks);

  // The mapping: created here, named in the hello, unlinked once the server has it.
  const uint64_t ring = options_.ring_bytes;
  c->shm_name = absl::StrCat("/k3serve-dp-", ::getpid(), "-", c->serial, "-", std::random_device{}());
  Fd shm(::shm_open(c->shm_name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (shm.get() < 0) return absl::ResourceExhaustedError(Errno(absl::StrCat("shm_open ", c->shm_name)));
  auto map = std::make_unique<Mapping>();
  map->size = SegmentBytes(ring);
  if (::ftruncate(shm.get(), static_cast<off_t>(map->size)) != 0) {
    ::shm_unlink(c->shm_name.c_str());
    return absl::ResourceExhaustedError(Errno("ftruncate of the shared mapping"));
  }
  void* addr_p = ::mmap(nullptr, map->size, PROT_READ | PROT_WRITE, MAP_SHARED, shm.get(), 0);
  if (addr_p == MAP_FAILED) {
    ::shm_unlink(c->shm_name.c_str());
    return absl::ResourceExhaustedError(Errno("mmap of the shared mapping"));
  }
  map->addr = addr_p;
  SegmentHeader* h = map->header();  // zero-filled by ftruncate: cursors and flags start at 0
  h->magic = kSegmentMagic;
  h->version = wire::kVersion;
  h->ring_bytes = ring;
  c->out = {&h->ring[0], map->ring_data(0), ring};
  c->in = {&h->ring[1], map->ring_data(1), ring};
  c->reader.emplace(ring, options_.max_message);
  c->map = std::move(map);

  c->sock.reset(::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (c->sock.get() < 0) {
    ::shm_unlink(c->shm_name.c_str());
    return absl::ResourceExhaustedError(Errno("socket"));
  }
  const int one = 1;
  ::setsockopt(c->sock.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  c->deadline = Clock::now() + options_.connect_timeout;
  if (::connect(c->sock.get(), reinterpret_cast<const sockaddr*>(&addr), AddressLength(addr)) != 0 &&
      errno != EINPROGRESS) {
    // Reported through on_failure, like an unreachable server found later.
    c->dead_status = absl::UnavailableError(Errno(absl::StrCat("connect to ", address)));
  }
  RunSync([&] {
    conns_[c->serial] = c;
    if (!c->dead_status.ok()) End(c, c->dead_status, true);
  });
  return std::unique_ptr<Connection>(new ShmConnection(this, c, address));
}

absl::StatusOr<std::unique_ptr<Server>> ShmTransport::Listen(const std::string& address, ServerCallbacks callbacks) {
  if (OnProgressThread()) return absl::FailedPreconditionError("Listen called from a transport callback");
  K3_ASSIGN_OR_RETURN(sockaddr_storage addr, ResolveAddress(StripScheme(address), true));
  auto l = std::make_unique<Listener>();
  l->sock.reset(::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (l->sock.get() < 0) return absl::ResourceExhaustedError(Errno("socket"));
  const int one = 1;
  ::setsockopt(l->sock.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(l->sock.get(), reinterpret_cast<const sockaddr*>(&addr), AddressLength(addr)) != 0)
    return absl::UnavailableError(Errno(absl::StrCat("bind ", address)));
  if (::listen(l->sock.get(), 128) != 0) return absl::UnavailableError(Errno("listen"));
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(l->sock.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  l->address = absl::StrCat(kShmScheme, FormatAddress(bound));
  l->callbacks = std::move(callbacks);
  l->serial = next_serial_++;
  const uint64_t serial = l->serial;
  std::string bound_address = l->address;
  RunSync([&] { listeners_[serial] = std::move(l); });
  return std::unique_ptr<Server>(new ShmServer(this, serial, std::move(bound_address)));
}

void ShmTransport::CloseClient(const std::shared_ptr<Conn>& c) {
  if (OnProgressThread()) Die("a connection was destroyed from one of its transport's callbacks");
  RunSync([&] {
    End(c, absl::CancelledError("connection closed"), false);
    conns_.erase(c->serial);
  });
}

void ShmTransport::CloseServer(uint64_t listener) {
  if (OnProgressThread()) Die("a server was destroyed from one of its transport's callbacks");
  RunSync([&] {
    auto it = listeners_.find(listener);
    if (it == listeners_.end()) return;
    std::vector<std::shared_ptr<Conn>> open;
    for (auto& [serial, c] : conns_)
      if (c->listener == it->second.get()) open.push_back(c);
    for (auto& c : open) {
      End(c, absl::CancelledError("server closed"), false);
      conns_.erase(c->serial);
    }
    listeners_.erase(it);
  });
}

// ---- sending (any thread) ----

void ShmTransport::Send(const std::shared_ptr<Conn>& c, Buffer msg, SendDone done) {
  if (msg.size() > options_.max_message) {
    Post([done = std::move(done), n = msg.size(), max = options_.max_message]() mutable {
      done(absl::InvalidArgumentError(absl::StrCat("message of ", n, " bytes above the limit of ", max)));
    });
    return;
  }
  bool queued;
  {
    std::lock_guard<std::mutex> lock(c->out_mu);
    if (c->dead) {
      absl::Status why = absl::UnavailableError(absl::StrCat("connection to ", c->peer, " is down: ",
                                                             c->dead_status.message()));
      Post([done = std::move(done), why]() mutable { done(why); });
      return;
    }
    c->out_q.push_back({std::move(msg), std::move(done)});
    if (c->out_q.size() == 1) c->WriteQueued();
    queued = !c->out_q.empty();
  }
  // What did not fit (or a connection still opening) is the progress thread's; a completion alone
  // waits for its next round (within 100 ms when it sleeps).
  if (queued) Post([] {});
}

void ShmTransport::ServerSend(uint64_t listener, ConnectionId to, Buffer msg, SendDone done) {
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> lock(server_conns_mu_);
    auto it = server_conns_.find(to);
    if (it != server_conns_.end()) c = it->second;
  }
  if (!c || c->listener_serial != listener) {
    Post([done = std::move(done), to]() mutable {
      done(absl::NotFoundError(absl::StrCat("no open connection ", to)));
    });
    return;
  }
  Send(c, std::move(msg), std::move(done));
}

// ---- the progress thread ----

void ShmTransport::Loop() {
  pthread_setname_np(pthread_self(), "k3-shm-progress");
  auto last_work = Clock::now();
  last_poll_ = last_work;
  while (alive_) {
    bool worked = RunCommands();
    worked |= Progress();
    const auto now = Clock::now();
    // Sockets (new connections, a peer's EOF) are looked at every millisecond while busy.
    if (now - last_poll_ >= std::chrono::milliseconds(1)) worked |= PollSockets();
    if (worked) {
      last_work = now;
    } else if (now - last_work >= options_.spin) {
      Sleep();  // the spin starts again only if waking finds work
    } else {
      sched_yield();  // as in the UCX transport: let a runnable thread on this CPU go first
      // A yield that took long means the CPUs are oversubscribed: a thread that polls there waits
      // behind the others when its message comes, one that sleeps is woken ahead of them.
      if (Clock::now() - now > kContended) {
        last_work = now - options_.spin;
        Sleep();
      }
    }
  }
}

bool ShmTransport::RunCommands() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_.swap(commands_);  // both keep their capacity: no allocation per round
  }
  for (auto& command : running_) command();
  const bool any = !running_.empty();
  running_.clear();
  return any;
}

bool ShmTransport::Progress() {
  bool worked = false;
  std::vector<SendDone>& completed = completed_;
  // A callback may end a connection (a malformed ring), so walk a snapshot.
  std::vector<std::shared_ptr<Conn>>& open = open_;
  open.clear();
  for (auto& [serial, c] : conns_)
    if (c->state == State::kOpen) open.push_back(c);
  for (auto& c : open) {
    worked |= ReadIn(c);
    if (c->state != State::kOpen) continue;
    {
      std::lock_guard<std::mutex> lock(c->out_mu);
      if (!c->out_q.empty()) worked |= c->WriteQueued();
      completed.swap(c->completed);
    }
    for (auto& done : completed)
      if (done) done(absl::OkStatus());
    completed.clear();
  }
  return worked;
}

bool ShmTransport::ReadIn(const std::shared_ptr<Conn>& conn) {
  Conn& c = *conn;
  absl::Status bad;
  bool worked = false;
  {
    std::unique_lock<std::mutex> lock(c.in_mu, std::try_to_lock);
    if (!lock.owns_lock()) return false;  // a Poll is reading it
    if (c.in_error.ok()) {
      if (c.pollers.load(std::memory_order_seq_cst) > 0) return false;  // left to the pollers
      worked = ReadRing(c);
    }
    bad = c.in_error;  // also one a Poll found: ended here, pollers or not
  }
  if (!bad.ok()) {
    End(conn, bad, true);
    if (c.listener != nullptr) conns_.erase(c.serial);
    return true;
  }
  return worked;
}

bool ShmTransport::ReadRing(Conn& c) {
  const uint64_t head = c.in.ctl->head.v.load(std::memory_order_acquire);
  if (head == c.in_tail) return false;
  auto tail = c.reader->Read(
      std::span<const std::byte>(c.in.data, c.in.capacity), c.in_tail, head,
      [&](uint32_t length) {
        c.rx = Buffer(length);
        return c.rx.data();
      },
      [&] {
        Buffer msg = std::move(c.rx);
        if (c.listener != nullptr) {
          if (c.listener->callbacks.on_message) c.listener->callbacks.on_message(c.serial, std::move(msg));
        } else if (c.client.on_message) {
          c.client.on_message(std::move(msg));
        }
      });
  if (!tail.ok()) {
    c.in_error = absl::UnavailableError(absl::StrCat("malformed ring from ", c.peer, ": ", tail.status().message()));
    c.readable = false;
    return true;
  }
  c.in_tail = *tail;
  c.in.ctl->tail.v.store(c.in_tail, std::memory_order_seq_cst);
  if (c.in.ctl->producer_waiting.v.load(std::memory_order_seq_cst) != 0) RingBell(c.out.ctl);
  return true;
}

bool ShmTransport::Poll(const std::shared_ptr<Conn>& c) { return !OnProgressThread() && ReadPolled(*c, false); }

void ShmTransport::EndPoll(const std::shared_ptr<Conn>& c) {
  if (c->pollers.fetch_sub(1, std::memory_order_seq_cst) > 1) return;
  // The last poller leaves. A message that landed before the count dropped may have found the
  // progress thread asleep and leaving it to us: read once more, after any Poll of another thread.
  // One that lands after rings the bell of a progress thread that now reads it (it announced its
  // sleep before looking at the count).
  ReadPolled(*c, true);
}

bool ShmTransport::ReadPolled(Conn& c, bool wait) {
  bool worked = false, bad = false;
  {
    std::unique_lock<std::mutex> lock(c.in_mu, std::defer_lock);
    if (wait) {
      lock.lock();
    } else if (!lock.try_lock()) {
      return false;
    }
    if (!c.readable) return false;
    worked = ReadRing(c);
    bad = !c.in_error.ok();
  }
  if (bad) Post([] {});  // the progress thread ends the connection
  return worked;
}

void ShmTransport::Sleep() {
  std::vector<futex_waitv>& words = sleep_words_;
  words.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!commands_.empty()) return;
    sleeping_ = true;
    words.push_back({wake_seq_.load(std::memory_order_seq_cst), reinterpret_cast<uintptr_t>(&wake_seq_),
                     FUTEX_32 | FUTEX_PRIVATE_FLAG, 0});
  }
  // Each bell's value first, then the sleep announced in every ring, then one more look: a peer
  // that wrote before seeing the flag is caught here, one that writes after rings the bell, which
  // no longer holds the value read.
  bool ready = false, handshaking = false;
  for (auto& [serial, c] : conns_) {
    if (c->state != State::kOpen) {
      handshaking |= c->state != State::kDead;
      continue;
    }
    if (words.size() < FUTEX_WAITV_MAX)
      words.push_back({c->in.ctl->bell.seq.load(std::memory_order_seq_cst), reinterpret_cast<uintptr_t>(&c->in.ctl->bell.seq),
                       FUTEX_32, 0});
    c->in.ctl->consumer_sleeping.v.store(1, std::memory_order_seq_cst);
    std::lock_guard<std::mutex> lock(c->out_mu);
    if (!c->out_q.empty()) c->out.ctl->producer_waiting.v.store(1, std::memory_order_seq_cst);
  }
  for (auto& [serial, c] : conns_) {
    if (c->state != State::kOpen) continue;
    // The published tail, not in_tail: a Poll on another thread may be reading the ring. A ring
    // with pollers is theirs.
    if (c->pollers.load(std::memory_order_seq_cst) == 0 &&
        c->in.ctl->head.v.load(std::memory_order_seq_cst) != c->in.ctl->tail.v.load(std::memory_order_seq_cst))
      ready = true;
    std::lock_guard<std::mutex> lock(c->out_mu);
    if (!c->out_q.empty() || !c->completed.empty()) {
      const uint64_t tail = c->out.ctl->tail.v.load(std::memory_order_seq_cst);
      if (!c->completed.empty() || c->out_head - tail < c->out.capacity) ready = true;
    }
  }
  // The sockets (new connections, handshakes, a peer's EOF) are looked at on waking: every 10 ms
  // when idle, every millisecond while a handshake is under way. More connections than one wait
  // can hold are looked at every millisecond too.
  const bool all_bells = words.size() < FUTEX_WAITV_MAX;
  if (!ready)
    WaitAny(words, handshaking || !all_bells ? std::chrono::microseconds(1000) : std::chrono::microseconds(10000));
  for (auto& [serial, c] : conns_) {
    if (c->state != State::kOpen) continue;
    c->in.ctl->consumer_sleeping.v.store(0, std::memory_order_relaxed);
    c->out.ctl->producer_waiting.v.store(0, std::memory_order_relaxed);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sleeping_ = false;
  }
  PollSockets();
}

bool ShmTransport::PollSockets() {
  last_poll_ = Clock::now();
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Conn>> conns;
  std::vector<Listener*> listeners;
  fds.push_back({-1, 0, 0});  // unused slot: keeps the indices below
  for (auto& [serial, l] : listeners_) {
    fds.push_back({l->sock.get(), POLLIN, 0});
    listeners.push_back(l.get());
  }
  for (auto& [serial, c] : conns_) {
    if (c->state == State::kDead) continue;
    fds.push_back({c->sock.get(), static_cast<short>(c->state == State::kConnecting ? POLLOUT : POLLIN), 0});
    conns.push_back(c);
  }
  const int n = ::poll(fds.data(), fds.size(), 0);
  bool worked = false;
  if (n > 0) {
    for (size_t i = 0; i < listeners.size(); ++i)
      if (fds[1 + i].revents != 0) {
        Accept(*listeners[i]);
        worked = true;
      }
    for (size_t i = 0; i < conns.size(); ++i) {
      const short revents = fds[1 + listeners.size() + i].revents;
      if (revents != 0) {
        OnSocket(conns[i], revents);
        worked = true;
      }
    }
  }
  const auto now = Clock::now();
  for (auto& c : conns) {
    if ((c->state == State::kConnecting || c->state == State::kAwaitAck) && now >= c->deadline) {
      End(c, absl::UnavailableError(absl::StrCat("connecting to ", c->peer, " timed out")), true);
    } else if (c->state == State::kAwaitHello && now >= c->deadline) {
      End(c, absl::DeadlineExceededError("no hello"), false);
      conns_.erase(c->serial);
    }
  }
  return worked;
}

void ShmTransport::Accept(Listener& l) {
  while (true) {
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    const int fd = ::accept4(l.sock.get(), reinterpret_cast<sockaddr*>(&from), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a connection that went away meanwhile
    auto c = std::make_shared<Conn>();
    c->serial = next_serial_++;
    c->peer = FormatAddress(from);
    c->listener = &l;
    c->listener_serial = l.serial;
    c->sock.reset(fd);
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    c->state = State::kAwaitHello;
    c->deadline = Clock::now() + options_.connect_timeout;
    conns_[c->serial] = c;
  }
}

void ShmTransport::OnSocket(const std::shared_ptr<Conn>& c, short revents) {
  Conn& conn = *c;
  switch (conn.state) {
    case State::kConnecting: {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(conn.sock.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0 || (revents & (POLLERR | POLLHUP)) != 0) {
        End(c, absl::UnavailableError(absl::StrCat("connect to ", conn.peer, ": ", std::strerror(err != 0 ? err : ECONNRESET))),
            true);
        return;
      }
      auto hello = wire::EncodeShmHello({conn.out.capacity, conn.shm_name});
      if (!hello.ok() || ::send(conn.sock.get(), hello->data(), hello->size(), MSG_NOSIGNAL) !=
                             static_cast<ssize_t>(hello->size())) {
        End(c, absl::UnavailableError(absl::StrCat("hello to ", conn.peer, " not sent")), true);
        return;
      }
      conn.state = State::kAwaitAck;
      return;
    }
    case State::kAwaitAck: {
      char b[64];
      const ssize_t n = ::recv(conn.sock.get(), b, sizeof(b), 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
      if (n <= 0 || b[0] != 'A') {
        End(c, absl::UnavailableError(absl::StrCat("the server at ", conn.peer,
                                                   " refused the shared-memory connection (not on this host, or "
                                                   "not a shared-memory data plane)")),
            true);
        return;
      }
      ::shm_unlink(conn.shm_name.c_str());
      conn.shm_name.clear();
      Opened(conn);
      return;
    }
    case State::kAwaitHello: {
      std::byte b[256];
      const ssize_t n = ::recv(conn.sock.get(), b, sizeof(b), 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
      if (n <= 0 || conn.hello.size() + n > wire::kShmHelloFixed + 200) {
        End(c, absl::UnavailableError("hello not received"), false);
        conns_.erase(conn.serial);
        return;
      }
      conn.hello.insert(conn.hello.end(), b, b + n);
      ServerHello(c);
      return;
    }
    case State::kOpen: {
      char b[256];
      const ssize_t n = ::recv(conn.sock.get(), b, sizeof(b), 0);
      if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) return;  // nothing is sent here once open
      const absl::Status why = absl::UnavailableError(
          n == 0 ? absl::StrCat("peer ", conn.peer, " closed the connection (exited or was killed)")
                 : Errno(absl::StrCat("connection to ", conn.peer)));
      const bool server_side = conn.listener != nullptr;
      End(c, why, true);
      if (server_side) conns_.erase(conn.serial);
      return;
    }
    case State::kDead: return;
  }
}

void ShmTransport::ServerHello(const std::shared_ptr<Conn>& c) {
  Conn& conn = *c;
  auto refuse = [&](const absl::Status& why) {
    std::fprintf(stderr, "k3serve shm transport: refused a connection from %s: %s\n", conn.peer.c_str(),
                 std::string(why.message()).c_str());
    End(c, why, false);
    conns_.erase(conn.serial);
  };
  auto length = wire::ShmHelloLength(conn.hello);
  if (!length.ok()) return refuse(length.status());
  if (*length == 0 || conn.hello.size() < *length) return;  // more to come
  if (conn.hello.size() > *length) return refuse(absl::InvalidArgumentError("bytes after the hello"));
  auto hello = wire::DecodeShmHello(conn.hello);
  if (!hello.ok()) return refuse(hello.status());
  Fd shm(::shm_open(hello->name.c_str(), O_RDWR | O_CLOEXEC, 0));
  if (shm.get() < 0) return refuse(absl::UnavailableError(Errno(absl::StrCat("shm_open ", hello->name))));
  struct stat st{};
  if (::fstat(shm.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) != SegmentBytes(hello->ring_bytes))
    return refuse(absl::InvalidArgumentError("the shared mapping's size does not match the hello's ring_bytes"));
  auto map = std::make_unique<Mapping>();
  map->size = SegmentBytes(hello->ring_bytes);
  void* addr = ::mmap(nullptr, map->size, PROT_READ | PROT_WRITE, MAP_SHARED, shm.get(), 0);
  if (addr == MAP_FAILED) return refuse(absl::ResourceExhaustedError(Errno("mmap")));
  map->addr = addr;
  SegmentHeader* h = map->header();
  if (h->magic != kSegmentMagic || h->version != wire::kVersion || h->ring_bytes != hello->ring_bytes)
    return refuse(absl::InvalidArgumentError("the shared mapping's header does not match the hello"));
  // From here the ring size is the hello's (checked), never the header's, which the peer may change.
  const uint64_t ring = hello->ring_bytes;
  std::byte* base = static_cast<std::byte*>(addr) + sizeof(SegmentHeader);
  conn.in = {&h->ring[0], base, ring};
  conn.out = {&h->ring[1], base + ring, ring};
  conn.reader.emplace(ring, options_.max_message);
  conn.map = std::move(map);
  const char ack = 'A';
  if (::send(conn.sock.get(), &ack, 1, MSG_NOSIGNAL) != 1) return refuse(absl::UnavailableError("ack not sent"));
  conn.hello.clear();
  conn.hello.shrink_to_fit();
  Opened(conn);
  std::lock_guard<std::mutex> lock(server_conns_mu_);
  server_conns_[conn.serial] = c;
}

void ShmTransport::Opened(Conn& c) {
  c.state = State::kOpen;
  {
    std::lock_guard<std::mutex> lock(c.in_mu);
    c.in_tail = c.in.ctl->tail.v.load(std::memory_order_relaxed);
    c.readable = true;
  }
  std::lock_guard<std::mutex> lock(c.out_mu);
  c.out_head = c.out.ctl->head.v.load(std::memory_order_relaxed);
  c.writable = true;
  c.WriteQueued();
}

void ShmTransport::End(const std::shared_ptr<Conn>& c, const absl::Status& why, bool tell_owner) {
  if (c->state == State::kDead) return;
  std::unique_lock<std::mutex> in_lock(c->in_mu);  // no Poll reads the ring from here on
  c->readable = false;
  if (c->state == State::kOpen && tell_owner && c->in_error.ok()) {
    // What the peer wrote before it went is still delivered.
    c->state = State::kDead;  // a malformed ring must not recurse here
    const uint64_t head = c->in.ctl->head.v.load(std::memory_order_acquire);
    if (head != c->in_tail)
      (void)c->reader->Read(
          std::span<const std::byte>(c->in.data, c->in.capacity), c->in_tail, head,
          [&](uint32_t length) {
            c->rx = Buffer(length);
            return c->rx.data();
          },
          [&] {
            if (c->listener != nullptr) {
              if (c->listener->callbacks.on_message) c->listener->callbacks.on_message(c->serial, std::move(c->rx));
            } else if (c->client.on_message) {
              c->client.on_message(std::move(c->rx));
            }
          });
  }
  in_lock.unlock();
  c->state = State::kDead;
  std::deque<OutMsg> queued;
  std::vector<SendDone> completed;
  {
    std::lock_guard<std::mutex> lock(c->out_mu);
    c->dead = true;
    c->dead_status = why;
    c->writable = false;
    queued.swap(c->out_q);
    completed.swap(c->completed);
    c->sock.reset();
  }
  if (c->listener != nullptr) {
    std::lock_guard<std::mutex> lock(server_conns_mu_);
    server_conns_.erase(c->serial);
  }
  {
    std::lock_guard<std::mutex> lock(c->in_mu);
    c->map.reset();
  }
  if (!c->shm_name.empty()) {
    ::shm_unlink(c->shm_name.c_str());
    c->shm_name.clear();
  }
  for (auto& done : completed)
    if (done) done(absl::OkStatus());
  const absl::Status failed = absl::IsCancelled(why) ? why : absl::UnavailableError(why.message());
  for (auto& m : queued)
    if (m.done) m.done(failed);
  if (!tell_owner) return;
  if (c->listener != nullptr) {
    if (c->listener->callbacks.on_closed) c->listener->callbacks.on_closed(c->serial, why);
  } else if (c->client.on_failure) {
    c->client.on_failure(absl::UnavailableError(why.message()));
  }
}

class SchemeTransport final : public Transport {
 public:
  SchemeTransport(std::unique_ptr<Transport> shm, std::unique_ptr<Transport> other)
      : shm_(std::move(shm)), other_(std::move(other)) {}
  absl::StatusOr<std::unique_ptr<Connection>> Connect(const std::string& address, ClientCallbacks callbacks) override {
    return Pick(address).Connect(address, std::move(callbacks));
  }
  absl::StatusOr<std::unique_ptr<Server>> Listen(const std::string& address, ServerCallbacks callbacks) override {
    return Pick(address).Listen(address, std::move(callbacks));
  }

 private:
  Transport& Pick(const std::string& address) { return address.starts_with(kShmScheme) ? *shm_ : *other_; }
  std::unique_ptr<Transport> shm_, other_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> NewShmTransport(const ShmOptions& options) {
  K3_ASSIGN_OR_RETURN(auto t, ShmTransport::Create(options));
  return std::unique_ptr<Transport>(std::move(t));
}

std::unique_ptr<Transport> NewSchemeTransport(std::unique_ptr<Transport> shm, std::unique_ptr<Transport> other) {
  return std::make_unique<SchemeTransport>(std::move(shm), std::move(other));
}

}  // namespace k3::dataplane
