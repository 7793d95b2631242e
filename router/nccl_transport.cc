#include "router/nccl_transport.h"

#include <dlfcn.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_status.h"
#include "router/nccl_rendezvous.h"

namespace k3::dataplane {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status NcclError(const char* what, ncclResult_t r) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr), ")"));
}

// A device buffer that only grows.
struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  ~DeviceBuffer() { cudaFree(p); }
  absl::Status Reserve(size_t n) {
    if (n <= bytes) return absl::OkStatus();
    cudaFree(p);
    p = nullptr;
    bytes = 0;
    K3_CUDA_OK(cudaMalloc(&p, n));
    bytes = n;
    return absl::OkStatus();
  }
};

// ncclCommRevoke (NCCL 2.28) when the libnccl loaded has it: looked up at run time, so that the binaries also
// start with an older NCCL (the GPU machine's own), which then falls back to ncclCommAbort.
using RevokeFn = ncclResult_t (*)(ncclComm_t, int);
RevokeFn Revoke() {
  static const RevokeFn fn = reinterpret_cast<RevokeFn>(dlsym(RTLD_DEFAULT, "ncclCommRevoke"));
  return fn;
}

}  // namespace

void DisableNvlinkMulticast() { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); }

// ------------------------------------------------------------------------------------------ link

