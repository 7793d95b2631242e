#include "engine/cuda/ipc_experts.h"

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_status.h"

extern char** environ;

namespace k3::cuda {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------- the wire
// A message is a Header and `bytes` of payload: one of the POD structs below (and its strings). Both ends are
// this executable on one host, so the structs travel as they are laid out in memory.
constexpr uint32_t kMagic = 0x5049334b;  // "K3IP"
constexpr uint64_t kMaxPayload = 1u << 24;
enum class Op : uint32_t { kHello = 1, kReady, kDispatch, kQueued, kStats, kStatsReply };

struct Header {
  uint32_t magic = kMagic;
  Op op = Op::kHello;
  uint64_t bytes = 0;
};

// Attention → expert, once: the shared buffer and events, the shapes, the model to build; then the strings.
struct Hello {
  cudaIpcMemHandle_t buffer;
  cudaIpcEventHandle_t rows_ready;  // A: recorded by the attention side after its copies in
  cudaIpcEventHandle_t sums_ready;  // B: recorded by the expert side after its experts
  int64_t max_rows, width, top_k, spin_us;
  uint64_t seed;
  int32_t device, mxfp4, share_experts;
  uint32_t dir_bytes, json_bytes;
};
// Expert → attention: the answer to Hello (code 0: serving), then the message.
struct Ready {
  int32_t code;
  int32_t pid;
  uint32_t message_bytes;
};
struct Dispatch {
  int64_t seq, layer, rows, width, top_k;
  int32_t split;      // x has a lo plane
  int32_t timing;     // record the experts' time
  int32_t host_wait;  // wait for A on the host (IpcOptions::expert_host_waits)
  int32_t unused = 0;
};
// Expert → attention, once the dispatch is queued: code 0, or why the experts refused it (then the message).
struct Queued {
  int64_t seq;
  int32_t code;
  uint32_t message_bytes;
};
// After kStats (no payload): how many of these follow.
struct StatsReply {
  uint32_t layers;
};
struct LayerStats {
  int64_t layer, dispatches;
  double expert_ms, expert_host_ms;
};

// The shared buffer: x's hi and lo planes [2, max_rows, width] bf16, idx and w [max_rows, top_k], sums
// [max_rows, width] fp32.
struct Layout {
  size_t x = 0, idx = 0, w = 0, out = 0, bytes = 0;
  int64_t rows = 0, width = 0, top_k = 0;
};
size_t Align(size_t n) { return (n + 255) & ~size_t{255}; }
Layout MakeLayout(int64_t rows, int64_t width, int64_t top_k) {
  Layout l;
  l.rows = rows, l.width = width, l.top_k = top_k;
  l.idx = Align(size_t(2 * rows * width) * 2);
  l.w = Align(l.idx + size_t(rows * top_k) * 4);
  l.out = Align(l.w + size_t(rows * top_k) * 4);
  l.bytes = Align(l.out + size_t(rows * width) * 4);
  return l;
}

template <typename T>
void Append(std::string* s, const T& v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// The socket of one peer: whole messages, a deadline on reads, EOF and errors as UNAVAILABLE naming the peer.
class Channel {
 public:
  Channel(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
  ~Channel() { Close(); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  void Open(int fd, std::string peer) {
    Close();
    fd_ = fd, peer_ = std::move(peer), hungup_ = false;
  }
  const std::string& peer() const { return peer_; }
  bool Hungup() const { return hungup_; }  // a read saw EOF

  absl::Status Send(Op op, const std::string& payload) {
    out_.clear();
    Append(&out_, Header{kMagic, op, payload.size()});
    out_ += payload;
    for (size_t done = 0; done < out_.size();) {
      const ssize_t n = send(fd_, out_.data() + done, out_.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return absl::UnavailableError(absl::StrCat(peer_, ": send: ", std::strerror(errno)));
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  // The next message: its op in *op, its payload in *payload.
  absl::Status RecvAny(absl::Time deadline, absl::Duration spin, Op* op, std::string* payload) {
    Header h;
    K3_RETURN_IF_ERROR(Read(&h, sizeof(h), deadline, spin));
    if (h.magic != kMagic || h.bytes > kMaxPayload)
      return absl::UnavailableError(absl::StrCat(peer_, ": not a message of this protocol"));
    *op = h.op;
    payload->resize(h.bytes);
    return Read(payload->data(), h.bytes, deadline, absl::ZeroDuration());
  }
  // The next message, which must be `want`.
  absl::Status Recv(Op want, absl::Time deadline, absl::Duration spin, std::string* payload) {
    Op op;
    K3_RETURN_IF_ERROR(RecvAny(deadline, spin, &op, payload));
    if (op != want)
      return absl::UnavailableError(absl::StrCat(peer_, ": unexpected message (op ", static_cast<uint32_t>(op),
                                                 "; want op ", static_cast<uint32_t>(want), ")"));
    return absl::OkStatus();
  }

  // UNAVAILABLE when the peer has hung up (or sent what nobody asked for); does not block.
  absl::Status CheckAlive() {
    char c;
    const ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return absl::UnavailableError(absl::StrCat(peer_, " closed the connection"));
    if (n > 0) return absl::UnavailableError(absl::StrCat(peer_, " sent a message nobody asked for"));
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return absl::UnavailableError(absl::StrCat(peer_, ": ", std::strerror(errno)));
    return absl::OkStatus();
  }

 private:
  absl::Status Read(void* p, size_t bytes, absl::Time deadline, absl::Duration spin) {
    char* dst = static_cast<char*>(p);
    const absl::Time spin_end = absl::Now() + spin;
    for (size_t got = 0; got < bytes;) {
      const ssize_t n = recv(fd_, dst + got, bytes - got, MSG_DONTWAIT);
      if (n > 0) {
        got += static_cast<size_t>(n);
        continue;
      }
      if (n == 0) {
        hungup_ = true;
        return absl::UnavailableError(absl::StrCat(peer_, " closed the connection"));
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        return absl::UnavailableError(absl::StrCat(peer_, ": recv: ", std::strerror(errno)));
      const absl::Time now = absl::Now();
      if (now < spin_end) continue;  // a reply due within microseconds: no sleep and wake-up
      if (now >= deadline)
        return absl::UnavailableError(absl::StrCat(peer_, " did not answer in time"));
      const int64_t ms = deadline == absl::InfiniteFuture()
                             ? -1
                             : std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - now) + 1);
      pollfd pfd{fd_, POLLIN, 0};
      if (poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30))) < 0 && errno != EINTR)
        return absl::UnavailableError(absl::StrCat(peer_, ": poll: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }

  int fd_;
  std::string peer_;
  std::string out_;
  bool hungup_ = false;
};

absl::Status CodeStatus(int32_t code, std::string message) {
  return absl::Status(static_cast<absl::StatusCode>(code), std::move(message));
}

double Ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

}  // namespace

// ---------------------------------------------------------------------------------------- attention side

struct IpcRemoteExperts::Impl {
  IpcOptions opt;
  Layout lay;
  Channel channel{-1, "expert process"};
  pid_t pid = -1;
  bool reaped = false;
  char* base = nullptr;
  cudaEvent_t rows_ready = nullptr, sums_ready = nullptr;
  absl::Status status;
  int64_t seq = 0;
  std::string payload;
  // Timing: four events a dispatch (before the copies in, after them, after wait(B), after the copy out).
  bool timing = false;
  struct Timed {
    int64_t layer = 0;
    cudaEvent_t e[4] = {};
    double round_trip_ms = 0, sums_host_ms = 0;
  };
  std::vector<Timed> timed;
  size_t n_timed = 0;

  ~Impl() {
    channel.Close();  // the expert process sees EOF and exits
    Reap(absl::Seconds(5));
    for (auto& t : timed)
      for (cudaEvent_t e : t.e) cudaEventDestroy(e);
    if (rows_ready) cudaEventDestroy(rows_ready);
    if (sums_ready) cudaEventDestroy(sums_ready);
    cudaFree(base);
  }

  // Waits up to `wait` for the child to exit, then kills it. Says how it ended.
  std::string Reap(absl::Duration wait) {
    if (pid <= 0 || reaped) return "";
    const absl::Time end = absl::Now() + wait;
    int ws = 0;
    for (;;) {
      const pid_t r = waitpid(pid, &ws, WNOHANG);
      if (r == pid) break;
      if (r < 0) return "";
      if (absl::Now() >= end) {
        kill(pid, SIGKILL);
        waitpid(pid, &ws, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    reaped = true;
    if (WIFSIGNALED(ws)) return absl::StrCat(" (killed by signal ", WTERMSIG(ws), ")");
    if (WIFEXITED(ws)) return absl::StrCat(" (exited with status ", WEXITSTATUS(ws), ")");
    return "";
  }

  // The link is gone: this and every later dispatch fail with the reason, and how the process ended if it has.
  absl::Status Fail(const absl::Status& why) {
    if (!status.ok()) return status;
    std::string end;
    if (pid > 0 && !reaped) {
      int ws = 0;
      for (int i = 0; i < 20; ++i) {  // a killed process becomes a zombie within milliseconds of its EOF
        const pid_t r = waitpid(pid, &ws, WNOHANG);
        if (r == pid) {
          reaped = true;
          end = WIFSIGNALED(ws) ? absl::StrCat(" (killed by signal ", WTERMSIG(ws), ")")
                                : absl::StrCat(" (exited with status ", WEXITSTATUS(ws), ")");
          break;
        }
        if (r < 0) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    status = absl::UnavailableError(absl::StrCat(why.message(), end));
    return status;
  }

  absl::StatusOr<Timed*> NextTimed(int64_t layer) {
    if (n_timed == timed.size()) {
      Timed t;
      for (cudaEvent_t& e : t.e) K3_CUDA_OK(cudaEventCreate(&e));
      timed.push_back(t);
    }
    Timed* t = &timed[n_timed++];
    t->layer = layer;
    return t;
  }
};

IpcRemoteExperts::IpcRemoteExperts(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
IpcRemoteExperts::~IpcRemoteExperts() = default;

absl::StatusOr<std::unique_ptr<IpcRemoteExperts>> IpcRemoteExperts::Spawn(const ModelConfig& config,
                                                                          const IpcModelSpec& spec,
                                                                          const IpcOptions& options) {
  if (options.max_rows <= 0) return absl::InvalidArgumentError(absl::StrCat("max_rows ", options.max_rows, " ≤ 0"));
  if (spec.model_dir.empty() == spec.config_json.empty())
    return absl::InvalidArgumentError("IpcModelSpec: exactly one of model_dir and config_json");
  auto impl = std::make_unique<Impl>();
  impl->opt = options;
  impl->lay = MakeLayout(options.max_rows, config.expert_width(), config.top_k);
  K3_CUDA_OK(cudaSetDevice(options.device));
  K3_CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&impl->base), impl->lay.bytes));
  K3_CUDA_OK(cudaMemset(impl->base, 0, impl->lay.bytes));
  K3_CUDA_OK(cudaEventCreateWithFlags(&impl->rows_ready, cudaEventInterprocess | cudaEventDisableTiming));
  K3_CUDA_OK(cudaEventCreateWithFlags(&impl->sums_ready, cudaEventInterprocess | cudaEventDisableTiming));
  Hello hello{};
  K3_CUDA_OK(cudaIpcGetMemHandle(&hello.buffer, impl->base));
  K3_CUDA_OK(cudaIpcGetEventHandle(&hello.rows_ready, impl->rows_ready));
  K3_CUDA_OK(cudaIpcGetEventHandle(&hello.sums_ready, impl->sums_ready));
  hello.max_rows = options.max_rows, hello.width = impl->lay.width, hello.top_k = impl->lay.top_k;
  hello.spin_us = absl::ToInt64Microseconds(options.spin);
  hello.seed = spec.seed, hello.device = options.device, hello.mxfp4 = spec.experts_mxfp4;
  hello.share_experts = spec.share_routed_experts;
  hello.dir_bytes = static_cast<uint32_t>(spec.model_dir.size());
  hello.json_bytes = static_cast<uint32_t>(spec.config_json.size());

  // This executable again, with one end of a socket pair at a descriptor named in its environment.
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (len <= 0) return absl::InternalError(absl::StrCat("readlink /proc/self/exe: ", std::strerror(errno)));
  exe[len] = 0;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(errno)));
  const int child_fd = sv[1] + 1;  // dup2 onto another number clears close-on-exec there
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sv[1], child_fd);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, kIpcExpertFdEnv, std::strlen(kIpcExpertFdEnv)) != 0) env_strings.emplace_back(*e);
  env_strings.push_back(absl::StrCat(kIpcExpertFdEnv, "=", child_fd));
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  char* argv[] = {exe, nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe, &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(sv[1]);
  if (rc != 0) {
    close(sv[0]);
    return absl::InternalError(absl::StrCat("posix_spawn ", exe, ": ", std::strerror(rc)));
  }
  impl->pid = pid;
  impl->channel.Open(sv[0], absl::StrCat("expert process ", pid));

  std::string payload;
  Append(&payload, hello);
  payload += spec.model_dir;
  payload += spec.config_json;
  if (auto s = impl->channel.Send(Op::kHello, payload); !s.ok()) return impl->Fail(s);
  const absl::Time deadline = absl::Now() + options.setup_timeout;
  if (auto s = impl->channel.Recv(Op::kReady, deadline, absl::ZeroDuration(), &payload); !s.ok()) return impl->Fail(s);
  Ready ready{};
  if (payload.size() < sizeof(ready)) return impl->Fail(absl::UnavailableError("short Ready"));
  std::memcpy(&ready, payload.data(), sizeof(ready));
  if (ready.code != 0)
    return CodeStatus(ready.code, absl::StrCat(impl->channel.peer(), ": ",
                                               payload.substr(sizeof(ready), ready.message_bytes)));
  return std::unique_ptr<IpcRemoteExperts>(new IpcRemoteExperts(std::move(impl)));
}

absl::Status IpcRemoteExperts::Run(const CudaExpertRequest& r, float* out, cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.status.ok()) return m.status;
  const Layout& L = m.lay;
  if (r.width != L.width || r.top_k != L.top_k || r.rows < 0 || r.rows > L.rows || r.x.ld < r.width)
    return absl::InvalidArgumentError(absl::StrCat("expert request (rows ", r.rows, ", width ", r.width, ", k ",
                                                   r.top_k, ", ld ", r.x.ld, ") for ", m.channel.peer(),
                                                   ", which takes rows ≤ ", L.rows, ", width ", L.width, ", k ",
                                                   L.top_k));
  if (r.rows == 0) return absl::OkStatus();
  // A peer that hung up is seen here, before anything that depends on it is enqueued.
  if (auto s = m.channel.CheckAlive(); !s.ok()) return m.Fail(s);
  Impl::Timed* t = nullptr;
  if (m.timing) {
    K3_ASSIGN_OR_RETURN(t, m.NextTimed(r.layer));
    K3_CUDA_OK(cudaEventRecord(t->e[0], stream));
  }
  const size_t row = size_t(r.width) * 2, pitch = size_t(r.x.ld) * 2, kb = size_t(r.rows * r.top_k) * 4;
  char* x = m.base + L.x;
  K3_CUDA_OK(cudaMemcpy2DAsync(x, row, r.x.p, pitch, row, r.rows, cudaMemcpyDeviceToDevice, stream));
  if (r.x.lo)
    K3_CUDA_OK(cudaMemcpy2DAsync(x + size_t(L.rows) * row, row, r.x.p + r.x.lo, pitch, row, r.rows,
                                 cudaMemcpyDeviceToDevice, stream));
  K3_CUDA_OK(cudaMemcpyAsync(m.base + L.idx, r.idx, kb, cudaMemcpyDeviceToDevice, stream));
  K3_CUDA_OK(cudaMemcpyAsync(m.base + L.w, r.w, kb, cudaMemcpyDeviceToDevice, stream));
  if (t) K3_CUDA_OK(cudaEventRecord(t->e[1], stream));
  K3_CUDA_OK(cudaEventRecord(m.rows_ready, stream));

  const Dispatch d{++m.seq, r.layer, r.rows, r.width, r.top_k, r.x.lo != 0, t != nullptr,
                    m.opt.expert_host_waits};
  m.payload.clear();
  Append(&m.payload, d);
  const auto t0 = Clock::now();
  if (auto s = m.channel.Send(Op::kDispatch, m.payload); !s.ok()) return m.Fail(s);
  if (auto s = m.channel.Recv(Op::kQueued, absl::Now() + m.opt.dispatch_timeout, m.opt.spin, &m.payload); !s.ok())
    return m.Fail(s);
  const auto t1 = Clock::now();
  Queued q{};
  if (m.payload.size() < sizeof(q)) return m.Fail(absl::UnavailableError(m.channel.peer() + ": short reply"));
  std::memcpy(&q, m.payload.data(), sizeof(q));
  if (q.seq != d.seq)
    return m.Fail(absl::UnavailableError(absl::StrCat(m.channel.peer(), ": reply to dispatch ", q.seq, ", want ", d.seq)));
  if (q.code != 0)  // the experts refused this request (and queued nothing to wait for); the link is fine
    return CodeStatus(q.code, absl::StrCat(m.channel.peer(), ": ", m.payload.substr(sizeof(q), q.message_bytes)));
  if (m.opt.attention_host_waits) {
    // B was recorded before the reply; spin until the expert's GPU has passed it, watching the peer.
    const auto end = t1 + std::chrono::microseconds(absl::ToInt64Microseconds(m.opt.dispatch_timeout));
    for (int64_t i = 0;; ++i) {
      const cudaError_t e = cudaEventQuery(m.sums_ready);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) K3_CUDA_OK(e);
      if (i % 4096 == 4095) {
        if (auto s = m.channel.CheckAlive(); !s.ok()) return m.Fail(s);
        if (Clock::now() > end)
          return m.Fail(absl::UnavailableError(m.channel.peer() + ": its experts did not finish in time"));
      }
    }
  } else {
    K3_CUDA_OK(cudaStreamWaitEvent(stream, m.sums_ready, 0));
  }
  if (t) {
    t->round_trip_ms = Ms(t0, t1);
    t->sums_host_ms = Ms(t1, Clock::now());
    K3_CUDA_OK(cudaEventRecord(t->e[2], stream));
  }
  K3_CUDA_OK(cudaMemcpyAsync(out, m.base + L.out, size_t(r.rows * r.width) * 4, cudaMemcpyDeviceToDevice, stream));
  if (t) K3_CUDA_OK(cudaEventRecord(t->e[3], stream));
  return absl::OkStatus();
}

absl::Status IpcRemoteExperts::status() const { return impl_->status; }
void IpcRemoteExperts::SetTiming(bool on) { impl_->timing = on; }
int IpcRemoteExperts::pid() const { return impl_->pid; }
const std::string& IpcRemoteExperts::peer() const { return impl_->channel.peer(); }

absl::StatusOr<std::map<int64_t, IpcStageStats>> IpcRemoteExperts::TakeStats() {
  Impl& m = *impl_;
  if (!m.status.ok()) return m.status;
  std::map<int64_t, IpcStageStats> stats;
  if (m.n_timed > 0) K3_CUDA_OK(cudaEventSynchronize(m.timed[m.n_timed - 1].e[3]));
  for (size_t i = 0; i < m.n_timed; ++i) {
    const Impl::Timed& t = m.timed[i];
    float pack = 0, wait = 0, unpack = 0;
    K3_CUDA_OK(cudaEventElapsedTime(&pack, t.e[0], t.e[1]));
    K3_CUDA_OK(cudaEventElapsedTime(&wait, t.e[1], t.e[2]));
    K3_CUDA_OK(cudaEventElapsedTime(&unpack, t.e[2], t.e[3]));
    IpcStageStats& s = stats[t.layer];
    ++s.dispatches;
    s.pack_ms += pack, s.wait_ms += wait, s.unpack_ms += unpack, s.round_trip_ms += t.round_trip_ms;
    s.sums_host_ms += t.sums_host_ms;
  }
  m.n_timed = 0;
  if (auto s = m.channel.Send(Op::kStats, ""); !s.ok()) return m.Fail(s);
  if (auto s = m.channel.Recv(Op::kStatsReply, absl::Now() + m.opt.dispatch_timeout, absl::ZeroDuration(), &m.payload);
      !s.ok())
    return m.Fail(s);
  StatsReply reply{};
  if (m.payload.size() < sizeof(reply)) return m.Fail(absl::UnavailableError(m.channel.peer() + ": short stats"));
  std::memcpy(&reply, m.payload.data(), sizeof(reply));
  if (m.payload.size() != sizeof(reply) + reply.layers * sizeof(LayerStats))
    return m.Fail(absl::UnavailableError(m.channel.peer() + ": bad stats"));
  for (uint32_t i = 0; i < reply.layers; ++i) {
    LayerStats l;
    std::memcpy(&l, m.payload.data() + sizeof(reply) + i * sizeof(LayerStats), sizeof(l));
    IpcStageStats& s = stats[l.layer];
    s.expert_ms += l.expert_ms, s.expert_host_ms += l.expert_host_ms;
  }
  return stats;
}

// ------------------------------------------------------------------------------------------- expert side
namespace {

struct ExpertSession {
  Channel& ch;
  absl::Duration spin;
  std::unique_ptr<CudaModel> model;
  char* base = nullptr;
  Layout lay;
  cudaEvent_t rows_ready = nullptr, sums_ready = nullptr;
  cudaStream_t stream = nullptr;
  struct Timed {
    int64_t layer = 0;
    cudaEvent_t begin = nullptr, end = nullptr;
    double host_ms = 0;
  };
  std::vector<Timed> timed;
  size_t n_timed = 0;

  explicit ExpertSession(Channel& c) : ch(c) {}
  ~ExpertSession() {
    if (stream) cudaStreamSynchronize(stream);
    for (auto& t : timed) cudaEventDestroy(t.begin), cudaEventDestroy(t.end);
    if (stream) cudaStreamDestroy(stream);
    if (rows_ready) cudaEventDestroy(rows_ready);
    if (sums_ready) cudaEventDestroy(sums_ready);
    if (base) cudaIpcCloseMemHandle(base);
  }

  absl::Status Setup(const std::string& payload) {
    Hello h;
    if (payload.size() < sizeof(h)) return absl::InvalidArgumentError("short Hello");
    std::memcpy(&h, payload.data(), sizeof(h));
    if (payload.size() != sizeof(h) + h.dir_bytes + h.json_bytes) return absl::InvalidArgumentError("bad Hello");
    const std::string dir = payload.substr(sizeof(h), h.dir_bytes);
    const std::string json = payload.substr(sizeof(h) + h.dir_bytes, h.json_bytes);
    spin = absl::Microseconds(h.spin_us);
    K3_CUDA_OK(cudaSetDevice(h.device));
    CudaModelOptions o;
    o.max_seqs = 1, o.max_context = 16, o.max_batch_tokens = h.max_rows, o.device = h.device;
    o.share_routed_experts = h.share_experts != 0;
    o.cuda_graphs = false;
    if (!dir.empty()) {
      K3_ASSIGN_OR_RETURN(model, CudaModel::Load(dir, o));
    } else {
      K3_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(json, "config.json (from the attention side)"));
      if (h.mxfp4) config.expert_format = ExpertFormat::kMxfp4;
      K3_ASSIGN_OR_RETURN(model, CudaModel::CreateRandom(config, h.seed, o));
    }
    const ModelConfig& c = model->config();
    if (c.expert_width() != h.width || c.top_k != h.top_k)
      return absl::InvalidArgumentError(absl::StrCat("the attention side's width ", h.width, " and top_k ", h.top_k,
                                                     " are not this model's (", c.expert_width(), ", ", c.top_k, ")"));
    if (!model->local_experts()) return absl::InvalidArgumentError("the model has no routed experts");
    lay = MakeLayout(h.max_rows, h.width, h.top_k);
    void* p = nullptr;
    K3_CUDA_OK(cudaIpcOpenMemHandle(&p, h.buffer, cudaIpcMemLazyEnablePeerAccess));
    base = static_cast<char*>(p);
    K3_CUDA_OK(cudaIpcOpenEventHandle(&rows_ready, h.rows_ready));
    K3_CUDA_OK(cudaIpcOpenEventHandle(&sums_ready, h.sums_ready));
    K3_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return absl::OkStatus();
  }

  // wait(A) → experts → record(B), enqueued; the GPU is not waited for.
  absl::Status Enqueue(const Dispatch& d, Clock::time_point received) {
    if (d.rows <= 0 || d.rows > lay.rows || d.width != lay.width || d.top_k != lay.top_k)
      return absl::InvalidArgumentError(absl::StrCat("dispatch (rows ", d.rows, ", width ", d.width, ", k ", d.top_k,
                                                     ") outside the shared buffer (rows ≤ ", lay.rows, ")"));
    if (d.host_wait) {
      // A was recorded before the frame was sent; spin until the attention GPU has passed it.
      const auto end = received + std::chrono::seconds(30);
      for (int64_t i = 0;; ++i) {
        const cudaError_t e = cudaEventQuery(rows_ready);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) K3_CUDA_OK(e);
        if (i % 4096 == 4095 && Clock::now() > end)
          return absl::DeadlineExceededError("the attention side's rows were not ready within 30 s");
      }
    } else {
      K3_CUDA_OK(cudaStreamWaitEvent(stream, rows_ready, 0));
    }
    Timed* t = nullptr;
    if (d.timing) {
      if (n_timed == timed.size()) {
        Timed n;
        K3_CUDA_OK(cudaEventCreate(&n.begin));
        K3_CUDA_OK(cudaEventCreate(&n.end));
        timed.push_back(n);
      }
      t = &timed[n_timed++];
      t->layer = d.layer;
      K3_CUDA_OK(cudaEventRecord(t->begin, stream));
    }
    Split x{reinterpret_cast<__nv_bfloat16*>(base + lay.x), lay.width, d.split ? lay.rows * lay.width : 0};
    const CudaExpertRequest r{d.layer, d.rows, d.width, d.top_k, x, reinterpret_cast<const int32_t*>(base + lay.idx),
                              reinterpret_cast<const float*>(base + lay.w)};
    const absl::Status run = model->local_experts()->Run(r, reinterpret_cast<float*>(base + lay.out), stream);
    if (t) K3_CUDA_OK(cudaEventRecord(t->end, stream));
    K3_CUDA_OK(cudaEventRecord(sums_ready, stream));  // also after a refusal, so that no wait on B hangs
    if (t) t->host_ms = Ms(received, Clock::now());
    return run;
  }

  absl::Status Stats(std::string* payload) {
    K3_CUDA_OK(cudaStreamSynchronize(stream));
    std::map<int64_t, LayerStats> layers;
    for (size_t i = 0; i < n_timed; ++i) {
      float ms = 0;
      K3_CUDA_OK(cudaEventElapsedTime(&ms, timed[i].begin, timed[i].end));
      LayerStats& l = layers[timed[i].layer];
      l.layer = timed[i].layer;
      ++l.dispatches;
      l.expert_ms += ms, l.expert_host_ms += timed[i].host_ms;
    }
    n_timed = 0;
    payload->clear();
    Append(payload, StatsReply{static_cast<uint32_t>(layers.size())});
    for (const auto& [layer, l] : layers) Append(payload, l);
    return absl::OkStatus();
  }

  // Until the attention side hangs up (0) or the link breaks (1).
  int Serve() {
    std::string payload, reply;
    for (;;) {
      Op op;
      if (absl::Status s = ch.RecvAny(absl::InfiniteFuture(), spin, &op, &payload); !s.ok()) {
        if (ch.Hungup()) return 0;
        std::fprintf(stderr, "ipc expert: %s\n", std::string(s.message()).c_str());
        return 1;
      }
      const auto received = Clock::now();
      if (op == Op::kStats) {
        if (auto s = Stats(&reply); !s.ok()) {
          std::fprintf(stderr, "ipc expert: %s\n", std::string(s.message()).c_str());
          return 1;
        }
        if (!ch.Send(Op::kStatsReply, reply).ok()) return 1;
        continue;
      }
      Dispatch d;
      if (op != Op::kDispatch || payload.size() != sizeof(d)) {
        std::fprintf(stderr, "ipc expert: unexpected message (op %u, %zu bytes)\n", static_cast<uint32_t>(op),
                     payload.size());
        return 1;
      }
      std::memcpy(&d, payload.data(), sizeof(d));
      const absl::Status run = Enqueue(d, received);
      const std::string message(run.message());
      reply.clear();
      Append(&reply, Queued{d.seq, static_cast<int32_t>(run.code()), static_cast<uint32_t>(message.size())});
      reply += message;
      if (!ch.Send(Op::kQueued, reply).ok()) return 1;
    }
  }
};

}  // namespace

int ServeIpcExpertsIfChild() {
  const char* v = std::getenv(kIpcExpertFdEnv);
  if (!v) return -1;
  const int fd = std::atoi(v);
  unsetenv(kIpcExpertFdEnv);
  Channel ch(fd, "attention process");
  ExpertSession session(ch);
  std::string payload;
  if (auto s = ch.Recv(Op::kHello, absl::InfiniteFuture(), absl::ZeroDuration(), &payload); !s.ok()) {
    std::fprintf(stderr, "ipc expert: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const absl::Status setup = session.Setup(payload);
  const std::string message(setup.message());
  std::string reply;
  Append(&reply, Ready{static_cast<int32_t>(setup.code()), static_cast<int32_t>(getpid()),
                       static_cast<uint32_t>(message.size())});
  reply += message;
  if (!ch.Send(Op::kReady, reply).ok() || !setup.ok()) return 1;
  return session.Serve();
}

}  // namespace k3::cuda
