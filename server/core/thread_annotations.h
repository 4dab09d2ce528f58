// Lock annotations the compiler checks (clang's -Wthread-safety; no-ops under GCC), and the
// mutex types that carry them. A member written `T x_ ATTNSERVE_GUARDED_BY(mu_);` may only be
// touched with mu_ held, and a function marked `ATTNSERVE_REQUIRES(mu_)` only called so; clang
// proves both at compile time (scripts/check-thread-safety, run by the test command), where a
// `// guarded by mu_` comment only asked the reader to.
//
// std::mutex carries no annotations in libstdc++, so the guarded classes use Mutex and
// MutexLock (SharedMutex, ReaderLock and WriterLock for a shared lock). A std::condition_variable
// waits on MutexLock::native(); the analysis treats the lock as held across the wait, as it is
// whenever the wait returns.
#pragma once

#include <mutex>
#include <shared_mutex>

#include "server/core/spin.h"

#if defined(__clang__)
#define ATTNSERVE_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define ATTNSERVE_THREAD_ANNOTATION(x)
#endif

#define ATTNSERVE_CAPABILITY(x) ATTNSERVE_THREAD_ANNOTATION(capability(x))
#define ATTNSERVE_SCOPED_CAPABILITY ATTNSERVE_THREAD_ANNOTATION(scoped_lockable)
#define ATTNSERVE_GUARDED_BY(x) ATTNSERVE_THREAD_ANNOTATION(guarded_by(x))
#define ATTNSERVE_PT_GUARDED_BY(x) ATTNSERVE_THREAD_ANNOTATION(pt_guarded_by(x))
#define ATTNSERVE_REQUIRES(...) ATTNSERVE_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ATTNSERVE_REQUIRES_SHARED(...) ATTNSERVE_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
#define ATTNSERVE_ACQUIRE(...) ATTNSERVE_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ATTNSERVE_ACQUIRE_SHARED(...) ATTNSERVE_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define ATTNSERVE_RELEASE(...) ATTNSERVE_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define ATTNSERVE_RELEASE_SHARED(...) ATTNSERVE_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define ATTNSERVE_RELEASE_GENERIC(...) ATTNSERVE_THREAD_ANNOTATION(release_generic_capability(__VA_ARGS__))
#define ATTNSERVE_EXCLUDES(...) ATTNSERVE_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ATTNSERVE_RETURN_CAPABILITY(x) ATTNSERVE_THREAD_ANNOTATION(lock_returned(x))

namespace attnserve {

// A std::mutex the analysis knows as a capability.
class ATTNSERVE_CAPABILITY("mutex") Mutex {
 public:
  void Lock() ATTNSERVE_ACQUIRE() { mu_.lock(); }
  void Unlock() ATTNSERVE_RELEASE() { mu_.unlock(); }
  // Tells the analysis the caller holds the lock (a lambda run under it, a callback); checks nothing.
  void AssertHeld() const ATTNSERVE_THREAD_ANNOTATION(assert_capability(this)) {}
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope, like std::unique_lock: Unlock() and Lock() release and retake it
// in between (a batch runs without the queue's lock).
class ATTNSERVE_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ATTNSERVE_ACQUIRE(mu) : lock_(mu.native()) {}
  ~MutexLock() ATTNSERVE_RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() ATTNSERVE_RELEASE() { lock_.unlock(); }
  void Lock() ATTNSERVE_ACQUIRE() { lock_.lock(); }
  // Lock(), after polling for the lock up to `polls` times (a PAUSE between): for a thread that
  // has just seen, spinning, news published under this lock, whose publisher still holds it for
  // the few hundred ns it takes to finish. std::mutex would block at once, and the publisher's
  // unlock would then have to wake it through a futex, on a VM whose vCPU may have halted
  // meanwhile (docs/journal/benchmarks-journal.md, "OnDone without the executor, and the queue's lock taken
  // spinning": a lone call's overhead over the floor 51 → 42 µs).
  // Returns whether a poll took it (false: it blocked).
  bool LockSpinning(int polls) ATTNSERVE_ACQUIRE() {
    for (int i = 0; i < polls; ++i) {
      if (lock_.try_lock()) return true;
      CpuRelax();
    }
    lock_.lock();
    return false;
  }
  // What std::condition_variable waits with.
  std::unique_lock<std::mutex>& native() { return lock_; }

 private:
  std::unique_lock<std::mutex> lock_;
};

// A std::shared_mutex the analysis knows: many readers or one writer.
class ATTNSERVE_CAPABILITY("shared mutex") SharedMutex {
 public:
  void Lock() ATTNSERVE_ACQUIRE() { mu_.lock(); }
  void Unlock() ATTNSERVE_RELEASE() { mu_.unlock(); }
  void LockShared() ATTNSERVE_ACQUIRE_SHARED() { mu_.lock_shared(); }
  void UnlockShared() ATTNSERVE_RELEASE_SHARED() { mu_.unlock_shared(); }

 private:
  std::shared_mutex mu_;
};

class ATTNSERVE_SCOPED_CAPABILITY ReaderLock {
 public:
  explicit ReaderLock(SharedMutex& mu) ATTNSERVE_ACQUIRE_SHARED(mu) : mu_(mu) { mu_.LockShared(); }
  ~ReaderLock() ATTNSERVE_RELEASE() { mu_.UnlockShared(); }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  SharedMutex& mu_;
};

class ATTNSERVE_SCOPED_CAPABILITY WriterLock {
 public:
  explicit WriterLock(SharedMutex& mu) ATTNSERVE_ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~WriterLock() ATTNSERVE_RELEASE() { mu_.Unlock(); }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  SharedMutex& mu_;
};

}  // namespace attnserve
