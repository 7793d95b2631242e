#include "router/ucx_transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include <ucp/api/ucp.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "router/socket_address.h"

namespace k3::dataplane {
namespace {

constexpr unsigned kAmId = 0;

absl::Status FromUcs(ucs_status_t status, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED: return absl::CancelledError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT: return absl::ResourceExhaustedError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR: return absl::InvalidArgumentError(msg);
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_BUSY: return absl::UnavailableError(msg);
    default: return absl::InternalError(msg);
  }
}

struct ContextDeleter {
  void operator()(ucp_context* c) const { ucp_cleanup(c); }
};
struct WorkerDeleter {
  void operator()(ucp_worker* w) const { ucp_worker_destroy(w); }
};
struct ListenerDeleter {
  void operator()(ucp_listener* l) const { ucp_listener_destroy(l); }
};

class Fd {
 public:
  Fd() = default;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// The network interface that owns `host` (an IP address), "" for any address or one not found.
std::string InterfaceOf(const std::string& host) {
  if (host.empty() || host == "0.0.0.0" || host == "::") return {};
  auto want = ResolveAddress(host + ":0", /*passive=*/false);
  if (!want.ok()) return {};
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string name;
  for (ifaddrs* a = list; a != nullptr && name.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != want->ss_family) continue;
    if (want->ss_family == AF_INET) {
      if (reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr ==
          reinterpret_cast<const sockaddr_in&>(*want).sin_addr.s_addr)
        name = a->ifa_name;
    } else if (std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr,
                           &reinterpret_cast<const sockaddr_in6&>(*want).sin6_addr, sizeof(in6_addr)) == 0) {
      name = a->ifa_name;
    }
  }
  ::freeifaddrs(list);
  return name;
}

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "k3serve ucx transport: %s\n", what);
  std::abort();
}

class UcxTransport;

struct ListenerState {
  uint64_t serial = 0;
  UcxTransport* transport = nullptr;
  ServerCallbacks callbacks;
  std::unique_ptr<ucp_listener, ListenerDeleter> listener;
  std::string address;
  absl::flat_hash_set<uint64_t> connections;  // endpoint serials
};

// One UCP endpoint, client or server side. Touched only on the progress thread.
struct Endpoint {
  uint64_t serial = 0;  // also the ConnectionId on the server side
  UcxTransport* transport = nullptr;
  ucp_ep_h ep = nullptr;            // null once closed
  std::string peer;                 // for error messages
  ClientCallbacks client;           // client side
  ListenerState* server = nullptr;  // server side
  absl::Status failure;             // set once the endpoint failed
  bool closing = false;             // closed by us (Connection/Server destroyed)
};

// Operations in flight name their endpoint by serial: it may be gone when they complete.
struct SendOp {
  UcxTransport* transport;
  uint64_t endpoint;
  Buffer msg;     // UCX reads it until the request completes
  SendDone done;  // null once called
};

// A rendezvous receive in flight.
struct RecvOp {
  UcxTransport* transport;
  uint64_t endpoint;
  Buffer msg;
};

class UcxConnection;
class UcxServer;

class UcxTransport final : public Transport {
 public:
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(const UcxOptions& options);
  ~UcxTransport() override;

  absl::StatusOr<std::unique_ptr<Connection>> Connect(const std::string& address,
                                                      ClientCallbacks callbacks) override;
  absl::StatusOr<std::unique_ptr<Server>> Listen(const std::string& address,
                                                 ServerCallbacks callbacks) override;

  // Used by UcxConnection / UcxServer.
  void SendOnEndpoint(uint64_t serial, const ListenerState* server, Buffer msg, SendDone done);
  void CloseClient(uint64_t serial);
  void CloseServer(uint64_t listener);
  void CloseAccepted(uint64_t serial, const ListenerState* server);

 private:
  explicit UcxTransport(const UcxOptions& options) : options_(options) {}

  void Post(absl::AnyInvocable<void()> command);
  template <class F>
  auto RunSync(F f) -> decltype(f());
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  void Loop();
  bool RunCommands();
  bool ProcessDeferred();
  void Sleep();

