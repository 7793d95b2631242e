// The data-plane transport: opaque messages between attention nodes (clients) and expert nodes
// (servers). Byte-oriented on purpose; the message format is router/wire.h. One implementation is
// UCX (router/ucx_transport.h); an NCCL one (GPU to GPU) is meant to follow behind the same
// interface.
//
// Threading: Send may be called from any thread, including from inside a callback. Every callback
// (messages, send completions, failures) runs on the transport's single progress thread, except that
// a client connection's messages may also be delivered by Connection::Poll on the thread calling it;
// one connection's on_message calls never overlap. A callback must not block: hand heavy work to
// another thread. Connect, Listen and the destructors
// of Connection and Server must not be called from a callback; they return (or die with a message)
// rather than deadlock. Connections and servers must be destroyed before their transport.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "absl/functional/any_invocable.h"
#include "common/status.h"

namespace k3::dataplane {

namespace detail {

// Recycles message memory by power-of-two size class (64 B to 64 MiB, a few blocks each), so that
// steady traffic allocates nothing per message; larger blocks go straight to the heap.
class BufferPool {
 public:
  static constexpr int kMinShift = 6, kMaxShift = 26, kPerClass = 16;

  // A block of at least `size` bytes; *capacity says how many.
  static std::byte* Take(size_t size, size_t* capacity) {
    const int shift = std::max(kMinShift, static_cast<int>(std::bit_width(size - 1)));
    if (shift > kMaxShift) {
      *capacity = size;
      return new std::byte[size];
    }
    *capacity = size_t{1} << shift;
    Class& c = Instance().classes_[shift - kMinShift];
    {
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.n > 0) return c.free[--c.n];
    }
    return new std::byte[*capacity];
  }
  static void Give(std::byte* p, size_t capacity) {
    const int shift = static_cast<int>(std::bit_width(capacity - 1));
    if (capacity == (size_t{1} << shift) && shift >= kMinShift && shift <= kMaxShift) {
      Class& c = Instance().classes_[shift - kMinShift];
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.n < kPerClass) {
        c.free[c.n++] = p;
        return;
      }
    }
    delete[] p;
  }

 private:
  struct Class {
    std::mutex mu;
    int n = 0;
    std::byte* free[kPerClass];
  };
  static BufferPool& Instance() {
    static BufferPool* pool = new BufferPool;  // never destroyed: buffers may outlive static destructors
    return *pool;
  }
  Class classes_[kMaxShift - kMinShift + 1];
};

struct PoolDeleter {
  size_t capacity = 0;
  void operator()(std::byte* p) const { BufferPool::Give(p, capacity); }
};

}  // namespace detail

// One owned message, its memory from detail::BufferPool. The bytes are not zero-filled on
// allocation: messages are up to many MiB and always written in full (by the codec, or by the
// transport on receive).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t size) : size_(size) {
    if (size == 0) return;
    size_t capacity = 0;
    std::byte* p = detail::BufferPool::Take(size, &capacity);
    data_ = std::unique_ptr<std::byte[], detail::PoolDeleter>(p, detail::PoolDeleter{capacity});
  }

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  std::span<std::byte> span() { return {data_.get(), size_}; }
  std::span<const std::byte> span() const { return {data_.get(), size_}; }

 private:
  std::unique_ptr<std::byte[], detail::PoolDeleter> data_;
  size_t size_ = 0;
};

// Runs once when a Send is over: OK when the message has left (the buffer is released), else why
// it was not delivered: UNAVAILABLE (peer failed, connection closed), CANCELLED (closed locally).
using SendDone = absl::AnyInvocable<void(absl::Status)>;

// ---- client side: one connection to one expert node ----

// Callbacks left empty are not called.
struct ClientCallbacks {
  std::function<void(Buffer msg)> on_message = nullptr;  // a message from the server
  // The connection is dead (peer crashed or closed, unreachable, ...). Runs at most once; sends
  // that were in flight complete with an error, later ones fail at once.
  std::function<void(absl::Status why)> on_failure = nullptr;
};

class Connection {
 public:
  // Closes the connection. Sends still in flight complete (with CANCELLED) before it returns, and
  // no callback of this connection runs afterwards.
  virtual ~Connection() = default;
  virtual void Send(Buffer msg, SendDone done) = 0;
  // Polling, for a thread that waits for a reply and would take it the moment it lands rather than
  // after the progress thread has been woken for it. Between BeginPoll and EndPoll the progress thread
  // leaves this connection's messages to Poll, which delivers those that have arrived on the calling
  // thread (its on_message runs there) and says whether there were any; EndPoll delivers what is left
  // and hands the connection back. Every BeginPoll needs its EndPoll, before the connection is
  // destroyed. Not from this connection's own callbacks. A transport that cannot (can_poll() false)
  // delivers everything on its progress thread.
  virtual bool can_poll() const { return false; }
  virtual void BeginPoll() {}
  virtual bool Poll() { return false; }
  virtual void EndPoll() {}
  virtual const std::string& address() const = 0;  // the server's address as given to Connect
};

// ---- server side: accepts connections from any number of clients ----

using ConnectionId = uint64_t;  // unique within one server, never reused

struct ServerCallbacks {
  std::function<void(ConnectionId from, Buffer msg)> on_message = nullptr;
  // A client connection is gone (closed by the client, or the client failed). Its id is dead.
  std::function<void(ConnectionId conn, absl::Status why)> on_closed = nullptr;
};

class Server {
 public:
  // Stops listening and closes every connection; as for Connection, sends in flight complete and no
  // callback runs after it returns.
  virtual ~Server() = default;
  // Sends on a connection that this server accepted (the reply path). NOT_FOUND if it is closed.
  virtual void Send(ConnectionId to, Buffer msg, SendDone done) = 0;
  // Closes one accepted connection (a client that failed the handshake); no callback of it runs
  // afterwards. Safe from a callback. A transport that cannot close one connection leaves it
  // open: the caller ignores its messages either way.
  virtual void Close(ConnectionId /*conn*/) {}
  // The bound address as "host:port" (the real port when 0 was asked): what clients Connect to.
  virtual const std::string& address() const = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Starts connecting to a server at "host:port". Returns at once; if the server cannot be reached,
  // on_failure reports it. InvalidArgument for an address that does not parse or resolve.
  virtual absl::StatusOr<std::unique_ptr<Connection>> Connect(const std::string& address,
                                                              ClientCallbacks callbacks) = 0;
  // Listens on "host:port"; port 0 picks a free one (see Server::address).
  virtual absl::StatusOr<std::unique_ptr<Server>> Listen(const std::string& address,
                                                         ServerCallbacks callbacks) = 0;
};

}  // namespace k3::dataplane
