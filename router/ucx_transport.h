// The UCX implementation of the data-plane transport: ucp active messages, with rendezvous for large
// messages (UCX picks the protocol by size; a 64 MiB message is tested). One ucp context + worker
// per transport, driven by one progress thread that polls while busy and sleeps on the worker's
// event fd when idle (no measurable CPU when idle).
//
// Endpoints use UCP_ERR_HANDLING_MODE_PEER, so that a dead peer fails its endpoint: a SIGKILLed peer
// on this host is reported within ~10 ms (its TCP connection breaks), sends in flight to it fail.
//
// Configuration: UCX's own defaults and UCX_* environment variables; nothing needs setting in a
// container or on one host. What UCX 1.13 (Debian 12) does with them, measured here:
// - PEER mode admits only transports that detect peer failure, which excludes shared memory
//   (posix/sysv) and leaves CMA unused, so between processes on one host the traffic runs over TCP
//   loopback (lanes tcp/lo + tcp/eth0, keepalive on tcp): ~20-30 µs round trips and 1-2 GB/s at
//   1 MiB on the shared 2-core dev box, not the 0.33 µs / 9-15 GB/s that shared memory reaches
//   without error handling. In a cluster, RDMA transports do detect peer failure and are picked.
//   Between processes on one host the data plane uses router/shm_transport.h instead (its own rings
//   in a shared mapping, a dead peer seen through a TCP control connection).
// - Across hosts, UCX_TLS (e.g. rc,tcp) and UCX_NET_DEVICES (e.g. mlx5_0:1) pass through from the
//   environment of k3serve-attention and k3serve-expert; unset, UCX picks RDMA verbs where there
//   are any, else TCP.
// - Do not set UCX_MM_ERROR_HANDLING=y (which makes shared memory eligible) or UCX_PROTO_ENABLE=y
//   with UCX 1.13: the active-message path over shared memory then drops messages ("Invalid
//   am_short_iov length") or asserts. Error mode NONE (shared memory) has the same bugs here.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "router/transport.h"

namespace k3::dataplane {

struct UcxOptions {
  // After its last piece of work the progress thread keeps polling this long (yielding the CPU to
  // any other runnable thread) before it arms the worker and sleeps: a message arriving meanwhile
  // costs no wake-up, and an idle transport costs no CPU.
  std::chrono::microseconds spin{200};
  // The address this process listens on (--host): UCX's devices are limited to the interface that
  // owns it, so that none of its sockets listens elsewhere. Empty or 0.0.0.0: every interface.
  std::string host;
};

absl::StatusOr<std::unique_ptr<Transport>> NewUcxTransport(const UcxOptions& options = {});

}  // namespace k3::dataplane
