#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <thread>
#include <type_traits>
#include <vector>

#include "server/core/thread_annotations.h"

namespace attnserve {

// A team of compute threads: the thread that calls Run (a batch worker) and size() − 1 helper
// threads that stay with the team. The CPU backend computes on one; the CUDA backend packs and
// unpacks its staging copies on one (CudaBackendOptions::staging_threads). For the CPU backend
// it replaces OpenMP's parallel regions, so that the helpers' waiting follows a forward rather
// than a global spin count:
//   - while a forward holds the team (Hold … Release), a helper spins between the forward's
//     parallel steps, however far apart, and so starts each step at once;
//   - once the forward is over, it spins `idle_spin` more, then sleeps: the next forward, in a
//     loop or a lone client's request a round trip later, finds it awake on a vCPU that did not
//     go idle. This spin yields its core every turn (YieldToReadyThreads, core/spin.h), so it
//     takes no time from the server's gRPC threads, which meanwhile send the answer and take the
//     next request. (libgomp's helper spun without yielding, 170–250 µs after every forward at a
//     30000-turn spin count, and slowed them: docs/journal/benchmarks-journal.md, "The compute team".)
//   - Hold wakes a sleeping helper as the forward starts: its wake-up overlaps the forward's
//     serial set-up instead of delaying the first step.
// Run hands out tasks one at a time to whoever is free, the caller included, and returns once
// every task has run. A helper that arrives after the last task is taken does not join the
// step, and the caller does not wait for it: a helper still waking slows no step.
// A task that throws ends its step (no later task starts), and Run rethrows it once every member
// has left the step. One caller at a time: a second thread's forward takes another team (CpuBackend keeps a pool,
// one per concurrent caller, as OpenMP kept a team per calling thread). Run from inside a task
// (a nested step) runs on the calling thread alone, as member 0 of that step.
class ComputeTeam {
 public:
  ComputeTeam(int size, std::chrono::microseconds idle_spin);
  ~ComputeTeam();
  ComputeTeam(const ComputeTeam&) = delete;
  ComputeTeam& operator=(const ComputeTeam&) = delete;

  int size() const { return size_; }

  // A forward starts: helpers wake now and spin between its steps until Release.
  void Hold();
  void Release();

  // body(task, member) for every task in [0, tasks), spread over the team; member is in
  // [0, size()), 0 the caller, and no two tasks run on one member at once (per-member scratch).
  template <typename Body>
  void Run(int64_t tasks, Body&& body) {
    using B = std::remove_reference_t<Body>;
    RunTasks(tasks, [](void* b, int64_t task, int member) { (*static_cast<B*>(b))(task, member); },
             const_cast<void*>(static_cast<const void*>(&body)));
  }

  // Whether this thread is running a task of some team (a nested Run runs inline).
  static bool InTask();

 private:
  using Call = void (*)(void* body, int64_t task, int member);
  void RunTasks(int64_t tasks, Call call, void* body);
  void Work(int member);  // claims and runs tasks of the open step until none is left
  void Helper(int member);
  // Returns once the step after `seen` is published, or the team stops; spins, then sleeps.
  void WaitForStep(uint32_t seen);
  void WakeSleepers();

  const int size_;
  const std::chrono::microseconds idle_spin_;

  // The step: [epoch:32][open:1][members in it:31]. Run publishes a new epoch, open, with no
  // members; a helper joins only while it is open (a CAS that counts it in), leaves when no
  // task is left; Run closes it once every task is taken and returns when no member is left.
  std::atomic<uint64_t> state_{0};
  Call call_ = nullptr;  // the open step's, written before it is published
  void* body_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};  // the next task to claim
  Mutex error_mu_;
  std::exception_ptr error_ ATTNSERVE_GUARDED_BY(error_mu_);  // the step's first exception

  std::atomic<bool> held_{false};
  std::atomic<uint32_t> holds_{0};  // Hold's count: wakes a sleeper for a forward
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  Mutex sleep_mu_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
};

}  // namespace attnserve
