#include "server/service/admin_worker.h"

#include <utility>

namespace attnserve {

AdminWorker::AdminWorker(int capacity) : capacity_(capacity), thread_([this] { Run(); }) {}

AdminWorker::~AdminWorker() {
  std::deque<Task> left;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    left.swap(tasks_);
  }
  cv_.notify_one();
  for (Task& task : left) task.refuse(UnavailableError("the server is shutting down"));
  thread_.join();
}

bool AdminWorker::Post(Task task) {
  {
    MutexLock lock(mu_);
    if (stopping_ || static_cast<int>(tasks_.size()) >= capacity_) return false;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

void AdminWorker::AbandonAll() {
  std::deque<Task> waiting;
  std::function<void(Status)> running;
  {
    MutexLock lock(mu_);
    waiting.swap(tasks_);
    running = running_refuse_;
  }
  const Status shutting_down = UnavailableError("the server is shutting down");
  for (Task& task : waiting) task.refuse(shutting_down);
  if (running) running(shutting_down);
  idle_cv_.notify_all();
}

bool AdminWorker::WaitIdle(std::chrono::steady_clock::time_point until) {
  MutexLock lock(mu_);
  return idle_cv_.wait_until(lock.native(), until, [this] {
    mu_.AssertHeld();  // the wait runs its predicate under the lock
    return tasks_.empty() && !running_;
  });
}

void AdminWorker::Run() {
  for (;;) {
    Task task;
    {
      MutexLock lock(mu_);
      cv_.wait(lock.native(), [this] {
        mu_.AssertHeld();  // the wait runs its predicate under the lock
        return stopping_ || !tasks_.empty();
      });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
      running_ = true;
      running_refuse_ = task.refuse;
    }
    if (std::chrono::steady_clock::now() >= task.deadline) {
      task.refuse(
          Status(StatusCode::kDeadlineExceeded, "the deadline passed while the call waited for earlier admin calls"));
    } else {
      task.run();
    }
    {
      MutexLock lock(mu_);
      running_ = false;
      running_refuse_ = nullptr;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace attnserve