  absl::StatusOr<uint64_t> CreateClientEndpoint(const sockaddr_storage& addr, const std::string& address,
                                                ClientCallbacks callbacks);
  absl::StatusOr<const ListenerState*> CreateListener(const sockaddr_storage& addr,
                                                      const std::string& address, ServerCallbacks callbacks);
  Endpoint* AddEndpoint(ucp_ep_h ep);
  void CloseEndpoint(Endpoint* e);
  void EraseEndpoint(Endpoint* e);
  void Deliver(Endpoint* e, Buffer msg);
  absl::Status SendStatus(uint64_t endpoint, ucs_status_t status);
  void Accept(uint64_t listener, ucp_conn_request_h request);

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnConnRequest(ucp_conn_request_h request, void* arg);
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data, size_t length,
                           const ucp_am_recv_param_t* param);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);

  const UcxOptions options_;
  std::unique_ptr<ucp_context, ContextDeleter> context_;
  std::unique_ptr<ucp_worker, WorkerDeleter> worker_;
  Fd wake_fd_;   // eventfd: commands posted while the thread sleeps
  Fd epoll_fd_;  // waits on wake_fd_ and the worker's event fd
  std::thread thread_;

  std::mutex mu_;
  std::vector<absl::AnyInvocable<void()>> commands_;  // guarded by mu_
  bool sleeping_ = false;                            // guarded by mu_

  // Progress-thread state.
  bool running_ = true;
  uint64_t next_serial_ = 1;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Endpoint>> endpoints_;
  absl::flat_hash_map<ucp_ep_h, Endpoint*> by_ep_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<ListenerState>> listeners_;
  // Work noticed inside UCX callbacks, done after ucp_worker_progress returns (UCX must not be
  // re-entered from its own callbacks for these).
  std::deque<std::pair<uint64_t, ucp_conn_request_h>> conn_requests_;
  std::deque<std::pair<uint64_t, ucs_status_t>> failed_;
  // Requests in flight, owned here. UCX does not complete every request of a force-closed endpoint
  // (a rendezvous send waiting for its peer, say) before the close finishes, so the transport
  // completes them itself and keeps their buffers until UCX lets go, or until the worker is gone.
  absl::flat_hash_set<SendOp*> sends_;
  absl::flat_hash_set<RecvOp*> recvs_;
};

class UcxConnection final : public Connection {
 public:
  UcxConnection(UcxTransport* transport, uint64_t serial, std::string address)
      : transport_(transport), serial_(serial), address_(std::move(address)) {}
  ~UcxConnection() override { transport_->CloseClient(serial_); }
  void Send(Buffer msg, SendDone done) override {
    transport_->SendOnEndpoint(serial_, nullptr, std::move(msg), std::move(done));
  }
  const std::string& address() const override { return address_; }

 private:
  UcxTransport* transport_;
  uint64_t serial_;
  std::string address_;
};

class UcxServer final : public Server {
 public:
  UcxServer(UcxTransport* transport, const ListenerState* state)
      : transport_(transport), state_(state), serial_(state->serial), address_(state->address) {}
  ~UcxServer() override { transport_->CloseServer(serial_); }
  void Send(ConnectionId to, Buffer msg, SendDone done) override {
    transport_->SendOnEndpoint(to, state_, std::move(msg), std::move(done));
  }
  void Close(ConnectionId conn) override { transport_->CloseAccepted(conn, state_); }
  const std::string& address() const override { return address_; }

 private:
  UcxTransport* transport_;
  const ListenerState* state_;  // identity only: compared on the progress thread, never dereferenced here
  uint64_t serial_;
  std::string address_;
};

