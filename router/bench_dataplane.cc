// k3serve-bench-dataplane [spin_us [ucx|shm]]: round-trip latency and throughput of the data plane
// between two processes on this host (the server is a forked child), over UCX (default) or the
// shared-memory transport. Prints figures; asserts nothing. spin_us sets the progress threads'
// spin on both sides.
// UCX_TLS selects the transports as usual, e.g. UCX_TLS=tcp,self for TCP loopback.
// DESIGN §7 anchors for this machine class: UCX 0.33 µs tag latency, 9-15 GB/s at 1 MiB on shared
// memory, TCP loopback 3.9 µs.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "router/shm_transport.h"
#include "router/ucx_transport.h"

using namespace k3::dataplane;
using Clock = std::chrono::steady_clock;

namespace {

// Replies with the message itself up to 4 KiB (latency), with an 8-byte ack above (throughput).
absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(bool shm, std::chrono::microseconds spin) {
  if (shm) {
    ShmOptions o;
    o.spin = spin;
    return NewShmTransport(o);
  }
  UcxOptions o;
  o.spin = spin;
  return NewUcxTransport(o);
}

[[noreturn]] void RunServer(int address_pipe, bool shm, std::chrono::microseconds spin) {
  auto transport = MakeTransport(shm, spin);
  if (!transport.ok()) {
    std::fprintf(stderr, "server: %s\n", transport.status().ToString().c_str());
    std::_Exit(1);
  }
  std::atomic<Server*> server{nullptr};
  auto on_message = [&server](ConnectionId from, Buffer msg) {
    Server* s = server.load();
    if (msg.size() <= 4096) {
      s->Send(from, std::move(msg), [](absl::Status) {});
    } else {
      Buffer ack(8);
      std::memcpy(ack.data(), msg.data(), 8);
      s->Send(from, std::move(ack), [](absl::Status) {});
    }
  };
  auto listening = (*transport)->Listen("127.0.0.1:0", {.on_message = on_message});
  if (!listening.ok()) {
    std::fprintf(stderr, "server: %s\n", listening.status().ToString().c_str());
    std::_Exit(1);
  }
  server = listening->get();
  const std::string address = (*listening)->address() + "\n";
  if (::write(address_pipe, address.data(), address.size()) < 0) std::_Exit(1);
  ::close(address_pipe);
  ::pause();  // until the parent kills us
  std::_Exit(0);
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

double CpuSeconds() {
  rusage r{};
  ::getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6;
}

}  // namespace

int main(int argc, char** argv) {
  const auto spin = std::chrono::microseconds(argc > 1 ? std::atoi(argv[1]) : 200);
  const bool shm = argc > 2 && std::string(argv[2]) == "shm";
  // Fork before any UCX state exists in this process.
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    RunServer(fds[1], shm, spin);
  }
  ::close(fds[1]);
  std::string address;
  char c;
  while (::read(fds[0], &c, 1) == 1 && c != '\n') address.push_back(c);
  ::close(fds[0]);

  const char* tls = std::getenv("UCX_TLS");
  std::printf("server %s (pid %d), %s, progress spin %lld us\n", address.c_str(), child,
              shm ? "shared memory" : absl::StrCat("UCX_TLS=", tls ? tls : "(default)").c_str(),
              static_cast<long long>(spin.count()));

  auto transport = MakeTransport(shm, spin);
  if (!transport.ok()) {
    std::fprintf(stderr, "%s\n", transport.status().ToString().c_str());
    return 1;
  }
  // Replies are counted; a callback may also chain the next send (callback-driven ping-pong).
  std::atomic<uint64_t> replies{0};
  std::function<void()> on_reply;
  auto connection = (*transport)->Connect(address, {.on_message = [&](Buffer) {
    if (on_reply) on_reply();
    replies.fetch_add(1, std::memory_order_release);
    replies.notify_all();
  }});
  if (!connection.ok()) {
    std::fprintf(stderr, "%s\n", connection.status().ToString().c_str());
    return 1;
  }
  Connection& conn = **connection;
  auto wait_for = [&](uint64_t n) {
    for (uint64_t seen = replies.load(std::memory_order_acquire); seen < n;
         seen = replies.load(std::memory_order_acquire)) {
      replies.wait(seen, std::memory_order_acquire);
    }
  };
  auto round_trip = [&](size_t size) {
    const uint64_t want = replies.load() + 1;
    conn.Send(Buffer(size), [](absl::Status) {});
    wait_for(want);
  };

  std::printf("latency (round trip; one way = half):\n");
  for (size_t size : {8, 64, 1024, 4096}) {
    for (int i = 0; i < 1000; ++i) round_trip(size);  // warm up
    // (a) the next message is sent from the reply callback, on the progress thread: the
    //     transport's own latency.
    constexpr int kIters = 20000;
    std::vector<Clock::time_point> stamps;
    stamps.reserve(kIters + 1);
    on_reply = [&] {
      stamps.push_back(Clock::now());
      if (stamps.size() <= kIters) conn.Send(Buffer(size), [](absl::Status) {});
    };
    const uint64_t base = replies.load();
    stamps.push_back(Clock::now());
    conn.Send(Buffer(size), [](absl::Status) {});
    wait_for(base + kIters);  // the first send plus kIters - 1 chained ones
    on_reply = nullptr;
    std::vector<double> rtt_us;
    for (size_t i = 1; i < stamps.size(); ++i)
      rtt_us.push_back(std::chrono::duration<double, std::micro>(stamps[i] - stamps[i - 1]).count());
    // (b) an application thread sends and sleeps until the reply (futex wake-up included).
    std::vector<double> app_us;
    for (int i = 0; i < kIters / 4; ++i) {
      const auto t0 = Clock::now();
      round_trip(size);
      app_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::printf("  %5zu B: from callback median %7.2f us p99 %7.2f us | "
                "from app thread median %7.2f us p99 %7.2f us\n",
                size, Percentile(rtt_us, 0.5), Percentile(rtt_us, 0.99), Percentile(app_us, 0.5),
                Percentile(app_us, 0.99));
  }

  // Throughput: a window of sends in flight, each acknowledged by the server.
  std::printf("throughput (one way, window of 8 in flight):\n");
  for (size_t size : {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20}) {
    const int window = 8;
    const int count = static_cast<int>(std::max<size_t>(64, (size_t{2} << 30) / size));
    const uint64_t base = replies.load();
    const auto t0 = Clock::now();
    for (int i = 0; i < count; ++i) {
      if (i >= window) wait_for(base + i - window + 1);
      // A fresh buffer per send, as the codec produces them; after the first rounds malloc hands
      // back the same (already mapped) memory. Its contents do not matter here.
      Buffer msg(size);
      std::memset(msg.data(), 0, 8);
      conn.Send(std::move(msg), [](absl::Status) {});
    }
    wait_for(base + count);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("  %8zu B x %5d: %6.2f GB/s (%8.1f us per message)\n", size, count,
                size * double(count) / s / 1e9, s / count * 1e6);
  }

  // Idle cost: both processes connected, nothing to do.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double cpu0 = CpuSeconds();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::printf("idle client process CPU: %.2f%% of one core\n", (CpuSeconds() - cpu0) * 100);

  connection->reset();
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  return 0;
}
