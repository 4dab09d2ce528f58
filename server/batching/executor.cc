#include "server/batching/executor.h"

#include <exception>
#include <new>
#include <string>
#include <utility>

namespace attnserve {
namespace {

int64_t Micros(std::chrono::steady_clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

}  // namespace

ThreadPoolExecutor::ThreadPoolExecutor(Backend* backend, ThreadPoolExecutorOptions options)
    : backend_(backend), options_(options) {
  const int threads = options_.threads < 1 ? 1 : options_.threads;
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
}

ThreadPoolExecutor::~ThreadPoolExecutor() { Shutdown(); }

void ThreadPoolExecutor::Submit(ForwardJob job) {
  if (job.enqueued == std::chrono::steady_clock::time_point()) job.enqueued = std::chrono::steady_clock::now();
  Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      refused = UnavailableError("server is shutting down");
    } else if (static_cast<int>(queue_.size()) >= options_.queue_capacity) {
      refused = ResourceExhaustedError("queue full (" + std::to_string(options_.queue_capacity) + " requests)");
    } else {
      // Submit never throws: the caller may already have handed other jobs of its call over.
      try {
        queue_.push_back(std::move(job));
      } catch (const std::bad_alloc&) {
        refused = ResourceExhaustedError("out of memory while queueing the request");
      }
    }
  }
  // `done` runs outside the lock: it may finish an RPC or submit more work.
  if (!refused.ok()) {
    job.done(std::move(refused), JobTimings{});
    return;
  }
  cv_.notify_one();
}

void ThreadPoolExecutor::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

int ThreadPoolExecutor::QueueDepth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(queue_.size());
}

void ThreadPoolExecutor::Work() {
  for (;;) {
    ForwardJob job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(backend_, job);
  }
}

void ThreadPoolExecutor::Run(Backend* backend, ForwardJob& job) {
  const auto start = std::chrono::steady_clock::now();
  JobTimings timings;
  timings.queue_us = Micros(start - job.enqueued);
  timings.batch_requests = 1;
  Status status;
  const ResidentForm* form = job.layer ? job.layer->Find(job.form) : nullptr;
  if (form == nullptr) {
    status = FailedPreconditionError("layer does not hold the " + std::string(FormName(job.form)) + " form");
  } else {
    // No exception may escape a compute thread; the backend's only expected one is bad_alloc.
    try {
      status = backend->Forward(*form, job.sequences);
    } catch (const std::bad_alloc&) {
      status = ResourceExhaustedError("out of memory while computing the " + std::string(FormName(job.form)) + " form");
    } catch (const std::exception& e) {
      status = InternalError(std::string("backend failed: ") + e.what());
    }
  }
  timings.compute_us = Micros(std::chrono::steady_clock::now() - start);
  job.done(std::move(status), timings);
}

}  // namespace attnserve
