// Executor: where Forward work runs, off gRPC's threads. gRPC threads receive, validate and
// Submit; compute threads only compute. This is the minimal executor (one job = one backend
// call); the dynamic batcher of docs/architecture.md §3 replaces it behind the same interface.
// Thread-safety: Submit may be called from any thread; `done` runs exactly once, on a compute
// thread, or on the submitting thread when the job is refused.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "server/backend/backend.h"
#include "server/core/forms.h"
#include "server/core/sequence.h"
#include "server/core/status.h"
#include "server/store/layer_store.h"

namespace attnserve {

// Where a job's time went, as ForwardResponse reports it.
struct JobTimings {
  int64_t queue_us = 0;        // from `enqueued` until a compute thread took the job
  int64_t compute_us = 0;      // the backend call that computed it
  int32_t batch_requests = 0;  // requests in that backend call (1 until the batcher lands)
};

struct ForwardJob {
  // Held for the whole job: an unload or replace never frees weights in use.
  std::shared_ptr<const Layer> layer;
  Form form = Form::kFactored;
  // Views over memory the submitter keeps alive until `done` has run (the request's bytes,
  // the response's output buffer).
  std::vector<Sequence> sequences;
  std::function<void(Status, JobTimings)> done;
  // Set by the submitter when the request arrived; Submit fills it when left at its default.
  std::chrono::steady_clock::time_point enqueued;
  // The client's deadline (max: none) and a probe of its cancellation: a job whose deadline
  // passed or whose client went away is dropped before compute.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::function<bool()> cancelled;
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Takes the job; calls job.done exactly once with the outcome. Never throws.
  virtual void Submit(ForwardJob job) = 0;
};

struct ThreadPoolExecutorOptions {
  // Compute threads. The CPU backend already spreads one call over its own OpenMP threads,
  // so more than one or two here oversubscribes the cores rather than adding throughput.
  int threads = 1;
  // Jobs waiting (not running) at most; beyond that Submit answers RESOURCE_EXHAUSTED at once.
  int queue_capacity = 256;
};

// N compute threads over one bounded FIFO queue; each job is one Backend::Forward.
class ThreadPoolExecutor final : public Executor {
 public:
  ThreadPoolExecutor(Backend* backend, ThreadPoolExecutorOptions options);
  ~ThreadPoolExecutor() override;  // Shutdown()

  ThreadPoolExecutor(const ThreadPoolExecutor&) = delete;
  ThreadPoolExecutor& operator=(const ThreadPoolExecutor&) = delete;

  void Submit(ForwardJob job) override;

  // Refuses later jobs (UNAVAILABLE), lets the queued ones run, joins the threads. Call it
  // from one owner thread, never from a `done` callback; calling it again does nothing.
  void Shutdown();

  // Jobs waiting now (for tests and, later, the queue_depth metric).
  int QueueDepth() const;

 private:
  void Work();
  static void Run(Backend* backend, ForwardJob& job);

  Backend* const backend_;
  const ThreadPoolExecutorOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ForwardJob> queue_;      // guarded by mu_
  bool stopping_ = false;             // guarded by mu_
  std::vector<std::thread> threads_;  // written by the constructor only
};

}  // namespace attnserve
