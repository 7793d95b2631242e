// k3serve-dataplane-echo [host:port [ucx|shm]]: a data-plane server that sends every message back on the
// connection it came from. Prints "listening on <host:port>" on stdout (UCX may log there too), then
// runs until SIGTERM or SIGINT, or until its parent exits: it is a test peer in another process
// (the transport tests kill it), not a service.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string_view>

#include "router/shm_transport.h"
#include "router/ucx_transport.h"

using namespace k3::dataplane;

int main(int argc, char** argv) {
  const std::string address = argc > 1 ? argv[1] : "127.0.0.1:0";
  const pid_t parent = getppid();
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) return 0;  // the parent died before prctl
  signal(SIGPIPE, SIG_IGN);            // a reader of our stdout may go away once it has the address
  // Block the stop signals in every thread (the transport's included) and take them with sigwait.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  const bool shm = argc > 2 && std::string_view(argv[2]) == "shm";
  auto transport = shm ? NewShmTransport() : NewUcxTransport();
  if (!transport.ok()) {
    std::fprintf(stderr, "%s\n", transport.status().ToString().c_str());
    return 1;
  }
  std::atomic<Server*> server{nullptr};
  auto listening = (*transport)->Listen(
      address, {.on_message =
                    [&server](ConnectionId from, Buffer msg) {
                      if (Server* s = server.load()) s->Send(from, std::move(msg), [](absl::Status) {});
                    }});
  if (!listening.ok()) {
    std::fprintf(stderr, "%s\n", listening.status().ToString().c_str());
    return 1;
  }
  server = listening->get();
  std::printf("listening on %s\n", (*listening)->address().c_str());
  std::fflush(stdout);

  int signal = 0;
  sigwait(&stop, &signal);
  server = nullptr;
  listening->reset();
  return 0;
}
