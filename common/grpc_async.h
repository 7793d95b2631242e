// Pieces of the completion-queue loops that serve streams (the attention node's Generate and Multiplex, the
// gateway): tags that say what to do once an operation completes, and a server stream's coalesced writes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <optional>

namespace k3 {

// A completion-queue tag: what to do once its operation completes (`ok` as Next says).
struct CqEvent {
  virtual ~CqEvent() = default;
  virtual void Done(bool ok) = 0;
};

template <class T>
struct CqOn final : CqEvent {
  CqOn(T* self, void (T::*fn)(bool)) : self(self), fn(fn) {}
  void Done(bool ok) override { (self->*fn)(ok); }
  T* self;
  void (T::*fn)(bool);
};

// A server stream's writes, one in flight: what arrives meanwhile is merged into `pending` by the caller
// (has_pending set) and goes out with the next write; the status goes once the writes before it are through.
template <class Msg>
struct CoalescedWrites {
  Msg pending, writing_msg;
  bool has_pending = false, writing = false, finishing = false;
  std::optional<grpc::Status> end;

  // The next write (unless `send` is false: the client is gone), or the finish.
  template <class Writer>
  void Flush(Writer& writer, bool send, CqEvent* wrote, CqEvent* finished) {
    if (finishing || writing) return;
    if (has_pending && send) {
      writing_msg.Swap(&pending);
      pending.Clear();
      has_pending = false;
      writing = true;
      writer.Write(writing_msg, wrote);
      return;
    }
    if (end) {
      finishing = true;
      writer.Finish(*end, finished);
    }
  }
};

}  // namespace k3