// ---- setup and teardown ----

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(const UcxOptions& options) {
  std::unique_ptr<UcxTransport> t(new UcxTransport(options));

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  // Configuration from UCX_* variables; a bound host also limits UCX's own sockets (its TCP lanes
  // listen on every device they use) to the interface that owns it, unless UCX_NET_DEVICES says.
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return FromUcs(s, "ucp_config_read");
  if (const std::string dev = InterfaceOf(options.host); !dev.empty() && std::getenv("UCX_NET_DEVICES") == nullptr)
    s = ucp_config_modify(config, "NET_DEVICES", dev.c_str());
  if (s == UCS_OK) s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return FromUcs(s, "ucp_init");
  t->context_.reset(context);

  // All UCX calls happen on the progress thread, so the worker needs no locking.
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  s = ucp_worker_create(t->context_.get(), &wparams, &worker);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_create");
  t->worker_.reset(worker);

  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kAmId;
  am.flags = UCP_AM_FLAG_WHOLE_MSG;
  am.cb = &UcxTransport::OnAm;
  am.arg = t.get();
  s = ucp_worker_set_am_recv_handler(t->worker_.get(), &am);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_set_am_recv_handler");

  int worker_fd = -1;
  s = ucp_worker_get_efd(t->worker_.get(), &worker_fd);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_get_efd");
  t->wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  t->epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (t->wake_fd_.get() < 0 || t->epoll_fd_.get() < 0)
    return absl::InternalError(absl::StrCat("eventfd/epoll: ", std::strerror(errno)));
  for (int fd : {worker_fd, t->wake_fd_.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(t->epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0)
      return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
  }

  t->thread_ = std::thread([raw = t.get()] { raw->Loop(); });
  return t;
}

UcxTransport::~UcxTransport() {
  if (thread_.joinable()) {
    if (OnProgressThread()) Die("the transport was destroyed from one of its callbacks");
    Post([this] { running_ = false; });
    thread_.join();
  }
  // Connections and servers are gone by contract; close whatever a caller left behind.
  for (auto& [serial, e] : endpoints_) {
    e->closing = true;
    CloseEndpoint(e.get());
  }
  endpoints_.clear();
  listeners_.clear();
  worker_.reset();
  for (SendOp* op : sends_) delete op;
  for (RecvOp* op : recvs_) delete op;
  // context_ goes with the members.
}

// ---- the progress thread ----

void UcxTransport::Post(absl::AnyInvocable<void()> command) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(command));
    wake = sleeping_;
  }
  if (wake) {
    const uint64_t one = 1;
    // A full eventfd counter (never in practice) still leaves it readable, which is all we need.
    [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
  }
}

template <class F>
auto UcxTransport::RunSync(F f) -> decltype(f()) {
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

void UcxTransport::Loop() {
  pthread_setname_np(pthread_self(), "k3-ucx-progress");
  auto last_work = std::chrono::steady_clock::now();
  while (running_) {
    bool worked = RunCommands();
    while (ucp_worker_progress(worker_.get()) != 0) worked = true;
    worked |= ProcessDeferred();
    const auto now = std::chrono::steady_clock::now();
    if (worked) {
      last_work = now;
    } else if (now - last_work >= options_.spin) {
      Sleep();
      last_work = std::chrono::steady_clock::now();
    } else {
      // Polling: let a runnable thread on this CPU (the application, woken by our last callback)
      // go first. Without this, on a machine with fewer cores than busy threads, the scheduler
      // keeps it waiting for the whole spin.
      sched_yield();
    }
  }
}

bool UcxTransport::RunCommands() {
  std::vector<absl::AnyInvocable<void()>> commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands.swap(commands_);
  }
  for (auto& command : commands) {
    command();
    // A command may have progressed the worker (closing an endpoint); finish what that noticed
    // before the next command looks at the state.
    ProcessDeferred();
  }
  return !commands.empty();
}

void UcxTransport::Sleep() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!commands_.empty()) return;
    sleeping_ = true;
  }
  // UCS_ERR_BUSY: events arrived since the last progress; go round again instead of sleeping.
  if (ucp_worker_arm(worker_.get()) == UCS_OK) {
    epoll_event events[2];
    int n;
    do {
      n = ::epoll_wait(epoll_fd_.get(), events, 2, -1);
    } while (n < 0 && errno == EINTR);
    uint64_t count;
    [[maybe_unused]] ssize_t r = ::read(wake_fd_.get(), &count, sizeof(count));  // EAGAIN if unsignalled
  }
  std::lock_guard<std::mutex> lock(mu_);
  sleeping_ = false;
}

