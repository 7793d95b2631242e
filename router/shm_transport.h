// The shared-memory implementation of the data-plane transport, for processes on one host.
//
// Each connection is a mapping of its own (shm_open, created by the client and unlinked as soon as
// the server has mapped it) holding two single-producer rings, client to server and back; messages
// are copied into the ring by the sending thread itself and out of it by the receiver's progress
// thread (router/wire.h's RingReader, which trusts nothing the peer wrote). Beside the mapping a TCP
// connection to the server's port carries the hello, and is how a dead peer is noticed: the kernel
// closes a killed process's sockets, so the other side reads EOF within milliseconds (1 ms while
// busy, 10 ms when idle).
//
// Addresses are "shm://host:port" (the "shm://" is optional when connecting). The server must be on
// this host and share /dev/shm with the client; otherwise it refuses the hello and the client
// reports UNAVAILABLE. Across hosts use the UCX transport (router/ucx_transport.h), which takes
// UCX_TLS / UCX_NET_DEVICES from the environment; NewSchemeTransport picks per address.
//
// Threading as router/transport.h says; one progress thread per transport polls the rings while
// busy and, when idle, sleeps on a futex word in each incoming ring (futex_waitv, Linux 5.16+) that
// a sender bumps and wakes only then. If the process is killed between creating a mapping and the
// server's ack, its /dev/shm/k3serve-dp-* file stays behind.
#pragma once

#include <chrono>
#include <memory>

#include "router/transport.h"

namespace k3::dataplane {

struct ShmOptions {
  size_t ring_bytes = 2 << 20;  // per direction; a power of two; longer messages stream through
  uint32_t max_message = 1u << 30;
  // As UcxOptions::spin: poll this long after the last piece of work before sleeping. Negative:
  // 200 us on a machine with more than 4 CPUs, else 0 — where the busy threads outnumber the cores
  // a poller only takes a core from them (on the 2-core dev box, spinning 200 us doubled the round
  // trip's overhead: 156-364 us against 170-186 us without).
  std::chrono::microseconds spin{-1};
  std::chrono::milliseconds connect_timeout{5000};
};

absl::StatusOr<std::unique_ptr<Transport>> NewShmTransport(const ShmOptions& options = {});

inline constexpr char kShmScheme[] = "shm://";

// Addresses that start with "shm://" go to `shm`, the others to `other`; both are owned.
std::unique_ptr<Transport> NewSchemeTransport(std::unique_ptr<Transport> shm, std::unique_ptr<Transport> other);

}  // namespace k3::dataplane
