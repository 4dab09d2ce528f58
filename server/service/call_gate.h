// The drain's door for inference calls: counts the calls a service has accepted and, once
// closed, lets no new one in, so that SIGTERM can wait for exactly the accepted calls to be
// answered before gRPC's Shutdown closes the sockets (docs/architecture.md, the service).
// Thread-safety: every member may be called from any thread at once.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "server/core/thread_annotations.h"

namespace attnserve {

class CallGate {
 public:
  // An accepted call's place in the count; given back by Release or when it goes.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept : gate_(other.gate_) { other.gate_ = nullptr; }
    Ticket& operator=(Ticket&& other) noexcept {
      if (this != &other) {
        Release();
        gate_ = other.gate_;
        other.gate_ = nullptr;
      }
      return *this;
    }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket() { Release(); }

    // False for the empty ticket Enter gives once the gate is closed.
    explicit operator bool() const { return gate_ != nullptr; }
    // Called right after the call's answer is handed to gRPC.
    void Release() {
      if (gate_ != nullptr) gate_->Leave();
      gate_ = nullptr;
    }

   private:
    friend class CallGate;
    explicit Ticket(CallGate* gate) : gate_(gate) {}
    CallGate* gate_ = nullptr;
  };

  // A ticket for a new call, or an empty one once Close has run (answer it UNAVAILABLE).
  Ticket Enter() {
    MutexLock lock(mu_);
    if (closed_) return Ticket();
    ++open_;
    return Ticket(this);
  }

  // From now on Enter refuses.
  void Close() {
    MutexLock lock(mu_);
    closed_ = true;
  }

  // Whether Close has run (the server is draining): readiness answers false from then on.
  bool closed() {
    MutexLock lock(mu_);
    return closed_;
  }

  // Waits until every accepted call has been answered, or until `until`; false when some are
  // still open then.
  bool WaitIdle(std::chrono::steady_clock::time_point until) {
    MutexLock lock(mu_);
    return idle_cv_.wait_until(lock.native(), until, [this] {
      mu_.AssertHeld();  // the wait runs its predicate under the lock
      return open_ == 0;
    });
  }

  int open() const {
    MutexLock lock(mu_);
    return open_;
  }

 private:
  void Leave() {
    {
      MutexLock lock(mu_);
      if (--open_ > 0) return;
    }
    idle_cv_.notify_all();
  }

  mutable Mutex mu_;
  std::condition_variable idle_cv_;
  bool closed_ ATTNSERVE_GUARDED_BY(mu_) = false;
  int open_ ATTNSERVE_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve
