#include "common/service.h"

#include <malloc.h>

#include <cstdio>

#include "absl/synchronization/mutex.h"
#include "common/signals.h"

namespace k3 {

void InitServiceProcess() {
  InstallShutdownSignals();
  // gRPC's locks are absl::Mutex, and Debian's abseil is built with deadlock detection on: a graph update and a
  // stack trace on each lock, ≈ 3% of a loop thread's CPU (the gateway's, measured).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  mallopt(M_MMAP_THRESHOLD, 128 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsServer(const std::string& host, int port,
                                                               const metrics::Registry& registry) {
  if (port < 0) return std::unique_ptr<HttpServer>();
  K3_ASSIGN_OR_RETURN(auto server, HttpServer::Start({.host = host, .port = port}));
  server->HandleMetrics(registry);
  return server;
}

void WriteReadyFile(const std::string& path, const std::string& line) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  if (FILE* f = std::fopen(tmp.c_str(), "w")) {
    std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
    std::rename(tmp.c_str(), path.c_str());  // readers never see a half-written file
  }
}

}  // namespace k3