// One rank of a two-rank non-blocking communicator. Every NCCL call on it holds mu_, so that the
// watchdog's abort never races another call; the calls that wait (init, an op still being
// enqueued) release it between polls.
class NcclLink {
 public:
  // Starts joining (ncclCommInitRankConfig returns before the peer has joined).
  static absl::StatusOr<std::unique_ptr<NcclLink>> Start(const std::string& unique_id, int rank, int device,
                                                         std::string peer) {
    DisableNvlinkMulticast();
    if (unique_id.size() != sizeof(ncclUniqueId))
      return absl::InvalidArgumentError(absl::StrCat("unique_id: ", unique_id.size(), " bytes, want ",
                                                     sizeof(ncclUniqueId)));
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    K3_CUDA_OK(cudaSetDevice(device));
    std::unique_ptr<NcclLink> link(new NcclLink(device, std::move(peer)));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&link->comm_, 2, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) return NcclError("ncclCommInitRankConfig", r);
    link->watchdog_ = std::thread(&NcclLink::Watchdog, link.get());
    return link;
  }

  ~NcclLink() {
    Fail(absl::CancelledError("closed"));
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      stop_ = true;
    }
    watch_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    for (auto& [event, deadline] : watched_) cudaEventDestroy(event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (comm_) {
      // A revoked communicator is freed once it is quiescent (bounded: abort frees it regardless).
      for (int i = 0; i < 5000; ++i) {
        ncclResult_t state;
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state != ncclInProgress) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ncclCommAbort(comm_);
    }
  }

  // Waits until both ranks have joined; aborts the communicator after the deadline.
  absl::Status WaitReady(absl::Time deadline) {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!status_.ok()) return status_;
        ncclResult_t state;
        const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
        if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
          AbortLocked(NcclError("communicator init", r != ncclSuccess ? r : state));
          return status_;
        }
        if (state == ncclSuccess) {
          ready_ = true;
          return absl::OkStatus();
        }
      }
      if (absl::Now() > deadline) {
        Fail(absl::DeadlineExceededError(absl::StrCat("communicator with ", peer_, ": not set up in time")));
        return status_;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Enqueues ops (NCCL point-to-point calls on comm) as one group, and has the watchdog abort the
  // link if stream does not pass them within timeout (InfiniteDuration: no deadline).
  absl::Status Enqueue(cudaStream_t stream, absl::Duration timeout, absl::FunctionRef<ncclResult_t(ncclComm_t)> ops) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!status_.ok()) return status_;
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) r = ops(comm_);
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    // Non-blocking: the group may still be being enqueued; nothing else may touch the stream until
    // the communicator says it is done.
    while (r == ncclInProgress) {
      ncclResult_t state;
      r = ncclCommGetAsyncError(comm_, &state);
      if (r == ncclSuccess) r = state;
      if (r == ncclInProgress) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
        if (!status_.ok()) return status_;
      }
    }
    if (r != ncclSuccess) {
      AbortLocked(NcclError(absl::StrCat("NCCL group with ", peer_).c_str(), r));
      return status_;
    }
    lock.unlock();
    if (timeout == absl::InfiniteDuration()) return absl::OkStatus();
    return Watch(stream, timeout);
  }

  // Waits for an event, polling (NCCL kernels spin on the device; a blocking sync would too), while
  // the link lives. The event completes once an abort has ended the kernels before it.
  absl::Status Sync(cudaEvent_t event) {
    const auto start = Clock::now();
    while (true) {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return status();
      if (e != cudaErrorNotReady) return absl::InternalError(absl::StrCat("cudaEventQuery: ", cudaGetErrorString(e)));
      if (!status().ok() && aborted_done_) {
        // Aborted: the kernels are ending; wait for the stream to drain rather than return with it busy.
        cudaEventSynchronize(event);
        return status();
      }
      // Spin while a reply is due; back off on an idle peer (an expert node between steps).
      if (Clock::now() - start < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  void Fail(const absl::Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    AbortLocked(why);
  }

  absl::Status status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  const std::string& peer() const { return peer_; }

 private:
  NcclLink(int device, std::string peer) : device_(device), peer_(std::move(peer)) {}

  void AbortLocked(const absl::Status& why) {
    if (!status_.ok()) return;
    status_ = why.code() == absl::StatusCode::kCancelled
                  ? why
                  : absl::UnavailableError(absl::StrCat("NCCL link to ", peer_, ": ", why.message()));
    // Revoke ends the kernels that wait on the peer, and those still queued behind them exit at once; the
    // communicator's memory stays until the destructor, when the streams have drained.
    if (ready_ && comm_ && Revoke()) {
      const ncclResult_t r = Revoke()(comm_, 0);  // NCCL_REVOKE_DEFAULT
      if (r == ncclSuccess || r == ncclInProgress) {
        aborted_done_ = true;
        return;
      }
    }
    // Not set up yet (no kernel of it can be queued), or no revoke in this NCCL: abort frees it now; with an
    // older NCCL a kernel of it still queued on a stream may then fault.
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    aborted_done_ = true;
  }

  absl::Status Watch(cudaStream_t stream, absl::Duration timeout) {
    cudaEvent_t event;
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      if (free_events_.empty()) {
        K3_CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
      } else {
        event = free_events_.back();
        free_events_.pop_back();
      }
    }
    K3_CUDA_OK(cudaEventRecord(event, stream));
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      watched_.emplace_back(event, Clock::now() + absl::ToChronoNanoseconds(timeout));
    }
    watch_cv_.notify_all();
    return absl::OkStatus();
  }

  // Aborts the link when the oldest watched point is late or NCCL reports an error.
  void Watchdog() {
    cudaSetDevice(device_);
    auto last_check = Clock::now();
    std::unique_lock<std::mutex> lock(watch_mu_);
    while (!stop_) {
      if (watched_.empty()) {
        watch_cv_.wait_for(lock, std::chrono::milliseconds(20));
      } else {
        auto [event, deadline] = watched_.front();
        const cudaError_t e = cudaEventQuery(event);
        if (e == cudaSuccess || !status().ok()) {
          watched_.pop_front();
          free_events_.push_back(event);
          continue;
        }
        if (Clock::now() > deadline) {
          lock.unlock();
          Fail(absl::DeadlineExceededError("a dispatch did not come back within the dispatch timeout"));
          lock.lock();
          continue;
        }
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        lock.lock();
      }
      if (Clock::now() - last_check > std::chrono::milliseconds(10)) {
        last_check = Clock::now();
        lock.unlock();
        {
          std::lock_guard<std::mutex> nccl(mu_);
          ncclResult_t state;
          if (comm_ && status_.ok() && ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
              state != ncclInProgress)
            AbortLocked(NcclError("asynchronous NCCL error", state));
        }
        lock.lock();
      }
    }
  }

  const int device_;
  const std::string peer_;
  mutable std::mutex mu_;
  ncclComm_t comm_ = nullptr;  // kept after a revoke (no call uses it then), freed by the destructor
  bool ready_ = false;         // both ranks have joined
  absl::Status status_;
  std::atomic<bool> aborted_done_{false};

  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool stop_ = false;
  std::deque<std::pair<cudaEvent_t, Clock::time_point>> watched_;
  std::vector<cudaEvent_t> free_events_;
  std::thread watchdog_;
};

