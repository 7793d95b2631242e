// Process plumbing shared by the service binaries: signals and allocator setup, the /metrics
// server, and the ready file that tells a launcher which ports were bound.
#pragma once

#include <memory>
#include <string>

#include "common/http_server.h"
#include "common/metrics.h"

namespace k3 {

// SIGTERM/SIGINT handlers, malloc settings that keep multi-MiB data-plane messages out of
// mmap/munmap (a fresh mapping per message costs page faults on every send and receive), and abseil's
// mutex deadlock detection off.
void InitServiceProcess();

// Serves registry on host:port at /metrics; port 0 picks one, a negative port means no server.
absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsServer(const std::string& host, int port,
                                                               const metrics::Registry& registry);

// Writes `line` + "\n" to path (if path is not empty): how `k3serve up` and the tests learn the
// ports a node bound.
void WriteReadyFile(const std::string& path, const std::string& line);

}  // namespace k3
