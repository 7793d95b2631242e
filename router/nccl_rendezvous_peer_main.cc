// k3serve-nccl-rendezvous-peer: one side of the NCCL data plane's control plane and nothing else (no
// CUDA), for the tests of what a SIGKILLed peer looks like (nccl_rendezvous_test).
//   --listen 127.0.0.1:0    serve NcclBootstrap, accept every Open; prints "listening on HOST:PORT"
//   --connect HOST:PORT     open one session; prints "open SESSION", then holds it
// Either way it runs until killed.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "router/nccl_rendezvous.h"

int main(int argc, char** argv) {
  using namespace k3::dataplane;
  if (argc != 3 || (std::string(argv[1]) != "--listen" && std::string(argv[1]) != "--connect")) {
    std::fprintf(stderr, "usage: %s --listen HOST:PORT | --connect HOST:PORT\n", argv[0]);
    return 2;
  }
  std::unique_ptr<NcclRendezvousServer> server;
  std::unique_ptr<NcclRendezvousClient> client;
  if (std::string(argv[1]) == "--listen") {
    uint64_t next = 1;
    auto s = NcclRendezvousServer::Start(
        argv[2], [&](const NcclOpenRequest&) -> absl::StatusOr<NcclAccepted> { return NcclAccepted{"peer", 0, next++, 64}; },
        [](uint64_t, const absl::Status&) {});
    if (!s.ok()) return std::fprintf(stderr, "%s\n", s.status().ToString().c_str()), 1;
    server = std::move(*s);
    std::printf("listening on %s\n", server->address().c_str());
  } else {
    auto c = NcclRendezvousClient::Open(argv[2], {std::string(kNcclUniqueIdBytes, 'p'), "peer", 0}, absl::Seconds(10),
                                        nullptr);
    if (!c.ok()) return std::fprintf(stderr, "%s\n", c.status().ToString().c_str()), 1;
    client = std::move(*c);
    std::printf("open %lu\n", static_cast<unsigned long>(client->accepted().session));
  }
  std::fflush(stdout);
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}