// ----------------------------------------------------------------------------- attention side

namespace {

// Frames go out from pinned host slots through a 64-byte copy on the engine's stream; a slot is
// reused once its copy is done (its event).
constexpr int kFrameSlots = 32;

}  // namespace

struct NcclRemoteExperts::Impl {
  ModelConfig config;
  NcclOptions options;
  int device = 0;
  NcclAccepted accepted;
  std::unique_ptr<NcclLink> link;
  std::unique_ptr<NcclRendezvousClient> control;  // after link: its on_lost fails the link
  std::byte* host_frames = nullptr;              // [kFrameSlots, 64] pinned
  std::byte* dev_frames = nullptr;               // [kFrameSlots, 64]
  cudaEvent_t slot_done[kFrameSlots] = {};
  uint64_t seq = 0;
  cudaStream_t stream = nullptr;  // the stream of the dispatches so far

  ~Impl() {
    if (link && link->status().ok() && stream) {
      // Best effort: the expert node ends the session at once instead of when the stream breaks.
      if (SendFrame(NcclFrame{.kind = NcclFrameKind::kClose, .seq = seq + 1}, stream).ok()) {
        cudaEvent_t e;
        if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess) {
          cudaEventRecord(e, stream);
          link->Sync(e).IgnoreError();
          cudaEventDestroy(e);
        }
      }
    }
    control.reset();
    if (stream) cudaStreamSynchronize(stream);  // a revoked link's kernels exit at once
    link.reset();
    for (cudaEvent_t e : slot_done)
      if (e) cudaEventDestroy(e);
    cudaFreeHost(host_frames);
    cudaFree(dev_frames);
  }

  // The frame's slot on the device, filled on stream.
  absl::StatusOr<std::byte*> StageFrame(const FrameBytes& bytes, cudaStream_t s) {
    const int slot = static_cast<int>(seq % kFrameSlots);
    K3_CUDA_OK(cudaEventSynchronize(slot_done[slot]));
    std::memcpy(host_frames + slot * kNcclFrameBytes, bytes.data(), kNcclFrameBytes);
    std::byte* dev = dev_frames + slot * kNcclFrameBytes;
    K3_CUDA_OK(cudaMemcpyAsync(dev, host_frames + slot * kNcclFrameBytes, kNcclFrameBytes, cudaMemcpyHostToDevice, s));
    K3_CUDA_OK(cudaEventRecord(slot_done[slot], s));
    return dev;
  }

  absl::Status SendFrame(const NcclFrame& f, cudaStream_t s) {
    K3_ASSIGN_OR_RETURN(std::byte* dev, StageFrame(EncodeFrame(f), s));
    return link->Enqueue(s, options.dispatch_timeout,
                         [&](ncclComm_t comm) { return ncclSend(dev, kNcclFrameBytes, ncclUint8, 1, comm, s); });
  }
};

