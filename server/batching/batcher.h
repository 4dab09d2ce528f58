// Batcher: the generic dynamic batcher. It knows nothing of attention: it keeps one bounded
// FIFO queue per key, and worker threads take batches from them under a policy (requests,
// tokens, queue delay) and hand each batch to a function. Expired and cancelled items are
// dropped before a batch is formed, so they never take a slot.
// Batcher<Key, Item>: Key is ordered (operator<) and names its queue in messages through the
// constructor's QueueName (a std::string key names itself); Item derives from BatchItem, and
// the batch function receives the items as that type.
// Thread-safety: Enqueue, QueueDepth and Drain may be called from any thread; the batch
// function runs on the batcher's worker threads; Drain must not be called from it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "server/core/spin.h"
#include "server/core/status.h"
#include "server/core/thread_annotations.h"

namespace attnserve {

using Clock = std::chrono::steady_clock;

struct BatchPolicy {
  int max_batch_requests = 32;       // a batch holds at most this many items
  int64_t max_batch_tokens = 8192;   // ... and at most this many tokens (a bigger item runs alone)
  std::chrono::microseconds max_queue_delay{1000};  // the oldest item waits at most this long
  int max_queue_requests = 256;      // per queue; beyond it Enqueue answers RESOURCE_EXHAUSTED
  int workers = 1;                   // threads taking batches (one per device stream)
  // After a batch, a worker that finds every queue empty polls them this long before it sleeps
  // (0: sleeps at once). A lone client's next request comes a round trip after the answer; a
  // worker still awake takes it without a wake-up, on a core that has not gone idle.
  std::chrono::microseconds idle_spin{0};
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

// The batcher's statuses, shared by every instantiation (batcher.cc).
Status QueueFullError(const std::string& queue, size_t waiting, int limit);
Status DrainingError();
Status DrainTimeoutError(std::chrono::milliseconds timeout);
// Why a queued item must not run at `now` (deadline passed, cancelled), or OK.
Status DeadItemStatus(const BatchItem& item, Clock::time_point now);
// Names a worker thread "batch-worker" (top -H, /proc/PID/task/TID/comm).
void NameWorker(std::thread& worker);

template <typename Key, std::derived_from<BatchItem> Item>
class Batcher {
 public:
  using Items = std::vector<std::unique_ptr<Item>>;
  // Runs one batch: every item of one queue; ends each item (the batcher does not look again).
  using RunBatch = std::function<void(const Key& queue, Items batch)>;
  // How a queue is named in messages (e.g. "layer/form/device#serial"). Runs under the
  // batcher's lock, like BatchItem::OnQueued: cheap, and no call back into the batcher.
  using QueueName = std::function<std::string(const Key& queue)>;

  // `name` may be left empty when Key is a std::string.
  Batcher(BatchPolicy policy, RunBatch run, QueueName name = {});
  ~Batcher() { Drain(std::chrono::milliseconds(0)); }
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues the item under `queue`. On refusal (queue full, draining) the item is failed here
  // with the returned status, so every item ends exactly once: through Fail or through the
  // batch function.
  Status Enqueue(const Key& queue, std::unique_ptr<Item> item);

  // Stops accepting (UNAVAILABLE), runs what is queued until `timeout` has passed, fails what
  // is left with UNAVAILABLE, joins the workers. Idempotent. Returns the number of items
  // failed because the timeout passed.
  int Drain(std::chrono::milliseconds timeout);

  // From now on no batch waits for company (max_queue_delay ends for every queue), while items
  // are still accepted: the server's drain calls it as it stops taking calls, so what its
  // accepted calls queued runs at once instead of when its delay or the drain deadline ends.
  void StopWaitingForCompany();

  int QueueDepth(const Key& queue) const;
  int TotalDepth() const;

 private:
  struct Queue {
    std::deque<std::unique_ptr<Item>> items;
  };
  using Queues = std::map<Key, Queue>;
  void Work();
  // Polls until news_ moves past `seen` (an item queued, a drain) or the policy's idle spin has
  // passed. Touches no guarded state: the worker runs it unlocked.
  void SpinForNews(uint64_t seen) const;
  // The queue whose head has waited longest, or end().
  // The queue to serve next: the one whose head batch is ready (Ready, or any while draining)
  // with the oldest front item, else the one with the oldest front item, to wait for. A queue
  // waiting out its delay never holds up another queue's ready batch.
  typename Queues::iterator NextQueue(Clock::time_point now) ATTNSERVE_REQUIRES(mu_);
  // Removes expired or cancelled items from the front part that would be batched.
  void DropDead(Queue& q, std::vector<std::pair<std::unique_ptr<Item>, Status>>& dead) ATTNSERVE_REQUIRES(mu_);
  // True when the queue's head batch should go now.
  bool Ready(const Queue& q, Clock::time_point now) const ATTNSERVE_REQUIRES(mu_);
  Items TakeBatch(Queue& q) ATTNSERVE_REQUIRES(mu_);

