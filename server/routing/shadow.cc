#include "server/routing/shadow.h"

#include <exception>
#include <future>
#include <new>
#include <span>
#include <utility>

#include "server/batching/divergence.h"

namespace attnserve {

int64_t ShadowRequest::BytesFor(const AttentionRequest& request) {
  return request.Bytes() + 2 * request.output_elements() * static_cast<int64_t>(sizeof(float));
}

ShadowRunner::ShadowRunner(Executor* executor, ShadowOptions options, RoutingObserver* observer)
    : executor_(executor), options_(options), observer_(observer), worker_([this] { Work(); }) {}

ShadowRunner::~ShadowRunner() { Shutdown(); }

bool ShadowRunner::Offer(std::string_view layer, int64_t bytes, const std::function<ShadowRequest()>& make) {
  {
    MutexLock lock(mu_);
    const bool room = !stopping_ && reserved_ < options_.queue_capacity && bytes_ + bytes <= options_.max_queue_bytes;
    if (room) {
      ++reserved_;
      bytes_ += bytes;
    }
    if (!room) {
      if (observer_ != nullptr) observer_->ShadowDropped(layer);
      return false;
    }
  }
  // The copy is made outside the lock: it is the slow part, and other offers need not wait.
  Task task;
  task.bytes = bytes;
  if (options_.budget != nullptr) {
    StatusOr<MemoryBudget::Reservation> reserved = options_.budget->Reserve(bytes, "a shadow run");
    if (!reserved.ok()) {
      {
        MutexLock lock(mu_);
        --reserved_;
        bytes_ -= bytes;
      }
      if (observer_ != nullptr) observer_->ShadowDropped(layer);
      return false;
    }
    task.reservation = std::move(reserved).value();
  }
  bool built = false;
  try {
    task.request = make();
    built = true;
  } catch (const std::exception&) {
    // Out of memory for the copy: the mirror is dropped, the primary is unaffected.
  }
  {
    MutexLock lock(mu_);
    if (built) {
      try {
        queue_.push_back(std::move(task));
      } catch (const std::bad_alloc&) {
        built = false;
      }
    }
    if (!built) {
      --reserved_;
      bytes_ -= bytes;
    }
  }
  if (!built) {
    if (observer_ != nullptr) observer_->ShadowDropped(layer);
    return false;
  }
  cv_.notify_one();
  return true;
}

void ShadowRunner::Shutdown() {
  std::deque<Task> dropped;
  {
    MutexLock lock(mu_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
    dropped.swap(queue_);
    reserved_ -= static_cast<int>(dropped.size());
    for (const Task& t : dropped) bytes_ -= t.bytes;
  }
  cv_.notify_all();
  if (observer_ != nullptr) {
    for (const Task& t : dropped) observer_->ShadowDropped(t.request.layer ? t.request.layer->name : "");
  }
  if (worker_.joinable()) worker_.join();
}

int ShadowRunner::Pending() const {
  MutexLock lock(mu_);
  return reserved_;
}

void ShadowRunner::Work() {
  for (;;) {
    Task task;
    {
      MutexLock lock(mu_);
      cv_.wait(lock.native(), [this] {
        mu_.AssertHeld();  // the wait runs its predicate under the lock
        return stopping_ || !queue_.empty();
      });
      if (queue_.empty()) return;  // stopping; Shutdown dropped the rest
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(task);
    {
      MutexLock lock(mu_);
      --reserved_;
      bytes_ -= task.bytes;
    }
  }
}

void ShadowRunner::Run(Task& task) {
  ShadowRequest& r = task.request;
  const std::string layer_name = r.layer ? r.layer->name : "";
  std::vector<float> mirror_output;
  ForwardJob job;
  std::promise<Status> done;
  try {
    mirror_output.resize(r.served_output.size());
    job.layer = r.layer;
    job.form = r.mirror.form;
    job.math = r.mirror.math;
    job.sequences = r.request.Sequences(mirror_output.data());
    job.done = [&done](Status status, JobTimings) { done.set_value(std::move(status)); };
  } catch (const std::exception&) {
    if (observer_ != nullptr) observer_->ShadowDropped(layer_name);
    return;
  }
  // One mirror at a time in the executor: the worker waits for it before taking the next.
  std::future<Status> finished = done.get_future();
  executor_->Submit(std::move(job));
  const Status status = finished.get();
  if (!status.ok()) {
    // The executor refused it (queue full, shutting down) or the form failed: nothing to compare.
    if (observer_ != nullptr) observer_->ShadowDropped(layer_name);
    return;
  }
  const DivergenceStats divergence = MeasureDivergence(r.served_output, mirror_output);
  if (observer_ != nullptr) observer_->ShadowCompared(layer_name, r.mirror, divergence);
}

}  // namespace attnserve