NcclRemoteExperts::NcclRemoteExperts(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclRemoteExperts::~NcclRemoteExperts() = default;

absl::StatusOr<std::unique_ptr<NcclRemoteExperts>> NcclRemoteExperts::Connect(const ModelConfig& config,
                                                                              const std::string& address, int device,
                                                                              const NcclOptions& options,
                                                                              const std::string& client_id) {
  DisableNvlinkMulticast();
  K3_CUDA_OK(cudaSetDevice(device));
  auto m = std::make_unique<Impl>();
  m->config = config;
  m->options = options;
  m->device = device;
  K3_CUDA_OK(cudaMallocHost(&m->host_frames, kFrameSlots * kNcclFrameBytes));
  K3_CUDA_OK(cudaMalloc(&m->dev_frames, kFrameSlots * kNcclFrameBytes));
  for (cudaEvent_t& e : m->slot_done) K3_CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  ncclUniqueId id;
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return NcclError("ncclGetUniqueId", r);
  const std::string id_bytes(reinterpret_cast<const char*>(&id), sizeof(id));
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  // The link exists before the control stream, so that the stream's loss always has a link to fail.
  K3_ASSIGN_OR_RETURN(m->link, NcclLink::Start(id_bytes, /*rank=*/0, device, address));
  NcclLink* link = m->link.get();
  K3_ASSIGN_OR_RETURN(m->control, NcclRendezvousClient::Open(address, {id_bytes, client_id, device},
                                                             options.connect_timeout,
                                                             [link](absl::Status why) { link->Fail(why); }));
  m->accepted = m->control->accepted();
  K3_RETURN_IF_ERROR(m->link->WaitReady(deadline));
  return std::unique_ptr<NcclRemoteExperts>(new NcclRemoteExperts(std::move(m)));
}

absl::Status NcclRemoteExperts::Run(const cuda::CudaExpertRequest& r, float* out, cudaStream_t stream) {
  Impl& m = *impl_;
  K3_RETURN_IF_ERROR(m.link->status());
  const ModelConfig& c = m.config;
  if (r.width != c.expert_width() || r.top_k != c.top_k || r.x.ld != r.width)
    return absl::InvalidArgumentError(absl::StrCat("expert request shape (width ", r.width, ", k ", r.top_k, ", ld ",
                                                   r.x.ld, ") does not match the model (", c.expert_width(), ", ",
                                                   c.top_k, ")"));
  if (r.x.lo == 0) return absl::InvalidArgumentError("expert request x: a split x (hi and lo planes) is required");
  if (r.rows > m.accepted.max_rows)
    return absl::InvalidArgumentError(absl::StrCat("expert request rows: ", r.rows, ", expert node ",
                                                   m.accepted.node_id, " takes at most ", m.accepted.max_rows));
  if (m.stream && m.stream != stream)
    return absl::InvalidArgumentError("NcclRemoteExperts: every dispatch must use the same stream");
  if (r.rows == 0) return absl::OkStatus();
  m.stream = stream;
  K3_CUDA_OK(cudaSetDevice(m.device));
  const NcclFrame f{.kind = NcclFrameKind::kRows, .seq = ++m.seq, .layer = static_cast<int32_t>(r.layer),
                    .rows = r.rows, .width = r.width, .top_k = r.top_k};
  const NcclPayload p = PayloadOf(f);
  K3_ASSIGN_OR_RETURN(std::byte* frame, m.StageFrame(EncodeFrame(f), stream));
  return m.link->Enqueue(stream, m.options.dispatch_timeout, [&](ncclComm_t comm) {
    ncclResult_t e = ncclSend(frame, kNcclFrameBytes, ncclUint8, 1, comm, stream);
    if (e == ncclSuccess) e = ncclSend(r.x.p, p.x_plane, ncclUint8, 1, comm, stream);
    if (e == ncclSuccess) e = ncclSend(r.x.p + r.x.lo, p.x_plane, ncclUint8, 1, comm, stream);
    if (e == ncclSuccess) e = ncclSend(r.idx, p.idx, ncclUint8, 1, comm, stream);
    if (e == ncclSuccess) e = ncclSend(r.w, p.w, ncclUint8, 1, comm, stream);
    if (e == ncclSuccess) e = ncclRecv(out, p.sums, ncclUint8, 1, comm, stream);
    return e;
  });
}

absl::Status NcclRemoteExperts::status() const { return impl_->link->status(); }

absl::StatusOr<NcclExpertStats> NcclRemoteExperts::TakeExpertStats() {
  Impl& m = *impl_;
  K3_RETURN_IF_ERROR(m.link->status());
  K3_CUDA_OK(cudaSetDevice(m.device));
  // On the dispatches' stream (ops of one communicator stay in one order); before any, on a stream of its own.
  struct Temp {
    cudaStream_t s = nullptr;
    ~Temp() {
      if (s) cudaStreamDestroy(s);
    }
  } temp;
  if (!m.stream) K3_CUDA_OK(cudaStreamCreateWithFlags(&temp.s, cudaStreamNonBlocking));
  cudaStream_t s = m.stream ? m.stream : temp.s;
  DeviceBuffer reply;
  K3_RETURN_IF_ERROR(reply.Reserve(kNcclFrameBytes));
  K3_ASSIGN_OR_RETURN(std::byte* frame,
                      m.StageFrame(EncodeFrame(NcclFrame{.kind = NcclFrameKind::kStats, .seq = ++m.seq}), s));
  K3_RETURN_IF_ERROR(m.link->Enqueue(s, m.options.dispatch_timeout, [&](ncclComm_t comm) {
    ncclResult_t e = ncclSend(frame, kNcclFrameBytes, ncclUint8, 1, comm, s);
    if (e == ncclSuccess) e = ncclRecv(reply.p, kNcclFrameBytes, ncclUint8, 1, comm, s);
    return e;
  }));
  FrameBytes host;
  K3_CUDA_OK(cudaMemcpyAsync(host.data(), reply.p, kNcclFrameBytes, cudaMemcpyDeviceToHost, s));
  cudaEvent_t e;
  K3_CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  K3_CUDA_OK(cudaEventRecord(e, s));
  const absl::Status synced = m.link->Sync(e);
  cudaEventDestroy(e);
  K3_RETURN_IF_ERROR(synced);
  return DecodeStats(host);
}

const std::string& NcclRemoteExperts::node_id() const { return impl_->accepted.node_id; }
int64_t NcclRemoteExperts::max_rows() const { return impl_->accepted.max_rows; }

// ------------------------------------------------------------------------------- expert side

struct NcclExpertServer::Impl {
  struct Session {
    uint64_t id = 0;
    std::string client;
    std::unique_ptr<NcclLink> link;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  ModelConfig model;
  cuda::CudaExpertExecutor* experts = nullptr;
  Config config;
  NcclFrameLimits limits;
  cudaStream_t compute = nullptr;  // the experts, one dispatch at a time
  std::mutex compute_mu;

  std::mutex mu;
  std::map<uint64_t, std::unique_ptr<Session>> sessions;
  uint64_t next_session = 1;
  bool stopping = false;
  NcclExpertStats stats;  // all sessions, since the last kStats
  Clock::time_point stats_since = Clock::now();

  std::unique_ptr<NcclRendezvousServer> control;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
      for (auto& [id, s] : sessions) s->link->Fail(absl::UnavailableError("the expert node is shutting down"));
    }
    // The sessions end (their links failed), then the streams: the clients learn of it. In this order because a
    // session that ends tells its client why through the rendezvous server.
    for (auto& [id, s] : sessions) s->thread.join();
    control.reset();
    sessions.clear();
    if (compute) cudaStreamDestroy(compute);
  }

  absl::StatusOr<NcclAccepted> Open(const NcclOpenRequest& req) {
    std::unique_ptr<Session> s = std::make_unique<Session>();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return absl::UnavailableError("the expert node is shutting down");
      // Sessions whose thread is over are reaped here.
      for (auto it = sessions.begin(); it != sessions.end();) {
        if (it->second->done) {
          it->second->thread.join();
          it = sessions.erase(it);
        } else {
          ++it;
        }
      }
      s->id = next_session++;
    }
    s->client = absl::StrCat(req.client_id, " (device ", req.client_device, ")");
    K3_ASSIGN_OR_RETURN(s->link, NcclLink::Start(req.unique_id, /*rank=*/1, config.device, s->client));
    Session* raw = s.get();
    const uint64_t id = s->id;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) return absl::UnavailableError("the expert node is shutting down");
      sessions[id] = std::move(s);
      raw->thread = std::thread(&Impl::Serve, this, raw);
    }
    return NcclAccepted{config.node_id, config.device, id, config.max_rows};
  }

  void Closed(uint64_t session, const absl::Status& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = sessions.find(session); it != sessions.end()) it->second->link->Fail(why);
  }

  void Serve(Session* s) {
    const absl::Status why = ServeLoop(*s);
    if (!why.ok() && why.code() != absl::StatusCode::kCancelled) {
      std::fprintf(stderr, "nccl expert %s: session %lu with %s ended: %s\n", config.node_id.c_str(),
                   static_cast<unsigned long>(s->id), s->client.c_str(), std::string(why.message()).c_str());
      s->link->Fail(why);
      if (control) control->Close(s->id, why);  // the client hears why
    }
    s->done = true;
  }

  absl::Status ServeLoop(Session& s) {
    K3_CUDA_OK(cudaSetDevice(config.device));
    K3_RETURN_IF_ERROR(s.link->WaitReady(absl::Now() + config.options.connect_timeout));
    cudaStream_t stream;
    K3_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    struct Owned {
      NcclLink* link;
      cudaStream_t stream;
      std::vector<cudaEvent_t> events;
      std::byte* host = nullptr;
      ~Owned() {
        link->Fail(absl::CancelledError("session over"));  // nothing of it may still wait on the peer
        cudaStreamSynchronize(stream);
        for (cudaEvent_t e : events) cudaEventDestroy(e);
        cudaFreeHost(host);
        cudaStreamDestroy(stream);
      }
    } owned{s.link.get(), stream, {}, nullptr};
    cudaEvent_t framed, t0, t1, t2, t3;
    for (cudaEvent_t* e : {&framed, &t0, &t1, &t2, &t3}) {
      K3_CUDA_OK(cudaEventCreate(e));
      owned.events.push_back(*e);
    }
    K3_CUDA_OK(cudaMallocHost(&owned.host, kNcclFrameBytes));
    DeviceBuffer frame, x, idx, w, sums;
    K3_RETURN_IF_ERROR(frame.Reserve(kNcclFrameBytes));
    const auto forever = absl::InfiniteDuration();  // between dispatches the attention node may idle
    bool timed = false;  // the last dispatch's events wait to be read
    while (true) {
      K3_RETURN_IF_ERROR(s.link->Enqueue(stream, forever, [&](ncclComm_t comm) {
        return ncclRecv(frame.p, kNcclFrameBytes, ncclUint8, 0, comm, stream);
      }));
      K3_CUDA_OK(cudaMemcpyAsync(owned.host, frame.p, kNcclFrameBytes, cudaMemcpyDeviceToHost, stream));
      K3_CUDA_OK(cudaEventRecord(framed, stream));
      K3_RETURN_IF_ERROR(s.link->Sync(framed));
      if (timed) {  // the frame came after the last dispatch's sums left: its events are complete
        float recv_ms = 0, experts_ms = 0, send_ms = 0;
        cudaEventElapsedTime(&recv_ms, t0, t1);
        cudaEventElapsedTime(&experts_ms, t1, t2);
        cudaEventElapsedTime(&send_ms, t2, t3);
        std::lock_guard<std::mutex> lock(mu);
        stats.recv_ms += recv_ms, stats.experts_ms += experts_ms, stats.send_ms += send_ms;
        timed = false;
      }
      K3_ASSIGN_OR_RETURN(const NcclFrame f, DecodeFrame(std::span(owned.host, kNcclFrameBytes), limits));
      if (f.kind == NcclFrameKind::kClose) return absl::CancelledError("closed by the client");
      if (f.kind == NcclFrameKind::kStats) {
        NcclExpertStats out;
        {
          std::lock_guard<std::mutex> lock(mu);
          out = stats;
          out.wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - stats_since).count();
          stats = {};
          stats_since = Clock::now();
        }
        const FrameBytes bytes = EncodeStats(out);
        std::memcpy(owned.host, bytes.data(), kNcclFrameBytes);
        K3_CUDA_OK(cudaMemcpyAsync(frame.p, owned.host, kNcclFrameBytes, cudaMemcpyHostToDevice, stream));
        K3_RETURN_IF_ERROR(s.link->Enqueue(stream, config.options.dispatch_timeout, [&](ncclComm_t comm) {
          return ncclSend(frame.p, kNcclFrameBytes, ncclUint8, 0, comm, stream);
        }));
        K3_CUDA_OK(cudaEventRecord(framed, stream));  // the host slot is reused by the next frame
        K3_RETURN_IF_ERROR(s.link->Sync(framed));
        continue;
      }
      if (model.mlp[f.layer] != Mlp::kMoe)
        return absl::InvalidArgumentError(absl::StrCat("frame.layer: layer ", f.layer, " has no routed experts"));
      const NcclPayload p = PayloadOf(f);
      K3_RETURN_IF_ERROR(x.Reserve(2 * p.x_plane));
      K3_RETURN_IF_ERROR(idx.Reserve(p.idx));
      K3_RETURN_IF_ERROR(w.Reserve(p.w));
      K3_RETURN_IF_ERROR(sums.Reserve(p.sums));
      std::byte* xb = static_cast<std::byte*>(x.p);
      K3_CUDA_OK(cudaEventRecord(t0, stream));
      K3_RETURN_IF_ERROR(s.link->Enqueue(stream, config.options.dispatch_timeout, [&](ncclComm_t comm) {
        ncclResult_t e = ncclRecv(xb, p.x_plane, ncclUint8, 0, comm, stream);
        if (e == ncclSuccess) e = ncclRecv(xb + p.x_plane, p.x_plane, ncclUint8, 0, comm, stream);
        if (e == ncclSuccess) e = ncclRecv(idx.p, p.idx, ncclUint8, 0, comm, stream);
        if (e == ncclSuccess) e = ncclRecv(w.p, p.w, ncclUint8, 0, comm, stream);
        return e;
      }));
      K3_CUDA_OK(cudaEventRecord(t1, stream));
      {
        // One compute stream for every session: the executor's workspace is shared.
        std::lock_guard<std::mutex> lock(compute_mu);
        K3_CUDA_OK(cudaStreamWaitEvent(compute, t1));
        cuda::CudaExpertRequest req;
        req.layer = f.layer, req.rows = f.rows, req.width = f.width, req.top_k = f.top_k;
        req.x = cuda::Split{static_cast<__nv_bfloat16*>(x.p), f.width, f.rows * f.width};
        req.idx = static_cast<const int32_t*>(idx.p);
        req.w = static_cast<const float*>(w.p);
        K3_RETURN_IF_ERROR(experts->Run(req, static_cast<float*>(sums.p), compute));
        K3_CUDA_OK(cudaEventRecord(t2, compute));
      }
      K3_CUDA_OK(cudaStreamWaitEvent(stream, t2));
      K3_RETURN_IF_ERROR(s.link->Enqueue(stream, config.options.dispatch_timeout, [&](ncclComm_t comm) {
        return ncclSend(sums.p, p.sums, ncclUint8, 0, comm, stream);
      }));
      K3_CUDA_OK(cudaEventRecord(t3, stream));
      timed = true;
      std::lock_guard<std::mutex> lock(mu);
      ++stats.dispatches;
      stats.bytes_in += static_cast<int64_t>(p.out());
      stats.bytes_out += static_cast<int64_t>(p.sums);
    }
  }
};

