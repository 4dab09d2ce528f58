#include "server/batching/batcher.h"

#include <algorithm>
#include <utility>

namespace attnserve {

Batcher::Batcher(BatchPolicy policy, RunBatch run) : policy_(policy), run_(std::move(run)) {
  for (int i = 0; i < std::max(1, policy_.workers); ++i) workers_.emplace_back([this] { Work(); });
}

Batcher::~Batcher() { Drain(std::chrono::milliseconds(0)); }

Status Batcher::Enqueue(const std::string& queue, std::unique_ptr<BatchItem> item) {
  Status refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) {
      refusal = UnavailableError("server is draining: no new requests are accepted");
    } else {
      Queue& q = queues_[queue];
      if (static_cast<int>(q.items.size()) >= policy_.max_queue_requests) {
        refusal = ResourceExhaustedError("queue " + queue + " is full (" + std::to_string(q.items.size()) +
                                         " requests waiting, limit --max-queue-requests=" +
                                         std::to_string(policy_.max_queue_requests) + "); retry with backoff");
        if (q.items.empty()) queues_.erase(queue);
      } else {
        q.items.push_back(std::move(item));
        q.items.back()->OnQueued();
        ++depth_;
        cv_.notify_all();
        return OkStatus();
      }
    }
  }
  item->Fail(refusal);
  return refusal;
}

int Batcher::QueueDepth(const std::string& queue) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = queues_.find(queue);
  return it == queues_.end() ? 0 : static_cast<int>(it->second.items.size());
}

int Batcher::TotalDepth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return depth_;
}

std::map<std::string, Batcher::Queue>::iterator Batcher::OldestQueue() {
  auto oldest = queues_.end();
  for (auto it = queues_.begin(); it != queues_.end(); ++it) {
    if (it->second.items.empty()) continue;
    if (oldest == queues_.end() || it->second.items.front()->enqueued < oldest->second.items.front()->enqueued) {
      oldest = it;
    }
  }
  return oldest;
}

namespace {
constexpr std::chrono::milliseconds kDeadlineSlack(2);
}  // namespace

void Batcher::DropDead(Queue& q, std::vector<std::pair<std::unique_ptr<BatchItem>, Status>>& dead) {
  const Clock::time_point now = Clock::now();
  for (auto it = q.items.begin(); it != q.items.end();) {
    BatchItem& item = **it;
    Status why;
    // The deadline first: gRPC's IsCancelled (the server's probe) also turns true when the
    // call's deadline passes, and an expiry counted as a client's cancel misleads dashboards.
    // gRPC's timer and our steady-clock copy of the deadline differ by a little; a call found
    // cancelled within kDeadlineSlack of its deadline expired.
    if (now >= item.deadline || (item.deadline - now <= kDeadlineSlack && item.Cancelled())) {
      why = Status(StatusCode::kDeadlineExceeded, "deadline passed while queued (" +
                                                      std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(now - item.enqueued).count()) +
                                                      " us in queue); the request was not run");
    } else if (item.Cancelled()) {
      why = Status(StatusCode::kCancelled, "request cancelled by the client while queued");
    }
    if (why.ok()) {
      ++it;
      continue;
    }
    dead.emplace_back(std::move(*it), std::move(why));
    it = q.items.erase(it);
    --depth_;
  }
}

bool Batcher::Ready(const Queue& q, Clock::time_point now) const {
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

BatchItems Batcher::TakeBatch(Queue& q) {
  BatchItems batch;
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

void Batcher::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    auto it = OldestQueue();
    if (it == queues_.end()) {
      if (draining_) return;  // nothing left to run
      cv_.wait(lock);
      continue;
    }
    std::vector<std::pair<std::unique_ptr<BatchItem>, Status>> dead;
    DropDead(it->second, dead);
    if (!dead.empty()) {
      if (it->second.items.empty()) queues_.erase(it);
      cv_.notify_all();  // depth changed: a drain may be waiting for it
      lock.unlock();
      for (auto& [item, why] : dead) item->Fail(why);
      lock.lock();
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (!draining_ && !Ready(it->second, now)) {
      // Wait for the oldest item's delay to run out, or for news (a new item, a drain).
      cv_.wait_until(lock, it->second.items.front()->enqueued + policy_.max_queue_delay);
      continue;
    }
    const std::string name = it->first;
    BatchItems batch = TakeBatch(it->second);
    if (it->second.items.empty()) queues_.erase(it);
    cv_.notify_all();
    lock.unlock();
    run_(name, std::move(batch));
    lock.lock();
  }
}

int Batcher::Drain(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> drain_lock(drain_mu_);
  if (joined_) return 0;
  std::vector<std::unique_ptr<BatchItem>> left;
  {
    std::unique_lock<std::mutex> lock(mu_);
    draining_ = true;
    drain_deadline_ = Clock::now() + timeout;
    cv_.notify_all();
    cv_.wait_until(lock, drain_deadline_, [this] { return depth_ == 0; });
    for (auto& [name, q] : queues_) {
      for (auto& item : q.items) left.push_back(std::move(item));
    }
    queues_.clear();
    depth_ = 0;
    cv_.notify_all();
  }
  for (auto& item : left) {
    item->Fail(UnavailableError("server shut down before this request ran (drain timeout " +
                                std::to_string(timeout.count()) + " ms)"));
  }
  for (auto& w : workers_) w.join();
  joined_ = true;
  return static_cast<int>(left.size());
}

}  // namespace attnserve