  const BatchPolicy policy_;
  const RunBatch run_;
  const QueueName name_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  Queues queues_ ATTNSERVE_GUARDED_BY(mu_);
  int depth_ ATTNSERVE_GUARDED_BY(mu_) = 0;
  // Moves (under mu_, its last write there) on every item queued and on Drain: what a spinning
  // worker polls; having seen it move, the worker polls for mu_ too (LockSpinning), which its
  // publisher is about to release, rather than block on it.
  std::atomic<uint64_t> news_{0};
  bool draining_ ATTNSERVE_GUARDED_BY(mu_) = false;
  bool no_delay_ ATTNSERVE_GUARDED_BY(mu_) = false;  // StopWaitingForCompany was called
  Clock::time_point drain_deadline_ ATTNSERVE_GUARDED_BY(mu_) = Clock::time_point::max();
  Mutex drain_mu_;  // one Drain at a time
  bool joined_ ATTNSERVE_GUARDED_BY(drain_mu_) = false;
  std::vector<std::thread> workers_;
};

// ---- Implementation (a template: every user instantiates it) ----

template <typename Key, std::derived_from<BatchItem> Item>
Batcher<Key, Item>::Batcher(BatchPolicy policy, RunBatch run, QueueName name)
    : policy_(policy), run_(std::move(run)), name_([&name]() -> QueueName {
        if constexpr (std::convertible_to<const Key&, std::string>) {
          if (!name) return [](const Key& key) { return std::string(key); };
        }
        return std::move(name);
      }()) {
  for (int i = 0; i < std::max(1, policy_.workers); ++i) {
    workers_.emplace_back([this] { Work(); });
    NameWorker(workers_.back());
  }
}

template <typename Key, std::derived_from<BatchItem> Item>
Status Batcher<Key, Item>::Enqueue(const Key& queue, std::unique_ptr<Item> item) {
  Status refusal;
  {
    MutexLock lock(mu_);
    if (draining_) {
      refusal = DrainingError();
    } else {
      Queue& q = queues_[queue];
      if (static_cast<int>(q.items.size()) >= policy_.max_queue_requests) {
        refusal = QueueFullError(name_(queue), q.items.size(), policy_.max_queue_requests);
        if (q.items.empty()) queues_.erase(queue);
      } else {
        q.items.push_back(std::move(item));
        q.items.back()->OnQueued();
        ++depth_;
        cv_.notify_all();
        // Last under the lock: a spinning worker takes the lock as soon as it sees this.
        news_.fetch_add(1, std::memory_order_release);
        return OkStatus();
      }
    }
  }
  item->Fail(refusal);
  return refusal;
}

template <typename Key, std::derived_from<BatchItem> Item>
int Batcher<Key, Item>::QueueDepth(const Key& queue) const {
  MutexLock lock(mu_);
  auto it = queues_.find(queue);
  return it == queues_.end() ? 0 : static_cast<int>(it->second.items.size());
}

template <typename Key, std::derived_from<BatchItem> Item>
int Batcher<Key, Item>::TotalDepth() const {
  MutexLock lock(mu_);
  return depth_;
}

template <typename Key, std::derived_from<BatchItem> Item>
typename Batcher<Key, Item>::Queues::iterator Batcher<Key, Item>::NextQueue(Clock::time_point now) {
  auto oldest = queues_.end(), oldest_ready = queues_.end();
  auto older = [](const auto& a, const auto& b) {
    return a->second.items.front()->enqueued < b->second.items.front()->enqueued;
  };
  for (auto it = queues_.begin(); it != queues_.end(); ++it) {
    if (it->second.items.empty()) continue;
    if (oldest == queues_.end() || older(it, oldest)) oldest = it;
    if ((draining_ || no_delay_ || Ready(it->second, now)) &&
        (oldest_ready == queues_.end() || older(it, oldest_ready))) {
      oldest_ready = it;
    }
  }
  return oldest_ready != queues_.end() ? oldest_ready : oldest;
}

template <typename Key, std::derived_from<BatchItem> Item>
void Batcher<Key, Item>::DropDead(Queue& q, std::vector<std::pair<std::unique_ptr<Item>, Status>>& dead) {
  const Clock::time_point now = Clock::now();
  for (auto it = q.items.begin(); it != q.items.end();) {
    Status why = DeadItemStatus(**it, now);
    if (why.ok()) {
      ++it;
      continue;
    }
    dead.emplace_back(std::move(*it), std::move(why));
    it = q.items.erase(it);
    --depth_;
  }
}

template <typename Key, std::derived_from<BatchItem> Item>
bool Batcher<Key, Item>::Ready(const Queue& q, Clock::time_point now) const {
  int count = 0;
  int64_t tokens = 0;
  for (const auto& item : q.items) {
    if (count == policy_.max_batch_requests) return true;
    if (count > 0 && tokens + item->tokens > policy_.max_batch_tokens) return true;
    ++count;
    tokens += item->tokens;
  }
  return count >= policy_.max_batch_requests || tokens >= policy_.max_batch_tokens ||
         now - q.items.front()->enqueued >= policy_.max_queue_delay;
}

template <typename Key, std::derived_from<BatchItem> Item>
typename Batcher<Key, Item>::Items Batcher<Key, Item>::TakeBatch(Queue& q) {
  Items batch;
  int64_t tokens = 0;
  while (!q.items.empty() && static_cast<int>(batch.size()) < policy_.max_batch_requests) {
    if (!batch.empty() && tokens + q.items.front()->tokens > policy_.max_batch_tokens) break;
    tokens += q.items.front()->tokens;
    batch.push_back(std::move(q.items.front()));
    q.items.pop_front();
  }
  depth_ -= static_cast<int>(batch.size());
  return batch;
}

template <typename Key, std::derived_from<BatchItem> Item>
void Batcher<Key, Item>::Work() {
  MutexLock lock(mu_);
  bool may_spin = false;  // once after each batch, not again until the next
  for (;;) {
    auto it = NextQueue(Clock::now());
    if (it == queues_.end()) {
      if (draining_) return;  // nothing left to run
      if (may_spin && policy_.idle_spin.count() > 0) {
        may_spin = false;
        const uint64_t seen = news_.load(std::memory_order_relaxed);
        lock.Unlock();
        SpinForNews(seen);
        lock.LockSpinning(kLockPolls);
        continue;  // look again under the lock: news may have come as the spin ended
      }
      cv_.wait(lock.native());
      continue;
    }
    std::vector<std::pair<std::unique_ptr<Item>, Status>> dead;
    DropDead(it->second, dead);
    if (!dead.empty()) {
      if (it->second.items.empty()) queues_.erase(it);
      cv_.notify_all();  // depth changed: a drain may be waiting for it
      lock.Unlock();
      for (auto& [item, why] : dead) item->Fail(why);
      lock.Lock();
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (!draining_ && !no_delay_ && !Ready(it->second, now)) {
      // Wait for the oldest item's delay to run out, or for news (a new item, a drain).
      cv_.wait_until(lock.native(), it->second.items.front()->enqueued + policy_.max_queue_delay);
      continue;
    }
    const Key key = it->first;
    Items batch = TakeBatch(it->second);
    if (it->second.items.empty()) queues_.erase(it);
    cv_.notify_all();
    lock.Unlock();
    run_(key, std::move(batch));
    lock.Lock();
    may_spin = true;
  }
}

template <typename Key, std::derived_from<BatchItem> Item>
void Batcher<Key, Item>::SpinForNews(uint64_t seen) const {
  const Clock::time_point until = Clock::now() + policy_.idle_spin;
  for (int polls = 1; news_.load(std::memory_order_acquire) == seen; ++polls) {
    CpuRelax();
    if (polls % kPollsPerTurn == 0) {
      YieldToReadyThreads();
      if (Clock::now() >= until) return;
    }
  }
}

template <typename Key, std::derived_from<BatchItem> Item>
void Batcher<Key, Item>::StopWaitingForCompany() {
  MutexLock lock(mu_);
  no_delay_ = true;
  news_.fetch_add(1, std::memory_order_release);
  cv_.notify_all();
}

template <typename Key, std::derived_from<BatchItem> Item>
int Batcher<Key, Item>::Drain(std::chrono::milliseconds timeout) {
  MutexLock drain_lock(drain_mu_);
  if (joined_) return 0;
  Items left;
  {
    MutexLock lock(mu_);
    draining_ = true;
    news_.fetch_add(1, std::memory_order_release);
    drain_deadline_ = Clock::now() + timeout;
    cv_.notify_all();
    cv_.wait_until(lock.native(), drain_deadline_, [this] {
      mu_.AssertHeld();  // the wait runs its predicate under the lock
      return depth_ == 0;
    });
    for (auto& [key, q] : queues_) {
      for (auto& item : q.items) left.push_back(std::move(item));
    }
    queues_.clear();
    depth_ = 0;
    cv_.notify_all();
  }
  for (auto& item : left) item->Fail(DrainTimeoutError(timeout));
  for (auto& w : workers_) w.join();
  joined_ = true;
  return static_cast<int>(left.size());
}

}  // namespace attnserve
