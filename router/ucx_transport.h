// The UCX implementation of the data-plane transport (ucp active messages; rendezvous for large
// messages, so multi-MiB payloads move zero-copy where the transport allows, e.g. CMA on one host).
// One ucp context + worker per transport, driven by one progress thread that polls while busy and
// sleeps on the worker's event fd when idle.
#pragma once

#include <chrono>
#include <memory>

#include "router/transport.h"

namespace k3::dataplane {

struct UcxOptions {
  // After its last piece of work the progress thread keeps polling this long before it arms the
  // worker and sleeps: a message arriving meanwhile costs no wake-up (tens of µs), and an idle
  // transport costs no CPU.
  std::chrono::microseconds spin{200};
};

// Transport selection: UCX's own defaults apply, except that when UCX_TLS is not set the transports
// are restricted to ones that work in a container on one host and across hosts over TCP
// (see kDefaultTls in ucx_transport.cc). Any UCX_* environment variable still overrides.
absl::StatusOr<std::unique_ptr<Transport>> NewUcxTransport(const UcxOptions& options = {});

}  // namespace k3::dataplane
