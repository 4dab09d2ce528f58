// Batcher: the generic dynamic batcher. It knows nothing of attention: it keeps one bounded
// FIFO queue per key, and worker threads take batches from them under a policy (requests,
// tokens, queue delay) and hand each batch to a function. Expired and cancelled items are
// dropped before a batch is formed, so they never take a slot.
// Thread-safety: Enqueue, QueueDepth and Drain may be called from any thread; the batch
// function runs on the batcher's worker threads; Drain must not be called from it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/core/status.h"

namespace attnserve {

using Clock = std::chrono::steady_clock;

struct BatchPolicy {
  int max_batch_requests = 32;       // a batch holds at most this many items
  int64_t max_batch_tokens = 8192;   // ... and at most this many tokens (a bigger item runs alone)
  std::chrono::microseconds max_queue_delay{1000};  // the oldest item waits at most this long
  int max_queue_requests = 256;      // per queue; beyond it Enqueue answers RESOURCE_EXHAUSTED
  int workers = 1;                   // threads taking batches (one per device stream)
};

// One queued unit of work. The batcher owns it from Enqueue until it is handed to the batch
// function or failed.
class BatchItem {
 public:
  virtual ~BatchItem() = default;
  // True when its client gave up; checked before the item joins a batch.
  virtual bool Cancelled() const { return false; }
  // Ends the item without running it (refused, deadline, cancel, shutdown).
  virtual void Fail(Status status) = 0;
  // Called under the batcher's lock once the item is in its queue (before any worker can take
  // it); must be cheap and must not call back into the batcher.
  virtual void OnQueued() {}

  int64_t tokens = 1;
  Clock::time_point enqueued = Clock::now();
  Clock::time_point deadline = Clock::time_point::max();
};

using BatchItems = std::vector<std::unique_ptr<BatchItem>>;

class Batcher {
 public:
  // Runs one batch: every item of one queue; ends each item (the batcher does not look again).
  using RunBatch = std::function<void(const std::string& queue, BatchItems batch)>;

  Batcher(BatchPolicy policy, RunBatch run);
  ~Batcher();  // Drain(0)
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues the item under `queue` (e.g. "layer/form/device"). On refusal (queue full,
  // draining) the item is failed here with the returned status, so every item ends exactly
  // once: through Fail or through the batch function.
  Status Enqueue(const std::string& queue, std::unique_ptr<BatchItem> item);

  // Stops accepting (UNAVAILABLE), runs what is queued until `timeout` has passed, fails what
  // is left with UNAVAILABLE, joins the workers. Idempotent. Returns the number of items
  // failed because the timeout passed.
  int Drain(std::chrono::milliseconds timeout);

  int QueueDepth(const std::string& queue) const;
  int TotalDepth() const;

 private:
  struct Queue {
    std::deque<std::unique_ptr<BatchItem>> items;
  };
  void Work();
  // Under mu_: the queue whose head has waited longest, or nullptr.
  std::map<std::string, Queue>::iterator OldestQueue();
  // Under mu_: removes expired or cancelled items from the front part that would be batched.
  void DropDead(Queue& q, std::vector<std::pair<std::unique_ptr<BatchItem>, Status>>& dead);
  // Under mu_: true when the queue's head batch should go now.
  bool Ready(const Queue& q, Clock::time_point now) const;
  BatchItems TakeBatch(Queue& q);

  const BatchPolicy policy_;
  const RunBatch run_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Queue> queues_;  // guarded by mu_
  int depth_ = 0;                        // guarded by mu_
  bool draining_ = false;                // guarded by mu_
  Clock::time_point drain_deadline_ = Clock::time_point::max();  // guarded by mu_
  bool joined_ = false;                  // guarded by drain_mu_
  std::mutex drain_mu_;
  std::vector<std::thread> workers_;
};

}  // namespace attnserve
