#include "common/signals.h"

#include <signal.h>

#include <atomic>
#include <thread>

#include "absl/time/clock.h"

namespace k3 {
namespace {
std::atomic<bool> g_shutdown{false};
void OnSignal(int) { g_shutdown.store(true); }
}  // namespace

void InstallShutdownSignals() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

bool ShutdownRequested() { return g_shutdown.load(); }

bool WaitForShutdown(absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  // Polling in small steps: a signal handler may only touch the atomic.
  while (!g_shutdown.load() && absl::Now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return g_shutdown.load();
}

}  // namespace k3