bool UcxTransport::ProcessDeferred() {
  bool worked = false;
  while (!conn_requests_.empty() || !failed_.empty()) {
    worked = true;
    if (!conn_requests_.empty()) {
      auto [listener, request] = conn_requests_.front();
      conn_requests_.pop_front();
      Accept(listener, request);
      continue;
    }
    auto [serial, status] = failed_.front();
    failed_.pop_front();
    auto it = endpoints_.find(serial);
    if (it == endpoints_.end() || !it->second->failure.ok()) continue;
    Endpoint* e = it->second.get();
    e->failure = absl::UnavailableError(
        absl::StrCat("connection to ", e->peer, " failed: ", ucs_status_string(status)));
    CloseEndpoint(e);
    if (e->server != nullptr) {
      ListenerState* server = e->server;
      const absl::Status why = e->failure;
      EraseEndpoint(e);  // before the callback, so that a Send to it from there fails cleanly
      if (server->callbacks.on_closed) server->callbacks.on_closed(serial, why);
    } else if (e->client.on_failure) {
      // The endpoint stays (failed) until its Connection is destroyed.
      e->client.on_failure(e->failure);
    }
  }
  return worked;
}

// ---- endpoints ----

Endpoint* UcxTransport::AddEndpoint(ucp_ep_h ep) {
  auto e = std::make_unique<Endpoint>();
  e->serial = next_serial_++;
  e->transport = this;
  e->ep = ep;
  Endpoint* raw = e.get();
  endpoints_.emplace(raw->serial, std::move(e));
  return raw;
}

void UcxTransport::CloseEndpoint(Endpoint* e) {
  if (e->ep == nullptr) return;
  ucp_ep_h ep = e->ep;
  e->ep = nullptr;
  by_ep_.erase(ep);  // messages still arriving on it are dropped
  // FORCE: no flush handshake with a peer that may be dead or stopped. It finishes after a few
  // progress calls; sends that UCX has not completed by then are completed here.
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (UCS_PTR_IS_PTR(request)) {
    while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker_.get());
    ucp_request_free(request);
  }
  const absl::Status why = SendStatus(e->serial, UCS_ERR_CANCELED);
  for (SendOp* op : sends_) {
    if (op->endpoint != e->serial || op->done == nullptr) continue;
    SendDone done = std::move(op->done);
    op->done = nullptr;
    done(why);
  }
}

void UcxTransport::EraseEndpoint(Endpoint* e) {
  if (e->server != nullptr) e->server->connections.erase(e->serial);
  endpoints_.erase(e->serial);
}

void UcxTransport::Accept(uint64_t listener, ucp_conn_request_h request) {
  auto it = listeners_.find(listener);
  if (it == listeners_.end()) return;  // cannot happen: a server drains these before it goes
  ListenerState* server = it->second.get();

  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string peer = "client";
  if (ucp_conn_request_query(request, &attr) == UCS_OK) peer = FormatAddress(attr.client_address);

  Endpoint* e = AddEndpoint(nullptr);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxTransport::OnEpError;
  params.err_handler.arg = e;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker_.get(), &params, &ep) != UCS_OK) {  // the client sees its connect fail
    endpoints_.erase(e->serial);
    return;
  }
  e->ep = ep;
  e->peer = std::move(peer);
  e->server = server;
  by_ep_.emplace(ep, e);
  server->connections.insert(e->serial);
}

void UcxTransport::Deliver(Endpoint* e, Buffer msg) {
  if (e->server != nullptr) {
    if (e->server->callbacks.on_message) e->server->callbacks.on_message(e->serial, std::move(msg));
  } else if (e->client.on_message) {
    e->client.on_message(std::move(msg));
  }
}

// ---- UCX callbacks (progress thread, inside ucp_worker_progress) ----

void UcxTransport::OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* e = static_cast<Endpoint*>(arg);
  e->transport->failed_.emplace_back(e->serial, status);
}

void UcxTransport::OnConnRequest(ucp_conn_request_h request, void* arg) {
  auto* server = static_cast<ListenerState*>(arg);
  server->transport->conn_requests_.emplace_back(server->serial, request);
}

