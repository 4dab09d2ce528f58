// BatchingExecutor: the dynamic batcher for Forward jobs. One queue per (layer, form, device);
// a batch is the concatenation of its jobs' sequences (a ragged batch), run as one backend call
// so every projection is one GEMM over all stacked tokens; outputs land straight in each job's
// buffers. The generic queueing lives in Batcher (batcher.h), which knows nothing of attention.
// Thread-safety: Submit from any thread; `done` runs on a worker thread, or on the submitting
// thread when the job is refused; Drain from one owner thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "server/backend/backend.h"
#include "server/batching/batch_observer.h"
#include "server/batching/batcher.h"
#include "server/batching/executor.h"

namespace attnserve {

class BatchingExecutor final : public Executor {
 public:
  BatchingExecutor(Backend* backend, BatchPolicy policy, BatchObserver* observer = nullptr);

  void Submit(ForwardJob job) override;

  // Stops taking jobs (UNAVAILABLE), runs what was accepted for at most `timeout`, fails the
  // rest with UNAVAILABLE. Returns how many were failed for lack of time.
  int Drain(std::chrono::milliseconds timeout) { return batcher_.Drain(timeout); }

  int QueueDepth() const { return batcher_.TotalDepth(); }
  int QueueDepth(const Layer& layer, Form form) const { return batcher_.QueueDepth(QueueName(layer, form)); }

 private:
  std::string QueueName(const Layer& layer, Form form) const;
  void RunBatch(BatchItems batch);

  Backend* const backend_;
  BatchObserver* const observer_;
  Batcher batcher_;  // last: its workers use the members above
};

}  // namespace attnserve
