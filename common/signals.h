// Graceful shutdown: SIGTERM / SIGINT set a flag that the service's main loop waits on.
#pragma once

#include "absl/time/time.h"

namespace k3 {

// Installs the handlers (call once, early in main).
void InstallShutdownSignals();
// True once SIGTERM or SIGINT arrived.
bool ShutdownRequested();
// Sleeps until a shutdown signal or the timeout; returns ShutdownRequested().
bool WaitForShutdown(absl::Duration timeout);

}  // namespace k3