ucs_status_t UcxTransport::OnAm(void* arg, const void*, size_t, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  Endpoint* e = nullptr;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
    auto it = self->by_ep_.find(param->reply_ep);
    if (it != self->by_ep_.end()) e = it->second;
  }
  if (e == nullptr) {  // from an endpoint being closed: drop; a rendezvous sender learns of it
    return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_CANCELED : UCS_OK;
  }

  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Large message: only its descriptor came; fetch the data into a buffer of our own.
    auto op = std::make_unique<RecvOp>(RecvOp{self, e->serial, Buffer(length)});
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &UcxTransport::OnRecvDone;
    rp.user_data = op.get();
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker_.get(), data, op->msg.data(), length, &rp);
    if (r == nullptr) {
      self->Deliver(e, std::move(op->msg));
    } else if (!UCS_PTR_IS_ERR(r)) {
      self->recvs_.insert(op.release());  // until OnRecvDone
    }
    // On error the message is lost with its endpoint, whose failure is reported separately.
    return UCS_INPROGRESS;
  }
  Buffer msg(length);
  if (length != 0) std::memcpy(msg.data(), data, length);
  self->Deliver(e, std::move(msg));
  return UCS_OK;
}

void UcxTransport::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<SendOp> op(static_cast<SendOp*>(user_data));
  ucp_request_free(request);
  op->transport->sends_.erase(op.get());
  if (op->done != nullptr) op->done(op->transport->SendStatus(op->endpoint, status));
}

void UcxTransport::OnRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
  std::unique_ptr<RecvOp> op(static_cast<RecvOp*>(user_data));
  ucp_request_free(request);
  op->transport->recvs_.erase(op.get());
  if (status != UCS_OK) return;  // the endpoint failed or was closed; reported there
  auto it = op->transport->endpoints_.find(op->endpoint);
  if (it != op->transport->endpoints_.end()) op->transport->Deliver(it->second.get(), std::move(op->msg));
}

// Sends fail with CANCELLED when we closed the connection, else UNAVAILABLE: the peer failed.
absl::Status UcxTransport::SendStatus(uint64_t endpoint, ucs_status_t status) {
  if (status == UCS_OK) return absl::OkStatus();
  auto it = endpoints_.find(endpoint);
  if (it == endpoints_.end() || it->second->closing) return absl::CancelledError("connection closed");
  const Endpoint& e = *it->second;
  if (!e.failure.ok()) return e.failure;
  return absl::UnavailableError(absl::StrCat("send to ", e.peer, ": ", ucs_status_string(status)));
}

// ---- operations ----

