// Where the pools' replicas live: processes on this machine (local) or a Kubernetes Deployment
// (attention) and StatefulSet (experts).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/status.h"
#include "orchestrator/controller.h"

namespace k3::orchestrator {

struct Replica {
  std::string name;
  std::string address;  // gRPC host:port, once known
  int64_t pid = 0;      // local processes
  bool ready = false;
  bool draining = false;
  int restarts = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Moves the pool towards `replicas` without blocking: starts replicas, drains surplus ones
  // (SIGTERM: an attention node finishes its streams, an expert node leaves the placement first),
  // restarts or reports crashed ones.
  virtual absl::Status Apply(Pool pool, int replicas) = 0;
  // The pool's replicas now, draining ones included.
  virtual absl::StatusOr<std::vector<Replica>> List(Pool pool) = 0;
  // Called when a drained replica has exited, with how long its drain took.
  std::function<void(Pool, absl::Duration)> on_drained;
};

}  // namespace k3::orchestrator
