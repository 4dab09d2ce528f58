// MemoryBudget: one server-wide byte budget for what requests hold while they are queued and
// computed (input and output, compare and shadow copies, the backend's scratch). Every request
// reserves its footprint at admission and gives it back when it is answered, so the sum of what
// admitted requests can hold never exceeds the budget, whatever arrives (docs/reliability.md).
// Weights are not in it: --max-layers and --max-layer-mb bound those.
// Thread-safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "server/core/status.h"

namespace attnserve {

class MemoryBudget {
 public:
  // Called with the bytes reserved after every change (the metrics' gauge).
  using Observer = std::function<void(int64_t reserved)>;

  // `budget_bytes` > 0; `flag` names where it came from in refusals ("--max-memory-mb").
  MemoryBudget(int64_t budget_bytes, std::string flag, Observer observer = nullptr);

  // Bytes held until destroyed (or moved from). Empty when default-made.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept : budget_(other.budget_), bytes_(other.bytes_) { other.budget_ = nullptr; }
    Reservation& operator=(Reservation&& other) noexcept;
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation() { Release(); }
    int64_t bytes() const { return budget_ == nullptr ? 0 : bytes_; }

   private:
    friend class MemoryBudget;
    Reservation(MemoryBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
    void Release();
    MemoryBudget* budget_ = nullptr;
    int64_t bytes_ = 0;
  };

  // INVALID_ARGUMENT when `bytes` exceeds the whole budget (it can never fit: not retryable),
  // RESOURCE_EXHAUSTED when it does not fit beside what is reserved now (retryable). `what`
  // says what the bytes are for, in the message.
  StatusOr<Reservation> Reserve(int64_t bytes, const std::string& what);

  int64_t budget() const { return budget_; }
  int64_t reserved() const { return reserved_.load(std::memory_order_relaxed); }

 private:
  void Release(int64_t bytes);

  const int64_t budget_;
  const std::string flag_;
  const Observer observer_;
  std::atomic<int64_t> reserved_{0};
};

// The default budget: half of the container's memory limit (cgroup v2 memory.max or v1
// memory.limit_in_bytes) when one is set, else half of the machine's physical memory. The other
// half is for the weights, the runtime and the allocator's slack.
int64_t DefaultMemoryBudgetBytes();

}  // namespace attnserve