NcclExpertServer::NcclExpertServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclExpertServer::~NcclExpertServer() = default;

absl::StatusOr<std::unique_ptr<NcclExpertServer>> NcclExpertServer::Start(const ModelConfig& model,
                                                                          cuda::CudaExpertExecutor& experts,
                                                                          const Config& config) {
  DisableNvlinkMulticast();
  if (config.max_rows < 1)
    return absl::InvalidArgumentError(absl::StrCat("max_rows: ", config.max_rows, ", want at least 1"));
  K3_CUDA_OK(cudaSetDevice(config.device));
  auto m = std::make_unique<Impl>();
  m->model = model;
  m->experts = &experts;
  m->config = config;
  m->limits = NcclFrameLimits{.num_layers = model.num_layers, .width = model.expert_width(), .top_k = model.top_k,
                              .max_rows = config.max_rows};
  K3_CUDA_OK(cudaStreamCreateWithFlags(&m->compute, cudaStreamNonBlocking));
  Impl* raw = m.get();
  K3_ASSIGN_OR_RETURN(m->control, NcclRendezvousServer::Start(
                                      config.address, [raw](const NcclOpenRequest& r) { return raw->Open(r); },
                                      [raw](uint64_t s, const absl::Status& why) { raw->Closed(s, why); }));
  return std::unique_ptr<NcclExpertServer>(new NcclExpertServer(std::move(m)));
}

const std::string& NcclExpertServer::address() const { return impl_->control->address(); }

int NcclExpertServer::sessions() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  int n = 0;
  for (const auto& [id, s] : impl_->sessions) n += !s->done;
  return n;
}

}  // namespace k3::dataplane
