// One thread that runs admin tasks in order. A layer load reads files and materialises forms
// (seconds for a large layer); doing that on a gRPC callback thread would stall other calls.
// The queue is bounded, a task whose caller's deadline passed while it waited is not run, and
// tasks still waiting at shutdown are answered UNAVAILABLE, so a slow load never holds up a
// drain by more than itself.
// Thread-safety: every member may be called from any thread at once; tasks run on the
// worker's own thread, one at a time.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"

namespace attnserve {

class AdminWorker {
 public:
  struct Task {
    std::function<void()> run;
    std::function<void(Status)> refuse;  // answers the call without running it
    std::chrono::steady_clock::time_point deadline;
  };

  explicit AdminWorker(int capacity);
  // Answers the tasks still waiting UNAVAILABLE, then waits for the running one.
  ~AdminWorker();
  // False when the queue is full (the caller answers RESOURCE_EXHAUSTED).
  bool Post(Task task);
  int capacity() const { return capacity_; }

  // Answers every waiting task and the running one UNAVAILABLE (the running one goes on, but
  // its answer is dropped): at shutdown, so that gRPC's Wait does not wait for a slow load.
  void AbandonAll();

  // Waits until no task runs or waits, or until `until`; false when one still runs then.
  bool WaitIdle(std::chrono::steady_clock::time_point until);

 private:
  void Run();

  const int capacity_;
  Mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Task> tasks_ ATTNSERVE_GUARDED_BY(mu_);
  bool running_ ATTNSERVE_GUARDED_BY(mu_) = false;                        // a task is running
  std::function<void(Status)> running_refuse_ ATTNSERVE_GUARDED_BY(mu_);  // the running task's refuse
  bool stopping_ ATTNSERVE_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attnserve