void UcxTransport::SendOnEndpoint(uint64_t serial, const ListenerState* server, Buffer msg, SendDone done) {
  Post([this, serial, server, msg = std::move(msg), done = std::move(done)]() mutable {
    auto it = endpoints_.find(serial);
    if (it == endpoints_.end() || it->second->server != server) {
      done(absl::NotFoundError(absl::StrCat("connection ", serial, " is closed or unknown")));
      return;
    }
    Endpoint* e = it->second.get();
    if (!e->failure.ok()) {
      done(e->failure);
      return;
    }
    auto op = std::make_unique<SendOp>(SendOp{this, serial, std::move(msg), std::move(done)});
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;  // the receiver learns which endpoint a message came on
    param.cb.send = &UcxTransport::OnSendDone;
    param.user_data = op.get();
    ucs_status_ptr_t r = ucp_am_send_nbx(e->ep, kAmId, nullptr, 0, op->msg.data(), op->msg.size(), &param);
    if (r == nullptr) {
      op->done(absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(r)) {
      op->done(SendStatus(serial, UCS_PTR_STATUS(r)));
    } else {
      sends_.insert(op.release());  // until OnSendDone
    }
  });
}

absl::StatusOr<std::unique_ptr<Connection>> UcxTransport::Connect(const std::string& address,
                                                                  ClientCallbacks callbacks) {
  if (OnProgressThread()) return absl::FailedPreconditionError("Connect called from a transport callback");
  K3_ASSIGN_OR_RETURN(const sockaddr_storage addr, ResolveAddress(address, /*passive=*/false));
  K3_ASSIGN_OR_RETURN(const uint64_t serial,
                      RunSync([&] { return CreateClientEndpoint(addr, address, std::move(callbacks)); }));
  return std::make_unique<UcxConnection>(this, serial, address);
}

absl::StatusOr<uint64_t> UcxTransport::CreateClientEndpoint(const sockaddr_storage& addr,
                                                            const std::string& address,
                                                            ClientCallbacks callbacks) {
  Endpoint* e = AddEndpoint(nullptr);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  params.sockaddr.addrlen = AddressLength(addr);
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails the endpoint instead of hanging it
  params.err_handler.cb = &UcxTransport::OnEpError;
  params.err_handler.arg = e;
  ucp_ep_h ep = nullptr;
  const ucs_status_t s = ucp_ep_create(worker_.get(), &params, &ep);
  if (s != UCS_OK) {
    endpoints_.erase(e->serial);
    return FromUcs(s, absl::StrCat("connect to ", address));
  }
  e->ep = ep;
  e->peer = address;
  e->client = std::move(callbacks);
  by_ep_.emplace(ep, e);
  return e->serial;
}

absl::StatusOr<std::unique_ptr<Server>> UcxTransport::Listen(const std::string& address,
                                                             ServerCallbacks callbacks) {
  if (OnProgressThread()) return absl::FailedPreconditionError("Listen called from a transport callback");
  K3_ASSIGN_OR_RETURN(const sockaddr_storage addr, ResolveAddress(address, /*passive=*/true));
  K3_ASSIGN_OR_RETURN(const ListenerState* state,
                      RunSync([&] { return CreateListener(addr, address, std::move(callbacks)); }));
  return std::make_unique<UcxServer>(this, state);
}

absl::StatusOr<const ListenerState*> UcxTransport::CreateListener(const sockaddr_storage& addr,
                                                                  const std::string& address,
                                                                  ServerCallbacks callbacks) {
  auto state = std::make_unique<ListenerState>();
  state->serial = next_serial_++;
  state->transport = this;
  state->callbacks = std::move(callbacks);
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  params.sockaddr.addrlen = AddressLength(addr);
  params.conn_handler.cb = &UcxTransport::OnConnRequest;
  params.conn_handler.arg = state.get();
  ucp_listener_h listener = nullptr;
  ucs_status_t s = ucp_listener_create(worker_.get(), &params, &listener);
  if (s != UCS_OK) return FromUcs(s, absl::StrCat("listen on ", address));
  state->listener.reset(listener);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(listener, &attr);
  if (s != UCS_OK) return FromUcs(s, "ucp_listener_query");
  state->address = FormatAddress(attr.sockaddr);
  const ListenerState* raw = state.get();
  listeners_.emplace(raw->serial, std::move(state));
  return raw;
}

void UcxTransport::CloseClient(uint64_t serial) {
  if (OnProgressThread()) Die("a Connection was destroyed from a transport callback");
  RunSync([&] {
    auto it = endpoints_.find(serial);
    if (it == endpoints_.end()) return;
    it->second->closing = true;
    CloseEndpoint(it->second.get());
    EraseEndpoint(it->second.get());
  });
}

void UcxTransport::CloseAccepted(uint64_t serial, const ListenerState* server) {
  Post([this, serial, server] {
    auto it = endpoints_.find(serial);
    if (it == endpoints_.end() || it->second->server != server) return;
    it->second->closing = true;
    CloseEndpoint(it->second.get());
    EraseEndpoint(it->second.get());
  });
}

void UcxTransport::CloseServer(uint64_t listener) {
  if (OnProgressThread()) Die("a Server was destroyed from a transport callback");
  RunSync([&] {
    ProcessDeferred();  // accept what is already queued, so no request outlives its listener
    auto it = listeners_.find(listener);
    if (it == listeners_.end()) return;
    ListenerState* server = it->second.get();
    server->listener.reset();
    for (uint64_t serial : std::vector<uint64_t>(server->connections.begin(), server->connections.end())) {
      auto e = endpoints_.find(serial);
      if (e == endpoints_.end()) continue;
      e->second->closing = true;
      CloseEndpoint(e->second.get());
      EraseEndpoint(e->second.get());
    }
    listeners_.erase(it);
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> NewUcxTransport(const UcxOptions& options) {
  K3_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> t, UcxTransport::Create(options));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace k3::dataplane
