// BatchingExecutor: the dynamic batcher for Forward jobs. One queue per (layer, form, device);
// a batch is the concatenation of its jobs' sequences (a ragged batch), run as one backend call
// so every projection is one GEMM over all stacked tokens; outputs land straight in each job's
// buffers. The generic queueing lives in Batcher (batcher.h), which knows nothing of attention.
// Thread-safety: Submit from any thread; `done` runs on a worker thread, or on the submitting
// thread when the job is refused; Drain from one owner thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "server/backend/backend.h"
#include "server/batching/batch_observer.h"
#include "server/batching/batcher.h"
#include "server/batching/executor.h"

namespace attnserve {

// A batch runs on exactly one set of weights: jobs queue per loaded Layer (a replaced layer and
// its successor are different objects) and form. The layer outlives its queue: every queued
// job holds it, and a queue is removed once empty.
struct ForwardQueue {
  const Layer* layer = nullptr;
  Variant variant;

  friend bool operator<(const ForwardQueue& a, const ForwardQueue& b) {
    if (a.layer != b.layer) return std::less<const Layer*>()(a.layer, b.layer);
    return a.variant < b.variant;
  }
};

// A Forward job in the batcher's queue.
class ForwardItem final : public BatchItem {
 public:
  ForwardItem(ForwardJob job, BatchObserver* observer);
  bool Cancelled() const override;
  void OnQueued() override;
  void Fail(Status status) override;
  // Leaves the queue into a batch at `when`.
  void Dequeue(Clock::time_point when);
  ForwardJob& job() { return job_; }
  // What it runs: its form in its math (Submit has set the math).
  Variant variant() const { return {job_.form, job_.math.value_or(Math::kFp32)}; }

 private:
  ForwardJob job_;
  BatchObserver* observer_;
  bool queued_ = false;  // touched under the batcher's lock or by the one thread that owns the item
};

class BatchingExecutor final : public Executor {
 public:
  BatchingExecutor(Backend* backend, BatchPolicy policy, BatchObserver* observer = nullptr);

  void Submit(ForwardJob job) override;

  // Stops taking jobs (UNAVAILABLE), runs what was accepted for at most `timeout`, fails the
  // rest with UNAVAILABLE. Returns how many were failed for lack of time.
  int Drain(std::chrono::milliseconds timeout) { return batcher_.Drain(timeout); }
  // No batch waits for company from now on (Batcher::StopWaitingForCompany): a drain's first step.
  void StopWaitingForCompany() { batcher_.StopWaitingForCompany(); }

  int QueueDepth() const { return batcher_.TotalDepth(); }
  int QueueDepth(const Layer& layer, Variant variant) const { return batcher_.QueueDepth({&layer, variant}); }

 private:
  std::string QueueName(const ForwardQueue& queue) const;
  void RunBatch(const ForwardQueue& queue, std::vector<std::unique_ptr<ForwardItem>> batch);

  Backend* const backend_;
  BatchObserver* const observer_;
  Batcher<ForwardQueue, ForwardItem> batcher_;  // last: its workers use the members above
};

}  // namespace attnserve
